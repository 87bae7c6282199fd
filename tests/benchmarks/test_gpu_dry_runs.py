"""The GPU scripts (benchmarks/gpu/) run their dry runs here, on the CPU at a small shape, through the
same code as on the GPU: a GPU machine is lent rarely, so a script that broke between two loans
would waste one. The vLLM script's dry run needs vLLM's CPU build (tests/benchmarks/test_gpu_vllm_dry_run.py, in
`make test-vllm`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GPU = REPO / "benchmarks" / "gpu"

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]


def _dry_run(args: list[str], out: Path, subprocess_env, timeout: float = 300) -> subprocess.CompletedProcess:
    env = subprocess_env(OUT=str(out), PYTHON=sys.executable, RLHF_HOME=str(out / "home"))
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_bench_h200_dry_run_samples_scores_and_updates_through_one_update_trainer(tmp_path, subprocess_env):
    """bench_h200.sh --dry-run: the model built, HF sampling, the advantages table in today's schema,
    the initial critic's setup stage and ``one_update_trainer``, the numbers written."""
    _dry_run(["bash", str(GPU / "bench_h200.sh"), "--dry-run"], tmp_path, subprocess_env)
    numbers = json.loads((tmp_path / "bench_h200.json").read_text())
    assert numbers["rollout_new_tokens"] == 4 * 8  # every sequence sampled to exactly --new-tokens
    assert numbers["perf/tokens_per_s"] > 0 and numbers["perf/actor_tokens_per_s"] > 0
    assert 0 < numbers["mfu"] < 1


def test_bench_h200_refuses_a_mini_batch_larger_than_the_batch_in_one_line(tmp_path, subprocess_env):
    """A mini-batch the batch cannot hold is the command line's mistake: one line before anything is
    built (it was a ConfigError traceback after the model build; without --mini-batch it is derived)."""
    env = subprocess_env(RLHF_HOME=str(tmp_path / "home"))
    proc = subprocess.run([sys.executable, str(GPU / "bench_h200.py"), "--small", "--device", "cpu", "--batch", "8",
                           "--mini-batch", "16"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith("--mini-batch 16 must be between 1 and --batch 8 (sequences "
                                                         "per optimizer step out of the batch)"), proc.stderr
    assert not (tmp_path / "home").exists()


def test_device_check_dry_run_runs_every_step_and_writes_its_files(tmp_path, subprocess_env):
    """device_check.sh --dry-run: the environment, the gpu-marked tests (skipped on the CPU), the demo
    through `rlhf demo` and `rlhf status`/`query`, the quickstart iteration through `rlhf run` with the
    static decode; every step ok and its files written (what the GPU run brings back)."""
    out = tmp_path / "out"
    _dry_run(["bash", str(GPU / "device_check.sh"), "--dry-run", str(out)], tmp_path, subprocess_env, timeout=1200)
    summary = (out / "summary.md").read_text()
    for step in ("env", "gpu_tests", "demo", "status", "quickstart"):
        assert f"| {step} | ok |" in summary, summary
    assert {p.name for p in out.iterdir()} == {"summary.md", "env.txt", "gpu_tests.txt", "demo.txt", "quickstart.txt",
                                               "quickstart.json", "quickstart.md"}
    assert "2 skipped" in (out / "gpu_tests.txt").read_text()  # collected, and skipped without CUDA
    assert "last-good: iteration 1" in (out / "demo.txt").read_text()
    result = json.loads((out / "quickstart.json").read_text())
    rows = result["iterations"]
    assert rows and all(r["seconds"]["rollout"] > 0 and r["update_tokens_per_s"] > 0 for r in rows)
    assert {m["phase"] for m in result["memory"]} >= {"update", "scoring"}
    assert all(m["measured_bytes"] > 0 for m in result["memory"])
    assert "| update |" in (out / "quickstart.md").read_text()


def test_every_gpu_test_is_in_the_files_the_device_check_runs():
    """The device check runs `pytest -m gpu` on its GPU_TESTS files only (collecting the whole suite
    would cost the GPU machine's minutes): a test marked gpu anywhere else would never run.
    (The vLLM dry run is tests/benchmarks/test_gpu_vllm_dry_run.py, in `make test-vllm`.)"""
    import re

    listed = set(re.search(r'^GPU_TESTS="([^"]+)"', (GPU / "device_check.sh").read_text(), re.M).group(1).split())
    marked = {str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")
              if re.search(r"^\s*@pytest\.mark\.gpu\b|pytestmark.*pytest\.mark\.gpu\b", p.read_text(), re.M)}
    assert marked and marked <= listed, sorted(marked - listed)
    assert all((REPO / path).is_file() for path in listed)


def test_the_wheelhouse_carries_what_the_gpu_host_lacks_and_never_its_cuda_stack(tmp_path):
    """`make wheelhouse`'s choice, on this checkout's own environment and the H200 host's package list:
    the project's services and DeepSpeed travel, the host's torch and CUDA libraries never do, and a
    host that lacks a package gets it."""
    script = REPO / "benchmarks" / "gpu" / "wheelhouse.py"
    out = subprocess.run([sys.executable, str(script), "--dry-run", "--venv-python", sys.executable],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    carried = {line.split()[1].split("==")[0].lower() for line in out.stdout.splitlines() if line.startswith("  carry ")}
    left = {line.split()[1].rstrip(":") for line in out.stdout.splitlines() if line.startswith("  leave ")}
    assert {"deepspeed", "prefect", "duckdb", "mlflow-skinny", "pydantic"} <= carried, carried
    assert {"torch", "numpy", "transformers", "pyarrow"} <= left and not carried & {"torch", "triton"}
    bare = tmp_path / "host.txt"
    bare.write_text("torch==2.11.0\n")  # a host with nothing but torch: numpy must travel
    out = subprocess.run([sys.executable, str(script), "--dry-run", "--venv-python", sys.executable,
                          "--host-packages", str(bare)], capture_output=True, text=True, timeout=120)
    assert "  carry numpy==" in out.stdout and "  leave torch: the host's CUDA stack" in out.stdout
    out = subprocess.run([sys.executable, str(script), "--dry-run", "--python", "twelve"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "--python 'twelve': give the host's Python as 3.N" in out.stderr
