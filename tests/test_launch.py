"""``commlens run -- torchrun …``: an unmodified script gets metrics and traces for all its ranks."""

import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from ports import free_port, free_ports

def _commlens(*args, **kwargs):
    return subprocess.Popen([sys.executable, "-m", "commlens.agent.cli", *args], **kwargs)


def test_an_unmodified_torchrun_job_is_instrumented_in_every_rank(tmp_path):
    script = pathlib.Path(__file__).resolve().parent / "children" / "launch_train.py"
    base = free_ports(2)
    job = _commlens("run", "--in-process", "--metrics-port", str(base), "--metrics-addr", "127.0.0.1",
                    "--job-id", "zero-code", "--metrics-detail", "op",
                    "--trace-file", str(tmp_path / "spans-{rank}.jsonl"), "--",
                    "torchrun", "--nproc-per-node", "2", "--master-port", str(free_port()), str(script), str(tmp_path),
                    cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready-{r}").exists() for r in (0, 1)):
            assert job.poll() is None, "the job ended before its ranks were ready"
            assert time.monotonic() < deadline, "the ranks never got ready"
            time.sleep(0.1)
        for rank in (0, 1):  # the sidecar drains every 50 ms: a scrape may come just before it
            barrier = f'commlens_collectives_total{{op="barrier",pg="0",rank="{rank}",status="ok"}} 1.0'
            text = ""
            while barrier not in text:
                assert time.monotonic() < deadline, text
                text = urllib.request.urlopen(f"http://127.0.0.1:{base + rank}/metrics", timeout=10).read().decode()
            assert f'commlens_collectives_total{{op="all_reduce",pg="0",rank="{rank}",status="ok"}} 5.0' in text
            assert 'job="zero-code"' in text and 'world_size="2"' in text
    finally:
        (tmp_path / "done").touch()
        assert job.wait(120) == 0
    for rank in (0, 1):
        spans = (tmp_path / f"spans-{rank}.jsonl").read_text()
        assert spans.count('"name":"all_reduce"') == 5 and spans.count('"name":"barrier"') == 1
    assert not (tmp_path / "spans-None.jsonl").exists() and len(list(tmp_path.glob("spans-*.jsonl"))) == 2


def test_a_bad_option_fails_before_the_command_starts(tmp_path):
    marker = tmp_path / "started"
    job = _commlens("run", "--hang-threshold", "-1", "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')",
                    stderr=subprocess.PIPE, text=True)
    _, err = job.communicate(timeout=60)
    assert job.returncode == 2 and err.strip() == ("commlens run: --hang-threshold -1 (COMMLENS_HANG_THRESHOLD_S) is "
                                                   "not accepted: it must be a number >= 0.1"), err  # as typed
    assert not marker.exists()


@pytest.mark.parametrize("options, held, whose", [
    (["--in-process"], 1, "local rank 1"),  # torchrun's second local rank serves on base + 1
    ([], 0, None),  # the default: one port, for the pod sidecar
], ids=["per-rank", "pod-sidecar"])
def test_run_refuses_a_metrics_port_in_use_before_the_command_starts(tmp_path, options, held, whose):
    """A rank that cannot serve its metrics would train unobserved while the verdict says all is well."""
    import socket

    marker, base = tmp_path / "started", free_ports(2)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base + held))
        taken.listen(1)
        job = _commlens("run", "--metrics-addr", "127.0.0.1", "--metrics-port", str(base), *options, "--",
                        sys.executable, "-c", f"open({str(marker)!r}, 'w')", "--nproc-per-node", "2",
                        stderr=subprocess.PIPE, text=True)
        _, err = job.communicate(timeout=60)
    which = f"port {base + held}" + (f" ({whose})" if whose else "")
    assert job.returncode == 2 and f"--metrics-port {base} (COMMLENS_METRICS_PORT) is not accepted: {which} is in " \
        "use on 127.0.0.1" in err, err
    assert not marker.exists()


def test_run_keeps_each_jobs_files_in_a_folder_of_its_own_never_written_over_and_refuses_a_bad_ring_path(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMMLENS_", "OTEL_", "TORCHCOMM_"))}
    env["COMMLENS_METRICS_PORT"] = "0"  # the pod sidecar serves none: the suite runs other jobs beside
    dump = "import os; open(os.environ['TORCHCOMM_FR_DUMP_TEMP_FILE'] + '0', 'w').write('a dump')"
    first = _commlens("run", "--", sys.executable, "-c", dump, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    _, err = first.communicate(timeout=60)
    [folder] = (tmp_path / "commlens-out").iterdir()  # named by the job id run gave it
    job = folder.name
    assert first.returncode == 0 and (folder / "rank_0").read_text() == "a dump", err
    assert f"job {job}: its trace files and flight-recorder dumps go to commlens-out/{job}\n" in err, err
    assert f"commlens: skipped {folder.relative_to(tmp_path)}/rank_0 is not a flight-recorder dump" in err, err
    assert err.endswith(f"commlens run: verdict: no telemetry in commlens-out/{job}: no trace file (*.jsonl) with "
                        f"commlens spans and no flight-recorder dump\ncommlens run: the job's files are in "
                        f"commlens-out/{job}\n"), err
    again = _commlens("run", "--job-id", job, "--", sys.executable, "-c", dump, cwd=tmp_path, env=env,
                      stderr=subprocess.PIPE, text=True)
    _, err = again.communicate(timeout=60)
    assert again.returncode == 2 and f"folder commlens-out/{job} holds files already" in err, err
    assert (folder / "rank_0").read_text() == "a dump"
    chosen = _commlens("run", "--trace-file", str(tmp_path / "t-{rank}.jsonl"), "--", sys.executable, "-c", "pass",
                       env={**env, "TORCHCOMM_FR_DUMP_TEMP_FILE": str(tmp_path / "d-")}, stderr=subprocess.PIPE,
                       text=True)
    assert "go to" not in chosen.communicate(timeout=60)[1]  # the user's own places: no folder
    marker = tmp_path / "started"
    refused = _commlens("run", "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')",
                        env={**env, "COMMLENS_RING_PATH": "/no/such/folder/ring-{rank}"}, stderr=subprocess.PIPE,
                        text=True)
    _, err = refused.communicate(timeout=60)
    assert refused.returncode == 2 and "COMMLENS_RING_PATH='/no/such/folder/ring-{rank}'" in err and not marker.exists()


def test_a_rank_that_cannot_start_commlens_trains_on_and_the_verdict_names_it_unobserved(tmp_path):
    """The command's own environment (a wrapper script, a launcher's) may hold what ``run`` did not see:
    the rank trains on, without commlens, and neither ``run`` nor the job's folder says all is well.
    An unwritable trace file, which ``run`` can see, is refused before the command starts."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMMLENS_", "OTEL_", "TORCHCOMM_"))}
    trained = tmp_path / "trained"
    job = _commlens("run", "--in-process", "--metrics-port", "0", "--job-id", "unseen", "--", "env", "RANK=0",
                    "WORLD_SIZE=1", "COMMLENS_RING_SLOTS=3", sys.executable, "-c", f"open({str(trained)!r}, 'w')",
                    cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    _, err = job.communicate(timeout=120)
    folder = tmp_path / "commlens-out" / "unseen"
    assert job.returncode == 0 and trained.exists(), err  # the job's own status: training was not stopped
    assert "commlens: not started in rank 0: COMMLENS_RING_SLOTS='3' is not accepted" in err, err
    unseen = "not observed: rank 0 ran without commlens (COMMLENS_RING_SLOTS='3' is not accepted"
    assert f"commlens run: verdict: nothing wrong found, in what commlens saw\ncommlens run: verdict: {unseen}" in err, err
    assert (folder / "verdict.txt").read_text().splitlines()[1].startswith(unseen)
    diagnosed = subprocess.run([sys.executable, "-m", "commlens.agent.cli", "diagnose", str(folder)],
                               capture_output=True, text=True, timeout=60)
    assert diagnosed.returncode == 3 and diagnosed.stdout.splitlines()[1].startswith(unseen), diagnosed
    refused = _commlens("run", "--in-process", "--metrics-port", "0", "--trace-file", "/no/such/folder/t-{rank}.jsonl",
                        "--", sys.executable, "-c", f"open({str(tmp_path / 'started')!r}, 'w')", cwd=tmp_path, env=env,
                        stderr=subprocess.PIPE, text=True)
    _, err = refused.communicate(timeout=60)
    assert refused.returncode == 2 and "--trace-file /no/such/folder/t-{rank}.jsonl (COMMLENS_TRACE_FILE): cannot " \
        "write in '/no/such/folder'" in err and not (tmp_path / "started").exists(), err


def test_a_sigterm_to_run_alone_ends_the_command_and_run_cleans_up_after_it(tmp_path):
    """Kubernetes stops a pod by signalling only the container's first process: here ``commlens run``."""
    waits = "import os, signal; print(os.getpid(), os.environ['COMMLENS_RING_DIR'], flush=True); signal.pause()"
    job = _commlens("run", "--sidecar", "--metrics-port", "0", "--trace-file", str(tmp_path / "t-{rank}.jsonl"), "--",
                    sys.executable, "-c", waits, stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    pid, rings = job.stdout.readline().split()
    job.send_signal(signal.SIGTERM)
    assert job.wait(60) == 128 + signal.SIGTERM  # the command's own ending, as a shell reports it
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid), 0)  # the command is gone, not left running without its launcher
    assert not os.path.exists(rings)  # the pod sidecar stopped and its ring folder was removed


def test_the_command_says_its_version_and_helps_without_importing_torch():
    import importlib.metadata

    version = subprocess.run([sys.executable, "-m", "commlens.agent.cli", "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.strip() == f"commlens {importlib.metadata.version('commlens')}"
    helped = subprocess.run([sys.executable, "-c", "import sys\nfrom commlens.agent.cli import main\ntry:\n    main(['--help'])\n"
                             "except SystemExit:\n    pass\nprint('torch loaded:', 'torch' in sys.modules)"],
                            capture_output=True, text=True)
    assert "which rank, which collective, why" in helped.stdout and "commlens run -- torchrun" in helped.stdout
    assert helped.stdout.strip().endswith("torch loaded: False"), helped.stdout


@pytest.mark.torch_free
def test_runs_help_says_each_options_unit_and_default():
    """``commlens run --help``: each option with its value's kind, its default and the variable it sets."""
    helped = subprocess.run([sys.executable, "-m", "commlens.agent.cli", "run", "--help"], capture_output=True,
                            text=True)
    flat = " ".join(helped.stdout.split())
    for option, shown in [("--hang-threshold SECONDS", "(default 300); sets COMMLENS_HANG_THRESHOLD_S"),
                          ("--metrics-port PORT", "(default 9464); sets COMMLENS_METRICS_PORT"),
                          ("--otlp-protocol PROTOCOL", "grpc or http/protobuf (default http/protobuf)"),
                          ("--metrics-detail DETAIL", "group, op or full (default group)")]:
        assert option in flat and shown in flat, helped.stdout


def test_run_imports_torch_only_to_build_the_extensions_and_not_once_they_are_built(tmp_path):
    """The launcher's cost before the command starts: about 0.1 s of CPU, not the seconds that
    importing torch takes, once the extensions are built (the test session builds them first)."""
    program = ("import sys\nfrom commlens.agent.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n"
               "    pass\nprint('torch loaded:', 'torch' in sys.modules)")
    launched = subprocess.run([sys.executable, "-c", program, "run", "--metrics-port", "0", "--trace-file",
                               str(tmp_path / "t.jsonl"), "--", "true"], capture_output=True, text=True, timeout=60,
                              cwd=tmp_path)
    assert launched.stdout.strip() == "torch loaded: False", launched
    unbuilt = subprocess.run([sys.executable, "-c", program, "run", "--metrics-port", "0", "--trace-file",
                              str(tmp_path / "t.jsonl"), "--", "true"], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "CXX": "false"}, cwd=tmp_path)
    assert unbuilt.stdout.strip() == "torch loaded: True", unbuilt  # it tried to build them (no compiler here)
    assert "commlens: building its C++ extension" in unbuilt.stderr and "could not be built" in unbuilt.stderr, \
        unbuilt.stderr  # said before the build's seconds, not after
    import torch

    if not torch.cuda.is_available():  # the GPU's extension is built only where there is a GPU
        assert "_gpu.cpp" not in unbuilt.stderr and "GPU extension" not in unbuilt.stderr, unbuilt.stderr


def test_run_starts_at_once_on_a_port_whose_last_jobs_scrapes_sit_in_time_wait(tmp_path):
    """A job run again at once on its metrics port: the connections that served the last job's scrapes
    sit in TIME_WAIT for a minute. Nothing holds the port, and the metrics server binds it (it sets
    SO_REUSEADDR), so the check must not refuse it; a listener it must (the server cannot bind that)."""
    import socket

    from commlens.agent import ConfigError
    from commlens.agent.cli.ports import is_free, refuse_taken

    base = free_ports(1)
    with socket.socket() as listener:  # the last job's endpoint, scraped once
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", base))
        listener.listen(1)
        with socket.create_connection(("127.0.0.1", base)) as scraper:
            served, _ = listener.accept()
            served.close()  # the server closes first, as an HTTP/1.0 one does: TIME_WAIT on its side
            assert scraper.recv(1) == b""
    assert not is_free(base)  # a plain bind is refused: the port's last connection is still there
    marker = tmp_path / "started"
    job = _commlens("run", "--metrics-addr", "127.0.0.1", "--metrics-port", str(base), "--", sys.executable, "-c",
                    f"open({str(marker)!r}, 'w')", stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    _, err = job.communicate(timeout=60)
    assert job.returncode == 0 and marker.exists(), err
    with socket.socket() as listener:  # a server of its own on the port, which sets SO_REUSEADDR too
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", base))
        listener.listen(1)
        with pytest.raises(ConfigError, match=f"port {base} is in use on 127.0.0.1"):
            refuse_taken("127.0.0.1", base, 1, None, "choose another")


@pytest.mark.torch_free
def test_a_job_run_twice_in_a_row_on_one_port_while_prometheus_scrapes_starts_at_once_both_times(tmp_path):
    """As people rerun a failed job: ``commlens run`` on one metrics port, Prometheus scraping its pod
    sidecar every second; once the job ends, the same command again starts at once and is scraped in
    turn. (Whether the scrapes' connections sit in TIME_WAIT on the port depends on which side closed
    them first; the test above makes them so.)"""
    import types

    from monitoring import STARTUP_S, Prometheus, wait_for

    port = free_port()
    target = types.SimpleNamespace(targets=[f"127.0.0.1:{port}"], __exit__=lambda *exc: None)
    scrapes = f'sum_over_time(up{{instance="127.0.0.1:{port}"}}[10m])'
    rules = pathlib.Path(__file__).resolve().parent.parent / "deploy" / "prometheus-rules.yaml"
    with Prometheus(tmp_path, target, [rules]) as prometheus:
        wait_for(lambda: prometheus.query("vector(1)"), "Prometheus answering")
        for attempt in (1, 2):
            done = tmp_path / f"done-{attempt}"
            before = sum(float(r["value"][1]) for r in prometheus.query(scrapes))
            job = _commlens("run", "--metrics-addr", "127.0.0.1", "--metrics-port", str(port), "--", sys.executable,
                            "-c", f"import os, time\nwhile not os.path.exists({str(done)!r}):\n    time.sleep(0.05)",
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path)
            try:
                wait_for(lambda: sum(float(r["value"][1]) for r in prometheus.query(scrapes)) >= before + 2,
                         f"attempt {attempt} scraped twice", STARTUP_S, explain=lambda: job.poll())
            finally:
                done.touch()
                _, err = job.communicate(timeout=60)
            assert job.returncode == 0 and "is not accepted" not in err, err


def test_a_live_hang_is_said_on_the_console_while_the_job_still_waits(tmp_path):
    """A user watching ``commlens run``'s terminal sees a hang when it is found, not after the job:
    rank 0 waits in an all_reduce for rank 1, held back (``tests/children/held_in_a_collective.py``)
    until the test has read that line; then the job ends well. (The pod sidecar says it, as an
    in-process exporter does: both are a ``RankPipeline``.)"""
    script = pathlib.Path(__file__).resolve().parent / "children" / "held_in_a_collective.py"
    released = tmp_path / "released"
    job = _commlens("run", "--hang-threshold", "1", "--metrics-port", "0", "--", "torchrun",
                    "--nproc-per-node", "2", "--master-port", str(free_port()), str(script), str(released),
                    cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    said, deadline = [], threading.Timer(90, released.touch)  # a line never said fails the test, not hangs it
    deadline.start()
    try:
        for line in job.stderr:
            said.append(line)
            if line.startswith("commlens: rank 0 has waited over 1 s in all_reduce (group 0, seq "):
                break
    finally:
        released.touch()
        deadline.cancel()
        said += job.stderr.readlines()
        job.wait(60)
    assert any(line.endswith("past the hang threshold; `commlens diagnose` names whom it waits for\n")
               for line in said), "".join(said)
    assert job.returncode == 0, "".join(said)


@pytest.mark.parametrize("mode, culprit", [("--in-process", 2), ("--sidecar", 0)], ids=["in-process", "pod-sidecar"])
def test_a_job_restarted_by_torchrun_keeps_each_attempts_files_and_the_verdict_tells_the_attempts_apart(
        tmp_path, mode, culprit):
    """``torchrun --max-restarts 1``: a rank of the first attempt is killed inside its all_reduce
    (``tests/faulty_train.py``), torchrun restarts every rank, and the second attempt trains to the end.
    The second attempt's files go to ``attempt-1/`` beside the first's (none written over: the killed
    rank's note that it ended is missing from the first's, as the verdict needs it to be), its
    collectives, numbered from 0 again, in traces of their own; ``commlens diagnose`` on the job's folder names the culprit in attempt 0 alone and finds
    nothing wrong in attempt 1; so does ``commlens diagnose --prometheus`` from the metrics (each
    attempt read as the next began, over windows that begin with it), once the job has ended. The
    shipped rules run through it all (attempt 1 trains for about 25 s: their 20 s windows span the
    restart, the counters and sequence numbers starting again): no alert names a rank but the culprit."""
    import json
    import types

    from monitoring import SCRIPT, STARTUP_S, Prometheus, culprits, wait_for

    out, base = tmp_path / "job", free_ports(3)
    target = types.SimpleNamespace(targets=[f"127.0.0.1:{base + rank}" for rank in range(3 if mode == "--in-process" else 1)],
                                   __exit__=lambda *exc: None)
    rules = pathlib.Path(__file__).resolve().parent.parent / "deploy" / "prometheus-rules.yaml"
    with Prometheus(tmp_path, target, [rules]) as prometheus:
        wait_for(lambda: prometheus.query("vector(1)"), "Prometheus answering")
        job = _commlens("run", mode, "--metrics-addr", "127.0.0.1", "--metrics-port", str(base),
                        "--job-id", "restarted", "--out", str(out), "--",
                        "torchrun", "--nproc-per-node", "3", "--max-restarts", "1", "--master-port", str(free_port()),
                        SCRIPT, "--fault", "kill", "--rank", str(culprit), "--step", "20", "--steps", "1000",
                        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        log, _ = job.communicate(timeout=2 * STARTUP_S)  # two attempts, each started up
        assert job.returncode == 0, log[-5000:]  # the second attempt trained to the end
        wait_for(lambda: prometheus.query('last_over_time(commlens_info{attempt="1"}[15m])'), "attempt 1 scraped")
        live = subprocess.run([sys.executable, "-m", "commlens.agent.cli", "diagnose", "--prometheus",
                               f"http://127.0.0.1:{prometheus.port}"], capture_output=True, text=True, timeout=60)
        alerted = {(a["metric"]["alertname"], a["metric"].get("rank", a["metric"].get("node"))) for a in
                   prometheus.query('max_over_time(ALERTS{alertstate="firing"}[15m])')}
    assert {rank for _, rank in alerted} <= {str(culprit)}, alerted  # a job-wide alert (no rank) is as wrong
    lines = live.stdout.splitlines()
    assert live.returncode == 1 and lines[-1] == "commlens, attempt 1: nothing wrong found", live.stdout + live.stderr
    assert all(line.startswith("commlens, attempt 0: ") for line in lines[:-1]) and \
        culprits("\n".join(lines[:-1])) == {culprit}, live.stdout
    said = [line.removeprefix("commlens run: verdict: ") for line in log.splitlines()
            if line.startswith("commlens run: verdict: ")]  # run's own verdict, as diagnose's below
    assert said[-1] == "attempt 1: nothing wrong found" and culprits("\n".join(said[:-1])) == {culprit}, log[-3000:]
    assert (out / "verdict.txt").exists() and (out / "attempt-1" / "verdict.txt").exists()
    first, second = out, out / "attempt-1"
    assert not (first / f"ended-{culprit}.json").exists()  # killed: no note that it ended, in its attempt's folder
    assert sorted(p.name for p in second.glob("ended-*.json")) == [f"ended-{r}.json" for r in range(3)], log[-3000:]

    def spans(folder):  # (rank, group, seq) -> (trace id, the resource's attempt) of each all_reduce's span
        found = {}
        for rank in range(3):
            for line in (folder / f"traces-{rank}.jsonl").read_text().splitlines():
                for rs in json.loads(line)["resourceSpans"]:
                    resource = {a["key"]: a["value"] for a in rs["resource"]["attributes"]}
                    for span in (s for ss in rs["scopeSpans"] for s in ss["spans"] if s["name"] == "all_reduce"):
                        attributes = {a["key"]: a["value"] for a in span["attributes"]}
                        key = (rank, attributes["commlens.pg.name"]["stringValue"], int(attributes["commlens.seq"]["intValue"]))
                        found[key] = (span["traceId"], int(resource["commlens.attempt"]["intValue"]))
        return found

    before, after = spans(first), spans(second)
    assert {attempt for _, attempt in before.values()} == {0} and {attempt for _, attempt in after.values()} == {1}
    common = sorted(set(before) & set(after))  # the same collective's number, in both attempts
    assert common and all(before[key][0] != after[key][0] for key in common)
    assert len({after[(rank, *common[0][1:])][0] for rank in range(3)}) == 1  # one trace for the ranks of one
    verdict = subprocess.run([sys.executable, "-m", "commlens.agent.cli", "diagnose", str(out)], capture_output=True,
                             text=True, timeout=60)
    lines = verdict.stdout.splitlines()
    assert verdict.returncode == 1 and lines[-1] == "attempt 1: nothing wrong found", verdict.stdout + verdict.stderr
    assert all(line.startswith("attempt 0: ") for line in lines[:-1]) and \
        culprits("\n".join(lines[:-1])) == {culprit}, verdict.stdout
