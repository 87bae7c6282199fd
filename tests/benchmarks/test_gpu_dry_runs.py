"""The GPU scripts (benchmarks/gpu/) run their dry runs here, on the CPU at a small shape, through the
same code as on the GPU: a GPU machine is lent rarely, so a script that broke between two loans
would waste one. The vLLM script's dry run needs vLLM's CPU build (tests/benchmarks/test_gpu_vllm_dry_run.py,
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


def test_bench_h200_dry_run_samples_scores_and_updates_through_update_once(tmp_path, subprocess_env):
    """bench_h200.sh --dry-run: the model built, HF sampling, the advantages table in today's schema,
    the initial critic's setup stage and ``update_once``, the numbers written."""
    _dry_run(["bash", str(GPU / "bench_h200.sh"), "--dry-run"], tmp_path, subprocess_env)
    numbers = json.loads((tmp_path / "bench_h200.json").read_text())
    assert numbers["rollout_new_tokens"] == 4 * 8  # every sequence sampled to exactly --new-tokens
    assert numbers["perf/tokens_per_s"] > 0 and numbers["perf/actor_tokens_per_s"] > 0
    assert 0 < numbers["mfu"] < 1
