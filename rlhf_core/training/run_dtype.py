"""A run keeps the dtype it trained in: ``deepspeed_config.dtype=auto`` is resolved per machine (bf16
where it pays), so a run resumed on another machine, or with ``RLHF_CPU_BF16`` set the other way,
would resolve it differently and mix dtypes — its replay of a pruned checkpoint misses and the
resume falls back, retraining in fp32 from bf16 weights, without a word about why.

The dtype each role trained in is recorded with every checkpoint (``deepspeed/{role}_state.json``'s
"dtype", written by the update). A resume reads it from the newest committed checkpoint on disk
(``recorded_dtypes``) and ``keep_recorded_dtype`` makes ``auto`` resolve to it again — on a CPU by
setting ``hardware.CPU_BF16_ENV``, the one input of that choice besides the model, which every
process the run starts inherits — or refuses in one line naming both dtypes where a configured
dtype, or a GPU, disagrees. The config is not touched: its hash names the iterations' lineage.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

from rlhf_core.config import ConfigError, RLHFConfig
from rlhf_core.config.resolve import role_model_key
from rlhf_core.config.validate import effective_deepspeed
from rlhf_core.run.layout import RunDir
from rlhf_core.run.lifecycle import committed_iterations
from rlhf_core.training import hardware
from rlhf_core.training.ds_config import model_largest_matrix, resolve_device, resolve_dtype
from rlhf_core.training.hardware import CPU_BF16_ENV

ROLE_KEYS = {"actor": "actor_rollout_ref.actor.deepspeed_config.dtype", "critic": "critic.deepspeed_config.dtype"}


def recorded_dtypes(run: RunDir) -> tuple[Optional[Path], dict[str, str]]:
    """(the newest committed checkpoint on disk, {role: the dtype it trained in}); (None, {}) when
    no committed checkpoint is on disk (nothing trained is kept yet)."""
    for k in reversed(committed_iterations(run)):
        directory = run.checkpoint(k) / "deepspeed"
        found = {}
        for role in ROLE_KEYS:
            try:
                found[role] = json.loads((directory / f"{role}_state.json").read_text())["dtype"]
            except (OSError, ValueError, KeyError, TypeError):
                continue  # no such role (no critic), or damaged: the resume's checks name that file
        if found:
            return run.checkpoint(k), found
    return None, {}


def keep_recorded_dtype(cfg: RLHFConfig, run: RunDir) -> None:
    """Make the resume of ``run`` train in the dtypes its checkpoints recorded (see the module),
    saying so once when ``auto`` would now choose another; ``ConfigError`` where it cannot."""
    checkpoint, recorded = recorded_dtypes(run)
    if checkpoint is None:
        return
    device = resolve_device(cfg.trainer.device)
    where = checkpoint.relative_to(run.root)
    for role, dtype in recorded.items():
        key = ROLE_KEYS[role]
        configured = effective_deepspeed(cfg, role).dtype
        if configured != "auto":
            if configured != dtype:
                raise ConfigError(
                    f"{key}={configured}, but this run trained in {dtype} (recorded with {where}): resuming would "
                    f"mix dtypes; resume with {key}={dtype} (or auto), or start a new run to train in {configured}")
            continue
        now = resolve_dtype("auto", device, model_largest_matrix(role_model_key(cfg, role)))
        if now == dtype:
            continue
        if device != "cpu":
            raise ConfigError(
                f"{key}=auto chooses {now} on this {device} machine, but this run trained in {dtype} (recorded with "
                f"{where}): resuming would mix dtypes; resume it on a machine of the kind it ran on, or start a new run")
        said = os.environ.get(CPU_BF16_ENV)
        os.environ[CPU_BF16_ENV] = "1" if dtype == "bf16" else "0"
        why = (f"{CPU_BF16_ENV}={said}" if said in ("0", "1")
               else f"this CPU ({hardware.cpu_description()[0]})")
        print(f"rlhf: warning: {key}=auto would choose {now} here ({why}), but this run trained in {dtype} "
              f"(recorded with {where}): kept {dtype}, as every process of the run will; a new run chooses afresh",
              file=sys.stderr)
