"""KL(actor ‖ reference) over the whole vocabulary at every response position: what the KL guard
measures (on the iteration's responses and, optionally, on fresh validation samples)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from rlhf_core.algos.logits import logprobs_from_logits
from rlhf_core.config.resolve import MicroBatching
from rlhf_core.errors import RLHFError
from rlhf_core.io.timing import MODEL_LOAD, timed
from rlhf_core.models.packed import (
    head_logits, output_head, pack_rows, packing_attention_mode, response_hidden, response_positions, scaled,
)
from rlhf_core.data.packing import Share
from rlhf_core.scoring.logprobs import compute_token_logprobs, own_micro_batches, plan_micro_batches
from rlhf_core.scoring.held import HeldModels
from rlhf_core.scoring.models import (
    is_lora_dir, load_causal_lm, load_merged_actor, reference_policy,
)


@dataclass(frozen=True)
class KLPassSettings:
    """What a pass of the actor (and the reference) over responses reads: the KL guard's and
    validation's. Built once from the config by the stage (``stages.settings.kl_pass``)."""

    device: torch.device
    """The scoring device (trainer.device)."""
    dtype: torch.dtype
    """The dtype the update trains in (actor.deepspeed_config.dtype on that device)."""
    attention: str
    """model.override_config.attn_implementation: the update's and scoring's."""
    temperature: float
    """rollout.temperature: the log-probs are those of the distribution the rollout sampled from."""
    ref_budget: int
    """Real tokens per packed micro-batch of the actor-vs-reference pass: the reference role's
    (verl's ref.log_prob_max_token_len_per_gpu, which falls back to the actor's)."""
    ref_offload: bool
    """The reference's weights wait in host memory between passes (ref.fsdp_config.param_offload)."""
    actor_batching: MicroBatching
    """How the actor-only pass is cut (the rollout role's log-prob budgets)."""
    packed: bool
    """model.use_remove_padding: the actor-only pass packs its rows."""


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


def importance_weighted_kl(new: list, old: list, ref: list) -> list:
    """One-sample estimate of the exact per-position KL(new ‖ ref) from tokens the old policy sampled:

        kl_t ≈ ρ_t · ((r_t − 1) − log r_t),   ρ_t = p_new(y_t)/p_old(y_t),   r_t = p_ref(y_t)/p_new(y_t)

    Over y_t ~ p_old its mean is Σ_v p_new(v) · ((p_ref(v)/p_new(v) − 1) − log(p_ref(v)/p_new(v))) =
    Σ_v p_new(v) log(p_new(v)/p_ref(v)), the quantity ``token_kl`` sums exactly; every term is >= 0
    (Schulman's k3, importance-weighted to the new policy). Inputs: per-sequence (n_i,) log-probs of
    the sampled tokens; returns per-sequence (n_i,) float64 tensors.
    """
    out = []
    for lp_new, lp_old, lp_ref in zip(new, old, ref):
        lp_new, lp_old, lp_ref = (torch.as_tensor(x, dtype=torch.float64) for x in (lp_new, lp_old, lp_ref))
        log_r = lp_ref - lp_new
        out.append(torch.exp(lp_new - lp_old) * (torch.expm1(log_r) - log_r))
    return out


def token_kl(actor, ref, sequences: list[list[int]], prompt_lengths: list[int], *, budget: int,
             temperature: float, pad_id: int = 0, share: Optional[Share] = None,
             ref_head_inputs: Optional[list] = None) -> tuple[list, list]:
    """Exact KL(actor ‖ ref) at every response position, summed over the whole vocabulary:

        kl_t = Σ_v p_a(v | s_<t) · (log p_a(v | s_<t) − log p_ref(v | s_<t)),   p = softmax(logits / T)

    Returns (per-sequence (n_i,) KL tensors, per-sequence (n_i,) actor log-probs of the sampled
    tokens). Unlike the one-sample estimate log p_a(y_t) − log p_ref(y_t), this is exact for each
    visited context and never negative, so it measures the new policy's drift even though the
    responses were sampled from the previous policy. Both models see the same packed micro-batches
    (block-diagonal mask), one no-grad forward each. ``share`` = (rank, world): only that process's
    micro-batches of the one-process plan (``own_micro_batches``); the other sequences stay None.
    ``ref_head_inputs``: per sequence the reference's (n_i, H) last hidden states at its response positions,
    kept from the score stage's pass (``scoring.ref_states``): the reference then runs its LM head on
    them instead of its whole forward — the same logits, the same KL.
    """
    kls: list = [None] * len(sequences)
    sampled: list = [None] * len(sequences)
    mode = packing_attention_mode(actor)
    if packing_attention_mode(ref) != mode:
        raise RLHFError(f"the actor packs as {mode!r} but the reference as {packing_attention_mode(ref)!r}: load "
                        "both with one actor_rollout_ref.model.override_config.attn_implementation")
    with torch.no_grad():
        lengths = [len(s) for s in sequences]
        plan = plan_micro_batches(lengths, budget)
        for micro in (plan if share is None else own_micro_batches(plan, lengths, *share)):
            packed = pack_rows(micro, sequences, pad_id, mode=mode)
            rows, cols, owners = response_positions(packed, prompt_lengths)
            if not owners:
                continue
            # the LM heads run on the response positions only, in row blocks: (rows_b, V) each at a time
            actor_hidden, actor_head = response_hidden(actor, packed, (rows, cols))
            ref_hidden, ref_head = _reference_hidden(ref, packed, (rows, cols), owners, ref_head_inputs)
            labels = packed.input_ids[rows, cols + 1].to(actor_hidden.device)
            kl, picked, start = [], [], 0
            for a_block, r_block in zip(head_logits(actor_head, actor_hidden), head_logits(ref_head, ref_hidden)):
                end = start + a_block.shape[0]
                block_kl, block_picked = _block_kl(scaled(a_block, temperature), scaled(r_block, temperature),
                                                   labels[start:end])
                kl.append(block_kl)
                picked.append(block_picked)
                start = end
                del a_block, r_block
            kl, picked = torch.cat(kl).cpu(), torch.cat(picked).cpu()
            offset = 0
            for i, n in owners:
                kls[i], sampled[i] = kl[offset:offset + n], picked[offset:offset + n]
                offset += n
    return kls, sampled


def _block_kl(actor_logits: torch.Tensor, ref_logits: torch.Tensor,
              labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact KL(actor ‖ ref) per row, the actor's log-prob of ``labels``) of (rows, V) fp32 logits
    already divided by the temperature."""
    la = torch.log_softmax(actor_logits, dim=-1)
    lr = torch.log_softmax(ref_logits, dim=-1)
    diff = lr.neg_().add_(la)  # la - lr, in lr's memory (the same floats: a - b is a + (-b))
    kl = (la.exp_() * diff).sum(-1).clamp_min(0.0)  # clamp: rounding only
    del la, lr, diff
    # the sampled tokens' log-probs by the formula scoring and the update use, to the bit
    return kl, logprobs_from_logits(actor_logits, labels)


def _reference_hidden(ref, packed, positions, owners, head_inputs: Optional[list]
                      ) -> tuple[torch.Tensor, torch.nn.Module]:
    """(the reference's LM-head input at ``positions`` (N, H), its head): the kept hidden states when
    given, else its forward's."""
    if head_inputs is None:
        return response_hidden(ref, packed, positions)
    head = output_head(ref)
    return torch.cat([head_inputs[i] for i, _ in owners]).to(next(head.parameters()).device), head


def actor_ref_kl(settings: KLPassSettings, session: HeldModels, actor_dir: Path, ref_dir: Path,
                 sequences: list[list[int]], prompt_lengths: list[int], share: Optional[Share] = None
                 ) -> tuple[list, list]:
    """``token_kl`` of the actor in ``actor_dir`` against the reference policy in ``ref_dir``, packed
    like the scoring stage's reference forward; on the reference states the score stage kept for these
    very sequences when the session has them (``scoring.ref_states``)."""
    actor = load_actor_for_kl(session, actor_dir, settings.device, settings.dtype, settings.attention)
    pad_id = actor.config.pad_token_id if actor.config.pad_token_id is not None else 0
    kept = None if share is not None else session.ref_states.lookup(ref_dir, settings.dtype, settings.attention,
                                                                   sequences, prompt_lengths)
    with reference_policy(ref_dir, settings.device, settings.dtype, settings.attention, settings.ref_offload,
                          session=session) as ref:
        return token_kl(actor, ref, sequences, prompt_lengths, budget=settings.ref_budget,
                        temperature=settings.temperature, pad_id=pad_id, share=share, ref_head_inputs=kept)


def actor_sampled_log_probs(settings: KLPassSettings, session: HeldModels, actor_dir: Path,
                            sequences: list[list[int]], prompt_lengths: list[int]) -> list:
    """The actor in ``actor_dir``'s log-probs of the sampled response tokens: one no-grad forward."""
    actor = load_actor_for_kl(session, actor_dir, settings.device, settings.dtype, settings.attention)
    pad_id = actor.config.pad_token_id if actor.config.pad_token_id is not None else 0
    return compute_token_logprobs(actor, sequences, prompt_lengths, settings.actor_batching,
                                  temperature=settings.temperature, pad_id=pad_id, packed=settings.packed,
                                  budget_key="actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
                                  desc="guard: actor log-probs")


def load_actor_for_kl(session: HeldModels, actor_dir: Path, device, dtype, attention: str = "auto"):
    """The trained actor for KL measurement: shared from ``scoring.cache`` (the next rollout samples
    from it when committed), except a LoRA adapter, which ``load_merged_actor`` merges into its base."""
    if is_lora_dir(actor_dir):
        with timed(MODEL_LOAD):
            return load_merged_actor(actor_dir, device=device, dtype=dtype, attention=attention, session=session)
    return load_causal_lm(actor_dir, device, dtype, role="actor", session=session, shared=True, attention=attention)
