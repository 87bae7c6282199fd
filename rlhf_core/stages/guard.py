"""The KL guard: after each update, keep the new policy only if it stayed close to the reference.

    measure   KL(actor_new ‖ ref) per response token, averaged over every response token of the
              iteration (per-token mean: the unit of verl's ``kl/mean`` and ``target_kl``). Each
              token's KL is exact over the vocabulary at that position (``token_kl``), at the
              rollout temperature; the sampled-token estimate log p_new − log p_ref (ref log-probs
              from scored.parquet) is reported beside it as ``kl_k1_sampled``.
    decide    breach ⇔ KL > trainer.kl_rollback_threshold (at the threshold still commits).
              An update whose every actor step was skipped, or a non-finite KL, is a rollback too.

The stage writes the verdict (iter_k/guard.json) and nothing else: acting on it (commit, or roll
back) is ``rlhf_core.run.lifecycle.settle``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Callable, Optional

import pyarrow.parquet as pq
import torch

from rlhf_core.config import RLHFConfig
from rlhf_core.config.reads import At, Built, build, config_keys
from rlhf_core.errors import CheckpointError
from rlhf_core.io.atomic import atomic_write_json
from rlhf_core.io.timing import TABLE_READ, timed
from rlhf_core.run.layout import RunDir
from rlhf_core.run.lifecycle import nonfinite_update, shown_apart
from rlhf_core.run.models import reference_path
from rlhf_core.rollout.generate import GenerationSettings
from rlhf_core.scoring.policy_kl import (
    KLPassSettings, actor_ref_kl, actor_sampled_log_probs, importance_weighted_kl, response_kl,
)
from rlhf_core.run.session import RunSession
from rlhf_core.stages.base import StageResult, stage_record
from rlhf_core.stages.ranks import merge_shares, run_on_ranks, share_processes, write_share
from rlhf_core.stages.settings import generation, kl_pass
from rlhf_core.stages.validate import sample_val_responses, val_kl_from_samples
from rlhf_core.training import flops
from rlhf_core.training.run_trainer import ensure_state



@dataclass(frozen=True)
class GuardSettings:
    """What the guard's measurement and verdict read of a config, built once per guard (``guard_settings``)."""

    threshold: float
    """trainer.kl_rollback_threshold."""
    estimator: str
    """trainer.kl_guard_estimator: "sampled" for the one-pass estimate, else the exact per-token KL."""
    kl: KLPassSettings
    reference: Optional[Path]
    """The reference policy (``run.models.reference_path``); None when nothing measures against it (the
    sampled estimator with no validation-prompt check)."""
    val_prompts: int
    """trainer.kl_guard_val_prompts: how many validation prompts the on-policy check samples."""
    validation: Optional[GenerationSettings]
    """Their generation; None when the check is off or the run has no validation set."""
    processes: Callable[[int], int]
    """How many processes a pass over n sequences is dealt to; 0: this one (``ranks.share_processes``)."""
    on_ranks: Callable[[int], list]
    """``guard_share`` on that many processes, each rank's arrays (``ranks.run_on_ranks``)."""


@dataclass(frozen=True)
class GuardConfig:
    """What the guard's measurement and verdict read of the config (``guard_config``)."""

    threshold: float
    estimator: str
    val_prompts: int
    kl: KLPassSettings


def guard_config(threshold: Annotated[float, At("trainer.kl_rollback_threshold")],
                 estimator: Annotated[str, At("trainer.kl_guard_estimator")],
                 val_prompts: Annotated[int, At("trainer.kl_guard_val_prompts")],
                 kl: Annotated[KLPassSettings, Built(kl_pass)]) -> GuardConfig:
    """Its parameters are the keys the guard's config hash covers (``kl_pass``'s included); the
    validation prompts' generation keys (``settings.generation``) join them when the check is on
    (``config_sections``)."""
    return GuardConfig(threshold=threshold, estimator=estimator, val_prompts=val_prompts, kl=kl)


def guard_settings(cfg: RLHFConfig, run: RunDir, k: int, session: RunSession) -> GuardSettings:
    """The guard's settings for iteration ``k`` of ``run``: the validation prompts' generation and the
    reference are resolved only when the guard measures with them, the process counts when asked for
    (the session's worker group, when it keeps one, runs the shares)."""
    read = build(guard_config, cfg)
    validation = build(generation, cfg) if read.val_prompts > 0 and run.val_prompts.is_file() else None
    return GuardSettings(
        threshold=read.threshold, estimator=read.estimator, kl=read.kl,
        reference=reference_path(cfg) if read.estimator != "sampled" or validation is not None else None,
        val_prompts=read.val_prompts, validation=validation,
        processes=lambda items: share_processes(cfg.trainer, session, items),
        on_ranks=lambda world: run_on_ranks(cfg, run, session, k, "guard", world))


def load_scored_sequences(path: Path, *columns: str) -> tuple:
    """(sequences, prompt lengths, then per column of ``columns`` (default: ref_log_probs) its
    per-token lists) of the responses with tokens, in one read."""
    columns = columns or ("ref_log_probs",)
    with timed(TABLE_READ):
        table = pq.read_table(path, columns=["prompt_token_ids", "response_token_ids", *columns])
    prompts = table.column("prompt_token_ids").to_pylist()
    responses = table.column("response_token_ids").to_pylist()
    keep = [i for i, r in enumerate(responses) if r]  # an empty response has no token to score
    lists = [[values[i] for i in keep] for values in (table.column(c).to_pylist() for c in columns)]
    return ([prompts[i] + responses[i] for i in keep], [len(prompts[i]) for i in keep], *lists)


def measure_kl(settings: GuardSettings, session: RunSession, run: RunDir, k: int,
               actor_dir: Optional[Path] = None) -> dict[str, float]:
    """KL(new actor ‖ ref) over iteration ``k``'s scored responses (see ``token_kl``, ``response_kl``).

    ``actor_dir`` defaults to the iteration's freshly trained actor (iter_k/checkpoint/actor), lent
    by the session's trainer when it holds it.
    """
    actor_dir = Path(actor_dir) if actor_dir else run.checkpoint(k) / "actor"
    if not actor_dir.is_dir() and not session.live.available(actor_dir):
        raise CheckpointError(f"no trained actor at {actor_dir}: run `rlhf stage update --run-dir {run.root} "
                              f"--iteration {k}` before the guard")
    if settings.estimator == "sampled":  # one actor pass, against the stored log-probs
        sequences, prompt_lengths, ref_log_probs, old_log_probs = load_scored_sequences(
            run.scored(k), "ref_log_probs", "old_log_probs")
        sampled = actor_sampled_log_probs(settings.kl, session, actor_dir, sequences, prompt_lengths)
        kls = importance_weighted_kl(sampled, old_log_probs, ref_log_probs)
        k1 = [[a - b for a, b in zip(new.tolist(), ref)] for new, ref in zip(sampled, ref_log_probs)]
        return {**response_kl(kls, k1), "estimator": "sampled"}
    sequences, prompt_lengths, ref_log_probs = load_scored_sequences(run.scored(k))
    world = settings.processes(len(sequences))
    if world and actor_dir == run.checkpoint(k) / "actor":
        # each process measures its micro-batches of the one-process plan: the same values, bit for bit
        shares = settings.on_ranks(world)
        kls = [torch.tensor(v, dtype=torch.float32) for v in merge_shares(shares, "kl", len(sequences))]
        sampled = [torch.tensor(v, dtype=torch.float32) for v in merge_shares(shares, "sampled", len(sequences))]
    else:
        kls, sampled = actor_ref_kl(settings.kl, session, actor_dir, settings.reference, sequences, prompt_lengths)
    k1 = [[a - b for a, b in zip(new.tolist(), old)] for new, old in zip(sampled, ref_log_probs)]
    return response_kl(kls, k1)


def guard_floor(settings: GuardSettings, session: RunSession, run: RunDir, k: int) -> dict[str, float]:
    """The model FLOPs of ``measure_kl``'s passes over iteration ``k``'s responses — the new actor's
    forward, and for the exact measure the reference's forward or, on the states the score stage kept
    (``scoring.ref_states``), only its LM head — and their floor (``training.flops``); whether the
    reference's states were reused (``perf/guard_reference_states_kept``). {} when a shape cannot be read."""
    sequences, prompt_lengths, _ = load_scored_sequences(run.scored(k))
    lengths = [len(s) for s in sequences]
    positions = sum(n - p for n, p in zip(lengths, prompt_lengths))
    actor = flops.model_shape(run.checkpoint(k) / "actor", session.live)
    if actor is None:
        return {}
    total, out, kl = flops.forward_flops(actor, lengths, positions), {}, settings.kl
    if settings.estimator != "sampled":
        reference = flops.model_shape(settings.reference, session.live)
        if reference is None:
            return {}
        kept = not settings.processes(len(sequences)) and session.ref_states.lookup(
            settings.reference, kl.dtype, kl.attention, sequences, prompt_lengths) is not None
        total += (2.0 * reference.hidden_size * reference.vocab_size * positions if kept
                  else flops.forward_flops(reference, lengths, positions))
        out["perf/guard_reference_states_kept"] = float(kept)
    dtype = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[kl.dtype]
    return {**out, **flops.floor_metrics("guard", total, kl.device.type, dtype)}


def decide(kl: float, threshold: float) -> str:
    """"commit" when KL is at or under the threshold, else "rollback"."""
    return "commit" if kl <= threshold else "rollback"


def config_sections(cfg: RLHFConfig) -> tuple[str, ...]:
    """The config this stage's output depends on (its manifest's config hash). The generation keys
    count only when the guard samples (the key set then differs, so switching the check on or off
    reruns it), so the hashes of guards recorded without the check stay as they were."""
    return config_keys(guard_config, *([generation] if cfg.trainer.kl_guard_val_prompts > 0 else []))


def run_guard(cfg: RLHFConfig, run: RunDir, iteration: Optional[int] = None, force: bool = False,
              session: Optional[RunSession] = None) -> StageResult:
    """Measure iteration ``iteration``'s KL and write the verdict (iter_k/guard.json).

    This stage only decides; ``lifecycle.settle`` acts on the verdict (commit, or roll back; the
    flow runs it as its settle task). ``session``: the flow run's (its trainer lends the new
    actor); None: every model read from disk.
    """
    session = session or RunSession()
    if iteration is None:
        raise ValueError("the guard stage needs an iteration")
    k = iteration

    with stage_record(stage="guard", cfg=cfg, run=run, iteration=k,
                      inputs=[run.scored(k), run.checkpoint(k) / "actor"],
                      config_sections=config_sections(cfg), force=force) as record:
        if record.skipped:
            return record.skipped
        ensure_state(session, run, k)  # the new actor: held in memory, on disk, or rebuilt now
        settings = guard_settings(cfg, run, k, session)
        threshold = settings.threshold
        kl = measure_kl(settings, session, run, k)
        verdict = {"iteration": k, "threshold": threshold, **kl}
        val = measure_val_kl(settings, session, run, k)
        verdict.update(val)
        guarded = max(kl["kl_mean"], val.get("val_kl_mean", float("-inf")))
        verdict["decision"] = decide(guarded, threshold)
        nonfinite = nonfinite_update(run.read_json(run.metrics(k)) or {}, guarded)
        if nonfinite:
            verdict.update(decision="rollback", reason=f"non-finite update: {nonfinite}")
        atomic_write_json(run.verdict(k), verdict)
        metrics = {f"guard/{key}": float(v) for key, v in verdict.items() if key.startswith(("kl_", "val_kl_"))}
        metrics["guard/breach"] = float(verdict["decision"] == "rollback")
        metrics["guard/nonfinite_update"] = float(nonfinite is not None)
        metrics["guard/threshold"] = float(threshold)
        metrics.update(guard_floor(settings, session, run, k))
        shown, bound = shown_apart(guarded, threshold)
        estimate = " (sampled estimate)" if kl.get("estimator") == "sampled" else ""
        line = (f"KL(actor‖ref) per-token mean{estimate} {shown}{' (validation prompts)' if guarded > kl['kl_mean'] else ''} "
                f"{'>' if guarded > threshold else '<='} threshold {bound} → {verdict['decision']}"
                + (f" ({verdict['reason']})" if "reason" in verdict else ""))
        rows = {"responses": int(kl["num_responses"]), "tokens": int(kl["num_tokens"])}
        return record.done(StageResult(stage="guard", iteration=k, outputs={"verdict": str(run.verdict(k))},
                                       rows=rows, metrics=metrics, summary=[line]))


def measure_val_kl(settings: GuardSettings, session: RunSession, run: RunDir, k: int) -> dict[str, float]:
    """On-policy KL on validation prompts (trainer.kl_guard_val_prompts > 0): responses sampled from
    the new actor, scored under it and under the reference. {} when switched off or no val set."""
    if settings.validation is None:
        return {}
    samples = sample_val_responses(settings.validation, session, run, run.checkpoint(k) / "actor",
                                   limit=settings.val_prompts, seed_offset=k)
    return val_kl_from_samples(settings.kl, session, settings.reference, samples, run.checkpoint(k) / "actor")


def guard_share(cfg, run: RunDir, iteration: int, rank: int, world: int, out: Path, session: RunSession) -> None:
    """This rank's micro-batches of the KL guard's measurement (exact per-token KL, sampled log-probs)."""
    sequences, prompt_lengths, _ = load_scored_sequences(run.scored(iteration))
    kls, sampled = actor_ref_kl(build(kl_pass, cfg), session, run.checkpoint(iteration) / "actor", reference_path(cfg),
                                sequences, prompt_lengths, share=(rank, world))
    write_share(out, {"kl": kls, "sampled": sampled})
