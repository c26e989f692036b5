"""The agent-cost benchmark runs every configuration on every workload (its quick mode; no timing is
judged here: the figures come from full runs, reported in the README)."""

import pathlib
import subprocess
import sys

BENCH = pathlib.Path(__file__).resolve().parent.parent / "bench" / "agent_cost.py"


def test_the_agent_cost_benchmark_measures_every_configuration_on_every_workload():
    sys.path.insert(0, str(BENCH.parent))
    from agent_cost import CONFIGS, WORKLOADS

    done = subprocess.run([sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()[1:]
    rows = {}
    for row in (line.split() for line in lines if "NaN check" not in line):
        # workload, config, ratio "min - median - max", commlens, +training and sidecar µs per collective
        rows[(" ".join(row[:-9]), row[-9])] = [float(row[i]) for i in (-8, -6, -4, -3, -2, -1)]
    assert set(rows) == {(w, c) for w in WORKLOADS for c in CONFIGS}, sorted(rows)
    assert all(values[0] > 0 for values in rows.values())
    assert all(rows[(w, "none")][:3] == [1.0, 1.0, 1.0] for w in WORKLOADS)  # each trial paired with itself
    nan_lines = [line for line in lines if "NaN check" in line]
    assert len(nan_lines) == sum(1 for elements, _ in WORKLOADS.values() if elements is not None)
