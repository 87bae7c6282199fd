"""The program of the process a user's reward function runs in (``rewards.user_process`` starts it).

    python user_process_main.py PARENT_PID READ_FD WRITE_FD

Run as a script by its path, so it imports nothing of the project: the standard modules below start
it in a fraction of a second, while importing ``rlhf_core.rewards`` would import torch. Messages are
``multiprocessing.connection`` messages on two pipes:

    parent → child   {"sys_path": [...], "target": module name or .py file, "is_file": bool, "name": str}
    child → parent   ("ready",) | ("no_module", text) | ("no_function", [callable names]) | an ending
    parent → child   {"data_source": ..., "solution_str": ..., "ground_truth": ..., "extra_info": {...}}
    child → parent   ("ok", result) | ("own_class", type name) | ("unsendable", text) | an ending

An ending is ``("exit", code)`` (the code called sys.exit / raised SystemExit), ``("interrupt",)``
(it raised KeyboardInterrupt) or ``("raised", "Type: message", location)`` (any other exception: its
traceback is printed on this process's standard error, which is the run's). ``os._exit``, a crash
or a kill send nothing: the parent reads the end of the pipe and the process's exit status.

A terminal's Ctrl-C is the parent's to handle (it stops this process on its way out), so SIGINT is
ignored here. The process leaves as soon as its parent is gone, however the parent went (a thread
watches for the reparenting): it never outlives the run, even inside a call that never returns.
"""

import functools
import hashlib
import importlib
import importlib.util
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


def leave_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.25)
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


def serve(reader: Connection, writer: Connection) -> None:
    reply, fn = load(reader.recv())
    writer.send(reply)
    if fn is None:
        return
    while True:
        try:
            kwargs = reader.recv()
        except EOFError:  # the parent closed the pipe: done
            return
        reply = call(fn, kwargs)
        try:
            writer.send(reply)
        except Exception as exc:  # pickling failed before a byte was written: the pipe is intact
            writer.send(("unsendable", f"{type(reply[-1]).__name__}: {exc}"))


def main() -> None:
    parent, read_fd, write_fd = (int(a) for a in sys.argv[1:4])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if os.getppid() != parent:
        os._exit(1)
    threading.Thread(target=leave_with_parent, args=(parent,), daemon=True).start()
    serve(Connection(read_fd, writable=False), Connection(write_fd, readable=False))


if __name__ == "__main__":
    main()
