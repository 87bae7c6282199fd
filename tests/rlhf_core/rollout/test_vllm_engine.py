"""The vllm engine. Generation tests need vllm and a CUDA GPU and skip (saying which is missing)
without them; the refusal on a machine without them is tested everywhere."""

from __future__ import annotations

import pytest

from rlhf_core.errors import RLHFError
from rlhf_core.rollout.base import FINISH_LENGTH, FINISH_STOP, SamplingParams
from rlhf_core.rollout.vllm_engine import VLLMEngine, vllm_unavailable_reason

QUESTIONS = ["What is 3 + 4?", "Tom has 5 apples and eats 2. How many are left?", "What is 12 - 7?"]


def test_engine_refuses_clearly_where_vllm_cannot_run(tiny_model_dir):
    reason = vllm_unavailable_reason()
    if reason is None:
        pytest.skip("vllm and CUDA are available here: the refusal path cannot be exercised")
    with pytest.raises(RLHFError, match="cannot start the vllm rollout engine: .*(CUDA|vllm)"):
        VLLMEngine(tiny_model_dir)


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory):
    """A tiny model vLLM's attention kernels accept (head_dim 64; the default tiny model has 16)."""
    reason = vllm_unavailable_reason()
    if reason:
        pytest.skip(reason)
    from rlhf_core.models.tiny import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, intermediate_size=256)
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny_vllm", spec)


@pytest.fixture(scope="module")
def engine(vllm_model_dir):
    eng = VLLMEngine(vllm_model_dir, gpu_memory_utilization=0.3, max_model_len=512, seed=0)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def prompts(engine):
    texts = engine.tokenizer.apply_chat_template([[{"role": "user", "content": q}] for q in QUESTIONS],
                                                 tokenize=False, add_generation_prompt=True)
    return engine.tokenizer(texts, add_special_tokens=False)["input_ids"]


@pytest.mark.gpu
def test_vllm_generates_n_samples_with_token_ids_and_finish_reasons(engine, prompts):
    samples = engine.generate(prompts, SamplingParams(max_new_tokens=16, n=3, seed=5))
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(p, j) for p in range(3) for j in range(3)]
    eos = engine.tokenizer.eos_token_id
    for s in samples:
        assert 1 <= len(s.token_ids) <= 16 and s.finish_reason in (FINISH_STOP, FINISH_LENGTH)
        if s.finish_reason == FINISH_STOP:
            assert s.token_ids[-1] in engine.eos_ids
        else:
            assert len(s.token_ids) == 16 and eos not in s.token_ids
        assert s.text == engine.tokenizer.decode(s.token_ids, skip_special_tokens=True)
    assert len({tuple(s.token_ids) for s in samples if s.prompt_index == 0}) > 1


@pytest.mark.gpu
def test_vllm_same_seed_same_responses(engine, prompts):
    sampling = SamplingParams(max_new_tokens=16, n=2, seed=7)
    first = engine.generate(prompts, sampling)
    engine.generate(prompts, SamplingParams(max_new_tokens=16, n=2, seed=8))
    again = engine.generate(prompts, sampling)
    assert [s.token_ids for s in first] == [s.token_ids for s in again]
    other = engine.generate(prompts, SamplingParams(max_new_tokens=16, n=2, seed=9))
    assert [s.token_ids for s in first] != [s.token_ids for s in other]


@pytest.mark.gpu
def test_vllm_greedy_and_top_k_1_agree(engine, prompts):
    greedy = engine.generate(prompts, SamplingParams(max_new_tokens=12, greedy=True))
    top1 = engine.generate(prompts, SamplingParams(max_new_tokens=12, top_k=1, seed=3))
    assert [s.token_ids for s in greedy] == [s.token_ids for s in top1]


@pytest.mark.gpu
def test_vllm_rejects_temperatures_it_cannot_take(engine, prompts):
    with pytest.raises(RLHFError, match="actor_rollout_ref.rollout.temperature"):
        engine.generate(prompts, SamplingParams(temperature=3.0))
