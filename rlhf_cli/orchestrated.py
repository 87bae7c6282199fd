"""The commands that run Prefect flows (tracked in MLflow): run, demo, stage (without --local),
rebuild, and the local services. A temporary Prefect server, when one is needed, is bound to the
command's process so that it never outlives it."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from prefect.logging.handlers import PrefectConsoleHandler
from prefect.server.api.server import SubprocessASGIServer
from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

from deployments.services import main as services_main
from flows.pipeline import PipelineParams, rlhf_pipeline
from flows.stage import StageParams, rlhf_rebuild, rlhf_stage
from rlhf_cli import session
from rlhf_cli.inspection import require_run_dir
from rlhf_cli.local import print_result, stage_overrides
from rlhf_core.config.machine import cuda_devices
from rlhf_core.errors import RLHFError
from rlhf_core.paths import project_root
from rlhf_core.run.layout import RunDir
from rlhf_core.run.plan import plan_run
from rlhf_core.security import redact_text
from tasks.mlflow_tracking import display_uri, run_url
from tasks.prefect_artifacts import redact_prefect_logs


_SERVER_WATCHDOG = """
import signal, sys, time
import psutil

signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for rlhf: it stops the server itself
parent = psutil.Process(int(sys.argv[1]))
me = psutil.Process().pid
SERVER_APP = "prefect.server.api.server:" + "create_app"
servers = {}
while True:
    try:
        if psutil.Process().ppid() != parent.pid or parent.status() == psutil.STATUS_ZOMBIE:
            break  # rlhf is gone (we were reparented): it cannot stop its server any more
        children = parent.children()
    except psutil.NoSuchProcess:
        break
    for child in children:
        try:
            # uvicorn serving Prefect's app (not this watchdog, whose own source names it too)
            if child.pid not in servers and child.pid != me and SERVER_APP in child.cmdline():
                servers[child.pid] = child
        except (psutil.NoSuchProcess, psutil.AccessDenied):  # a short-lived child, gone or a zombie
            pass
    time.sleep(0.25)
for server in servers.values():
    try:
        server.terminate()
        server.wait(5)
    except psutil.TimeoutExpired:
        server.kill()
    except psutil.NoSuchProcess:  # stopped by rlhf itself on a normal exit
        pass
"""
"""Stops the temporary Prefect server once `rlhf` is gone, however it went. It runs before the
server starts and remembers every server child `rlhf` has, so a kill while the server is still
starting up leaves nothing behind either; psutil refuses to signal a PID that was reused meanwhile."""


def _bind_temporary_server() -> None:
    """Without PREFECT_API_URL, Prefect starts a temporary server as a child process on first use
    and stops it at interpreter exit. A ``kill -9`` (or an ``os._exit``) skips that exit, and the
    orphaned server kept listening for good. So the server is started here, before any flow, and a
    tiny watchdog process stops it as soon as this process is gone. Nothing changes when
    PREFECT_API_URL names a server (or ephemeral mode is off: Prefect reports that itself)."""

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return
    subprocess.Popen([sys.executable, "-c", _SERVER_WATCHDOG, str(os.getpid())],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, close_fds=True)
    with _server_output_to(Path(os.environ.get("PREFECT_HOME", ".")) / "temporary-server.log"):
        SubprocessASGIServer().start()  # the instance Prefect's clients use (one per process)


@contextlib.contextmanager
def _server_output_to(log: Path):
    """While the temporary server starts, this process's stdout/stderr point at ``log``, so the server
    inherits that instead of the terminal: the same Ctrl-C stops it, and its shutdown tracebacks
    would otherwise land in the middle of rlhf's own last line (and it would share, and could flip,
    the terminal pipe's blocking mode)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(log, "ab") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def _quiet_deepspeed() -> None:
    """DeepSpeed warns on the console each time it has to detect the CPU itself: say it once here."""
    if cuda_devices() == 0:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _user_error_names() -> set[str]:

    names, todo = set(), [RLHFError]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return names | {"KeyboardInterrupt"}


class _NoUserErrorTracebacks(logging.Filter):
    """On the console only: drop Prefect's report of a run that failed on a user error (or Ctrl-C),
    traceback included; the CLI prints that error as one line (the Prefect UI keeps the full log)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            return type(record.exc_info[1]).__name__ not in _user_error_names()
        if record.levelno >= logging.ERROR and record.name.startswith(("prefect.flow_runs", "prefect.task_runs")):
            text = record.getMessage()
            return not any(f"{name}:" in text or f"{name}(" in text for name in _user_error_names())
        return True


def _quiet_user_errors() -> None:
    """Install ``_NoUserErrorTracebacks`` on Prefect's console handlers (configured when Prefect loads),
    and the secret redaction on every Prefect handler (before the flow starts: Prefect logs a
    rejected flow's parameters before the flow body runs)."""
    redact_prefect_logs()

    for handler in logging.getLogger().handlers:
        if isinstance(handler, PrefectConsoleHandler) and not any(
                isinstance(f, _NoUserErrorTracebacks) for f in handler.filters):
            handler.addFilter(_NoUserErrorTracebacks())


FLAGS = {"run_name": "--run-name", "iterations": "--iterations", "iteration": "--iteration"}
"""A flow parameter → the option of `rlhf run` / `rlhf stage` that sets it."""

FIXES = {
    "run_name": "give a plain directory name (letters, digits, '.', '_', '-'; starting with a letter or digit), "
                "e.g. --run-name my-run; the run goes under trainer.runs_root",
    "iterations": "give --iterations N with N >= 1",
    "iteration": "give --iteration K >= 1 (validate also takes 0, the initial policy)",
}
"""What to do about a bad value of each flag."""


def checked_params(model: type[BaseModel], **values: Any) -> BaseModel:
    """``model(**values)`` (a flow's parameters), its validation errors as one RLHFError line
    naming the option, the bad value and the fix: before any server starts or anything is written."""
    try:
        return model(**values)
    except ValidationError as exc:
        raise RLHFError(params_problem(exc, values)) from None


def params_problem(exc: ValidationError, values: dict[str, Any]) -> str:
    """Each validation error as '<option> <value>: <why>; <fix>' (a rule across fields, such as a
    stage's iteration, already says both)."""
    problems = []
    for error in exc.errors():
        why = error["msg"].removeprefix("Value error, ")
        field = error["loc"][0] if error["loc"] else None
        if field is None:
            problems.append(why)
        else:
            problems.append(f"{FLAGS.get(field, field)} {values.get(field)!r}: {why}; "
                            f"{FIXES.get(field, 'see rlhf --help')}")
    return "; ".join(problems)


def cmd_stage(args: argparse.Namespace) -> int:
    """One stage as its own flow run (`--local` runs ``local.cmd_stage_local`` instead)."""
    params = checked_params(StageParams, stage=args.stage, run_dir=str(args.run_dir.resolve()),
                            iteration=getattr(args, "iteration", None), config=args.preset,
                            overrides=stage_overrides(args), force=args.force)
    _bind_temporary_server()
    _quiet_user_errors()
    result = rlhf_stage(params)
    print_result(result)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    # fail on a bad name, preset, override or path here, before a Prefect server is started for nothing
    checked_params(PipelineParams, run_name=args.run_name, iterations=args.iterations)
    plan = plan_run(preset=None if args.resume else args.preset, overrides=list(args.overrides),
                    iterations=args.iterations, run_name=args.run_name, resume=args.resume)
    session.RUN_DIR = plan.run  # for the resume hint after Ctrl-C
    _quiet_deepspeed()
    _bind_temporary_server()
    _quiet_user_errors()
    # the flow plans again: give it the directory planned here (a default name is a timestamp)
    params = PipelineParams(config=args.preset if args.preset or args.resume else None,
                            overrides=list(args.overrides), iterations=args.iterations,
                            run_name=None if args.resume else plan.run.root.name,
                            resume=str(args.resume.resolve()) if args.resume else None)
    summary = rlhf_pipeline(params)
    print(redact_text(closing_block(summary)))  # a terminal is a sink too: scrollback, CI logs
    return 0


def closing_block(summary: dict) -> str:
    """What `rlhf run` prints once the flow is done: the run directory, last-good, the export,
    then ``where_to_look``."""
    last_good = summary.get("last_good")
    lines = [f"run directory: {summary['run_dir']}",
             f"last-good: iteration {last_good['iteration']}" if last_good else "last-good: none"]
    exported = summary.get("export") or {}
    if exported.get("exported"):
        lines.append(f"exported actor: {exported['path']}")
    elif exported.get("reason"):
        lines.append(f"export: {exported['reason']}")
    return "\n".join(lines + [where_to_look(summary)])


def where_to_look(summary: dict) -> str:
    """The closing block of ``rlhf run`` / ``rlhf demo``: the run directory, its learning curve,
    MLflow and the Prefect UI, each with the command that opens it."""
    run_dir = summary["run_dir"]
    curve = RunDir(run_dir).learning_curve
    if summary.get("mlflow_run_id"):
        uri = display_uri()
        mlflow = f"run {summary['mlflow_run_id']}: " + (run_url(summary["mlflow_run_id"]) or (
            f"mlflow ui --host 127.0.0.1 --backend-store-uri {uri}   (then http://127.0.0.1:5000)"))
    else:
        mlflow = "not tracked (trainer.logger has no mlflow)"
    api = os.environ.get("PREFECT_API_URL")
    prefect = (f"{api.removesuffix('/api')}/runs (flow rlhf-pipeline)" if api else
               "this run used a temporary Prefect server, now stopped; `make services-up` starts a "
               "persistent one (http://127.0.0.1:4200) where later runs and the deployments appear")
    lines = [
        "where to look:",
        f"  run directory   {run_dir}   (rlhf status {run_dir}; rlhf query {run_dir} \"select * from metrics_wide\")",
        f"  learning curve  {curve if curve.is_file() else 'none (no iteration ran)'}",
        f"  MLflow          {mlflow}",
        f"  Prefect UI      {prefect}",
    ]
    return "\n".join(lines)


GRPO_DEMO = ("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4")
"""`rlhf demo --grpo`: the demo preset with GRPO, four responses per prompt normalised within their group."""


def cmd_demo(args: argparse.Namespace) -> int:
    overrides = [*GRPO_DEMO, *args.overrides] if getattr(args, "grpo", False) else args.overrides
    ns = argparse.Namespace(preset=str(project_root() / "configs" / "demo.yaml"), overrides=overrides,
                            run_name=args.run_name, resume=None, iterations=None, verbose=args.verbose)
    return cmd_run(ns)


def cmd_rebuild(args: argparse.Namespace) -> int:
    require_run_dir(args.run_dir)
    _bind_temporary_server()
    _quiet_user_errors()
    results = rlhf_rebuild(str(args.run_dir.resolve()))
    for result in results:
        print_result(result)
    print(f"rebuilt {len(results)} stage(s)" if results else "nothing to rebuild: every stage follows config.yaml")
    return 0


def cmd_services(args: argparse.Namespace) -> int:

    return services_main([args.action, *args.options]) or 0
