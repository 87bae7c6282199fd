"""The KL-guard halt (trainer.on_kl_breach=halt) reaches the terminal of `rlhf run` as its one
line, exit 3: no Prefect traceback above it, no 'Finished in state Failed' (issue 18)."""

from __future__ import annotations

import subprocess
import sys

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
