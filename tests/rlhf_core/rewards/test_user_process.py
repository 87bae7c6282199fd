"""custom_reward_function.path's function in a process of its own: every way out of it is one
DataError naming it (name and file), a hang is stopped at call_timeout_s, and its results are the
in-process call's, bit for bit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import json
import textwrap
import time
from pathlib import Path

import pytest

from rlhf_core.config import ConfigError, load_config
from rlhf_core.errors import DataError
from rlhf_core.registry import Registry
from rlhf_core.rewards import registry, reward_function
from rlhf_core.rewards.user_process import UserProcess
from rlhf_core.rewards.user_process_main import plain

USER = textwrap.dedent("""
    import asyncio, os, signal, sys, time
    from pathlib import Path
    import numpy as np

    def numpy_dict(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": np.float32(0.1), "acc": np.bool_(solution_str.endswith(ground_truth)),
                "pred": solution_str[-2:], "ratio": np.float64(1) / 3, "info": extra_info}

    def plain(data_source, solution_str, ground_truth, extra_info=None):
        return 1.0 if solution_str.strip().endswith(ground_truth) else 0.0

    def sequence(**kwargs):
        return (np.float32(2.5), "why")

    async def later(**kwargs):
        await asyncio.sleep(0)
        return 0.75

    def calls_sys_exit(**kwargs):
        sys.exit(0)

    def raises_system_exit(**kwargs):
        raise SystemExit("done")

    def calls_os_exit(**kwargs):
        os._exit(0)

    def raises_keyboard_interrupt(**kwargs):
        raise KeyboardInterrupt

    def kills_itself(**kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    def segfaults(**kwargs):
        import ctypes
        ctypes.string_at(0)

    def never_returns(**kwargs):
        while True:
            time.sleep(0.05)

    def divides_by_zero(**kwargs):
        return 1 / 0

    class Mine:
        pass

    def own_class(**kwargs):
        return {"score": 1.0, "why": Mine()}

    class Result(dict):
        pass

    def own_dict(**kwargs):
        return Result(score=1.0)

    def generator(**kwargs):
        return (x for x in [1.0])

    class Bomb:  # passes for a class of the standard library; reading its pickle would run os._exit
        __module__ = "json"

        def __reduce__(self):
            return (os._exit, (0,))

    def pickle_bomb(**kwargs):
        return {"score": 1.0, "why": Bomb()}

    def huge(**kwargs):
        return 10 ** 400

    def tensor_score(**kwargs):
        import torch
        return {"score": torch.tensor(0.5), "per_step": np.arange(3)}

    def _spawn(pid_file):  # a plain child and a double-forked daemon in a session of its own
        import subprocess
        child = subprocess.Popen(["sleep", "600"])
        middle = os.fork()
        if middle == 0:
            os.setsid()
            if os.fork() == 0:
                Path(pid_file + ".new").write_text(str(os.getpid()))
                os.rename(pid_file + ".new", pid_file + ".daemon")  # whole when seen
                time.sleep(600)
            os._exit(0)
        os.waitpid(middle, 0)
        while not Path(pid_file + ".daemon").exists():
            time.sleep(0.01)
        Path(pid_file).write_text(f"{child.pid} {Path(pid_file + '.daemon').read_text()}")

    def starts_children(extra_info=None, **kwargs):
        _spawn(extra_info["pid_file"])
        return 1.0

    def starts_children_and_hangs(extra_info=None, **kwargs):
        _spawn(extra_info["pid_file"])
        time.sleep(600)
""")


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(USER)
    return path


def _settings(path, name: str, *extra: str):
    return load_config(None, [f"custom_reward_function.path={path}", f"custom_reward_function.name={name}",
                              *extra]).custom_reward_function


ARGS = [("src", "the answer is 42", "42", '{"index": 4, "split": "train"}'), ("src", "so 7", "8", None),
        ("other", "", "1", "{}")]


@pytest.mark.parametrize("name", ["numpy_dict", "plain", "sequence", "later"])
def test_results_are_the_in_process_calls_bit_for_bit(user_file, name, monkeypatch):
    """The same function called in this process (as a registered route) and in its own process: the
    same scores to the bit; numpy values cross as the Python numbers they hold."""
    monkeypatch.syspath_prepend(str(user_file.parent))
    import my_reward  # noqa: PLC0415  the user's module, in this process for the comparison

    routes = Registry("reward function")
    for source in ("src", "other"):
        routes.register(source)(getattr(my_reward, name))
    monkeypatch.setattr(registry, "REWARDS", routes)
    here = registry.get_reward_fn(load_config(None, []).custom_reward_function)
    with reward_function(_settings(user_file, name)) as there:
        for args in ARGS:
            a, b = here(*args), there(*args)
            as_json = json.loads(json.dumps(a, default=plain))  # numpy values as their numbers
            assert type(as_json) is type(b) and repr(as_json) == repr(b)
            assert registry.normalize_result(a, "row")[0] == registry.normalize_result(b, "row")[0]
            if isinstance(a, dict):
                assert all(type(as_json[k]) is type(b[k]) for k in a)
    sys.modules.pop("my_reward", None)


@pytest.mark.parametrize("name,said", [
    ("calls_sys_exit", r"called sys.exit\(0\), which would end the run"),
    ("raises_system_exit", r"called sys.exit\('done'\), which would end the run"),
    ("calls_os_exit", r"ended its process with exit status 0 \(os._exit, or a library it calls exiting\)"),
    ("raises_keyboard_interrupt", r"raised KeyboardInterrupt, which would stop the run as Ctrl-C does"),
    ("kills_itself", r"crashed: its process was killed by SIGKILL \(the kernel's out-of-memory killer, or a kill\)"),
    ("segfaults", r"crashed: its process was killed by SIGSEGV \(a crash in native code\)"),
    ("divides_by_zero", r"raised ZeroDivisionError: division by zero at my_reward.py line \d+, in divides_by_zero "
                        r"\(its traceback is above\)"),
    ("own_class", r"returned an object of its own class rlhf_user_reward_\w+\.Mine"),
    ("own_dict", r"returned an object of its own class rlhf_user_reward_\w+\.Result"),
    ("generator", r"returned a value that cannot be sent back to the run \(generator"),
    ("pickle_bomb", r"returned a value that cannot be sent back to the run \(dict: json.Bomb is not a number"),
])
def test_every_way_out_of_the_function_is_one_data_error_naming_it(user_file, name, said, capfd):
    with reward_function(_settings(user_file, name)) as fn:
        with pytest.raises(DataError, match=f"^the reward function '{name}' of {user_file} {said}"):
            fn(*ARGS[0])
        with pytest.raises(DataError, match=said):  # and again, without another call of the function
            fn(*ARGS[1])
    if name == "divides_by_zero":  # the user's own traceback, not ours
        err = capfd.readouterr().err
        assert "Traceback" in err and "in divides_by_zero" in err and "user_process_main" not in err


def test_a_result_is_json_never_a_pickle(user_file):
    """Issue 49: a result whose pickle runs code (its class passing for the standard library's) made
    the run exit 0 when unpickled. Results now cross as JSON: plain numbers, torch and numpy included."""
    with reward_function(_settings(user_file, "tensor_score")) as fn:
        assert fn(*ARGS[0]) == {"score": 0.5, "per_step": [0, 1, 2]}
    with reward_function(_settings(user_file, "huge")) as fn:
        result = fn(*ARGS[0])
    assert result == 10 ** 400
    with pytest.raises(DataError, match=r"^row 3: the reward function returned an integer of 1329 bits, beyond "
                                        r"float32's range"):
        registry.normalize_result(result, "row 3")


@pytest.mark.parametrize("name", ["starts_children", "starts_children_and_hangs"])
def test_nothing_the_function_starts_outlives_its_call(user_file, tmp_path, name):
    """Issue 49: a child (Popen) or a double-forked daemon started by the reward function kept running
    after the stage, and after the timeout's kill. Both are gone when the call returns or times out."""
    pid_file = tmp_path / "pids"
    with reward_function(_settings(user_file, name, "custom_reward_function.call_timeout_s=15")) as fn:
        process = fn.process._proc.pid
        if name == "starts_children":
            assert fn("src", "x", "1", {"pid_file": str(pid_file)}) == 1.0
            assert _alive(process)  # the function's own process serves the next call
        else:
            with pytest.raises(DataError, match="took longer than"):
                fn("src", "x", "1", {"pid_file": str(pid_file)})
        pids = [int(p) for p in pid_file.read_text().split()]
        assert len(pids) == 2
        deadline = time.monotonic() + 5
        while any(map(_alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(map(_alive, pids)), f"still running: {[p for p in pids if _alive(p)]}"


def test_a_call_that_never_returns_is_stopped_at_the_timeout(user_file):
    with reward_function(_settings(user_file, "never_returns", "custom_reward_function.call_timeout_s=1.5")) as fn:
        pid = fn.process._proc.pid
        started = time.monotonic()
        with pytest.raises(DataError, match=r"'never_returns' of .*my_reward.py took longer than "
                                            r"custom_reward_function.call_timeout_s=1.5 s on one response and was stopped"):
            fn(*ARGS[0])
        assert 1.5 <= time.monotonic() - started < 10
    assert fn.process._proc.poll() is not None and not _alive(pid)


def test_ctrl_c_taken_by_another_thread_still_stops_the_wait_at_once(user_file):
    """The kernel may hand a process's SIGINT to any of its threads (torch's, a progress bar's); the
    main thread's wait for a reply is then not interrupted, and Python runs the KeyboardInterrupt only
    when the wait returns. Seen in CI: a Ctrl-C during a reward call was answered by the 60 s timeout."""
    # a process started in the background by a non-interactive shell inherits SIGINT ignored (CI may run so)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _interrupted_in_a_bystander(user_file)
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupted_in_a_bystander(user_file) -> None:
    import threading

    with reward_function(_settings(user_file, "never_returns", "custom_reward_function.call_timeout_s=60")) as fn:
        bystander = threading.Event()
        other = threading.Thread(target=bystander.wait, args=(30,), daemon=True)
        other.start()
        threading.Timer(1.0, signal.pthread_kill, args=(other.ident, signal.SIGINT)).start()
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            fn(*ARGS[0])
        bystander.set()
        assert time.monotonic() - started < 10


def test_a_module_that_exits_or_hangs_when_imported_is_one_error(tmp_path):
    leaving = tmp_path / "leaving.py"
    leaving.write_text("import os\nos._exit(3)\n\ndef compute_score(**kwargs):\n    return 1.0\n")
    with pytest.raises(DataError, match=r"'compute_score' of .*leaving.py ended its process with exit status 3 "
                                        r"while its module was imported"):
        registry.get_reward_fn(_settings(leaving, "compute_score"))
    stuck = tmp_path / "stuck.py"
    stuck.write_text("import time\ntime.sleep(600)\n")
    with pytest.raises(DataError, match=r"took longer than custom_reward_function.call_timeout_s=1 s to import its module"):
        registry.get_reward_fn(_settings(stuck, "compute_score", "custom_reward_function.call_timeout_s=1"))


def test_the_timeout_must_be_positive():
    with pytest.raises(ConfigError, match=r"custom_reward_function.call_timeout_s=0.0: must be > 0 seconds"):
        load_config(None, ["custom_reward_function.call_timeout_s=0"])


def test_the_process_ends_with_the_block_and_with_its_parent(user_file, tmp_path):
    with reward_function(_settings(user_file, "plain")) as fn:
        pid = fn.process._proc.pid
        assert fn(*ARGS[0]) == 1.0 and _alive(pid)
    assert not _alive(pid)
    # a parent killed with -9 inside a call that never returns: its reward process leaves too
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        from rlhf_core.rewards.user_process import UserProcess
        p = UserProcess({str(user_file)!r}, "never_returns", 600)
        print(p._proc.pid, flush=True)
        p.call(data_source="s", solution_str="x", ground_truth="y", extra_info={{}})
    """))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    time.sleep(0.5)
    assert _alive(child)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the reward process outlived its parent"


def test_a_module_or_function_that_is_not_there_is_a_config_error(user_file):
    with pytest.raises(ConfigError, match="custom_reward_function.name to one of: .*numpy_dict"):
        UserProcess(str(user_file), "missing", 10)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie of ours counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        return os.path.exists(f"/proc/{pid}")
