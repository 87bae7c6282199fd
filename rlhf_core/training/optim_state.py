"""Optimizer state by parameter name, full tensors (no pickle anywhere): the layout any ZeRO stage
and world size can be loaded from.

DeepSpeed 0.19's own ``load_checkpoint`` reads its files with ``torch.load(weights_only=False)``,
i.e. unpickles them, so we do not use it. Checkpoints keep each rank's own partition
(``train_state``, ``checkpoint``); this module is the full-tensor path: ``gather_optimizer_state``
collects each trainable parameter's *full* AdamW moments (``safe_get_full_optimizer_state``,
stages 1-3, a collective; the torch optimizer directly at stage 0) plus the fp32 master weights in
bf16/fp16, and ``restore_optimizer_state`` scatters such full tensors into any engine's partitions.
It serves checkpoints written before the sharded layout ({role}_optim.safetensors) and sharded
ones resumed under another world size or ZeRO stage (reassembled by ``checkpoint``). The step
count, LR-schedule position (training steps, not optimizer steps: the lr moves once per
iteration) and engine counters are JSON (``counters``).

Restoring needs the optimizer's state tensors to exist, and torch AdamW creates them lazily at its
first step. ``prime_optimizer`` therefore takes one step with zero gradients at learning rate 0
(AdamW then changes no weight and leaves both moments at 0), after which the saved moments, step
counts and counters are written over the fresh ones.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from rlhf_core.training.engines import TrainEngine

MOMENT_KEYS = ("exp_avg", "exp_avg_sq")
SEP = "::"


def _is_partitioned(p: torch.nn.Parameter) -> bool:
    # ZeRO-1/2 give every parameter an _hp_mapping attribute, None on ranks that hold none of it:
    # those ranks must still join the gather, so test for the attribute, not its value
    return hasattr(p, "ds_id") or hasattr(p, "_hp_mapping")


def has_state(te: TrainEngine) -> bool:
    return len(te.base_optimizer.state) > 0


def adam_step_count(te: TrainEngine) -> int:
    steps = [float(s["step"]) for s in te.base_optimizer.state.values() if "step" in s]
    return int(max(steps)) if steps else 0


def gather_optimizer_state(te: TrainEngine) -> dict[str, torch.Tensor]:
    """{"<param name>::exp_avg" / "::exp_avg_sq" / "::fp32": full fp32 CPU tensor}. Collective under
    ZeRO: every rank must call it, in the same order."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out: dict[str, torch.Tensor] = {}
    if not has_state(te):
        return out
    for name, p in te.named_trainable():
        for key in MOMENT_KEYS:
            if _is_partitioned(p):
                value = safe_get_full_optimizer_state(p, key)
            else:
                value = te.base_optimizer.state.get(p, {}).get(key)
            if value is not None:  # ZeRO-3 parameters keep their full shape in ds_shape
                out[name + SEP + key] = value.detach().float().cpu().reshape(getattr(p, "ds_shape", p.shape)).clone()
        if te.dtype != "fp32" and _is_partitioned(p):
            out[name + SEP + "fp32"] = safe_get_full_fp32_param(p).detach().float().cpu().clone()
    return out


def counters(te: TrainEngine) -> dict[str, Any]:
    """JSON-able position of the optimizer: Adam step, schedule step, engine counters."""
    e = te.engine
    return {"adam_step": adam_step_count(te), "lr_schedule_step": te.lr_schedule_step,
            "global_steps": int(e.global_steps), "global_samples": int(e.global_samples),
            "skipped_steps": int(e.skipped_steps), "zero_stage": te.zero_stage, "dtype": te.dtype}


def prime_optimizer(te: TrainEngine, zero_loss: Callable[[], torch.Tensor]) -> None:
    """Create the optimizer's state tensors with one lr=0, zero-gradient step. ``zero_loss()`` runs a
    forward through the engine and returns 0 * (its output), so every rank joins the collectives."""
    groups = te.base_optimizer.param_groups
    saved_lrs = [g["lr"] for g in groups]
    for g in groups:
        g["lr"] = 0.0
    te.engine.set_gradient_accumulation_boundary(True)
    te.engine.backward(zero_loss())
    te.engine.step()
    for g, lr in zip(groups, saved_lrs):
        g["lr"] = lr


def _set_full(p: torch.nn.Parameter, value: torch.Tensor, key: Optional[str]) -> None:
    """Write a full-size state tensor (``key`` None: the fp32 master weights) into this rank's part.

    ZeRO-3 goes through the per-rank API with our own slicing: DeepSpeed 0.19's
    ``safe_set_full_optimizer_state`` slices ``rank * partition_numel`` out of the unpadded full
    tensor and fails on the last rank whenever the size does not divide by the world size."""
    from deepspeed.utils import (safe_set_full_fp32_param, safe_set_full_optimizer_state,
                                 safe_set_local_fp32_param, safe_set_local_optimizer_state)

    if hasattr(p, "ds_id"):
        from deepspeed import comm

        n = p.ds_tensor.numel()
        rank = comm.get_rank(group=getattr(p, "ds_process_group", None))
        local = torch.zeros(n, dtype=torch.float32)
        piece = value.flatten()[rank * n:(rank + 1) * n]
        local[:piece.numel()] = piece
        local = local.to(p.ds_tensor.device)
        if key is None:
            safe_set_local_fp32_param(p, local)
        else:
            safe_set_local_optimizer_state(p, local, key)
    elif key is None:
        safe_set_full_fp32_param(p, value.to(p.device))
    else:
        safe_set_full_optimizer_state(p, value.to(p.device), key)


def restore_optimizer_state(te: TrainEngine, tensors: dict[str, torch.Tensor], meta: dict[str, Any],
                            zero_loss: Callable[[], torch.Tensor]) -> None:
    """Load what ``gather_optimizer_state`` + ``counters`` saved (any ZeRO stage / world size).
    The learning rate follows the *current* config's base LR at the saved schedule position, so a
    retry with a smaller LR takes effect."""
    if meta.get("adam_step", 0) > 0:
        prime_optimizer(te, zero_loss)
        for name, p in te.named_trainable():
            for key in MOMENT_KEYS:
                value = tensors.get(name + SEP + key)
                if value is None and not _is_partitioned(p) and p not in te.base_optimizer.state:
                    continue  # stage 0: a parameter that never had a gradient has no state anywhere
                if value is None:
                    raise KeyError(f"optimizer state has no {key} for parameter {name}")
                if _is_partitioned(p):
                    _set_full(p, value, key)
                else:
                    te.base_optimizer.state[p][key].copy_(value.view_as(p))
            master = tensors.get(name + SEP + "fp32")
            if master is not None and _is_partitioned(p):
                _set_full(p, master, None)
        for state in te.base_optimizer.state.values():
            state["step"].fill_(float(meta["adam_step"]))
    restore_counters(te, meta)


def restore_counters(te: TrainEngine, meta: dict[str, Any]) -> None:
    """The lr-schedule position and engine counters of ``counters`` (+ ``micro_steps`` when saved)."""
    # A checkpoint from before the lr moved per training step has no lr_schedule_step; its
    # schedule_step counted optimizer steps, which is not a position on this schedule: start at 0.
    te.set_lr_schedule_step(int(meta.get("lr_schedule_step", 0)))
    e = te.engine
    e.global_steps = int(meta.get("global_steps", 0))
    e.global_samples = int(meta.get("global_samples", 0))
    e.skipped_steps = int(meta.get("skipped_steps", 0))
    if "micro_steps" in meta:
        e.micro_steps = int(meta["micro_steps"])
