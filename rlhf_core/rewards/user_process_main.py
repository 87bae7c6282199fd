"""The program of the process a user's reward function runs in (``rewards.user_process`` starts it).

    python user_process_main.py PARENT_PID READ_FD WRITE_FD

Run as a script by its path, so it imports nothing of the project: the standard modules below start
it in a fraction of a second, while importing ``rlhf_core.rewards`` would import torch. Messages go on
two pipes: the parent's are ``multiprocessing.connection`` messages (this process trusts the run), the
replies are JSON text (the run trusts nothing of the user's code: a pickle would run code when read,
JSON holds only numbers, strings, lists and dicts):

    parent → child   {"sys_path": [...], "target": module name or .py file, "is_file": bool, "name": str}
    child → parent   ["ready"] | ["no_module", text] | ["no_function", [callable names]] | an ending
    parent → child   {"data_source": ..., "solution_str": ..., "ground_truth": ..., "extra_info": {...}}
    child → parent   ["ok", result] | ["own_class", type name] | ["unsendable", text] | an ending

A result crosses as JSON after ``plain``: numpy and torch scalars and arrays become numbers and lists
(``.item()`` / ``.tolist()``), Python floats keep every bit (JSON writes their shortest round-trip
form). An ending is ``["exit", code]`` (the code called sys.exit / raised SystemExit),
``["interrupt"]`` (it raised KeyboardInterrupt) or ``["raised", "Type: message", location]`` (any
other exception: its traceback is printed on this process's standard error, which is the run's).
``os._exit``, a crash or a kill send nothing: the parent reads the end of the pipe and the process's
exit status.

Whatever the user's code starts does not outlive the call: this process is a child subreaper (an
orphaned grandchild, a double-forked daemon included, is reparented to it, not to init) and kills
every descendant when a call or the import returns (``kill_descendants``); the parent does the same
before it kills this process (a timeout) and this process does it when the parent is gone.

A terminal's Ctrl-C is the parent's to handle (it stops this process on its way out), so SIGINT is
ignored here. The process leaves as soon as its parent is gone, however the parent went (a thread
watches for the reparenting): it never outlives the run, even inside a call that never returns.
"""

import ctypes
import functools
import hashlib
import importlib
import importlib.util
import json
import os
import signal
import site
import sys
import sysconfig
import threading
import time
import traceback
import types
from multiprocessing.connection import Connection
from pathlib import Path


@functools.lru_cache(maxsize=None)
def installed() -> tuple[str, ...]:
    """Where Python's and the installed libraries' modules live: a value of their classes can be read
    by the run without importing any of the user's code."""
    paths = [sysconfig.get_paths().get(key) for key in ("stdlib", "platstdlib", "purelib", "platlib")]
    return tuple({str(Path(p).resolve()) for p in [*paths, *site.getsitepackages(), site.getusersitepackages()] if p})


PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Orphans among this process's descendants are reparented to it (Linux; elsewhere a no-op)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def descendants(root: int) -> list[int]:
    """The pids below ``root`` in the process tree, read from /proc (empty where there is none)."""
    parent_of: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in filter(str.isdigit, entries):
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                fields = fh.read().rpartition(b")")[2].split()  # after the name, which may hold spaces
        except OSError:  # it ended meanwhile
            continue
        parent_of[int(entry)] = int(fields[1])
    found, frontier = [], [root]
    while frontier:
        below = [pid for pid, ppid in parent_of.items() if ppid in frontier]
        found += below
        frontier = below
    return found


def kill_descendants(root: int) -> None:
    """SIGKILL every process below ``root``, again until none is left (one may fork while it goes),
    and reap those that were ``root``'s own children when ``root`` is this process. For this
    process, a subreaper, one system call answers the common case: no child, so no descendant."""
    if root == os.getpid() and not _has_children():
        return
    for _ in range(20):
        pids = descendants(root)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if root == os.getpid():
            _reap()
        time.sleep(0.01)


def _has_children() -> bool:
    """Whether this process has a child still running (finished ones are reaped on the way)."""
    _reap()
    try:
        os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        return False
    return True


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def leave_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.25)
    kill_descendants(os.getpid())
    os._exit(1)


def import_target(target: str, is_file: bool):
    """The user's module: a .py file (under a name of its own, registered so that dataclasses and
    typing in it find their module) or a module on the parent's sys.path."""
    if not is_file:
        return importlib.import_module(target)
    file = Path(target)
    module_name = "rlhf_user_reward_" + hashlib.sha256(str(file.resolve()).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def own_class(value, depth: int = 0):
    """The name of the first class in ``value`` (a result, walked through its dicts, lists, tuples
    and sets) defined outside Python and the installed libraries, else None: the parent would have
    to import the user's code to read it."""
    cls = type(value)
    module = sys.modules.get(cls.__module__)
    where = getattr(module, "__file__", None)
    if module is None or (where is not None and not _under(Path(where).resolve(), installed())):
        return f"{cls.__module__}.{cls.__qualname__}"
    if depth > 20:
        return None
    items = ([*value.keys(), *value.values()] if isinstance(value, dict)
             else value if isinstance(value, (list, tuple, set, frozenset)) else ())
    return next(filter(None, (own_class(item, depth + 1) for item in items)), None)


def _under(path: Path, roots: tuple[str, ...]) -> bool:
    return any(path.is_relative_to(root) for root in roots)


def ending(exc: BaseException) -> tuple:
    """The message for an exception that left the user's code; its traceback goes to stderr."""
    if isinstance(exc, SystemExit):  # its code as the parent can read it
        return ("exit", exc.code if isinstance(exc.code, (int, str, type(None))) else repr(exc.code))
    if isinstance(exc, KeyboardInterrupt):
        return ("interrupt",)
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:  # the user's frames only
        tb = tb.tb_next
    exc = exc.with_traceback(tb)
    frames = traceback.extract_tb(tb)
    last = frames[-1] if frames else None
    location = f"{Path(last.filename).name} line {last.lineno}, in {last.name}" if last else ""
    traceback.print_exception(exc, file=sys.stderr)
    sys.stderr.flush()
    return ("raised", "".join(traceback.format_exception_only(exc)).strip(), location)


def load(request: dict) -> tuple:
    sys.path[:] = request["sys_path"]
    try:
        module = import_target(request["target"], request["is_file"])
    except ModuleNotFoundError as exc:
        if request["is_file"]:
            return ending(exc), None
        return ("no_module", str(exc)), None
    except BaseException as exc:  # noqa: B036 — every way out of the user's code is reported
        return ending(exc), None
    fn = getattr(module, request["name"], None)
    if not callable(fn):
        return ("no_function", sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))), None
    return ("ready",), fn


def call(fn, kwargs: dict) -> tuple:
    try:
        result = fn(**kwargs)
        if isinstance(result, types.CoroutineType):  # an async def function: run to completion
            import asyncio  # noqa: PLC0415  only then: with ssl it is most of this program's start-up

            result = asyncio.run(result)
    except BaseException as exc:  # noqa: B036
        return ending(exc)
    finally:
        sys.stdout.flush()
    found = own_class(result)
    return ("own_class", found) if found else ("ok", result)


def plain(value):
    """``json.dumps``' hook for what it cannot write: a numpy or torch scalar or array as its number
    or list; anything else stays unsendable (TypeError)."""
    for method in ("item", "tolist"):
        convert = getattr(value, method, None)
        if callable(convert) and type(value).__module__.split(".")[0] in ("numpy", "torch"):
            try:
                return convert()
            except (ValueError, RuntimeError):  # .item() of an array with several elements
                continue
    raise TypeError(f"{type(value).__module__}.{type(value).__qualname__} is not a number, string, list or dict")


def encode(reply: tuple) -> bytes:
    """The reply as JSON text; a result JSON cannot hold becomes an "unsendable" reply."""
    try:
        return json.dumps(reply, default=plain).encode()
    except (TypeError, ValueError, RecursionError) as exc:
        return json.dumps(["unsendable", f"{type(reply[-1]).__name__}: {exc}"]).encode()


def serve(reader: Connection, writer: Connection) -> None:
    reply, fn = load(reader.recv())
    kill_descendants(os.getpid())
    writer.send_bytes(encode(reply))
    if fn is None:
        return
    while True:
        try:
            kwargs = reader.recv()
        except EOFError:  # the parent closed the pipe: done
            return
        reply = call(fn, kwargs)
        kill_descendants(os.getpid())
        writer.send_bytes(encode(reply))


def main() -> None:
    parent, read_fd, write_fd = (int(a) for a in sys.argv[1:4])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    become_subreaper()
    if os.getppid() != parent:
        os._exit(1)
    threading.Thread(target=leave_with_parent, args=(parent,), daemon=True).start()
    serve(Connection(read_fd, writable=False), Connection(write_fd, readable=False))


if __name__ == "__main__":
    main()
