"""Packed scoring passes agree with plain one-sequence-at-a-time forwards (log-probs and values)."""

from __future__ import annotations

import random

import pytest
import torch

from rlhf_core.config.resolve import MicroBatching
from rlhf_core.data.packing import PackingBudgetError
from rlhf_core.scoring import (
    Throughput,
    compute_token_logprobs,
    compute_token_values,
    load_causal_lm,
    load_critic,
    plan_micro_batches,
    same_weights,
    weights_fingerprint,
)
from rlhf_core.run.session import RunSession

DISK = RunSession()  # nothing held in memory: every model is read from its directory

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def actor(tiny_model_dir):
    return load_causal_lm(tiny_model_dir, CPU, torch.float32, session=DISK)


@pytest.fixture(scope="module")
def critic(tiny_model_dir):
    torch.manual_seed(3)
    return load_critic(tiny_model_dir, CPU, torch.float32, session=DISK)  # fresh value head on the tiny backbone


@pytest.fixture(scope="module")
def batch(actor):
    """12 sequences of mixed prompt/response lengths (seeded), token ids within the vocabulary."""
    rng = random.Random(0)
    vocab = actor.config.vocab_size
    seqs, prompts = [], []
    for _ in range(12):
        p, r = rng.randint(3, 40), rng.randint(1, 30)
        seqs.append([rng.randrange(3, vocab) for _ in range(p + r)])
        prompts.append(p)
    return seqs, prompts


def unpacked_logprobs(model, seq, p, temperature):
    """The plain reference: one sequence, no padding, full log-softmax."""
    ids = torch.tensor([seq])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float() / temperature  # (L, V)
    logp = torch.log_softmax(logits[p - 1:-1], dim=-1)  # positions predicting the response
    return logp.gather(-1, ids[0, p:, None]).squeeze(-1)


def unpacked_values(critic, seq, p):
    with torch.no_grad():
        values = critic(input_ids=torch.tensor([seq])).logits[0, :, 0]  # (L,)
    return values[p - 1:-1]


@pytest.mark.parametrize("budget,row_tokens", [(80, 80), (200, 64), (4096, 1024)])
def test_packed_logprobs_match_unpacked(actor, batch, budget, row_tokens):
    seqs, prompts = batch
    got = compute_token_logprobs(actor, seqs, prompts, budget, temperature=0.7, row_tokens=row_tokens,
                                 progress=False)
    for seq, p, lp in zip(seqs, prompts, got):
        assert lp.shape == (len(seq) - p,)
        torch.testing.assert_close(lp, unpacked_logprobs(actor, seq, p, 0.7), atol=1e-5, rtol=0)


@pytest.mark.parametrize("budget", [80, 4096])
def test_packed_values_match_unpacked(critic, batch, budget):
    seqs, prompts = batch
    got = compute_token_values(critic, seqs, prompts, budget, row_tokens=64, progress=False)
    for seq, p, v in zip(seqs, prompts, got):
        assert v.shape == (len(seq) - p,)
        torch.testing.assert_close(v, unpacked_values(critic, seq, p), atol=1e-5, rtol=0)


def test_temperature_is_applied(actor, batch):
    seqs, prompts = batch
    at_one = compute_token_logprobs(actor, seqs, prompts, 4096, temperature=1.0, progress=False)
    at_half = compute_token_logprobs(actor, seqs, prompts, 4096, temperature=0.5, progress=False)
    assert not torch.allclose(torch.cat(at_one), torch.cat(at_half))
    torch.testing.assert_close(at_half[0], unpacked_logprobs(actor, seqs[0], prompts[0], 0.5), atol=1e-5, rtol=0)


def test_micro_batches_respect_budget_and_cover_every_sequence(batch):
    seqs, _ = batch
    lengths = [len(s) for s in seqs]
    plan = plan_micro_batches(lengths, budget=100, row_tokens=50)
    seen = sorted(i for mb in plan for row in mb for i in row)
    assert seen == list(range(len(seqs)))
    for mb in plan:
        assert sum(lengths[i] for row in mb for i in row) <= 100
        for row in mb:  # a row is at most row_tokens wide unless one sequence alone is longer
            assert len(row) == 1 or sum(lengths[i] for i in row) <= max(50, max(lengths))


FIXED_5 = MicroBatching(use_dynamic_bsz=False, token_budget=10, micro_batch_size=5)


def test_without_dynamic_batching_forwards_take_micro_batch_size_sequences_in_order(batch):
    lengths = [len(s) for s in batch[0]]
    padded = plan_micro_batches(lengths, FIXED_5, packed=False)
    assert padded == [[[0], [1], [2], [3], [4]], [[5], [6], [7], [8], [9]], [[10], [11]]]
    packed = plan_micro_batches(lengths, FIXED_5, row_tokens=50)
    assert [sorted(i for row in mb for i in row) for mb in packed] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11]]
    assert any(len(row) > 1 for mb in packed for row in mb)  # the token budget plays no part: 10 < every length
    dynamic = MicroBatching(use_dynamic_bsz=True, token_budget=100, micro_batch_size=5)
    assert plan_micro_batches(lengths, dynamic, row_tokens=50) == plan_micro_batches(lengths, 100, row_tokens=50)


@pytest.mark.parametrize("batching,packed", [(FIXED_5, True), (FIXED_5, False),
                                             (MicroBatching(True, 120, 1), False)])
def test_every_layout_gives_the_unpacked_numbers(actor, critic, batch, batching, packed):
    seqs, prompts = batch
    meter = Throughput()
    lps = compute_token_logprobs(actor, seqs, prompts, batching, temperature=0.7, packed=packed, throughput=meter,
                                 progress=False)
    values = compute_token_values(critic, seqs, prompts, batching, packed=packed, progress=False)
    for seq, p, lp, v in zip(seqs, prompts, lps, values):
        torch.testing.assert_close(lp, unpacked_logprobs(actor, seq, p, 0.7), atol=1e-5, rtol=0)
        torch.testing.assert_close(v, unpacked_values(critic, seq, p), atol=1e-5, rtol=0)
    if not batching.use_dynamic_bsz:
        assert meter.passes["log-probs"] == 3  # 12 sequences, 5 per forward


def test_a_sequence_over_the_budget_names_the_roles_key(actor):
    with pytest.raises(PackingBudgetError, match="actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"):
        compute_token_logprobs(actor, [[5, 6, 7, 8]], [2], MicroBatching(True, 3, 1),
                               budget_key="actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", progress=False)


def test_throughput_counts_every_token(actor, batch):
    seqs, prompts = batch
    meter = Throughput()
    compute_token_logprobs(actor, seqs, prompts, 200, throughput=meter, progress=False)
    assert meter.tokens == sum(len(s) for s in seqs) and meter.seconds > 0 and meter.passes["log-probs"] >= 2


def test_bad_prompt_length_is_rejected(actor):
    with pytest.raises(ValueError, match="prompt length"):
        compute_token_logprobs(actor, [[5, 6, 7]], [4], 100, progress=False)


def test_same_weights_compares_content_not_names(tiny_model_dir, tmp_path, actor):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy)
    assert same_weights(tiny_model_dir, copy)
    changed = tmp_path / "changed"
    with torch.no_grad():
        actor.lm_head.weight[0, 0] += 1.0  # tied embeddings: one weight changed
    try:
        actor.save_pretrained(changed)
    finally:
        with torch.no_grad():
            actor.lm_head.weight[0, 0] -= 1.0
    assert not same_weights(tiny_model_dir, changed)
    assert weights_fingerprint(tmp_path) is None  # no weights there: nothing can be proven equal
    assert not same_weights(tmp_path, tmp_path)
    last_byte = tmp_path / "last_byte"  # a difference past the first chunk read is still found
    shutil.copytree(tiny_model_dir, last_byte)
    weights = last_byte / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert not same_weights(copy, last_byte) and same_weights(copy, copy)
    config = tmp_path / "config_only"
    shutil.copytree(tiny_model_dir, config)
    (config / "config.json").write_text((config / "config.json").read_text() + " ")
    assert not same_weights(copy, config)
