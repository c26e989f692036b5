"""Healthy DDP jobs watched for a false alert of the replica checks (and any other): the matrix's DDP job
(``tests/matrix_train.py``, 3 gloo ranks, each its own data and its own dropout draw) under ``commlens run``
with the pod sidecar, Prometheus on the shipped rules, for ``--minutes`` each, in fp32, bfloat16 autocast
and float16 with a GradScaler (its overflows: non-finite buckets, then a smaller scale), and a bfloat16
model (``bf16-params``: DDP's buckets themselves bfloat16, as autocast's are not); every
fifth collective's result fingerprinted (``COMMLENS_FINGERPRINT_EVERY``; the default, 61, compares fewer)
and every DDP bucket's scale followed. Goal: no alert fires, and ``diagnose`` live and on the job's files
find nothing.

    python bench/replica_soak.py [--minutes 10] [--precisions fp32,bf16,fp16,bf16-params]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from detection import Cell, run_cell  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--precisions", default="fp32,bf16,fp16,bf16-params")
    args = parser.parse_args()
    os.environ["COMMLENS_FINGERPRINT_EVERY"] = "5"
    failed = 0
    for precision in args.precisions.split(","):
        model = ("--params", "bf16") if precision == "bf16-params" else ()
        started = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            cell = Cell.make("ddp", "none", "pod", "fp32" if model else precision)
            result = run_cell(pathlib.Path(tmp), cell, trains_on_s=60 * args.minutes, script_args=("--dropout", "0.1", *model))
        quiet = result.ok and not result.alerts
        failed += not quiet
        print(f"ddp {precision}: {args.minutes:g} min healthy, {time.monotonic() - started:.0f} s: "
              f"{'no alert, nothing found' if quiet else 'FALSE ALARM'}; alerts {result.alerts or 'none'}; "
              f"live: {result.live.strip() or '-'}; offline: {result.offline.strip() or '-'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
