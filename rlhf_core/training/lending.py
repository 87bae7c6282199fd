"""What a resident trainer lends the stages while a flow run keeps it: the modules it holds, served
for their checkpoint directory (the run session's ``live``), gradients off while lent, and the kept
vLLM engine, paused for each update and synced in place to each new or restored actor.

A borrowed module must compute what its checkpoint reloaded from disk would: so a lent module has
``requires_grad`` off (ATen's matmul takes another summation path for a weight that requires grad)
and a ZeRO-3 module on several ranks is lent as a whole copy (``inference_copy``)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator, Optional

import torch

from rlhf_core.io import timing
from rlhf_core.models.live import LiveModel, LiveModels
from rlhf_core.run.layout import RunDir
from rlhf_core.training.engines import TrainEngine
from rlhf_core.training.snapshot import SNAPSHOT


class Lending:
    """The lending side of one ``training.resident.ResidentTrainer`` kept for a flow run."""

    def __init__(self, run: RunDir, live: LiveModels):
        self.run = run
        self.live = live
        """Where the held state is offered to the stages: the run session's ``LiveModels``."""
        self.rollout_sync: dict[str, float] = {}
        """The last sync of the kept rollout engine to the held actor: its seconds and log-prob gap."""
        self._lent_flags: list[tuple[torch.nn.Parameter, bool]] = []
        """``requires_grad`` of each parameter of the engines' modules while they are lent frozen."""

    def offer(self, ckpt: Path, actor: TrainEngine, critic: Optional[TrainEngine], tokenizer: Optional[Path],
              world_size: int) -> None:
        """Serve ``actor`` and ``critic`` for ``ckpt``'s actor and critic directories, and sync the
        kept rollout engine to the actor."""
        self.live.hold(ckpt / "actor", LiveModel(self._lend(actor, world_size), "causal_lm", tokenizer))
        if critic is not None:
            self.live.hold(ckpt / "critic", LiveModel(self._lend(critic, world_size), "critic", tokenizer))
        self._sync_rollout_engine(actor, ckpt / "actor")

    def withdraw(self) -> None:
        """Nothing lent any more: the trainable parameters require gradients again."""
        self.live.drop(self.run.root)
        for param, requires_grad in self._lent_flags:
            param.requires_grad_(requires_grad)
        self._lent_flags = []

    def rollout_engine_sleeps(self) -> Optional[float]:
        """A kept vLLM engine pauses for the update and, where its platform can, gives its memory to it
        (CUDA: KV cache freed, weights offloaded); returns the GiB that freed, measured (None: no
        engine kept, or nothing freed: CPU)."""
        held = self.live.held_engine()
        freed = held.engine.sleep() if held is not None else None
        return freed / 2 ** 30 if freed is not None else None

    def _lend(self, te: TrainEngine, world_size: int) -> torch.nn.Module:
        """``_servable(te)`` with gradients off until ``withdraw``, as every model a stage loads
        from disk has them: ATen's matmul takes another summation path for a weight that requires
        grad, so a borrowed module would give other bits than its checkpoint reloaded after a crash
        (a resumed run's log-probs would differ from the uninterrupted run's in the last digit)."""
        module = _servable(te, world_size)
        if module is te.module:
            self._lent_flags += [(p, p.requires_grad) for p in module.parameters()]
            module.requires_grad_(False)
        return module

    def _sync_rollout_engine(self, actor: TrainEngine, actor_dir: Path) -> None:
        """The kept vLLM engine takes the held actor's weights in place (and wakes), checked against
        the actor's own log-probs; no disk round trip. A ZeRO-3 actor is gathered for it."""
        held = self.live.held_engine()
        if held is None:
            return
        with gathered(actor):
            self.rollout_sync = held.engine.sync_from(actor.module)
        self.live.hold_engine(held.engine, actor_dir)


def _servable(te: TrainEngine, world_size: int) -> torch.nn.Module:
    """The module a stage may borrow: the engine's own, except a ZeRO-3 engine's on several ranks,
    whose parameters are partitioned (a forward would gather them with the other ranks, which are
    not running it): then a whole copy, dropped before the next update trains."""
    if te.zero_stage != 3 or world_size == 1:
        return te.module
    with timing.timed(SNAPSHOT):
        return inference_copy(te)


@contextlib.contextmanager
def gathered(te: TrainEngine) -> Iterator[None]:
    """``te``'s whole parameters for the block (ZeRO-3 keeps only partitions otherwise)."""
    if te.zero_stage != 3:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(te.module.parameters()), modifier_rank=None):
        yield


def inference_copy(te: TrainEngine) -> torch.nn.Module:
    """A plain module (same class, config and attention) holding ``te``'s whole weights, on its
    device, gradients off. Every rank must call it: ZeRO-3 gathers the partitions."""
    import deepspeed

    module = te.module
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        weights = {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}
    first = next(iter(weights.values()))
    with torch.device(first.device):
        copy = type(module)._from_config(module.config, dtype=first.dtype)
    copy.load_state_dict(weights, strict=False)  # tied weights: one tensor under both names
    return copy.eval().requires_grad_(False)
