"""The `rlhf` command line.

    rlhf config show [-c PRESET] [key=value ...]        print the resolved config
    rlhf run [-c PRESET] [key=value ...] [--run-name NAME] [--iterations N]
    rlhf run --resume RUN_DIR [key=value ...]           continue after the last committed iteration
    rlhf demo [key=value ...]                           the main job on the embedded defaults
    rlhf stage NAME --run-dir RUN [--iteration K] [-c PRESET] [key=value ...]   rerun one stage
    rlhf rebuild RUN                                    rerun stale stages / override reruns with config.yaml
    rlhf status RUN                                     per-iteration stage table, last-good
    rlhf query RUN "SQL"                                DuckDB over the whole run (see rlhf_core.run.query)
    rlhf export RUN [key=value ...]                     save the last-good actor in HF format
    rlhf model build-tiny --out DIR                     build the local tiny model + tokenizer

`run`, `demo` and `stage` run as Prefect flow runs (a temporary local Prefect server starts when
PREFECT_API_URL is not set) tracked in MLflow (an SQLite store under $RLHF_HOME unless
MLFLOW_TRACKING_URI is set).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

# quiet, offline defaults for every entry point (a user's explicit setting wins)
for _key, _value in {
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
    "DO_NOT_TRACK": "1", "MLFLOW_DISABLE_TELEMETRY": "true", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
}.items():
    os.environ.setdefault(_key, _value)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", dest="preset", help="YAML preset (e.g. configs/demo.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted overrides, e.g. algorithm.kl_ctrl.kl_coef=0.002")


def build_parser() -> argparse.ArgumentParser:
    from rlhf_core.stages.registry import STAGES

    parser = argparse.ArgumentParser(prog="rlhf", description="Offline PPO RLHF as a staged, rerunnable DAG.")
    sub = parser.add_subparsers(dest="command", required=True)

    cfg = sub.add_parser("config", help="inspect configuration").add_subparsers(dest="config_cmd", required=True)
    show = cfg.add_parser("show", help="print the resolved config (defaults ← preset ← overrides)")
    _add_config_args(show)
    show.add_argument("--flat", action="store_true", help="one dotted key per line")

    stage = sub.add_parser("stage", help="run (or rerun) one stage on a run directory, as its own flow run")
    stage_sub = stage.add_subparsers(dest="stage", required=True)
    for spec in STAGES.values():
        sp = stage_sub.add_parser(spec.name, help=spec.help, description=spec.help)
        sp.add_argument("--run-dir", required=True, type=Path, help="run directory (created if absent)")
        if spec.per_iteration:
            sp.add_argument("--iteration", "-k", type=int, required=True, help="iteration number (1-based)")
        sp.add_argument("--force", action="store_true", help="rerun even if inputs and config are unchanged")
        sp.add_argument("--local", action="store_true",
                        help="run in this process without Prefect or MLflow (debugging)")
        if spec.name == "update":
            sp.add_argument("--nproc", type=int, default=None, help="data-parallel processes (trainer.nproc)")
        _add_config_args(sp)

    run = sub.add_parser("run", help="run the pipeline (a Prefect flow run, tracked in MLflow)")
    _add_config_args(run)
    run.add_argument("--run-name", help="run directory name under trainer.runs_root (default: timestamp)")
    run.add_argument("--iterations", type=int, help="PPO iterations (trainer.total_iterations)")
    run.add_argument("--resume", type=Path, metavar="RUN_DIR",
                     help="continue RUN_DIR after its last committed iteration (its saved config + overrides)")
    run.add_argument("--verbose", action="store_true",
                     help="also print every task's log and the per-stage progress bars (the Prefect UI has them)")

    demo = sub.add_parser("demo", help="the main job on the embedded default data and tiny model")
    demo.add_argument("--run-name", help="run directory name (default: timestamp)")
    demo.add_argument("--verbose", action="store_true", help="as for `rlhf run`")
    demo.add_argument("overrides", nargs="*", metavar="key=value")

    rebuild = sub.add_parser("rebuild", help="rerun, with the run's config.yaml, every stage at or before last-good "
                                             "that is stale or was rerun with overrides (a flow run per stage)")
    rebuild.add_argument("run_dir", type=Path, metavar="RUN")

    status = sub.add_parser("status", help="per-iteration stage table and the last-good iteration")
    status.add_argument("run_dir", type=Path, metavar="RUN")

    query = sub.add_parser("query", help="SQL (DuckDB) over the whole run: prompts, rollouts, scored, "
                                         "advantages, response_kl, metrics, metrics_wide, stages, events, validation")
    query.add_argument("run_dir", type=Path, metavar="RUN")
    query.add_argument("sql", help='e.g. "SELECT iteration, avg(reward) FROM scored GROUP BY 1 ORDER BY 1"')
    query.add_argument("--max-rows", type=int, default=50)
    query.add_argument("--csv", type=Path, help="also write the full result to this CSV file")

    export = sub.add_parser("export", help="save the last-good actor in Hugging Face format (LoRA merged), if its "
                                           "latest validation score clears trainer.export_min_val_score")
    export.add_argument("run_dir", type=Path, metavar="RUN")
    export.add_argument("--out", type=Path, help="output directory (default RUN/export/actor)")
    export.add_argument("overrides", nargs="*", metavar="key=value")

    model = sub.add_parser("model", help="model utilities").add_subparsers(dest="model_cmd", required=True)
    tiny = model.add_parser("build-tiny", help="build the tiny Qwen2-style model + BPE tokenizer locally")
    tiny.add_argument("--out", type=Path, required=True)
    tiny.add_argument("--hidden-size", type=int, default=64)
    tiny.add_argument("--layers", type=int, default=2)
    tiny.add_argument("--vocab-size", type=int, default=512)
    tiny.add_argument("--seed", type=int, default=0)
    svc = sub.add_parser("services", help="local Prefect server + worker + MLflow UI on 127.0.0.1 "
                                          "(deployments/README.md)")
    svc.add_argument("action", choices=["up", "down", "status", "register"])
    svc.add_argument("options", nargs=argparse.REMAINDER, help="e.g. --prefect-port 4300 --concurrency 2")
    return parser


# ---------------------------------------------------------------------------------------------
# commands
# ---------------------------------------------------------------------------------------------


def resolve_run_config(run_dir: Optional[Path], preset: Optional[str], overrides: Sequence[str]):
    """A run's config: its saved config.yaml (+ overrides) when no preset is given, else the preset."""
    from rlhf_core.run.plan import resolve_run_config as resolve

    return resolve(run_dir, preset, overrides)


def _prefect_env() -> None:
    """Prefect keeps its database and results under the project's state directory; a temporary
    server, when this command needs one, is bound to this process (``_bind_temporary_server``)."""
    from rlhf_core.paths import state_dir

    home = Path(os.environ.setdefault("PREFECT_HOME", str(state_dir() / "prefect")))
    home.mkdir(parents=True, exist_ok=True)  # Prefect creates only the last level itself
    _bind_temporary_server()


_SERVER_WATCHDOG = """
import signal, sys, time
import psutil

signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for rlhf: it stops the server itself
parent = int(sys.argv[1])
try:
    server = psutil.Process(int(sys.argv[2]))
    while server.is_running() and server.status() != psutil.STATUS_ZOMBIE:
        if psutil.Process().ppid() != parent:  # rlhf is gone (reparented): it cannot stop the server any more
            server.terminate()
            try:
                server.wait(5)
            except psutil.TimeoutExpired:
                server.kill()
            break
        time.sleep(0.25)
except psutil.NoSuchProcess:  # the server is gone already
    pass
"""
"""Stops the temporary Prefect server once `rlhf` is gone, however it went; psutil's Process
refuses to signal a PID that was reused meanwhile."""


def _bind_temporary_server() -> None:
    """Without PREFECT_API_URL, Prefect starts a temporary server as a child process on first use
    and stops it at interpreter exit. A ``kill -9`` (or an ``os._exit``) skips that exit, and the
    orphaned server kept listening for good. So the server is started here, before any flow, and a
    tiny watchdog process stops it as soon as this process is gone. Nothing changes when
    PREFECT_API_URL names a server (or ephemeral mode is off: Prefect reports that itself)."""
    import subprocess

    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return
    server = SubprocessASGIServer()  # the instance Prefect's clients use (one per process)
    server.start()
    subprocess.Popen([sys.executable, "-c", _SERVER_WATCHDOG, str(os.getpid()), str(server.server_process.pid)],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, close_fds=True)


def _quiet_console() -> None:
    """A run's console shows the iteration table, warnings and errors; the per-task INFO log stays
    in the Prefect UI (only the console handler is raised) and the inner progress bars go away
    (bars that matter pass disable=False explicitly). A user's own setting wins."""
    for key, value in {"PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "WARNING", "TQDM_DISABLE": "1",
                       "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error"}.items():
        os.environ.setdefault(key, value)
    from rlhf_core.config.machine import cuda_devices  # torch is loaded already (the config was fitted)

    if cuda_devices() == 0:  # DeepSpeed warns on the console each time it has to detect the CPU itself
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _user_error_names() -> set[str]:
    from rlhf_core.errors import RLHFError

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
    """Install ``_NoUserErrorTracebacks`` on Prefect's console handlers (configured when Prefect loads)."""
    from prefect.logging.handlers import PrefectConsoleHandler

    for handler in logging.getLogger().handlers:
        if isinstance(handler, PrefectConsoleHandler) and not any(
                isinstance(f, _NoUserErrorTracebacks) for f in handler.filters):
            handler.addFilter(_NoUserErrorTracebacks())


def _print_result(result: dict) -> None:
    status = "skipped (up to date)" if result["skipped"] else f"done in {result['seconds']:.1f}s"
    where = f" iteration {result['iteration']}" if result.get("iteration") is not None else ""
    print(f"[{result['stage']}{where}] {status}")
    for line in result.get("summary", []):
        print(f"  {line}")
    if result.get("action"):
        print(f"  guard verdict applied: {result['action']}")


def cmd_config_show(args: argparse.Namespace) -> int:
    """The resolved config, after the same checks `rlhf run` makes before any work (keys, values,
    paths), so an error shows here first."""
    from rlhf_core.config import flatten, to_yaml
    from rlhf_core.config.inputs import check_inputs
    from rlhf_core.run.plan import note_loggers, resolve_run_config

    cfg = resolve_run_config(None, args.preset, args.overrides)
    check_inputs(cfg)
    note_loggers(cfg)
    if args.flat:
        for key, value in flatten(cfg).items():
            print(f"{key}={value}")
    else:
        print(to_yaml(cfg), end="")
    return 0


def _stage_local(args: argparse.Namespace, overrides: list[str]) -> dict:
    from rlhf_core.run.layout import RunDir
    from rlhf_core.run.lock import RunLock
    from rlhf_core.run.plan import stage_config
    from rlhf_core.stages.registry import get_stage

    run = RunDir(args.run_dir)
    with RunLock(run):
        cfg = stage_config(run, args.preset, overrides)  # a rerun's overrides stay out of config.yaml
        return get_stage(args.stage).load()(cfg, run, getattr(args, "iteration", None), force=args.force).to_dict()


def cmd_stage(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if getattr(args, "nproc", None):
        overrides.append(f"trainer.nproc={args.nproc}")
    if args.local:
        result = _stage_local(args, overrides)
    else:
        _prefect_env()
        from flows.stage import StageParams, rlhf_stage

        _quiet_user_errors()

        result = rlhf_stage(StageParams(stage=args.stage, run_dir=str(args.run_dir.resolve()),
                                        iteration=getattr(args, "iteration", None), config=args.preset,
                                        overrides=overrides, force=args.force))
    _print_result(result)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from rlhf_core.run.plan import plan_run

    # fail on a bad preset, override or path here, before a Prefect server is started for nothing
    plan = plan_run(preset=None if args.resume else args.preset, overrides=list(args.overrides),
                    iterations=args.iterations, run_name=args.run_name, resume=args.resume)
    _RUN_DIR[0] = plan.run.root  # for the resume hint after Ctrl-C
    if not getattr(args, "verbose", False):
        _quiet_console()
    _prefect_env()
    from flows.pipeline import PipelineParams, rlhf_pipeline

    _quiet_user_errors()
    # the flow plans again: give it the directory planned here (a default name is a timestamp)
    params = PipelineParams(config=args.preset if args.preset or args.resume else None,
                            overrides=list(args.overrides), iterations=args.iterations,
                            run_name=None if args.resume else plan.run.root.name,
                            resume=str(args.resume.resolve()) if args.resume else None)
    summary = rlhf_pipeline(params)
    print(f"run directory: {summary['run_dir']}")
    last_good = summary.get("last_good")
    print(f"last-good: iteration {last_good['iteration']}" if last_good else "last-good: none")
    exported = summary.get("export") or {}
    if exported.get("exported"):
        print(f"exported actor: {exported['path']}")
    elif exported.get("reason"):
        print(f"export: {exported['reason']}")
    print(where_to_look(summary))
    return 0


def where_to_look(summary: dict) -> str:
    """The closing block of ``rlhf run`` / ``rlhf demo``: the run directory, its learning curve,
    MLflow and the Prefect UI, each with the command that opens it."""
    from tasks.mlflow_tracking import run_url, tracking_uri

    run_dir = summary["run_dir"]
    curve = Path(run_dir) / "plots" / "learning_curve.png"
    if summary.get("mlflow_run_id"):
        uri = tracking_uri()
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


def cmd_demo(args: argparse.Namespace) -> int:
    from rlhf_core.paths import project_root

    ns = argparse.Namespace(preset=str(project_root() / "configs" / "demo.yaml"), overrides=args.overrides,
                            run_name=args.run_name, resume=None, iterations=None, verbose=args.verbose)
    return cmd_run(ns)


def cmd_rebuild(args: argparse.Namespace) -> int:
    _require_run_dir(args.run_dir)
    _prefect_env()
    from flows.stage import rlhf_rebuild

    _quiet_user_errors()
    results = rlhf_rebuild(str(args.run_dir.resolve()))
    for result in results:
        _print_result(result)
    print(f"rebuilt {len(results)} stage(s)" if results else "nothing to rebuild: every stage follows config.yaml")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from rlhf_core.run.query import format_status

    _require_run_dir(args.run_dir)
    print(format_status(args.run_dir))
    return 0


def cmd_query(args: argparse.Namespace) -> int:
    import duckdb

    from rlhf_core.errors import RLHFError
    from rlhf_core.run.query import format_table, query

    _require_run_dir(args.run_dir)
    try:
        table = query(args.run_dir, args.sql)
    except duckdb.Error as exc:
        raise RLHFError(f"query failed: {exc}\n(views: prompts, rejects, generation_batches, rollouts, scored, "
                        "advantages, response_kl, validation, metrics, metrics_wide, stages, events)") from None
    print(format_table(table, max_rows=args.max_rows))
    if args.csv:
        import pyarrow.csv as pacsv

        pacsv.write_csv(table, args.csv)
        print(f"wrote {args.csv}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from rlhf_core.run.export import export_actor
    from rlhf_core.run.layout import RunDir
    from rlhf_core.run.lock import RunLock

    _require_run_dir(args.run_dir)
    run = RunDir(args.run_dir)
    cfg = resolve_run_config(run.root, None, args.overrides)
    with RunLock(run):
        path = export_actor(cfg, run, args.out)
    print(f"exported the last-good actor to {path}")
    return 0


def _require_run_dir(path: Path) -> None:
    from rlhf_core.errors import RLHFError

    if not (Path(path) / "config.yaml").is_file():
        raise RLHFError(f"{path} is not a run directory (no config.yaml); runs live under trainer.runs_root")


def cmd_build_tiny(args: argparse.Namespace) -> int:
    from rlhf_core.models.tiny import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(hidden_size=args.hidden_size, num_hidden_layers=args.layers,
                         vocab_size=args.vocab_size, seed=args.seed)
    path = build_tiny_model(args.out, spec)
    print(f"tiny model + tokenizer written to {path}")
    return 0


def cmd_services(args: argparse.Namespace) -> int:
    from deployments.services import main as services_main

    return services_main([args.action, *args.options]) or 0


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """argparse, plus key=value overrides anywhere on the line (``rlhf run --iterations 2 a.b=1``):
    argparse alone takes positionals only before the first option."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    stray = [e for e in extra if e.startswith("-") or "=" not in e]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


_RUN_DIR: list[Optional[Path]] = [None]
"""The run directory `rlhf run` planned (set before its flow starts), for the resume hint."""


class _OneLine(logging.Formatter):
    """A note or warning as one line: 'rlhf: <message>' (no level or logger name)."""

    def format(self, record: logging.LogRecord) -> str:
        return f"rlhf: {record.getMessage()}"


def _console_logging(verbose: bool) -> tuple[logging.Logger, logging.Handler, bool]:
    """Print the 'rlhf' loggers' warnings (config notes, alerts outside a flow) on stderr, one line
    each, and not again through the root logger's handlers (Prefect configures one)."""
    log = logging.getLogger("rlhf")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_OneLine())
    handler.setLevel(logging.INFO if verbose else logging.WARNING)
    log.addHandler(handler)
    if log.level == logging.NOTSET or log.level > handler.level:
        log.setLevel(handler.level)
    propagate, log.propagate = log.propagate, False
    return log, handler, propagate


_SAID_INTERRUPTED = [False]


def _on_ctrl_c(command: str) -> None:
    """From now on Ctrl-C (SIGINT) says at once how to resume, silences what the dying run would
    print after it (Prefect retrying a server the same Ctrl-C killed, tracebacks), and leaves with
    status 130 within EXIT_GRACE_SECONDS; a second Ctrl-C leaves at once."""

    def handler(signum, frame) -> None:
        print(_interrupted(command), file=sys.stderr, flush=True)
        _SAID_INTERRUPTED[0] = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stderr.fileno())
        _exit_soon(130)
        signal.signal(signal.SIGINT, lambda *_: os._exit(130))
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)


def _interrupted(command: str) -> str:
    """The line printed after Ctrl-C: what to run to continue, when there is a run to continue."""
    run_dir = _RUN_DIR[0]
    if command in ("run", "demo") and run_dir is not None and (run_dir / "config.yaml").is_file():
        return f"rlhf: interrupted; continue with: rlhf run --resume {run_dir}"
    return "rlhf: interrupted" + ("; no run directory was written yet" if command in ("run", "demo") else "")


EXIT_GRACE_SECONDS = 10.0
"""After Ctrl-C, how long the interpreter's exit hooks may run (they stop a temporary Prefect
server and flush its events) before the process leaves anyway: when the same Ctrl-C killed that
server, its event client would otherwise retry for many minutes."""


def _exit_soon(code: int) -> None:
    """Let the normal exit run, but leave with ``code`` after EXIT_GRACE_SECONDS whatever hangs."""
    def leave() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    timer = threading.Timer(EXIT_GRACE_SECONDS, leave)
    timer.daemon = True
    timer.start()


_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def _drop_inherited_world_of_one() -> None:
    """A process that ran a one-process update keeps its process group, and the TCP store on
    MASTER_PORT, with the rendezvous variables set; an `rlhf` started from it would inherit them and
    fail to bind that port. The command line never runs inside a launcher's world of one, so those
    inherited variables are dropped (an in-process update fills in its own)."""
    if os.environ.get("WORLD_SIZE") == "1":
        for key in _RENDEZVOUS:
            os.environ.pop(key, None)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The `rlhf` entry point. User errors (RLHFError, ConfigError, a missing file) print one line
    and exit 2 (3 for a KL-guard halt); Ctrl-C prints how to resume and exits 130."""
    from rlhf_core.errors import RLHFError

    args = parse_args(argv)
    if argv is None:
        _drop_inherited_world_of_one()
    handlers = {
        "config": cmd_config_show, "stage": cmd_stage, "run": cmd_run, "demo": cmd_demo, "rebuild": cmd_rebuild,
        "status": cmd_status, "query": cmd_query, "export": cmd_export, "model": cmd_build_tiny,
        "services": cmd_services,
    }
    log, handler, propagate = _console_logging(getattr(args, "verbose", False))
    if argv is None and args.command in ("run", "demo"):  # the console script, on a long-running command
        _on_ctrl_c(args.command)
    try:
        return handlers[args.command](args) or 0
    except (RLHFError, FileNotFoundError) as exc:
        # user errors: one clear line, no traceback
        print(f"rlhf: error: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 3 if type(exc).__name__ == "KLGuardHalt" else 2
    except KeyboardInterrupt:
        if not _SAID_INTERRUPTED[0]:
            print(_interrupted(args.command), file=sys.stderr, flush=True)
        if argv is None:  # the console script
            _exit_soon(130)
        return 130
    finally:
        log.removeHandler(handler)
        log.propagate = propagate
        if argv is None:
            signal.signal(signal.SIGINT, signal.default_int_handler)


if __name__ == "__main__":
    sys.exit(main())
