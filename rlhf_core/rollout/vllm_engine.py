"""vLLM engine (GPU): ``vllm.LLM`` on the actor checkpoint directory, generating from token ids.

vLLM is imported only here, when this engine is built (its wheels are CUDA-only). API used (vLLM
0.32 / 0.33): ``LLM(model, tokenizer, tensor_parallel_size, gpu_memory_utilization, dtype, seed,
max_model_len)``, ``SamplingParams(n, temperature, top_p, top_k, max_tokens, seed,
skip_special_tokens)``, prompts as ``vllm.inputs.TokensPrompt(prompt_token_ids=...)``, and per
output ``.outputs[j].token_ids`` / ``.text`` / ``.finish_reason``.

vLLM schedules its own continuous batches, so the rollout sends a whole iteration in one call. Each
prompt gets its own seed, derived from the call's seed and the prompt's position: per-request seeds
make the samples reproducible, and distinct ones keep different prompts from sharing random draws.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from rlhf_core.errors import RLHFError
from rlhf_core.rollout.base import (
    FINISH_LENGTH, FINISH_STOP, GeneratedSample, SamplingParams, copies_of_greedy, derive_seed, eos_token_ids,
    trim_response,
)

VLLM_MAX_TEMPERATURE = 2.0  # vLLM's SamplingParams rejects temperature > 2


def vllm_unavailable_reason() -> Optional[str]:
    """Why this machine cannot run the vLLM engine, or None when it can."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a core dependency
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "vLLM needs a CUDA GPU and none is available here (use actor_rollout_ref.rollout.name=hf)"
    try:
        import vllm  # noqa: F401
    except ImportError:
        return "vllm is not installed (pip install 'rlhf-dag[vllm]')"
    except Exception as exc:  # a CUDA-only wheel on a machine without the driver fails at import
        return f"vllm is installed but failed to import ({type(exc).__name__}: {exc})"
    return None


class VLLMEngine:
    """``vllm.LLM`` over the actor's Hugging Face checkpoint directory."""

    name = "vllm"
    schedules_own_batches = True

    def __init__(self, model_path: str | Path, *, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.5, dtype: str = "auto", seed: int = 0,
                 max_model_len: Optional[int] = None, tokenizer_path: Optional[str | Path] = None):
        reason = vllm_unavailable_reason()
        if reason:
            raise RLHFError(f"cannot start the vllm rollout engine: {reason}")
        from transformers import AutoTokenizer, GenerationConfig
        from vllm import LLM

        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or model_path)
        try:
            generation_config = GenerationConfig.from_pretrained(model_path)
        except OSError:  # no generation_config.json: the tokenizer's EOS is the only stop token
            generation_config = None
        # vLLM also stops on the generation config's EOS list (and keeps that token in token_ids)
        self.eos_ids = eos_token_ids(self.tokenizer, generation_config)
        self.llm = LLM(
            model=str(model_path), tokenizer=str(tokenizer_path or model_path),
            tensor_parallel_size=tensor_parallel_size, gpu_memory_utilization=gpu_memory_utilization,
            dtype={"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(dtype, dtype),
            seed=seed, max_model_len=max_model_len,
        )
        # An explicit SamplingParams per request is used as given: vLLM applies the checkpoint's
        # generation-config sampling defaults only when generate() gets no sampling params.

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams) -> list[GeneratedSample]:
        """Sample ``sampling.n`` responses per prompt; returns len(prompts) × n samples in order."""
        from vllm.inputs import TokensPrompt

        if not prompt_token_ids:
            return []
        if not sampling.greedy and sampling.temperature > VLLM_MAX_TEMPERATURE:
            raise RLHFError(f"vLLM accepts temperature <= {VLLM_MAX_TEMPERATURE}; lower "
                            f"actor_rollout_ref.rollout.temperature (got {sampling.temperature})")
        prompts = [TokensPrompt(prompt_token_ids=list(map(int, ids))) for ids in prompt_token_ids]
        seeds = [derive_seed(sampling.seed, i) for i in range(len(prompts))]
        params = [self._sampling_params(sampling, seed) for seed in seeds]
        outputs = self.llm.generate(prompts, params, use_tqdm=True)
        samples = []
        for i, request in enumerate(outputs):  # same order as the prompts
            for j, completion in enumerate(sorted(request.outputs, key=lambda c: c.index)):
                ids, reason = self._normalise(list(completion.token_ids), completion.finish_reason)
                samples.append(GeneratedSample(prompt_index=i, sample_index=j, token_ids=ids,
                                               text=completion.text, finish_reason=reason, seed=seeds[i]))
        return copies_of_greedy(samples, sampling.n) if sampling.greedy else samples

    def close(self) -> None:
        import gc

        import torch

        self.llm = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # -------------------------------------------------------------------------------------------

    @staticmethod
    def _sampling_params(sampling: SamplingParams, seed: int):
        from vllm import SamplingParams as VLLMSamplingParams

        if sampling.greedy:  # temperature 0 is vLLM's greedy decoding
            return VLLMSamplingParams(n=1, temperature=0.0, max_tokens=sampling.max_new_tokens,
                                      skip_special_tokens=True)
        return VLLMSamplingParams(
            n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else 0,  # 0 disables top-k in vLLM
            max_tokens=sampling.max_new_tokens, seed=seed, skip_special_tokens=True,
        )

    def _normalise(self, token_ids: list[int], finish_reason: Optional[str]) -> tuple[list[int], str]:
        """vLLM keeps the sampled EOS in ``token_ids`` and reports "stop"/"length"; map to our two
        reasons with the same rule as the hf engine (cut after the first EOS)."""
        ids, reason = trim_response(token_ids, self.eos_ids)
        if reason == FINISH_LENGTH and finish_reason == FINISH_STOP:
            # stopped on another of the model's stop tokens (generation_config eos list): keep it
            return ids, FINISH_STOP
        return ids, reason
