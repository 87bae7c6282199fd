"""The durable checkpoint: Hugging Face models for the next rollout, each rank's own optimizer shard
for exact resume, a sha256 manifest, all written atomically (the directory appears complete or
not at all).

    checkpoint/
      actor/                      causal LM, safetensors + tokenizer (LoRA: adapters merged in)
      actor_adapter/              LoRA only: the peft adapter (what the next update trains on)
      critic/                     token-classification value model (1 label), safetensors + tokenizer
      deepspeed/actor_shard.rank{r}-of-{N}.safetensors   rank r's optimizer partition (train_state)
      deepspeed/actor_shard.rank{r}-of-{N}.json          its layout + counters (Adam step, lr position)
      deepspeed/critic_shard.rank{r}-of-{N}.{safetensors,json}
      deepspeed/{actor,critic}_state.json                Adam step, lr position, counters (rank 0)
      rng.safetensors             torch RNG state(s)
      trainer_state.json          python/numpy RNG, data position, run facts
      manifest.json               {"files": {relative path: {"sha256", "bytes"}}}

No rank gathers the optimizer state: each writes the partition it owns (``train_state``), so the
host memory a save needs is this rank's shard plus one tensor in flight. Rank 0 writes the HF
directories; under ZeRO-3 at world > 1 it gathers the weights one parameter at a time while
writing them (the other ranks join each gather in the same order). Every file of ours is hashed while it is written
(``io.safetensors_stream``); the manifest is built from those digests, and only small files that
other libraries write (tokenizer, config) are read back. With N ranks all write into one
temporary directory and rank 0 renames it after a barrier.

Checkpoints written before the sharded layout (``deepspeed/{role}_optim.safetensors`` + ``_state.json``,
full tensors by parameter name) still load (reading back: ``checkpoint_load``). Nothing here is read with pickle: safetensors and JSON
only (see ``optim_state`` for why DeepSpeed's own format is not used). ``verify_checkpoint`` checks
every file against the manifest before anything is loaded and names the first bad one.

``BackgroundWriter`` writes a checkpoint from a ``train_state.capture`` in a daemon thread while
training goes on; with several ranks (ZeRO 0-2) every rank's writer writes its part with no
collective, and rank 0's seals the checkpoint once every rank's shard is in.
"""

from __future__ import annotations

import contextlib
import copy
import json
import random
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import numpy as np
import torch

from rlhf_core.errors import CheckpointError, disk_full_as_user_error
from rlhf_core.io.atomic import atomic_dir, atomic_write_text, seal_dir, staging_dir
from rlhf_core.io.checksums import FORMAT_VERSION, write_manifest
from rlhf_core.io.timing import background
from rlhf_core.io.safetensors_stream import LazyTensor, Source, write_hashed_json, write_safetensors
from rlhf_core.models.threads import serial_background_thread
from rlhf_core.training.distributed import DistInfo, barrier
from rlhf_core.training.engines import TrainEngine, present
from rlhf_core.training.train_state import (TrainState, module_tensors, restore_rng, rng_state, role_views,
                                            shard_weights)

__all__ = ["BackgroundWriter", "can_write_in_background", "full_state_dict", "prepare_staging", "restore_rng",
           "rng_state", "save_checkpoint", "save_tokenizer", "seed_rng", "shard_name"]

COUNTER_KEYS = ("adam_step", "lr_schedule_step", "global_steps", "global_samples", "skipped_steps", "zero_stage",
                "dtype", "world_size")
"""What deepspeed/{role}_state.json holds: the role's position, readable without the shard layout."""
HF_METADATA = {"format": "pt"}  # transformers refuses a safetensors weight file without it


def seed_rng(seed: int) -> None:
    """The RNG an update starts from when no checkpoint precedes it: torch (CPU and every CUDA
    device), python and numpy seeded from ``trainer.seed``, so its checkpoint's saved state never
    depends on what the process did before (numpy and python seed themselves from the OS at start)."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def shard_name(role: str, rank: int, world_size: int) -> str:
    """File stem of rank ``rank``'s optimizer shard under deepspeed/ (+ .safetensors / .json)."""
    return f"{role}_shard.rank{rank}-of-{world_size}"


SHARD_FILE = re.compile(r"^(?P<role>\w+?)_shard\.rank(?P<rank>\d+)-of-(?P<world>\d+)\.json$")
"""A rank's optimizer-shard layout file, ``shard_name(role, rank, world)`` + .json (read back by ``checkpoint_load``)."""


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


def _untied(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One entry per tensor (the first name wins, as HF keeps embed_tokens and re-ties lm_head)."""
    seen: set[int] = set()
    out = {}
    for k, v in weights.items():
        if id(v) not in seen:
            seen.add(id(v))
            out[k] = v
    return out


# ---------------------------------------------------------------------------------------------
# what one checkpoint write needs, detached from the live engines
# ---------------------------------------------------------------------------------------------


@dataclass
class _RoleJob:
    role: str
    optim: dict[str, torch.Tensor]
    meta: dict
    weights: Optional[dict[str, torch.Tensor]] = None
    """Rank 0: the HF state dict to write (tied aliases dropped); None elsewhere and with LoRA."""
    config: Any = None
    generation_config: Any = None
    lora_adapter: Optional[dict[str, torch.Tensor]] = None
    lora_config: Any = None
    lora_dtype: Optional[torch.dtype] = None


@dataclass
class _Job:
    roles: list[_RoleJob]
    rng_tensors: dict[str, torch.Tensor]
    rng_json: dict
    trainer_state: dict
    tokenizer_path: Path
    lora_base: Optional[Path]


def _hf_config(module: torch.nn.Module, dtype: torch.dtype):
    """Copies of the module's config and generation config, as HF ``save_pretrained`` writes them."""
    config = copy.deepcopy(module.config)
    config.architectures = [type(module).__name__]
    config.dtype = dtype
    gen = None
    if getattr(module, "can_generate", lambda: False)() and getattr(module, "generation_config", None) is not None:
        gen = copy.deepcopy(module.generation_config)
    return config, gen


def _gathered_one_at_a_time(te: TrainEngine, dist: DistInfo, params: dict[str, torch.Tensor], meta: dict,
                            captured: bool) -> dict[str, Source]:
    """ZeRO-3 at world > 1: the full weights as ``LazyTensor``s, each gathered only when the writer
    reaches it, so rank 0 holds one full parameter at a time. Producing one is collective: rank 0
    produces them while writing, the other ranks in the same order in ``_drain``."""
    import deepspeed
    import torch.distributed as tdist

    live, _ = module_tensors(te)
    device = dist.device if dist.device != "cpu" else "cpu"

    def from_capture(key, shape):
        part = params[key].to(device)
        pieces = [torch.empty_like(part) for _ in range(dist.world_size)]
        tdist.all_gather(pieces, part)
        return torch.cat(pieces)[:int(np.prod(shape, dtype=np.int64))].view(shape).cpu()

    def from_engine(key):
        p = live[key]
        with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
            return p.data.detach().cpu().clone()

    out: dict[str, Source] = {}
    for key, (shape, dtype) in meta["params"].items():
        if key not in meta["partitioned"]:
            out[key] = params[key]  # buffers: every rank holds them whole
            continue
        produce = (lambda k=key, s=tuple(shape): from_capture(k, s)) if captured else (lambda k=key: from_engine(k))
        out[key] = LazyTensor(getattr(torch, dtype.split(".")[-1]), tuple(shape), produce)
    return out


def _weights(te: TrainEngine, dist: DistInfo, state: Optional[TrainState], params, meta) -> Optional[dict]:
    """What rank 0 writes as the HF weights (None on the other ranks unless they must join gathers)."""
    if not meta["partitioned"] or dist.world_size == 1:  # every rank holds the weights whole
        return shard_weights(params, meta) if dist.is_main else None
    if te.lora is not None:  # peft picks the adapter keys from real tensors: gather them all
        return full_state_dict(te, dist) if state is None else _materialise(
            _gathered_one_at_a_time(te, dist, params, meta, captured=True), dist)
    return _gathered_one_at_a_time(te, dist, params, meta, captured=state is not None)


def _materialise(lazy: dict[str, Source], dist: DistInfo) -> Optional[dict[str, torch.Tensor]]:
    out = {k: v.produce() if isinstance(v, LazyTensor) else v for k, v in lazy.items()}
    return out if dist.is_main else None


def _drain(job: "_Job") -> None:
    """Non-zero ranks: join rank 0's one-at-a-time ZeRO-3 gathers, in its order (``_write_main``)."""
    for r in job.roles:
        for v in (r.weights or {}).values():
            if isinstance(v, LazyTensor):
                v.produce()


def _role_job(te: TrainEngine, dist: DistInfo, state: Optional[TrainState]) -> _RoleJob:
    """Every rank must call this for each role in the same order (a ZeRO-3 weight gather is
    collective). From ``state`` when given, else from live views of the engine (no copies: the
    writer streams them one tensor at a time)."""
    if state is not None:
        shard = state.roles[te.role]
        params, optim, meta = shard.params, shard.optim, shard.meta
    else:
        params, optim, meta = role_views(te, dist.world_size)
    weights = _weights(te, dist, state, params, meta)
    job = _RoleJob(te.role, optim, meta)
    if not dist.is_main:
        job.weights = weights  # lazy ZeRO-3 gathers this rank must join, or None
        return job
    dtype = next(v.dtype for v in weights.values() if v.dtype.is_floating_point)
    if te.lora is not None:
        from peft import get_peft_model_state_dict

        job.lora_adapter = get_peft_model_state_dict(te.module, state_dict=weights)
        job.lora_config, job.lora_dtype = te.lora.peft_config(), dtype
    else:
        job.weights = _untied(weights)
        job.config, job.generation_config = _hf_config(te.module, dtype)
    return job


def _make_job(actor: TrainEngine, critic: Optional[TrainEngine], dist: DistInfo, state: Optional[TrainState],
              tokenizer_path: Path, trainer_state: dict, lora_base: Optional[Path]) -> _Job:
    roles = [_role_job(te, dist, state) for te in present(actor, critic)]  # collective calls in one fixed order
    rng_tensors, rng_json = (state.rng_tensors, state.rng_json) if state is not None else rng_state()
    return _Job(roles, rng_tensors, rng_json, dict(trainer_state), Path(tokenizer_path),
                Path(lora_base) if lora_base is not None else None)


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------


def save_tokenizer(src: Path, dst: Path) -> None:
    """The tokenizer files of model directory ``src`` into ``dst``."""
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(src).save_pretrained(dst)


def _write_lora(job: _RoleJob, base_path: Path, out: Path) -> None:
    """actor_adapter/ (peft format) and actor/ with the adapters merged, built on a fresh CPU copy of
    the base so the training weights are never merged and unmerged in place (which would round)."""
    from peft import get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=job.lora_dtype)
    peft_model = get_peft_model(base, job.lora_config)
    set_peft_model_state_dict(peft_model, job.lora_adapter)
    peft_model.save_pretrained(out / "actor_adapter", safe_serialization=True)
    peft_model.merge_and_unload().save_pretrained(out / "actor", safe_serialization=True)


def _write_hf(job: _RoleJob, out: Path) -> dict[str, dict]:
    out.mkdir(parents=True, exist_ok=True)
    job.config.save_pretrained(out)
    if job.generation_config is not None:
        job.generation_config.save_pretrained(out)
    return {"model.safetensors": write_safetensors(out / "model.safetensors", job.weights, metadata=HF_METADATA)}


def _write_shard(tmp: Path, job: _RoleJob, rank: int, world_size: int) -> dict[str, dict]:
    (tmp / "deepspeed").mkdir(exist_ok=True)
    stem = shard_name(job.role, rank, world_size)
    meta = {**job.meta, "rank": rank, "format": FORMAT_VERSION}
    return {f"deepspeed/{stem}.safetensors": write_safetensors(tmp / "deepspeed" / f"{stem}.safetensors", job.optim),
            f"deepspeed/{stem}.json": write_hashed_json(tmp / "deepspeed" / f"{stem}.json", meta)}


def _write_main(tmp: Path, job: _Job) -> dict[str, dict]:
    """Rank 0's files: HF directories, tokenizers, RNG, trainer state. Returns their digests."""
    recorded: dict[str, dict] = {}
    for r in job.roles:
        if r.lora_adapter is not None:
            _write_lora(r, job.lora_base, tmp)
        else:
            recorded.update({f"{r.role}/{k}": v for k, v in _write_hf(r, tmp / r.role).items()})
        save_tokenizer(job.tokenizer_path, tmp / r.role)
        counters = {k: r.meta[k] for k in COUNTER_KEYS}
        counters["shards"] = [shard_name(r.role, i, r.meta["world_size"]) for i in range(r.meta["world_size"])]
        recorded[f"deepspeed/{r.role}_state.json"] = write_hashed_json(tmp / "deepspeed" / f"{r.role}_state.json",
                                                                       counters)
    recorded["rng.safetensors"] = write_safetensors(tmp / "rng.safetensors", job.rng_tensors)
    trainer = {**job.trainer_state, "rng": job.rng_json, "format": FORMAT_VERSION}
    recorded["trainer_state.json"] = write_hashed_json(tmp / "trainer_state.json", trainer)
    return recorded


def _hashes_sidecar(tmp: Path, rank: int) -> Path:
    # how rank r hands rank 0 the digests of its shard files (removed before the manifest is sealed)
    return tmp / "deepspeed" / f".digests.rank{rank}.json"


def _write_rank(tmp: Path, job: _Job, dist: DistInfo) -> dict[str, dict]:
    recorded: dict[str, dict] = {}
    for r in job.roles:
        recorded.update(_write_shard(tmp, r, dist.rank, dist.world_size))
    if dist.is_main:
        recorded.update(_write_main(tmp, job))
    else:
        _drain(job)
    return recorded


def _broadcast_path(path: Optional[Path]) -> Path:
    """Rank 0's temporary directory, told to every rank (a byte tensor over the process group)."""
    import torch.distributed as tdist

    size = torch.zeros(1, dtype=torch.int64)
    raw = str(path).encode() if path is not None else b""
    size[0] = len(raw)
    tdist.broadcast(size, src=0)
    buf = torch.zeros(int(size[0]), dtype=torch.uint8)
    if path is not None:
        buf.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    tdist.broadcast(buf, src=0)
    return Path(bytes(buf.tolist()).decode())


def _save_multi_rank(directory: Path, job: _Job, dist: DistInfo) -> None:
    if dist.is_main:
        with atomic_dir(directory) as tmp:
            (tmp / "deepspeed").mkdir()  # before the other ranks learn the path and write into it
            _broadcast_path(tmp)
            recorded = _write_rank(tmp, job, dist)
            barrier()  # every rank's shard and digests are in
            for r in range(1, dist.world_size):
                sidecar = _hashes_sidecar(tmp, r)
                recorded.update(json.loads(sidecar.read_text()))
                sidecar.unlink()
            write_manifest(tmp, recorded)
    else:
        tmp = _broadcast_path(None)
        recorded = _write_rank(tmp, job, dist)
        _hashes_sidecar(tmp, dist.rank).write_text(json.dumps(recorded))
        barrier()


def save_checkpoint(directory: str | Path, *, actor: TrainEngine, critic: Optional[TrainEngine], tokenizer_path: Path,
                    trainer_state: dict[str, Any], dist: DistInfo, lora_base: Optional[Path] = None,
                    state: Optional[TrainState] = None) -> Path:
    """Write the checkpoint atomically; every rank must call (each writes its own optimizer shard;
    the ZeRO-3 weight gather is collective). ``state``: a ``train_state.capture`` taken earlier
    (the engines may have trained on since), else the engines' current state is written, streamed
    from the live tensors. ``lora_base``: the frozen base model when the actor trains LoRA adapters."""
    directory = Path(directory)
    job = _make_job(actor, critic, dist, state, tokenizer_path, trainer_state, lora_base)
    if dist.world_size == 1:
        _write_atomically(directory, job, dist)
    else:
        _save_multi_rank(directory, job, dist)
    barrier()
    return directory


def _write_atomically(directory: Path, job: _Job, dist: DistInfo) -> Path:
    with atomic_dir(directory) as tmp:
        write_manifest(tmp, _write_rank(tmp, job, dist))
    return directory


SHARDS_WAIT_S = 1800.0
"""How long rank 0's background writer waits for the other ranks' shards of a save."""


def can_write_in_background(engines: list[TrainEngine], world_size: int) -> bool:
    """Whether a save of these engines needs no collective: one rank, or weights every rank holds
    whole (ZeRO 0-2; a ZeRO-3 save gathers the weights with the other ranks)."""
    return world_size == 1 or all(te.zero_stage != 3 for te in engines)


def prepare_staging(directory: str | Path, dist: DistInfo, token: str) -> Path:
    """Every rank, in step: the temporary directory a background save of several ranks writes into
    (``BackgroundWriter.submit``'s ``staging``), made afresh by rank 0 before any rank writes."""
    tmp = staging_dir(directory, token)
    if dist.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # a crashed attempt's
        (tmp / "deepspeed").mkdir(parents=True)
    barrier()
    return tmp


def _failed_marker(tmp: Path, rank: int) -> Path:
    return tmp / "deepspeed" / f".failed.rank{rank}"


def _write_staged(directory: Path, tmp: Path, job: _Job, dist: DistInfo) -> None:
    """One rank's part of a save of several ranks, with no collective: each writes its shard and
    hands rank 0 its digests in a file; rank 0 waits for all, seals the manifest, renames."""
    try:
        recorded = _write_rank(tmp, job, dist)
    except BaseException as exc:
        if not dist.is_main:
            with contextlib.suppress(OSError):
                _failed_marker(tmp, dist.rank).write_text(f"{type(exc).__name__}: {exc}")
        raise
    if not dist.is_main:
        atomic_write_text(_hashes_sidecar(tmp, dist.rank), json.dumps(recorded))
        return
    for r in range(1, dist.world_size):
        recorded.update(_shard_digests(tmp, r))
    write_manifest(tmp, recorded)
    with disk_full_as_user_error(directory):
        seal_dir(tmp, directory)


def _shard_digests(tmp: Path, rank: int) -> dict[str, dict]:
    """Rank ``rank``'s digests, once its background writer has handed them over."""
    deadline, sidecar = time.monotonic() + SHARDS_WAIT_S, _hashes_sidecar(tmp, rank)
    while not sidecar.exists():
        if _failed_marker(tmp, rank).exists():
            raise CheckpointError(f"rank {rank} could not write its shard of {tmp.name}: "
                                  f"{_failed_marker(tmp, rank).read_text()}")
        if time.monotonic() > deadline:
            raise CheckpointError(f"rank {rank} did not write its shard of {tmp.name} within {SHARDS_WAIT_S:.0f} s")
        time.sleep(0.05)
    digests = json.loads(sidecar.read_text())
    sidecar.unlink()
    return digests


class BackgroundWriter:
    """Writes checkpoints from captured state in a daemon thread, so training goes on meanwhile. At
    most one write is in flight: ``submit`` waits for the previous one (and re-raises its error).
    ``on_done(directory)`` runs in the writer thread after the atomic rename. With several ranks,
    every rank submits its part (``staging`` from ``prepare_staging``); ZeRO-3 cannot (its weights
    are gathered collectively: ``save_checkpoint`` in step instead). A failed write is kept until
    ``wait`` hands it over, as a ``CheckpointError`` naming the directory: nothing else clears it."""

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[tuple[Path, BaseException]] = None

    def submit(self, directory: str | Path, state: TrainState, *, actor: TrainEngine, critic: Optional[TrainEngine],
               tokenizer_path: Path, trainer_state: dict[str, Any],
               on_done: Optional[Callable[[Path], None]] = None, lora_base: Optional[Path] = None,
               dist: Optional[DistInfo] = None, staging: Optional[Path] = None) -> None:
        """Start writing ``directory`` from ``state``. Everything read from the engines (configs,
        LoRA adapter selection) is read before this returns; the thread touches only ``state``."""
        if state.world_size != 1 and (staging is None or dist is None):
            raise ValueError("a state of several ranks is written by every rank, into prepare_staging's directory")
        if not can_write_in_background(list(present(actor, critic)), state.world_size):
            raise ValueError("a ZeRO-3 state of several ranks gathers its weights collectively: save_checkpoint")
        self.wait()
        dist = dist if state.world_size != 1 else DistInfo(rank=0, world_size=1, local_rank=0, device="cpu")
        job = _make_job(actor, critic, dist, state, tokenizer_path, trainer_state, lora_base)
        self._thread = threading.Thread(target=self._run, args=(Path(directory), job, dist, on_done, staging),
                                        name="checkpoint-writer", daemon=True)
        self._thread.start()

    def _run(self, directory: Path, job: _Job, dist: DistInfo, on_done, staging: Optional[Path]) -> None:
        serial_background_thread()
        try:
            with background():  # its checkpoint_write span overlaps training, off the critical path
                if staging is None:
                    _write_atomically(directory, job, dist)
                else:
                    _write_staged(directory, staging, job, dist)
            if on_done is not None:
                on_done(directory)
        except BaseException as exc:  # handed to the trainer by wait()
            self._error = (directory, exc)

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def idle(self) -> None:
        """Block until the write in flight (if any) is done, leaving a failure for ``wait``."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def wait(self) -> None:
        """Block until the write in flight (if any) is done; raise its failure (once)."""
        self.idle()
        if self._error is not None:
            (directory, error), self._error = self._error, None
            raise CheckpointError(f"writing {directory} in the background failed: "
                                  f"{str(error) or type(error).__name__}") from error

    def close(self) -> None:
        self.wait()
