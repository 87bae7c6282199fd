"""A state the resident trainer's engines held, copied to host memory: what a rollback puts back
(the snapshot an update starts by taking) and what a save writes (a capture of a committed state,
made on a background thread while the next rollout runs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from rlhf_core.training.engines import TrainEngine
from rlhf_core.training.train_state import TrainState, capture

SNAPSHOT = "state_snapshot"
"""io.timing kind: copying the engines' state to host memory (the rollback snapshot, a save's capture)."""

Rng = tuple[dict, dict]
"""The RNG state right after an update (``training.checkpoint.rng_state``)."""


@dataclass
class Snapshot:
    """A state the engines held, in host memory: what a rollback puts back, or what a save writes."""

    iteration: int
    """The committed iteration whose update produced it (0: the initial models)."""
    state: TrainState
    rng: Optional[Rng]
    """The RNG right after that update (None: the initial state, seeded from trainer.seed)."""
    trainer_state: Optional[dict] = None


def take_snapshot(iteration: int, engines: Sequence[TrainEngine], rng: Optional[Rng], trainer_state: Optional[dict],
                  *, pin_memory: bool, reuse: Optional[Snapshot] = None) -> Snapshot:
    """The engines' state as ``iteration``'s, copied to host memory (``reuse``: a released snapshot
    whose buffers are overwritten, so no fresh pages are faulted in)."""
    return Snapshot(iteration, capture(engines, pin_memory=pin_memory, reuse=reuse.state if reuse else None), rng,
                    trainer_state)


def with_rng(state: TrainState, rng: Optional[Rng]) -> TrainState:
    """``state`` carrying ``rng`` as the RNG a checkpoint of it saves (None: it keeps its own)."""
    if rng is not None:
        state.rng_tensors, state.rng_json = rng
    return state
