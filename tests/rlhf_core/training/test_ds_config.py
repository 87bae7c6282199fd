"""Our config → the DeepSpeed config dict (no engine needed)."""

from __future__ import annotations

import json
import os

import pytest

from rlhf_core.config import ConfigError, load_config
from rlhf_core.config.schema import DeepSpeedConfig
from rlhf_core.config.reads import build
from rlhf_core.training.ds_config import build_ds_config, resolve_dtype
from rlhf_core.training.settings import engine_settings


def _ds(cfg, role: str, world_size: int = 1) -> dict:
    """``role``'s DeepSpeed config as the update's engine settings build it."""
    return getattr(build(engine_settings, cfg, device="cpu", world_size=world_size), role).ds_config


def test_defaults_let_the_ppo_loop_own_accumulation_and_use_a_client_optimizer():
    cfg = load_config(None, ["actor_rollout_ref.actor.grad_clip=0.7", "critic.grad_clip=0.3"])
    assert _ds(cfg, "critic", 1)["gradient_clipping"] == 0.3
    ds = _ds(cfg, "actor", 2)
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
    zero = _ds(cfg, "actor", 1)["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_optimizer"]["device"] == "cpu" and zero["offload_param"]["device"] == "cpu"
    assert "offload_param" not in _ds(cfg, "critic", 1)["zero_optimization"]  # the actor's flags only


def test_the_critics_fsdp_offload_flags_map_to_its_zero_offload():
    cfg = load_config(None, ["critic.model.fsdp_config.optimizer_offload=true", "critic.deepspeed_config.zero_stage=2"])
    zero = _ds(cfg, "critic", 1)["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == "cpu" and "offload_param" not in zero
    assert "offload_optimizer" not in _ds(cfg, "actor", 1)["zero_optimization"]
    with pytest.raises(ConfigError, match="critic.deepspeed_config.offload_param=true needs ZeRO-3"):
        _ds(load_config(None, ["critic.model.fsdp_config.param_offload=true"]), "critic", 1)


@pytest.mark.parametrize("overrides, key", [
    (["actor_rollout_ref.actor.deepspeed_config.offload_optimizer=true"], "zero_stage to 1, 2 or 3"),
    (["actor_rollout_ref.actor.fsdp_config.param_offload=true",
      "actor_rollout_ref.actor.deepspeed_config.zero_stage=2"], "needs ZeRO-3"),
])
def test_offload_without_the_zero_stage_it_needs_names_the_fix(overrides, key):
    with pytest.raises(ConfigError, match=key):
        _ds(load_config(None, overrides), "actor", 1)


def test_raw_json_overrides_generated_keys_and_reserved_keys_are_refused(tmp_path):
    raw = tmp_path / "ds.json"
    raw.write_text(json.dumps({"zero_optimization": {"stage": 2, "overlap_comm": True}, "gradient_clipping": 5.0}))
    cfg = load_config(None, [f"critic.deepspeed_config.config_path={raw}"])
    ds = _ds(cfg, "critic", 1)
    assert ds["zero_optimization"] == {"stage": 2, "overlap_comm": True} and ds["gradient_clipping"] == 5.0

    raw.write_text(json.dumps({"gradient_accumulation_steps": 4}))
    with pytest.raises(ConfigError, match="gradient_accumulation_steps"):
        _ds(cfg, "critic", 1)
    raw.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        _ds(cfg, "critic", 1)


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


@pytest.fixture
def cpu(monkeypatch):
    """Pretend this machine's CPU is a given model with given /proc/cpuinfo flags and, where asked,
    given matmul rates (GFLOP/s by dtype); nothing judged yet in this process tree."""
    from rlhf_core.training import hardware

    monkeypatch.setenv(hardware.CPU_BF16_ENV, "")
    monkeypatch.delenv(hardware.CPU_BF16_ENV)  # restored as it was after the test

    def pretend(model: str, *flags: str, rates: dict[str, float] | None = None) -> None:
        monkeypatch.setattr(hardware, "cpu_description", lambda: (model, flags))
        hardware._rates_judged.cache_clear()
        os.environ.pop(hardware.CPU_BF16_ENV, None)

        def rate(device: str, dtype: str) -> float:
            assert rates is not None, "no rate may be measured on this CPU"
            return rates[dtype] * 1e9

        monkeypatch.setattr(hardware, "device_rate", rate)

    yield pretend
    hardware._rates_judged.cache_clear()  # pretended rates must not outlive the test


@pytest.mark.parametrize("flags, largest, rates, want", [
    (("avx2", "avx512f", "avx512_bf16"), 896 * 4864, {"bf16": 207, "fp32": 98}, "bf16"),  # AMD EPYC, Qwen2.5-0.5B's MLP
    (("avx2", "avx512f", "avx512_bf16"), 896 * 4864, {"bf16": 164, "fp32": 297}, "fp32"),  # Intel Xeon, no AMX: MKL's fp32 wins
    (("avx2", "avx512_bf16"), 896 * 4864, {"bf16": 120, "fp32": 100}, "fp32"),  # faster, but under the margin
    (("avx2", "amx_tile", "amx_bf16"), 896 * 4864, {"bf16": 900, "fp32": 100}, "bf16"),  # AMX
    (("avx2", "avx512_bf16"), 64 * 512, None, "fp32"),  # native, but the tiny demo's matrices: nothing measured
    (("avx2", "avx512_bf16"), None, None, "fp32"),  # the model's size unknown (not built yet)
    (("avx2", "avx512f"), 896 * 4864, None, "fp32"),  # AVX-512 without bf16: emulated, nothing measured
])
def test_dtype_auto_on_a_cpu_is_bf16_only_where_its_measured_matmuls_pay_for_a_large_model(cpu, flags, largest,
                                                                                          rates, want):
    cpu("Test CPU", *flags, rates=rates)
    assert resolve_dtype("auto", "cpu", largest) == want
    assert resolve_dtype("auto", "cuda", largest) == "bf16"  # a GPU: always
    assert resolve_dtype("fp32", "cpu", largest) == "fp32"  # an explicit choice stands


def test_the_cpu_judgment_is_made_once_for_the_process_tree_and_a_users_word_stands(cpu, monkeypatch):
    from rlhf_core.training import hardware

    cpu("Test CPU", "avx512_bf16", rates={"bf16": 207, "fp32": 98})
    assert resolve_dtype("auto", "cpu", 896 * 4864) == "bf16"
    assert os.environ[hardware.CPU_BF16_ENV] == "1"  # what the stage and rank processes it starts inherit
    assert "207 GFLOP/s against 98 in fp32" in hardware.bf16_judgment()
    monkeypatch.setattr(hardware, "device_rate", lambda device, dtype: pytest.fail("measured twice"))
    assert resolve_dtype("auto", "cpu", 896 * 4864) == "bf16"
    monkeypatch.setenv(hardware.CPU_BF16_ENV, "0")  # the user's word, or a parent process's judgment
    hardware._rates_judged.cache_clear()
    assert resolve_dtype("auto", "cpu", 896 * 4864) == "fp32"
    assert hardware.bf16_judgment().startswith("RLHF_CPU_BF16=0")
    cpu("AVX2 Test CPU", "avx2")  # no bf16 instructions: nothing measured, and the line says why
    assert resolve_dtype("auto", "cpu", 896 * 4864) == "fp32"
    assert hardware.bf16_judgment() == "no bf16 matrix instructions"


def test_the_auto_choice_is_said_once_with_the_cpu_and_why(cpu, tmp_path):
    from rlhf_core.notes import said
    from rlhf_core.models.tiny import ensure_tiny_model
    from rlhf_core.training.ds_config import role_dtype

    model = ensure_tiny_model(tmp_path / "tiny")
    cpu("Native Test CPU 1", "avx512_bf16")
    assert role_dtype("auto", str(model), "cpu") == "fp32"  # the tiny model is faster in fp32
    line = [s for s in said() if "Native Test CPU 1" in s]
    assert len(line) == 1 and "dtype=auto: fp32" in line[0] and "under 1 M elements" in line[0]
    # the critic's same choice for the same reason is not said again (it landed inside the iteration table)
    assert role_dtype("auto", str(model), "cpu", "critic") == "fp32"
    assert [s for s in said() if "Native Test CPU 1" in s] == line
    cpu("Emulating Test CPU 2", "avx2")
    assert role_dtype("auto", str(model), "cpu") == "fp32"
    assert any("Emulating Test CPU 2" in s and "bf16 would be emulated" in s for s in said())


def test_an_explicit_bf16_on_a_cpu_without_bf16_units_says_what_it_costs(cpu, tmp_path):
    from rlhf_core.notes import said
    from rlhf_core.training.ds_config import BF16_EMULATED_COST, role_dtype

    cpu("Emulating Test CPU 3", "avx2", "fma")
    assert role_dtype("bf16", str(tmp_path / "absent"), "cpu", "critic") == "bf16"
    line = [s for s in said() if "Emulating Test CPU 3" in s]
    assert len(line) == 1 and line[0].startswith("critic.deepspeed_config.dtype=bf16") and BF16_EMULATED_COST in line[0]
    cpu("Native Test CPU 4", "avx512_bf16", rates={"bf16": 207, "fp32": 98})
    role_dtype("bf16", str(tmp_path / "absent"), "cpu")
    assert not any("Native Test CPU 4" in s for s in said())  # bf16 pays here: nothing to warn about
    cpu("Native Test CPU 5", "avx512_bf16", rates={"bf16": 164, "fp32": 297})
    assert role_dtype("bf16", str(tmp_path / "absent"), "cpu") == "bf16"  # warned, not overruled
    line = [s for s in said() if "Native Test CPU 5" in s]
    assert len(line) == 1 and "164 GFLOP/s against 297 in fp32" in line[0] and "does not pay" in line[0]
