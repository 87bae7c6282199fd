"""Repair: a run's damaged artifacts rebuilt by the stage that produced them, or a fall back.

``run.integrity`` finds what of the committed lineage no longer matches the hash recorded when it
was written. Each is rebuilt the one way every state of a run is built — by running its producer
on its recorded inputs, with the config its iteration ran with (its state record's):

    a table, the KL state, a verdict, a state record   that stage of that iteration, rerun
    a checkpoint                                        removed; when last-good, its update replayed
                                                        and written again (``training.resident``)

and it is kept only when every output reproduces the recorded hash (the stage's record is then
left as it was: it still describes what is on disk). What cannot be rebuilt so — its record is
gone, or the rerun writes other bytes (another machine, a changed config) — ends the lineage
there: the run falls back to the commit before it (``lifecycle.fall_back``) and the iterations
after are rerun. So "replay after a crash", "repair after damage" and "resume" are one mechanism:
a missing or damaged artifact and one that was only ever in memory are both rebuilt by their
producer, checked against what was recorded.

Each action is one line on standard error and an event (``repaired`` or ``fallback``). A resume
(``control.opening.open_run``) and `rlhf export` run this under the run lock; `rlhf status` shows what
``integrity.find_damage`` finds and ``Damage.remedy``, what this will do.
"""

from __future__ import annotations

import sys
from typing import Optional

from rlhf_core.config import RLHFConfig
from rlhf_core.errors import RLHFError, first_clause
from rlhf_core.run.integrity import Damage, find_damage, output_damage
from rlhf_core.run.layout import RunDir
from rlhf_core.run.lifecycle import (committed_iterations, discard_checkpoint, fall_back, is_replayable,
                                    last_good_iteration)
from rlhf_core.run.manifest import read_manifest, write_manifest
from rlhf_core.run.session import RunSession
from rlhf_core.stages.base import changed_outputs
from rlhf_core.stages.catalog import stage_functions
from rlhf_core.training.lineage import read_state_record, recorded_config
from rlhf_core.training.resident import ReplayMismatch
from rlhf_core.training.run_trainer import ensure_state
from rlhf_core.training.run_dtype import keep_recorded_dtype


class Unrepairable(RLHFError):
    """A damaged artifact its producer cannot rebuild to the recorded bytes."""


def repair_run(run: RunDir, cfg: RLHFConfig, *, may_fall_back: bool = True) -> list[str]:
    """Rebuild every damaged artifact of the committed lineage (earliest first: a later one may be
    rebuilt from it), falling back where one cannot be (``may_fall_back=False``: raise instead,
    naming it: an export must not move last-good). ``cfg``: the run's saved config, for an iteration
    whose state record is lost. Returns one line per action."""
    lines: list[str] = []
    tried: set[tuple] = set()
    while True:
        found = find_damage(run)
        if not found:
            return lines
        damage = found[0]
        key = (damage.iteration, damage.stage, damage.path, damage.checkpoint)
        try:
            if key in tried:
                raise Unrepairable("it is still damaged after being rebuilt")
            tried.add(key)
            line = _repair(run, cfg, damage)
        except RLHFError as exc:  # Unrepairable, or a replay that did not reproduce its record
            reason = f"{damage.describe(run)}, and it cannot be rebuilt ({first_clause(exc)})"
            if damage.setup:  # every iteration stands on it: there is no commit to fall back to
                raise Unrepairable(f"{reason}; restore it from a copy of the run, or start a new run") from None
            if not may_fall_back:
                raise Unrepairable(f"{reason}; `rlhf run --resume {run.root}` falls back to the commit before "
                                   f"iteration {damage.iteration} and reruns from there") from None
            good = max([k for k in committed_iterations(run) if k < damage.iteration], default=0)
            lines.append(fall_back(run, good, reason))
            continue
        run.append_event("repaired", damage.iteration, path=str(damage.path), message=line)
        print(f"rlhf: warning: {line}", file=sys.stderr)
        lines.append(line)


def _repair(run: RunDir, cfg: RLHFConfig, damage: Damage) -> str:
    if damage.stage is None:
        raise Unrepairable("nothing records what it held")
    if damage.checkpoint:
        return _rebuild_checkpoint(run, damage)
    return _rerun(run, iteration_config(run, damage.iteration, cfg), damage)


def iteration_config(run: RunDir, k: int, saved: RLHFConfig) -> RLHFConfig:
    """The config iteration ``k`` ran with: its state record's when that verifies (a retry's
    changes included), else the run's saved one."""
    state = run.state_record(k)
    if any(d.path == state for d in output_damage(run, k)) or not state.is_file():
        return saved
    return recorded_config(read_state_record(run, k))


def _rerun(run: RunDir, cfg: RLHFConfig, damage: Damage) -> str:
    """Rerun the stage that wrote ``damage``; keep it when every output it recorded is reproduced."""
    k, stage = (None if damage.setup else damage.iteration), damage.stage
    which = stage if k is None else f"{stage} of iteration {k}"
    before = read_manifest(run, k)[stage]
    try:
        stage_functions(stage).run(cfg, run, k, force=True)
    except RLHFError as exc:
        raise Unrepairable(f"rerunning {which} failed: {first_clause(exc)}") from None
    manifest = read_manifest(run, k)
    after = manifest[stage]
    changed = changed_outputs(run, stage, before.get("outputs") or {}, after.get("outputs") or {},
                              after.get("outputs_paths") or {})
    if changed:
        raise Unrepairable(f"rerunning {which} wrote a different {changed[0]}")
    # the record still describes the files: keep it (a report output's new digest aside)
    manifest[stage] = {**before, "outputs": {**(before.get("outputs") or {}), **(after.get("outputs") or {})},
                       "repaired_at": after.get("finished_at")}
    write_manifest(run, k, manifest)
    return f"{damage.describe(run)}: rebuilt by rerunning {which} (the same bytes as recorded)"


def _rebuild_checkpoint(run: RunDir, damage: Damage) -> str:
    """A damaged checkpoint goes; its state lives on in its record, and last-good's is replayed
    from there and written again (``run_trainer.ensure_state``, which rebuilds with the config in
    iteration k's record, not the run's)."""
    k = damage.iteration
    discard_checkpoint(run, k, damaged=True)
    if not is_replayable(run, k):
        raise Unrepairable(f"iteration {k}'s state record or advantages table is not there to replay its update")
    if k != last_good_iteration(run):
        return f"{damage.describe(run)}: removed (iteration {k}'s state is rebuilt by replay when a stage needs it)"
    ensure_state(RunSession(), run, k)
    return f"{damage.describe(run)}: rebuilt by replaying iteration {k}'s update from its record"


def prepare_export(run: RunDir, cfg: RLHFConfig) -> list[str]:
    """Before an export reads last-good: what is damaged rebuilt (never fallen back from: that would
    move last-good under the export; ``Unrepairable`` says so instead), and last-good's checkpoint
    written when its state is only in its record (a crash between save points); a replay in the dtype
    the run trained in (``keep_recorded_dtype``). Returns the lines."""
    keep_recorded_dtype(cfg, run)
    lines = repair_run(run, cfg, may_fall_back=False)
    written = make_last_good_durable(run)
    return lines + ([written] if written else [])


def rebuild_last_good(run: RunDir) -> list[str]:
    """Before a resume continues: last-good's state written as a checkpoint when it was only in its
    record (a crash between save points), so the run never continues from a state it cannot
    rebuild. A replay that does not reproduce its record (``ReplayMismatch``: another machine or
    library) never strands the run: it falls back to the commit before the iteration that did not
    replay (the ones before it did, and are rebuilt again) and reruns from there. Returns one line
    per action."""
    lines: list[str] = []
    while True:
        try:
            written = make_last_good_durable(run)
            return lines + ([written] if written else [])
        except ReplayMismatch as exc:
            good = max([k for k in committed_iterations(run) if k < exc.iteration], default=0)
            lines.append(fall_back(run, good, first_clause(exc)))


def make_last_good_durable(run: RunDir) -> Optional[str]:
    """Write last-good's checkpoint when its state is only in its record (a crash between save
    points): what a flow run does at its end, for one that had nothing left to train. Returns the
    line saying so, or None."""
    k = last_good_iteration(run)
    if not ensure_state(RunSession(), run, k):
        return None
    return f"iteration {k}'s state was only in its record: its checkpoint is written again by replaying its update"
