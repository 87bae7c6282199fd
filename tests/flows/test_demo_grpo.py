"""`rlhf demo --grpo` is the demo preset with GRPO and four responses per prompt: through the real
CLI and flow (validation only, on the tiny model), the run's saved config holds both keys and the
run builds no critic."""

from __future__ import annotations

import pytest

from rlhf_cli.main import main
from rlhf_core.config import load_config
from rlhf_core.notes import said
from rlhf_core.run.layout import RunDir

pytestmark = [pytest.mark.prefect]


def test_demo_grpo_runs_the_demo_preset_with_grpo(prefect_server, tiny_overrides, tmp_path):
    runs = tmp_path / "runs"
    assert main(["demo", "--grpo", "--run-name", "g", *tiny_overrides(runs, "trainer.val_only=true")]) == 0
    run = RunDir(runs / "g")
    cfg = load_config(run.config_path)
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.actor_rollout_ref.rollout.n == 4
    assert cfg.data.data_source == "arith"  # the demo preset underneath
    assert not run.critic_init.exists()
    assert any("uses no critic" in line for line in said())  # said once per process: maybe by an earlier test
