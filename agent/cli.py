"""The ``commlens`` command.

    commlens demo --world-size 4 --steps 20        train on CPU with every collective recorded
    commlens demo --inject desync:rank=1:step=3    ... and see the flight recorder name the culprit
"""

from __future__ import annotations

import argparse
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
    demo.add_argument("--inject", type=_fault, help="a fault: desync|size|skip:rank=R:step=S")
    args = parser.parse_args(argv)

    from .demo import run

    out = args.out or tempfile.mkdtemp(prefix="commlens-demo-")
    if args.inject and args.inject.rank >= args.world_size:
        parser.error(f"--inject rank={args.inject.rank} is not accepted: ranks are 0..{args.world_size - 1}")
    print(f"commlens demo: {args.world_size} ranks x {args.steps} steps on gloo/CPU; dumps in {out}")
    verdict = run(args.world_size, args.steps, out, args.inject)
    report = (verdict.stdout + verdict.stderr).strip()
    print("torchfrtrace:", report or "no mismatch found")
    return verdict.returncode


if __name__ == "__main__":
    sys.exit(main())
