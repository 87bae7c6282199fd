"""What a stage's model passes cost in FLOPs, how fast this device multiplies matrices, and so the
stage's floor: the seconds its passes would take if every FLOP ran at that rate.

    floor(stage) = model FLOPs of the stage's passes / device matmul rate      (perf/stage_floor_seconds/<stage>)

Model FLOPs count the matrix multiplications a pass must do, 2 per multiply-add, on real tokens only
(no padding, no recomputation under gradient checkpointing), for a decoder-only transformer
(``memory.ModelShape``):

    per token            2 · P_dense                 P_dense = L · (H·(q + k + v + o) + 3·H·I)
    attention (causal)   2 · L · heads · d · s²      per sequence of s tokens (QKᵀ and AV, half the square)
    LM head              2 · H · V                   per position it runs on (the response positions in
                                                     scoring, the update and the guard; one per generated token)
    backward             2 × the forward             (gradients of activations and of weights)

Generation runs the prompt once (prefill; the LM head at its last position) and then one position per
generated token, whose attention reads every position before it (2 · 2 · L · heads · d · position).
The embedding lookup, norms, activations and the value head's H x 1 are left out (no matmul worth
counting). Decoding is bound by memory traffic more than by FLOPs, so a rollout's floor is far below
what any engine reaches at small batches: the report says how far, not that it is reachable.

The rate is this device's matmul rate in the run's dtype (``hardware.device_rate``: a GPU's listed
peak, a CPU's measured).

verl's names keep verl's definitions: ``verl_update_flops`` is verl's estimate for Qwen2/Llama
(``verl/utils/flops_counter.py``: 6 x (dense + embedding and LM head) parameters x tokens + the causal
attention term, on every token) and ``verl_promised_flops`` its device table (a CPU counts as 448 GFLOP/s),
so ``perf/mfu/actor`` and ``perf/mfu/critic`` read as verl's would on the same work.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

import torch

from rlhf_core.config.errors import ConfigError
from rlhf_core.models.live import LiveModels
from rlhf_core.training.hardware import device_rate
from rlhf_core.training.memory import ModelShape

VERL_DEVICE_FLOPS = {"CPU": 448e9, "GB200": 2.5e15, "B200": 2.25e15, "MI300X": 1307e12, "MI350X": 2300e12,
                     "MI355X": 2500e12, "H100": 989e12, "H800": 989e12, "H200": 989e12, "A100": 312e12,
                     "A800": 312e12, "L40S": 362.05e12, "L40": 181.05e12, "A40": 149.7e12, "L20": 119.5e12,
                     "H20": 148e12, "910B": 354e12, "A2G3": 354e12, "Ascend950DT": 432e12, "Ascend910": 354e12,
                     "RTX 3070 Ti": 21.75e12}
"""verl 0.9.1's promised FLOP/s per device name (a CPU counts as 448 GFLOP/s), which its ``perf/mfu/*``
divide by: the first key, in reverse alphabetical order, that the device's name contains; none: infinite
(the conformance step compares ``verl_promised_flops`` with verl's ``get_device_flops``)."""


def dense_parameters(shape: ModelShape) -> int:
    """Weights every token multiplies through in the transformer layers (attention projections, MLP)."""
    d, h, kv = shape.dim_per_head, shape.num_attention_heads, shape.num_key_value_heads
    attention = shape.hidden_size * (2 * h * d + 2 * kv * d)
    return shape.num_hidden_layers * (attention + 3 * shape.hidden_size * shape.intermediate_size)


def forward_flops(shape: ModelShape, lengths: Sequence[int], head_positions: int) -> float:
    """One forward over sequences of ``lengths`` tokens with the LM head at ``head_positions`` positions
    (0 for a value model)."""
    tokens = sum(lengths)
    attention = 2 * shape.num_hidden_layers * shape.num_attention_heads * shape.dim_per_head * sum(s * s for s in lengths)
    return 2.0 * dense_parameters(shape) * tokens + attention + 2.0 * shape.hidden_size * shape.vocab_size * head_positions


def training_flops(shape: ModelShape, lengths: Sequence[int], head_positions: int, epochs: int = 1) -> float:
    """Forward and backward (3 x the forward) over the sequences, ``epochs`` times."""
    return 3.0 * epochs * forward_flops(shape, lengths, head_positions)


def generation_flops(shape: ModelShape, prompt_lengths: Sequence[int], response_lengths: Sequence[int]) -> float:
    """Prefill of each prompt (LM head at its last position), then one position per generated token with
    attention over every position before it and the LM head."""
    per_position = 2.0 * dense_parameters(shape) + 2.0 * shape.hidden_size * shape.vocab_size
    read = 4 * shape.num_hidden_layers * shape.num_attention_heads * shape.dim_per_head  # QK and AV per key
    total = forward_flops(shape, prompt_lengths, len(prompt_lengths))
    for p, n in zip(prompt_lengths, response_lengths):
        # the last sampled token is never fed back: n - 1 decode positions, at p + 1 .. p + n - 1 keys
        steps = max(n - 1, 0)
        total += steps * per_position + read * (steps * p + steps * (steps + 1) / 2)
    return total


def verl_update_flops(shape: ModelShape, lengths: Sequence[int]) -> float:
    """verl's estimate of one pass of training over sequences of ``lengths`` tokens (its Qwen2/Llama
    formula): 6 x (dense + 2 x vocabulary x hidden) x tokens + 6 x sum(s²) x head dim x heads x layers."""
    dense = dense_parameters(shape) + 2 * shape.vocab_size * shape.hidden_size
    attention = 6 * sum(s * s for s in lengths) * shape.dim_per_head * shape.num_attention_heads * shape.num_hidden_layers
    return 6.0 * dense * sum(lengths) + attention


def verl_promised_flops(device: str, name: Optional[str] = None) -> float:
    """verl's promised FLOP/s of ``device`` ('cpu' | 'cuda'; ``name``: the GPU's, default this one's) by
    ``VERL_DEVICE_FLOPS``'s rule; an unknown GPU infinite (verl's mfu then reads 0)."""
    if not device.startswith("cuda"):
        name = "CPU"
    name = name or torch.cuda.get_device_name()
    return next((flops for key, flops in sorted(VERL_DEVICE_FLOPS.items(), reverse=True) if key in name), float("inf"))


def model_shape(path: str | Path, live: LiveModels) -> Optional[ModelShape]:
    """The shape of the model at ``path`` (the module the run's trainer holds there, or its
    config.json); None when there is none to read."""
    held = live.lookup(path)
    try:
        if held is not None:
            module = held.module
            config = getattr(module, "config", None) or getattr(getattr(module, "module", None), "config", None)
            return ModelShape.from_dict(config.to_dict())
        return ModelShape.from_dict(json.loads((live.on_disk(path) / "config.json").read_text()))
    except (AttributeError, OSError, ValueError, ConfigError):
        return None


def floor_metrics(stage: str, flops: float, device: str, dtype: str, devices: int = 1) -> dict[str, float]:
    """A stage's FLOPs, its floor in seconds on ``devices`` such devices and the rate behind it, as the
    stage reports them."""
    rate = device_rate(device, dtype)
    return {f"perf/stage_flops/{stage}": float(flops), f"perf/stage_floor_seconds/{stage}": flops / (rate * devices),
            "perf/device_matmul_flops_per_s": rate}
