"""What an iteration reports, decided in one place: its metrics (every stage's, both names of each
verl/ours pair, verl's timing_s/*, totals), which stage reports which name, the alerts, and the
console row. The Prefect layer publishes these (MLflow batch, artifacts); it decides nothing."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import pyarrow.compute as pc
import pyarrow.parquet as pq

from rlhf_core.config import resolve
from rlhf_core.config.schema import DataConfig, TrainerConfig
from rlhf_core.io.atomic import atomic_write_json
from rlhf_core.run.layout import RunDir
from rlhf_core.run.lifecycle import committed_iterations
from rlhf_core.run.manifest import read_manifest
from rlhf_core.run.stage_order import ITERATION_STAGES, REPORT_ORDER, SETUP_STAGES


ALIASES = {
    "guard/kl_mean": "kl/mean",  # the guarded KL(actor‖ref) after the update
    "critic/score/mean": "reward/mean",  # verl's name ↔ ours: the mean sequence score (reward before KL)
}
"""Pairs of names for one quantity: each side is filled in from the other when a stage reports
only one (verl's names for verl's dashboards, ours for the CLI table and the learning curve)."""

TIMING = {
    "timing_s/gen": ("perf/stage_seconds/rollout",),
    "timing_s/reward": ("perf/score_seconds/reward",),
    "timing_s/old_log_prob": ("perf/score_seconds/old_log_prob", "perf/stage_seconds/score"),
    "timing_s/ref": ("perf/score_seconds/ref",),
    "timing_s/values": ("perf/score_seconds/values",),
    "timing_s/adv": ("perf/stage_seconds/gae",),
    "timing_s/update_critic": ("perf/critic_update_seconds",),
    "timing_s/update_actor": ("perf/actor_update_seconds", "perf/stage_seconds/update"),
    "timing_s/save_checkpoint": ("perf/checkpoint_seconds",),
    "timing_s/testing": ("perf/stage_seconds/validate",),
    "timing_s/step": ("perf/iteration_seconds",),
}
"""verl's step timers from our stage timings: the first name present wins. The score stage reports
each model pass's seconds (perf/score_seconds/*: a pass it skipped — the actor's when the old log-probs
are the rollout's, the reference's when its weights are the actor's — has no timer, as in verl); a
record from before it did carries the whole stage as timing_s/old_log_prob. The update reports each
role's training-loop seconds (with the critic and the actor trained at the same time they overlap);
an older record, the whole update stage. timing_s/gen includes the rollout's model load;
timing_s/step is every stage of the iteration (the KL guard included)."""


def with_aliases(metrics: dict[str, float]) -> dict[str, float]:
    """``metrics`` plus the other name of every ALIASES pair one side of which is present."""
    out = dict(metrics)
    for a, b in ALIASES.items():
        if a in out:
            out.setdefault(b, out[a])
        elif b in out:
            out[a] = out[b]
    return out


def timing_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """verl's timing_s/* names from an iteration's metrics (``TIMING``)."""
    out = {}
    per_pass = any(name.startswith("perf/score_seconds/") for name in metrics)
    for name, sources in TIMING.items():
        if per_pass:  # the stage's whole time stands in for a pass only in a record without pass timers
            sources = tuple(s for s in sources if s != "perf/stage_seconds/score")
        found = next((metrics[s] for s in sources if s in metrics), None)
        if found is not None:
            out[name] = float(found)
    return out


def throughput_metrics(metrics: dict[str, float], tokens: int) -> dict[str, float]:
    """verl's perf/total_num_tokens (prompt + response tokens of the step's batch), perf/time_per_step
    (timing_s/step) and perf/throughput (tokens / (step seconds x devices): per GPU, and per update
    process on a CPU — perf/world_size, reported by the update)."""
    step = metrics.get("timing_s/step", 0.0)
    if not tokens or step <= 0:
        return {}
    devices = max(1.0, metrics.get("perf/world_size", 1.0))
    return {"perf/total_num_tokens": float(tokens), "perf/time_per_step": step,
            "perf/throughput": tokens / (step * devices)}


FLOORED_STAGES = ("rollout", "score", "update", "guard")
"""The stages that report their model FLOPs and floor (``training.flops``; gae runs no model)."""


def floor_ratios(metrics: dict[str, float]) -> dict[str, float]:
    """perf/stage_over_floor/<stage>: a stage's seconds over its floor (its model FLOPs at this device's
    matmul rate), for each stage that reported both: 1 would be every FLOP at that rate."""
    out = {}
    for stage in FLOORED_STAGES:
        seconds, floor = metrics.get(f"perf/stage_seconds/{stage}"), metrics.get(f"perf/stage_floor_seconds/{stage}")
        if seconds is not None and floor:
            out[f"perf/stage_over_floor/{stage}"] = seconds / floor
    return out


def steps_per_epoch(data: DataConfig, run: RunDir) -> int:
    """Iterations per pass over the training prompts as this run orders them: the pack stage's slot
    count (verl's train prompts // data.train_batch_size when the pack stage has not run)."""
    slots = (read_manifest(run, None).get("pack", {}).get("rows") or {}).get("slots")
    if slots:
        return int(slots)
    return max(1, resolve.steps_per_epoch(data.train_batch_size, run.train_prompt_count())) if run.train_prompts.is_file() else 1


def iteration_metrics(data: DataConfig, run: RunDir, k: int) -> dict[str, float]:
    """``collect_metrics`` of iteration ``k``, written to iter_k/iteration_metrics.json and returned."""
    out = collect_metrics(data, run, k)
    save_iteration_metrics(run, k, out)
    return out


def save_iteration_metrics(run: RunDir, k: int, metrics: dict[str, float]) -> None:
    atomic_write_json(run.iteration_metrics(k), metrics)


def collect_metrics(data: DataConfig, run: RunDir, k: int) -> dict[str, float]:
    """Every stage metric of iteration ``k`` (manifest records, both names of each ALIASES pair),
    plus perf/stage_seconds/<stage>, perf/iteration_seconds, perf/iteration_tokens_per_s, verl's
    timing_s/* (``TIMING``), training/global_step and training/epoch (0-based, as verl counts; the
    epoch's length from ``data``: ``steps_per_epoch``)."""
    manifest = read_manifest(run, k)
    out: dict[str, float] = {}
    seconds = 0.0
    for stage, rec in manifest.items():
        if rec.get("status") not in ("done", "stale"):
            continue
        for name, value in (rec.get("metrics") or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                out[name] = float(value)
        if rec.get("seconds") is not None:
            out[f"perf/stage_seconds/{stage}"] = float(rec["seconds"])
            seconds += float(rec["seconds"]) if stage in ITERATION_STAGES or stage == "validate" else 0.0
    out = with_aliases(out)
    out["perf/iteration_seconds"] = seconds
    tokens = iteration_tokens(run, k)
    if tokens and seconds > 0:
        out["perf/iteration_tokens_per_s"] = tokens / seconds
    out.update(timing_metrics(out))
    out.update(throughput_metrics(out, tokens))
    out.update(floor_ratios(out))
    out["training/global_step"] = float(k)
    out["training/epoch"] = float((k - 1) // steps_per_epoch(data, run)) if k >= 1 else 0.0
    out["iteration"] = float(k)
    return out


REPORTED = ("done", "stale")
"""Records whose metrics an iteration reports (a rolled-back attempt's are reported by the breach)."""


def stage_reports(manifest: dict, statuses: Sequence[str] = REPORTED,
                  order: Sequence[str] = REPORT_ORDER) -> dict[str, dict[str, float]]:
    """What each stage of a scope reports to MLflow, in run order: its metrics minus the names
    an earlier stage already reported (one point per metric and step; e.g. response_length/mean
    from rollout, not again from score), plus perf/stage_seconds/<stage>. Only records whose status
    is in ``statuses`` count, as reporters and as earlier stages."""
    taken: set[str] = set()
    out: dict[str, dict[str, float]] = {}
    for stage in order:
        rec = manifest.get(stage)
        if not rec or rec.get("status") not in statuses:
            continue
        metrics = rec.get("metrics") or {}
        mine = {name: value for name, value in metrics.items() if name not in taken}
        taken |= set(metrics)
        if rec.get("seconds") is not None:
            mine[f"perf/stage_seconds/{stage}"] = float(rec["seconds"])
        out[stage] = mine
    return out


def iteration_tokens(run: RunDir, k: int) -> int:
    """Prompt + response tokens of iteration ``k``'s rollout (0 when absent)."""
    if not run.rollout(k).is_file():
        return 0
    table = pq.read_table(run.rollout(k), columns=["prompt_token_ids", "response_length"])
    prompt = pc.sum(pc.list_value_length(table.column("prompt_token_ids"))).as_py() or 0
    response = pc.sum(table.column("response_length")).as_py() or 0
    return int(prompt + response)


@dataclass(frozen=True)
class IterationNumbers:
    """Everything iteration k reports, decided once by ``iteration_numbers``; a caller picks the
    part it publishes and decides nothing."""

    metrics: dict[str, float]
    """All of it (iter_k/iteration_metrics.json): the CLI table, the learning curve, the export gate."""
    stages: dict[str, dict[str, float]]
    """What each committed (done / stale) stage reports (``stage_reports``)."""
    derived: dict[str, float]
    """Names no stage reports: the other name of each alias pair, totals, verl's timing_s/*, steps."""
    rolled_back: dict[int, dict[str, float]]
    """Per rollback attempt, what its rolled-back stages reported (logged with the breach)."""

    @property
    def batch(self) -> dict[str, float]:
        """The iteration's MLflow batch at step k: every committed stage's names plus the derived ones."""
        out: dict[str, float] = {}
        for reported in self.stages.values():
            out.update(reported)
        return {**out, **self.derived}


def iteration_numbers(data: DataConfig, run: RunDir, k: int) -> IterationNumbers:
    """What iteration ``k`` reports, from its manifest alone (writes nothing)."""
    manifest = read_manifest(run, k)
    metrics = collect_metrics(data, run, k)
    by_stage = [set(rec.get("metrics") or {}) | {f"perf/stage_seconds/{name}"} for name, rec in manifest.items()]
    logged = set().union(*by_stage) if by_stage else set()
    rolled_back: dict[int, dict[str, float]] = {}
    for stage, reported in stage_reports(manifest, statuses=REPORTED + ("rolled_back",)).items():
        rec = manifest[stage]
        if rec.get("status") == "rolled_back":
            rolled_back.setdefault(int(rec.get("rollback_attempt") or 0), {}).update(reported)
    return IterationNumbers(metrics=metrics, stages=stage_reports(manifest),
                            derived={name: v for name, v in metrics.items() if name not in logged},
                            rolled_back=rolled_back)


def stage_numbers(run: RunDir, iteration: Optional[int], stage: str) -> dict[str, float]:
    """What one stage reports on its own (a single-stage rerun), by the same rule as the iteration's."""
    order = REPORT_ORDER if iteration is not None else SETUP_STAGES
    return stage_reports(read_manifest(run, iteration), order=order).get(stage, {})


ROW_COLUMNS = (("iter", "iteration", "{:>4.0f}"), ("reward", "reward/mean", "{:>7.3f}"),
               ("acc", "val/accuracy", "{:>6.3f}"), ("kl", "kl/mean", "{:>8.4f}"),
               ("entropy", "actor/entropy", "{:>8.3f}"), ("grad_norm", "actor/grad_norm", "{:>9.3f}"),
               ("seconds", "perf/iteration_seconds", "{:>7.1f}"))
"""The console's row per iteration. The policy's entropy, not its clip fraction: with one epoch of a
few mini-batches (the demo: two) the policy moves ~1e-4 in log-probability before its later steps,
far inside the clip range, so actor/pg_clipfrac reads 0.000 on every row (it stays in MLflow,
`rlhf query` and the alerts)."""


def format_iteration_header() -> str:
    widths = [len(fmt.format(0.0)) for _, _, fmt in ROW_COLUMNS]
    return " ".join(title.rjust(w) for (title, _, _), w in zip(ROW_COLUMNS, widths))


def format_iteration_row(metrics: dict[str, float], note: str = "") -> str:
    """One line of the CLI's per-iteration table ('-' where a metric is absent)."""
    cells = []
    for _, key, fmt in ROW_COLUMNS:
        value = metrics.get(key)
        width = len(fmt.format(0.0))
        cells.append(fmt.format(value) if isinstance(value, (int, float)) else "-".rjust(width))
    return " ".join(cells) + (f"  {note}" if note else "")


CLIPFRAC_LOW, CLIPFRAC_REARM = 0.1, 0.15
"""The clip-fraction alert: fires when actor/pg_clipfrac falls below CLIPFRAC_LOW after it had been
at or above CLIPFRAC_REARM (since the run began, or since the last such alert). Hysteresis, not a
level: a clip fraction that stays low — the usual case for LLM PPO, and structurally 0 with one
optimizer step per batch — is no news, and one that wobbles around 0.1 alerts once, not each time."""


@dataclass(frozen=True)
class Alert:
    """One alert: ``kind`` names what happened (the Prefect event is ``rlhf.alert.<kind>``; see
    ALERT_KINDS), ``message`` says it to a person."""

    kind: str
    message: str


OLD_LOG_PROB_GAP = 1e-3
"""The largest |log pi - old log-prob| at the update's start (actor/old_log_prob_diff_max) that old log-probs
taken from the rollout may show: the hf engine in fp32 measured ~2e-6 at most, bf16 decoding ~1.6e-2."""

ALERT_KINDS = {"kl-breach": "warning", "val-drop": "warning", "clipfrac-fell": "info", "old-log-prob-gap": "warning"}
"""Each kind ``iteration_alerts`` raises, and how loud it is: a warning reaches a person (a Prefect
event the alerting automation notifies on), information only goes to the log and the report."""


def iteration_alerts(trainer: TrainerConfig, metrics: dict[str, float],
                     history: Sequence[dict[str, float]] = ()) -> list[Alert]:
    """What is worth a person's attention at this iteration (``metrics``), given the metrics of the
    run's earlier committed iterations (``history``, oldest first):

    - ``kl-breach``: every KL above trainer.kl_rollback_threshold (a breach: each one matters);
    - ``val-drop``: val/accuracy more than trainer.alert_val_drop below the run's best so far
      (``dropped_from_best``: once per fall, armed again by a new best);
    - ``clipfrac-fell``: the clip fraction falling below CLIPFRAC_LOW from at or above
      CLIPFRAC_REARM (``fell_below``): the policy has stopped moving much, a convergence signal;
    - ``old-log-prob-gap``: old log-probs taken from the rollout (rollout.old_log_probs=auto) more than
      OLD_LOG_PROB_GAP from the trainer's own at the update's start: the PPO ratio does not start at 1."""
    out = []
    kl = metrics.get("kl/mean")
    if kl is not None and kl > trainer.kl_rollback_threshold:
        out.append(Alert("kl-breach", f"KL {kl:.4f} above trainer.kl_rollback_threshold="
                                      f"{trainer.kl_rollback_threshold}"))
    drop = trainer.alert_val_drop
    accuracy = [m.get("val/accuracy") for m in (*history, metrics)]
    best = dropped_from_best(accuracy, drop) if drop is not None else None
    if best is not None:
        out.append(Alert("val-drop", f"val/accuracy fell to {accuracy[-1]:.3f}, {best - accuracy[-1]:.3f} below the "
                                     f"run's best {best:.3f} (more than trainer.alert_val_drop={drop})"))
    gap = metrics.get("actor/old_log_prob_diff_max")
    if metrics.get("score/old_log_probs_from_rollout") == 1.0 and gap is not None and gap > OLD_LOG_PROB_GAP:
        out.append(Alert("old-log-prob-gap", f"the old log-probs taken from the rollout are up to {gap:.2g} from the "
                                             f"trainer's own (> {OLD_LOG_PROB_GAP:g}): set "
                                             "actor_rollout_ref.rollout.old_log_probs=recompute"))
    clipfrac = [m.get("actor/pg_clipfrac") for m in (*history, metrics)]
    if fell_below(clipfrac, CLIPFRAC_LOW, CLIPFRAC_REARM):
        before = max(v for v in clipfrac[:-1] if v is not None)
        out.append(Alert("clipfrac-fell", f"actor/pg_clipfrac fell to {clipfrac[-1]:.3f} (< {CLIPFRAC_LOW}; it had "
                                          f"reached {before:.3f}): updates are small now (a convergence signal)"))
    return out


def alerts(trainer: TrainerConfig, metrics: dict[str, float],
           history: Sequence[dict[str, float]] = ()) -> list[str]:
    """The messages of ``iteration_alerts``."""
    return [a.message for a in iteration_alerts(trainer, metrics, history)]


def dropped_from_best(values: Sequence[Optional[float]], drop: float) -> Optional[float]:
    """The best earlier value when the last of ``values`` (None: not measured) is a fall of more
    than ``drop`` below it while armed, else None. Armed from the first value on; the fall it
    reports disarms it, and a new best (a value above every earlier one) arms it again, so a
    validation score that stays low after a fall alerts once."""
    best, armed, fell = None, True, None
    for value in values:
        fell = None
        if value is None:
            continue
        if best is None or value > best:
            best, armed = value, True
        elif armed and value < best - drop:
            armed, fell = False, best
    return fell


def fell_below(values: Sequence[Optional[float]], low: float, rearm: float) -> bool:
    """Whether the last of ``values`` (None: not measured) is a fall below ``low`` while armed. The
    series starts unarmed, is armed by a value at or above ``rearm`` (> low) and disarmed by the fall
    it reports; values in between change nothing."""
    armed, fell = False, False
    for value in values:
        fell = False
        if value is None:
            continue
        if value >= rearm:
            armed = True
        elif value < low and armed:
            armed, fell = False, True
    return fell


def alert_history(run: RunDir, k: int) -> list[dict[str, float]]:
    """The metrics of the run's committed iterations before ``k``, oldest first (what ``alerts``
    compares iteration k with; a rolled-back attempt is not part of the run's history)."""
    return [run.read_json(run.iteration_metrics(j)) or {} for j in committed_iterations(run) if j < k]
