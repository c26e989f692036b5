"""The catalogue: each kind of verdict once — its precedence, its title, the alert rules that find it
live (PromQL, ``rules/<kind>.yaml``) and, through their names, their runbooks (``docs/runbooks.md``).
``detectors/`` finds the same kinds in ranks' facts; ``deploy/prometheus-rules.yaml`` is built from
``rules/`` (``rules_text``, by ``python deploy/build.py``).

Adding a kind: a ``Kind`` in ``KINDS``, its detector in ``detectors/``, its rules in
``rules/<name>.yaml``, a runbook section per alert, and its tests.

Example::

    KIND["late_rank"].alerts      # ('CommlensRankLate', 'CommlensPeerLate')
"""

from __future__ import annotations

import dataclasses
import pathlib
import textwrap

RULES = pathlib.Path(__file__).resolve().parent / "rules"
"""The PromQL: a file per kind of its alerts (and the records only they read), and ``EVIDENCE``'s."""


@dataclasses.dataclass(frozen=True)
class Kind:
    name: str
    """``Finding.kind``; its alert rules are ``rules/<name>.yaml``."""
    title: str
    """How a finding of it starts when printed (``Finding.line``)."""
    alerts: tuple[str, ...] = ()
    """The alerts that name its culprit live; none: it is found after the fact only."""


KINDS = (
    Kind("nan_origin", "NaN/Inf entered on", ("CommlensNaNOrigin",)),
    Kind("replica_mismatch", "corrupted result:", ("CommlensReplicaMismatch",)),
    Kind("diverging_input", "diverging input:", ("CommlensInputDiverging",)),
    Kind("node_unreachable", "unreachable:", ("CommlensNodeUnreachable",)),
    Kind("node_slow", "slow node:", ("CommlensNodeSlow",)),
    Kind("network_slow", "the network is slow, no rank is late:", ("CommlensNetworkSlow",)),
    Kind("lost_rank", "killed or crashed:", ("CommlensRankKilled",)),
    Kind("desync", "desync:", ("CommlensCollectiveDesync",)),
    Kind("size_mismatch", "size mismatch:", ("CommlensCollectiveMismatch",)),
    Kind("late_rank", "late or missing:", ("CommlensRankLate", "CommlensPeerLate")),
    Kind("deadlock", "deadlock: waiting on each other,", ("CommlensDeadlock",)),
    Kind("hang", "hang: all waiting,", ("CommlensCollectiveHung",)),
    Kind("stall", "stall:"),
    Kind("straggler", "straggler:", ("CommlensStraggler",)),
)
"""Every kind, in precedence: the most severe first, as ``diagnose`` lists them."""
KIND = {kind.name: kind for kind in KINDS}
VERDICT_ALERTS = tuple(alert for kind in KINDS for alert in kind.alerts)
"""The alerts that name a culprit (a rank, a node, the network)."""

HEALTH = ("CommlensBusBandwidthDrop", "CommlensLossScaleSkipping", "CommlensRingRecordsDropped", "CommlensSpansLost",
          "CommlensTargetDown")
"""The alerts (``rules/health.yaml``) on a job's health and on commlens' own losses: no verdict, no culprit."""
EVIDENCE = ("waits", "arrivals")
"""``rules/`` files of records that several kinds read: who waits, where, on whom; who arrives last."""
_HEADER = """\
# commlens alert rules: load with Prometheus' rule_files, or as the PrometheusRule in deploy/kubernetes.
# Built by deploy/build.py from agent/verdicts/rules (a file per kind of verdict: agent/verdicts/catalogue.py);
# do not edit. Unit tests: promtool test rules deploy/prometheus-rules.test.yaml deploy/prometheus-rules.slow.test.yaml
#
# Written for scrapes of 2 s or less: `commlens assets --scrape-interval 30s DIR` writes them for another
# interval (deploy/kubernetes holds them at its PodMonitor's 15 s).
#
# Series are keyed by Prometheus' `job` label (one training job: the PodMonitor sets it from the pod's
# batch.kubernetes.io/job-name label), the process group `pg` and the `rank`.
groups:
"""


def rules_text() -> str:
    """The text of ``deploy/prometheus-rules.yaml``: the recording groups, then one group of the alerts
    and the records they read — ``EVIDENCE`` first, then each kind's in precedence, then ``HEALTH`` —
    evaluated in that order, so that a rule reads the records of the same evaluation."""
    parts = [*EVIDENCE, *(kind.name for kind in KINDS if kind.alerts), "health"]
    rules = "\n".join(textwrap.indent((RULES / f"{part}.yaml").read_text(), " " * 6) for part in parts)
    return (_HEADER + textwrap.indent((RULES / "recording.yaml").read_text(), "  ")
            + "\n  - name: commlens.alerts\n    rules:\n" + rules)
