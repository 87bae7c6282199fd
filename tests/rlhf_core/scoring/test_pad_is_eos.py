"""Scoring a chat batch where the pad token is the end-of-turn token (SmolLM2) and where it is not
(the tiny model): issue 48 item 7.

Every ChatML prompt holds ``<|im_end|>`` (one per earlier turn, and the default system turn SmolLM2's
template adds), and every stopped response ends with it; for SmolLM2 it is also the pad id. Scoring
packs several sequences into a row and fills the rest with the pad id, so a mask built as
``ids != pad_id`` would drop the prompt's turn ends (the tokens after them then see a different
context) and the response's EOS. What must hold, for every attention kernel and both layouts:

    old log-probs, values and the guard's KL of each sequence = one unpadded forward of that sequence alone
    the same numbers whether pad == EOS or not (the masks come from lengths, never from ids)
    the last entry of each stopped response is the EOS's own: log p(<|im_end|> | everything before it)
"""

from __future__ import annotations

import pytest
import torch

from rlhf_core.config.resolve import MicroBatching
from rlhf_core.scoring.logprobs import compute_token_logprobs, compute_token_values, plan_micro_batches
from rlhf_core.scoring.models import load_causal_lm, load_critic
from rlhf_core.scoring.policy_kl import token_kl
from rlhf_core.run.session import RunSession

DISK = RunSession()  # every model read from its directory
CPU = torch.device("cpu")
ATTENTION = ("sdpa", "eager", "sdpa_varlen")  # 4-D bool mask, additive float mask, varlen (one flat row)

CONVERSATIONS = [
    [{"role": "user", "content": "What is 3 + 4?"}],
    [{"role": "system", "content": "You are a careful math tutor."},
     {"role": "user", "content": "Tom has 5 apples and eats 1. How many are left?"}],
    [{"role": "user", "content": "What is 1 + 2?"}, {"role": "assistant", "content": "#### 3"},
     {"role": "user", "content": "And 12 - 7?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}],
    [{"role": "user", "content": "What is 1 + 2?"}, {"role": "assistant", "content": "#### 3"},
     {"role": "user", "content": "And 2 + 2?"}, {"role": "assistant", "content": "He eats one apple, so #### 4"},
     {"role": "user", "content": "And 3 + 3?"}],
]
RESPONSES = ["#### 7", "He eats one apple, so #### 3", "", "#### 4", "He eats"]
"""Response texts; all but the last end with <|im_end|> (the last was cut at the length limit)."""
ALL_IN_ONE = MicroBatching(use_dynamic_bsz=True, token_budget=10_000, micro_batch_size=1)
"""One micro-batch holding every sequence: rows of different lengths, padding in every forward."""


def chat_batch(model_dir) -> tuple[list[list[int]], list[int], int]:
    """(sequences, prompt lengths, EOS id): CONVERSATIONS in the model's template, RESPONSES after them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    sequences, prompt_lengths = [], []
    for k, (messages, response) in enumerate(zip(CONVERSATIONS, RESPONSES)):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt = tok(text, add_special_tokens=False)["input_ids"]
        reply = tok(response, add_special_tokens=False)["input_ids"] + ([eos] if k < len(RESPONSES) - 1 else [])
        assert prompt.count(eos) == text.count("<|im_end|>") >= len(messages)  # one per turn
        sequences.append(prompt + reply)
        prompt_lengths.append(len(prompt))
    return sequences, prompt_lengths, eos


def unpadded(model, sequence: list[int], prompt_length: int, attention_mask=None) -> torch.Tensor:
    """(T, V) fp32 outputs at the positions that score response tokens 0..T-1: one sequence, no padding."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([sequence]), attention_mask=attention_mask, use_cache=False).logits[0]
    return out[prompt_length - 1:len(sequence) - 1].float()


def picked(logits: torch.Tensor, sequence: list[int], prompt_length: int) -> torch.Tensor:
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(sequence[prompt_length:])[:, None]).squeeze(1)


def pad_id(model) -> int:
    """What the score stage passes (``stages.score._pad_id``): the model's own pad id."""
    return int(model.config.pad_token_id)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("attention", ATTENTION)
def test_log_probs_and_values_are_each_sequence_alone(chat_model, chat_critics, attention, packed):
    name, model_dir = chat_model
    actor = load_causal_lm(model_dir, CPU, torch.float32, session=DISK, attention=attention)
    critic = load_critic(chat_critics[name], CPU, torch.float32, attention, session=DISK)
    sequences, prompt_lengths, eos = chat_batch(model_dir)
    assert (pad_id(actor) == eos) == (name != "tiny") and pad_id(critic) == pad_id(actor)
    (rows,) = plan_micro_batches([len(s) for s in sequences], ALL_IN_ONE, packed=packed)
    assert any(len(row) > 1 for row in rows) == packed  # packed: sequences share a row, the rest pad-filled
    log_probs = compute_token_logprobs(actor, sequences, prompt_lengths, ALL_IN_ONE, pad_id=pad_id(actor),
                                       packed=packed, progress=False)
    values = compute_token_values(critic, sequences, prompt_lengths, ALL_IN_ONE, pad_id=pad_id(critic),
                                  packed=packed, progress=False)
    for seq, p, lp, v in zip(sequences, prompt_lengths, log_probs, values):
        assert lp.shape == v.shape == (len(seq) - p,)
        torch.testing.assert_close(lp, picked(unpadded(actor, seq, p), seq, p), atol=1e-5, rtol=0)
        torch.testing.assert_close(v, unpadded(critic, seq, p)[:, 0], atol=1e-5, rtol=0)
    for seq, p, lp in zip(sequences[:-1], prompt_lengths, log_probs):  # the stopped ones: EOS scored last
        assert seq[-1] == eos and lp[-1] == lp[len(seq) - p - 1] and torch.isfinite(lp[-1])


def test_the_prompts_end_of_turn_tokens_are_attended_to(chat_models):
    """The comparisons above have teeth: hiding the prompt's <|im_end|> tokens (what a mask built as
    ``ids != pad_id`` does where pad == EOS) moves the responses' log-probs far past their tolerance."""
    model_dir = chat_models["smol_like"]
    actor = load_causal_lm(model_dir, CPU, torch.float32, session=DISK, attention="sdpa")
    sequences, prompt_lengths, eos = chat_batch(model_dir)
    scored = compute_token_logprobs(actor, sequences, prompt_lengths, ALL_IN_ONE, pad_id=pad_id(actor), progress=False)
    moved = []
    for seq, p, lp in zip(sequences, prompt_lengths, scored):
        ids_not_pad = (torch.tensor([seq]) != pad_id(actor)).long()
        assert ids_not_pad[0, :p].sum() < p  # every prompt holds the pad id (its turn ends)
        moved.append(float((lp - picked(unpadded(actor, seq, p, attention_mask=ids_not_pad), seq, p)).abs().max()))
    assert max(moved) > 1e-2, moved  # 1000x the tolerance


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("attention", ATTENTION)
def test_the_pad_id_changes_no_score(chat_models, chat_critics, attention, packed):
    """The same sequences through the same weights, pad <|endoftext|> against pad == EOS: the same
    log-probs and values to the bit (the pad id only fills slots no real token sees)."""
    sequences, prompt_lengths, _ = chat_batch(chat_models["tiny"])
    assert chat_batch(chat_models["tiny_pad_eos"])[:2] == (sequences, prompt_lengths)
    out = {}
    for name in ("tiny", "tiny_pad_eos"):
        actor = load_causal_lm(chat_models[name], CPU, torch.float32, session=DISK, attention=attention)
        critic = load_critic(chat_critics[name], CPU, torch.float32, attention, session=DISK)
        out[name] = (compute_token_logprobs(actor, sequences, prompt_lengths, ALL_IN_ONE, pad_id=pad_id(actor),
                                            packed=packed, progress=False),
                     compute_token_values(critic, sequences, prompt_lengths, ALL_IN_ONE, pad_id=pad_id(critic),
                                          packed=packed, progress=False))
    assert pad_id(actor) != 0  # the second pass did pad with the EOS id
    for ours, theirs in zip(out["tiny"], out["tiny_pad_eos"]):
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("attention", ATTENTION)
def test_the_guards_kl_is_each_sequence_alone(chat_model, tiny_model_dir, attention):
    """The KL guard's exact per-token KL(actor ‖ ref) and its sampled log-probs over packed rows padded
    with the pad id: those of unpadded forwards, the EOS position included."""
    name, model_dir = chat_model
    actor = load_causal_lm(model_dir, CPU, torch.float32, session=DISK, attention=attention)
    ref = load_causal_lm(tiny_model_dir, CPU, torch.float32, session=DISK, attention=attention)  # untaught weights
    sequences, prompt_lengths, eos = chat_batch(model_dir)
    kls, sampled = token_kl(actor, ref, sequences, prompt_lengths, budget=10_000, temperature=1.0,
                            pad_id=pad_id(actor))
    for seq, p, kl, lp in zip(sequences, prompt_lengths, kls, sampled):
        la = torch.log_softmax(unpadded(actor, seq, p), -1)
        lr = torch.log_softmax(unpadded(ref, seq, p), -1)
        torch.testing.assert_close(kl, (la.exp() * (la - lr)).sum(-1).clamp_min(0.0), atol=1e-5, rtol=0)
        torch.testing.assert_close(lp, picked(unpadded(actor, seq, p), seq, p), atol=1e-5, rtol=0)
        assert kl[-1] > 0  # the last position (the EOS's, where stopped) is measured: the models differ there
