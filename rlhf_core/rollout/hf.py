"""Hugging Face ``generate`` engine: batched sampling with a KV cache, on CPU (default) or CUDA.

Each ``generate`` call is one left-padded batch (the pack stage sizes them by token budget). The
call's seed is set inside a forked RNG, so a batch's samples depend only on (weights, prompts,
sampling parameters, seed) — not on which batches ran before — and a rerun reproduces them.

The KV cache (``decode``, from actor_rollout_ref.rollout.hf_decode): 'dynamic' is transformers'
growing cache; 'static' is one cache of ``max_cache_len`` positions per batch size, which lets
``generate`` compile its decode step on CUDA (torch.compile's CUDA graphs: one kernel launch a step
instead of one per operation). Masked cache slots add nothing to the attention, so the tokens are
the dynamic cache's (log-probs within float rounding: tests/rlhf_core/rollout/test_hf_static_decode.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from rlhf_core.errors import RLHFError
from rlhf_core.models.threads import module_largest_matrix
from rlhf_core.rollout.base import (
    GeneratedSample, SamplingParams, copies_of_greedy, decode_threads, eos_token_ids, torch_threads,
    trim_response,
)
from rlhf_core.scoring.models import load_causal_lm, load_tokenizer, release
from rlhf_core.scoring.held import HeldModels

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DECODES = ("dynamic", "static")
"""The KV caches ``HFEngine`` decodes with (actor_rollout_ref.rollout.hf_decode)."""


def resolve_device(device: str = "auto") -> str:
    """'auto' → 'cuda' when available, else 'cpu'."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RLHFError("trainer.device=cuda but CUDA is not available here; use trainer.device=auto or cpu")
    return device


class HFEngine:
    """``AutoModelForCausalLM.generate`` over one batch per call.

    dtype 'auto' is fp32 on CPU and bf16 on CUDA; the rollout passes the actor's training dtype, so the
    engine borrows the trainer's module as it is held.
    ``cpu_threads`` 0 = auto: one thread for a model whose weight matrices are small (``decode_threads``:
    its per-token matmuls are too small to split), else torch's default. ``decode``: 'dynamic' or
    'static' KV cache (module docstring); a static cache holds ``max_cache_len`` positions (at least
    each call's prompt width + max_new_tokens), so every call of one batch size reuses one compiled step.
    """

    name = "hf"
    schedules_own_batches = False

    def __init__(self, model_path: str | Path, *, device: str = "auto", dtype: str = "auto",
                 tokenizer_path: Optional[str | Path] = None, cpu_threads: int = 0, attention: str = "auto",
                 decode: str = "dynamic", max_cache_len: Optional[int] = None, session: Optional[HeldModels] = None):
        import torch
        from transformers import GenerationConfig

        if decode not in DECODES:
            raise RLHFError(f"actor_rollout_ref.rollout.hf_decode={decode!r}: valid: {', '.join(DECODES)}")
        self.decode, self.max_cache_len = decode, max_cache_len
        self.device = resolve_device(device)
        if dtype == "auto":
            dtype = "bf16" if self.device.startswith("cuda") else "fp32"
        torch_dtype = getattr(torch, _DTYPES[dtype])
        # shared (scoring.cache): the actor the guard just measured, or the one scoring will use next,
        # loaded with the same attention implementation as theirs so it is one cached model
        # session: the trainer's module when the run holds model_path's state (none: from disk)
        self.session = session or HeldModels()
        self.tokenizer = load_tokenizer(tokenizer_path or model_path, session=self.session, shared=True)
        model = load_causal_lm(Path(model_path), torch.device(self.device), torch_dtype, session=self.session,
                               shared=True, attention=attention)
        self.model = model
        self.eos_ids = eos_token_ids(self.tokenizer, model.generation_config)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]
        # Our SamplingParams are the only source of sampling settings: a checkpoint's
        # generation_config.json (e.g. Qwen's repetition_penalty=1.05, top_k=20) would otherwise fill
        # every unset field and sample from a distribution the scoring stage does not model. (On a
        # shared model this is the same assignment every engine makes: the union of the same EOS ids.)
        self.model.generation_config = GenerationConfig(eos_token_id=self.eos_ids, pad_token_id=self.pad_id)
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self.cpu_threads = decode_threads(cpu_threads, module_largest_matrix(model))

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams) -> list[GeneratedSample]:
        """Sample ``sampling.n`` responses per prompt; returns len(prompts) × n samples in order."""
        import torch

        if not prompt_token_ids:
            return []
        input_ids, attention_mask = self._left_pad(prompt_token_ids)  # (B, P) each
        self._check_length(input_ids.shape[1], sampling.max_new_tokens)
        devices = [torch.device(self.device).index or 0] if self.device.startswith("cuda") else []
        recorder = SampledLogProbs()
        with torch.random.fork_rng(devices=devices), torch.inference_mode(), \
                torch_threads(self.cpu_threads if self.device == "cpu" else 0):
            torch.manual_seed(sampling.seed)
            out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                      **self._generate_kwargs(sampling, recorder))  # (B·m, P + T)
            log_probs = recorder.finish(out[:, -1]).tolist()  # (B·m, T)
        new_tokens = out[:, input_ids.shape[1]:].tolist()  # (B·m, T), rows grouped per prompt
        m = self._sequences_per_prompt(sampling)
        trimmed = [trim_response(row, self.eos_ids) for row in new_tokens]
        texts = self.tokenizer.batch_decode([ids for ids, _ in trimmed], skip_special_tokens=True)
        samples = [
            GeneratedSample(prompt_index=row // m, sample_index=row % m, token_ids=ids,
                            text=text, finish_reason=reason, seed=sampling.seed, log_probs=log_probs[row][:len(ids)])
            for row, ((ids, reason), text) in enumerate(zip(trimmed, texts))
        ]
        return copies_of_greedy(samples, sampling.n) if sampling.greedy else samples

    def close(self) -> None:
        import weakref

        import torch

        if self.model is None:
            return
        alive = weakref.ref(self.model)
        self.model = None
        release(alive, torch.device(self.device), self.session)

    # -------------------------------------------------------------------------------------------

    def _left_pad(self, prompts: list[list[int]]):
        """(B, P) input ids and attention mask, padded on the left so every row ends at column P."""
        import torch

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise RLHFError(f"prompt {i} of the batch has no tokens; rerun the preprocess stage")
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        return ids.to(self.device), mask.to(self.device)

    @staticmethod
    def _sequences_per_prompt(sampling: SamplingParams) -> int:
        """Rows ``generate`` returns per prompt: n sampled, one greedy (its copies are made after)."""
        return 1 if sampling.greedy else sampling.n

    def _generate_kwargs(self, sampling: SamplingParams, recorder: "SampledLogProbs") -> dict:
        """``generate``'s arguments. Sampling's temperature / top-k / top-p go in as our own processors,
        with the recorder after them: ``generate`` runs processors passed to it before the ones it
        builds from these settings, so a recorder there would see the logits before the cut. The
        processors, their order and the draws are those ``generate`` makes from the settings."""
        from transformers import LogitsProcessorList

        common = dict(max_new_tokens=sampling.max_new_tokens, num_return_sequences=self._sequences_per_prompt(sampling),
                      eos_token_id=self.eos_ids, pad_token_id=self.pad_id, use_cache=True)
        if self.decode == "static":  # sized once: calls of one batch size share one cache shape and compiled step
            common.update(cache_implementation="static", max_cache_len=self.max_cache_len)
        if sampling.greedy:
            return dict(do_sample=False, logits_processor=LogitsProcessorList([recorder]), **common)
        processors = LogitsProcessorList([*sampling_warpers(sampling), recorder])
        return dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, logits_processor=processors, **common)

    def _check_length(self, prompt_width: int, max_new_tokens: int) -> None:
        if self.max_positions and prompt_width + max_new_tokens > self.max_positions:
            raise RLHFError(
                f"longest prompt ({prompt_width} tokens) + max response ({max_new_tokens}) exceeds the model's "
                f"{self.max_positions} positions; lower data.max_prompt_length or data.max_response_length")



def sampling_warpers(sampling: SamplingParams) -> list:
    """transformers' warpers for ``sampling``, in the order ``generate`` applies them (temperature,
    top-k, top-p), each only when it changes the distribution, as ``generate`` builds them."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    warpers: list = []
    if sampling.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k > 0:  # -1 (and 0): no top-k cut
        warpers.append(TopKLogitsWarper(top_k=sampling.top_k))
    if sampling.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=sampling.top_p))
    return warpers


class SampledLogProbs:
    """The last logits processor of a ``generate`` call: the log-probability of each drawn token
    under the processed scores it was drawn from (verl's processed_logprobs), without keeping more
    than one step of scores. A step's token is known only at the next call (as ``input_ids``' last
    column) or, for the last step, from the output (``finish``).

        (B, V) scores at step t  →  log_softmax kept  →  step t+1: entry of input_ids[:, -1]  →  (B, T)
    """

    def __init__(self) -> None:
        self._last = None   # (B, V) log-softmax of the latest step's processed scores
        self._steps: list = []  # per finished step: (B,) log-probs of the drawn tokens

    def __call__(self, input_ids, scores):
        import torch

        if self._last is not None:
            self._steps.append(self._last.gather(1, input_ids[:, -1:]).squeeze(1))
        self._last = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, last_tokens):
        """(B, T) log-probs of every generated column, given the output's last column (B,)."""
        import torch

        steps = self._steps + [self._last.gather(1, last_tokens[:, None]).squeeze(1)]
        self._last, self._steps = None, []
        return torch.stack(steps, dim=1)
