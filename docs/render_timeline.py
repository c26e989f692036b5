"""Render a ``commlens timeline`` file as a PNG, for the README (needs matplotlib, which commlens
itself does not use: ``pip install matplotlib``).

One row per rank and process group, a bar per collective coloured by op, a line per flow from the
first rank to arrive to the last, markers where the trace has them.

    commlens demo --world-size 4 --steps 6 --inject hang:rank=2:step=3 --out /tmp/late
    python docs/render_timeline.py /tmp/late/timeline.json docs/timeline-late-rank.png
"""

from __future__ import annotations

import collections
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def render(source: str, target: str) -> None:
    events = json.load(open(source))["traceEvents"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    rows = sorted(key for key, name in threads.items() if name != "steps")
    row = {key: i for i, key in enumerate(rows)}
    colours = dict(zip(sorted({e["name"] for e in events if e.get("cat") == "collective"}), plt.cm.tab10.colors))
    figure, axes = plt.subplots(figsize=(14, 0.45 * len(rows) + 1.6))
    for e in events:
        if e.get("cat") == "collective":
            axes.barh(row[(e["pid"], e["tid"])], e["dur"] / 1e3, left=e["ts"] / 1e3, height=0.6,
                      color=colours[e["name"]], edgecolor="none")
    flows = collections.defaultdict(list)
    for e in events:
        if e["ph"] in "stf":
            flows[e["id"]].append(e)
    for members in flows.values():
        first, last = members[0], members[-1]
        axes.plot([first["ts"] / 1e3, last["ts"] / 1e3], [row[(first["pid"], first["tid"])], row[(last["pid"], last["tid"])]],
                  color="grey", linewidth=0.5, alpha=0.6)
    for e in events:
        if e["ph"] == "i":
            y = row.get((e["pid"], e.get("tid")), None)
            ys = [y] if y is not None else [i for (pid, _), i in row.items() if pid == e["pid"]]
            marker, colour = ("v", "red") if e.get("cat") == "verdict" else ("o", "orange")
            axes.scatter([e["ts"] / 1e3] * len(ys), ys, marker=marker, color=colour, s=60, zorder=3,
                         label=e["name"])
    axes.set_yticks(range(len(rows)), [f"rank {pid} · {threads[(pid, tid)]}" for pid, tid in rows])
    axes.invert_yaxis()
    axes.set_xlabel("ms since the first collective")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    labels = list(colours)
    for handle, label in zip(*axes.get_legend_handles_labels()):
        if label not in labels:
            handles.append(handle)
            labels.append(label)
    axes.legend(handles, labels, loc="upper left", fontsize=8, ncol=len(labels))
    axes.set_title("commlens timeline: collectives per rank; grey lines join a collective's first and last arrival")
    figure.tight_layout()
    figure.savefig(target, dpi=110)


if __name__ == "__main__":
    render(*sys.argv[1:3])
