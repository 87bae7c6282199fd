"""Models held in memory for a whole flow run, found by the checkpoint directory they stand for.

One ``LiveModels`` belongs to one run session (``scoring.held.HeldModels``): the flow creates it
and hands it to every stage call; a CLI rerun of one stage gets an empty one, so everything is read
from disk. Nothing here is process-wide.

With resident models (``trainer.resident_models``) the update keeps the actor and the critic it
trains loaded between iterations, and most iterations write no checkpoint. Every other stage still
asks for its models by directory (``iter_k/checkpoint/actor``: the lineage stays path-based, so a
CLI rerun of one stage works from the run directory alone); the loaders in ``scoring.models`` look
here first and, when the directory is the state the trainer holds right now, hand out the trainer's
own module — the weights the update just produced, with no disk round trip. When the trainer's
ranks are other processes (a worker group), a ``Provider`` answers for their state instead: the
stages' model passes run in those processes, and anything this process must load itself gets a
copy published on first ask (``on_disk``).

Only the current state is ever held: the trainer replaces its entries before it changes the weights
(an update, a rollback), so an entry never serves weights other than its directory's. Nothing here
loads, trains or writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Protocol


@dataclass(frozen=True)
class LiveModel:
    module: Any
    """The trained module itself (torch.nn.Module): borrowers switch it to eval mode and must not
    change its weights; the trainer switches it back to train mode before it updates."""
    kind: str
    """'causal_lm' (the actor) or 'critic' (the value model)."""
    tokenizer_dir: Path
    """Where the tokenizer files are that the checkpoint directory would carry."""


class Provider(Protocol):
    """Holds states in other processes and can put a copy of one on disk when this process needs it."""

    def provides(self, directory: Path) -> bool:
        """Whether ``directory``'s state is held (a cheap check: nothing is written)."""

    def publish(self, directory: Path) -> Path:
        """A model directory on disk with ``directory``'s weights (written on the first ask)."""


@dataclass
class HeldEngine:
    engine: Any
    """A rollout engine with ``sleep`` / ``wake_up`` / ``load_weights`` (rollout.vllm_engine)."""
    serves: Path
    """The actor directory whose weights the engine holds now."""


class LiveModels:
    """The states one run holds in memory: the trainer's lent modules (by checkpoint directory), a
    worker group answering for the states its processes hold (the ``Provider``), and the rollout
    engine kept for the run (vLLM: one engine, asleep while the update trains). Empty: every
    directory is read from disk."""

    def __init__(self) -> None:
        self._held: dict[Path, LiveModel] = {}
        self._provider: Optional[Provider] = None
        self._engine: Optional[HeldEngine] = None
        self._keep_engines = False

    # -- the trainer's own modules -----------------------------------------------------------

    def hold(self, directory: str | Path, model: LiveModel) -> None:
        """Serve ``model`` for ``directory`` until ``drop`` (the trainer holds that state now)."""
        self._held[Path(directory).resolve()] = model

    def drop(self, under: Optional[str | Path] = None) -> None:
        """Forget every held directory (or those inside ``under``, e.g. one run's root)."""
        if under is None:
            self._held.clear()
            return
        root = Path(under).resolve()
        for path in [p for p in self._held if p == root or root in p.parents]:
            del self._held[path]

    def lookup(self, directory: str | Path) -> Optional[LiveModel]:
        """The model held for ``directory``, or None (then load it from disk)."""
        if not self._held:
            return None
        return self._held.get(Path(directory).resolve())

    def is_live(self, module: Any) -> bool:
        """Whether ``module`` is one the trainer holds (dropping a borrower's reference frees nothing)."""
        return any(m.module is module for m in self._held.values())

    def held_directories(self) -> list[Path]:
        return sorted(self._held)

    # -- states held by other processes (a worker group of the update's ranks) ----------------

    def provide_with(self, provider: Optional[Provider]) -> None:
        """Let ``provider`` answer for directories nobody in this process holds (None: stop)."""
        self._provider = provider

    def available(self, directory: str | Path) -> bool:
        """Whether ``directory``'s state is held here or by the provider (nothing is loaded or written)."""
        path = Path(directory).resolve()
        return path in self._held or (self._provider is not None and self._provider.provides(path))

    def on_disk(self, directory: str | Path) -> Path:
        """Where to load ``directory`` from: itself, or — when only the provider holds its state —
        the copy the provider publishes for this process."""
        path = Path(directory)
        if self._provider is None or path.is_dir() or not self._provider.provides(path.resolve()):
            return path
        return self._provider.publish(path.resolve())

    # -- a rollout engine kept for the run ---------------------------------------------------

    def keep_engines(self, on: bool) -> None:
        """While on (a resident flow run), a rollout engine built for an actor is kept for the next
        rollout instead of closed; off closes the kept one."""
        self._keep_engines = on
        if not on and self._engine is not None:
            held, self._engine = self._engine, None
            held.engine.close()

    def keeping_engines(self) -> bool:
        return self._keep_engines

    def hold_engine(self, engine: Any, serves: str | Path) -> None:
        self._engine = HeldEngine(engine, Path(serves).resolve())

    def held_engine(self) -> Optional[HeldEngine]:
        return self._engine

    def engine_for(self, directory: str | Path) -> Optional[Any]:
        """The kept engine when its weights are ``directory``'s, else None."""
        if self._engine is None or self._engine.serves != Path(directory).resolve():
            return None
        return self._engine.engine
