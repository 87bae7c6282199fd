"""vLLM engine (GPU): ``vllm.LLM`` on the actor checkpoint directory, generating from token ids.

vLLM is imported only here, when this engine is built (its wheels are CUDA-only). API used (vLLM
0.32 / 0.33): ``LLM(model, tokenizer, tensor_parallel_size, gpu_memory_utilization, dtype, seed,
max_model_len, enable_sleep_mode)``, ``SamplingParams(n, temperature, top_p, top_k, max_tokens, seed,
skip_special_tokens)``, prompts as ``vllm.inputs.TokensPrompt(prompt_token_ids=...)``, and per
output ``.outputs[j].token_ids`` / ``.text`` / ``.finish_reason``.

vLLM schedules its own continuous batches, so the rollout sends a whole iteration in one call. Each
prompt gets its own seed, derived from the call's seed and the prompt's position: per-request seeds
make the samples reproducible, and distinct ones keep different prompts from sharing random draws.

Resident engine (``sleep_mode=True``): one engine for the whole run, as verl and OpenRLHF keep it.
During the update it sleeps (``LLM.sleep(level=1)``: weights copied to host memory, KV cache
dropped, so the trainer gets the GPU memory back); afterwards the updated actor weights go in place
(``load_weights``: Hugging Face names, no disk round trip) and it wakes, weights first and KV cache
second (``LLM.wake_up(tags=["weights"])`` then ``["kv_cache"]``, verl's order: the KV cache, the big
allocation, only comes back once the new weights are in). Weights reach the model through
``LLM.collective_rpc(fn)``, which calls ``fn(worker)`` on every vLLM worker. For that call to take
tensors by reference, the resident engine runs vLLM's engine core in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, as verl does for its in-process rollout); with one GPU the worker is
then in this process too and ``load_weights`` copies nothing but the GPU-to-GPU ``param.copy_``.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator, Optional

from rlhf_core.errors import RLHFError
from rlhf_core.rollout.base import (
    FINISH_LENGTH, FINISH_STOP, GeneratedSample, SamplingParams, copies_of_greedy, derive_seed, eos_token_ids,
    trim_response,
)

if TYPE_CHECKING:
    import torch

VLLM_MAX_TEMPERATURE = 2.0  # vLLM's SamplingParams rejects temperature > 2
VLLM_NEEDED = "0.32"  # the floor of the `vllm` extra in pyproject.toml
VLLM_WRITTEN_FOR = "0.33"  # the newest release whose LLM.sleep / wake_up(tags) / collective_rpc this follows
IN_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"

# Wrappers that prefix a module's parameter names: DeepSpeed / DDP (`module.`), torch.compile
# (`_orig_mod.`), FSDP and activation checkpointing. None of them is part of a Hugging Face name.
_WRAPPER_PREFIX = re.compile(r"^(module\.)+")
_RELEASE = re.compile(r"\d+(\.\d+)*")
_WRAPPER_INFIX = re.compile(r"(^|\.)(_orig_mod|_fsdp_wrapped_module|_checkpoint_wrapped_module)\.")


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


# --- pure helpers (no vLLM, no GPU: tested on CPU) ---------------------------------------------------

def version_at_least(found: str, needed: str) -> bool:
    """``found >= needed`` by release numbers; local tags and pre-releases of a release count as that
    release (a ``0.32.0+cu128`` or ``0.32.1rc1.dev5`` wheel is a 0.32). Unreadable: False."""
    def release(version: str) -> Optional[tuple[int, ...]]:
        match = _RELEASE.match(version.strip().lstrip("v"))
        return tuple(int(part) for part in match.group(0).split(".")) if match else None

    have, want = release(found), release(needed)
    if have is None or want is None:
        return False
    width = max(len(have), len(want))  # 0.32 == 0.32.0
    return have + (0,) * (width - len(have)) >= want + (0,) * (width - len(want))


def missing_resident_api(llm_cls: type) -> list[str]:
    """The calls of ``vllm.LLM`` the resident engine uses that ``llm_cls`` lacks (empty: all there)."""
    missing = [f"LLM.{name}" for name in ("sleep", "wake_up", "collective_rpc", "reset_prefix_cache")
               if not callable(getattr(llm_cls, name, None))]
    wake_up = getattr(llm_cls, "wake_up", None)
    if callable(wake_up) and "tags" not in inspect.signature(wake_up).parameters:
        missing.append("LLM.wake_up(tags=...)")  # older vLLM wakes everything at once
    return missing


def resident_api_error(found: str, missing: list[str]) -> str:
    """The one-line refusal for a vLLM without the resident engine's calls: an old one is upgraded,
    a newer one that renamed them is pinned back to the versions this module was written against."""
    if version_at_least(found, VLLM_NEEDED):
        fix = f"install vllm=={VLLM_WRITTEN_FOR}.* (the API this engine was written against)"
    else:
        fix = f"upgrade to vLLM >= {VLLM_NEEDED} (pip install 'rlhf-dag[vllm]')"
    return (f"vLLM {found} lacks {', '.join(missing)}, which the resident vllm rollout engine needs: {fix}, "
            "or set trainer.resident_models=false to build a fresh engine per rollout")


def hf_weight_name(name: str) -> str:
    """A trainer-side parameter name as the Hugging Face checkpoint spells it (the names vLLM's
    ``model.load_weights`` maps onto its fused layers): wrapper prefixes dropped."""
    return _WRAPPER_INFIX.sub(r"\1", _WRAPPER_PREFIX.sub("", name))


def prepare_named_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                          to_cpu: bool = False) -> list[tuple[str, torch.Tensor]]:
    """(Hugging Face name, detached tensor) pairs for ``load_weights``, refusing what would load wrong.

    A ZeRO-3 parameter outside ``GatheredParameters`` is an empty placeholder (its shard lives in
    ``ds_tensor``); loading it would fail deep inside vLLM's fused-layer loaders, so it is refused
    here by name. Two names that map to one Hugging Face name (``module.x`` and ``x``) are refused:
    which one wins would be an accident of order. ``to_cpu`` makes host copies, for workers in
    other processes (tensor parallel), which cannot take this process's CUDA memory.
    """
    out: list[tuple[str, torch.Tensor]] = []
    seen: dict[str, str] = {}
    for name, tensor in named_tensors:
        hf_name = hf_weight_name(name)
        if hf_name in seen:
            raise RLHFError(f"load_weights got two tensors for {hf_name!r} ({seen[hf_name]!r} and {name!r}); "
                            "pass each parameter once")
        seen[hf_name] = name
        if tensor.numel() == 0:
            raise RLHFError(f"load_weights got an empty tensor for {name!r} (a ZeRO-3 partition?): gather it "
                            "first (deepspeed.zero.GatheredParameters) and pass the full tensor")
        tensor = tensor.detach()
        out.append((hf_name, tensor.cpu() if to_cpu else tensor))
    if not out:
        raise RLHFError("load_weights got no tensors: pass the actor's (name, tensor) pairs, e.g. "
                        "model.named_parameters()")
    return out


def _load_into_worker(worker, weights: list) -> int:
    """Runs on each vLLM worker (``collective_rpc``): weights into its model, in place. Returns the
    number of vLLM parameters written (fused layers take several Hugging Face tensors each)."""
    import torch

    model = worker.get_model() if callable(getattr(worker, "get_model", None)) else worker.model_runner.model
    device = next(model.parameters()).device
    try:
        # vLLM's loaders map the HF names onto fused qkv / gate_up layers, shard for tensor
        # parallelism and cast to the engine's dtype while copying into the existing storage
        loaded = model.load_weights(weights=((name, t.to(device, non_blocking=True)) for name, t in weights))
    except (KeyError, ValueError) as exc:  # a name the vLLM model has no parameter for
        raise RLHFError(f"vLLM's {type(model).__name__} cannot load these weights ({exc}): pass the actor's "
                        "Hugging Face parameter names (model.named_parameters() of the causal LM)") from exc
    torch.cuda.synchronize(device)  # the copies are done when load_weights returns (and can be timed)
    return len(loaded) if loaded is not None else len(weights)


# --- the engine -----------------------------------------------------------------------------------

class VLLMEngine:
    """``vllm.LLM`` over the actor's Hugging Face checkpoint directory.

    ``sleep_mode=True`` builds the resident engine (module docstring): ``sleep``, ``wake_up`` and
    ``load_weights`` become available; generation is unchanged.
    """

    name = "vllm"
    schedules_own_batches = True

    def __init__(self, model_path: str | Path, *, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.5, dtype: str = "auto", seed: int = 0,
                 max_model_len: Optional[int] = None, tokenizer_path: Optional[str | Path] = None,
                 sleep_mode: bool = False):
        reason = vllm_unavailable_reason()
        if reason:
            raise RLHFError(f"cannot start the vllm rollout engine: {reason}")
        import vllm
        from transformers import AutoTokenizer, GenerationConfig
        from vllm import LLM

        if sleep_mode and (missing := missing_resident_api(LLM)):
            raise RLHFError(resident_api_error(getattr(vllm, "__version__", "(unknown version)"), missing))
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or model_path)
        try:
            generation_config = GenerationConfig.from_pretrained(model_path)
        except OSError:  # no generation_config.json: the tokenizer's EOS is the only stop token
            generation_config = None
        # vLLM also stops on the generation config's EOS list (and keeps that token in token_ids)
        self.eos_ids = eos_token_ids(self.tokenizer, generation_config)
        self.sleep_mode = sleep_mode
        self.tensor_parallel_size = tensor_parallel_size
        self._asleep: tuple[str, ...] = ()  # memory tags now asleep: (), ("kv_cache",) or both
        with _engine_core_in_this_process() if sleep_mode else contextlib.nullcontext():
            self.llm = LLM(
                model=str(model_path), tokenizer=str(tokenizer_path or model_path),
                tensor_parallel_size=tensor_parallel_size, gpu_memory_utilization=gpu_memory_utilization,
                dtype={"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(dtype, dtype),
                seed=seed, max_model_len=max_model_len,
                **({"enable_sleep_mode": True} if sleep_mode else {}),
            )
        # An explicit SamplingParams per request is used as given: vLLM applies the checkpoint's
        # generation-config sampling defaults only when generate() gets no sampling params.

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams) -> list[GeneratedSample]:
        """Sample ``sampling.n`` responses per prompt; returns len(prompts) × n samples in order."""
        from vllm.inputs import TokensPrompt

        if not prompt_token_ids:
            return []
        if self._asleep:
            raise RLHFError("the vllm rollout engine is asleep: call wake_up() (or load_weights) before generate")
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

    # --- resident engine: sleep / wake / weights in place -------------------------------------------

    @property
    def asleep(self) -> bool:
        """True between ``sleep()`` and the end of the next ``wake_up()`` / ``load_weights()``."""
        return bool(self._asleep)

    def sleep(self) -> None:
        """Level 1: weights to host memory, KV cache discarded (its contents are recomputed from the
        prompts: the prefix cache is reset first). Idempotent."""
        import gc

        import torch

        self._require_sleep_mode("sleep")
        if self._asleep:
            return
        self.llm.sleep(level=1)
        self._asleep = ("weights", "kv_cache")
        # the engine core runs in this process: give torch's cached blocks (sampling buffers,
        # activations of the last step) back to the device as well, for the trainer
        gc.collect()
        torch.cuda.empty_cache()

    def wake_up(self) -> None:
        """Weights (if still asleep) and KV cache back on the GPU; generation works again. Idempotent."""
        self._require_sleep_mode("wake_up")
        if self._asleep == ("weights", "kv_cache"):
            self.llm.wake_up(tags=["weights"])  # weights first, then the big KV allocation
            self._asleep = ("kv_cache",)
        if self._asleep == ("kv_cache",):
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = ()

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Write the actor's weights into the engine's model in place, from memory.

        ``named_tensors``: (Hugging Face parameter name, full tensor) pairs, e.g. the updated actor's
        ``named_parameters()`` (DeepSpeed's ``module.`` prefix is dropped; ZeRO-3 parameters must be
        gathered); any device, any float dtype (cast to the engine's). A subset updates just those.
        A sleeping engine wakes its weights, takes the new ones, then wakes its KV cache; an awake
        one loads and drops its prefix cache (cached KV was computed with the old weights). The
        engine is awake afterwards.
        """
        self._require_sleep_mode("load_weights")
        weights = prepare_named_tensors(named_tensors, to_cpu=self.tensor_parallel_size > 1)
        if "weights" in self._asleep:
            self.llm.wake_up(tags=["weights"])
            self._asleep = ("kv_cache",)
        self.llm.collective_rpc(_load_into_worker, args=(weights,))
        if self._asleep:
            self.wake_up()  # the KV cache comes back empty: nothing stale in it
        else:
            self.llm.reset_prefix_cache()

    @staticmethod
    def gpu_memory_in_use() -> int:
        """Bytes in use on the current CUDA device, by every process (``torch.cuda.mem_get_info``:
        vLLM's sleep-mode pool allocates outside torch's caching allocator, so torch's own counters
        would not see what sleep frees)."""
        import torch

        free, total = torch.cuda.mem_get_info()
        return int(total - free)

    def close(self) -> None:
        import gc

        import torch

        self.llm = None
        self._asleep = ()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # -------------------------------------------------------------------------------------------

    def _require_sleep_mode(self, call: str) -> None:
        if not self.sleep_mode:
            raise RLHFError(f"VLLMEngine.{call}() needs the resident engine: build it with sleep_mode=True")

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


@contextlib.contextmanager
def _engine_core_in_this_process() -> Iterator[None]:
    """While a resident engine is built: vLLM's engine core (and, with one GPU, its worker) in this
    process, so ``collective_rpc`` hands the worker our tensors by reference. The variable is
    restored afterwards; engines built later choose for themselves."""
    import vllm.envs as envs

    previous = os.environ.get(IN_PROCESS_ENV)
    os.environ[IN_PROCESS_ENV] = "0"
    try:
        # vLLM freezes its environment once an engine core has started in a process
        if envs.VLLM_ENABLE_V1_MULTIPROCESSING:
            raise RLHFError(f"vLLM already fixed {IN_PROCESS_ENV}=1 in this process (an engine started earlier): "
                            f"set {IN_PROCESS_ENV}=0 in the environment before the first vLLM engine starts")
        yield
    finally:
        if previous is None:
            os.environ.pop(IN_PROCESS_ENV, None)
        else:
            os.environ[IN_PROCESS_ENV] = previous
