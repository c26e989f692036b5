"""The verdict matrix (``bench/detection.py --matrix``): its cells, the culprits' positions, and cells run
end to end by ``run_cell`` — by default ``SAMPLE``; ``COMMLENS_MATRIX_CELLS`` (comma-separated
``layout:fault:mode[:culprit][:precision][:wWORLD]``) runs those instead, each a test that passes where
the alerts, ``diagnose --prometheus`` and ``diagnose`` on the job's folder name the culprit and only it:

    COMMLENS_MATRIX_CELLS=tp-pp-dp:nan:pod:6,ddp:leave:per-rank:2:w4 python3 -m pytest -n 0 tests/test_matrix.py
"""

import os
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "bench"))

from detection import EXPECTED, LAYOUTS, Cell, positions, run_cell  # noqa: E402

SAMPLE = ("tp-pp-dp:nan:pod:6", "tp-pp-dp:kill:per-rank:3", "ddp:leave:per-rank:2:w4", "fsdp:none:per-rank")
"""What CI runs of the matrix (20 s to a minute each), none on rank 1: in an 8-rank TP x PP x DP job, a
NaN sent back over the pipeline by a last stage (the ranks it reached through a recv and through their
pair's all_reduce are no origin), and a rank killed with the in-process agent; a rank of a 4-rank DDP
job leaving its loop while a peer still waits in the previous collective (gloo's broadcast relays
through the rank that left); and an FSDP2 job healthy (the in-process agents': ``test_verdicts.py``'s
long healthy run has pod sidecars). The whole matrix: ``python bench/detection.py --matrix``."""
CELLS = os.environ["COMMLENS_MATRIX_CELLS"].split(",") if os.environ.get("COMMLENS_MATRIX_CELLS") else SAMPLE


def test_the_culprits_positions_cover_every_place_in_each_layout():
    """First and last pipeline stage, either TP member, either replica, and rank 0."""
    assert positions("tp-pp-dp", 8) == {0: "first stage, TP 0, replica 0", 3: "last stage, TP 1, replica 0",
                                        5: "first stage, TP 1, replica 1", 6: "last stage, TP 0, replica 1"}
    assert positions("pp4", 4) == {0: "first stage, replica 0", 1: "stage 1, replica 0", 2: "stage 2, replica 0",
                                   3: "last stage, replica 0"}
    assert positions("tp-dp", 4) == {0: "TP 0, replica 0", 1: "TP 1, replica 0", 2: "TP 0, replica 1",
                                     3: "TP 1, replica 1"}
    assert sorted(positions("ddp", 4)) == [0, 1, 2, 3]


def test_a_cell_is_parsed_and_its_culprit_drawn_with_the_seed():
    assert Cell.parse("tp-pp-dp:nan:pod:5") == Cell("tp-pp-dp", "nan", "pod", 5)
    assert Cell.parse("ddp:leave:per-rank:2:w4") == Cell("ddp", "leave", "per-rank", 2, world=4)
    assert Cell.parse("tp-pp-dp:none:pod:bf16") == Cell("tp-pp-dp", "none", "pod", None, "bf16")
    drawn = {Cell.parse("tp-pp-dp:kill:per-rank", seed).culprit for seed in range(40)}
    assert drawn == set(positions("tp-pp-dp", 8))  # every position, over seeds
    assert Cell.parse("pp4:late:pod", 7) == Cell.parse("pp4:late:pod:*", 7)  # the same seed, the same draw
    assert str(Cell.parse("ddp:leave:per-rank:2:w4")) == "ddp:leave:per-rank:2:w4"
    with pytest.raises(ValueError, match="give layout"):
        Cell.parse("ddp:explode:pod")
    with pytest.raises(ValueError, match="culprit '3' is not a rank of the job: give 0 to 2"):
        Cell.parse("ddp:slow-data:per-rank:3")  # the layout's 3 ranks
    assert set(EXPECTED) >= {"none", "nan", "kill"} and set(LAYOUTS) == {"ddp", "fsdp", "tp-dp", "tp-pp-dp", "pp4"}


@pytest.mark.long
@pytest.mark.bench  # the matrix is the bench's: its cells run under one torch in CI, as the matrix does
@pytest.mark.parametrize("text", CELLS)
def test_the_cell_names_its_culprit_and_only_it(tmp_path, text):
    """A healthy cell: nothing named by any reader. A faulty one: the culprit alone, by every reader that
    must name it (a one-off stall: after the fact), and its alert fired."""
    result = run_cell(tmp_path, Cell.parse(text))
    assert result.ok, (f"{result.cell}: named by alerts {sorted(result.by_alerts)}, live {sorted(result.by_live)}, "
                       f"offline {sorted(result.by_offline)}; alerts fired: {result.alerts}; live: {result.live}; "
                       f"offline: {result.offline}")
