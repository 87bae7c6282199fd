"""Fit a validated config to this machine: what it cannot act on falls back, saying so, or is
refused at once with the key and the fix (before any stage runs or run directory is made).

    setting                        without CUDA                       with CUDA
    rollout.name=vllm              vllm with the vllm-cpu build,      vllm (needs the vllm extra)
                                   else falls back to hf (one line)
    trainer.n_gpus_per_node=N      one process (one line when N > 1)  refused when N > visible GPUs
    trainer.nnodes > 1             needs Ray (the ray extra): its      the same
                                   cluster places the ranks (one line)
    trainer.device=cuda            refused                            cuda

vLLM on CPU is also checked here, before anything starts: the actor's attention head size must be one
its CPU kernels take, and VLLM_CPU_KVCACHE_SPACE, when set, a whole number of GiB (at least 1) that
the RAM holds (``vllm_cpu_problems``).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import os
from typing import Optional

import psutil

from rlhf_core.config.errors import ConfigError
from rlhf_core.notes import say_once
from rlhf_core.config.resolve import ray_address, update_world_size
from rlhf_core.config.schema import RLHFConfig
from rlhf_core.models.tiny import TinyModelSpec
from rlhf_core.paths import TINY, ModelNotFoundError, locate_model

VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""The attention head sizes vLLM 0.32's CPU kernels take (``CPUAttentionBackend.get_supported_head_sizes``;
a `make test-vllm` test compares). Kept here because importing vLLM to ask takes seconds; any other
size fails at the first generate ("Unsupported CPU attention configuration")."""
CPU_KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
CPU_KV_CACHE_HINT = (f"on CPU the vLLM engine's KV cache is {CPU_KV_CACHE_ENV} GiB when set (a whole number, at "
                     "least 1, that fits the free RAM), else sized for one rollout at full length (at most a "
                     "quarter of RAM); actor_rollout_ref.rollout.gpu_memory_utilization does not size it on CPU")
"""The project's own advice for the KV cache on CPU (vLLM's says to raise gpu_memory_utilization,
which the CPU engine ignores once the KV cache has a size, as it always has here)."""


def cuda_devices() -> int:
    """Visible CUDA devices (0 on a CPU machine). torch is imported here, not with the module: loading
    a config must not cost torch's import (1.7 s on a 2-core machine) to a command that only reads a
    run (``rlhf status``)."""
    import torch

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
    if r.name == "vllm" and not on_gpu:
        problems = vllm_cpu_problems(cfg.actor_rollout_ref.model.path, os.environ.get(CPU_KV_CACHE_ENV),
                                     psutil.virtual_memory().total)
        if problems:
            raise ConfigError("; ".join(problems))
    if r.name == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError("actor_rollout_ref.rollout.name=vllm: vLLM is not installed; "
                          "`pip install -e '.[vllm]'` or use actor_rollout_ref.rollout.name=hf")
    if r.name == "vllm" and r.tensor_model_parallel_size > 1 and t.resident_models \
            and update_world_size(t, gpus if on_gpu else 0) == 1:
        say_once(tensor_parallel_note(r.tensor_model_parallel_size, on_gpu))
    return cfg


def vllm_cpu_build() -> bool:
    """Whether the installed vLLM is its CPU build (the ``vllm-cpu`` distribution), read from the
    package metadata: importing vLLM itself takes seconds."""
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return importlib.util.find_spec("vllm") is not None


def vllm_cpu_problems(model: str, kv_cache_gib: Optional[str], ram_bytes: int) -> list[str]:
    """What keeps vLLM's CPU engine from running the actor ``model`` here: its attention head size
    (``head_size_problem``) and the ``VLLM_CPU_KVCACHE_SPACE`` value (``cpu_kv_cache_problem``)."""
    found = attention_head_size(model)
    problems = [head_size_problem(model, *found, VLLM_CPU_HEAD_SIZES)] if found else []
    return [p for p in (*problems, cpu_kv_cache_problem(kv_cache_gib, ram_bytes)) if p]


def attention_head_size(model: str) -> Optional[tuple[int, str]]:
    """(head size, how it follows from the config) of model ``model``, read from its config.json
    (the tiny model's spec while it is not built yet); None when the model or its config cannot be
    found (the input check says so)."""
    try:
        config_path = locate_model(model) / "config.json"
    except ModelNotFoundError:
        return None
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
        except (OSError, ValueError):
            return None
        config = config.get("text_config") or config  # a multimodal config keeps the LM's in text_config
    elif model == TINY:
        config = dataclasses.asdict(TinyModelSpec())
    else:
        return None
    heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
    if config.get("head_dim"):
        return int(config["head_dim"]), "head_dim"
    if heads and hidden:
        return hidden // heads, f"hidden_size {hidden} / {heads} heads"
    return None


def head_size_problem(model: str, head_size: int, how: str, supported: tuple[int, ...] | list[int]) -> Optional[str]:
    """None when vLLM's CPU attention takes ``head_size``, else the one-line reason with the fix."""
    if head_size in supported:
        return None
    tiny = (" (the tiny model with 2 heads of 32: `rlhf model build-tiny --out DIR --heads 2 --kv-heads 1`, "
            "then actor_rollout_ref.model.path=DIR)")
    return (f"actor_rollout_ref.rollout.name=vllm on CPU: model {model!r} has attention head size {head_size} "
            f"({how}) and vLLM's CPU attention takes {', '.join(map(str, supported))} only; use a model with one "
            f"of those{tiny if model == TINY else ''}, or actor_rollout_ref.rollout.name=hf")


def cpu_kv_cache_problem(value: Optional[str], ram_bytes: int) -> Optional[str]:
    """None when ``VLLM_CPU_KVCACHE_SPACE`` is unset or a size vLLM can allocate here, else why not.
    vLLM reads it with int(): '1.5' fails, and 0 leaves no room for a single block."""
    if value is None or value == "":
        return None
    ram_gib = ram_bytes / 2 ** 30
    try:
        gib = int(value)
    except ValueError:
        gib = None
    if gib is None or gib < 1:
        why = "is not a whole number of GiB" if gib is None else "leaves the KV cache no room"
    elif gib > ram_gib:
        why = f"is more than this machine's {ram_gib:.1f} GiB of RAM"
    else:
        return None
    return (f"{CPU_KV_CACHE_ENV}={value} {why}: {CPU_KV_CACHE_HINT}; set {CPU_KV_CACHE_ENV}=1 (GiB; "
            "the Makefile's value for these tests) or unset it")


def tensor_parallel_note(tp: int, on_gpu: bool) -> str:
    """What vLLM tensor parallel costs with one update process (docs/vllm.md, "Tensor parallel")."""
    world = f"trainer.n_gpus_per_node={tp}" if on_gpu else f"trainer.nproc={tp}"
    return (f"config: actor_rollout_ref.rollout.tensor_model_parallel_size={tp} with one update process: every rollout "
            f"and validation starts its vLLM engines afresh in {tp} processes of their own, and every iteration is "
            f"checkpointed for them (docs/vllm.md: ~70 s a launch for the tiny model on 2 CPU cores, 1-2 s on a kept "
            f"engine); an update of {tp} processes ({world}) keeps one engine on its ranks for the whole run")


def check_nodes(cfg: RLHFConfig) -> None:
    """A multi-node update's ranks are placed by a Ray cluster (``training.ray_ranks``): Ray must be
    installed (looked up, not imported: it loads in seconds); how the ranks live is said once."""
    t = cfg.trainer
    if importlib.util.find_spec("ray") is None:
        raise ConfigError(f"trainer.nnodes={t.nnodes}: the update's nodes are a Ray cluster and Ray is not installed "
                          "here; install the ray extra (pip install -e '.[ray]', on every node) or use trainer.nnodes=1")
    address = ray_address(t, os.environ)
    if t.resident_models and cfg.actor_rollout_ref.rollout.name == "hf":
        say_once(f"config: trainer.nnodes={t.nnodes}: Ray places the update's ranks on {t.nnodes} nodes of the "
                 f"cluster at {address!r}, one worker group for the whole run")
    elif t.resident_models:
        say_once(f"config: trainer.nnodes={t.nnodes} with rollout engine {cfg.actor_rollout_ref.rollout.name!r}: "
                 f"Ray places the update's ranks on {t.nnodes} nodes of the cluster at {address!r} afresh each "
                 "iteration (a worker group keeps vLLM engines on one machine only)")