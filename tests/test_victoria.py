"""The shipped rules past one Prometheus: two vmagents sharing the targets, VictoriaMetrics, vmalert
(``bench/victoria.py``, on ``bench/scale.py``'s simulated job at a small size): every alert names its
culprit and only it, and ``commlens diagnose --prometheus`` reads the verdict back through
VictoriaMetrics' Prometheus API. About 80 s, most of it waiting: the template job's two ranks, then the
stack at a 2 s interval until the straggler's 20 s windows fill and every alert's `for` has passed (a
shorter interval would not be the scrape vmagents run); marked long and bench (CI runs it once)."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "bench"))

from victoria import EXPECTED, measure  # noqa: E402
from scale import template  # noqa: E402

pytestmark = [pytest.mark.bench, pytest.mark.long]


def test_vmalert_over_sharded_vmagents_names_each_culprit_and_diagnose_reads_it_back(tmp_path):
    result = measure(template(), ranks=264, agents=2, out=tmp_path, interval_s=2)
    assert all(result["verdicts"].values()), result["named"]
    assert set(result["named"]) == set(EXPECTED), result["named"]  # no other alert fired
    late = result["faulty"]["late"].split("/")[1]
    assert f"rank {late}" in result["diagnose"], result["diagnose"]
    assert all(seconds > 0 for seconds in result["evaluation"].values()), result["evaluation"]
