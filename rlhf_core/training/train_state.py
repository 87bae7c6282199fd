"""This rank's complete training state as host-memory copies: what an in-memory rollback restores
and what a sharded checkpoint writes.

Each rank keeps only what it owns, read through DeepSpeed's per-rank views, never gathered:

    ZeRO stage   params (RoleShard.params)                 optim (RoleShard.optim)
    0            every parameter and buffer, full           each parameter's full AdamW moments
    1, 2         every parameter and buffer, full           the fragment of each parameter's moments
                 (ZeRO-1/2 replicate the weights)           in this rank's flat fp32 partition
    3            each parameter's ds_tensor partition;      the same partition of the moments
                 ``::full`` also for the small persistent
                 parameters every rank keeps whole

Optimizer keys are ``<parameter name>::exp_avg`` / ``::exp_avg_sq`` and, when the weights train in
bf16/fp16, ``::fp32`` (the fp32 master weights). All are 1-D; ``meta["fragments"][name]`` =
[offset into the flattened parameter, numel, full numel, full shape], so shards from all ranks
reassemble into full tensors (``checkpoint_load.load_optimizer_state`` does it when the world size or
ZeRO stage changed). Under ZeRO-3 the last rank's partition carries padding past the full numel.

``capture(..., reuse=old)`` overwrites a released capture's buffers instead of allocating new host
memory (fresh pages are what a copy mostly costs: measured ~6x slower than copying into existing
buffers). ZeRO-3 state is read and written through DeepSpeed's public ``safe_get/set_local_*``
(the write lands in the optimizer's own partition, also when it is offloaded or swapped out);
ZeRO-1/2, for which DeepSpeed has no local API, through direct views of the flat fp32 partition at
the place its fragment mapping records.

In fp32 the master weights are equal to the weights after every step (DeepSpeed copies them
across), so they are not stored twice: ``restore`` rebuilds them from the restored weights. Before
the first optimizer step torch AdamW has no state; a capture taken then restores as zero moments
at step 0, which the next step treats exactly as fresh state.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from rlhf_core.training.engines import TrainEngine
from rlhf_core.training.optim_state import MOMENT_KEYS, SEP, counters, restore_counters

MASTER_KEY = "fp32"
FULL_SUFFIX = SEP + "full"


@dataclass
class RoleShard:
    """One role's state on this rank, in host memory (detached clones)."""

    params: dict[str, torch.Tensor]
    """What this rank holds of the module's parameters and persistent buffers, by state-dict name
    (ZeRO-3: the ds_tensor partitions, 1-D; tied aliases are listed in ``meta["tied"]``)."""
    optim: dict[str, torch.Tensor]
    """This rank's optimizer partition: ``<name>::exp_avg`` / ``::exp_avg_sq`` (/ ``::fp32``), 1-D."""
    meta: dict
    """``optim_state.counters`` + the layout needed to put fragments back (see the module doc)."""


@dataclass
class TrainState:
    rank: int
    world_size: int
    roles: dict[str, RoleShard]
    """"actor", "critic"."""
    rng_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    rng_json: dict = field(default_factory=dict)
    """As ``rng_state()`` returns them."""

    def nbytes(self) -> int:
        tensors = [*self.rng_tensors.values()]
        for shard in self.roles.values():
            tensors += [*shard.params.values(), *shard.optim.values()]
        return sum(t.numel() * t.element_size() for t in tensors)


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


# ---------------------------------------------------------------------------------------------
# where each rank's pieces live (views into the live engine; nothing copied)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fragment:
    """This rank's part of one trainable parameter's optimizer state."""

    name: str
    param: torch.nn.Parameter
    offset: int
    """Into the flattened full parameter."""
    numel: int
    full_numel: int
    shape: tuple[int, ...]
    read: Callable[[Optional[str]], Optional[torch.Tensor]]
    """read(key) -> this rank's 1-D fp32 part (key None: the master weights); None without state."""
    write: Callable[[Optional[str], torch.Tensor], None]
    """write(key, value): put this rank's part back (the same keys as ``read``)."""


def _zero3(p) -> bool:
    return hasattr(p, "ds_id")


def _flat_hp_partitions(te: TrainEngine) -> list[torch.Tensor]:
    # ZeRO-1/2 (DeepSpeedZeroOptimizer) and the BF16 optimizer name their fp32 partitions differently
    opt = te.engine.optimizer
    flats = getattr(opt, "single_partition_of_fp32_groups", None)
    return flats if flats is not None else opt.fp32_groups_flat_partition


def _flat_view(base: torch.optim.Optimizer, flat: torch.Tensor, start: int, n: int):
    """view(key) into a flat fp32 partition (key None) or its AdamW state (None before any step)."""
    def view(key):
        if key is None:
            return flat.narrow(0, start, n)
        state = base.state.get(flat)
        return state[key].narrow(0, start, n) if state else None

    return view


def _written_through(view: Callable[[Optional[str]], Optional[torch.Tensor]]):
    def write(key, value):
        view(key).copy_(value)

    return write


def _zero3_fragment(name: str, p) -> Fragment:
    """A ZeRO-3 partition's optimizer state (or master weights: key None), read and written where
    DeepSpeed's stage-3 optimizer keeps it (which also swaps NVMe-offloaded state in and out); its
    offset = this rank's place in the padded flat parameter.

    Not through ``deepspeed.utils.safe_get/set_local_*``: they return None (and write nothing) for a
    parameter whose ``requires_grad`` is off, which is every parameter of a module lent to the stages
    (``training.resident._lend``) — a save captured meanwhile held no optimizer state at all, and a
    resume from it failed ("has no saved exp_avg"). The method they call, past that check, is used."""
    optimizer = p._z3_optimizer

    def partition(key, release: bool) -> torch.Tensor:
        return optimizer._get_fp32_opt_state_partition(p, release_swap_buffers=release, optim_state_key=key)[0]

    def read(key):
        if key is not None and not optimizer.optimizer.state:
            return None  # before the first step
        return partition(key, True)

    def write(key, value):
        partition(key, False).data.copy_(value.flatten())

    n = p.ds_tensor.numel()
    return Fragment(name, p, _group_rank(p) * n, n, p.ds_numel, tuple(p.ds_shape), read, write)


def fragments(te: TrainEngine) -> list[Fragment]:
    """Every trainable parameter's optimizer fragment on this rank, in ``named_trainable`` order.
    ZeRO-3 reads and writes through DeepSpeed's ``safe_get/set_local_*``; ZeRO-1/2 have no local
    API (only the ``safe_get_full_*`` ones, a collective per parameter), so their fragments are views
    into the flat fp32 partition at the place DeepSpeed's own fragment mapping records."""
    base = te.base_optimizer
    out = []
    flats = None
    for name, p in te.named_trainable():
        if _zero3(p):
            out.append(_zero3_fragment(name, p))
        elif hasattr(p, "_hp_mapping"):
            m = p._hp_mapping
            if m is None:  # this rank's partition holds none of this parameter
                continue
            flats = flats if flats is not None else _flat_hp_partitions(te)
            n = m.hp_fragment_address.numel
            view = _flat_view(base, flats[m.param_group_index], m.hp_fragment_address.start, n)
            out.append(Fragment(name, p, m.lp_fragment_address.start, n, p.numel(), tuple(p.shape), view,
                                _written_through(view)))
        else:
            def view(key, p=p):
                state = base.state.get(p)
                return state[key].view(-1) if key is not None and state else None

            out.append(Fragment(name, p, 0, p.numel(), p.numel(), tuple(p.shape), view, _written_through(view)))
    return out


def _group_rank(p) -> int:
    from deepspeed import comm

    return comm.get_rank(group=getattr(p, "ds_process_group", None))


def _stores_master(te: TrainEngine) -> bool:
    return te.dtype != "fp32" and te.zero_stage > 0


def module_tensors(te: TrainEngine) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """{state-dict name: live parameter/buffer} once per tensor, and {tied alias: owner name}."""
    owners: dict[int, str] = {}
    unique, tied = {}, {}
    for key, t in te.module.state_dict(keep_vars=True).items():
        if id(t) in owners:
            tied[key] = owners[id(t)]
        else:
            owners[id(t)] = key
            unique[key] = t
    return unique, tied


def _available(p) -> bool:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return p.ds_status == ZeroParamStatus.AVAILABLE and p.data.numel() == p.ds_numel


def role_views(te: TrainEngine, world_size: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
    """(params, optim, meta) of ``RoleShard``, as live views instead of copies: what ``capture``
    clones and what a synchronous save streams to disk one tensor at a time."""
    tensors, tied = module_tensors(te)
    params: dict[str, torch.Tensor] = {}
    shapes, partitioned = {}, []
    for key, t in tensors.items():
        if _zero3(t):
            params[key] = t.ds_tensor.data.view(-1)
            partitioned.append(key)
            if world_size > 1 and _available(t):  # a persistent parameter: every rank keeps it whole
                params[key + FULL_SUFFIX] = t.data
            shapes[key] = [list(t.ds_shape), str(t.dtype)]
        else:
            params[key] = t.data
            shapes[key] = [list(t.shape), str(t.dtype)]
    optim: dict[str, torch.Tensor] = {}
    layout = {}
    has_state = len(te.base_optimizer.state) > 0
    for f in fragments(te):
        layout[f.name] = [f.offset, f.numel, f.full_numel, list(f.shape)]
        for key in MOMENT_KEYS if has_state else ():
            view = f.read(key)
            if view is not None:  # stage 0: a parameter that never had a gradient has no state
                optim[f.name + SEP + key] = view
        if _stores_master(te):
            optim[f.name + SEP + MASTER_KEY] = f.read(None)
    meta = {**counters(te), "micro_steps": int(te.engine.micro_steps), "has_state": has_state,
            "world_size": world_size, "fragments": layout, "params": shapes, "partitioned": partitioned, "tied": tied,
            "stores_master": _stores_master(te)}
    return params, optim, meta


def _fits(into: Optional[torch.Tensor], t: torch.Tensor, pin: bool) -> bool:
    return into is not None and into.shape == t.shape and into.dtype == t.dtype and (into.is_pinned() or not pin)


def _host_copy(t: torch.Tensor, pin: bool, into: Optional[torch.Tensor]) -> torch.Tensor:
    t = t.detach()
    if _fits(into, t, pin):
        return into.copy_(t)  # no fresh pages to fault in: several times faster than a new copy
    if pin:
        return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True).copy_(t)
    return t.to("cpu", copy=True)


def covers(state: TrainState, engines: Sequence[TrainEngine], *, pin_memory: bool = False) -> bool:
    """Whether ``capture(engines, reuse=state)`` would only overwrite ``state``'s buffers: every tensor
    of the engines' state (weights and optimizer fragments) has a buffer of its shape and dtype there.
    Not so for a capture made before the first update, which has no moments yet."""
    pin = pin_memory and torch.cuda.is_available()
    for te in engines:
        old = state.roles.get(te.role)
        if old is None:
            return False
        params, optim, _ = role_views(te, _world_size())
        if not all(_fits(old.params.get(k), v, pin) for k, v in params.items()) or \
                not all(_fits(old.optim.get(k), v, pin) for k, v in optim.items()):
            return False
    return True


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def capture(engines: Sequence[TrainEngine], *, pin_memory: bool = False,
            reuse: Optional[TrainState] = None) -> TrainState:
    """This rank's complete training state copied to host memory. No collective, no disk.
    ``pin_memory`` pins the copies (only where CUDA is there to use them: faster device copies).
    ``reuse``: an earlier capture no longer needed (e.g. the snapshot a passed guard released);
    its buffers are overwritten where shapes match instead of allocating new ones, and it must
    not be used afterwards."""
    import torch.distributed as tdist

    pin = pin_memory and torch.cuda.is_available()
    world = tdist.get_world_size() if tdist.is_initialized() else 1
    rank = tdist.get_rank() if tdist.is_initialized() else 0
    roles = {}
    for te in engines:
        params, optim, meta = role_views(te, world)
        old = reuse.roles.get(te.role) if reuse is not None else None
        roles[te.role] = RoleShard(
            params={k: _host_copy(v, pin, old.params.get(k) if old else None) for k, v in params.items()},
            optim={k: _host_copy(v, pin, old.optim.get(k) if old else None) for k, v in optim.items()}, meta=meta)
    rng_tensors, rng_json = rng_state()
    return TrainState(rank=rank, world_size=world, roles=roles,
                      rng_tensors={k: v.clone() for k, v in rng_tensors.items()}, rng_json=rng_json)


# ---------------------------------------------------------------------------------------------
# putting it back
# ---------------------------------------------------------------------------------------------


def _check_layout(te: TrainEngine, shard: RoleShard, world_size: int) -> None:
    m = shard.meta
    if (m["zero_stage"], m["dtype"], m["world_size"]) != (te.zero_stage, te.dtype, world_size):
        raise ValueError(f"{te.role}: state captured at ZeRO-{m['zero_stage']} {m['dtype']} on {m['world_size']} "
                         f"rank(s), engine is ZeRO-{te.zero_stage} {te.dtype} on {world_size}")


@torch.no_grad()
def restore_params(te: TrainEngine, params: dict[str, torch.Tensor]) -> None:
    """Copy captured weights (and ZeRO-3 partitions) back into the live module, in place."""
    tensors, _ = module_tensors(te)
    for key, t in tensors.items():
        if _zero3(t):
            t.ds_tensor.data.view(-1).copy_(params[key])
            if _available(t):  # persistent: also the whole copy the forward reads
                full = params.get(key + FULL_SUFFIX)
                t.data.copy_(full if full is not None else params[key][:t.ds_numel].view_as(t.data))
        else:
            t.data.copy_(params[key])


@torch.no_grad()
def restore_optim(te: TrainEngine, optim: dict[str, torch.Tensor], meta: dict) -> None:
    """Write this rank's optimizer fragments back (the engine's layout must match ``meta``): moments
    (zeros at step 0 when there was no state yet), the fp32 master weights (from ``optim`` in
    bf16/fp16, else from the already restored weights), Adam step, lr position, engine counters."""
    frags = fragments(te)
    here = {f.name: [f.offset, f.numel, f.full_numel, list(f.shape)] for f in frags}
    saved = {k: [int(a) for a in v[:3]] + [list(v[3])] for k, v in meta["fragments"].items()}
    if here != saved:
        differ = sorted(k for k in set(here) | set(saved) if here.get(k) != saved.get(k))
        raise ValueError(f"{te.role}: this rank's optimizer partition differs from the saved one for "
                         f"{len(differ)} parameter(s), e.g. {differ[:3]} (here {[here.get(k) for k in differ[:1]]}, "
                         f"saved {[saved.get(k) for k in differ[:1]]})")
    base = te.base_optimizer
    if meta["has_state"] and not base.state:
        raise ValueError(f"{te.role}: the optimizer has no state tensors yet (prime_optimizer first)")
    if not meta["has_state"]:
        for state in base.state.values():  # no state at capture: fresh AdamW == zero moments at step 0
            for v in state.values():
                if torch.is_tensor(v):
                    v.zero_()
    for f in frags:
        for key in MOMENT_KEYS if meta["has_state"] else ():
            saved, live = optim.get(f.name + SEP + key), f.read(key)
            if (saved is None) != (live is None):
                raise ValueError(f"{te.role}: {f.name} has {'no' if saved is None else ''} saved {key} "
                                 f"but {'no' if live is None else ''} live one")
            if live is not None:
                f.write(key, saved)
        if f.read(None) is None:
            continue  # stage 0 fp32: the parameter is its own master
        saved = optim.get(f.name + SEP + MASTER_KEY)
        if saved is None:
            saved = (f.param.ds_tensor.data.view(-1) if _zero3(f.param)
                     else f.param.data.view(-1).narrow(0, f.offset, f.numel))
        f.write(None, saved)
    if meta["has_state"]:
        for state in base.state.values():
            state["step"].fill_(float(meta["adam_step"]))
    restore_counters(te, meta)


def restore(engines: Sequence[TrainEngine], state: TrainState) -> None:
    """Put engines + process RNG back exactly as captured (bit for bit: weights, fp32 master,
    moments, Adam step, lr schedule position, engine counters). No collective. Call it between
    optimizer steps (no gradients accumulated), as ``capture`` was."""
    for te in engines:
        shard = state.roles[te.role]
        _check_layout(te, shard, state.world_size)
        restore_params(te, shard.params)
        restore_optim(te, shard.optim, shard.meta)
    restore_rng(state.rng_tensors, state.rng_json)


def shard_weights(params: dict[str, torch.Tensor], meta: dict) -> dict[str, torch.Tensor]:
    """The HF state dict held whole in ``params`` (ZeRO 0-2 at any world size; ZeRO-3 at world
    size 1, its partitions reshaped to the full shape), tied aliases sharing their owner's tensor."""
    out = {}
    for key, (shape, _) in meta["params"].items():
        t = params[key]
        if key in meta["partitioned"]:
            t = t[:int(np.prod(shape, dtype=np.int64))]
        out[key] = t.view(shape)
    for alias, owner in meta["tied"].items():
        out[alias] = out[owner]
    return out


def full_weights(state: TrainState, te: TrainEngine) -> Optional[dict[str, torch.Tensor]]:
    """The role's full HF state dict from a capture, tied weights shared: ZeRO 0-2 (every rank holds
    the weights whole) or a world-size-1 ZeRO-3 capture (the partitions reshaped). None for ZeRO-3
    at world > 1: there the partitions must be gathered (``checkpoint.full_state_dict`` for live
    engines; ``checkpoint.save_checkpoint`` gathers a capture's)."""
    shard = state.roles[te.role]
    if shard.meta["partitioned"] and state.world_size != 1:
        return None
    return shard_weights(shard.params, shard.meta)
