"""The ``commlens`` command.

    commlens demo --world-size 4 --steps 20        train on CPU with every collective recorded
    commlens demo --inject nan:rank=1:step=3       ... and see commlens name the rank and step
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not accepted: give a positive integer")
    return value


def _fault(text: str):
    from .demo import Fault

    try:
        return Fault.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="commlens", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run the instrumented multi-rank training demo on CPU")
    demo.add_argument("--world-size", type=_positive, default=4, help="gloo processes (default 4)")
    demo.add_argument("--steps", type=_positive, default=20, help="training steps (default 20)")
    demo.add_argument("--out", help="folder for the flight-recorder dumps (default: a new temporary one)")
    demo.add_argument("--inject", type=_fault,
                      help="a fault: nan|hang|desync|size|skip:rank=R:step=S, or slow:rank=R:ms=M")
    demo.add_argument("--keep-serving", action="store_true",
                      help="after training, keep serving metrics until SIGTERM (for a Prometheus to scrape)")
    args = parser.parse_args(argv)

    from .config import DEFAULT_METRICS_PORT, ConfigError
    from .demo import run

    out = args.out or tempfile.mkdtemp(prefix="commlens-demo-")
    if args.inject and args.inject.rank >= args.world_size:
        parser.error(f"--inject rank={args.inject.rank} is not accepted: ranks are 0..{args.world_size - 1}")
    port = os.environ.get("COMMLENS_METRICS_PORT", str(DEFAULT_METRICS_PORT))
    print(f"commlens demo: {args.world_size} ranks x {args.steps} steps of DDP on gloo/CPU; metrics on "
          f"127.0.0.1:{port}+rank; traces and flight-recorder dumps in {out}", flush=True)
    try:
        outcome = run(args.world_size, args.steps, out, args.inject, args.keep_serving)
    except ConfigError as error:
        print(f"commlens demo: {error}", file=sys.stderr)
        return 2
    print(outcome.summary)
    report = (outcome.analyzer.stdout + outcome.analyzer.stderr).strip()
    print("torchfrtrace:", report or "no mismatch found")
    return outcome.analyzer.returncode


if __name__ == "__main__":
    sys.exit(main())
