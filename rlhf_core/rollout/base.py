"""What every rollout engine shares: sampling parameters, one generated sample, the engine protocol,
the engine registry, seeding and the response-trimming rule.

An engine turns tokenized prompts into responses::

    engine = get_engine("hf")(model_path, device="cpu")
    samples = engine.generate([[1, 413, 71], [1, 57, 264, 86]], SamplingParams(n=2, seed=7))
    # 4 GeneratedSample: (prompt 0, sample 0), (0, 1), (1, 0), (1, 1)
    engine.close()

``offline`` is not an engine: imported trajectories are a rollout *source* (``offline.py``) and
never call a model to generate.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
from dataclasses import dataclass, field
from typing import Iterator, Optional, Protocol, Sequence, runtime_checkable

from rlhf_core.errors import RLHFError
from rlhf_core.models.threads import small_matmuls

FINISH_STOP = "stop"      # the response ends with an EOS token (included in its token ids)
FINISH_LENGTH = "length"  # hit max_new_tokens without EOS
FINISH_OFFLINE = "offline"


@dataclass(frozen=True)
class SamplingParams:
    """Our sampling parameters (engine-neutral; each engine maps them to its own API)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1 disables top-k (vLLM's convention; the hf engine passes 0 to transformers)."""
    max_new_tokens: int = 128
    n: int = 1
    """Responses per prompt."""
    seed: int = 0
    """Seed of one generate call; the rollout derives it per generation batch (``derive_seed``)."""
    greedy: bool = False
    """Argmax decoding (verl's do_sample=false): ignores temperature / top_p / top_k. With n > 1 every
    prompt gets n identical responses, as verl repeats the batch n times; engines decode once."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise RLHFError(f"n (responses per prompt) must be >= 1 (got {self.n})")
        if self.max_new_tokens < 1:
            raise RLHFError(f"max_new_tokens must be >= 1 (got {self.max_new_tokens}); "
                            f"raise data.max_response_length")


@dataclass
class GeneratedSample:
    """One response. ``token_ids`` holds the generated tokens only (no prompt, no padding), with the
    EOS token included when ``finish_reason == "stop"``."""

    prompt_index: int
    """Position of the prompt in the list given to ``generate``."""
    sample_index: int
    """0 .. n-1 for that prompt."""
    token_ids: list[int]
    text: str
    """Decoded with special tokens skipped (the EOS does not appear in the text)."""
    finish_reason: str
    seed: Optional[int] = None
    """The seed that reproduces this sample (the generate call's seed, or the per-request seed)."""
    log_probs: Optional[list[float]] = None
    """The engine's log-probability of each token of ``token_ids`` under the distribution it sampled
    it from (temperature, top-k and top-p applied: verl's processed_logprobs); None when unknown."""


def copies_of_greedy(samples: list[GeneratedSample], n: int) -> list[GeneratedSample]:
    """One greedy sample per prompt → ``n`` per prompt (sample_index 0..n-1), in prompt order: what
    verl's repeated batch decodes to, without decoding the same thing n times."""
    return [GeneratedSample(prompt_index=s.prompt_index, sample_index=j, token_ids=list(s.token_ids), text=s.text,
                            finish_reason=s.finish_reason, seed=s.seed,
                            log_probs=None if s.log_probs is None else list(s.log_probs))
            for s in samples for j in range(n)]


@runtime_checkable
class RolloutEngine(Protocol):
    """A model that samples responses. Engines hold the model between calls; ``close`` frees it."""

    name: str
    schedules_own_batches: bool
    """True when the engine batches internally (vLLM): the caller then sends a whole iteration at
    once instead of the pack stage's generation batches."""

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams) -> list[GeneratedSample]:
        """Samples in prompt order, then sample order: len == len(prompt_token_ids) * sampling.n."""
        ...

    def close(self) -> None:
        ...


ENGINES: dict[str, str] = {
    "hf": "rlhf_core.rollout.hf:HFEngine",
    "vllm": "rlhf_core.rollout.vllm_engine:VLLMEngine",
}


def get_engine(name: str) -> type:
    """The engine class registered under ``name`` (imported lazily, so vllm loads only when used)."""
    if name not in ENGINES:
        hint = " ('offline' imports responses instead of generating: see rlhf_core.rollout.offline)" \
            if name == "offline" else ""
        raise RLHFError(f"unknown rollout engine {name!r}; valid engines: {', '.join(ENGINES)}{hint}")
    module, _, cls = ENGINES[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def derive_seed(base: int, *parts: object) -> int:
    """A stable 63-bit seed from ``base`` and any labels (e.g. the batch id).

    Hash-derived rather than ``base + i`` so neighbouring iterations' batches never share a seed, and
    stable across processes (unlike Python's ``hash``), so a rerun reproduces every batch.
    """
    key = ":".join(str(p) for p in (base, *parts)).encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") & ((1 << 63) - 1)


def trim_response(token_ids: Sequence[int], eos_ids: Sequence[int]) -> tuple[list[int], str]:
    """Cut a generated row after its first EOS token.

    Returns (tokens up to and including the first EOS, "stop"), or (all tokens, "length") when no
    EOS was generated. Everything after the first EOS is padding that ``generate`` adds for finished
    rows of a batch, so it never belongs to the response — even when pad and EOS share an id.
    """
    eos = set(int(e) for e in eos_ids)
    for t, token in enumerate(token_ids):
        if int(token) in eos:
            return [int(x) for x in token_ids[: t + 1]], FINISH_STOP
    return [int(x) for x in token_ids], FINISH_LENGTH


def eos_token_ids(tokenizer, generation_config=None) -> list[int]:
    """Every token that ends a response: the tokenizer's EOS plus the checkpoint's generation-config
    EOS list (chat models often stop on both an end-of-turn and an end-of-text token)."""
    ids: list[int] = []
    for value in (tokenizer.eos_token_id, getattr(generation_config, "eos_token_id", None)):
        for token in (value if isinstance(value, (list, tuple)) else [value]):
            if token is not None and int(token) not in ids:
                ids.append(int(token))
    if not ids:
        raise RLHFError("the tokenizer defines no EOS token, so responses could never stop; set eos_token "
                        "in the model's tokenizer_config.json")
    return ids


SMALL_MODEL_PARAMS = 100_000_000
"""Below this many parameters the SFT warm start trains on one CPU thread (``sft.warm_start``)."""

def decode_threads(configured: int, largest_matrix: int) -> int:
    """rollout.cpu_threads as an engine applies it on CPU: the configured count, else (0 = auto)
    one thread for a model of small matmuls (``models.threads``) and torch's default (0: unchanged)
    otherwise."""
    return configured or (1 if small_matmuls(largest_matrix) else 0)


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``threads`` for the block, then restored (0: unchanged).
    The count is process-wide: an engine sets it for its own calls only."""
    import torch

    if not threads:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class GenerationStats:
    """Throughput of one rollout: generated tokens over generation wall time (model load excluded)."""

    generated_tokens: int = 0
    seconds: float = 0.0
    load_seconds: float = 0.0
    batches: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0
