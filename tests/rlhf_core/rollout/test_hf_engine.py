"""The hf engine on the real tiny model: seeded reproducibility, n samples, EOS / length finish
reasons, max_new_tokens, top-k / top-p, left padding, and the shared engine helpers."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.errors import RLHFError
from rlhf_core.models.threads import largest_matrix
from rlhf_core.rollout.base import (
    FINISH_LENGTH, FINISH_STOP, SamplingParams, decode_threads, derive_seed, get_engine, trim_response,
)
from rlhf_core.rollout.hf import HFEngine

QUESTIONS = ["What is 3 + 4?", "Tom has 5 apples and eats 2. How many are left?", "What is 12 - 7?",
             "Kai has 19 cards, then gets 12 more cards. How many cards does Kai have now?"]


def chat_prompt_ids(tokenizer, questions):
    """Token ids the way the preprocess stage makes them: chat template, generation prompt open."""
    texts = tokenizer.apply_chat_template([[{"role": "user", "content": q}] for q in questions],
                                          tokenize=False, add_generation_prompt=True)
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = HFEngine(tiny_model_dir, device="cpu")
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def prompts(engine):
    return chat_prompt_ids(engine.tokenizer, QUESTIONS)


@pytest.fixture(scope="module")
def stopping_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model after a few real SGD steps on answers that end with EOS, so sampled responses
    usually stop on their own (the random-init model almost never samples EOS)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    texts = [t + "#### 7" + tok.eos_token for t in tok.apply_chat_template(
        [[{"role": "user", "content": f"What is {i} + {2 * i}?"}] for i in range(8)],
        tokenize=False, add_generation_prompt=True)]
    batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    torch.manual_seed(0)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # matmuls this small only lose time to a second thread
    try:
        for _ in range(30):
            model(**batch, labels=labels).loss.backward()
            optim.step()
            optim.zero_grad()
    finally:
        torch.set_num_threads(threads)
    out = tmp_path_factory.mktemp("models") / "stopping"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _key(samples):
    return [(s.prompt_index, s.sample_index, s.token_ids, s.text, s.finish_reason) for s in samples]


def test_same_seed_reproduces_responses_whatever_ran_before(engine, prompts):
    sampling = SamplingParams(max_new_tokens=12, n=2, seed=11)
    first = engine.generate(prompts, sampling)
    engine.generate(prompts, SamplingParams(max_new_tokens=12, n=2, seed=99))  # perturbs nothing
    torch.rand(5)  # nor does the caller's use of the global RNG
    again = engine.generate(prompts, sampling)
    assert _key(first) == _key(again)
    assert all(s.seed == 11 for s in first)


def test_generate_leaves_the_global_rng_untouched(engine, prompts):
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    engine.generate(prompts, SamplingParams(max_new_tokens=4, seed=1))
    assert torch.equal(torch.rand(3), expected)


def test_different_seeds_give_different_responses(engine, prompts):
    a = engine.generate(prompts, SamplingParams(max_new_tokens=12, seed=1))
    b = engine.generate(prompts, SamplingParams(max_new_tokens=12, seed=2))
    assert [s.token_ids for s in a] != [s.token_ids for s in b]


def test_n_samples_per_prompt_in_prompt_then_sample_order(engine, prompts):
    samples = engine.generate(prompts, SamplingParams(max_new_tokens=10, n=3, seed=4))
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(p, j) for p in range(len(prompts))
                                                                    for j in range(3)]
    for p in range(len(prompts)):  # the n samples of one prompt are drawn, not copied
        group = [tuple(s.token_ids) for s in samples if s.prompt_index == p]
        assert len(set(group)) > 1


def test_random_model_hits_the_length_limit_exactly(engine, prompts):
    samples = engine.generate(prompts, SamplingParams(max_new_tokens=7, n=2, seed=3))
    for s in samples:
        assert len(s.token_ids) <= 7
        if s.finish_reason == FINISH_LENGTH:
            assert len(s.token_ids) == 7 and engine.tokenizer.eos_token_id not in s.token_ids
    assert any(s.finish_reason == FINISH_LENGTH for s in samples)


def test_responses_stop_at_eos_and_keep_it(stopping_model_dir):
    eng = HFEngine(stopping_model_dir, device="cpu")
    try:
        eos = eng.tokenizer.eos_token_id
        prompts = chat_prompt_ids(eng.tokenizer, QUESTIONS)
        samples = eng.generate(prompts, SamplingParams(max_new_tokens=16, n=3, seed=0))
        stopped = [s for s in samples if s.finish_reason == FINISH_STOP]
        assert len(stopped) >= len(samples) // 2
        for s in stopped:  # EOS is the last token and the only one; no padding after it
            assert s.token_ids[-1] == eos and s.token_ids.count(eos) == 1 and len(s.token_ids) < 16
            assert s.text == eng.tokenizer.decode(s.token_ids, skip_special_tokens=True)
            assert eng.tokenizer.eos_token not in s.text
        short = eng.generate(prompts, SamplingParams(max_new_tokens=1, seed=0))
        assert {s.finish_reason for s in short if s.token_ids != [eos]} <= {FINISH_LENGTH}
    finally:
        eng.close()


def test_top_k_1_and_tiny_top_p_are_greedy(engine, prompts):
    greedy = engine.generate(prompts, SamplingParams(max_new_tokens=10, greedy=True))
    top_k1 = engine.generate(prompts, SamplingParams(max_new_tokens=10, top_k=1, seed=8))
    top_p0 = engine.generate(prompts, SamplingParams(max_new_tokens=10, top_p=1e-6, seed=9))
    assert [s.token_ids for s in top_k1] == [s.token_ids for s in greedy]
    assert [s.token_ids for s in top_p0] == [s.token_ids for s in greedy]
    sampled = engine.generate(prompts, SamplingParams(max_new_tokens=10, top_k=40, top_p=0.9, seed=8))
    assert [s.token_ids for s in sampled] != [s.token_ids for s in greedy]


@pytest.mark.parametrize("sampling", [
    SamplingParams(max_new_tokens=10, n=2, seed=3),
    SamplingParams(max_new_tokens=10, n=2, seed=3, temperature=0.6, top_k=20, top_p=0.8),
    SamplingParams(max_new_tokens=10, greedy=True),
], ids=["plain", "temperature-top_k-top_p", "greedy"])
def test_samples_carry_the_log_probs_they_were_drawn_with(engine, prompts, tiny_model_dir, sampling,
                                                          processed_log_probs):
    """Each token's log-prob under the distribution it was drawn from (temperature, then top-k,
    then top-p; greedy: the model's own), recorded while generating, batched and left-padded."""
    samples = engine.generate(prompts, sampling)
    for s in samples:
        assert len(s.log_probs) == len(s.token_ids)
        expected = processed_log_probs(tiny_model_dir, prompts[s.prompt_index], s.token_ids, sampling)
        torch.testing.assert_close(torch.tensor(s.log_probs), expected, atol=1e-5, rtol=0)
    if sampling.top_k > 0:  # the cut renormalises: every drawn token is likelier than the model says
        plain = processed_log_probs(tiny_model_dir, prompts[0], samples[0].token_ids,
                                    SamplingParams(temperature=sampling.temperature))
        assert (torch.tensor(samples[0].log_probs) > plain).all()


def test_left_padding_does_not_change_a_prompts_response(engine, prompts):
    sampling = SamplingParams(max_new_tokens=10, greedy=True)
    batched = engine.generate(prompts, sampling)
    alone = [engine.generate([p], sampling)[0] for p in prompts]
    assert [s.token_ids for s in batched] == [s.token_ids for s in alone]


def test_prompt_plus_response_over_the_model_positions_is_a_clear_error(engine):
    with pytest.raises(RLHFError, match="data.max_response_length"):
        engine.generate([[5] * 1000], SamplingParams(max_new_tokens=100))


def test_greedy_with_several_samples_gives_identical_copies(engine, prompts):
    """verl repeats the batch n times before a greedy rollout: n identical responses per prompt."""
    one = engine.generate(prompts, SamplingParams(max_new_tokens=10, greedy=True))
    three = engine.generate(prompts, SamplingParams(max_new_tokens=10, greedy=True, n=3))
    assert [(s.prompt_index, s.sample_index) for s in three] == [(i, j) for i in range(len(prompts)) for j in range(3)]
    assert [s.token_ids for s in three] == [s.token_ids for s in one for _ in range(3)]
    with pytest.raises(RLHFError, match="n"):
        SamplingParams(n=0)


def test_sampling_settings_follow_do_sample_and_val_kwargs():
    from rlhf_core.config import load_config
    from rlhf_core.rollout.generate import train_sampling, validation_sampling
    from rlhf_core.stages.settings import generation
    from rlhf_core.config.reads import build

    def gen(*overrides):
        return build(generation, load_config(None, list(overrides)))

    four = gen("actor_rollout_ref.rollout.n=4")
    assert not train_sampling(four, seed=1).greedy and train_sampling(four, seed=1).n == 4
    greedy = train_sampling(gen("actor_rollout_ref.rollout.do_sample=false", "actor_rollout_ref.rollout.n=4"), seed=1)
    assert greedy.greedy and greedy.n == 4
    assert validation_sampling(four, seed=1).greedy  # verl's val_kwargs default: do_sample=false
    assert validation_sampling(gen("actor_rollout_ref.rollout.val_kwargs.do_sample=true",
                                   "actor_rollout_ref.rollout.val_kwargs.temperature=0"),
                               seed=1).greedy  # temperature 0 is greedy too
    sampled = validation_sampling(gen(
        "actor_rollout_ref.rollout.val_kwargs.do_sample=true", "actor_rollout_ref.rollout.val_kwargs.temperature=0.7",
        "actor_rollout_ref.rollout.val_kwargs.n=3"), seed=1)
    assert not sampled.greedy and sampled.temperature == 0.7 and sampled.n == 3
    assert four.data.max_response_length == train_sampling(four, seed=1).max_new_tokens


def test_unknown_engine_lists_the_valid_ones():
    with pytest.raises(RLHFError, match="valid engines: hf, vllm"):
        get_engine("sglang")
    with pytest.raises(RLHFError, match="offline"):
        get_engine("offline")
    assert get_engine("hf") is HFEngine


def test_derive_seed_is_stable_and_separates_labels():
    assert derive_seed(1, 0) == derive_seed(1, 0)
    seeds = {derive_seed(base, b) for base in range(3) for b in range(50)}
    assert len(seeds) == 150 and all(0 <= s < 2 ** 63 for s in seeds)


@pytest.mark.parametrize("row, eos, expected", [
    ([5, 6, 2, 0, 0], [2], ([5, 6, 2], FINISH_STOP)),
    ([5, 2, 2, 2], [2], ([5, 2], FINISH_STOP)),          # pad id == EOS id
    ([2, 9, 9], [2], ([2], FINISH_STOP)),                # empty answer: EOS first
    ([5, 6, 7], [2], ([5, 6, 7], FINISH_LENGTH)),
    ([5, 0, 7], [2], ([5, 0, 7], FINISH_LENGTH)),        # a sampled pad-id token inside is kept
    ([5, 3, 2], [2, 3], ([5, 3], FINISH_STOP)),          # any of several EOS ids stops
])
def test_trim_response(row, eos, expected):
    assert trim_response(row, eos) == expected


def test_decode_threads_follow_the_largest_matmul_not_the_parameter_count(engine):
    """The tiny model decodes on one thread; a model of Qwen2.5-0.5B's layer shape (896 x 4864) on
    torch's default even when cut to 60 M parameters; a configured count always wins."""
    assert engine.cpu_threads == 1
    half_b = [(896, 896), (128, 896), (4864, 896), (896, 4864), (896,), (512, 896)]
    assert largest_matrix(half_b) == 4864 * 896 and decode_threads(0, largest_matrix(half_b)) == 0
    assert decode_threads(0, largest_matrix([(64, 176), (512, 64), (64,)])) == 1
    assert decode_threads(3, largest_matrix(half_b)) == 3 and largest_matrix([(5,)]) == 0
