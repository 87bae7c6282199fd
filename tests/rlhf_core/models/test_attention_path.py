"""One attention path: score, update and KL guard compute the same log-probs for the same data.

For every attention implementation this machine can load, the old log-probs (score stage), the
update's first-step log-probs (the trainable actor, its own micro-batch planner) and the guard's
sampled-token log-probs must be bit-identical, so the PPO ratio is exactly 1 at the first step. A
model loaded with another implementation than scoring's must show up as a difference (the check can
fail), and a flash-attention model is never handed a 4-D mask.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlhf_core.models.attention import resolve_attention
from rlhf_core.models.packed import pack_rows, packed_forward, packing_attention_mode
from rlhf_core.scoring.logprobs import compute_token_logprobs
from rlhf_core.scoring.models import load_causal_lm
from rlhf_core.scoring.policy_kl import token_kl
from rlhf_core.training.batch import PER_TOKEN_COLUMNS, MicroBatchPlan, PPOData, build_micro_batch, split_mini_batch
from rlhf_core.training.engines import load_actor_model
from rlhf_core.training.forward import actor_forward
from rlhf_core.run.session import RunSession

DISK = RunSession()  # nothing held in memory: every model is read from its directory

CPU = torch.device("cpu")
BUDGET = 160  # tokens per micro-batch: several micro-batches, several sequences per row


def _batch(seed: int = 0, n: int = 12) -> tuple[list[list[int]], list[int]]:
    """n sequences of mixed prompt and response lengths (token ids of the tiny model's vocabulary)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(5, 500, rng.integers(4, 20)).tolist() for _ in range(n)]
    responses = [rng.integers(5, 500, rng.integers(1, 24)).tolist() for _ in range(n)]
    return [p + r for p, r in zip(prompts, responses)], [len(p) for p in prompts]


def _update_logprobs(model, sequences, prompt_lengths) -> list[torch.Tensor]:
    """Log-probs as the update's first step computes them: the update's planner and micro-batches,
    the layout of the model's attention implementation, the trainable model in train mode."""
    data = PPOData(prompt_ids=[s[:p] for s, p in zip(sequences, prompt_lengths)],
                   response_ids=[s[p:] for s, p in zip(sequences, prompt_lengths)],
                   per_token={c: [np.zeros(len(s) - p, np.float32) for s, p in zip(sequences, prompt_lengths)]
                              for c in PER_TOKEN_COLUMNS})
    plan = MicroBatchPlan(use_dynamic_bsz=True, token_budget=BUDGET, micro_batch_size=0, pack_rows=True)
    out: list = [None] * len(sequences)
    with torch.no_grad():
        for layout in split_mini_batch(data.lengths, list(range(len(data))), plan):
            mb = build_micro_batch(data, layout, 0, mode=packing_attention_mode(model))
            log_prob, _ = actor_forward(model, mb, entropy=False)
            for b, i in enumerate(mb.order):
                out[i] = log_prob[b, :len(data.response_ids[i])]
    return out


@pytest.mark.parametrize("implementation", ["sdpa", "eager", "sdpa_varlen"])
def test_score_update_and_guard_agree_bit_for_bit(tiny_model_dir, implementation):
    sequences, prompt_lengths = _batch()
    scorer = load_causal_lm(tiny_model_dir, CPU, torch.float32, attention=implementation, session=DISK)
    old = compute_token_logprobs(scorer, sequences, prompt_lengths, BUDGET)
    _, guard = token_kl(scorer, scorer, sequences, prompt_lengths, budget=BUDGET, temperature=1.0)
    trainee = load_actor_model(tiny_model_dir, torch.float32, attention=resolve_attention(implementation, CPU))
    assert trainee.training and trainee.config._attn_implementation == implementation
    new = _update_logprobs(trainee, sequences, prompt_lengths)
    for i in range(len(sequences)):
        assert torch.equal(new[i], old[i]), f"sequence {i}: update and score log-probs differ"
        assert torch.equal(torch.exp(new[i] - old[i]), torch.ones_like(old[i]))  # the first step's ratio
        assert torch.equal(guard[i], old[i]), f"sequence {i}: guard and score log-probs differ"


def test_another_kernel_in_the_update_shows(tiny_model_dir):
    """The check above can fail: the update on eager against scores from sdpa_varlen differs."""
    sequences, prompt_lengths = _batch(seed=1)
    scorer = load_causal_lm(tiny_model_dir, CPU, torch.float32, attention="sdpa_varlen", session=DISK)
    old = compute_token_logprobs(scorer, sequences, prompt_lengths, BUDGET)
    new = _update_logprobs(load_actor_model(tiny_model_dir, torch.float32, attention="eager"), sequences, prompt_lengths)
    assert any(not torch.equal(a, b) for a, b in zip(new, old))
    assert max(float((a - b).abs().max()) for a, b in zip(new, old)) < 1e-4  # the same model, another kernel


def test_varlen_kernels_get_one_flat_row_and_no_mask(tiny_model_dir):
    sequences, _ = _batch(n=4)
    model = load_causal_lm(tiny_model_dir, CPU, torch.float32, attention="sdpa_varlen", session=DISK)
    assert packing_attention_mode(model) == "varlen"
    packed = pack_rows([[0, 1], [2, 3]], sequences, 0, mode=packing_attention_mode(model))
    assert packed.attention_mask is None and packed.input_ids.shape == (1, sum(map(len, sequences)))
    alone = [load_causal_lm(tiny_model_dir, CPU, torch.float32, attention="sdpa", session=DISK)(input_ids=torch.tensor([s])).logits[0]
             for s in sequences]
    logits = packed_forward(model, packed)[0]
    for i, start, end in packed.spans[0]:
        torch.testing.assert_close(logits[start:end], alone[i], rtol=0, atol=1e-5)


def test_a_flash_model_refuses_a_4d_mask(tiny_model_dir):
    model = load_causal_lm(tiny_model_dir, CPU, torch.float32, attention="sdpa", session=DISK)
    model.config._attn_implementation = "flash_attention_2"  # what packing decides from; no forward runs
    assert packing_attention_mode(model) == "varlen"
    with pytest.raises(ValueError, match="4-D mask"):
        packed_forward(model, pack_rows([[0, 1]], [[1, 2, 3], [4, 5]], 0, mode="mask4d"))


def test_flash_needs_cuda_and_its_package():
    from rlhf_core.errors import RLHFError

    assert resolve_attention("auto", CPU) == "sdpa"
    with pytest.raises(RLHFError, match="needs a CUDA device.*use auto or sdpa"):
        resolve_attention("flash_attention_2", CPU)
    with pytest.raises(RLHFError, match="unknown attention implementation"):
        resolve_attention("flash", CPU)
