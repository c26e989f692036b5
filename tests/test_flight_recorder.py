"""Flight-recorder dumps, read by PyTorch's own analyzer (torchfrtrace)."""

import json
import pickle
import subprocess

import pytest
import torch
import torch.distributed as dist

import commlens.hooks as ch
from commlens.agent.cli.demo import Fault, run
from commlens.hooks import native


def analyzer_output(folder):
    done = subprocess.run(["torchfrtrace", str(folder)], capture_output=True, text=True)
    return done.returncode, done.stdout + done.stderr


def test_a_clean_four_rank_run_analyzes_without_errors(tmp_path):
    outcome = run(4, 5, str(tmp_path))
    assert outcome.analyzer.returncode == 0
    code, out = analyzer_output(tmp_path)
    assert code == 0 and out.strip() == "", out  # nothing: not even "tabulate is not installed"
    dump = pickle.loads((tmp_path / "rank_0").read_bytes())
    assert dump["version"] == "2.10" and dump["pg_config"]["0"]["ranks"] == "[0, 1, 2, 3]"
    entries = dump["entries"]
    assert {e["state"] for e in entries} == {"completed"}
    assert all(e["duration_ms"] >= 0 and e["time_discovered_completed_ns"] >= e["time_created_ns"] for e in entries)
    seqs = [e["collective_seq_id"] for e in entries]
    names = {e["profiling_name"] for e in entries}
    if native.AVAILABLE:  # PyTorch's process-group hooks: DDP's C++ collectives too, so no gaps
        assert seqs == list(range(1, len(seqs) + 1)) and len(seqs) > 3 * 5 + 1
        assert {"gloo:broadcast", "gloo:all_reduce", "gloo:barrier"} <= names
    else:  # 3 recorded per step and a barrier; the gaps are DDP's own C++ collectives (construction, bucket rebuild)
        assert seqs == sorted(set(seqs)) and len(seqs) == 3 * 5 + 1
        assert names == {"gloo:broadcast", "gloo:all_reduce", "gloo:barrier"}


@pytest.mark.parametrize("kind, expected", [
    ("desync", "Culprit rank 2; Error type: COLLECTIVE_TYPE_MISMATCH"),
    ("size", "Culprit rank 2; Error type: SIZE_OR_SYNTAX_MISMATCH"),
    ("skip", "missing ranks: {2}"),
])
def test_the_analyzer_names_the_rank_that_went_wrong(tmp_path, kind, expected):
    analyzer = run(4, 5, str(tmp_path), (Fault(kind, rank=2, step=2),)).analyzer  # torchfrtrace, run by the demo
    out = analyzer.stdout + analyzer.stderr
    assert expected in out, out


def record_and_dump(rank, world_size, prefix):
    import os

    os.environ["TORCHCOMM_FR_DUMP_TEMP_FILE"] = prefix
    ch.instrument()
    empty = ch.FlightRecorderHook(max_entries=8)
    empty_dump = empty.dump()
    recorder = ch.FlightRecorderHook(max_entries=3).register_with_comm()
    for _ in range(5):
        dist.all_reduce(torch.ones(2))
    recorder.unregister()
    dist.all_reduce(torch.ones(2))
    os.environ["TORCHCOMM_FR_DUMP_TEMP_FILE"] = "/proc/no-such-dir/rank_"
    with pytest.raises(OSError) as refused:
        recorder.dump_file(rank)
    os.environ["TORCHCOMM_FR_DUMP_TEMP_FILE"] = prefix
    path = recorder.dump_file(rank=rank)  # as torchcomms' examples call it
    with pytest.raises(ValueError, match="max_entries=0 is not accepted"):
        ch.FlightRecorderHook(max_entries=0)
    with pytest.raises(ValueError, match="COMMLENS_RING_SLOTS"):
        ch.FlightRecorderHook(max_entries=1 << 20)
    return {"empty": empty_dump, "empty_json": empty.dump_json(), "json": json.loads(recorder.dump_json()),
            "path": path, "refused": str(refused.value), "dump": pickle.loads(open(path, "rb").read())}


def test_recorder_keeps_its_window_and_reports_bad_input_clearly(run_ranks, tmp_path):
    for rank, r in enumerate(run_ranks(record_and_dump, 2, prefix=str(tmp_path / "dumps" / "rank_"))):
        assert r["empty"]["entries"] == [] and '"entries": []' in r["empty_json"]
        assert "/proc/no-such-dir/rank_" in r["refused"] and "TORCHCOMM_FR_DUMP_TEMP_FILE" in r["refused"]
        assert r["path"].endswith(f"dumps/rank_{rank}")
        entries = r["dump"]["entries"]
        assert [e["collective_seq_id"] for e in entries] == [3, 4, 5]  # the last 3 of 5; not the 6th
        assert [e["collective_seq_id"] for e in r["json"]["entries"]] == [3, 4, 5]  # dump_json: the same, as text
