"""``commlens timeline`` and ``commlens report`` on ordinary training scripts with a fault written into
them, run under ``commlens run`` (4 gloo ranks): the trace-event file a user opens in Perfetto or
chrome://tracing, and the page a user opens in a browser (Debian's Chromium, headless)."""

import collections
import html
import json
import pathlib
import pickle
import shutil
import subprocess
import sys

import pytest

from commlens.agent.verdicts.readers import spans_in
from monitoring import STARTUP_S, TrainingJob

WORLD = 4


def _job(tmp_path, fault, rank=2, extra=()) -> pathlib.Path:
    """The folder of a finished 4-rank job of 30 steps, ``fault`` on ``rank`` from step 5."""
    tmp_path.mkdir(exist_ok=True)
    with TrainingJob(tmp_path, WORLD, fault, rank=rank, step=5, steps=30, extra=extra) as training:
        assert training.wait(STARTUP_S) == 0  # its start-up and 30 steps
    return training.out


@pytest.fixture(scope="module")
def nan_job(tmp_path_factory) -> pathlib.Path:
    """A job whose rank 1 puts a NaN into its gradients at step 5: run once, read by the tests of its
    group (one pytest-xdist worker), each from its own copy."""
    return _job(tmp_path_factory.mktemp("nan"), "nan", rank=1)


ON_THE_NAN_JOBS_WORKER = pytest.mark.xdist_group("timeline-nan-job")


def _timeline(out):
    done = subprocess.run([sys.executable, "-m", "commlens.agent.cli", "timeline", str(out)],
                          capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith(f"timeline: {out / 'timeline.json'} "), done
    document = json.loads((out / "timeline.json").read_text())
    recorded = {(int(a["commlens.rank"]), a["commlens.pg.name"], int(a["commlens.seq"]))
                for _, a in spans_in(str(out)) if not a.get("commlens.p2p")}
    return document["traceEvents"], recorded


def _check_structure(events, recorded):
    for event in events:
        assert event["ph"] in "XstfiM" and isinstance(event["pid"], int), event
        if event["ph"] != "M":
            assert isinstance(event["ts"], float) and event["ts"] >= 0, event
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {f"rank {r}" for r in range(WORLD)}
    slices = [(e["pid"], e["args"]["group"], e["args"]["seq"]) for e in events if e.get("cat") == "collective"]
    assert len(slices) == len(set(slices)) and set(slices) == recorded  # one slice per recorded collective per rank
    flows = collections.defaultdict(list)
    for e in events:
        if e["ph"] in "stf":
            flows[e["id"]].append(e)
    by_collective = collections.defaultdict(set)
    for pid, group, seq in slices:
        by_collective[(group, seq)].add(pid)
    tracks = {(e["pid"], e["tid"]): e["args"]["name"].removeprefix("group ") for e in events
              if e["ph"] == "M" and e["name"] == "thread_name"}
    joined = {}
    for members in flows.values():
        assert [e["ph"] for e in members] == ["s"] + ["t"] * (len(members) - 2) + ["f"]
        assert [e["ts"] for e in members] == sorted(e["ts"] for e in members)  # first arrival to last
        [group] = {tracks[(e["pid"], e["tid"])] for e in members}
        [seq] = {int(e["name"].rsplit(" seq ", 1)[1]) for e in members}
        joined[(group, seq)] = {e["pid"] for e in members}
    # every (group, seq) recorded on more than one rank has one arrow, through exactly its ranks
    assert len(joined) == len(flows)
    assert joined == {key: ranks for key, ranks in by_collective.items() if len(ranks) > 1}
    return flows


def _skewed(out: pathlib.Path, to: pathlib.Path, ranks: set[int], offset_ns: int) -> pathlib.Path:
    """A copy of the job's folder whose ``ranks``' span times read ``offset_ns`` more: their node's clock."""
    shutil.copytree(out, to)
    for path in to.glob("*.jsonl"):
        lines = []
        for line in path.read_text().splitlines():
            document = json.loads(line)
            for spans in document["resourceSpans"]:
                for span in (span for scope in spans["scopeSpans"] for span in scope["spans"]):
                    rank = next(int(a["value"]["intValue"]) for a in span["attributes"] if a["key"] == "commlens.rank")
                    if rank in ranks:
                        for key in ("startTimeUnixNano", "endTimeUnixNano"):
                            span[key] = str(int(span[key]) + offset_ns)
            lines.append(json.dumps(document))
        path.write_text("\n".join(lines) + "\n")
    return to


def _verdict(folder: pathlib.Path) -> str:
    done = subprocess.run([sys.executable, "-m", "commlens.agent.cli", "diagnose", str(folder)], capture_output=True,
                          text=True, timeout=60)
    return done.stdout


def test_a_straggler_is_named_the_same_when_its_nodes_clock_is_off(tmp_path):
    """Rank 2 arrives late at every step; its node's clock reads 40 s behind the others' (ranks 2 and 3's
    span times, as on a host whose clock drifted): ``commlens diagnose`` on the job's files says the
    same, the ranks' clocks aligned from the ends of the collectives they share (ranks complete a
    collective together). About 30 s: a job of its own."""
    out = _job(tmp_path, "slow")
    verdict = _verdict(out)
    assert "straggler: rank 2 " in verdict, verdict
    skewed = _verdict(_skewed(out, tmp_path / "skewed", {2, 3}, -40 * 10**9))
    # the same findings (what they measure may differ in its last digit: the clocks aligned to within a ms)
    assert [line.partition(" — ")[0] for line in skewed.splitlines()] == \
        [line.partition(" — ")[0] for line in verdict.splitlines()], skewed


def test_a_late_ranks_timeline_joins_every_collective_across_ranks_and_its_arrows_end_on_the_late_rank(tmp_path):
    """Rank 2 is late at step 5; rank 0 started 5 s after the others (its first collective, DDP's, waited
    for past the hang threshold): the job's start-up, not a fault, and not in the verdict."""
    events, recorded = _timeline(_job(tmp_path, "late", extra=["--slow-start", "0"]))
    flows = _check_structure(events, recorded)
    [verdict] = [e for e in events if e.get("cat") == "verdict"]
    assert verdict["name"] == "verdict: late rank" and verdict["pid"] == 2, verdict
    group, seq = verdict["args"]["verdict"].split("(group ")[1].split(")")[0].split(", seq ")
    late = [members for members in flows.values() if members[0]["name"].endswith(f"seq {seq}")
            and any(e["pid"] == 2 for e in members)]
    assert late and all(members[-1]["pid"] == 2 for members in late)  # the late rank arrives last
    assert any(e["name"] == "hang" for e in events if e["ph"] == "i")


@ON_THE_NAN_JOBS_WORKER
def test_the_nan_origin_is_marked_on_its_rank_and_a_healthy_jobs_timeline_holds_no_marker(tmp_path, nan_job):
    events, recorded = _timeline(shutil.copytree(nan_job, tmp_path / "nan"))
    _check_structure(events, recorded)
    origin = [e for e in events if e.get("cat") == "verdict"]
    assert [(e["name"], e["pid"]) for e in origin] == [("verdict: nan origin", 1)], origin
    assert any(e["name"] == "NaN" and e["pid"] == 1 for e in events if e.get("cat") == "anomaly")

    events, recorded = _timeline(_job(tmp_path / "none", "none"))
    _check_structure(events, recorded)
    assert [e for e in events if e["ph"] == "i"] == []


@pytest.mark.parametrize("argv, error", [
    (["--last", "soon"], "'soon' is not accepted: give a duration such as 30s"),
    (["--steps", "5:2"], "'5:2' is not accepted: give A:B with A < B"),
])
def test_a_bad_window_is_refused_naming_what_is_accepted(tmp_path, argv, error):
    done = subprocess.run([sys.executable, "-m", "commlens.agent.cli", "timeline", str(tmp_path), *argv],
                          capture_output=True, text=True)
    assert done.returncode == 2 and error in done.stderr, done.stderr


@ON_THE_NAN_JOBS_WORKER
def test_damaged_files_are_named_and_skipped_and_a_folder_without_telemetry_is_refused(tmp_path, nan_job):
    """A corrupt trace line and a file that is no dump: each named in one line, the rest still read,
    so the verdict stands. A folder with no telemetry: both commands say so and exit 2, never
    "nothing wrong found"."""
    out = shutil.copytree(nan_job, tmp_path / "job")
    [first, *_] = sorted(out.glob("*.jsonl"))
    with open(first, "ab") as f:
        f.write(b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"attributes": 7}]}]}]}\n{"cut off\n\xff\xfe\n')
    (out / "rank_9").write_bytes(b"not a pickle")
    (out / "rank_8").write_bytes(pickle.dumps({"entries": [1, 2]}))  # a dump's shape, not its entries
    (out / "spans.jsonl").mkdir()
    lines = {}
    for command in ("diagnose", "timeline", "report"):
        done = subprocess.run([sys.executable, "-m", "commlens.agent.cli", command, str(out)],
                              capture_output=True, text=True, timeout=120)
        lines[command] = done.stdout
        skipped = [line for line in done.stderr.splitlines() if line.startswith("commlens: skipped ")]
        assert len(skipped) == 6 and all(str(out) in line for line in skipped), done.stderr
        assert "Traceback" not in done.stderr, done.stderr
        assert len([line for line in skipped if f"{first}, line " in line and "not an OTLP JSON line" in line]) == 3
        assert [line for line in skipped if "rank_9 is not a flight-recorder dump" in line]
        assert [line for line in skipped if "rank_8 is not a flight-recorder dump: entry 0 is not a collective's" in line]
        assert [line for line in skipped if "spans.jsonl: cannot be read (Is a directory)" in line]
    assert lines["diagnose"].startswith("NaN/Inf entered on rank 1 in all_reduce"), lines
    unread = [line for line in lines["diagnose"].splitlines() if line.startswith("not read: ")]
    assert len(unread) == 6 and "rank_9 is not a flight-recorder dump" in unread[-2] + unread[-1], lines  # in the verdict too
    assert "not read: " in (out / "report.html").read_text()
    assert lines["timeline"].startswith("timeline: ") and lines["report"].startswith("report: "), lines
    partial = shutil.copytree(nan_job, tmp_path / "partial")
    for path in partial.glob("*-2.jsonl"):
        path.unlink()  # a rank whose files never came: its node's disk, a copy cut short
    done = subprocess.run([sys.executable, "-m", "commlens.agent.cli", "diagnose", str(partial)],
                          capture_output=True, text=True, timeout=120)
    assert f"not read: rank 2 of the job's {WORLD}: nothing of it in {partial} (no span, no dump)" in done.stdout, done
    (tmp_path / "empty").mkdir()
    for command in ("diagnose", "timeline", "report"):
        done = subprocess.run([sys.executable, "-m", "commlens.agent.cli", command, str(tmp_path / "empty")],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 3 and f"no telemetry in {tmp_path / 'empty'}" in done.stderr, done
        assert "nothing wrong" not in done.stdout and not list((tmp_path / "empty").iterdir())


def test_a_folder_of_dumps_alone_gets_the_report_of_their_verdict(tmp_path):
    """Where a collector took the spans, the job's folder holds its dumps only: the report gives their
    verdict and says why there is no timeline. Three ranks' dumps of one all_reduce, rank 1's input
    the wrong size."""
    for rank in range(3):
        entry = {"process_group": ["0", "default_pg"], "collective_seq_id": 7, "profiling_name": "gloo:all_reduce",
                 "input_dtypes": ["Float"], "input_sizes": [[8 if rank == 1 else 4]], "state": "started"}
        (tmp_path / f"rank_{rank}").write_bytes(pickle.dumps({"version": "2.10", "entries": [entry]}))
    done = subprocess.run([sys.executable, "-m", "commlens.agent.cli", "report", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done
    page = (tmp_path / "report.html").read_text()
    assert "no spans in the folder (a collector took them, or the trace files went elsewhere)" in page and "<h2>Timeline</h2>" not in page, page
    assert "id=verdict>size mismatch: rank 1 in all_reduce (group 0, seq 7)" in page, page


@ON_THE_NAN_JOBS_WORKER
def test_the_report_opens_from_disk_in_a_browser_without_error_and_shows_the_verdict(tmp_path, nan_job):
    """``commlens report`` writes one page into the job's folder; headless Chromium opens it from disk
    (no server, no network): no console message, and the page shows ``commlens diagnose``'s verdict,
    every rank's lane and row, and the NaN among the anomalies."""
    out = shutil.copytree(nan_job, tmp_path / "job")
    done = subprocess.run([sys.executable, "-m", "commlens.agent.cli", "report", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith(f"report: {out / 'report.html'} "), done
    verdict = subprocess.run([sys.executable, "-m", "commlens.agent.cli", "diagnose", str(out)],
                             capture_output=True, text=True, timeout=120).stdout.splitlines()[0]
    assert verdict.startswith("NaN/Inf entered on rank 1 "), verdict
    browser = shutil.which("chromium")
    assert browser, "the report's test needs Debian's chromium (apt-get install chromium)"
    shown = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
                            "--v=0", "--dump-dom", (out / "report.html").as_uri()],
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert not [line for line in shown.stderr.splitlines() if ":CONSOLE" in line], shown.stderr
    page = shown.stdout
    assert f'id="verdict">{html.escape(verdict, quote=False)}</div>' in page, page[:3000]
    assert all(f">rank {rank}</text>" in page and f"<tr><td>{rank}</td>" in page for rank in range(WORLD)), page
    assert '<td class="text">NaN' in page, page
    assert "of which waiting for others" in page and 'aria-label="latency distribution of all_reduce in group 0"' \
        in page, page
