"""The fingerprint of a state's trained weights that its lineage record keeps (``weights_sample`` in
``iter_k/state.json``, ``training.lineage``): a replay that does not reproduce it stops."""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch

SAMPLE_POINTS = 64
"""Elements taken from each tensor for ``weights_sample``: enough that any real divergence shows."""


def weights_sample(modules: Sequence[torch.nn.Module]) -> str:
    """sha256 over every parameter and buffer (by name, in order) of its float64 sum and of
    ``SAMPLE_POINTS`` evenly strided elements: one pass at memory speed, no copy of the weights, and
    it changes when a replayed step differs anywhere (the sum also sees the few embedding rows one
    batch touches, which a sample alone would miss). A ZeRO-3 parameter is read as this rank's
    partition: its full tensor exists only while gathered, and what a state dict shows of it
    depends on what ran before, not on the weights; the partition is the same on every path to the
    same state. Rank 0's sample is the one recorded and checked."""
    h = hashlib.sha256()
    for module in modules:
        params = dict(module.named_parameters(remove_duplicate=False))  # tied names too
        for name, tensor in module.state_dict().items():
            partition = getattr(params.get(name), "ds_tensor", None)
            flat = (tensor if partition is None else partition).detach().reshape(-1)
            if flat.numel() == 0:
                continue
            stride = max(1, flat.numel() // SAMPLE_POINTS)
            h.update(name.encode())
            h.update(torch.sum(flat, dtype=torch.float64).cpu().numpy().tobytes())
            h.update(flat[::stride].float().cpu().numpy().tobytes())
    return h.hexdigest()
