"""The KL guard: after each update, keep the new policy only if it stayed close to the reference.

    measure   KL(actor_new ‖ ref) per response token, averaged over every response token of the
              iteration (per-token mean: the unit of verl's ``kl/mean`` and ``target_kl``). Each
              token's KL is exact over the vocabulary at that position (``token_kl``), at the
              rollout temperature; the sampled-token estimate log p_new − log p_ref (ref log-probs
              from scored.parquet) is reported beside it as ``kl_k1_sampled``.
    decide    breach ⇔ KL > trainer.kl_rollback_threshold (at the threshold still commits).
    commit    last_good.json → this iteration's checkpoint (one atomic rename).
    rollback  discard this iteration's checkpoint, put the KL controller back to its state before
              the iteration, mark gae/update/guard ``rolled_back`` and append a ``rollback`` event.
              The actor, critic and optimizer state need no copying: the next update reads them
              from the last-good checkpoint, which the pointer still names and nothing rewrote.

The pieces are separate functions so the Prefect flow can run commit and rollback as transaction
hooks, and ``rlhf stage guard`` (no transaction) can run the same code on disk. Everything here is
idempotent: a crash between two steps is repaired by running the step again.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Optional

from rlhf_core.config import RLHFConfig
from rlhf_core.config.resolve import micro_batching
from rlhf_core.errors import CheckpointError, RLHFError
from rlhf_core.io.atomic import TMP_MARK, atomic_write_json
from rlhf_core.io.manifest import read_manifest, set_status, write_manifest
from rlhf_core.io.pointers import read_last_good, write_last_good
from rlhf_core.io.rundir import RunDir
from rlhf_core.io.timing import MODEL_LOAD, TABLE_READ, timed
from rlhf_core.stages.base import StageResult, execute_stage

ROLLED_BACK_STAGES = ("gae", "update", "guard")
"""Stages whose outputs a rollback invalidates. Rollout and score stay valid: they were computed
from the last-good actor, which the rollback keeps, so a retry reuses them."""

GUARD_SECTIONS = ("trainer.kl_rollback_threshold", "trainer.kl_guard_val_prompts",
                  "actor_rollout_ref.rollout.temperature", "actor_rollout_ref.rollout.log_prob",
                  "actor_rollout_ref.model", "actor_rollout_ref.ref", "trainer.device")


class KLGuardHalt(RLHFError):
    """The guard rolled back an iteration and the policy (halt, or retries used up) stops the run."""


def verdict_path(run: RunDir, k: int) -> Path:
    return run.iter_dir(k) / "guard.json"


def kl_snapshot_path(run: RunDir, k: int) -> Path:
    return run.iter_dir(k) / "kl_ctrl_before.json"


# ---------------------------------------------------------------------------------------------
# measure
# ---------------------------------------------------------------------------------------------


def response_kl(token_kls: list, sampled_k1: Optional[list] = None) -> dict[str, float]:
    """Summaries of per-response token KL lists (each (n_i,)).

    kl_mean          Σ_i Σ_t kl_it / Σ_i n_i     per-token mean: the guarded quantity
    kl_seq_mean      mean_i mean_t kl_it         sequence-mean of token-means (rows with ≥ 1 token)
    kl_max           largest single-token KL
    kl_k1_sampled    per-token mean of log p_new(y_t) − log p_ref(y_t) on the sampled tokens
    """
    total, count, seq_means, peak = 0.0, 0, [], 0.0
    for kl in token_kls:
        kl = [float(x) for x in kl]
        if not kl:
            continue
        total += sum(kl)
        count += len(kl)
        seq_means.append(sum(kl) / len(kl))
        peak = max(peak, max(kl))
    out = {"kl_mean": total / count if count else 0.0,
           "kl_seq_mean": sum(seq_means) / len(seq_means) if seq_means else 0.0,
           "kl_max": peak, "num_tokens": count, "num_responses": len(seq_means)}
    if sampled_k1 is not None:
        flat = [float(x) for row in sampled_k1 for x in row]
        out["kl_k1_sampled"] = sum(flat) / len(flat) if flat else 0.0
    return out


def token_kl(actor, ref, sequences: list[list[int]], prompt_lengths: list[int], *, budget: int,
             temperature: float, pad_id: int = 0) -> tuple[list, list]:
    """Exact KL(actor ‖ ref) at every response position, summed over the whole vocabulary:

        kl_t = Σ_v p_a(v | s_<t) · (log p_a(v | s_<t) − log p_ref(v | s_<t)),   p = softmax(logits / T)

    Returns (per-sequence (n_i,) KL tensors, per-sequence (n_i,) actor log-probs of the sampled
    tokens). Unlike the one-sample estimate log p_a(y_t) − log p_ref(y_t), this is exact for each
    visited context and never negative, so it measures the new policy's drift even though the
    responses were sampled from the previous policy. Both models see the same packed micro-batches
    (block-diagonal mask), one no-grad forward each.
    """
    import torch

    from rlhf_core.models.packed import pack_rows, packed_forward, response_positions
    from rlhf_core.scoring import plan_micro_batches

    kls: list = [None] * len(sequences)
    sampled: list = [None] * len(sequences)
    with torch.no_grad():
        for micro in plan_micro_batches([len(s) for s in sequences], budget):
            packed = pack_rows(micro, sequences, pad_id)
            rows, cols, owners = response_positions(packed, prompt_lengths)
            if not owners:
                continue
            # the LM heads run on the response positions only: (N, V) each
            la = torch.log_softmax(packed_forward(actor, packed, positions=(rows, cols)).float() / temperature, dim=-1)
            lr = torch.log_softmax(packed_forward(ref, packed, positions=(rows, cols)).float() / temperature, dim=-1)
            kl = (la.exp() * (la - lr)).sum(-1).clamp_min(0.0).cpu()  # clamp: rounding only
            labels = packed.input_ids[rows, cols + 1].to(la.device)
            picked = la.gather(-1, labels[:, None]).squeeze(-1).cpu()
            offset = 0
            for i, n in owners:
                kls[i], sampled[i] = kl[offset:offset + n], picked[offset:offset + n]
                offset += n
            del la, lr
    return kls, sampled


def _load_scored_sequences(path: Path) -> tuple[list[list[int]], list[int], list[list[float]]]:
    import pyarrow.parquet as pq

    with timed(TABLE_READ):
        table = pq.read_table(path, columns=["prompt_token_ids", "response_token_ids", "ref_log_probs"])
    prompts = table.column("prompt_token_ids").to_pylist()
    responses = table.column("response_token_ids").to_pylist()
    refs = table.column("ref_log_probs").to_pylist()
    keep = [i for i, r in enumerate(responses) if r]  # an empty response has no token to score
    return ([prompts[i] + responses[i] for i in keep], [len(prompts[i]) for i in keep],
            [refs[i] for i in keep])


def measure_kl(cfg: RLHFConfig, run: RunDir, k: int, actor_dir: Optional[Path] = None) -> dict[str, float]:
    """KL(new actor ‖ ref) over iteration ``k``'s scored responses (see ``token_kl``, ``response_kl``).

    ``actor_dir`` defaults to the iteration's freshly trained actor (iter_k/checkpoint/actor).
    """
    actor_dir = Path(actor_dir) if actor_dir else run.checkpoint(k) / "actor"
    if not actor_dir.is_dir():
        raise CheckpointError(f"no trained actor at {actor_dir}: run `rlhf stage update --run-dir {run.root} "
                              f"--iteration {k}` before the guard")
    sequences, prompt_lengths, ref_log_probs = _load_scored_sequences(run.scored(k))
    kls, sampled = actor_ref_kl(cfg, actor_dir, sequences, prompt_lengths)
    k1 = [[a - b for a, b in zip(new.tolist(), old)] for new, old in zip(sampled, ref_log_probs)]
    return response_kl(kls, k1)


def actor_ref_kl(cfg: RLHFConfig, actor_dir: Path, sequences: list[list[int]], prompt_lengths: list[int]
                 ) -> tuple[list, list]:
    """``token_kl`` of the actor in ``actor_dir`` against the reference policy, on the scoring
    device and dtype, with the rollout's temperature and scoring token budget."""
    from rlhf_core.io.pointers import reference_path
    from rlhf_core.scoring import load_causal_lm, scoring_device, scoring_dtype

    rollout = cfg.actor_rollout_ref.rollout
    device = scoring_device(cfg.trainer.device)
    dtype = scoring_dtype(device, cfg.actor_rollout_ref.actor.deepspeed_config.dtype)
    actor = load_actor_for_kl(actor_dir, device, dtype)
    ref = load_causal_lm(reference_path(cfg), device, dtype, role="reference", shared=True)
    pad_id = actor.config.pad_token_id if actor.config.pad_token_id is not None else 0
    # packed like the scoring stage's reference forward: the reference role's token budget (verl's
    # ref.log_prob_max_token_len_per_gpu, which falls back to the actor's)
    budget = micro_batching(cfg, "ref").token_budget
    return token_kl(actor, ref, sequences, prompt_lengths, budget=budget, temperature=rollout.temperature,
                    pad_id=pad_id)


def load_actor_for_kl(actor_dir: Path, device, dtype):
    """The trained actor for KL measurement: shared from ``scoring.cache`` (the next rollout samples
    from it when committed), except a LoRA adapter, which ``export.load_actor`` merges into its base."""
    from rlhf_core.export import is_lora_dir, load_actor
    from rlhf_core.scoring import load_causal_lm

    if is_lora_dir(actor_dir):
        with timed(MODEL_LOAD):
            return load_actor(actor_dir, device=device, dtype=dtype)
    return load_causal_lm(actor_dir, device, dtype, role="actor", shared=True)


def nonfinite_update(update_record: dict, kl: float) -> Optional[str]:
    """Why iteration's update is not worth keeping although its KL may look fine, else None: a
    non-finite KL, or every actor optimizer step skipped for a non-finite loss / gradient norm (the
    weights did not move; committing would hide the fault). ``update_record``: iter_k/metrics.json."""
    import math

    if not math.isfinite(kl):
        return f"KL(actor‖ref) is {kl}"
    metrics = update_record.get("metrics") or {}
    steps, skipped = metrics.get("actor/num_steps", 0), metrics.get("actor/skipped_steps", 0)
    if steps and skipped >= steps:
        return f"all {int(steps)} actor steps skipped (non-finite loss or gradient norm)"
    return None


def decide(kl: float, threshold: float) -> str:
    """"commit" when KL is at or under the threshold, else "rollback"."""
    return "commit" if kl <= threshold else "rollback"


def run_guard(cfg: RLHFConfig, run: RunDir, iteration: Optional[int] = None, force: bool = False) -> StageResult:
    """Measure iteration ``iteration``'s KL and write the verdict (iter_k/guard.json).

    This stage only decides; ``commit_iteration`` / ``rollback_iteration`` act on the verdict (the
    flow runs them as transaction hooks).
    """
    if iteration is None:
        raise ValueError("the guard stage needs an iteration")
    k = iteration
    threshold = cfg.trainer.kl_rollback_threshold

    def body() -> StageResult:
        kl = measure_kl(cfg, run, k)
        verdict = {"iteration": k, "threshold": threshold, **kl}
        val = measure_val_kl(cfg, run, k)
        verdict.update(val)
        guarded = max(kl["kl_mean"], val.get("val_kl_mean", float("-inf")))
        verdict["decision"] = decide(guarded, threshold)
        nonfinite = nonfinite_update(run.read_json(run.metrics(k)) or {}, guarded)
        if nonfinite:
            verdict.update(decision="rollback", reason=f"non-finite update: {nonfinite}")
        atomic_write_json(verdict_path(run, k), verdict)
        metrics = {f"guard/{key}": float(v) for key, v in verdict.items() if key.startswith(("kl_", "val_kl_"))}
        metrics["guard/breach"] = float(verdict["decision"] == "rollback")
        metrics["guard/nonfinite_update"] = float(nonfinite is not None)
        metrics["guard/threshold"] = float(threshold)
        line = (f"KL(actor‖ref) per-token mean {kl['kl_mean']:.4f} "
                f"{'>' if guarded > threshold else '<='} threshold {threshold:g} → {verdict['decision']}"
                + (f" ({verdict['reason']})" if "reason" in verdict else ""))
        return StageResult(stage="guard", iteration=k, outputs={"verdict": str(verdict_path(run, k))},
                           rows={"responses": int(kl["num_responses"]), "tokens": int(kl["num_tokens"])}, metrics=metrics,
                           summary=[line])

    return execute_stage(stage="guard", cfg=cfg, run=run, iteration=k,
                         inputs=[run.scored(k), run.checkpoint(k) / "actor"],
                         config_sections=GUARD_SECTIONS, body=body, force=force)


def measure_val_kl(cfg: RLHFConfig, run: RunDir, k: int) -> dict[str, float]:
    """On-policy KL on validation prompts (trainer.kl_guard_val_prompts > 0): responses sampled from
    the new actor, scored under it and under the reference. {} when switched off or no val set."""
    n = cfg.trainer.kl_guard_val_prompts
    if n <= 0 or not run.val_prompts.is_file():
        return {}
    from rlhf_core.validation import sample_val_responses, val_kl_from_samples

    samples = sample_val_responses(cfg, run, run.checkpoint(k) / "actor", limit=n, seed_offset=k)
    return val_kl_from_samples(cfg, samples, run.checkpoint(k) / "actor")


def read_verdict(run: RunDir, k: int) -> Optional[dict]:
    return run.read_json(verdict_path(run, k))


# ---------------------------------------------------------------------------------------------
# KL controller snapshot
# ---------------------------------------------------------------------------------------------


def begin_iteration(run: RunDir, k: int) -> dict:
    """Record the KL controller state as it was before iteration ``k`` (once), and when the gae
    stage of ``k`` has not completed, put that state back: a crash inside gae may have updated the
    controller without recording the stage, and rerunning gae must not update it twice."""
    snap = kl_snapshot_path(run, k)
    current = run.read_json(run.kl_ctrl_path)
    if not snap.is_file():
        atomic_write_json(snap, {"state": current})
        return {"snapshot": "taken", "state": current}
    saved = run.read_json(snap)["state"]
    gae_done = read_manifest(run, k).get("gae", {}).get("status") == "done"
    if not gae_done and saved != current:
        _write_kl_state(run, saved)
        return {"snapshot": "restored", "state": saved}
    return {"snapshot": "kept", "state": current}


def _write_kl_state(run: RunDir, state: Optional[dict]) -> None:
    if state is None:
        run.kl_ctrl_path.unlink(missing_ok=True)
    else:
        atomic_write_json(run.kl_ctrl_path, state)


def restore_kl_controller(run: RunDir, k: int) -> Optional[dict]:
    """Put kl_ctrl.json back to its state before iteration ``k`` (from the snapshot, else from the
    last-good checkpoint's trainer_state.json). Returns the restored state (None = fresh)."""
    snap = run.read_json(kl_snapshot_path(run, k))
    if snap is not None:
        state = snap["state"]
    else:
        state = _kl_state_from_last_good(run)
    _write_kl_state(run, state)
    return state


def _kl_state_from_last_good(run: RunDir) -> Optional[dict]:
    record = read_last_good(run)
    if not record:
        return None
    trainer_state = run.read_json(run.root / record["checkpoint"] / "trainer_state.json") or {}
    return trainer_state.get("kl_ctrl")


# ---------------------------------------------------------------------------------------------
# commit / rollback
# ---------------------------------------------------------------------------------------------


def commit_iteration(run: RunDir, k: int) -> dict:
    """Move last_good to iteration ``k`` (atomic) and note it in the manifest and event log."""
    checkpoint = run.checkpoint(k)
    if not (checkpoint / "actor").is_dir():
        raise CheckpointError(f"cannot commit iteration {k}: {checkpoint}/actor is missing")
    previous = read_last_good(run)
    if previous and previous.get("iteration") == k:  # a rerun after a crash past the pointer move
        set_status(run, k, "guard", "done", committed=True)
        return previous
    record = write_last_good(run, k)
    set_status(run, k, "guard", "done", committed=True)
    run.append_event("commit", k, previous_last_good=previous.get("iteration") if previous else None)
    return record


def check_committed(run: RunDir, k: int) -> None:
    """Prefect logs and swallows a failing commit hook (and then rolls back): fail loudly instead."""
    record = read_last_good(run)
    if not record or record.get("iteration") != k:
        raise CheckpointError(f"iteration {k} of {run.root} passed the KL guard but last_good.json does not point "
                              f"at it (see the commit hook's error in the flow log); rerun with `rlhf run --resume "
                              f"{run.root}`")


def discard_checkpoint(run: RunDir, k: int) -> bool:
    """Remove iteration ``k``'s checkpoint: renamed to a temporary name first (one atomic step, so
    no reader ever sees half a checkpoint; ``clean_temporaries`` removes a crash's leftover), then
    deleted. Refuses to touch the last-good checkpoint. Returns whether anything was removed."""
    checkpoint = run.checkpoint(k)
    record = read_last_good(run)
    if record and record.get("iteration") == k:
        raise CheckpointError(f"refusing to discard {checkpoint}: it is the last-good checkpoint")
    if not checkpoint.exists():
        return False
    doomed = checkpoint.with_name(f"{checkpoint.name}{TMP_MARK}discarded-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    os.replace(checkpoint, doomed)
    shutil.rmtree(doomed, ignore_errors=True)
    return True


def rollback_iteration(run: RunDir, k: int, *, policy: str, attempt: int) -> dict:
    """Undo iteration ``k`` on disk except the checkpoint (see ``discard_checkpoint``): mark its
    gae/update/guard records ``rolled_back``, restore the KL controller, append the event."""
    verdict = read_verdict(run, k) or {}
    manifest = read_manifest(run, k)
    for stage in ROLLED_BACK_STAGES:
        if stage in manifest:
            manifest[stage]["status"] = "rolled_back"
            manifest[stage]["rollback_attempt"] = attempt
    write_manifest(run, k, manifest)
    restored = restore_kl_controller(run, k)
    last_good = read_last_good(run)
    return run.append_event(
        "rollback", k, reason=verdict.get("reason", "KL above threshold"), kl=verdict.get("kl_mean"),
        val_kl=verdict.get("val_kl_mean"),
        threshold=verdict.get("threshold"), attempt=attempt, policy=policy,
        last_good=last_good.get("iteration") if last_good else None,
        kl_ctrl_restored=restored)


def rollback_count(run: RunDir, k: int, since: float = 0.0) -> int:
    """Rollbacks of iteration ``k`` recorded since ``since`` (a flow run's start time)."""
    return sum(1 for e in run.events() if e.get("kind") == "rollback" and e.get("iteration") == k
               and e.get("time", 0) >= since)


def retry_overrides(cfg: RLHFConfig, run: RunDir, k: int) -> tuple[list[str], dict[str, Any]]:
    """What a retry of iteration ``k`` changes: the actor learning rate divided by
    trainer.retry_lr_divisor (a config override) and the KL coefficient multiplied by
    trainer.retry_kl_coef_multiplier (in the controller state and its pre-iteration snapshot, so a
    second rollback starts from the raised value). Returns (overrides, {change: (old, new)})."""
    t = cfg.trainer
    changes: dict[str, Any] = {}
    overrides: list[str] = []
    if t.retry_lr_divisor > 1:
        old = cfg.actor_rollout_ref.actor.optim.lr
        overrides.append(f"actor_rollout_ref.actor.optim.lr={old / t.retry_lr_divisor!r}")
        changes["actor_rollout_ref.actor.optim.lr"] = (old, old / t.retry_lr_divisor)
    if t.retry_kl_coef_multiplier > 1:
        state = run.read_json(run.kl_ctrl_path)
        if isinstance(state, dict) and isinstance(state.get("value"), (int, float)):
            old = float(state["value"])
            state["value"] = old * t.retry_kl_coef_multiplier
            _write_kl_state(run, state)
            atomic_write_json(kl_snapshot_path(run, k), {"state": state})
            changes["kl_ctrl.value"] = (old, state["value"])
        else:  # no controller state yet: the coefficient still comes from the config
            old = cfg.algorithm.kl_ctrl.kl_coef
            overrides.append(f"algorithm.kl_ctrl.kl_coef={old * t.retry_kl_coef_multiplier!r}")
            changes["algorithm.kl_ctrl.kl_coef"] = (old, old * t.retry_kl_coef_multiplier)
        if cfg.actor_rollout_ref.actor.use_kl_loss:
            old = cfg.actor_rollout_ref.actor.kl_loss_coef
            overrides.append(f"actor_rollout_ref.actor.kl_loss_coef={old * t.retry_kl_coef_multiplier!r}")
            changes["actor_rollout_ref.actor.kl_loss_coef"] = (old, old * t.retry_kl_coef_multiplier)
    return overrides, changes


def halt_message(run: RunDir, k: int, reason: str) -> str:
    """What happened and how to continue, for the failed flow run and the CLI."""
    verdict = read_verdict(run, k) or {}
    last_good = read_last_good(run)
    where = f"iteration {last_good['iteration']}" if last_good else "the initial model (no iteration committed)"
    if "reason" in verdict:  # a non-finite update, not a KL breach
        return (f"KL guard halted the run at iteration {k}: {verdict['reason']} ({reason}). The iteration was "
                f"rolled back; last-good is {where}. Look for NaN/inf in iter_{k}/advantages.parquet and the "
                f"update's metrics (iter_{k}/metrics.json), lower actor_rollout_ref.actor.optim.lr or fix the "
                f"reward, then resume: rlhf run --resume {run.root}")
    return (f"KL guard halted the run at iteration {k}: KL(actor‖ref) = {verdict.get('kl_mean', float('nan')):.4f} "
            f"> trainer.kl_rollback_threshold = {verdict.get('threshold')} ({reason}). The iteration was rolled "
            f"back; last-good is {where}. To continue, lower the step size or raise the threshold and resume, "
            f"e.g.: rlhf run --resume {run.root} actor_rollout_ref.actor.optim.lr=<smaller> "
            f"(or trainer.on_kl_breach=retry, or trainer.kl_rollback_threshold=<larger>)")


def committed_iterations(run: RunDir) -> list[int]:
    """Iterations whose guard committed them, ascending."""
    out = []
    for k in run.iterations():
        record = read_manifest(run, k).get("guard", {})
        if record.get("committed"):
            out.append(k)
    return out

