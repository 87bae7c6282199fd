"""Loading the models scoring runs (actor, reference, critic) and telling identical weights apart."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from rlhf_core.errors import CheckpointError
from rlhf_core.io.timing import HASHING, MEMORY_RELEASE, MODEL_LOAD, timed
from rlhf_core.models import sdpa_varlen as _sdpa_varlen  # noqa: F401  (registers attn_implementation=sdpa_varlen)
from rlhf_core.models.attention import resolve_attention
from rlhf_core.models.storage import load_pretrained, own_aligned_storage
from rlhf_core.scoring import cache
from rlhf_core.scoring.held import HeldModels


@dataclass
class ModelPaths:
    """The models a score pass over iteration k reads (the ones k started from, so a rerun of an old
    iteration reproduces its table)."""

    actor: Path
    reference: Path
    critic: Optional[Path]
    """None in a run without a critic: the values column then holds zeros."""
    reward_model: Optional[Path]
    rm_input_tokenizer: Optional[Path] = None
    """reward_model.model.input_tokenizer: decode responses with it and re-render for the RM."""


def scoring_device(preference: str = "auto") -> torch.device:
    """trainer.device: 'auto' → CUDA when present, else CPU."""
    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def scoring_dtype(device: torch.device, deepspeed_dtype: str = "auto") -> torch.dtype:
    """The dtype the update stage trains in, so old log-probs and the first update's log-probs come
    from the same arithmetic (and a module the trainer lends is the one asked for): the DeepSpeed
    dtype, whose 'auto' is fp32 on CPU and bf16 on CUDA."""
    if deepspeed_dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[deepspeed_dtype]


def _require_model_dir(path: Path, role: str) -> None:
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{role} model at {path} is missing config.json; point the config at a "
                              "Hugging Face model directory (or rerun the stage that writes it)")


def load_causal_lm(path: str | Path, device: torch.device, dtype: torch.dtype, role: str = "actor", *,
                   session: HeldModels, shared: bool = False, attention: Optional[str] = None):
    """``AutoModelForCausalLM`` in eval mode with gradients off, attention ``attention`` (an
    implementation name or 'auto', see ``rlhf_core.models.attention``: stages pass the config's, so
    scoring, update and guard share one kernel). ``shared=True``: possibly an already loaded, shared
    model from ``scoring.cache`` — only for code that never changes its weights. Gradients off as
    on a module the trainer lends (``training.resident``): both give the same bits. ``session``:
    the trainer's module when it holds ``path``'s state (an empty one reads the disk)."""
    path = Path(path)
    held = _borrow(session, path, "causal_lm", device, dtype)
    if held is not None:
        return held
    path = session.live.on_disk(path)
    _require_model_dir(path, role)
    attention = resolve_attention(attention or "auto", device)

    def load():
        with timed(MODEL_LOAD):
            model = load_pretrained(AutoModelForCausalLM, path, dtype=dtype, attn_implementation=attention)
            return model.to(device).eval().requires_grad_(False)

    if not shared:
        return load()
    return cache.shared("causal_lm", path, device.type, (str(device), str(dtype), attention), load)


@contextlib.contextmanager
def reference_policy(path: str | Path, device: torch.device, dtype: torch.dtype, attention: Optional[str],
                     param_offload: bool, *, session: HeldModels) -> Iterator[torch.nn.Module]:
    """The reference policy on ``device`` for one pass (score, guard, validation KL), held by the
    session for the run and placed by ``actor_rollout_ref.ref.fsdp_config.param_offload``
    (``scoring.frozen``); attention as ``load_causal_lm``'s."""
    path = Path(path)
    _require_model_dir(path, "reference")
    attention = resolve_attention(attention or "auto", device)

    def load(where: torch.device):
        with timed(MODEL_LOAD):
            model = load_pretrained(AutoModelForCausalLM, path, dtype=dtype, attn_implementation=attention)
            return model.to(where).eval()

    with session.frozen.on_device("reference", path, device, param_offload, (str(dtype), attention), load) as model:
        yield model


def load_tokenizer(path: str | Path, *, session: HeldModels, shared: bool = False):
    """``AutoTokenizer`` of a model directory (``shared``: see ``load_causal_lm``; callers must not
    change its settings)."""
    from transformers import AutoTokenizer

    held = session.live.lookup(path)
    if held is not None:  # the checkpoint is not on disk (yet): its tokenizer is the one it would copy
        path = held.tokenizer_dir
    else:
        path = session.live.on_disk(path)

    def load():
        with timed(MODEL_LOAD):
            return AutoTokenizer.from_pretrained(path)

    return cache.shared("tokenizer", Path(path), "cpu", (), load) if shared else load()


def _borrow(session: HeldModels, path: Path, kind: str, device: torch.device, dtype: torch.dtype):
    """The trainer's own module when the session holds ``path``'s state (``models.live``), in eval
    mode with gradients off (as it is lent); None otherwise. It must already sit on ``device`` in ``dtype`` — the update trains in the dtype scoring
    uses (``scoring_dtype``) — else the caller would score other arithmetic than it asked for."""
    held = session.live.lookup(path)
    if held is None or held.kind != kind:
        return None
    first = next(held.module.parameters())
    if first.device.type != device.type or first.dtype != dtype:
        raise CheckpointError(f"{path} is held in memory as {first.dtype} on {first.device}, but {dtype} on "
                              f"{device} was asked for; set trainer.resident_models=false to load it from disk")
    return held.module.eval()


def release(model_ref: "weakref.ref", device: torch.device, session: HeldModels) -> None:
    """Give a model's memory back after the caller dropped its last reference (pass a weakref taken
    before ``del``). Reference counting frees a model at once unless a reference cycle holds it
    (seen for the first model a process loads) — only then run the full garbage collection, which
    walks the whole heap and costs 0.2-0.5 s in a process with Prefect and MLflow loaded. A model
    the cache or the session holds stays loaded on purpose."""
    model = model_ref()
    pending = model is not None and not cache.holds(model) and not session.holds(model)
    del model
    if pending:
        with timed(MEMORY_RELEASE):
            gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def load_critic(path: str | Path, device: torch.device, dtype: torch.dtype, attention: str = "auto", *,
                session: HeldModels):
    """The value model: ``AutoModelForTokenClassification`` with one label, eval mode (no dropout),
    gradients off and attention as ``load_causal_lm``'s."""
    from transformers import AutoModelForTokenClassification

    path = Path(path)
    held = _borrow(session, path, "critic", device, dtype)
    if held is not None:
        return held
    path = session.live.on_disk(path)
    _require_model_dir(path, "critic")
    with timed(MODEL_LOAD):
        model = load_pretrained(
            AutoModelForTokenClassification, path, num_labels=1, dtype=dtype, attn_implementation=resolve_attention(attention, device))
        return model.to(device).eval().requires_grad_(False)


def weights_fingerprint(path: str | Path) -> Optional[str]:
    """sha256 over config.json and every *.safetensors file (None when there are no safetensors
    weights: then nothing can be proven equal). Tokenizer files are left out: they do not change the
    log-probs of given token ids. A state held only in memory has no files: None."""
    path = Path(path)
    weights = sorted(path.glob("*.safetensors"))
    if not weights or not (path / "config.json").is_file():
        return None
    h = hashlib.sha256()
    with timed(HASHING):
        for f in [path / "config.json", *weights]:
            h.update(f.name.encode())
            with open(f, "rb") as fh:
                while chunk := fh.read(1 << 20):
                    h.update(chunk)
    return h.hexdigest()


def same_weights(a: str | Path, b: str | Path) -> bool:
    """True only when both directories hold byte-identical config and safetensors weights, so
    log-probs computed under one are exactly those of the other.

    Compared byte by byte, stopping at the first difference: a trained actor differs from its
    reference early in its first file, where hashing both (``weights_fingerprint``) read every byte
    of both every iteration — seconds per score pass at 0.5B, a minute at 7B. A state held only in
    memory has no files: False."""
    a, b = Path(a), Path(b)
    names = _weight_files(a)
    if not names or names != _weight_files(b):
        return False
    if a.resolve() == b.resolve():
        return True
    if any((a / n).stat().st_size != (b / n).stat().st_size for n in names):
        return False
    with timed(HASHING):
        return all(_same_bytes(a / n, b / n) for n in names)


def _weight_files(path: Path) -> list[str]:
    """config.json and the safetensors files of a model directory; [] without either."""
    weights = sorted(p.name for p in path.glob("*.safetensors"))
    return ["config.json", *weights] if weights and (path / "config.json").is_file() else []


def _same_bytes(x: Path, y: Path, chunk: int = 1 << 22) -> bool:
    with open(x, "rb") as fx, open(y, "rb") as fy:
        while True:
            bx, by = fx.read(chunk), fy.read(chunk)
            if bx != by:
                return False
            if not bx:
                return True


def is_lora_dir(path: Path) -> bool:
    return (Path(path) / "adapter_config.json").is_file()


def load_merged_actor(path: str | Path, device=None, dtype=None, attention: str = "auto", *,
                      session: Optional[HeldModels] = None):
    """The actor as a plain causal LM in eval mode: a full model directory as is, a peft adapter
    directory merged into its base (``base_model_name_or_path`` in adapter_config.json). Without a
    session (an export) it is read from disk."""
    path = Path(path)
    device = device or torch.device("cpu")
    dtype = dtype or torch.float32
    if not is_lora_dir(path):
        return load_causal_lm(path, device, dtype, role="actor", attention=attention, session=session or HeldModels())
    base_path = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base_path or not Path(base_path).is_dir():
        raise CheckpointError(f"{path}/adapter_config.json names base model {base_path!r}, which is not a "
                              "local directory; restore the base model there or edit base_model_name_or_path")
    base = load_pretrained(AutoModelForCausalLM, base_path, dtype=dtype,
                           attn_implementation=resolve_attention(attention, device))
    merged = own_aligned_storage(PeftModel.from_pretrained(base, path).merge_and_unload())
    return merged.to(device).eval()
