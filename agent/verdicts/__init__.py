"""The verdicts: what kinds there are (``catalogue``, with their alert rules in ``rules/`` and their
scrape-interval forms in ``rule_files``), a verdict (``Finding``), the detectors that find them in ranks'
facts (``facts``, ``findings``; docs/verdicts.md), the readers that build those facts from files,
endpoints and Prometheus (``readers``), and what a person reads: ``diagnose``, ``timeline``, ``report``.

Example::

    for finding in findings(readers.from_files("./commlens-out/job-7")):
        print(finding.line())
"""

from .detectors import findings
from .finding import Finding

__all__ = ["Finding", "findings"]
