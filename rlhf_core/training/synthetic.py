"""A well-formed advantages table without running rollout/score/gae: for the update's tests and
benchmark. Responses are random token ids; ``old_log_probs`` (and, by default, ``ref_log_probs``)
are the model's own log-probs of them, so the PPO ratio starts at exactly the value scoring would
give; advantages and returns are seeded Gaussian noise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

from rlhf_core.data.schemas import ADVANTAGES
from rlhf_core.scoring.logprobs import compute_token_logprobs
from rlhf_core.scoring.models import load_causal_lm
from rlhf_core.run.session import RunSession


def synthetic_advantages(model_dir: str | Path, n: int = 16, *, seed: int = 0, prompt_len: tuple[int, int] = (4, 12),
                         response_len: tuple[int, int] = (1, 16), iteration: int = 1, temperature: float = 1.0,
                         advantage_scale: float = 1.0, ref_model_dir: Optional[str | Path] = None,
                         pairs: Optional[list[tuple[list[int], list[int]]]] = None, device: str = "cpu",
                         dtype: str = "fp32", budget: Optional[int] = None):
    """A pyarrow Table in the ADVANTAGES schema with ``n`` rows (lengths uniform in the given
    inclusive ranges), or one row per given (prompt ids, response ids) in ``pairs``.
    ``ref_model_dir`` scores ``ref_log_probs`` with another model (default: the same as
    old_log_probs, as in iteration 1). The log-probs are scored on ``device`` in ``dtype``
    ('fp32' | 'bf16') with micro-batches of ``budget`` tokens (default: 4 longest sequences)."""
    import pyarrow as pa
    import torch

    rng = np.random.default_rng(seed)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    disk = RunSession()  # test data from model directories: nothing is held in memory
    model = load_causal_lm(model_dir, torch.device(device), torch_dtype, session=disk)
    vocab = model.config.vocab_size
    if pairs is not None:
        prompts, responses, n = [list(p) for p, _ in pairs], [list(r) for _, r in pairs], len(pairs)
    else:
        prompts = [rng.integers(3, vocab, rng.integers(*prompt_len, endpoint=True)).tolist() for _ in range(n)]
        responses = [rng.integers(3, vocab, rng.integers(*response_len, endpoint=True)).tolist() for _ in range(n)]
    sequences = [p + r for p, r in zip(prompts, responses)]
    lengths = [len(p) for p in prompts]
    budget = budget or max(len(s) for s in sequences) * 4
    old = compute_token_logprobs(model, sequences, lengths, budget, temperature, progress=False)
    ref = old if ref_model_dir is None else compute_token_logprobs(
        load_causal_lm(ref_model_dir, torch.device(device), torch_dtype, session=disk), sequences, lengths, budget, temperature,
        progress=False)

    def noise(k: int, scale: float = 1.0) -> list[float]:
        return (rng.standard_normal(k) * scale).astype(np.float32).tolist()

    values = [noise(len(r), 0.1) for r in responses]
    advantages = [noise(len(r), advantage_scale) for r in responses]
    returns = [[a + v for a, v in zip(adv, val)] for adv, val in zip(advantages, values)]
    cols = {
        "prompt_id": [f"p{i}" for i in range(n)], "sample_index": [0] * n, "iteration": [iteration] * n,
        "data_source": ["synthetic"] * n, "ground_truth": [""] * n, "prompt_token_ids": prompts,
        "response_text": [""] * n, "response_token_ids": responses, "response_length": [len(r) for r in responses],
        "finish_reason": ["offline"] * n, "engine": ["offline"] * n, "sampling_seed": [seed] * n,
        "reward_source": ["synthetic"] * n, "extra_info": ["{}"] * n, "uid": [f"{iteration}-{i}" for i in range(n)],
        "rollout_log_probs": [t.float().tolist() for t in old],  # as an fp32 hf rollout records them: the old log-probs
        "reward": [0.0] * n, "reward_extra": ["{}"] * n, "old_log_probs": [t.float().tolist() for t in old],
        "ref_log_probs": [t.float().tolist() for t in ref], "values": values, "reward_baseline": [None] * n,
        "token_level_rewards": [[0.0] * len(r) for r in responses], "advantages": advantages, "returns": returns,
    }
    for field in ADVANTAGES:  # optional columns (rollout log-probs, rollout correction, ...) stay null
        cols.setdefault(field.name, pa.nulls(n, field.type))
    return pa.table(cols).select(ADVANTAGES.names).cast(ADVANTAGES)
