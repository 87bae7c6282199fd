"""The reference every engine's recorded log-probs are checked against."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def processed_log_probs():
    """``processed_log_probs(model_dir, prompt, response, sampling)`` → (T,): one fp32 forward over
    prompt + response, logits / temperature, then top-k and top-p cut by transformers' own warpers,
    log-softmax, the response tokens' entries (greedy: the model's plain log-probs). What an engine
    must record as the log-prob it sampled each token with (verl's processed_logprobs)."""
    from transformers import AutoModelForCausalLM, TopKLogitsWarper, TopPLogitsWarper

    models: dict = {}

    def reference(model_dir, prompt, response, sampling) -> torch.Tensor:
        if model_dir not in models:
            models[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = models[model_dir](torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].float()
        scores = logits if sampling.greedy else logits / sampling.temperature  # (T, V)
        if not sampling.greedy and sampling.top_k > 0:
            scores = TopKLogitsWarper(sampling.top_k)(None, scores)
        if not sampling.greedy and sampling.top_p < 1:
            scores = TopPLogitsWarper(sampling.top_p)(None, scores)
        return torch.log_softmax(scores, dim=-1).gather(1, torch.tensor(response)[:, None]).squeeze(1)

    return reference
