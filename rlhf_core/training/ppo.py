"""The PPO update loop: epochs → mini-batches (one optimizer step) → micro-batches (one backward).

Gradient accumulation is exact: every micro-batch's loss is its *share* of the mini-batch loss
(``rlhf_core.algos`` aggregation with the mini-batch's global token and sequence counts), gradients
are summed over micro-batches, and — because DeepSpeed averages gradients over data-parallel ranks —
each loss is multiplied by the world size. The accumulated gradient is then the gradient of the
full-mini-batch loss whatever the micro-batching or the number of ranks.

    actor loss  = policy loss − entropy_coeff · entropy + kl_loss_coef · KL(actor‖ref)   (use_kl_loss)
    critic loss = clipped value loss

Metrics per optimizer step: the mini-batch's loss values (``actor/pg_loss``, ``actor/kl_loss``,
``critic/vf_loss``), token means over the mini-batch (``actor/pg_clipfrac``, ``actor/ppo_kl``,
``actor/entropy``, ...), the pre-clip gradient norm and the learning rate. ``aggregate`` turns the
per-step list into per-iteration values.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from rlhf_core.training.batch import MicroBatch, MicroBatchPlan, PPOData, build_micro_batch, global_counts
from rlhf_core.training.batch import mini_batches, split_mini_batch
from rlhf_core.io.atomic import fault_point
from rlhf_core.training.distributed import DistInfo, all_reduce
from rlhf_core.training.engines import TrainEngine, optimizer_step
from rlhf_core.training.forward import actor_forward, critic_forward
from rlhf_core.progress import bar_disabled

# a micro-batch loss: (engine, micro-batch, mini-batch tokens, mini-batch sequences) → (loss, sums)
MicroLoss = Callable[[object, MicroBatch, int, int], tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class ActorLoss:
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    policy_loss: str = "vanilla"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "k1+"
    temperature: float = 1.0
    """The rollout temperature: old log-probs were computed at it, so the ratio must be too."""

    def __call__(self, engine, mb: MicroBatch, n_tok: int, n_seq: int):
        from rlhf_core.algos import agg_loss, get_policy_loss_fn, kl_penalty

        log_prob, entropy = actor_forward(engine, mb, self.temperature, entropy_grad=self.entropy_coeff != 0)
        t = {k: v.to(log_prob.device) for k, v in mb.tensors.items()}
        mask = mb.response_mask.to(log_prob.device)
        counts = dict(loss_agg_mode=self.loss_agg_mode, global_num_tokens=n_tok, global_num_seqs=n_seq)
        pg_loss, pg = get_policy_loss_fn(self.policy_loss)(
            old_log_prob=t["old_log_probs"], log_prob=log_prob, advantages=t["advantages"], response_mask=mask,
            clip_ratio_low=self.clip_ratio_low, clip_ratio_high=self.clip_ratio_high,
            clip_ratio_c=self.clip_ratio_c, **counts)
        kl = kl_penalty(logprob=log_prob, ref_logprob=t["ref_log_probs"], kind=self.kl_loss_type)
        kl_loss = agg_loss(loss_mat=kl, loss_mask=mask, **counts)
        ent_loss = agg_loss(loss_mat=entropy, loss_mask=mask, **counts)
        loss = pg_loss
        if self.entropy_coeff != 0:
            loss = loss - self.entropy_coeff * ent_loss
        if self.use_kl_loss:
            loss = loss + self.kl_loss_coef * kl_loss
        ntok = mask.sum()
        sums = {"actor/pg_loss": pg_loss, "actor/kl_loss": kl_loss,
                "actor/entropy": torch.where(mask, entropy, 0.0).sum() / max(n_tok, 1)}
        for k in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
            sums[f"actor/{k}"] = pg[k] * ntok / max(n_tok, 1)
        return loss, {k: v.detach().float() for k, v in sums.items()}


@dataclass(frozen=True)
class CriticLoss:
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"

    def __call__(self, engine, mb: MicroBatch, n_tok: int, n_seq: int):
        from rlhf_core.algos import compute_value_loss

        vpreds = critic_forward(engine, mb)
        t = {k: v.to(vpreds.device) for k, v in mb.tensors.items()}
        mask = mb.response_mask.to(vpreds.device)
        vf_loss, m = compute_value_loss(vpreds=vpreds, values=t["values"], returns=t["returns"], response_mask=mask,
                                        cliprange_value=self.cliprange_value, loss_agg_mode=self.loss_agg_mode,
                                        global_num_tokens=n_tok, global_num_seqs=n_seq)
        ntok = mask.sum()
        sums = {"critic/vf_loss": vf_loss, "critic/vf_clipfrac": m["vf_clipfrac"] * ntok / max(n_tok, 1),
                "critic/vpred_mean": torch.where(mask, vpreds, 0.0).sum() / max(n_tok, 1)}
        return vf_loss, {k: v.detach().float() for k, v in sums.items()}


@dataclass
class StepResult:
    metrics: dict[str, float]
    tokens: int
    """Real sequence tokens (prompt + response) this rank pushed through forward and backward."""


def train_step(te: TrainEngine, data: PPOData, rows: list[int], plan: MicroBatchPlan, loss_fn: MicroLoss,
               dist: DistInfo, pad_id: int,
               on_gradients: Optional[Callable[[TrainEngine], None]] = None) -> StepResult:
    """One optimizer step of ``te`` on mini-batch ``rows`` (table indices, all ranks together).
    ``on_gradients(te)`` runs after the last backward, before the step (to read gradients)."""
    n_tok, n_seq = global_counts(data, rows)
    layouts = split_mini_batch(data.lengths, rows, plan, dist.world_size, dist.rank)
    sums: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), dtype=torch.float64))
    tokens = 0
    for j, layout in enumerate(layouts):
        mb = build_micro_batch(data, layout, pad_id, filler_row=rows[0])
        te.engine.set_gradient_accumulation_boundary(j == len(layouts) - 1)
        loss, stats = loss_fn(te.engine, mb, n_tok, n_seq)
        # DeepSpeed averages over ranks; the shares were computed for a sum over ranks
        te.engine.backward(loss * (mb.weight * dist.world_size))
        for k, v in stats.items():
            sums[k] += v.cpu().double() * mb.weight
        tokens += mb.num_tokens if mb.weight else 0
    if on_gradients is not None:
        on_gradients(te)
    outcome = optimizer_step(te)
    keys = sorted(sums)
    reduced = all_reduce(torch.stack([sums[k] for k in keys])) if keys else torch.zeros(0)
    metrics = {k: float(v) for k, v in zip(keys, reduced)}
    metrics.update({f"{te.role}/grad_norm": outcome.grad_norm, f"{te.role}/lr": outcome.lr,
                    f"{te.role}/step_applied": float(outcome.applied), f"{te.role}/micro_batches": len(layouts)})
    return StepResult(metrics=metrics, tokens=tokens)


@dataclass
class RoleSchedule:
    te: TrainEngine
    loss_fn: MicroLoss
    epochs: int


@dataclass
class PPOOutcome:
    steps: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    """role → per-optimizer-step metrics (with "epoch" and "step")."""
    tokens: dict[str, int] = field(default_factory=dict)
    """role → sequence tokens this rank trained on (each epoch counted)."""
    seconds: dict[str, float] = field(default_factory=dict)
    """role → wall seconds of its training loop."""
    wall_seconds: float = 0.0
    """Wall seconds of the whole update loop (less than the sum of ``seconds`` when roles overlap)."""


def _train_role(role: RoleSchedule, data: PPOData, plan: MicroBatchPlan, mini_batch_size: int, shuffle: bool,
                seed: str, dist: DistInfo, pad_id: int, bar) -> tuple[list[dict[str, float]], int, float]:
    """All epochs of one role: (per-step metrics, tokens trained on, wall seconds)."""
    name, started = role.te.role, time.perf_counter()
    steps: list[dict[str, float]] = []
    tokens = 0
    for epoch in range(role.epochs):
        for rows in mini_batches(len(data), mini_batch_size, shuffle=shuffle, seed=seed, epoch=epoch):
            result = train_step(role.te, data, rows, plan, role.loss_fn, dist, pad_id)
            steps.append({"epoch": epoch, "step": len(steps), **result.metrics})
            fault_point(f"update:after_step:{name}:{len(steps)}")  # kill tests: weights moved, nothing saved
            tokens += result.tokens
            bar.update(1)
    return steps, tokens, time.perf_counter() - started


def run_ppo(roles: list[RoleSchedule], data: PPOData, *, plan: MicroBatchPlan, mini_batch_size: int,
            shuffle: bool, seed: str, dist: DistInfo, pad_id: int, progress: Optional[bool] = None,
            concurrent: bool = False) -> PPOOutcome:
    """Train each role (critic, then actor, or both at once) for its epochs over ``data``; every rank
    returns the same (all-reduced) metrics. The mini-batch order depends only on ``seed`` and the epoch.

    ``concurrent``: train the roles at the same time, one thread each. The critic's and the actor's
    updates read the same fixed advantages table and share nothing else, so each ends with exactly
    the weights and metrics it would have alone; with one intra-op thread per role this keeps two
    cores busy where a small model's matmuls cannot. Only for one process (``concurrent_roles``):
    with several ranks, two threads' collectives could interleave differently on each rank.
    """
    from concurrent.futures import ThreadPoolExecutor

    from tqdm.auto import tqdm

    if concurrent and dist.world_size > 1:
        raise ValueError("concurrent roles need a single process: collectives from two threads could "
                         "pair up differently on each rank")
    outcome = PPOOutcome()
    total = sum(r.epochs * math.ceil(len(data) / mini_batch_size) for r in roles)
    started = time.perf_counter()
    with tqdm(total=total, desc="ppo update", unit="step", leave=False,
              disable=bar_disabled(progress) or not dist.is_main) as bar:
        args = (data, plan, mini_batch_size, shuffle, seed, dist, pad_id, bar)
        if concurrent and len(roles) > 1:
            with ThreadPoolExecutor(max_workers=len(roles), thread_name_prefix="ppo-role") as pool:
                futures = [pool.submit(_train_role, role, *args) for role in roles]
                results = [f.result() for f in futures]  # re-raises a role's exception here
        else:
            results = [_train_role(role, *args) for role in roles]
    for role, (steps, tokens, seconds) in zip(roles, results):
        outcome.steps[role.te.role] = steps
        outcome.tokens[role.te.role] = tokens
        outcome.seconds[role.te.role] = seconds
    outcome.wall_seconds = time.perf_counter() - started
    return outcome


def aggregate(outcome: PPOOutcome) -> dict[str, float]:
    """Per-iteration metrics: each per-step metric averaged over the role's steps (grad norms over
    applied steps only), step and skipped-step counts, and throughput.

    ``perf/<role>_tokens_per_s``: sequence tokens (prompt + response, all ranks) through that model's
    forward and backward per second. ``perf/tokens_per_s``: the iteration's tokens times the actor's
    epochs over the whole update's wall seconds (critic and actor both trained, one after the other
    or at the same time) — the rate at which the update consumes data.
    """
    out: dict[str, float] = {}
    for role, steps in outcome.steps.items():
        applied = [s for s in steps if s.get(f"{role}/step_applied", 1.0) > 0]
        out[f"{role}/num_steps"] = float(len(steps))
        out[f"{role}/skipped_steps"] = float(len(steps) - len(applied))
        keys = {k for s in steps for k in s if k.startswith(role + "/") and k != f"{role}/step_applied"}
        for k in sorted(keys):
            pool = applied if k.endswith("/grad_norm") else steps
            values = [s[k] for s in pool if k in s and math.isfinite(s[k])]
            if values:
                out[k] = sum(values) / len(values)
    world_tokens = all_reduce(torch.tensor([float(outcome.tokens.get(r, 0)) for r in outcome.steps],
                                            dtype=torch.float64))
    for (role, tokens) in zip(outcome.steps, world_tokens.tolist()):
        secs = outcome.seconds.get(role, 0.0)
        out[f"perf/{role}_tokens_per_s"] = tokens / secs if secs > 0 else 0.0
    total = outcome.wall_seconds or sum(outcome.seconds.values())
    out["perf/update_seconds"] = total
    actor_tokens = float(world_tokens[list(outcome.steps).index("actor")]) if "actor" in outcome.steps else 0.0
    out["perf/tokens_per_s"] = actor_tokens / total if total > 0 else 0.0
    return out
