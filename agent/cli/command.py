"""commlens: every collective of a PyTorch distributed job, visible; which rank, which collective, why.

    commlens demo --world-size 4 --steps 20        train on CPU with every collective recorded
    commlens demo --inject nan:rank=1:step=3       ... and see commlens name the rank and step
    commlens run -- torchrun --nproc-per-node 4 train.py   instrument every rank of your own job (one sidecar)
    commlens run --in-process -- torchrun ... train.py     ... exporting from a thread in every rank instead
    commlens sidecar --ring-dir /dev/shm/commlens           the pod sidecar (a Kubernetes sidecar container)
    commlens diagnose ./commlens-out/JOB           which rank, which collective, why
    commlens dump --store HOST:PORT --job-id ID    every rank of a live job writes its flight-recorder dump
    commlens report ./commlens-out/JOB             the verdict, timeline and latencies as one HTML page
    commlens timeline ./commlens-out/JOB           every rank's collectives on one timeline (Perfetto)
    commlens assets ./commlens-assets              the Grafana dashboards, alert rules and Kubernetes manifests
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys


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


_RUN_OPTIONS = {
    "job-id": ("COMMLENS_JOB_ID", "ID", "the job's id: the `job` of its telemetry and the name of its folder (default: "
               "a new one, from the time and the process)"),
    "metrics-port": ("COMMLENS_METRICS_PORT", "PORT", "the metrics port; with --in-process, local rank R serves on "
                     "PORT+R; 0: no metrics (default 9464)"),
    "metrics-addr": ("COMMLENS_METRICS_ADDR", "ADDR", "the address the metrics endpoints listen on (default 0.0.0.0)"),
    "hang-threshold": ("COMMLENS_HANG_THRESHOLD_S", "SECONDS", "how long a collective may wait before it is "
                       "reported hung, at least 0.1 (default 300)"),
    "trace-file": ("COMMLENS_TRACE_FILE", "PATH", "the spans' file where no OTLP endpoint is set, {rank} replaced "
                   "(default: traces-{rank}.jsonl in the job's folder)"),
    "otlp-endpoint": ("OTEL_EXPORTER_OTLP_ENDPOINT", "URL", "an OTLP receiver for the spans, e.g. "
                      "http://collector:4318 (default: none; spans go to --trace-file)"),
    "otlp-protocol": ("OTEL_EXPORTER_OTLP_PROTOCOL", "PROTOCOL", "grpc or http/protobuf (default http/protobuf)"),
    "service-name": ("OTEL_SERVICE_NAME", "NAME", "the spans' service.name (default commlens)"),
    "module-attribution": ("COMMLENS_MODULE_ATTRIBUTION", "BOOL", "true: each collective's span names the module "
                           "that issued it (default false)"),
    "ring-dir": ("COMMLENS_RING_DIR", "DIR", "an existing folder shared with a pod sidecar (commlens sidecar) running "
                 "beside, where the ranks write their rings (default: none)"),
    "metrics-detail": ("COMMLENS_METRICS_DETAIL", "DETAIL", "what per-collective series are split by: group, op or "
                       "full (default group)"),
}
"""option -> (the variable it sets, its value's name, what it is: unit, accepted values, default)."""


def _settings(args: argparse.Namespace) -> dict[str, str]:
    return {variable: getattr(args, option.replace("-", "_")) for option, (variable, _, _) in _RUN_OPTIONS.items()
            if getattr(args, option.replace("-", "_")) is not None}


def _in_options(message: str, settings: dict[str, str]) -> str:
    """A refusal of a variable the user set by its option, said with the option as typed.

    >>> _in_options("COMMLENS_HANG_THRESHOLD_S='-3' is not accepted: ...", {"COMMLENS_HANG_THRESHOLD_S": "-3"})
    '--hang-threshold -3 (COMMLENS_HANG_THRESHOLD_S) is not accepted: ...'"""
    for option, (variable, _, _) in _RUN_OPTIONS.items():
        for given in (f"{variable}={settings.get(variable)!r}", f"{variable}={settings.get(variable)}"):
            if variable in settings and message.startswith(given):
                return f"--{option} {settings[variable]} ({variable})" + message[len(given):]
    return message


def _version() -> str:
    """The installed distribution's version; a source tree on PYTHONPATH has none, and still runs."""
    try:
        return importlib.metadata.version("commlens")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed: run from a source tree)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="commlens", description=__doc__.split("\n")[0],
                                     epilog=__doc__.split("\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"commlens {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run the instrumented multi-rank training demo on CPU")
    demo.add_argument("--world-size", type=_positive, default=4, help="gloo processes (default 4)")
    demo.add_argument("--steps", type=_positive, default=20, help="training steps (default 20)")
    demo.add_argument("--out", help="the job's folder for its trace files, dumps and timeline (default: "
                      "./commlens-out/<job id>)")
    demo.add_argument("--inject", type=_fault, action="append", default=[],
                      help="a fault, repeatable: nan|hang|desync|size|skip:rank=R:step=S (hang also takes "
                      ":s=SECONDS), or slow:rank=R:ms=M")
    demo.add_argument("--keep-serving", action="store_true",
                      help="after training, keep serving metrics (for a Prometheus to scrape) until SIGTERM or "
                      "Ctrl-C; then the summary")
    launch = commands.add_parser("run", help="run COMMAND with commlens started in every distributed rank",
                                 description="Options set the COMMLENS_*/OTEL_* variable named in their help; "
                                 "the environment configures the rest.")
    sidecar = commands.add_parser("sidecar", help="the pod sidecar: serve every local rank's ring in COMMLENS_RING_DIR",
                                  description="Reads the rings that ranks started with COMMLENS_RING_DIR write, and "
                                  "exports for all of them: one metrics port, spans, dumps. Runs until SIGTERM. "
                                  "Options set the COMMLENS_*/OTEL_* variable named in their help.")
    for option, (variable, value, what) in _RUN_OPTIONS.items():
        for command in (launch, sidecar):
            command.add_argument(f"--{option}", metavar=value, help=f"{what}; sets {variable}")
    launch.add_argument("--out", metavar="DIR", help="the job's folder for its trace files and dumps (default: "
                        "./commlens-out/<job id>, the job id a new one unless --job-id or COMMLENS_JOB_ID gives it)")
    where = launch.add_mutually_exclusive_group()
    where.add_argument("--sidecar", dest="sidecar", action="store_const", const=True,
                       help="export from one commlens sidecar process for the node, as in a Kubernetes pod (the "
                       "default, unless --ring-dir or COMMLENS_RING_DIR names the rings of a sidecar running beside): "
                       "it outlives the ranks, so a killed rank's evidence stays")
    where.add_argument("--in-process", dest="sidecar", action="store_const", const=False,
                       help="export from a thread in every rank instead, each local rank serving metrics on "
                       "base + LOCAL_RANK")
    launch.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND [ARGS...]",
                        help="the command to run, e.g. torchrun ... train.py")
    dump = commands.add_parser("dump", help="every rank of a live job writes its flight-recorder dump, and "
                               "training goes on", description="Asks through the job's store; each rank (or its "
                               "pod sidecar, from shared memory) writes its dump within a second or so, where the "
                               "job writes its dumps (TORCHCOMM_FR_DUMP_TEMP_FILE).")
    dump.add_argument("--store", required=True, metavar="HOST:PORT",
                      help="the job's store: its ranks' MASTER_ADDR:MASTER_PORT")
    dump.add_argument("--job-id", default=os.environ.get("COMMLENS_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID")
                      or "local", help="the job's COMMLENS_JOB_ID (default: this environment's, else 'local')")
    assets = commands.add_parser("assets", help="write the Grafana dashboards, Prometheus rules and Kubernetes "
                                 "manifests that ship with commlens into a new or empty folder")
    assets.add_argument("folder", help="where to write them (dashboards/, deploy/)")
    assets.add_argument("--scrape-interval", metavar="DURATION", help="the rules and the PodMonitor for "
                        "Prometheus scraping this often (1s to 60s, e.g. 30s; default: the rules for 2 s or less, "
                        "the manifests for their PodMonitor's 15s)")
    commands.add_parser("diagnose", add_help=False, help="name the rank, collective and cause of what went wrong "
                        "(live from metrics or Prometheus, or from trace files and dumps)")
    commands.add_parser("timeline", add_help=False, help="a cross-rank timeline of a job's collectives, for "
                        "ui.perfetto.dev or chrome://tracing, from its trace files")
    commands.add_parser("report", add_help=False, help="a job's verdict, timeline, ranks, latencies and anomalies "
                        "as one HTML page, from its trace files")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["diagnose"], ["timeline"], ["report"]):  # each parses its own arguments
        return importlib.import_module(f"..verdicts.{argv[0]}", __package__).main(argv[1:])
    args = parser.parse_args(argv)

    from ..config import Config, ConfigError

    if args.command in ("run", "sidecar"):
        from .launch import run as run_command, serve_pod

        try:
            if args.command == "sidecar":
                return serve_pod(_settings(args))
            command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
            if not command:
                parser.error("run needs a command: commlens run [options] -- COMMAND [ARGS...]")
            return run_command(command, _settings(args), args.sidecar, args.out)
        except ConfigError as error:
            print(f"commlens {args.command}: {_in_options(str(error), _settings(args))}", file=sys.stderr)
            return 2
    if args.command == "assets":
        import pathlib

        from .assets import write_assets
        from ..verdicts.rule_files import parse_interval

        try:
            interval = None if args.scrape_interval is None else parse_interval(args.scrape_interval)
            written = write_assets(pathlib.Path(args.folder), interval)
        except (ConfigError, ValueError) as error:
            assets.error(f"--scrape-interval {error}" if isinstance(error, ValueError) else str(error))
        print(f"commlens assets: wrote {len(written)} files into {args.folder}: dashboards/ for Grafana, "
              "deploy/prometheus-rules.yaml for Prometheus, deploy/kubernetes/ for kubectl apply -k")
        return 0
    if args.command == "dump":
        from ..job_dumps import request_dumps

        try:
            request_dumps(args.store, args.job_id)
        except ValueError as error:
            dump.error(str(error))
        except ConnectionError as error:
            print(f"commlens dump: {error}", file=sys.stderr)
            return 1
        print(f"commlens dump: asked every rank of job {args.job_id!r} for its flight-recorder dump")
        return 0
    from .demo import demo_environment, demo_job_id, run
    from .launch import OUT_ROOT, conclude, make_job_folder
    from .ports import refuse_taken

    for fault in args.inject:
        if fault.rank >= args.world_size:
            demo.error(f"--inject rank={fault.rank} is not accepted: ranks are 0..{args.world_size - 1}")
    job = demo_job_id()
    out = args.out or os.path.join(OUT_ROOT, job)
    environment = demo_environment(out, args.world_size, job)
    try:
        config = Config.from_env({**os.environ, **environment})  # refused here, before anything runs
        refuse_taken(config.metrics_addr, config.metrics_port or 0, args.world_size, "rank",
                     "choose another base port, or leave it unset for free ones")
        make_job_folder(out)
        print(f"commlens demo: {args.world_size} ranks x {args.steps} steps of DDP on gloo/CPU; metrics on "
              f"127.0.0.1:{environment['COMMLENS_METRICS_PORT']}+rank; traces and flight-recorder dumps in {out}",
              flush=True)
        outcome = run(args.world_size, args.steps, out, tuple(args.inject), args.keep_serving, environment)
    except ConfigError as error:
        print(f"commlens demo: {error}", file=sys.stderr)
        return 2
    print(outcome.summary)
    report = (outcome.analyzer.stdout + outcome.analyzer.stderr).strip()
    print("torchfrtrace:", report or "no mismatch found")
    from ..verdicts.timeline import OPEN_IN

    _, written = conclude(out)
    print(f"the job's files are in {out}: {', '.join(map(os.path.basename, written))} (timeline.json: {OPEN_IN}; "
          "report.html: open it in a browser)")
    return outcome.analyzer.returncode

