"""Shared fixtures: offline environment, the locally built tiny model, the GSM8K file from ../shared."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import CodeType, FrameType
from typing import Callable

import pytest

for key, value in {
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
    "DO_NOT_TRACK": "1", "MLFLOW_DISABLE_TELEMETRY": "true", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90", "DS_ACCELERATOR": "cpu",
}.items():
    os.environ.setdefault(key, value)
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    # one torch thread per test worker (`make test` runs two on two cores): two workers of two
    # threads each oversubscribe the cores and their OpenMP threads spin waiting for each other
    os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO_ROOT = Path(__file__).resolve().parent.parent
GSM8K_TRAIN = REPO_ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"


@pytest.fixture(scope="session")
def prefect_server():
    """One temporary Prefect server + SQLite database for the whole test session, shared by every
    test that needs a server; yields its API URL (subprocesses get it as PREFECT_API_URL so they
    report to the same server)."""
    import prefect.settings
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=90):
        yield prefect.settings.PREFECT_API_URL.value()


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def gsm8k_train() -> Path:
    """The real GSM8K train split; a user's clone has no ../shared, so tests skip there."""
    if not GSM8K_TRAIN.is_file():
        pytest.skip(f"GSM8K train split not found at {GSM8K_TRAIN} (it lives in ../shared beside the checkout)")
    return GSM8K_TRAIN


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The project's tiny Qwen2-style causal LM + BPE tokenizer, built once per test session."""
    from rlhf_core.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory) -> Path:
    """The tiny model with head_dim 32 (2 heads of 32, one KV head): vLLM's CPU attention kernels
    take head sizes 32, 64, 80, ... and refuse the default tiny model's 16."""
    from rlhf_core.models.tiny import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(hidden_size=64, num_attention_heads=2, num_key_value_heads=1)
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny_vllm", spec)


RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


@pytest.fixture(scope="session")
def subprocess_env():
    """``subprocess_env(**extra)``: this process's environment for a child process, without the
    rendezvous variables an earlier in-process update left (the child binds its own port; the one
    they name is still held here), plus ``extra``."""
    def make(**extra: str) -> dict[str, str]:
        return {**{k: v for k, v in os.environ.items() if k not in RENDEZVOUS}, **extra}

    return make


AS_FROM_A_TERMINAL = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                      "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); os.execv(sys.argv[1], sys.argv[1:])")


@pytest.fixture(scope="session")
def from_a_terminal():
    """``from_a_terminal(command)``: the command run with Ctrl-C as a terminal gives it (default
    disposition, not blocked). A shell's background job (CI's, maybe) or a signal state an earlier
    test left here would otherwise be inherited, and Python keeps ignoring a SIGINT that was ignored
    when it started. A launcher that execs the command (same pid), not a ``preexec_fn``: that forces
    a fork of this test process, which after many in-process DeepSpeed engines holds tens of GB of
    untouched virtual memory, and the kernel's overcommit check refuses to copy it (ENOMEM, as CI
    met); without one, subprocess starts the child with vfork."""
    import sys

    def wrap(command: list[str]) -> list[str]:
        return [sys.executable, "-c", AS_FROM_A_TERMINAL, *command]

    return wrap


@pytest.fixture(autouse=True)
def _isolated_state(tmp_path, monkeypatch, tiny_model_dir):
    """Each test gets its own RLHF_HOME so built models, MLflow stores and Prefect homes never leak.
    The tiny model is already there (a link to the session's build), as after `rlhf model build-tiny`:
    lookups never build it, and rebuilding it for every test would cost seconds each."""
    home = tmp_path.with_name(tmp_path.name + "-rlhf-home")  # beside tmp_path: tests list tmp_path's contents
    (home / "models").mkdir(parents=True)
    (home / "models" / "tiny").symlink_to(tiny_model_dir, target_is_directory=True)
    monkeypatch.setenv("RLHF_HOME", str(home))


# verl's GSM8K PPO quickstart (volcengine/verl docs/start/quickstart.rst), its 25 overrides verbatim
# except the four paths, which the test fills in ({train}, {val}, {model}).
VERL_QUICKSTART = """
data.train_files={train}
data.val_files={val}
data.train_batch_size=256
data.max_prompt_length=512
data.max_response_length=512
actor_rollout_ref.model.path={model}
actor_rollout_ref.actor.optim.lr=1e-6
actor_rollout_ref.actor.ppo_mini_batch_size=64
actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
actor_rollout_ref.rollout.name=vllm
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
actor_rollout_ref.rollout.tensor_model_parallel_size=1
actor_rollout_ref.rollout.gpu_memory_utilization=0.4
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4
critic.optim.lr=1e-5
critic.model.path={model}
critic.ppo_micro_batch_size_per_gpu=4
algorithm.kl_ctrl.kl_coef=0.001
trainer.logger=console
trainer.val_before_train=False
trainer.n_gpus_per_node=1
trainer.nnodes=1
trainer.save_freq=10
trainer.test_freq=10
trainer.total_epochs=15
""".split()


@pytest.fixture(scope="session")
def verl_quickstart():
    """verl_quickstart(train=..., val=..., model=...) -> the quickstart's overrides with those paths."""
    def fill(**paths: str) -> list[str]:
        return [line.format(**paths) for line in VERL_QUICKSTART]

    return fill


@pytest.fixture(scope="module")
def ray_cluster():
    """A real Ray cluster of two nodes on this machine (two raylets of 2 logical CPUs each), this
    process its driver; the tests that need it skip without the ray extra (make test-ray)."""
    ray = pytest.importorskip("ray", reason="needs the ray extra: pip install -e '.[ray]' (make test-ray)")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture
def call_path():
    """``call_path(target_code, run)``: the frames from a stage's Prefect task function (``run_stage``,
    tasks/stages.py, what Prefect calls) to the first call of ``target_code`` while ``run()`` runs,
    outermost first, as ``file:function`` — how deep the math sits below its task (docs/architecture.md).
    A profile hook records the stack when the target is entered."""

    def measure(target: CodeType, run: Callable[[], object]) -> list[str]:
        found: list[str] = []

        def hook(frame: FrameType, event: str, _arg) -> None:
            if event != "call" or found or frame.f_code is not target:
                return
            chain = []
            while frame is not None:
                chain.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}")
                if frame.f_code.co_name == "run_stage" and frame.f_code.co_filename.endswith("tasks/stages.py"):
                    break
                frame = frame.f_back
            found.extend(reversed(chain))

        sys.setprofile(hook)
        try:
            run()
        finally:
            sys.setprofile(None)
        assert found and found[0] == "stages.py:run_stage", found
        return found

    return measure
