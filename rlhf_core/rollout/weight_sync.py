"""Weights into a running rollout engine, checked before and after (no vLLM here: tested on CPU).

Before anything is written, the trainer's (name, tensor) pairs are checked against what the engine
loaded at start — every name and every shape, read from the checkpoint's safetensors headers — so
a mismatch is one clear error and the engine keeps its old weights (vLLM's loaders would raise
halfway, leaving the model half written and unusable). After writing, a few next-token log-probs
of a fixed probe sequence are taken from the engine and from the trainer's module and compared:
they must agree to the precision of the dtype.

    shapes = checkpoint_shapes(model_dir)                    # {HF name: shape} the engine loaded
    weights = prepare_named_tensors(module.named_parameters())
    check_against(weights, shapes)                           # raises before a byte moves
    ... engine writes them ...
    diff = log_prob_gap(engine_log_probs, trainer_log_probs(module, probe), dtype="fp32")
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

from rlhf_core.errors import RLHFError

if TYPE_CHECKING:
    import torch

# Wrappers that prefix a module's parameter names: DeepSpeed / DDP (`module.`), torch.compile
# (`_orig_mod.`), FSDP and activation checkpointing. None of them is part of a Hugging Face name.
_WRAPPER_PREFIX = re.compile(r"^(module\.)+")
_WRAPPER_INFIX = re.compile(r"(^|\.)(_orig_mod|_fsdp_wrapped_module|_checkpoint_wrapped_module)\.")

SYNC_TOLERANCE = {"fp32": 1e-3, "fp16": 5e-2, "bf16": 2e-1}
"""Largest |engine − trainer| next-token log-prob on the probe that still counts as the same weights.
fp32 on CPU measures < 1e-6 (vLLM's CPU kernels against transformers' sdpa); the half-precision
bounds leave room for kernels that round differently (a failed or partial sync moves log-probs by
whole nats)."""
PROBE_TOKENS = 32


def hf_weight_name(name: str) -> str:
    """A trainer-side parameter name as the Hugging Face checkpoint spells it (the names vLLM's
    loaders map onto its fused layers): wrapper prefixes dropped."""
    return _WRAPPER_INFIX.sub(r"\1", _WRAPPER_PREFIX.sub("", name))


def prepare_named_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                          to_cpu: bool = False) -> list[tuple[str, torch.Tensor]]:
    """(Hugging Face name, detached tensor) pairs, refusing what would load wrong.

    A ZeRO-3 parameter outside ``GatheredParameters`` is an empty placeholder (its shard lives in
    ``ds_tensor``): refused by name. Two names that map to one Hugging Face name (``module.x`` and
    ``x``) are refused: which one wins would be an accident of order. ``to_cpu`` makes host copies,
    for workers in other processes, which cannot take this process's device memory.
    """
    out: list[tuple[str, torch.Tensor]] = []
    seen: dict[str, str] = {}
    for name, tensor in named_tensors:
        hf_name = hf_weight_name(name)
        if hf_name in seen:
            raise RLHFError(f"load_weights got two tensors for {hf_name!r} ({seen[hf_name]!r} and {name!r}); "
                            "pass each parameter once")
        seen[hf_name] = name
        if tensor.numel() == 0:
            raise RLHFError(f"load_weights got an empty tensor for {name!r} (a ZeRO-3 partition?): gather it "
                            "first (deepspeed.zero.GatheredParameters) and pass the full tensor")
        tensor = tensor.detach()
        out.append((hf_name, tensor.cpu() if to_cpu else tensor))
    if not out:
        raise RLHFError("load_weights got no tensors: pass the actor's (name, tensor) pairs, e.g. "
                        "model.named_parameters()")
    return out


# --- what the engine loaded --------------------------------------------------------------------

def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: those its index names, else every ``*.safetensors``."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    return sorted(model_dir.glob("*.safetensors"))


def checkpoint_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """{Hugging Face tensor name: shape} of the checkpoint in ``model_dir``, from the safetensors
    headers (nothing is loaded): the names and shapes an engine built on it took in."""
    from safetensors import safe_open

    files = safetensors_files(model_dir)
    if not files:
        raise RLHFError(f"{model_dir} holds no .safetensors weights: the vllm rollout engine checks weight "
                        "updates against them; save the model with safe_serialization=True")
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def read_checkpoint(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every weight in the checkpoint, one file open at a time."""
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def check_against(weights: list[tuple[str, torch.Tensor]], shapes: dict[str, tuple[int, ...]], *,
                  what: str = "the rollout engine's model") -> None:
    """Refuse, before anything is written, any name the engine's checkpoint lacks and any shape that
    differs from the one it loaded; lists the first few of each."""
    unknown = [name for name, _ in weights if name not in shapes]
    wrong = [f"{name} {tuple(t.shape)} (loaded {shapes[name]})" for name, t in weights
             if name in shapes and tuple(t.shape) != shapes[name]]
    if not unknown and not wrong:
        return
    parts = []
    if unknown:
        parts.append(f"{len(unknown)} name(s) it does not have ({', '.join(unknown[:3])}"
                     + (", ..." if len(unknown) > 3 else "") + ")")
    if wrong:
        parts.append(f"{len(wrong)} shape(s) that differ ({'; '.join(wrong[:3])}" + ("; ..." if len(wrong) > 3 else "")
                     + ")")
    raise RLHFError(f"weights for {what} refused, nothing written (it keeps its weights): {' and '.join(parts)}; "
                    "pass the actor's own Hugging Face parameters (model.named_parameters() of the causal LM the "
                    "engine was started on)")


# --- checked after writing: log-probs of a probe ---------------------------------------------------

def probe_tokens(vocab_size: int, length: int = PROBE_TOKENS, seed: int = 0) -> list[int]:
    """A fixed token sequence to compare engine and trainer on (seeded: the same every sync)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=g).tolist()


def trainer_log_probs(module: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """(T − 1,) log p(token t | tokens before it) under ``module`` (a causal LM), temperature 1, at its
    own dtype, on its own device; its train/eval mode is restored afterwards."""
    import torch

    device = next(module.parameters()).device
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            logits = module(input_ids=torch.tensor([token_ids], device=device)).logits[0, :-1].float()  # (T-1, V)
    finally:
        module.train(was_training)
    targets = torch.tensor(token_ids[1:], device=device)[:, None]
    return torch.log_softmax(logits, dim=-1).gather(1, targets).squeeze(1).cpu()


def log_prob_gap(engine: list[float], trainer: torch.Tensor, *, dtype: str, what: str = "the rollout engine") -> float:
    """max |engine − trainer| over the probe; raises when it exceeds ``SYNC_TOLERANCE[dtype]``."""
    import torch

    if len(engine) != trainer.numel():
        raise RLHFError(f"{what} returned {len(engine)} probe log-probs for {trainer.numel()} positions")
    gap = float((torch.tensor(engine, dtype=torch.float32) - trainer.float()).abs().max())
    tolerance = SYNC_TOLERANCE.get(dtype, SYNC_TOLERANCE["bf16"])
    if not math.isfinite(gap) or gap > tolerance:
        raise RLHFError(f"after the weight sync {what}'s log-probs differ from the trainer's by up to {gap:.3g} "
                        f"(more than {tolerance:g} at {dtype}): it does not sample from the policy being trained; "
                        "this is a bug of the weight sync (report it), or set trainer.resident_models=false to "
                        "start the engine from each checkpoint instead")
    return gap
