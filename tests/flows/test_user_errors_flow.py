"""The KL-guard halt (trainer.on_kl_breach=halt) reaches the terminal of `rlhf run` as its one
line, exit 3: no Prefect traceback above it, no 'Finished in state Failed' (issue 18)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.prefect, pytest.mark.slow]


def test_a_kl_guard_halt_is_one_line_with_the_resume_command(prefect_server, demo_preset, tiny_overrides, tmp_path,
                                                             subprocess_env):
    runs = tmp_path / "runs"
    # any step breaches a threshold this small: iteration 1 is rolled back, and the policy halts
    overrides = tiny_overrides(runs, "trainer.on_kl_breach=halt", "trainer.kl_rollback_threshold=1e-9",
                               "trainer.logger=[console]", "trainer.val_before_train=false")
    out = subprocess.run([sys.executable, "-m", "rlhf_cli.main", "run", "-c", demo_preset, "--iterations", "1",
                          *overrides], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                         env=subprocess_env(PREFECT_API_URL=prefect_server))
    assert out.returncode == 3, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("rlhf: error:")]
    assert len(errors) == 1 and "KL guard halted the run at iteration 1" in errors[0], out.stderr[-3000:]
    assert "rlhf run --resume" in errors[0]
    assert "Traceback" not in out.stderr and "Finished in state Failed" not in out.stderr, out.stderr[-3000:]
    assert "KLGuardHalt" not in out.stderr, out.stderr[-3000:]
    shown = re.search(r"= (\S+) > trainer.kl_rollback_threshold = (\S+) ", errors[0])
    assert shown and shown[1] != shown[2] and float(shown[2]) == 1e-9, errors[0]  # never rounded onto each other


def _gsm8k_like(path, short: int, long: int) -> str:
    """``short`` problems that fit the demo's 128-token prompts and ``long`` ones that do not."""
    rows = [{"question": f"Sam has {i} pens and buys {i + 2} more. How many pens does he have now?",
             "answer": f"{i} + {i + 2} = {2 * i + 2}\n#### {2 * i + 2}"} for i in range(short)]
    rows += [{"question": f"Problem {i}: " + "a long story about pens and pencils " * 40 + "How many?",
              "answer": "#### 1"} for i in range(long)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_run_that_keeps_too_few_prompts_says_why_and_trains_nothing(prefect_server, demo_preset, tiny_overrides,
                                                                   tmp_path, subprocess_env):
    """Issue 29: 2 of 200 GSM8K rows accepted (196 too long), 0 for validation, trained, exit 0,
    `val/accuracy 0.000`. Now: the preprocess line on the console, one error line, exit 2, no iteration."""
    data = _gsm8k_like(tmp_path / "broken.jsonl", short=2, long=18)
    runs = tmp_path / "runs"
    out = subprocess.run([sys.executable, "-m", "rlhf_cli.main", "run", "-c", demo_preset, "--iterations", "1",
                          *tiny_overrides(runs, f"data.train_files=[{data}]"), "--run-name", "broken"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300,
                         env=subprocess_env(PREFECT_API_URL=prefect_server))
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    assert (f"preprocess: 20 rows -> train 2, validation 0, rejected 18 (prompt too long 18); the rejected rows: "
            f"rlhf query {runs / 'broken'} \"SELECT reason") in out.stdout, out.stdout
    errors = [line for line in out.stderr.splitlines() if line.startswith("rlhf: error:")]
    assert len(errors) == 1 and "preprocess accepted 10.0% of the rows, under data.min_accepted_fraction=0.5" in errors[0]
    assert "raise data.max_prompt_length=128" in errors[0], errors[0]
    assert "Traceback" not in out.stderr and "val/accuracy" not in out.stdout, out.stderr[-3000:]
    assert not (runs / "broken" / "iter_1").exists() and not (runs / "broken" / "iter_0").exists()
    # the run directory this refusal leaves (only the tokenizer finds the mistake) is taken over once the data is fixed
    _gsm8k_like(tmp_path / "broken.jsonl", short=8, long=0)
    again = subprocess.run(out.args, capture_output=True, text=True, cwd=tmp_path, timeout=300,
                           env=subprocess_env(PREFECT_API_URL=prefect_server))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already exists" not in again.stderr and "started afresh" in again.stderr, again.stderr[-3000:]
    assert (runs / "broken" / "iter_1").is_dir()


def test_a_run_that_validates_on_no_prompt_is_refused(demo_preset, tiny_overrides, tmp_path, monkeypatch, capsys):
    """Every row accepted but none held out for validation (val_fraction of 3 rounds to 0), while the
    run validates: refused in one line (in-process `rlhf run`, the console script's code path) by the
    plan's data screening, before a run directory or a server: the Prefect API named here is a closed port."""
    from rlhf_cli.main import main

    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    data = _gsm8k_like(tmp_path / "three.jsonl", short=3, long=0)
    runs = tmp_path / "runs"
    code = main(["run", "-c", demo_preset, "--iterations", "1", "--run-name", "noval",
                 *tiny_overrides(runs, f"data.train_files=[{data}]", "data.train_batch_size=2",
                                 "actor_rollout_ref.actor.ppo_mini_batch_size=2")])
    out = capsys.readouterr()
    assert code == 2, out.err[-3000:]
    errors = [line for line in out.err.splitlines() if line.startswith("rlhf: error:")]
    assert len(errors) == 1 and "no validation prompt was accepted (3 rows -> train 3, validation 0)" in errors[0], \
        out.err[-3000:]
    assert "trainer.test_freq=-1" in errors[0] and not runs.exists()


@pytest.mark.parametrize("rows, words", [
    ("", "three.jsonl: no rows to read (empty)"),
    ('{"q": "1+1", "a": "#### 2"}\n', "no row has the fields data.adapter=gsm8k reads"),
    ('{"question": "1+1", "answer": "#### 2"}\n{"question": "1+2"}\n{"question": "1+3"}\n',
     "preprocess accepted 33.3% of the rows, under data.min_accepted_fraction=0.5 (3 rows -> train 1, validation 0, "
     "rejected 2: missing answer 2; e.g. "),
])
def test_a_data_mistake_is_refused_before_anything_exists(rows, words, demo_preset, tmp_path, subprocess_env):
    """Issue 50: a data mistake took 18-20 s (the Prefect server started before preprocess) and left a
    run directory and a FAILED MLflow run. Now the plan reads the files first: one line, exit 2, no run
    directory, no tracking store, no server (the Prefect API named is a closed port)."""
    data = tmp_path / "three.jsonl"
    data.write_text(rows)
    runs, store = tmp_path / "runs", tmp_path / "mlflow.db"
    out = subprocess.run([sys.executable, "-m", "rlhf_cli.main", "run", "-c", demo_preset, "--iterations", "1",
                          f"data.train_files=[{data}]", f"trainer.runs_root={runs}"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120,
                         env=subprocess_env(PREFECT_API_URL="http://127.0.0.1:9/api",
                                            MLFLOW_TRACKING_URI=f"sqlite:///{store}"))
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("rlhf: error:")]
    assert len(errors) == 1 and words in errors[0], out.stderr[-3000:]
    assert "Traceback" not in out.stderr and out.stdout == "", out.stdout + out.stderr
    assert not runs.exists() and not store.exists()


def test_a_reward_that_exits_or_overflows_float32_is_one_line(two_iterations, tmp_path, subprocess_env, capsys):
    """Issue 29: a reward function calling sys.exit(0) made the command exit 0 with nothing printed;
    a reward of 1e300 passed the finiteness check in float64 and was stored as inf in float32.
    `rlhf stage score` on a copy of a finished run, through the console entry point (sys.exit) and
    in-process (1e300)."""
    import shutil

    from rlhf_cli.main import main

    run = shutil.copytree(two_iterations.pristine.root, tmp_path / "run")
    rewards = tmp_path / "rewards.py"
    rewards.write_text("import sys\n\ndef leaves(**kwargs):\n    sys.exit(0)\n\n"
                       "def huge(**kwargs):\n    return 1e300\n")
    argv = ["stage", "score", "--local", "--run-dir", str(run), "--iteration", "1", "--force",
            f"custom_reward_function.path={rewards}"]
    out = subprocess.run([sys.executable, "-m", "rlhf_cli.main", *argv, "custom_reward_function.name=leaves"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300, env=subprocess_env())
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("rlhf: error:")]
    assert len(errors) == 1 and "called sys.exit(0), which would end the run" in errors[0], out.stderr[-3000:]
    assert "iter_1/rollout.parquet row 0" in errors[0] and "Traceback" not in out.stderr

    assert main([*argv, "custom_reward_function.name=huge"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("rlhf: error:")]
    assert len(errors) == 1 and "returned 1e+300, beyond float32's range" in errors[0], errors


def test_an_mlflow_store_replaced_mid_run_costs_one_line_not_the_run(prefect_server, demo_preset, tiny_overrides,
                                                                    tmp_path, subprocess_env):
    """Issue 29: the MLflow store replaced during a run: every iteration committed, then ~100 lines
    of traceback, exit 1, no summary, no export. Now one warning line, and the run ends as without
    MLflow: exit 0, last-good, the export, and the closing block saying tracking failed."""
    import time

    home, runs = tmp_path / "home", tmp_path / "runs"
    (home / "models").mkdir(parents=True)
    proc = subprocess.Popen([sys.executable, "-m", "rlhf_cli.main", "run", "-c", demo_preset, "--iterations", "3",
                             "--run-name", "ml", *tiny_overrides(runs)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            env=subprocess_env(PREFECT_API_URL=prefect_server, RLHF_HOME=str(home)))
    deadline = time.monotonic() + 300
    while not (runs / "ml" / "iter_1").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    store = home / "mlflow" / "mlflow.db"
    store.rename(store.with_name("old.db"))  # a store replaced under the running command
    store.write_text("not a database\n")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    failures = [line for line in err.splitlines() if "MLflow tracking failed" in line]
    assert len(failures) == 1 and "is not tracked from here on: the run goes on" in failures[0], err[-3000:]
    assert "Traceback" not in err and "ERROR" not in err, err[-3000:]
    assert "last-good: iteration 3" in out and f"exported actor: {runs / 'ml' / 'export' / 'actor'}" in out, out
    assert "MLflow          tracking failed (" in out and f"`rlhf run --resume {runs / 'ml'}` logs them" in out


LEAVING_REWARDS = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path

    def os_exit(**kwargs):
        os._exit(0)

    def keyboard_interrupt(**kwargs):
        raise KeyboardInterrupt

    def kill_itself(**kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    def never_returns(**kwargs):
        Path(os.environ["REWARD_PID_FILE"]).write_text(str(os.getpid()))
        while True:
            time.sleep(0.05)

    class Bomb:  # passes for a class of the standard library; reading its pickle would run os._exit
        __module__ = "json"

        def __reduce__(self):
            return (os._exit, (0,))

    def pickle_bomb(**kwargs):
        return {"score": 1.0, "why": Bomb()}

    def huge_score(**kwargs):
        return 10 ** 400

    def starts_a_daemon(**kwargs):  # double fork, a session of its own: reparented away from its parent
        pid_file = Path(os.environ["REWARD_PID_FILE"])
        middle = os.fork()
        if middle == 0:
            os.setsid()
            if os.fork() == 0:
                pid_file.with_suffix(".new").write_text(str(os.getpid()))
                pid_file.with_suffix(".new").rename(pid_file)
                time.sleep(600)
            os._exit(0)
        os.waitpid(middle, 0)
        while not pid_file.exists():
            time.sleep(0.01)
        return 1.0
""")


def test_a_reward_function_that_ends_its_process_stops_rlhf_run_in_one_line(prefect_server, demo_preset,
                                                                          tiny_overrides, tmp_path, subprocess_env):
    """Issue 38: a reward function calling os._exit(0) made `rlhf run` exit 0 with nothing committed
    and nothing said. Now the run stops with one line naming the function and its file, exit 2."""
    rewards = tmp_path / "rewards.py"
    rewards.write_text(LEAVING_REWARDS)
    runs = tmp_path / "runs"
    out = subprocess.run([sys.executable, "-m", "rlhf_cli.main", "run", "-c", demo_preset, "--iterations", "1",
                          "--run-name", "leaves", *tiny_overrides(runs, f"custom_reward_function.path={rewards}",
                                                                  "custom_reward_function.name=os_exit")],
                         capture_output=True, text=True, cwd=tmp_path, timeout=600,
                         env=subprocess_env(PREFECT_API_URL=prefect_server))
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("rlhf: error:")]
    assert len(errors) == 1, out.stderr[-3000:]
    assert f"the reward function 'os_exit' of {rewards} ended its process with exit status 0" in errors[0], errors
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert not (runs / "leaves" / "last_good.json").exists()


@pytest.mark.parametrize("name,said", [
    ("keyboard_interrupt", "raised KeyboardInterrupt, which would stop the run as Ctrl-C does"),
    ("kill_itself", "crashed: its process was killed by SIGKILL"),
    ("never_returns", "took longer than custom_reward_function.call_timeout_s=3 s on one response and was stopped"),
    ("pickle_bomb", "returned a value that cannot be sent back to the run (dict: json.Bomb is not a number"),
])
def test_every_way_out_of_a_reward_function_is_one_line_naming_it(two_iterations, tmp_path, subprocess_env,
                                                                   name, said):
    """Issue 38: raised by the function, a KeyboardInterrupt stopped the command as Ctrl-C does (exit
    130, 'resume with'); its own SIGKILL killed the command; a call that never returned hung it. Now
    each is one error line naming the function and the row, exit 2, and the function's process is gone."""
    import shutil

    run = shutil.copytree(two_iterations.pristine.root, tmp_path / "run")
    rewards, pid_file = tmp_path / "rewards.py", tmp_path / "reward.pid"
    rewards.write_text(LEAVING_REWARDS)
    out = subprocess.run([sys.executable, "-m", "rlhf_cli.main", "stage", "score", "--local", "--run-dir", str(run),
                          "--iteration", "1", "--force", f"custom_reward_function.path={rewards}",
                          f"custom_reward_function.name={name}", "custom_reward_function.call_timeout_s=3"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300,
                         env=subprocess_env(REWARD_PID_FILE=str(pid_file)))
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("rlhf: error:")]
    assert len(errors) == 1 and f"the reward function {name!r} of {rewards} {said}" in errors[0], out.stderr[-3000:]
    assert "iter_1/rollout.parquet row 0" in errors[0] and "Traceback" not in out.stderr
    if pid_file.exists():
        assert not Path(f"/proc/{pid_file.read_text()}").exists(), "the reward function's process outlived rlhf"


def test_a_score_beyond_float_is_one_line_and_no_child_of_the_reward_outlives_its_call(two_iterations, tmp_path,
                                                                                      subprocess_env):
    """Issue 49: a score of 10**400 ended in an OverflowError traceback; a daemon the reward function
    forked kept running after the stage. Now the first is one line naming the row, exit 2; after the
    second the stage succeeds and the daemon is gone."""
    import shutil
    import time

    run = shutil.copytree(two_iterations.pristine.root, tmp_path / "run")
    rewards, pid_file = tmp_path / "rewards.py", tmp_path / "reward.pid"
    rewards.write_text(LEAVING_REWARDS)
    outs = {name: subprocess.run([sys.executable, "-m", "rlhf_cli.main", "stage", "score", "--local", "--run-dir",
                                  str(run), "--iteration", "1", "--force", f"custom_reward_function.path={rewards}",
                                  f"custom_reward_function.name={name}"],
                                 capture_output=True, text=True, cwd=tmp_path, timeout=300,
                                 env=subprocess_env(REWARD_PID_FILE=str(pid_file)))
            for name in ("huge_score", "starts_a_daemon")}
    out = outs["huge_score"]
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("rlhf: error:")]
    assert len(errors) == 1 and "iter_1/rollout.parquet row 0" in errors[0], out.stderr[-3000:]
    assert "returned an integer of 1329 bits, beyond float32's range" in errors[0], errors
    out = outs["starts_a_daemon"]
    assert out.returncode == 0, out.stderr[-3000:]
    daemon = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while Path(f"/proc/{daemon}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{daemon}").exists(), "the reward function's daemon outlived its call"


def test_ctrl_c_during_a_reward_call_interrupts_and_leaves_no_reward_process(two_iterations, tmp_path,
                                                                             subprocess_env, from_a_terminal):
    """Ctrl-C reaches the whole process group: `rlhf` stops as interrupted (exit 130, its line), not
    with the reward function's error, and the function's process goes with it."""
    import os
    import shutil
    import signal
    import time

    run = shutil.copytree(two_iterations.pristine.root, tmp_path / "run")
    rewards, pid_file = tmp_path / "rewards.py", tmp_path / "reward.pid"
    rewards.write_text(LEAVING_REWARDS)
    proc = subprocess.Popen(from_a_terminal([sys.executable, "-m", "rlhf_cli.main", "stage", "score", "--local",
                                             "--run-dir", str(run), "--iteration", "1", "--force",
                                             f"custom_reward_function.path={rewards}",
                                             "custom_reward_function.name=never_returns"]),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            start_new_session=True, env=subprocess_env(REWARD_PID_FILE=str(pid_file)))
    deadline = time.monotonic() + 240
    while not pid_file.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pid_file.exists(), proc.communicate()[1][-3000:]
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole foreground group
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-3000:]
    assert "rlhf: error:" not in err and "Traceback" not in err, err[-3000:]
    assert not Path(f"/proc/{pid_file.read_text()}").exists(), "the reward function's process outlived rlhf"


@pytest.fixture
def small_disk(tmp_path):
    """``small_disk(name, mib)``: a tmpfs of ``mib`` MiB mounted at tmp_path/name (root only; skipped
    where mounting is not allowed), unmounted after the test."""
    mounted = []

    def mount(name: str, mib: int) -> Path:
        point = tmp_path / name
        point.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(point)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): a read-only or full disk needs one")
        mounted.append(point)
        return point

    yield mount
    for point in reversed(mounted):
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


@pytest.mark.parametrize("disk", ["read-only", "full"])
def test_a_resume_on_a_read_only_or_full_disk_is_one_line_before_any_server(two_iterations, small_disk,
                                                                            subprocess_env, tmp_path, disk):
    """Issue 49, 8: on a read-only run directory the resume printed Prefect ERROR lines and two
    tracebacks (Errno 30 on run.lock.vm) and no rlhf: line; on a full disk its line named the free
    space of the current directory's disk instead of the run directory's. Now each is one line that
    names the run directory's own disk, before any server starts."""
    import shutil

    source = two_iterations.pristine.root
    size = sum(p.stat().st_size for p in source.rglob("*") if p.is_file())
    point = small_disk("disk", size // 2**20 + 8)
    run = Path(shutil.copytree(source, point / "run", symlinks=True))
    if disk == "read-only":
        subprocess.run(["mount", "-o", "remount,ro", str(point)], check=True)
    else:
        with open(point / "filler", "wb") as fh:  # every block the tmpfs has left
            try:
                while True:
                    fh.write(bytes(1 << 20))
                    fh.flush()
            except OSError:
                pass
    out = subprocess.run([sys.executable, "-m", "rlhf_cli.main", "run", "--resume", str(run), "--iterations", "3"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300, env=subprocess_env())
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "ERROR" not in out.stderr, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("rlhf: error:")]
    assert len(errors) == 1, out.stderr[-3000:]
    if disk == "read-only":
        assert errors[0] == (f"rlhf: error: cannot resume {run}: run directory {run} cannot be written (Read-only file "
                             "system); the run writes its lock, records and checkpoints there: make it writable, or "
                             "copy it to a writable disk and use the copy")
    else:
        assert errors[0].startswith(f"rlhf: error: no space left on the device writing {run} (0 B free); "), errors
    assert "starting: the Prefect server" not in out.stderr


def test_export_prints_its_own_line_and_no_third_party_progress_bar(two_iterations, tmp_path, subprocess_env):
    """Issue 50: `rlhf export` printed transformers' weight-loading progress bars around its own line."""
    import shutil

    run = shutil.copytree(two_iterations.pristine.root, tmp_path / "run", symlinks=True)
    out = subprocess.run([sys.executable, "-m", "rlhf_cli.main", "export", str(run)], capture_output=True, text=True,
                         cwd=tmp_path, timeout=300, env=subprocess_env())
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == f"exported the last-good actor to {run / 'export' / 'actor'}"
    assert "%|" not in out.stderr and "Loading" not in out.stderr, out.stderr[-3000:]
