"""Held-out accuracy of an in-memory causal LM: sample responses, score them with the GSM8K rule.

Used by the warm start (``rlhf_core.sft.warm_start``) to watch the tiny model learn, and in development to
measure a checkpoint the way the pipeline's validation does: pure temperature sampling (no top-k,
no top-p), responses cut at the first EOS, reward = ``rewards.gsm8k.compute_score`` (1 when the
number after '####' equals the ground truth). The PPO pipeline itself validates through its rollout
engine; this helper exists for code that holds a model object rather than a checkpoint directory.

    result = sampled_accuracy(model, tokenizer, prompt_ids, truths, max_new_tokens=48, seed=0)
    result.accuracy, result.responses[0]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from rlhf_core.models.chat import end_of_turn_id
from rlhf_core.rewards.gsm8k import compute_score
from rlhf_core.rollout.base import trim_response


@dataclass
class AccuracyResult:
    """Scores of one sampled pass over a prompt set."""

    accuracy: float
    """Mean score (the share answered correctly when scores are 0/1)."""
    scores: list[float] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)
    mean_response_tokens: float = 0.0
    stopped: float = 0.0
    """Share of responses that ended with EOS before the token budget."""


def score_responses(responses: Sequence[str], ground_truths: Sequence[str], method: str = "strict") -> list[float]:
    """GSM8K rule per response: 1.0 when its final answer equals the ground truth, else 0.0."""
    if len(responses) != len(ground_truths):
        raise ValueError(f"{len(responses)} responses but {len(ground_truths)} ground truths")
    return [compute_score(r, t, method=method) for r, t in zip(responses, ground_truths)]


def _left_pad(prompts: Sequence[Sequence[int]], pad_id: int):
    """(B, P) input ids and attention mask, prompts right-aligned so generation continues each one."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


def sample_responses(model, tokenizer, prompt_token_ids: Sequence[Sequence[int]], max_new_tokens: int,
                     temperature: float = 1.0, batch_size: int = 64, seed: int = 0,
                     greedy: bool = False) -> tuple[list[str], list[int], list[bool]]:
    """Sample one response per prompt. Returns (texts, token counts, stopped-on-EOS flags).

    Batch b is seeded with ``seed + b`` inside a forked RNG, so the result depends only on (weights,
    prompts, seed) and the caller's random state is left untouched.
    """
    import torch

    eos_id = end_of_turn_id(tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    sampling = (dict(do_sample=False) if greedy else
                dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0))  # top_k=0: no filter
    texts, lengths, stopped = [], [], []
    was_training = model.training
    model.eval()
    for b, start in enumerate(range(0, len(prompt_token_ids), batch_size)):
        ids, mask = _left_pad(prompt_token_ids[start:start + batch_size], pad_id)
        with torch.random.fork_rng(devices=[]), torch.inference_mode():
            torch.manual_seed(seed + b)
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                 eos_token_id=eos_id, pad_token_id=pad_id, use_cache=True, **sampling)
        for row in out[:, ids.shape[1]:].tolist():  # (B, T) new tokens, padded after EOS
            tokens, reason = trim_response(row, [eos_id])
            texts.append(tokenizer.decode(tokens, skip_special_tokens=True))
            lengths.append(len(tokens))
            stopped.append(reason == "stop")
    model.train(was_training)
    return texts, lengths, stopped


def sampled_accuracy(model, tokenizer, prompt_token_ids: Sequence[Sequence[int]], ground_truths: Sequence[str],
                     max_new_tokens: int, temperature: float = 1.0, batch_size: int = 64, seed: int = 0,
                     method: str = "strict", greedy: bool = False) -> AccuracyResult:
    """Accuracy of one sampled response per prompt (temperature 1 by default, as PPO samples)."""
    if not prompt_token_ids:
        return AccuracyResult(accuracy=float("nan"))
    texts, lengths, stopped = sample_responses(model, tokenizer, prompt_token_ids, max_new_tokens,
                                               temperature, batch_size, seed, greedy)
    scores = score_responses(texts, ground_truths, method)
    n = len(scores)
    return AccuracyResult(accuracy=sum(scores) / n, scores=scores, responses=texts,
                          mean_response_tokens=sum(lengths) / n, stopped=sum(stopped) / n)


def accuracy_by_group(scores: Sequence[float], groups: Sequence[object]) -> dict[object, float]:
    """Mean score per group label (e.g. difficulty level), groups in sorted order."""
    sums: dict[object, list[float]] = {}
    for s, g in zip(scores, groups):
        sums.setdefault(g, []).append(s)
    return {g: sum(v) / len(v) for g, v in sorted(sums.items(), key=lambda kv: str(kv[0]))}

