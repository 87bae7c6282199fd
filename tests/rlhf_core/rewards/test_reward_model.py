"""Reward-model scoring reads the last real token of each sequence, batched or not."""

from __future__ import annotations

import random

import pytest
import torch

from rlhf_core.rewards.reward_model import conversation_ids, load_reward_model, score_conversations, score_token_batch


@pytest.fixture(scope="module")
def rm_dir(tiny_model_dir, tmp_path_factory):
    """A tiny reward model: the tiny backbone with a fresh one-output sequence-classification head."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path_factory.mktemp("rm")
    torch.manual_seed(11)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def rm(rm_dir):
    return load_reward_model(rm_dir)


def alone(rm, ids):
    """One sequence, unpadded, read at its final position (pad-id pooling switched off)."""
    saved = rm.model.config.pad_token_id
    rm.model.config.pad_token_id = None
    try:
        with torch.no_grad():
            return rm.model(input_ids=torch.tensor([ids])).logits[0, 0].item()
    finally:
        rm.model.config.pad_token_id = saved


def test_batched_scores_equal_each_sequence_alone(rm):
    rng = random.Random(1)
    vocab = rm.model.config.vocab_size
    batch = [[rng.randrange(3, vocab) for _ in range(rng.randint(2, 40))] for _ in range(7)]
    got = score_token_batch(rm, batch)
    assert got.shape == (7,)
    for value, ids in zip(got.tolist(), batch):
        assert value == pytest.approx(alone(rm, ids), abs=1e-5)


def test_a_sequence_ending_in_the_pad_token_is_read_at_its_real_end(rm):
    """transformers pools at 'the rightmost token that is not pad': wrong when a real token is the pad id."""
    pad = rm.tokenizer.pad_token_id
    batch = [[7, 8, 9, pad], [7, 8, 9, 10, 11, 12]]
    got = score_token_batch(rm, batch)
    assert got[0].item() == pytest.approx(alone(rm, batch[0]), abs=1e-5)
    with torch.no_grad():  # the library's own pooling reads token 9 instead of the final pad-id token
        naive = rm.model(input_ids=torch.tensor([batch[0]])).logits[0, 0].item()
    assert abs(naive - got[0].item()) > 1e-4


def test_conversations_use_the_rm_chat_template_and_keep_input_order(rm):
    prompts = [[{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(5)]
    responses = ["It is " + "very " * (4 - i) + f"clearly {2 * i}. #### {2 * i}" for i in range(5)]
    ids = conversation_ids(rm, prompts[0], responses[0])
    text = rm.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>user\nWhat is 0 + 0?<|im_end|>") and "<|im_start|>assistant\nIt is" in text
    scores = score_conversations(rm, prompts, responses, micro_batch_size=2, progress=False)
    for score, p, r in zip(scores, prompts, responses):
        assert score == pytest.approx(alone(rm, conversation_ids(rm, p, r)), abs=1e-5)
    assert len(set(round(s, 6) for s in scores)) == 5  # different texts, different scores


def test_missing_reward_model_dir_is_a_clear_error(tmp_path):
    from rlhf_core.errors import CheckpointError

    with pytest.raises(CheckpointError, match="reward_model.model.path"):
        load_reward_model(tmp_path)


def test_rerendering_decodes_drops_eos_and_uses_the_rm_template(rm):
    from rlhf_core.rewards.reward_model import decoded_response, rerendered_ids

    tok = rm.tokenizer
    response_ids = tok("It is 4. #### 4", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert tok.eos_token in tok.decode(response_ids) and decoded_response(tok, response_ids) == "It is 4. #### 4"
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    full = rerendered_ids(rm, messages, response_ids, tok, max_length=10_000)
    assert full == conversation_ids(rm, messages, "It is 4. #### 4")
    assert rerendered_ids(rm, messages, response_ids, tok, max_length=7) == full[:7]  # verl keeps the first tokens


def test_the_actors_ids_need_the_actors_vocabulary(rm, rm_dir, tmp_path):
    from transformers import AutoTokenizer

    from rlhf_core.config import ConfigError
    from rlhf_core.rewards.reward_model import check_same_vocabulary

    check_same_vocabulary(rm, AutoTokenizer.from_pretrained(rm_dir), rm_dir)
    other = AutoTokenizer.from_pretrained(rm_dir)
    other.add_tokens(["<other_token>"])
    with pytest.raises(ConfigError, match="reward_model.model.input_tokenizer"):
        check_same_vocabulary(rm, other, tmp_path)


def test_dynamic_and_fixed_batches_give_the_same_scores_in_input_order(rm):
    from rlhf_core.config.resolve import MicroBatching
    from rlhf_core.data.packing import PackingBudgetError
    from rlhf_core.rewards.reward_model import score_sequences

    rng = random.Random(2)
    vocab = rm.model.config.vocab_size
    batch = [[rng.randrange(3, vocab) for _ in range(rng.randint(2, 30))] for _ in range(9)]
    fixed = score_sequences(rm, batch, MicroBatching(False, 0, 4), progress=False)
    dynamic = score_sequences(rm, batch, MicroBatching(True, 40, 1), progress=False)
    assert fixed == pytest.approx(dynamic, abs=1e-5)
    assert fixed == pytest.approx(score_token_batch(rm, batch).tolist(), abs=1e-5)
    with pytest.raises(PackingBudgetError, match="critic.forward_max_token_len_per_gpu"):
        score_sequences(rm, batch, MicroBatching(True, 5, 1), progress=False)
