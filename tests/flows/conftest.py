"""A tiny configuration that runs the whole pipeline on CPU in about a minute per two iterations,
and helpers that compare whole runs (the session's one Prefect server is ``tests/conftest.py``'s)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlhf_core.run.layout import RunDir

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"


@pytest.fixture(scope="session")
def demo_preset() -> str:
    return str(DEMO)


@pytest.fixture(scope="session")
def tiny_overrides(tiny_model_dir):
    """``tiny_overrides(runs_root, *extra)``: configs/demo.yaml shrunk to 4 prompts per iteration,
    12-token responses, 4 validation prompts, one PPO mini-batch; every checkpoint kept so tests can
    compare them."""

    def make(runs_root: Path, *extra: str) -> list[str]:
        return _tiny(tiny_model_dir, runs_root, *extra)

    return make


def _tiny(tiny_model_dir: Path, runs_root: Path, *extra: str) -> list[str]:
    return [
        f"actor_rollout_ref.model.path={tiny_model_dir}", f"trainer.runs_root={runs_root}",
        "actor_rollout_ref.model.warm_start.enable=false",
        "data.train_batch_size=4", "data.max_val_samples=4", "data.max_response_length=12",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1024",
        "actor_rollout_ref.rollout.generation_batch_tokens=2048",
        "trainer.test_freq=2", "trainer.save_freq=1", "trainer.max_ckpt_to_keep=5", "trainer.device=cpu",
        "trainer.export_min_val_score=0.0", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", *extra,
    ]


@pytest.fixture(scope="module")
def shared_home(tmp_path_factory) -> Path:
    """A state directory (MLflow store) shared by the tests of one module, which reuse one run."""
    return tmp_path_factory.mktemp("home")


# comparing whole runs bit for bit (resident, worker-group and reloading designs) --------------

TABLES = ("rollout", "scored", "advantages")


def _weights(checkpoint: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for role in ("actor", "critic"):
        for f in sorted((checkpoint / role).glob("*.safetensors")):
            out.update({f"{role}/{k}": v for k, v in load_file(str(f)).items()})
    return out


def _assert_same_weights(a: Path, b: Path) -> None:
    import torch

    wa, wb = _weights(a), _weights(b)
    assert wa and sorted(wa) == sorted(wb)
    different = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not different, f"{len(different)} tensors differ between {a} and {b}, e.g. {different[:3]}"


def _assert_same_tables(a, b, iterations) -> None:
    """Every column equal, bit for bit — the rollout engine's log-probs too: a module the trainer
    lends computes as its checkpoint loaded from disk does (``training.resident``)."""
    import pyarrow.parquet as pq

    for k in iterations:
        for name in TABLES:
            ta, tb = (pq.read_table(getattr(r, name)(k)) for r in (a, b))
            assert ta.column_names == tb.column_names
            differing = [c for c in ta.column_names if not ta[c].equals(tb[c])]
            assert not differing, f"iteration {k} {name}: columns {differing} differ"


@pytest.fixture(scope="session")
def same_weights():
    """``same_weights(checkpoint_a, checkpoint_b)``: every actor and critic tensor equal."""
    return _assert_same_weights


@pytest.fixture(scope="session")
def same_tables():
    """``same_tables(run_a, run_b, iterations)``: the rollout, scored and advantages tables equal."""
    return _assert_same_tables


@pytest.fixture(scope="session")
def flow_run(demo_preset, tiny_overrides):
    """``flow_run(runs_root, name, *overrides, iterations=N, resume=None)``: the pipeline flow on the
    tiny demo config, in this process; returns its summary."""
    from flows.pipeline import PipelineParams, rlhf_pipeline

    def run(runs: Path, name: str, *extra: str, iterations: int, resume=None) -> dict:
        if resume:
            return rlhf_pipeline(PipelineParams(resume=str(resume), overrides=list(extra), iterations=iterations))
        return rlhf_pipeline(PipelineParams(config=demo_preset, overrides=tiny_overrides(runs, *extra),
                                            iterations=iterations, run_name=name))

    return run


@pytest.fixture(scope="session")
def two_iterations(prefect_server, demo_preset, tiny_overrides, tmp_path_factory):
    """The whole pipeline flow, 2 iterations of the tiny model, run once per session (~40 s): the
    pipeline test asserts on it and then reruns its stages; the README's commands run against
    ``pristine``, a copy taken before any test touched it (a run directory works where it is copied).
    ``home``: the RLHF_HOME it ran under (its MLflow store)."""
    from flows.pipeline import PipelineParams, rlhf_pipeline

    home, runs = tmp_path_factory.mktemp("home"), tmp_path_factory.mktemp("runs")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLHF_HOME", str(home))
        started = time.perf_counter()
        summary = rlhf_pipeline(PipelineParams(config=demo_preset, overrides=tiny_overrides(runs),
                                               iterations=2, run_name="two"))
        seconds = time.perf_counter() - started
    print(f"\n[timing] 2-iteration tiny flow: {seconds:.1f} s wall")
    pristine = tmp_path_factory.mktemp("pristine") / "two"
    shutil.copytree(summary["run_dir"], pristine, symlinks=True)
    return SimpleNamespace(summary=summary, run=RunDir(summary["run_dir"]), seconds=seconds, home=home,
                           pristine=RunDir(pristine))


@pytest.fixture(scope="session")
def killed_run(prefect_server, demo_preset, tiny_overrides, subprocess_env):
    """``killed_run(runs_root, name, *overrides, iterations=N, at=WRITE)``: `rlhf run` on the tiny demo
    config in its own process, killed (as kill -9 would: the fault hook, exit 137) just before the
    atomic write ``at`` lands; returns its run directory."""
    import subprocess
    import sys

    from rlhf_core.run.layout import RunDir

    def run(runs: Path, name: str, *extra: str, iterations: int, at: str):
        env = subprocess_env(PREFECT_API_URL=prefect_server, RLHF_FAULT=f"before_rename:{at}")
        proc = subprocess.run([sys.executable, "-m", "rlhf_cli.main", "run", "-c", demo_preset,
                               *tiny_overrides(runs, *extra), "--iterations", str(iterations), "--run-name", name],
                              env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 137, proc.stdout[-3000:] + proc.stderr[-3000:]
        return RunDir(runs / name)

    return run


@pytest.fixture
def score_rerun_rebuilds(tmp_path, subprocess_env):
    """``score_rerun_rebuilds(run)``: on a copy of ``run``, whose iteration 1 state lived only in
    memory, `rlhf stage score --local -k 2 --force` rebuilds that state by replay (keeping it as a
    checkpoint) and scores iteration 2 to the same table."""
    import shutil
    import subprocess
    import sys

    import pyarrow.parquet as pq

    from rlhf_core.run.layout import RunDir

    def check(run) -> None:
        copy = RunDir(shutil.copytree(run.root, tmp_path / "copy"))
        before = pq.read_table(copy.scored(2))
        assert not copy.checkpoint(1).exists()  # iteration 2 started from iteration 1's state: memory only
        proc = subprocess.run([sys.executable, "-m", "rlhf_cli.main", "stage", "score", "--local", "--run-dir",
                               str(copy.root), "--iteration", "2", "--force"], env=subprocess_env(),
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert copy.checkpoint(1).is_dir()  # rebuilt by replay, kept for the next rerun
        after = pq.read_table(copy.scored(2))
        assert all(after[c].equals(before[c]) for c in before.column_names)

    return check


@pytest.fixture
def rlhf(prefect_server, subprocess_env):
    """``rlhf(*args, **env)``: the real command line in a child process, on the test Prefect server."""
    import subprocess
    import sys

    def run(*args: str, **env: str) -> "subprocess.CompletedProcess":
        return subprocess.run([sys.executable, "-m", "rlhf_cli.main", *args],
                              env=subprocess_env(PREFECT_API_URL=prefect_server, **env),
                              capture_output=True, text=True, timeout=900)

    return run
