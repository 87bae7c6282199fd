"""The PPO update loop: epochs → mini-batches (one optimizer step) → micro-batches (one backward).

Gradient accumulation is exact: every micro-batch's loss is its *share* of the mini-batch loss
(``rlhf_core.algos`` aggregation with the mini-batch's global token and sequence counts), gradients
are summed over micro-batches, and — because DeepSpeed averages gradients over data-parallel ranks —
each loss is multiplied by the world size. The accumulated gradient is then the gradient of the
full-mini-batch loss (verl's ``agg_loss`` over the whole mini-batch) whatever the micro-batching,
the packing or the number of ranks.

    actor loss  = policy loss − entropy_coeff · entropy + kl_loss_coef · KL(actor‖ref)   (use_kl_loss)
    critic loss = clipped value loss

Metrics, under verl's names (dp_actor / dp_critic): per optimizer step the mini-batch's losses
(``actor/pg_loss``, ``actor/kl_loss`` — 0 without use_kl_loss, as verl — ``critic/vf_loss``), its
aggregated entropy (``actor/entropy``), its token means (``actor/pg_clipfrac``, ``actor/ppo_kl``,
``actor/pg_clipfrac_lower``, ``critic/vf_clipfrac``, ``critic/vpred_mean``), ``actor/kl_coef`` with
use_kl_loss, the pre-clip gradient norm and the learning rate. ``aggregate`` reduces the steps of
an iteration as verl reduces them (see ``SUMMED_OVER_STEPS``).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import torch
from tqdm.auto import tqdm

from rlhf_core.algos.registry import accepted_kwargs, get_policy_loss_fn
from rlhf_core.algos.aggregation import agg_loss
from rlhf_core.algos.losses import compute_value_loss
from rlhf_core.algos.kl import kl_penalty
from rlhf_core.algos.correction_specs import RolloutCorrection
from rlhf_core.io.atomic import fault_point
from rlhf_core.models.packed import packing_attention_mode
from rlhf_core.progress import bar_disabled
from rlhf_core.training.batch import MicroBatch, MicroBatchPlan, PPOData, build_micro_batch, global_counts
from rlhf_core.training.batch import mini_batches, split_mini_batch
from rlhf_core.training.distributed import DistInfo, all_reduce
from rlhf_core.training.engines import TrainEngine, optimizer_step
from rlhf_core.training.forward import actor_forward, critic_forward

@dataclass
class MicroForward:
    """One micro-batch through a role's model: what its objective and its total read."""

    out: torch.Tensor
    """(B, T): the actor's log-probs of the response tokens, or the critic's value predictions."""
    entropy: Optional[torch.Tensor]
    """(B, T): the actor's entropy per token (None for the critic)."""
    tensors: dict[str, torch.Tensor]
    """The micro-batch's table tensors (old_log_probs, advantages, values, returns, ...) on the model's device."""
    mask: torch.Tensor
    """(B, T) bool: the response tokens."""


class MicroLoss(Protocol):
    """A role's loss on one micro-batch in the three parts ``train_step`` calls in turn: the model's
    ``forward``, the registered ``objective`` (the function and its inputs: the step calls it, so
    the math sits one frame below the step) and the ``total`` with its per-micro-batch statistics.
    ``n_tok`` / ``n_seq``: the mini-batch's global token and sequence counts (the aggregation's)."""

    def forward(self, engine, mb: MicroBatch) -> MicroForward: ...

    def objective(self, fwd: MicroForward, n_tok: int, n_seq: int) -> tuple[Callable[..., Any], dict[str, Any]]: ...

    def total(self, loss: torch.Tensor, parts: dict[str, torch.Tensor], fwd: MicroForward, n_tok: int,
              n_seq: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...

    def step_metrics(self) -> dict[str, float]: ...


def _on_device(engine_out: torch.Tensor, mb: MicroBatch) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    return {k: v.to(engine_out.device) for k, v in mb.tensors.items()}, mb.response_mask.to(engine_out.device)

PEAKS = ("actor/old_log_prob_diff_max",)
"""Per-micro-batch statistics a step reduces by their maximum (every other one is a share, summed)."""
FIRST_STEP_ONLY = ("actor/old_log_prob_diff_mean", "actor/old_log_prob_diff_max")
"""|log pi - old_log_probs| over the response tokens of a role's first mini-batch, before its first optimizer
step: the trainer's log-probs at the very weights the old log-probs stand for, so this is how far the old
log-probs the update trains against are from its own arithmetic (recomputed by the score stage, or the
rollout's own: actor_rollout_ref.rollout.old_log_probs). Later steps' weights have moved: not reported."""


@dataclass(frozen=True)
class ActorLoss:
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    loss_mode: str = "vanilla"
    """The POLICY_LOSSES registry name (actor.policy_loss.loss_mode)."""
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    temperature: float = 1.0
    """The rollout temperature: old log-probs were computed at it, so the ratio must be too."""
    loss_scale_factor: Optional[float] = None
    """seq-mean-token-sum-norm's constant divisor (``config.resolve.loss_scale_factor``)."""
    loss_mode_settings: tuple[tuple[str, object], ...] = ()
    """Per-mode knobs (actor.policy_loss's clip_cov_ratio, kl_cov_ratio, dro_beta, ..., actor.tau_pos /
    tau_neg), each offered to the loss function, which takes those it names."""
    rollout_correction: Optional[RolloutCorrection] = None
    """algorithm.rollout_correction, which bypass_mode's loss applies inside the loss."""

    @property
    def policy_fn(self) -> Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        """The registered policy loss of ``loss_mode`` (algos/losses.py, algos/loss_modes.py)."""
        return get_policy_loss_fn(self.loss_mode)

    def policy_inputs(self, *, log_prob: torch.Tensor, tensors: dict[str, torch.Tensor], mask: torch.Tensor,
                      n_tok: int, n_seq: int) -> dict[str, object]:
        """The keyword arguments of ``policy_fn`` on one micro-batch: it is offered every input and knob
        (and takes those it names): the mini-batch's global counts, the rollout-correction weights when
        the table has them."""
        offered = dict(old_log_prob=tensors["old_log_probs"], log_prob=log_prob, advantages=tensors["advantages"],
                       response_mask=mask, clip_ratio_low=self.clip_ratio_low, clip_ratio_high=self.clip_ratio_high,
                       clip_ratio_c=self.clip_ratio_c, rollout_is_weights=tensors.get("rollout_is_weights"),
                       rollout_correction=self.rollout_correction, **self._counts(n_tok, n_seq),
                       **dict(self.loss_mode_settings))
        return accepted_kwargs(self.policy_fn, offered)

    def policy_loss(self, *, log_prob: torch.Tensor, tensors: dict[str, torch.Tensor], mask: torch.Tensor,
                    n_tok: int, n_seq: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The policy loss alone on one micro-batch (what ``total`` adds the entropy and KL terms to)."""
        return self.policy_fn(**self.policy_inputs(log_prob=log_prob, tensors=tensors, mask=mask, n_tok=n_tok,
                                                   n_seq=n_seq))

    def _counts(self, n_tok: int, n_seq: int) -> dict:
        return dict(loss_agg_mode=self.loss_agg_mode, global_num_tokens=n_tok, global_num_seqs=n_seq,
                    loss_scale_factor=self.loss_scale_factor)

    def forward(self, engine, mb: MicroBatch) -> MicroForward:
        log_prob, entropy = actor_forward(engine, mb, self.temperature, entropy_grad=self.entropy_coeff != 0)
        return MicroForward(log_prob, entropy, *_on_device(log_prob, mb))

    def objective(self, fwd: MicroForward, n_tok: int, n_seq: int) -> tuple[Callable[..., Any], dict[str, Any]]:
        return self.policy_fn, self.policy_inputs(log_prob=fwd.out, tensors=fwd.tensors, mask=fwd.mask, n_tok=n_tok,
                                                  n_seq=n_seq)

    def total(self, pg_loss: torch.Tensor, pg: dict[str, torch.Tensor], fwd: MicroForward, n_tok: int,
              n_seq: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """policy loss − entropy_coeff · entropy + kl_loss_coef · KL(actor‖ref), and the micro-batch's
        statistics as its share of the mini-batch's."""
        log_prob, t, mask = fwd.out, fwd.tensors, fwd.mask
        counts = self._counts(n_tok, n_seq)
        ent_loss = agg_loss(loss_mat=fwd.entropy, loss_mask=mask, **counts)
        loss, kl_loss = pg_loss, torch.zeros((), device=log_prob.device)
        if self.entropy_coeff != 0:
            loss = loss - self.entropy_coeff * ent_loss
        if self.use_kl_loss:
            kl = kl_penalty(logprob=log_prob, ref_logprob=t["ref_log_probs"], kind=self.kl_loss_type)
            kl_loss = agg_loss(loss_mat=kl, loss_mask=mask, **counts)
            loss = loss + self.kl_loss_coef * kl_loss
        share = mask.sum() / max(n_tok, 1)  # token means of this micro-batch → its share of the mini-batch's
        gap = torch.where(mask, (log_prob.detach().float() - t["old_log_probs"].float()).abs(), 0.0)
        sums = {"actor/pg_loss": pg_loss, "actor/kl_loss": kl_loss, "actor/entropy": ent_loss,
                "actor/old_log_prob_diff_mean": gap.sum() / max(n_tok, 1),
                "actor/old_log_prob_diff_max": gap.max() if gap.numel() else gap.sum()}
        for k, v in pg.items():  # pg_clipfrac, pg_clipfrac_lower, ppo_kl; bypass_mode's rollout_corr/...
            sums[k if "/" in k else f"actor/{k}"] = v * share
        return loss, {k: v.detach().float() for k, v in sums.items()}

    def step_metrics(self) -> dict[str, float]:
        """Per-step constants verl logs beside the losses."""
        return {"actor/kl_coef": self.kl_loss_coef} if self.use_kl_loss else {}


@dataclass(frozen=True)
class CriticLoss:
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: Optional[float] = None
    """seq-mean-token-sum-norm's constant divisor (``config.resolve.critic_loss_scale_factor``)."""

    def value_inputs(self, *, vpreds: torch.Tensor, tensors: dict[str, torch.Tensor], mask: torch.Tensor,
                     n_tok: int, n_seq: int) -> dict[str, Any]:
        """The keyword arguments of ``compute_value_loss`` on one micro-batch, with the mini-batch's global counts."""
        return dict(vpreds=vpreds, values=tensors["values"], returns=tensors["returns"], response_mask=mask,
                    cliprange_value=self.cliprange_value, loss_agg_mode=self.loss_agg_mode, global_num_tokens=n_tok,
                    global_num_seqs=n_seq, loss_scale_factor=self.loss_scale_factor)

    def value_loss(self, *, vpreds: torch.Tensor, tensors: dict[str, torch.Tensor], mask: torch.Tensor,
                   n_tok: int, n_seq: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The clipped value loss on one micro-batch with the mini-batch's global counts."""
        return compute_value_loss(**self.value_inputs(vpreds=vpreds, tensors=tensors, mask=mask, n_tok=n_tok,
                                                      n_seq=n_seq))

    def forward(self, engine, mb: MicroBatch) -> MicroForward:
        vpreds = critic_forward(engine, mb)
        return MicroForward(vpreds, None, *_on_device(vpreds, mb))

    def objective(self, fwd: MicroForward, n_tok: int, n_seq: int) -> tuple[Callable[..., Any], dict[str, Any]]:
        return compute_value_loss, self.value_inputs(vpreds=fwd.out, tensors=fwd.tensors, mask=fwd.mask, n_tok=n_tok,
                                                     n_seq=n_seq)

    def total(self, vf_loss: torch.Tensor, m: dict[str, torch.Tensor], fwd: MicroForward, n_tok: int,
              n_seq: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The value loss itself, and the micro-batch's statistics as its share of the mini-batch's."""
        share = fwd.mask.sum() / max(n_tok, 1)
        sums = {"critic/vf_loss": vf_loss, "critic/vf_clipfrac": m["vf_clipfrac"] * share,
                "critic/vpred_mean": torch.where(fwd.mask, fwd.out, 0.0).sum() / max(n_tok, 1)}
        return vf_loss, {k: v.detach().float() for k, v in sums.items()}

    def step_metrics(self) -> dict[str, float]:
        return {}


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
    mode = packing_attention_mode(te.engine)  # varlen for a flash-attention model: never a 4-D mask
    sums: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), dtype=torch.float64))
    peaks: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), dtype=torch.float64))
    tokens = 0
    for j, layout in enumerate(layouts):
        mb = build_micro_batch(data, layout, pad_id, filler_row=rows[0], mode=mode)
        te.engine.set_gradient_accumulation_boundary(j == len(layouts) - 1)
        fwd = loss_fn.forward(te.engine, mb)
        objective, inputs = loss_fn.objective(fwd, n_tok, n_seq)
        loss, stats = loss_fn.total(*objective(**inputs), fwd, n_tok, n_seq)  # the registered loss, called here
        del fwd, inputs  # the forward's outputs are not needed through the backward: freed before it, not after
        # DeepSpeed averages over ranks; the shares were computed for a sum over ranks
        te.backward(loss * (mb.weight * dist.world_size))
        for k, v in stats.items():
            if k in PEAKS:
                peaks[k] = torch.maximum(peaks[k], v.cpu().double() * mb.weight)
            else:
                sums[k] += v.cpu().double() * mb.weight
        tokens += mb.num_tokens if mb.weight else 0
    if on_gradients is not None:
        on_gradients(te)
    outcome = optimizer_step(te)
    keys = sorted(sums)
    reduced = all_reduce(torch.stack([sums[k] for k in keys])) if keys else torch.zeros(0)
    metrics = {k: float(v) for k, v in zip(keys, reduced)}
    top = sorted(peaks)
    if top:
        metrics.update(zip(top, map(float, all_reduce(torch.stack([peaks[k] for k in top]), op="max"))))
    metrics.update(loss_fn.step_metrics())
    metrics.update({f"{te.role}/grad_norm": outcome.grad_norm, f"{te.role}/lr": outcome.lr,
                    f"{te.role}/step_applied": float(outcome.applied), f"{te.role}/micro_batches": len(layouts)})
    return StepResult(metrics=metrics, tokens=tokens)


@dataclass(frozen=True)
class RoleSettings:
    """How one role trains in an iteration (its own budgets, as verl's critic.* keys allow)."""

    loss_fn: MicroLoss
    epochs: int
    plan: MicroBatchPlan
    mini_batch_size: int
    """Sequences per optimizer step, all ranks together: ppo_mini_batch_size × rollout.n."""
    shuffle: bool


@dataclass
class RoleSchedule:
    """One role's engine and how it trains this iteration."""

    te: TrainEngine
    how: RoleSettings


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

    def add(self, roles: "PPOOutcome") -> None:
        """Take in the per-role records of a loop that trained other roles (a thread's)."""
        self.steps.update(roles.steps)
        self.tokens.update(roles.tokens)
        self.seconds.update(roles.seconds)


def run_ppo(roles: list[RoleSchedule], data: PPOData, *, seed: str, dist: DistInfo, pad_id: int,
            progress: Optional[bool] = None, concurrent: bool = False, bar=None) -> PPOOutcome:
    """Train each role (critic, then actor, or both at once) for its epochs over ``data``, then one step
    of its LR schedule; every rank returns the same (all-reduced) metrics. The mini-batch order
    depends only on ``seed`` and the epoch.

    ``concurrent``: train the roles at the same time, one thread each, each thread running this loop
    for its one role (``bar``: the progress bar they share). The critic's and the actor's updates read
    the same fixed advantages table and share nothing else, so each ends with exactly the weights and
    metrics it would have alone; with one intra-op thread per role this keeps two cores busy where a
    small model's matmuls cannot. Only for one process (``concurrent_roles``): with several ranks, two
    threads' collectives could interleave differently on each rank.
    """
    if concurrent and dist.world_size > 1:
        raise ValueError("concurrent roles need a single process: collectives from two threads could "
                         "pair up differently on each rank")
    outcome = PPOOutcome()
    started = time.perf_counter()
    with (_progress_bar(roles, data, dist, progress) if bar is None else contextlib.nullcontext(bar)) as bar:
        if concurrent and len(roles) > 1:
            with ThreadPoolExecutor(max_workers=len(roles), thread_name_prefix="ppo-role") as pool:
                futures = [pool.submit(run_ppo, [role], data, seed=seed, dist=dist, pad_id=pad_id, bar=bar)
                           for role in roles]
                for future in futures:
                    outcome.add(future.result())  # re-raises a role's exception here
        else:
            for role in roles:
                name, how, role_started = role.te.role, role.how, time.perf_counter()
                steps, outcome.tokens[name] = outcome.steps.setdefault(name, []), 0
                order = data.grouped_order()
                for epoch in range(how.epochs):
                    for rows in mini_batches(order, how.mini_batch_size, shuffle=how.shuffle, seed=seed, epoch=epoch):
                        result = train_step(role.te, data, rows, how.plan, how.loss_fn, dist, pad_id)
                        reported = {k: v for k, v in result.metrics.items() if not steps or k not in FIRST_STEP_ONLY}
                        steps.append({"epoch": epoch, "step": len(steps), **reported})
                        # kill tests: weights moved, nothing saved
                        fault_point(f"update:after_step:{name}:{len(steps)}")
                        outcome.tokens[name] += result.tokens
                        bar.update(1)
                role.te.finish_training_step()  # one step of the role's LR schedule
                outcome.seconds[name] = time.perf_counter() - role_started
    outcome.wall_seconds = time.perf_counter() - started
    return outcome


def _progress_bar(roles: list[RoleSchedule], data: PPOData, dist: DistInfo, progress: Optional[bool]):
    total = sum(r.how.epochs * math.ceil(len(data) / r.how.mini_batch_size) for r in roles)
    return tqdm(total=total, desc="ppo update", unit="step", leave=False,
                disable=bar_disabled(progress) or not dist.is_main)


SUMMED_OVER_STEPS = ("actor/pg_loss", "actor/kl_loss", "critic/vf_loss")
"""verl's dp_actor / dp_critic add every optimizer step's loss into one number per update (since
verl #4711), so with several mini-batches or epochs these are sums over the steps; every other
per-step metric is averaged (verl averages the values it appends per micro-batch or step)."""


def aggregate(outcome: PPOOutcome) -> dict[str, float]:
    """Per-iteration metrics: ``SUMMED_OVER_STEPS`` summed over the role's steps, every other per-step
    metric averaged (grad norms over applied steps only: a skipped step's norm is inf/nan and is
    counted in ``<role>/skipped_steps`` instead), step counts, and throughput.

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
        keys = {k for s in steps for k in s
                if (k.startswith(role + "/") or k.startswith("rollout_corr/")) and k != f"{role}/step_applied"}
        for k in sorted(keys):
            pool = applied if k.endswith("/grad_norm") else steps
            values = [s[k] for s in pool if k in s and math.isfinite(s[k])]
            if values:
                out[k] = sum(values) if k in SUMMED_OVER_STEPS else sum(values) / len(values)
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
