"""The verdicts: what kinds there are (``catalogue``, with their alert rules in ``rules/``), a verdict
(``Finding``), and the detectors that find them in ranks' facts (``findings``; docs/verdicts.md).

Example::

    for finding in findings(readers.from_files("./commlens-out/job-7")):
        print(finding.line())
"""

from .detectors import findings
from .finding import Finding

__all__ = ["Finding", "findings"]
