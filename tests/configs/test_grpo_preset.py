"""The GSM8K GRPO preset loads and validates through `rlhf config show`, as a user runs it, carries
verl's GRPO example values and builds no critic."""

from __future__ import annotations

import json
from pathlib import Path

from rlhf_cli.main import main
from rlhf_core.config.loader import load_config
from rlhf_core.notes import said
from rlhf_core.config.resolve import uses_critic

REPO = Path(__file__).resolve().parents[2]
PRESET = REPO / "configs" / "gsm8k_grpo.yaml"
VERL_EXAMPLE = {  # examples/grpo_trainer/run_qwen2-7b.sh
    "algorithm.adv_estimator": "grpo", "algorithm.use_kl_in_reward": "False", "data.train_batch_size": "1024",
    "data.max_prompt_length": "512", "data.max_response_length": "1024", "actor_rollout_ref.actor.optim.lr": "1e-06",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "256", "actor_rollout_ref.actor.use_kl_loss": "True",
    "actor_rollout_ref.actor.kl_loss_coef": "0.001", "actor_rollout_ref.actor.kl_loss_type": "low_var_kl",
    "actor_rollout_ref.rollout.n": "5", "actor_rollout_ref.actor.entropy_coeff": "0.0",
}


def test_config_show_validates_the_grpo_preset(tmp_path, capsys):
    train = tmp_path / "gsm8k_train.jsonl"  # the preset's GSM8K path is outside the checkout in CI
    train.write_text(json.dumps({"question": "1 + 1?", "answer": "#### 2"}) + "\n")
    code = main(["config", "show", "--flat", "-c", str(PRESET), f"data.train_files=[{train}]",
                 "actor_rollout_ref.model.path=tiny"])
    out, err = capsys.readouterr()
    assert code == 0, err
    flat = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    assert {k: flat[k] for k in VERL_EXAMPLE} == VERL_EXAMPLE
    assert any("uses no critic" in line for line in said())  # said once per process: maybe by an earlier test


def test_the_grpo_preset_has_no_critic_unless_asked():
    cfg = load_config(PRESET, ["actor_rollout_ref.model.path=tiny"])
    assert not uses_critic(cfg)
    assert uses_critic(load_config(PRESET, ["actor_rollout_ref.model.path=tiny", "critic.enable=true"]))
