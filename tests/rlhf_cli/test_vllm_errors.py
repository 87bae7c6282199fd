"""What vLLM's CPU build cannot run is one `rlhf: error:` line through the console script (issue 43):
the head size its attention kernels lack and a VLLM_CPU_KVCACHE_SPACE it cannot allocate, before
anything starts (config load: no run directory, no Prefect server); a KV cache that passes that
check but not the free RAM when the engine starts, translated with the project's hint for the CPU
(vLLM's own advice, to raise gpu_memory_utilization, does nothing there). Runs in .venv-vllm
(`make test-vllm`); skips elsewhere."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from rlhf_core.config.machine import cuda_devices, vllm_cpu_build

pytestmark = pytest.mark.skipif(not vllm_cpu_build() or cuda_devices() > 0,
                                reason="needs vLLM's CPU build (vllm-cpu) on a machine without CUDA")

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"
VLLM_ADVICE = "gpu_memory_utilization` when initializing"  # vLLM's: raise it (nothing on CPU)


def _rlhf(tmp_path: Path, *args: str, kv_cache: str = "1", api: str | None = None,
          timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(RLHF_HOME=str(tmp_path / "home"), VLLM_CPU_KVCACHE_SPACE=kv_cache, VLLM_HOST_IP="127.0.0.1")
    if api:
        env["PREFECT_API_URL"] = api
    exe = shutil.which("rlhf", path=str(Path(sys.executable).parent)) or "rlhf"
    return subprocess.run([exe, *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=timeout)


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    errors = [line for line in proc.stderr.splitlines() if line.startswith("rlhf: error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and VLLM_ADVICE not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    return errors[0]


def _nothing_started(tmp_path: Path) -> None:
    assert not (tmp_path / "runs").exists()
    assert not (tmp_path / "home" / "prefect" / "temporary-server.log").exists()


def test_the_default_tiny_model_is_refused_at_load_with_the_fix(tmp_path):
    proc = _rlhf(tmp_path, "run", "actor_rollout_ref.rollout.name=vllm", f"trainer.runs_root={tmp_path / 'runs'}")
    line = _one_error_line(proc)
    assert "model 'tiny' has attention head size 16 (hidden_size 64 / 4 heads)" in line, line
    assert "--heads 2 --kv-heads 1" in line and "actor_rollout_ref.rollout.name=hf" in line, line
    _nothing_started(tmp_path)


@pytest.mark.parametrize("kv_cache, why", [("0", "leaves the KV cache no room"),
                                           ("1.5", "is not a whole number of GiB"),
                                           ("100000", "is more than this machine's")])
def test_a_kv_cache_size_vllm_cannot_allocate_is_refused_at_load(tmp_path, vllm_model_dir, kv_cache, why,
                                                                 monkeypatch, capsys):
    """In this process (`main`, the console script's function: seconds, not a new interpreter each)."""
    from rlhf_cli.main import main

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", kv_cache)
    monkeypatch.setenv("RLHF_HOME", str(tmp_path / "home"))
    code = main(["run", "actor_rollout_ref.rollout.name=vllm", f"actor_rollout_ref.model.path={vllm_model_dir}",
                 f"trainer.runs_root={tmp_path / 'runs'}"])
    line = _one_error_line(subprocess.CompletedProcess([], code, *capsys.readouterr()))
    assert f"VLLM_CPU_KVCACHE_SPACE={kv_cache} {why}" in line, line
    assert "gpu_memory_utilization does not size it on CPU" in line and "VLLM_CPU_KVCACHE_SPACE=1" in line, line
    _nothing_started(tmp_path)


def test_a_kv_cache_larger_than_the_free_ram_at_engine_start_is_one_line(tmp_path, vllm_model_dir, prefect_server):
    """All of the RAM as KV cache passes the load check (it is no more than the RAM) and fails when
    the engine starts (this process and the system use some): vLLM's ValueError, translated."""
    memory = psutil.virtual_memory()
    gib = int(memory.total / 2 ** 30)
    if memory.available > (gib - 1) * 2 ** 30:
        pytest.skip(f"{memory.available / 2 ** 30:.1f} GiB free: {gib} GiB of KV cache might be allocated")
    proc = _rlhf(tmp_path, "run", "-c", str(DEMO), "actor_rollout_ref.rollout.name=vllm",
                 f"actor_rollout_ref.model.path={vllm_model_dir}", "actor_rollout_ref.model.warm_start.enable=false",
                 "data.max_val_samples=4", f"trainer.runs_root={tmp_path / 'runs'}", kv_cache=str(gib),
                 api=prefect_server)  # the session's server: no temporary one to start
    line = _one_error_line(proc)
    assert f"the vllm rollout engine has no room for its KV cache (VLLM_CPU_KVCACHE_SPACE={gib} GiB)" in line, line
    assert "vLLM says \"Available memory on node" in line and "gpu_memory_utilization does not size it" in line, line


def test_tensor_parallel_with_one_update_process_says_what_it_costs_and_reads_the_actor_from_disk(tmp_path,
                                                                                                   vllm_model_dir):
    """Its engines' ranks are torchrun processes of each launch: they read the actor from disk, so
    the models are not kept resident (they were, and iteration 2's rollout found no checkpoint); the
    config says once what that costs and what keeps one engine for the run."""
    from rlhf_core.config import load_config
    from rlhf_core.training.run_trainer import resident_possible

    tp = [f"actor_rollout_ref.model.path={vllm_model_dir}", "actor_rollout_ref.rollout.name=vllm",
          "actor_rollout_ref.rollout.tensor_model_parallel_size=2"]
    proc = _rlhf(tmp_path, "config", "show", *tp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    notes = [line for line in proc.stderr.splitlines() if "tensor_model_parallel_size=2" in line]
    assert len(notes) == 1 and "starts its vLLM engines afresh" in notes[0] and "trainer.nproc=2" in notes[0], notes
    assert "with one update process" in resident_possible(load_config(None, tp))
    assert resident_possible(load_config(None, [*tp, "trainer.nproc=2"])) is None  # the worker group keeps it
