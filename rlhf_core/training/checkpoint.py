"""The update's checkpoint: Hugging Face models for the next rollout, optimizer state for exact
resume, a sha256 manifest, all written atomically (the directory appears complete or not at all).

    checkpoint/
      actor/                      causal LM, safetensors + tokenizer (LoRA: adapters merged in)
      actor_adapter/              LoRA only: the peft adapter (what the next update trains on)
      critic/                     token-classification value model (1 label), safetensors + tokenizer
      deepspeed/actor_optim.safetensors, actor_state.json    AdamW moments by parameter name, counters
      deepspeed/critic_optim.safetensors, critic_state.json
      rng.safetensors             torch RNG state(s)
      trainer_state.json          KL controller, python/numpy RNG, data position, run facts
      manifest.json               {"files": {relative path: {"sha256", "bytes"}}}

Nothing here is read with pickle: safetensors and JSON only (see ``optim_state`` for why DeepSpeed's
own checkpoint format is not used). ``verify_checkpoint`` checks every file against the manifest
before anything is loaded and names the first missing, truncated or corrupt file.
"""

from __future__ import annotations

import contextlib
import json
import random
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from rlhf_core.io.atomic import atomic_dir
from rlhf_core.io.checksums import FORMAT_VERSION, write_checksums
from rlhf_core.training.distributed import DistInfo, barrier
from rlhf_core.training.engines import TrainEngine
from rlhf_core.training.optim_state import counters, gather_optimizer_state



# ---------------------------------------------------------------------------------------------
# RNG (no pickle: torch states as uint8 tensors, python/numpy states as JSON)
# ---------------------------------------------------------------------------------------------


def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return tensors, {"python": [version, list(internal), gauss],
                     "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]}


def restore_rng(tensors: dict[str, torch.Tensor], state: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = [tensors[k] for k in sorted(tensors) if k.startswith("torch_cuda_")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def seed_rng(seed: int) -> None:
    """The RNG an update starts from when no checkpoint precedes it: torch (CPU and every CUDA
    device), python and numpy seeded from ``trainer.seed``, so its checkpoint's saved state never
    depends on what the process did before (numpy and python seed themselves from the OS at start)."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


# ---------------------------------------------------------------------------------------------
# gathering full weights (collective under ZeRO-3)
# ---------------------------------------------------------------------------------------------


def full_state_dict(te: TrainEngine, dist: DistInfo) -> Optional[dict[str, torch.Tensor]]:
    """The module's complete state dict on CPU at rank 0 (None elsewhere). Tied weights stay shared.
    Under ZeRO-3 the partitions are gathered first; every rank must call this."""
    import deepspeed

    module = te.module
    gather = (deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)
              if te.zero_stage == 3 else contextlib.nullcontext())
    with gather:
        if not dist.is_main:
            return None
        copies: dict[tuple, torch.Tensor] = {}
        return {k: copies.setdefault((v.data_ptr(), tuple(v.shape)), v.detach().cpu().clone())
                for k, v in module.state_dict().items()}


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------


def _save_tokenizer(src: Path, dst: Path) -> None:
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(src).save_pretrained(dst)


def _export_lora(te: TrainEngine, state: dict[str, torch.Tensor], base_path: Path, out: Path) -> None:
    """actor_adapter/ (peft format) and actor/ with the adapters merged, built on a fresh CPU copy of
    the base so the training weights are never merged and unmerged in place (which would round)."""
    from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    adapter = get_peft_model_state_dict(te.module, state_dict=state)
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=next(iter(state.values())).dtype)
    peft_model = get_peft_model(base, te.lora.peft_config())
    set_peft_model_state_dict(peft_model, adapter)
    peft_model.save_pretrained(out / "actor_adapter", safe_serialization=True)
    peft_model.merge_and_unload().save_pretrained(out / "actor", safe_serialization=True)


def _save_optimizer(te: TrainEngine, tensors: dict[str, torch.Tensor], meta: dict[str, Any], out: Path) -> None:
    from safetensors.torch import save_file

    (out / "deepspeed").mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "deepspeed" / f"{te.role}_optim.safetensors"))
    (out / "deepspeed" / f"{te.role}_state.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


def save_checkpoint(directory: str | Path, *, actor: TrainEngine, critic: TrainEngine, tokenizer_path: Path,
                    trainer_state: dict[str, Any], dist: DistInfo, lora_base: Optional[Path] = None) -> Path:
    """Write the checkpoint atomically (rank 0 writes; every rank must call: ZeRO gathers are
    collective). ``lora_base``: the frozen base model when the actor trains LoRA adapters."""
    from safetensors.torch import save_file

    directory = Path(directory)
    gathered = {}
    for te in (actor, critic):  # gather everything first: collective calls in one fixed order
        gathered[te.role] = (full_state_dict(te, dist), gather_optimizer_state(te), counters(te))
    if dist.is_main:
        with atomic_dir(directory) as tmp:
            actor_state, _, _ = gathered["actor"]
            if actor.lora is not None:
                _export_lora(actor, actor_state, lora_base, tmp)
            else:
                actor.module.save_pretrained(tmp / "actor", state_dict=actor_state, safe_serialization=True)
            critic.module.save_pretrained(tmp / "critic", state_dict=gathered["critic"][0], safe_serialization=True)
            for sub in ("actor", "critic"):
                _save_tokenizer(tokenizer_path, tmp / sub)
            for te in (actor, critic):
                _save_optimizer(te, gathered[te.role][1], gathered[te.role][2], tmp)
            rng_tensors, rng_json = rng_state()
            save_file(rng_tensors, str(tmp / "rng.safetensors"))
            state = {**trainer_state, "rng": rng_json, "format": FORMAT_VERSION}
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
            write_checksums(tmp)
    barrier()
    return directory


# ---------------------------------------------------------------------------------------------
# reading (after verify_checkpoint)
# ---------------------------------------------------------------------------------------------


def load_optimizer_files(directory: Path, role: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from safetensors.torch import load_file

    tensors = load_file(str(directory / "deepspeed" / f"{role}_optim.safetensors"))
    meta = json.loads((directory / "deepspeed" / f"{role}_state.json").read_text())
    return tensors, meta


def load_trainer_state(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "trainer_state.json").read_text())


def load_rng(directory: Path) -> None:
    from safetensors.torch import load_file

    restore_rng(load_file(str(directory / "rng.safetensors")), load_trainer_state(directory)["rng"])
