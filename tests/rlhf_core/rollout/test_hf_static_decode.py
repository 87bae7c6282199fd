"""The hf engine's static KV cache (actor_rollout_ref.rollout.hf_decode=static): the same tokens as
the dynamic cache, the log-probs within float rounding, one cache size for every call; on CUDA the
compiled decode step too (marked gpu), with its speed against the dynamic cache."""

from __future__ import annotations

import time

import pytest
import torch

from rlhf_core.errors import RLHFError
from rlhf_core.rollout.base import SamplingParams
from rlhf_core.rollout.hf import HFEngine

PROMPTS = [[5, 17, 200, 31, 9], [44, 3], [100, 101, 102, 103, 104, 105, 106, 107]]
WIDER = [[7] * 20, [300, 301, 302]]
"""A second call with a wider prompt: the one static cache (``max_cache_len``) serves both."""


def _same(dynamic, static, tolerance: float) -> None:
    assert [(s.prompt_index, s.sample_index, s.token_ids, s.finish_reason) for s in dynamic] == \
        [(s.prompt_index, s.sample_index, s.token_ids, s.finish_reason) for s in static]
    worst = max(abs(a - b) for d, s in zip(dynamic, static) for a, b in zip(d.log_probs, s.log_probs))
    assert worst <= tolerance, worst


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    dynamic = HFEngine(tiny_model_dir, device="cpu")
    static = HFEngine(tiny_model_dir, device="cpu", decode="static", max_cache_len=64)
    yield dynamic, static
    static.close()
    dynamic.close()


@pytest.mark.parametrize("sampling", [SamplingParams(max_new_tokens=24, n=2, seed=3),
                                      SamplingParams(max_new_tokens=24, n=2, seed=3, greedy=True),
                                      SamplingParams(max_new_tokens=16, seed=9, temperature=0.7, top_k=50, top_p=0.9)],
                         ids=["sampled", "greedy", "warped"])
def test_static_cache_gives_the_dynamic_caches_tokens_on_cpu(engines, sampling):
    dynamic, static = engines
    for prompts in (PROMPTS, WIDER):
        _same(dynamic.generate(prompts, sampling), static.generate(prompts, sampling), 1e-5)
    assert static.model._previous_max_cache_length == 64  # sized once, not per call


def test_the_setting_reaches_the_engine_sized_for_the_longest_sequence(tiny_model_dir):
    from rlhf_core.config import load_config
    from rlhf_core.rollout.generate import build_rollout_engine
    from rlhf_core.stages.settings import generation
    from rlhf_core.config.reads import build
    from rlhf_core.run.session import RunSession

    cfg = load_config(None, [f"actor_rollout_ref.model.path={tiny_model_dir}", "actor_rollout_ref.rollout.hf_decode=static",
                             "data.max_prompt_length=40", "data.max_response_length=24", "trainer.device=cpu"])
    engine = build_rollout_engine(build(generation, cfg), tiny_model_dir, session=RunSession())
    try:
        assert (engine.decode, engine.max_cache_len) == ("static", 64)
    finally:
        engine.close()
    assert load_config(None, []).actor_rollout_ref.rollout.hf_decode == "dynamic"  # the default path is unchanged
    with pytest.raises(RLHFError, match="hf_decode"):
        HFEngine(tiny_model_dir, device="cpu", decode="graphs")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled decode step is CUDA's (needs a GPU)")
def test_compiled_static_decode_on_cuda_gives_the_same_tokens_and_its_speed(tiny_model_dir, tmp_path):
    """fp32 on CUDA (bf16 kernels of a compiled and an eager step may round a near tie apart): the
    compiled step's greedy and sampled tokens are the dynamic cache's. Then the speed at Qwen2.5-0.5B's
    layer shape cut to 4 layers with its real vocabulary, batch 128, 64 new tokens, bf16, after a
    warm-up call that compiles."""
    import sys
    from pathlib import Path

    dynamic = HFEngine(tiny_model_dir, device="cuda", dtype="fp32")
    static = HFEngine(tiny_model_dir, device="cuda", dtype="fp32", decode="static", max_cache_len=64)
    # six rows each (3 prompts × 2 samples; 6 prompts greedy): one batch size, one compilation
    for prompts, sampling in ((PROMPTS, SamplingParams(max_new_tokens=24, n=2, seed=3)),
                              (PROMPTS + PROMPTS[::-1], SamplingParams(max_new_tokens=24, seed=3, greedy=True))):
        _same(dynamic.generate(prompts, sampling), static.generate(prompts, sampling), 1e-4)
    static.close()
    dynamic.close()

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
    from shapes import build_shape_model

    model_dir = build_shape_model(tmp_path, "qwen2.5-0.5b", layers=4, vocab=151936)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 512, (128, 96), generator=g).tolist()
    sampling = SamplingParams(max_new_tokens=64, seed=1)
    speeds = {}
    for decode in ("dynamic", "static"):
        engine = HFEngine(model_dir, device="cuda", dtype="bf16", decode=decode, max_cache_len=96 + 64)
        engine.generate(prompts, sampling)  # warm-up (compiles the static step)
        torch.cuda.synchronize()
        started = time.perf_counter()
        out = engine.generate(prompts, sampling)
        speeds[decode] = sum(len(s.token_ids) for s in out) / (time.perf_counter() - started)
        engine.close()
    print(f"\n[decode] 4 layers of Qwen2.5-0.5B, vocabulary 151936, batch 128, 64 new tokens, bf16: "
          f"dynamic {speeds['dynamic']:.0f} tokens/s, static + compiled {speeds['static']:.0f} tokens/s")
    assert speeds["static"] > speeds["dynamic"]
