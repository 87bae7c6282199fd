"""What of a run's committed lineage no longer matches the hashes recorded when it was written.

Each stage records the sha256 of every output in its manifest record (``run.manifest``) and each
checkpoint carries a sha256 manifest of its files (``io.checksums``). ``find_damage`` compares both
with the disk for the setup stages' outputs (the prompts, the packing, the initial critic, the
initial policy the warm start made) and for every committed iteration — its tables, the KL
controller state gae handed on, the state record of its update, the guard's verdict, its
validation — and for the checkpoints a
resume would load: last-good's, else the newest kept one before it (where a replay of the commits
after it starts). It reads and hashes and never writes, so `rlhf status`, a resume and `rlhf
export` ask it the same question and agree on what is damaged.

What is done about each damage is ``stages.repair``'s: the stage that wrote it runs again (a
checkpoint: its update is replayed), and the result is kept only when it reproduces the recorded
hash; otherwise the run falls back to the commit before it. ``Damage.remedy`` says which a resume
will try, for `rlhf status`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rlhf_core.errors import CheckpointError, first_clause
from rlhf_core.io.checksums import verify_checkpoint
from rlhf_core.run.layout import RunDir, StateFileError
from rlhf_core.run.lifecycle import committed_iterations, is_replayable
from rlhf_core.run.manifest import STATE_DIGEST, path_digest, read_manifest, record_key
from rlhf_core.run.stage_order import ITERATION_STAGES, REPORT_ORDER, SETUP_STAGES


@dataclass(frozen=True)
class Damage:
    """One artifact of committed iteration ``iteration`` that does not verify."""

    iteration: int
    stage: Optional[str]
    """The stage that wrote it (None: the iteration's record itself, so nothing can be checked)."""
    path: Path
    why: str
    """What is wrong, as one clause ("is missing", "changed since score wrote it", ...)."""
    checkpoint: bool = False
    """A checkpoint directory (rebuilt by replaying its update) rather than a stage output."""
    setup: bool = False
    """An output of a setup stage (``manifest.json``): nothing can be fallen back to before it."""

    def describe(self, run: RunDir) -> str:
        return f"{_rel(run, self.path)} {self.why}"

    def remedy(self, run: RunDir, last_good: int) -> str:
        """What a resume does about it (the words `rlhf status` shows)."""
        if self.setup:
            return (f"a resume reruns {self.stage} to rebuild it, and stops (nothing trains on it) if that does "
                    "not reproduce it")
        if self.stage is None:
            return (f"a resume falls back to the commit before iteration {self.iteration} (iterations "
                    f"{self.iteration}..{last_good} are rerun)")
        if self.checkpoint:
            if self.iteration == last_good:
                return f"a resume rebuilds it by replaying iteration {self.iteration}'s update"
            return f"a resume removes it (iteration {self.iteration}'s state is rebuilt by replay when needed)"
        return (f"a resume reruns {self.stage} of iteration {self.iteration} to rebuild it, and falls back to the "
                "commit before it if that does not reproduce it")


def _rel(run: RunDir, path: Path) -> str:
    return str(path.relative_to(run.root)) if path.is_relative_to(run.root) else str(path)


def find_damage(run: RunDir) -> list[Damage]:
    """Every committed artifact that does not verify, in lineage order: the setup stages' outputs
    first (iteration 0: prompts, packing, the initial critic, the initial policy), then by iteration
    (within one, the stages in order, then its checkpoint). A damaged commit log raises
    ``StateFileError``."""
    committed = committed_iterations(run)
    found = [d for k in committed for d in output_damage(run, k)] + checkpoint_damage(run, committed)
    return setup_damage(run) + sorted(found, key=lambda d: (d.iteration, d.checkpoint))


def setup_damage(run: RunDir) -> list[Damage]:
    """The setup stages' outputs (``manifest.json``) that are missing or changed since written — what
    every iteration, and every replay from the initial models, reads. Reported as iteration 0's."""
    try:
        manifest = read_manifest(run, None)
    except StateFileError:
        return []  # `rlhf status` names it; the setup stages rebuild their records when rerun
    found = []
    for stage in SETUP_STAGES:
        record = manifest.get(stage) or {}
        if record.get("status") == "done":
            found += [Damage(0, stage, path, why, setup=True) for path, why in _changed_outputs(run, stage, record)]
    return found


def _changed_outputs(run: RunDir, stage: str, record: dict) -> list[tuple[Path, str]]:
    """(path, what is wrong) for each output of ``record`` whose digest is not the recorded one."""
    found = []
    for rel, digest in (record.get("outputs") or {}).items():
        if str(digest).startswith(STATE_DIGEST):
            continue
        path = Path(rel) if Path(rel).is_absolute() else run.root / rel
        now = path_digest(run, path)
        if now != digest:
            found.append((path, "is missing" if now is None else
                          f"changed since {stage} wrote it (sha256 {now[:12]}…, recorded {str(digest)[:12]}…)"))
    return found


def output_damage(run: RunDir, k: int) -> list[Damage]:
    """The outputs of committed iteration ``k``'s stages that are missing or changed since written
    (a checkpoint is named by its lineage id, not its bytes: ``checkpoint_damage`` checks those)."""
    where = run.manifest_path(k)
    try:
        manifest = read_manifest(run, k)
    except StateFileError as exc:
        return [Damage(k, None, where, str(exc).removeprefix(f"{where} "))]
    if not manifest:
        return [Damage(k, None, where, "is missing: nothing records what iteration "
                                       f"{k}'s stages wrote")]
    found = []
    for stage in REPORT_ORDER:
        record = manifest.get(stage)
        if record is None:
            if stage in ITERATION_STAGES:
                found.append(Damage(k, None, where, f"has no record of the {stage} stage"))
            continue
        if record.get("status") != "done":
            continue  # stale or rerun with overrides: `stages.base.out_of_date` refuses those
        found += [Damage(k, stage, path, why) for path, why in _changed_outputs(run, stage, record)]
    return found


def checkpoint_damage(run: RunDir, committed: list[int]) -> list[Damage]:
    """The checkpoints a resume would load that do not verify against their own sha256 manifest:
    last-good's, and while that is damaged or only in its record, each older kept one down to the
    first that verifies (the replay base); on the way, a commit with neither a checkpoint nor a
    record to replay it from. Older ones are checked when a stage loads them."""
    found = []
    for k in reversed(committed):
        ckpt = run.checkpoint(k)
        if not ckpt.exists():
            # between save points, or pruned, a state lives on in its record (a recorded one that is
            # missing or changed is output_damage's: rebuilt by rerunning the update)
            if not is_replayable(run, k) and not _records(run, k, "update", run.state_record(k)):
                found.append(Damage(k, "update", ckpt, "is missing, and so is the record to replay its update from",
                                    checkpoint=True))
            continue
        try:
            verify_checkpoint(ckpt)
        except CheckpointError as exc:
            found.append(Damage(k, "update", ckpt, f"is damaged ({first_clause(exc)})", checkpoint=True))
            continue
        foreign = not_its_own(run, k)
        if foreign:
            found.append(Damage(k, "update", ckpt, foreign, checkpoint=True))
            continue
        break
    return found


def not_its_own(run: RunDir, k: int) -> Optional[str]:
    """Why iteration ``k``'s checkpoint, whole by its own manifest, is not the state this run's
    record names (a symbolic link, or one swapped in from another run or iteration: its
    trainer_state.json names another lineage id than ``iter_k/state.json``), else None. A
    checkpoint written before the id was saved in it is taken as it is."""
    ckpt = run.checkpoint(k)
    if ckpt.is_symlink():
        return f"is a symbolic link (to {os.readlink(ckpt)}), not a checkpoint this run wrote"
    try:
        saved = (run.read_json(ckpt / "trainer_state.json") or {}).get("state_id")
        recorded = (run.read_json(run.state_record(k)) or {}).get("id")
    except StateFileError:
        return None  # a damaged record is output_damage's
    if saved is None or recorded is None or saved == recorded:
        return None
    return (f"is not this run's own: it holds state {saved[:12]}, while {_rel(run, run.state_record(k))} names "
            f"{recorded[:12]} (copied in from another run or iteration)")


def _records(run: RunDir, k: int, stage: str, path: Path) -> bool:
    """Whether ``stage``'s record of iteration ``k`` lists ``path`` among its outputs."""
    try:
        record = read_manifest(run, k).get(stage) or {}
    except StateFileError:
        return False
    return record_key(run, path) in (record.get("outputs") or {})


def damaged_checkpoints(run: RunDir) -> set[int]:
    """Iterations whose checkpoint directory is damaged (for the status table)."""
    try:
        return {d.iteration for d in checkpoint_damage(run, committed_iterations(run))}
    except StateFileError:
        return set()
