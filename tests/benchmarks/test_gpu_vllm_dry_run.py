"""benchmarks/gpu/bench_vllm_resident.py's dry run on vLLM's CPU build (`make test-vllm`; skipped, saying
why, where vLLM is absent): the resident engine built, asleep and awake, new weights in place and the
originals back, the same calls as on the GPU, so the script cannot rot while no GPU machine with the
vLLM wheel is at hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_core.rollout.vllm_engine import vllm_unavailable_reason

REASON = vllm_unavailable_reason()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=f"needs vLLM: {REASON}"), pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def test_bench_vllm_resident_dry_run_checks_sleep_weights_and_restore(tmp_path, subprocess_env):
    out = tmp_path / "vllm_resident.json"
    env = subprocess_env(VLLM_CPU_KVCACHE_SPACE="1", VLLM_HOST_IP="127.0.0.1")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks/gpu/bench_vllm_resident.py"), "--dry-run",
                           "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    numbers = json.loads(out.read_text())
    assert numbers["cold_start_seconds"] > 0 and numbers["cold_over_resident"] > 1
    (round_,) = numbers["rounds"]
    assert round_["wake_same_tokens"] and round_["perturbed_tokens_differ"] and round_["original_tokens_restored"]
