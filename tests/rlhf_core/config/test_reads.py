"""A settings builder's parameters are the config keys it reads: ``build`` passes their values,
``config_keys`` lists them for the stage's config hash."""

from __future__ import annotations

from typing import Annotated, Optional

import pytest

from rlhf_core.config import ConfigError, RLHFConfig, load_config
from rlhf_core.config.loader import config_hash, flatten
from rlhf_core.config.reads import Algorithm, At, Built, CriticEnable, build, config_keys, config_values
from rlhf_core.stages import gae, guard, init_critic, pack, preprocess, rollout, score, validate
from rlhf_core.stages import update
from rlhf_core.stages.settings import generation, reward_settings
from rlhf_core.training.settings import engine_settings, run_length, update_keys, update_settings, update_world


def _builder(gamma: Annotated[float, At("algorithm.gamma")], algorithm: Algorithm,
             critic_enable: CriticEnable) -> tuple:
    return gamma, algorithm, critic_enable


def test_build_passes_each_parameter_the_value_at_its_key():
    cfg = load_config(None, ["algorithm.gamma=0.5", "critic.enable=true"])
    gamma, algorithm, critic_enable = build(_builder, cfg)
    assert (gamma, critic_enable) == (0.5, True)
    assert algorithm is cfg.algorithm  # a section is passed as it is


def test_config_keys_name_each_key_once_in_order_and_values_read_them():
    assert config_keys(_builder) == ("algorithm.gamma", "algorithm.", "critic.enable")
    assert config_keys(_builder, _builder) == config_keys(_builder)
    cfg = load_config(None, ["algorithm.gamma=0.25"])
    assert config_values(_builder, cfg)["algorithm.gamma"] == 0.25


def _outer(seed: Annotated[int, At("trainer.seed")], inner: Annotated[tuple, Built(_builder)]) -> tuple:
    return seed, inner


def test_a_built_parameter_is_its_builders_settings_and_its_keys_are_the_outer_builders():
    cfg = load_config(None, ["algorithm.gamma=0.5", "trainer.seed=3"])
    seed, (gamma, _, _) = build(_outer, cfg)
    assert (seed, gamma) == (3, 0.5)
    assert config_keys(_outer) == ("trainer.seed", "algorithm.gamma", "algorithm.", "critic.enable")
    assert config_values(_outer, cfg)["algorithm.gamma"] == 0.5


def test_an_unhashed_key_is_read_but_left_out_of_the_hash():
    cfg = load_config(None, ["trainer.device=cpu"])
    assert build(generation, cfg).device == "cpu"
    assert "trainer.device" not in config_keys(generation)
    assert rollout.config_sections(cfg) == config_keys(generation)  # a plain rollout: generation's keys


def test_a_part_read_only_when_its_decider_says_so_is_none_and_unhashed_otherwise():
    plain = load_config(None, ["actor_rollout_ref.rollout.n=4"])
    filtered = load_config(None, ["actor_rollout_ref.rollout.n=4", "algorithm.filter_groups.enable=true"])
    assert build(rollout.rollout_settings, plain).filter_groups is None
    assert build(rollout.rollout_settings, filtered).filter_groups is filtered.algorithm.filter_groups
    added = set(config_keys(rollout.rollout_settings, cfg=filtered)) - set(config_keys(rollout.rollout_settings, cfg=plain))
    assert added == {"algorithm.filter_groups.", "algorithm.use_kl_in_reward", "reward_model.", "custom_reward_function."}
    # the deciding key itself is not hashed: the key set differs instead
    assert "algorithm.filter_groups.enable" not in config_keys(rollout.rollout_settings, cfg=plain)
    with pytest.raises(TypeError, match=r"reads dynamic_sampling only when filters_groups says so.*cfg=cfg"):
        config_keys(rollout.rollout_settings)


def test_a_reward_model_adds_its_batching_keys_only_when_it_scores():
    rule = load_config(None, [])
    model = load_config(None, ["reward_model.enable=true", "reward_model.model.path=data/models/demo"])
    assert build(reward_settings, rule).reward_model is None
    assert build(reward_settings, model).reward_model is not None
    assert (set(config_keys(reward_settings, cfg=model)) - set(config_keys(reward_settings, cfg=rule))
            == {"critic.use_dynamic_bsz", "actor_rollout_ref.actor.use_dynamic_bsz",
                "critic.forward_max_token_len_per_gpu", "critic.ppo_max_token_len_per_gpu"})


def _with_world(gamma: Annotated[float, At("algorithm.gamma")], *, world_size: int) -> tuple:
    return gamma, world_size


def _outer_with_world(part: Annotated[tuple, Built(_with_world)], seed: Annotated[int, At("trainer.seed")], *,
                      world_size: int) -> tuple:
    return part, seed, world_size


def test_a_keyword_only_parameter_without_a_key_is_the_callers_and_reaches_built_parts():
    cfg = load_config(None, ["algorithm.gamma=0.5", "trainer.seed=3"])
    assert build(_outer_with_world, cfg, world_size=4) == ((0.5, 4), 3, 4)
    assert config_keys(_outer_with_world) == ("algorithm.gamma", "trainer.seed")
    with pytest.raises(TypeError, match="world_size"):
        build(_outer_with_world, cfg)


UPDATE_KEYS = ("actor_rollout_ref.actor.", "actor_rollout_ref.model.", "critic.", "algorithm.adv_estimator",
               "actor_rollout_ref.rollout.n", "actor_rollout_ref.rollout.temperature", "data.max_response_length",
               "algorithm.rollout_correction.", "trainer.seed", "trainer.critic_warmup", "trainer.nproc",
               "trainer.nnodes", "trainer.n_gpus_per_node", "trainer.device", "data.train_batch_size")
"""The keys every state id recorded so far hashes (``lineage.state_id``): a change here changes the id
of every run directory's states, which needs a run-format migration (``run.migrate``)."""
STEP_KEYS = ("trainer.total_iterations", "trainer.total_training_steps", "trainer.total_epochs")


def _hashed(keys: tuple[str, ...]) -> set[str]:
    """``keys`` less those a section among them covers already (the hash is the same)."""
    return {k for k in keys if not any(k != other and other.endswith(".") and k.startswith(other) for other in keys)}


def test_the_update_hashes_its_builders_keys_which_are_the_recorded_ones():
    cfg = load_config(None, [])
    assert update.config_sections(cfg) == update_keys(cfg) == config_keys(
        update_settings, engine_settings, update_world, run_length, cfg=cfg)
    assert _hashed(update_keys(cfg)) == set(UPDATE_KEYS)
    cosine = load_config(None, ["critic.optim.lr_scheduler_type=cosine"])  # the run's length now matters
    assert _hashed(update_keys(cosine)) == set(UPDATE_KEYS + STEP_KEYS)
    before = config_hash(cfg, update_keys(cfg))
    assert config_hash(load_config(None, ["trainer.total_epochs=3"]), update_keys(cfg)) == before
    assert config_hash(load_config(None, ["actor_rollout_ref.actor.clip_ratio=0.3"]), update_keys(cfg)) != before


def test_a_section_read_whole_can_hash_a_few_of_its_keys_and_says_why_not_the_rest():
    keys = config_keys(validate.validation_generation)
    assert "actor_rollout_ref.rollout.val_kwargs." in keys and "actor_rollout_ref.rollout." not in keys
    cfg = load_config(None, [])
    before = config_hash(cfg, validate.config_sections(cfg))
    training_sampling = load_config(None, ["actor_rollout_ref.rollout.top_p=0.5", "actor_rollout_ref.rollout.n=3"])
    assert build(validate.validation_generation, training_sampling).rollout.top_p == 0.5  # read, for the engine
    assert config_hash(training_sampling, validate.config_sections(training_sampling)) == before
    val_sampling = load_config(None, ["actor_rollout_ref.rollout.val_kwargs.n=3"])
    assert config_hash(val_sampling, validate.config_sections(val_sampling)) != before
    with pytest.raises(TypeError, match="unhashed= must say why"):
        At("actor_rollout_ref.rollout.", only=("seed",))


def test_a_parameter_without_a_key_is_named():
    def builder(gamma: Annotated[float, At("algorithm.gamma")], lam: Optional[float]) -> float:
        return gamma

    with pytest.raises(TypeError, match=r"builder: parameter 'lam' names no config key.*At\('<dotted key>'\)"):
        config_keys(builder)


@pytest.mark.parametrize("stage, builder", [(gae, gae.gae_settings), (pack, pack.pack_settings),
                                            (preprocess, preprocess.preprocess_settings),
                                            (init_critic, init_critic.init_critic_settings),
                                            (guard, guard.guard_config), (score, score.score_settings),
                                            (rollout, rollout.rollout_settings),
                                            (validate, validate.validation_settings)])
def test_a_stage_hashes_exactly_the_keys_its_builder_reads(stage, builder):
    """The stage's config sections are its builder's keys: a key the builder takes changes the hash,
    one outside them does not."""
    cfg = load_config(None, [])
    assert stage.config_sections(cfg) == config_keys(builder, cfg=cfg)
    before = config_hash(cfg, stage.config_sections(cfg))
    untouched = load_config(None, ["trainer.experiment_name=another"])  # no builder above reads it
    assert config_hash(untouched, stage.config_sections(untouched)) == before
    flipped = _one_number_changed(cfg, config_keys(builder, cfg=cfg))
    assert config_hash(flipped, stage.config_sections(flipped)) != before


def _one_number_changed(cfg: RLHFConfig, keys: tuple[str, ...]) -> RLHFConfig:
    """``cfg`` with the first number under ``keys`` that the config accepts plus seven."""
    for leaf, value in flatten(cfg).items():
        if leaf.startswith(keys) and isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return load_config(None, [f"{leaf}={value + 7}"])
            except ConfigError:
                continue
    raise AssertionError(f"no number under {keys} to change")
