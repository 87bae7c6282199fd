"""Our config → the DeepSpeed config dict (no engine needed)."""

from __future__ import annotations

import json

import pytest

from rlhf_core.config import ConfigError, load_config
from rlhf_core.config.schema import DeepSpeedConfig
from rlhf_core.training.ds_config import actor_ds_config, build_ds_config, critic_ds_config, resolve_dtype


def test_defaults_let_the_ppo_loop_own_accumulation_and_use_a_client_optimizer():
    cfg = load_config(None, ["actor_rollout_ref.actor.grad_clip=0.7", "critic.grad_clip=0.3"])
    assert critic_ds_config(cfg, "cpu", world_size=1)["gradient_clipping"] == 0.3
    ds = actor_ds_config(cfg, "cpu", world_size=2)
    assert ds["gradient_accumulation_steps"] == 1 and ds["train_micro_batch_size_per_gpu"] == 1
    assert ds["train_batch_size"] == 2
    assert ds["gradient_clipping"] == 0.7
    assert ds["zero_optimization"] == {"stage": 0}
    assert ds["zero_force_ds_cpu_optimizer"] is False and "optimizer" not in ds and "scheduler" not in ds
    assert not ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]  # auto = fp32 on CPU


@pytest.mark.parametrize("dtype, device, want", [("auto", "cpu", "fp32"), ("auto", "cuda", "bf16"),
                                                 ("fp16", "cuda", "fp16"), ("bf16", "cpu", "bf16")])
def test_dtype_auto_is_fp32_on_cpu_and_bf16_on_cuda(dtype, device, want):
    assert resolve_dtype(dtype, device) == want
    ds = build_ds_config(DeepSpeedConfig(dtype=dtype), grad_clip=1.0, device=device)
    assert ds["bf16"]["enabled"] == (want == "bf16") and ds["fp16"]["enabled"] == (want == "fp16")
    # mixed precision trains at ZeRO >= 1, where the fp32 master weights are visible per parameter
    assert ds["zero_optimization"]["stage"] == (0 if want == "fp32" else 1)


def test_fsdp_offload_policy_maps_to_zero3_parameter_and_optimizer_offload():
    cfg = load_config(None, ["actor_rollout_ref.actor.fsdp_config.offload_policy=true",
                             "actor_rollout_ref.actor.deepspeed_config.zero_stage=3"])
    zero = actor_ds_config(cfg, "cpu", 1)["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_optimizer"]["device"] == "cpu" and zero["offload_param"]["device"] == "cpu"
    assert "offload_param" not in critic_ds_config(cfg, "cpu", 1)["zero_optimization"]  # the actor's flags only


def test_the_critics_fsdp_offload_flags_map_to_its_zero_offload():
    cfg = load_config(None, ["critic.model.fsdp_config.optimizer_offload=true", "critic.deepspeed_config.zero_stage=2"])
    zero = critic_ds_config(cfg, "cpu", 1)["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == "cpu" and "offload_param" not in zero
    assert "offload_optimizer" not in actor_ds_config(cfg, "cpu", 1)["zero_optimization"]
    with pytest.raises(ConfigError, match="critic.deepspeed_config.offload_param=true needs ZeRO-3"):
        critic_ds_config(load_config(None, ["critic.model.fsdp_config.param_offload=true"]), "cpu", 1)


@pytest.mark.parametrize("overrides, key", [
    (["actor_rollout_ref.actor.deepspeed_config.offload_optimizer=true"], "zero_stage to 1, 2 or 3"),
    (["actor_rollout_ref.actor.fsdp_config.param_offload=true",
      "actor_rollout_ref.actor.deepspeed_config.zero_stage=2"], "needs ZeRO-3"),
])
def test_offload_without_the_zero_stage_it_needs_names_the_fix(overrides, key):
    with pytest.raises(ConfigError, match=key):
        actor_ds_config(load_config(None, overrides), "cpu", 1)


def test_raw_json_overrides_generated_keys_and_reserved_keys_are_refused(tmp_path):
    raw = tmp_path / "ds.json"
    raw.write_text(json.dumps({"zero_optimization": {"stage": 2, "overlap_comm": True}, "gradient_clipping": 5.0}))
    cfg = load_config(None, [f"critic.deepspeed_config.config_path={raw}"])
    ds = critic_ds_config(cfg, "cpu", 1)
    assert ds["zero_optimization"] == {"stage": 2, "overlap_comm": True} and ds["gradient_clipping"] == 5.0

    raw.write_text(json.dumps({"gradient_accumulation_steps": 4}))
    with pytest.raises(ConfigError, match="gradient_accumulation_steps"):
        critic_ds_config(cfg, "cpu", 1)
    raw.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        critic_ds_config(cfg, "cpu", 1)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_accumulates_and_reduces_gradients_in_fp32_at_every_stage(stage):
    ds = build_ds_config(DeepSpeedConfig(dtype="bf16", zero_stage=stage), grad_clip=1.0, device="cuda")
    assert ds["data_types"] == {"grad_accum_dtype": "fp32"} and ds["communication_data_type"] == "fp32"
    fp32 = build_ds_config(DeepSpeedConfig(dtype="fp32", zero_stage=stage), grad_clip=1.0, device="cpu")
    assert "data_types" not in fp32 and "communication_data_type" not in fp32  # nothing to widen


def test_offload_pins_host_memory_and_steps_cpu_adam_only_on_cuda():
    from rlhf_core.training.ds_config import uses_cpu_adam

    ds = DeepSpeedConfig(zero_stage=3, offload_optimizer=True, offload_param=True)
    on_gpu = build_ds_config(ds, grad_clip=1.0, device="cuda", world_size=8)
    assert on_gpu["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert on_gpu["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert uses_cpu_adam(on_gpu, "cuda")
    on_cpu = build_ds_config(ds, grad_clip=1.0, device="cpu")
    assert on_cpu["zero_optimization"]["offload_optimizer"]["pin_memory"] is False
    assert not uses_cpu_adam(on_cpu, "cpu")  # the torch AdamW: no ~75 s cpu_adam build on a CPU machine
    assert not uses_cpu_adam(build_ds_config(DeepSpeedConfig(zero_stage=3), grad_clip=1.0, device="cuda"), "cuda")
