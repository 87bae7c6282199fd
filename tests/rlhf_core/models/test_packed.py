"""Packed forward passes give the same per-token log-probs and values as one sequence at a time."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from rlhf_core.data.packing import pack_bfd, split_into_rows
from rlhf_core.models.packed import (
    gather_response_logprobs,
    gather_response_values,
    pack_rows,
    packed_forward,
    packing_attention_mode,
)

TOL = 1e-5


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def critic(tiny_model_dir):
    from transformers import AutoModelForTokenClassification

    torch.manual_seed(0)  # the value head is freshly initialised
    return AutoModelForTokenClassification.from_pretrained(tiny_model_dir, num_labels=1,
                                                           attn_implementation="sdpa").eval()


def make_batch(seed: int, count: int = 9, vocab: int = 500):
    """Random (prompt + response) token sequences; response lengths include 1."""
    rng = random.Random(seed)
    prompts = [rng.randint(1, 24) for _ in range(count)]
    responses = [1, 1] + [rng.randint(1, 30) for _ in range(count - 2)]
    sequences = [[rng.randint(3, vocab - 1) for _ in range(p + r)] for p, r in zip(prompts, responses)]
    return sequences, prompts


def several_rows(sequences, row_tokens=64):
    """Rows from the packer, narrow enough that there are several, right-padded to the longest."""
    lengths = [len(s) for s in sequences]
    rows = split_into_rows(lengths, list(range(len(sequences))), row_tokens)
    assert len(rows) >= 2 and len({sum(lengths[i] for i in r) for r in rows}) >= 2
    return rows


@torch.no_grad()
def reference_logprobs(model, sequences, prompts, temperature=1.0):
    out = {}
    for i, (seq, p) in enumerate(zip(sequences, prompts)):
        ids = torch.tensor([seq])
        logits = model(input_ids=ids).logits[0].float() / temperature  # (n, V) alone, no mask needed
        logp = torch.log_softmax(logits[p - 1:-1], dim=-1)
        out[i] = logp.gather(-1, ids[0, p:, None]).squeeze(-1)
    return out


@torch.no_grad()
def reference_values(model, sequences, prompts):
    return {i: model(input_ids=torch.tensor([seq])).logits[0, p - 1:-1, 0]
            for i, (seq, p) in enumerate(zip(sequences, prompts))}


def max_error(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    for i in a:
        assert a[i].shape == b[i].shape, f"sequence {i}: {a[i].shape} vs {b[i].shape}"
    return max(float((a[i] - b[i]).abs().max()) for i in a)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_logprobs_match_one_at_a_time(policy, temperature):
    sequences, prompts = make_batch(seed=1)
    packed = pack_rows(several_rows(sequences), sequences, pad_id=0)
    assert packed.mode == "mask4d" and packing_attention_mode(policy) == "mask4d"
    with torch.no_grad():
        logits = packed_forward(policy, packed)
    got = gather_response_logprobs(logits, packed, prompts, temperature=temperature, chunk_tokens=7)
    want = reference_logprobs(policy, sequences, prompts, temperature)
    assert got[0].numel() == 1 and got[1].numel() == 1
    assert max_error(got, want) < TOL


@pytest.mark.parametrize("block_bytes", [None, 3 * 512 * 4])  # one head call; blocks of 3 rows
def test_response_logprobs_in_head_blocks_match_one_at_a_time(policy, monkeypatch, block_bytes):
    """Past HEAD_CHUNK_BYTES the LM head runs on row blocks of the response positions (a real
    vocabulary's (responses, V) logits never whole): the same log-probs; the head's inputs it hands
    back are the ones the head saw."""
    from rlhf_core.models import packed as packed_module

    if block_bytes is not None:
        monkeypatch.setattr(packed_module, "HEAD_CHUNK_BYTES", block_bytes)
    sequences, prompts = make_batch(seed=3)
    packed = pack_rows(several_rows(sequences), sequences, pad_id=0)
    seen, hidden = [], []
    hook = policy.get_output_embeddings().register_forward_hook(lambda _m, args, out: seen.append(out.shape[0]))
    try:
        with torch.no_grad():
            got = packed_module.response_logprobs(policy, packed, prompts, temperature=0.7, hidden_out=hidden)
    finally:
        hook.remove()
    assert max_error(got, reference_logprobs(policy, sequences, prompts, 0.7)) < TOL
    responses = sum(len(s) - p for s, p in zip(sequences, prompts))
    rows = [n for n in seen if n]  # the model's own head call runs on 0 rows
    assert sum(rows) == responses and max(rows) == (3 if block_bytes else responses)
    assert hidden[0].shape == (responses, policy.config.hidden_size)


def test_packed_values_match_one_at_a_time(critic):
    sequences, prompts = make_batch(seed=2)
    packed = pack_rows(several_rows(sequences), sequences, pad_id=0)
    with torch.no_grad():
        values = packed_forward(critic, packed)
    assert values.shape == (*packed.input_ids.shape, 1)
    got = gather_response_values(values, packed, prompts)
    assert max_error(got, reference_values(critic, sequences, prompts)) < TOL


def test_eager_attention_gets_an_additive_mask(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    eager = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager").eval()
    sequences, prompts = make_batch(seed=3)
    packed = pack_rows(several_rows(sequences), sequences, pad_id=0)
    with torch.no_grad():
        got = gather_response_logprobs(packed_forward(eager, packed), packed, prompts)
    assert max_error(got, reference_logprobs(eager, sequences, prompts)) < TOL


def test_varlen_layout_is_one_unpadded_row(policy):
    """The flash layout, checked on CPU: without a cache, sdpa infers the same block mask from the
    restarting position_ids (batch size 1), so the flattened row must reproduce the reference."""
    sequences, prompts = make_batch(seed=4)
    packed = pack_rows(several_rows(sequences), sequences, pad_id=0, mode="varlen")
    lengths = [len(s) for s in sequences]
    assert packed.input_ids.shape == (1, sum(lengths)) and packed.attention_mask is None
    assert packed.max_length == max(lengths) and packed.cu_seq_lens.dtype == torch.int32
    assert packed.cu_seq_lens[-1] == sum(lengths) and len(packed.cu_seq_lens) == len(sequences) + 1
    with torch.no_grad():
        got = gather_response_logprobs(packed_forward(policy, packed), packed, prompts)
    assert max_error(got, reference_logprobs(policy, sequences, prompts)) < TOL


def test_position_ids_alone_do_not_keep_sequences_apart(policy):
    """Why the mask: with a KV cache in play (use_cache=True, the config default) restarting
    position_ids alone let each sequence attend to the ones before it in its row; and handing the
    model a plain causal mask instead of the block-diagonal one breaks it too, so the block mask we
    pass is what isolates the sequences, not anything inferred."""
    sequences, prompts = make_batch(seed=5)
    rows = [list(range(len(sequences)))]  # everything in one row
    packed = pack_rows(rows, sequences, pad_id=0)
    want = reference_logprobs(policy, sequences, prompts)
    with torch.no_grad():
        leaky = policy(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=True).logits
        causal = torch.ones_like(packed.attention_mask).tril()
        crossed = policy(input_ids=packed.input_ids, position_ids=packed.position_ids,
                         attention_mask=causal, use_cache=False).logits
    assert max_error(gather_response_logprobs(leaky, packed, prompts), want) > 1e-2
    assert max_error(gather_response_logprobs(crossed, packed, prompts), want) > 1e-2
    with torch.no_grad():
        exact = gather_response_logprobs(packed_forward(policy, packed), packed, prompts)
    assert max_error(exact, want) < TOL


def test_bins_from_the_packer_round_trip_through_rows(policy):
    """Micro-batch → rows → forward: every sequence of every bin comes back exactly once."""
    sequences, prompts = make_batch(seed=6, count=14)
    lengths = [len(s) for s in sequences]
    seen = []
    for micro in pack_bfd(lengths, 96):
        packed = pack_rows(split_into_rows(lengths, micro, 48), sequences, pad_id=0)
        with torch.no_grad():
            got = gather_response_logprobs(packed_forward(policy, packed), packed, prompts)
        seen += list(got)
        for i in got:
            assert got[i].numel() == lengths[i] - prompts[i]
    assert sorted(seen) == list(range(len(sequences)))


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("flash_attn") is None,
                    reason="needs CUDA and the flash_attn package (the varlen kernel)")
def test_varlen_flash_attention_on_gpu(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="flash_attention_2",
                                                 dtype=torch.bfloat16).cuda().eval()
    assert packing_attention_mode(model) == "varlen"
    sequences, prompts = make_batch(seed=7)
    packed = pack_rows(several_rows(sequences), sequences, pad_id=0, mode=packing_attention_mode(model))
    with torch.no_grad():
        got = gather_response_logprobs(packed_forward(model, packed), packed, prompts)
    want = {i: v.cuda() for i, v in reference_logprobs(model, sequences, prompts).items()}
    assert max_error(got, want) < 2e-2  # bf16 kernels: same math, different summation order


@pytest.mark.parametrize("model_name", ["policy", "critic"])
def test_one_sequence_per_row_needs_no_mask(request, model_name):
    """Right-padded single-sequence rows run under plain causal attention (no 4-D mask, positions
    counting on through the padding) and still match one sequence at a time."""
    model = request.getfixturevalue(model_name)
    sequences, prompts = make_batch(seed=7)
    packed = pack_rows([[i] for i in range(len(sequences))], sequences, pad_id=0)
    assert packed.attention_mask is None and packed.mode == "mask4d"
    assert packed.position_ids[0].tolist() == list(range(packed.input_ids.shape[1]))
    with torch.no_grad():
        out = packed_forward(model, packed)
    if model_name == "policy":
        got, want = gather_response_logprobs(out, packed, prompts), reference_logprobs(model, sequences, prompts)
    else:
        got, want = gather_response_values(out, packed, prompts), reference_values(model, sequences, prompts)
    assert max_error(got, want) < TOL


@pytest.mark.parametrize("model_name", ["policy", "critic"])
def test_outputs_at_chosen_positions_equal_the_full_output_there(request, model_name):
    """``positions`` runs the LM head on the chosen hidden states only (the critic, which has no
    output-embedding head, is indexed after its forward); both equal the full output at them."""
    model = request.getfixturevalue(model_name)
    sequences, prompts = make_batch(seed=8)
    packed = pack_rows(several_rows(sequences), sequences, pad_id=0)
    rows = torch.tensor([0, 0, 1, 1, 1])
    cols = torch.tensor([3, 0, 5, 2, 2])
    with torch.no_grad():
        full = packed_forward(model, packed)
        picked = packed_forward(model, packed, positions=(rows, cols))
    assert picked.shape == (5, full.shape[-1])
    assert torch.allclose(picked, full[rows, cols], atol=1e-6)


def test_block_causal_mask_keeps_sequences_and_padding_apart():
    from rlhf_core.models.packed import block_causal_mask

    want = [[1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0],
            [0, 0, 1, 0, 0, 0, 0],
            [0, 0, 1, 1, 0, 0, 0],
            [0, 0, 1, 1, 1, 0, 0],
            [0, 0, 0, 0, 0, 1, 0],   # padding: itself only
            [0, 0, 0, 0, 0, 0, 1]]
    assert block_causal_mask([2, 3], 7).int().tolist() == want
    assert block_causal_mask([4], 4).equal(torch.ones(4, 4, dtype=torch.bool).tril())
