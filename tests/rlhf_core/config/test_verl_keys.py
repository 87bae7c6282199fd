"""A verl user's keys load: renamed spellings move, no-effect knobs are named once, values this
project cannot honour are refused with the fix, and what the machine cannot do falls back."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import subprocess
import sys

import pytest

from rlhf_core.algos.registry import ADV_ESTIMATORS
from rlhf_core.config import ConfigError, flatten, load_config, valid_keys
from rlhf_core import notes
from rlhf_core.config import verl_keys
from rlhf_core.config.machine import fit_to_machine


@pytest.fixture
def said(monkeypatch, caplog):
    """Fresh 'said once' memory; returns the config notes logged during the test."""
    monkeypatch.setattr(notes, "_SAID", {})
    caplog.set_level(logging.WARNING, logger="rlhf.config")
    return lambda: [r.getMessage() for r in caplog.records if r.name == "rlhf.config"]


def test_quickstart_overrides_load_with_verl_meanings(verl_quickstart, said):
    cfg = load_config(None, verl_quickstart(train="t.parquet", val="v.parquet", model="tiny"))
    a, r = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    assert cfg.data.val_files == ["v.parquet"] and cfg.data.train_batch_size == 256
    assert a.ppo_mini_batch_size == 64 and a.ppo_micro_batch_size_per_gpu == 4
    assert r.log_prob_micro_batch_size_per_gpu == 8 and cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu == 4
    assert cfg.critic.ppo_micro_batch_size_per_gpu == 4 and cfg.critic.optim.lr == 1e-5
    assert cfg.trainer.logger == ["console"] and cfg.trainer.val_before_train is False
    assert cfg.trainer.total_epochs == 15 and cfg.trainer.test_freq == 10 and cfg.trainer.save_freq == 10
    assert r.name == "hf"  # no CUDA here: vLLM falls back, saying so once
    assert any("rollout.name=vllm needs a CUDA GPU" in line for line in said())


def test_renamed_keys_move_and_are_said_once(said):
    cfg = load_config(None, ["actor_rollout_ref.actor.max_grad_norm=0.5", "critic.optim.clip_grad=0.7",
                             "actor_rollout_ref.actor.policy_loss=vanilla", "reward_model.model_path=rm",
                             "data.use_sequence_packing=false"])
    assert cfg.actor_rollout_ref.actor.grad_clip == 0.5
    assert cfg.critic.grad_clip == 0.7
    assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "vanilla"
    assert cfg.reward_model.model.path == "rm"
    assert cfg.actor_rollout_ref.model.use_remove_padding is False
    load_config(None, ["actor_rollout_ref.actor.max_grad_norm=0.5"])
    lines = said()
    assert sum("max_grad_norm is read as actor_rollout_ref.actor.grad_clip" in s for s in lines) == 1


def test_no_effect_keys_are_accepted_and_named(said, tmp_path):
    preset = tmp_path / "verl.yaml"
    preset.write_text("actor_rollout_ref:\n  rollout:\n    enforce_eager: true\n    free_cache_engine: true\n"
                      "  actor:\n    use_torch_compile: false\n    checkpoint:\n      save_contents: [model]\n"
                      "trainer:\n  balance_batch: true\n")
    cfg = load_config(preset, ["data.dataloader_num_workers=4", "actor_rollout_ref.hybrid_engine=True"])
    assert "actor_rollout_ref.rollout.enforce_eager" not in flatten(cfg)
    text = "\n".join(said())
    for key in ("rollout.enforce_eager", "rollout.free_cache_engine", "actor.use_torch_compile",
                "actor.checkpoint.save_contents", "trainer.balance_batch", "data.dataloader_num_workers",
                "actor_rollout_ref.hybrid_engine"):
        assert f"{key} has no effect here (" in text, key


@pytest.mark.parametrize("override, fragment", [
    ("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "sequence parallelism is not implemented"),
    ("actor_rollout_ref.rollout.multi_turn.enable=true", "multi-turn rollouts are not implemented"),
    ("actor_rollout_ref.rollout.skip_rollout=true", "rollout.name=offline"),
])
def test_values_we_cannot_honour_are_refused(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert override.split("=")[0] in str(err.value) and fragment in str(err.value)
    load_config(None, [override.split("=")[0] + "=" + ("1" if "size" in override else "false")])  # default is fine


def test_no_key_is_both_a_schema_field_and_a_verl_keys_entry():
    """A verl key made a field leaves verl_keys.py: a field listed in NO_EFFECT would keep its "no
    effect here" note in the table while the loader sets the field and never says it."""
    assert not verl_keys.entries_shadowing_fields(valid_keys()), "\n".join(
        verl_keys.entries_shadowing_fields(valid_keys()))
    said = verl_keys.entries_shadowing_fields(["data.validation_shuffle", "critic.max_grad_norm", "critic.grad_clip"])
    assert said == [
        "data.validation_shuffle: a field of rlhf_core/config/schema.py and listed in NO_EFFECT "
        "(rlhf_core/config/verl_keys.py), where its note says it has no effect here, and the loader never says it: "
        "remove it from NO_EFFECT",
        "critic.max_grad_norm: a field of rlhf_core/config/schema.py and listed in RENAMED "
        "(rlhf_core/config/verl_keys.py), where the loader moves its value to another key: remove it from RENAMED"]


def test_unknown_keys_still_fail_with_suggestions():
    with pytest.raises(ConfigError, match="did you mean|Did you mean"):
        load_config(None, ["actor_rollout_ref.actor.ppo_mini_batch=4"])


def test_algorithm_names_checked_against_the_registries():
    with pytest.raises(ConfigError, match="algorithm.adv_estimator='nope'.*valid: .*gae"):
        load_config(None, ["algorithm.adv_estimator=nope"])
    with pytest.raises(ConfigError, match="policy_loss.loss_mode='nope'.*vanilla"):
        load_config(None, ["actor_rollout_ref.actor.policy_loss.loss_mode=nope"])
    ADV_ESTIMATORS.register("test_only_estimator")(lambda **kw: None)
    try:  # a newly registered estimator is valid at once
        assert load_config(None, ["algorithm.adv_estimator=test_only_estimator"]).algorithm.adv_estimator == \
            "test_only_estimator"
    finally:
        ADV_ESTIMATORS.unregister("test_only_estimator")


def test_machine_fit_without_and_with_gpus(said):
    cfg = load_config(None, ["trainer.n_gpus_per_node=8"])
    assert any("n_gpus_per_node=8 on a machine without CUDA" in s for s in said())
    with pytest.raises(ConfigError, match="trainer.n_gpus_per_node=8: only 2 CUDA device"):
        fit_to_machine(cfg, gpus=2)
    assert fit_to_machine(cfg, gpus=8) is cfg
    if importlib.util.find_spec("ray") is None:  # the ray extra places several nodes' ranks
        with pytest.raises(ConfigError, match=r"trainer.nnodes=2: the update's nodes are a Ray cluster and Ray is "
                                              r"not installed here; install the ray extra"):
            load_config(None, ["trainer.nnodes=2"])
    else:
        assert load_config(None, ["trainer.nnodes=2"]).trainer.nnodes == 2
        assert any("trainer.nnodes=2: Ray places the update's ranks on 2 nodes of the cluster at 'auto'" in s
                   for s in said())
    vllm = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, n_gpus_per_node=1))
    vllm.actor_rollout_ref.rollout.name = "vllm"
    assert fit_to_machine(vllm, gpus=0).actor_rollout_ref.rollout.name == "hf"


def test_logger_names():
    assert load_config(None, ["trainer.logger=['console','wandb']"]).trainer.logger == ["console", "wandb"]
    with pytest.raises(ConfigError, match="unknown logger 'slack'"):
        load_config(None, ["trainer.logger=[console,slack]"])


def test_ppo_mini_batch_counts_prompts_and_fits_the_batch():
    with pytest.raises(ConfigError, match="counts prompts, as in verl"):
        load_config(None, ["data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=32"])


def test_cli_config_show_prints_notes_as_single_lines(verl_quickstart, tmp_path):
    train, val = tmp_path / "train.parquet", tmp_path / "test.parquet"
    args = [sys.executable, "-m", "rlhf_cli.main", "config", "show", "--flat",
            *verl_quickstart(train=str(train), val=str(val), model="tiny")]
    missing = subprocess.run(args, capture_output=True, text=True)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert f"data.train_files: {train} not found" in missing.stderr  # the run's checks, before any work
    train.touch(), val.touch()
    out = subprocess.run(args, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    assert "actor_rollout_ref.rollout.name=hf" in out.stdout.splitlines()
    notes = [line for line in out.stderr.splitlines() if "vllm needs a CUDA GPU" in line]
    assert len(notes) == 1, out.stderr



@pytest.mark.parametrize("key", ["trainer.master_addr=node0", "trainer.master_port=29500",
                                 "trainer.node_join_timeout_s=30"])
def test_the_retired_node_join_keys_answer_with_the_ray_steps(key):
    with pytest.raises(ConfigError, match=rf"{key.split('=')[0]}=.*retired: the update's nodes are a Ray cluster: "
                                          r"`ray start --head`"):
        load_config(None, [key])


def test_a_saved_config_with_the_retired_keys_at_their_defaults_still_loads(tmp_path):
    """config.yaml of a run made before Ray holds them at their defaults: dropped without a word."""
    from rlhf_core.config import to_yaml
    import yaml

    tree = yaml.safe_load(to_yaml(load_config(None, [])))
    tree["trainer"].update(master_addr=None, master_port=None, node_join_timeout_s=600)
    preset = tmp_path / "old.yaml"
    preset.write_text(yaml.safe_dump(tree))
    assert load_config(str(preset), []).trainer.nnodes == 1
