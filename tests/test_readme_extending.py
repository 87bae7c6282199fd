"""The README's "Extending" examples run as written: the estimator registers and a config naming
it loads without a critic, and the reward function scores through custom_reward_function.path."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from rlhf_core.algos.registry import ADV_ESTIMATORS, accepted_kwargs, get_adv_estimator, register_adv_estimator
from rlhf_core.config import load_config
from rlhf_core.config.resolve import uses_critic
from rlhf_core.rewards.registry import get_reward_fn

README = Path(__file__).resolve().parents[1] / "README.md"


def _section() -> str:
    return README.read_text(encoding="utf-8").split("## Extending", 1)[1].split("\n## ", 1)[0]


def _example(after: str) -> str:
    """The first python block of the README's Extending section after the words ``after``."""
    return re.search(r"```python\n(.*?)```", _section().split(after, 1)[1], flags=re.DOTALL).group(1)


def test_every_python_example_of_the_section_is_run_below():
    examples = re.findall(r"```python\n(.*?)```", _section(), flags=re.DOTALL)
    assert examples == [_example("**A new advantage estimator**"), _example("**A new reward**")]


def test_the_estimator_example_registers_and_runs_without_a_critic():
    namespace = {"register_adv_estimator": register_adv_estimator, "torch": torch}
    exec(_example("**A new advantage estimator**"), namespace)
    try:
        cfg = load_config(None, ["algorithm.adv_estimator=sign_of_reward"])
        assert not uses_critic(cfg)
        estimator = get_adv_estimator("sign_of_reward")
        rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, -2.0, 0.0]])
        mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
        offered = dict(token_level_rewards=rewards, response_mask=mask, values=torch.zeros(2, 3), gamma=1.0)
        advantages, returns = estimator(**accepted_kwargs(estimator, offered))
        assert advantages.tolist() == [[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]] and torch.equal(advantages, returns)
    finally:
        ADV_ESTIMATORS.unregister("sign_of_reward")


def test_the_reward_example_scores_through_custom_reward_function_path(tmp_path):
    module = tmp_path / "my_reward.py"
    module.write_text(_example("**A new reward**"))
    cfg = load_config(None, [f"custom_reward_function.path={module}", "custom_reward_function.name=compute_score"])
    score = get_reward_fn(cfg.custom_reward_function)
    assert score("anything", "so the answer is 42", "42") == 1.0
    assert score("anything", "no idea", "42") == 0.0
