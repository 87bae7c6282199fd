"""The vllm engine. Generation tests need vllm and a CUDA GPU and skip (saying which is missing)
without them; the refusal on a machine without them, and the resident engine's pure helpers (weight
names, tensor checks, vLLM API check), are tested everywhere."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.errors import RLHFError
from rlhf_core.rollout.base import FINISH_LENGTH, FINISH_STOP, SamplingParams
from rlhf_core.rollout.vllm_engine import (
    VLLM_NEEDED, VLLM_WRITTEN_FOR, VLLMEngine, hf_weight_name, missing_resident_api, prepare_named_tensors,
    resident_api_error, version_at_least, vllm_unavailable_reason,
)

QUESTIONS = ["What is 3 + 4?", "Tom has 5 apples and eats 2. How many are left?", "What is 12 - 7?"]


@pytest.mark.parametrize("sleep_mode", [False, True])
def test_engine_refuses_clearly_where_vllm_cannot_run(tiny_model_dir, sleep_mode):
    reason = vllm_unavailable_reason()
    if reason is None:
        pytest.skip("vllm and CUDA are available here: the refusal path cannot be exercised")
    with pytest.raises(RLHFError, match="cannot start the vllm rollout engine: .*(CUDA|vllm)"):
        VLLMEngine(tiny_model_dir, sleep_mode=sleep_mode)


# --- resident engine helpers (CPU) -----------------------------------------------------------------

def test_hf_weight_name_drops_what_wrappers_add(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    wrapped = torch.nn.Module()
    wrapped.module = model  # how DeepSpeedEngine (and DDP) hold the model: names gain "module."
    hf_names = [n for n, _ in model.named_parameters()]
    assert [hf_weight_name(n) for n, _ in wrapped.named_parameters()] == hf_names
    assert [hf_weight_name(n) for n in hf_names] == hf_names  # already HF names: unchanged
    assert hf_weight_name("_orig_mod.model.norm.weight") == "model.norm.weight"  # torch.compile
    assert hf_weight_name("model.layers.3._checkpoint_wrapped_module.mlp.up_proj.weight") == \
        "model.layers.3.mlp.up_proj.weight"
    assert hf_weight_name("_fsdp_wrapped_module.model.layers.0._fsdp_wrapped_module.self_attn.q_proj.bias") == \
        "model.layers.0.self_attn.q_proj.bias"


def test_prepare_named_tensors_passes_full_tensors_by_reference(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    params = dict(model.named_parameters())
    out = prepare_named_tensors((f"module.{n}", p) for n, p in params.items())
    assert [n for n, _ in out] == list(params)
    for name, tensor in out:  # detached views of the same storage: no copy on the way to the worker
        assert not tensor.requires_grad and tensor.data_ptr() == params[name].data_ptr()
    copies = prepare_named_tensors(params.items(), to_cpu=True)  # already on CPU: .cpu() is the same tensor
    assert all(torch.equal(t, params[n]) for n, t in copies)


def test_prepare_named_tensors_refuses_what_would_load_wrong():
    full = torch.ones(4, 4)
    with pytest.raises(RLHFError, match="empty tensor for 'module.model.norm.weight'.*GatheredParameters"):
        prepare_named_tensors([("model.embed_tokens.weight", full), ("module.model.norm.weight", torch.empty(0))])
    with pytest.raises(RLHFError, match="two tensors for 'model.norm.weight'"):
        prepare_named_tensors([("model.norm.weight", full), ("module.model.norm.weight", full)])
    with pytest.raises(RLHFError, match="got no tensors"):
        prepare_named_tensors(iter(()))


@pytest.mark.parametrize("found, ok", [
    ("0.33.0", True), ("0.32.0+cu128", True), ("0.32.1rc1.dev5+g1234abc", True), ("1.0.0", True),
    ("0.31.9", False), ("0.11.2", False), ("0.32.0rc1", True), ("not-a-version", False),
])
def test_version_at_least_reads_wheel_versions(found, ok):
    assert version_at_least(found, VLLM_NEEDED) is ok
    assert version_at_least("0.32", "0.32.0") and not version_at_least("0.32", "0.32.1")  # 0.32 == 0.32.0


def test_missing_resident_api_names_each_missing_call_and_the_versions():
    class CurrentLLM:  # the calls as vLLM's LLM spells them (vllm/entrypoints/llm.py)
        def sleep(self, level: int = 1): ...
        def wake_up(self, tags=None): ...
        def collective_rpc(self, method, timeout=None, args=(), kwargs=None): ...
        def reset_prefix_cache(self): ...

    class OldLLM:  # sleep mode before tagged wake-up, and no worker RPC
        def sleep(self, level: int = 1): ...
        def wake_up(self): ...
        def reset_prefix_cache(self): ...

    assert missing_resident_api(CurrentLLM) == []
    missing = missing_resident_api(OldLLM)
    assert missing == ["LLM.collective_rpc", "LLM.wake_up(tags=...)"]
    old = resident_api_error("0.7.3", missing)  # too old: upgrade
    assert old.startswith("vLLM 0.7.3 lacks LLM.collective_rpc, LLM.wake_up(tags=...)")
    assert f"upgrade to vLLM >= {VLLM_NEEDED}" in old and "trainer.resident_models=false" in old
    renamed = resident_api_error("0.40.0", ["LLM.sleep"])  # newer and renamed: pin back
    assert renamed.startswith("vLLM 0.40.0 lacks LLM.sleep") and f"install vllm=={VLLM_WRITTEN_FOR}.*" in renamed


# --- generation (GPU) ------------------------------------------------------------------------------

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


def chat_prompts(tokenizer) -> list[list[int]]:
    texts = tokenizer.apply_chat_template([[{"role": "user", "content": q}] for q in QUESTIONS],
                                          tokenize=False, add_generation_prompt=True)
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def prompts(engine):
    return chat_prompts(engine.tokenizer)


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


@pytest.mark.gpu
def test_vllm_plain_engine_refuses_resident_calls(engine):
    with pytest.raises(RLHFError, match="sleep_mode=True"):
        engine.sleep()


# --- resident engine (GPU): sleep, wake, weights in place ------------------------------------------

@pytest.fixture(scope="module")
def resident(vllm_model_dir):
    """(the sleep-mode engine, the device bytes it took when built)."""
    before = VLLMEngine.gpu_memory_in_use()
    eng = VLLMEngine(vllm_model_dir, gpu_memory_utilization=0.3, max_model_len=512, seed=0, sleep_mode=True)
    yield eng, VLLMEngine.gpu_memory_in_use() - before
    eng.close()


def greedy_ids(eng: VLLMEngine) -> list[list[int]]:
    return [s.token_ids for s in eng.generate(chat_prompts(eng.tokenizer), SamplingParams(max_new_tokens=24,
                                                                                         greedy=True))]


def hf_weights(model_dir) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under their Hugging Face names (tied: no lm_head.weight)."""
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


@pytest.mark.gpu
def test_vllm_sleep_frees_gpu_memory_and_wake_up_generates_the_same(resident):
    eng, footprint = resident
    assert footprint > 0
    before = greedy_ids(eng)
    awake = eng.gpu_memory_in_use()
    eng.sleep()
    asleep = eng.gpu_memory_in_use()
    # level 1 frees the KV cache (most of the 0.3 share) and the weights (copied to host memory)
    assert awake - asleep >= 0.8 * footprint, (awake, asleep, footprint)
    with pytest.raises(RLHFError, match="asleep: call wake_up"):
        eng.generate(chat_prompts(eng.tokenizer), SamplingParams(greedy=True))
    eng.sleep()  # idempotent
    eng.wake_up()
    assert eng.gpu_memory_in_use() - asleep >= 0.8 * footprint  # KV cache and weights back
    assert not eng.asleep and greedy_ids(eng) == before  # weights restored bit for bit from host memory
    eng.wake_up()  # idempotent


@pytest.mark.gpu
def test_vllm_load_weights_changes_greedy_output_and_original_weights_restore_it(resident, vllm_model_dir):
    eng, footprint = resident
    original = hf_weights(vllm_model_dir)
    g = torch.Generator().manual_seed(0)
    perturbed = {n: t + 0.5 * t.float().std() * torch.randn(t.shape, generator=g) for n, t in original.items()}
    base = greedy_ids(eng)

    eng.sleep()
    eng.load_weights((f"module.{n}", t.cuda()) for n, t in perturbed.items())  # as DeepSpeed names them
    assert not eng.asleep
    changed = greedy_ids(eng)
    assert changed != base

    eng.sleep()
    in_use_asleep = eng.gpu_memory_in_use()
    eng.load_weights(original.items())  # from host memory this time
    assert eng.gpu_memory_in_use() - in_use_asleep >= 0.8 * footprint  # woke: weights and KV cache
    assert greedy_ids(eng) == base  # exactly the engine's first output

    # awake, no sleep: the prefix cache holds KV computed with the old weights and must not be reused
    eng.load_weights(perturbed.items())
    assert greedy_ids(eng) == changed
    eng.load_weights(original.items())
    assert greedy_ids(eng) == base


@pytest.mark.gpu
def test_vllm_load_weights_refuses_names_the_model_lacks(resident):
    eng, _ = resident
    with pytest.raises(RLHFError, match="Hugging Face parameter names"):
        eng.load_weights([("v_head.weight", torch.ones(1, 128))])
