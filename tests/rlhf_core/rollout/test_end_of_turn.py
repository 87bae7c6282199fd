"""Generation stops at the end-of-turn token, and that token is part of the response (issue 48 item 7).

verl's response is everything the engine generated up to and including the EOS: ``response_token_ids``
end with ``<|im_end|>`` and ``finish_reason`` is "stop"; what ``generate`` appends after it for the
rows of a batch that finished early is padding — the pad id, which for SmolLM2 is that same
``<|im_end|>`` — and never part of a response. Checked on the tiny model taught to answer and stop
(``chat_models``), with pad != EOS, pad == EOS and SmolLM2's template, and on chat prompts that hold
earlier turns' ``<|im_end|>`` tokens (left padding with the same id must not hide them).
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_core.rollout.base import FINISH_LENGTH, FINISH_STOP, SamplingParams, eos_token_ids
from rlhf_core.rollout.hf import HFEngine

CONVERSATIONS = [
    [{"role": "user", "content": "What is 3 + 4?"}],
    [{"role": "user", "content": "Tom has 5 apples and eats 1. How many are left?"}],
    [{"role": "system", "content": "You are a careful math tutor."}, {"role": "user", "content": "What is 12 - 7?"}],
    [{"role": "user", "content": "What is 1 + 2?"}, {"role": "assistant", "content": "#### 3"},
     {"role": "user", "content": "Tom has 4 apples and eats 1. How many are left?"}],
    [{"role": "user", "content": "Kai has 19 cards. How many?"}],
]
MAX_NEW = 24


@pytest.fixture
def engine(chat_model):
    name, model_dir = chat_model
    eng = HFEngine(model_dir, device="cpu")
    yield name, eng
    eng.close()


def chat_prompts(tokenizer) -> list[list[int]]:
    """CONVERSATIONS as the preprocess stage tokenizes them (template, generation prompt opened)."""
    texts = tokenizer.apply_chat_template(CONVERSATIONS, tokenize=False, add_generation_prompt=True)
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def end_of_turn(tokenizer) -> int:
    return tokenizer.convert_tokens_to_ids("<|im_end|>")


def check_response(sample, eos: int) -> None:
    """A response is its tokens up to the first EOS, that EOS included, or exactly MAX_NEW tokens."""
    ids = sample.token_ids
    if sample.finish_reason == FINISH_STOP:
        assert ids[-1] == eos and ids.count(eos) == 1 and len(ids) <= MAX_NEW
    else:
        assert sample.finish_reason == FINISH_LENGTH and len(ids) == MAX_NEW and eos not in ids
    assert "<|im_end|>" not in sample.text and "<|endoftext|>" not in sample.text
    assert len(sample.log_probs) == len(ids) and all(math.isfinite(lp) and lp <= 0 for lp in sample.log_probs)


def test_the_engine_stops_on_the_end_of_turn_token(engine):
    name, eng = engine
    eos = end_of_turn(eng.tokenizer)
    assert eos in eng.eos_ids and eng.tokenizer.eos_token_id == eos
    assert (eng.pad_id == eos) == (name != "tiny")  # the two layouts under test


def test_greedy_responses_end_with_the_end_of_turn_token_and_nothing_after_it(engine, processed_log_probs,
                                                                            chat_models):
    """One left-padded batch of chat prompts of different lengths: the rows that stop early are
    followed by padding inside ``generate`` (the EOS id itself where pad == EOS), and each response
    is what that prompt gives alone, its EOS the last token, scored with the log-prob an unpadded
    forward gives it."""
    name, eng = engine
    eos = end_of_turn(eng.tokenizer)
    prompts = chat_prompts(eng.tokenizer)
    assert all(eos in p for p in prompts) and len({len(p) for p in prompts}) > 1
    greedy = SamplingParams(greedy=True, max_new_tokens=MAX_NEW)
    samples = eng.generate(prompts, greedy)
    stopped = [s for s in samples if s.finish_reason == FINISH_STOP]
    # the taught model stops on most prompts, at different steps: padding followed some EOS in the batch
    assert len(stopped) >= 3 and len({len(s.token_ids) for s in stopped}) > 1
    for s, prompt in zip(samples, prompts):
        check_response(s, eos)
        (alone,) = eng.generate([prompt], greedy)
        assert alone.token_ids == s.token_ids and alone.finish_reason == s.finish_reason
        reference = processed_log_probs(chat_models[name], prompt, s.token_ids, greedy)
        torch.testing.assert_close(torch.tensor(s.log_probs), reference, atol=1e-4, rtol=0)


def test_sampled_responses_end_at_their_first_end_of_turn(engine):
    """Several samples per prompt at temperature 1: responses of many lengths in one batch, every
    stopped one cut right after its first EOS."""
    _, eng = engine
    eos = end_of_turn(eng.tokenizer)
    samples = eng.generate(chat_prompts(eng.tokenizer), SamplingParams(n=4, temperature=1.0, max_new_tokens=MAX_NEW,
                                                                        seed=3))
    assert len(samples) == 4 * len(CONVERSATIONS)
    for s in samples:
        check_response(s, eos)
    lengths = {len(s.token_ids) for s in samples if s.finish_reason == FINISH_STOP}
    assert len(lengths) > 1


def test_the_end_of_turn_token_ends_a_response_for_smollm2(smollm2_dir):
    """SmolLM2's tokenizer and generation config: <|im_end|> (id 2) is the EOS, and the pad id too."""
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    eos = end_of_turn(tokenizer)
    ids = eos_token_ids(tokenizer, GenerationConfig.from_pretrained(smollm2_dir))
    assert eos in ids and tokenizer.pad_token_id == eos
    assert tokenizer.decode([101, eos], skip_special_tokens=True) == tokenizer.decode([101])
