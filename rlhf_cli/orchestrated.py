"""The commands that run Prefect flows (tracked in MLflow): run, demo, stage (without --local),
rebuild, and the local services. Each reports to one Prefect server (``rlhf_cli.prefect_server``:
the configured one, the local services' one, or a temporary one that never outlives the command)
and stops, resumable, when that server goes away mid-command."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import Any

from pydantic import BaseModel, ValidationError
from prefect.context import refresh_global_settings_context
from prefect.logging.handlers import PrefectConsoleHandler
from prefect.settings import (
    PREFECT_API_URL, PREFECT_HOME, PREFECT_SERVER_EPHEMERAL_ENABLED, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
)

from deployments.services import main as services_main
from flows.pipeline import PipelineParams, rlhf_pipeline
from flows.stage import StageParams, rlhf_rebuild, rlhf_stage
from rlhf_cli import prefect_server, session, startup
from rlhf_cli.inspection import demo_as_run, plan_run_command
from rlhf_core.run.layout import require_run_dir
from rlhf_cli.local import print_result, quiet_deepspeed, stage_overrides
from rlhf_cli.typed_commands import as_typed
from rlhf_core.control.status import accuracy_lines
from rlhf_core.errors import RLHFError
from rlhf_core.run.layout import RunDir
from rlhf_core.security import redact_text
from tasks import prefect_runs
from tasks.mlflow_tracking import TRAINING_VIEW, display_uri, run_url, ui_path
from tasks.prefect_artifacts import redact_prefect_logs


EXIT_SERVER_GONE = 75
"""Exit status when the Prefect server went away mid-command (sysexits' EX_TEMPFAIL: run it again)."""


def _bind_server() -> None:
    """Point this command's Prefect at the server it reports to (``prefect_server.choose``: the
    configured one, the local services' one, or a temporary one of its own) and watch that server,
    so that one dying mid-command stops the command (``_server_gone``) instead of hanging it."""
    reporting = prefect_server.choose(PREFECT_API_URL.value(), PREFECT_SERVER_EPHEMERAL_ENABLED.value(),
                                      PREFECT_HOME.value(), PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())
    prefect_runs.COMMAND_SIGTERM = session.ON_SIGNAL  # the flows keep it over Prefect's own
    if reporting is None:
        return  # no server and no temporary one allowed: Prefect says so itself
    if reporting.whose != "configured":
        os.environ["PREFECT_API_URL"] = reporting.api_url  # for the processes this one starts, too
        if reporting.whose == "temporary":
            os.environ["PREFECT_UI_URL"] = ""  # it serves no UI: Prefect prints no dead "View at" link
        refresh_global_settings_context()  # Prefect read its settings when it was imported
    if reporting.whose == "services":
        print(f"rlhf: reporting to the local services' Prefect server, {_ui(reporting.api_url)}", file=sys.stderr)
    session.REPORTING, session.STOP, session.WORK_DONE = reporting, None, False
    session.WATCH = prefect_server.ServerWatch(reporting, _server_gone)


def _ui(api_url: str) -> str:
    return api_url.removesuffix("/api")


def _server_gone(reason: str) -> None:
    """The server went away (called once, from ``ServerWatch``'s thread). During the work: stop the
    command the way Ctrl-C does (resumable, one line, a bounded exit; ``rlhf_cli.main``), since
    Prefect would record nothing more of it. After the work: leave now with what it printed, instead
    of Prefect retrying to deliver its last events."""
    reporting = session.REPORTING
    what = f"the Prefect server at {_ui(reporting.api_url)} went away ({reason})"
    if session.WORK_DONE:
        sys.stdout.flush()
        os.write(session.STDERR_FD if session.STDERR_FD is not None else 2,
                 f"rlhf: {what}; Prefect missed this command's last events (the run directory has everything)\n"
                 .encode())
        os._exit(0)
    session.STOP = (f"rlhf: stopped: {what}; {_how_to_continue(reporting.whose)}", EXIT_SERVER_GONE)
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


def _how_to_continue(whose: str) -> str:
    """The second half of the line that says the command stopped because its server went away."""
    run_dir = session.RUN_DIR
    if run_dir is not None and run_dir.config_path.is_file():
        then = f"continue with: rlhf run --resume {run_dir.root}"
    else:
        then = "run the same command again"
    return then + {"temporary": " (it starts a new temporary server)",
                   "services": " (on a temporary server until `make services-down services-up` restarts the services)",
                   "configured": " once the server at PREFECT_API_URL is back"}[whose]


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
    quiet_deepspeed()
    _bind_server()
    _quiet_user_errors()
    result = rlhf_stage(params)
    print_result(result)
    session.WORK_DONE = True
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    # fail on a bad name, preset, override or path here, before a Prefect server is started for nothing
    # (``rlhf_cli.main`` planned already, before this module's imports: ``args.plan``)
    checked_params(PipelineParams, run_name=args.run_name, iterations=args.iterations)
    plan = getattr(args, "plan", None) or plan_run_command(args)
    session.RUN_DIR = plan.run  # for the resume hint after Ctrl-C
    quiet_deepspeed()
    startup.step("the Prefect server")
    _bind_server()
    _quiet_user_errors()
    # the flow plans again: give it the directory planned here (a default name is a timestamp)
    params = PipelineParams(config=args.preset if args.preset or args.resume else None,
                            overrides=list(args.overrides), iterations=args.iterations,
                            run_name=None if args.resume else plan.run.root.name,
                            resume=str(args.resume.resolve()) if args.resume else None)
    startup.end()  # the flow prints from here on
    summary = rlhf_pipeline(params)
    print(redact_text(closing_block(summary)))  # a terminal is a sink too: scrollback, CI logs
    session.WORK_DONE = True
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
    return "\n".join(lines + accuracy_lines(RunDir(summary["run_dir"])) + [where_to_look(summary)])


def where_to_look(summary: dict) -> str:
    """The closing block of ``rlhf run`` / ``rlhf demo``: the run directory, its learning curve,
    MLflow and the Prefect UI, each with the command that opens it."""
    run_dir = summary["run_dir"]
    curve = RunDir(run_dir).learning_curve
    if summary.get("tracking_failed"):
        mlflow = (f"tracking failed ({summary['tracking_failed']}); the run directory has every metric, "
                  f"`rlhf run --resume {run_dir}` logs them into the store it then finds")
    elif summary.get("mlflow_run_id"):
        uri = display_uri()
        page = ui_path(summary["mlflow_run_id"]) or f"#/experiments?{TRAINING_VIEW}"  # the runs view, not GenAI's
        mlflow = f"run {summary['mlflow_run_id']}: " + (run_url(summary["mlflow_run_id"]) or (
            f"{as_typed('mlflow')} ui --host 127.0.0.1 --workers 1 --backend-store-uri {uri}   (then http://127.0.0.1:5000/{page})"))
    else:
        mlflow = "not tracked (trainer.logger has no mlflow)"
    reporting = session.REPORTING
    api = reporting.api_url if reporting else os.environ.get("PREFECT_API_URL")
    temporary = reporting is not None and reporting.whose == "temporary"
    prefect = (f"{_ui(api)}/runs (flow rlhf-pipeline)" if api and not temporary else
               "this run used a temporary Prefect server, now stopped; `make services-up` starts a "
               "persistent one (http://127.0.0.1:4200) where later runs and the deployments appear")
    rlhf = as_typed("rlhf")
    lines = [
        "where to look:",
        f"  run directory   {run_dir}   ({rlhf} status {run_dir}; {rlhf} query {run_dir} \"select * from metrics_wide\")",
        f"  learning curve  {curve if curve.is_file() else 'none (no iteration ran)'}",
        f"  MLflow          {mlflow}",
        f"  Prefect UI      {prefect}",
    ]
    return "\n".join(lines)


def cmd_demo(args: argparse.Namespace) -> int:
    return cmd_run(args if args.command == "run" else demo_as_run(args))


def cmd_rebuild(args: argparse.Namespace) -> int:
    require_run_dir(args.run_dir)
    quiet_deepspeed()
    _bind_server()
    _quiet_user_errors()
    results = rlhf_rebuild(str(args.run_dir.resolve()))
    for result in results:
        print_result(result)
    print(f"rebuilt {len(results)} stage(s)" if results else "nothing to rebuild: every stage follows config.yaml")
    session.WORK_DONE = True
    return 0


def cmd_services(args: argparse.Namespace) -> int:

    return services_main([args.action, *args.options]) or 0
