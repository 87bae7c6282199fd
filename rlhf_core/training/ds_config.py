"""The DeepSpeed config dict, built from our config (no DeepSpeed import here).

Gradient accumulation belongs to the PPO loop, not to DeepSpeed: a mini-batch is split into a
varying number of token-budget micro-batches, so DeepSpeed is told ``gradient_accumulation_steps=1``
(it then never divides the loss) and the loop marks the boundary itself with
``engine.set_gradient_accumulation_boundary`` (False for every micro-batch but the last), calling
``engine.step()`` once per mini-batch. The losses carry the global token / sequence counts of the
whole mini-batch, so the accumulated gradient is the full-mini-batch gradient.

Mixed precision (bf16/fp16) runs at ZeRO stage 1 or higher: at stage 0 DeepSpeed wraps the optimizer
in its FP16 optimizers, which expose no per-parameter view of the fp32 master weights and moments,
and the pickle-free checkpoint (``optim_state``) needs that view. With one process ZeRO-1 holds the
same tensors as stage 0; with several it also splits the optimizer state across ranks.

bf16 gradients accumulate and are reduced in fp32 (``data_types.grad_accum_dtype: fp32`` and
``communication_data_type: fp32``), as verl's FSDP mixed precision reduces in fp32: summing many
micro-batches of bf16 gradients (8 significant bits) loses the small ones. DeepSpeed then trains
ZeRO-1 without offload with its BF16 optimizer (fp32 gradient buffer, fp32 all-reduce), ZeRO-2/3 and
offloaded ZeRO-1 with the ZeRO optimizer keeping fp32 gradient partitions.

The optimizer is a client ``torch.optim.AdamW`` (DeepSpeed's own Adam variants JIT-compile C++/CUDA
ops on first use, about 70 s each on a CPU machine); with optimizer offload that needs
``zero_force_ds_cpu_optimizer: false``. On CUDA with optimizer offload the client optimizer is
DeepSpeed's ``DeepSpeedCPUAdam`` instead (``engines.make_optimizer``): torch's AdamW stepping 7 B
fp32 parameters on the host is several times slower than its vectorised C++ kernel, and the
offloaded state is then kept in pinned host memory (``pin_memory: true``) for fast copies to the GPU.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any, Optional

from rlhf_core.config.loader import ConfigError
from rlhf_core.notes import say_once
from rlhf_core.config.schema import DeepSpeedConfig
from rlhf_core.errors import RLHFError
from rlhf_core.models.threads import SMALL_MATMUL, config_largest_matrix, small_matmuls
from rlhf_core.paths import resolve_model_path, resolve_path
from rlhf_core.training import hardware

DTYPES = ("fp32", "bf16", "fp16")

# keys a raw JSON must not set: they would fight the loop's own accumulation or the client optimizer
RESERVED_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                 "optimizer", "scheduler")


def resolve_device(preference: str = "auto") -> str:
    """trainer.device: 'auto' → 'cuda' when a GPU is visible, else 'cpu'."""
    import torch

    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        return "cuda"
    return "cpu"


BF16_EMULATED_COST = "a matmul ~90x and a forward + backward ~30x slower than in fp32"
"""What bf16 costs on a CPU without ``hardware.NATIVE_BF16_FLAGS``, as measured on one (AMD EPYC, AVX2 only, one
thread: a 944 x 896 x 4864 matmul at 0.9 GFLOP/s against 80 in fp32; forward + backward of 8 x 118 tokens
through 4 layers of Qwen2.5-0.5B's shape 192 s against 6.1 s; docs/benchmarks.md §8): said when a config
asks for bf16 there."""


def resolve_dtype(dtype: str, device: str, largest_matrix: Optional[int] = None) -> str:
    """deepspeed_config.dtype: 'auto' = bf16 on CUDA; on a CPU bf16 only where it pays — bf16 matmuls run
    well faster than fp32 ones on this CPU (``hardware.cpu_bf16_pays``, measured) and the model's largest
    weight matrix (``largest_matrix``, None = unknown) is not small (``models.threads.SMALL_MATMUL``: the
    tiny demo's 64 x 512 runs faster in fp32) — else fp32."""
    if dtype == "auto":
        if device != "cpu":
            return "bf16"
        large = largest_matrix is not None and not small_matmuls(largest_matrix)
        return "bf16" if large and hardware.cpu_bf16_pays() else "fp32"
    if dtype not in DTYPES:
        raise ConfigError(f"deepspeed_config.dtype={dtype!r}: must be auto, fp32, bf16 or fp16")
    return dtype


def model_largest_matrix(model_path: str) -> Optional[int]:
    """Elements of the largest weight matrix of the model at ``model_path`` (a model key: a directory, a
    hub id, ``tiny``), from its config.json; None when it is not there yet (the tiny model before its
    build) or has no readable config."""
    try:
        config = json.loads((resolve_model_path(model_path) / "config.json").read_text())
    except (RLHFError, OSError, ValueError):
        return None
    return config_largest_matrix(config) or None


def role_dtype(configured: str, model_path: str, device: str, key: str = "actor_rollout_ref.actor") -> str:
    """A trained role's dtype on ``device``: its deepspeed_config.dtype (``configured``) with 'auto' resolved for the model at ``model_path``
    (``resolve_dtype``). The run follows the actor's: rollout, scoring and the KL guard run in it. On a CPU
    the choice is said once per process (rank 0), with why."""
    largest = model_largest_matrix(model_path)
    dtype = resolve_dtype(configured, device, largest)
    if device == "cpu" and os.environ.get("RANK", "0") == "0":
        _say_cpu_dtype(key, configured, dtype, largest)
    return dtype


_NOT_PAYING = f"bf16 does not pay here (it needs {hardware.BF16_PAYS_AT}x fp32's matmul rate)"


def _say_cpu_dtype(key: str, configured: str, dtype: str, largest: Optional[int]) -> None:
    model, _ = hardware.cpu_description()
    native = hardware.cpu_native_bf16()
    units = "with native bf16 (AVX512-BF16 / AMX)" if native else "without native bf16 (no AVX512-BF16 / AMX)"
    if configured == "auto":
        size = "size unknown" if largest is None else f"largest weight matrix {largest / 1e6:.2f} M elements"
        if not native:
            why = "bf16 would be emulated"
        elif largest is None:
            why = "the model's size is not known yet"
        elif small_matmuls(largest):
            why = f"fp32 is faster for a model with matrices under {SMALL_MATMUL / 1e6:.0f} M elements"
        else:
            why = f"{hardware.bf16_judgment()}: {'bf16 pays' if dtype == 'bf16' else _NOT_PAYING}"
        note = f"deepspeed_config.dtype=auto: {dtype} on this CPU ({model}, {units}; {size}): {why}"
    elif dtype in ("bf16", "fp16") and not native:
        note = (f"deepspeed_config.dtype={dtype} on a CPU {units} ({model}): {dtype} is emulated here, "
                f"measured on such a CPU {BF16_EMULATED_COST}; leave it at auto (fp32 here)")
    elif dtype == "bf16" and not hardware.cpu_bf16_pays():
        note = (f"deepspeed_config.dtype=bf16 on this CPU ({model}): {hardware.bf16_judgment()}: "
                f"{_NOT_PAYING}; leave it at auto (fp32 here)")
    else:
        return
    # said once for the run: the critic's same choice for the same reason is not repeated (it printed
    # inside the iteration table)
    say_once(f"{key}.{note}", topic=note)


def torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def _zero_section(ds: DeepSpeedConfig, key: str, dtype: str, device: str = "cpu") -> dict[str, Any]:
    if ds.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"{key}.zero_stage={ds.zero_stage!r}: must be 0, 1, 2 or 3")
    if ds.offload_optimizer and ds.zero_stage == 0:
        raise ConfigError(f"{key}.offload_optimizer=true needs ZeRO: set {key}.zero_stage to 1, 2 or 3")
    if ds.offload_param and ds.zero_stage != 3:
        raise ConfigError(f"{key}.offload_param=true needs ZeRO-3: set {key}.zero_stage=3 "
                          "(or drop fsdp_config.param_offload / offload_policy)")
    zero: dict[str, Any] = {"stage": max(ds.zero_stage, 1) if dtype != "fp32" else ds.zero_stage}
    # pinned (page-locked) host buffers speed up host<->GPU copies; without a GPU there is nothing to
    # copy to, and pinning needs CUDA
    pin = device == "cuda"
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    if ds.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    return zero


def uses_cpu_adam(ds_config: dict[str, Any], device: str) -> bool:
    """Whether the engine steps DeepSpeed's ``DeepSpeedCPUAdam``: optimizer offload on CUDA. On a
    CPU-only machine the torch AdamW stays (building the cpu_adam op costs ~75 s of g++ on first use)."""
    offload = ds_config.get("zero_optimization", {}).get("offload_optimizer", {})
    return device == "cuda" and offload.get("device") == "cpu"


def zero3(ds_config: dict[str, Any]) -> bool:
    return int(ds_config.get("zero_optimization", {}).get("stage", 0)) == 3


def deep_merge(base: dict, override: dict) -> dict:
    """``override``'s keys win; nested dicts merge key by key."""
    out = copy.deepcopy(base)
    for k, v in override.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def read_raw_config(path: str | Path, key: str) -> dict:
    """A user's DeepSpeed JSON; reserved keys (see ``RESERVED_KEYS``) are refused with the reason."""
    p = resolve_path(path)
    if not p.is_file():
        raise ConfigError(f"{key}.config_path={str(path)!r}: file not found")
    try:
        raw = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{key}.config_path={str(path)!r}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{key}.config_path={str(path)!r}: must hold a JSON object")
    bad = [k for k in RESERVED_KEYS if k in raw]
    if bad:
        raise ConfigError(
            f"{p}: keys {bad} are set by the PPO loop (micro-batches by token budget, one optimizer step "
            f"per mini-batch, client AdamW with verl's lr schedule); remove them and use "
            f"actor_rollout_ref.actor.ppo_mini_batch_size / optim.* instead")
    return raw


def build_ds_config(ds: DeepSpeedConfig, *, grad_clip: float, device: str, world_size: int = 1,
                    key: str = "actor_rollout_ref.actor.deepspeed_config",
                    largest_matrix: Optional[int] = None) -> dict[str, Any]:
    """The DeepSpeed config for one engine (``key`` names its section in error messages).

    ``grad_clip`` (verl's actor.grad_clip / critic.grad_clip: the total-norm clip of each mini-batch
    gradient) becomes ``gradient_clipping``; the raw JSON at ``ds.config_path`` (if any) is
    merged last, so its keys win. ``largest_matrix``: the model's, for dtype 'auto' (``resolve_dtype``).
    """
    dtype = resolve_dtype(ds.dtype, device, largest_matrix)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world_size,
        "gradient_clipping": float(grad_clip),
        "zero_optimization": _zero_section(ds, key, dtype, device),
        "bf16": {"enabled": dtype == "bf16"},
        "fp16": {"enabled": dtype == "fp16", "initial_scale_power": 16},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if dtype == "bf16":  # accumulate and reduce gradients in fp32, as verl does (module docstring)
        config["data_types"] = {"grad_accum_dtype": "fp32"}
        config["communication_data_type"] = "fp32"
    if ds.config_path:
        config = deep_merge(config, read_raw_config(ds.config_path, key))
    return config


def role_ds_config(ds: DeepSpeedConfig, *, grad_clip: float, model_key: str, device: str, world_size: int,
                   key: str = "actor_rollout_ref.actor.deepspeed_config") -> dict[str, Any]:
    """A trained role's config from its effective DeepSpeed settings and the model its weights start
    from (``model_key``: 'auto' dtype is resolved for its largest matrix)."""
    return build_ds_config(ds, grad_clip=grad_clip, device=device, world_size=world_size, key=key,
                           largest_matrix=model_largest_matrix(model_key))
