"""Actor and critic as DeepSpeed engines: model loading (LoRA included), client AdamW, LR schedule, step.

The actor is a causal LM; the critic the same backbone family with a one-output token-classification
head (``AutoModelForTokenClassification``, num_labels=1, as verl does). Dropout is switched off in
both: the old log-probs and values were computed without it, so with dropout the PPO ratio would not
start at 1. The reference model is not needed here: the update reads ``ref_log_probs`` from the
advantages table. With LoRA the reference is the base model with the adapters disabled
(``reference_logprobs``), never a second copy.

Loading for ZeRO-3: both loaders take the engine's DeepSpeed config (``ds_config=``); at stage 3 a
``transformers`` ``HfDeepSpeedConfig`` is kept alive while ``from_pretrained`` runs, which makes it
build the model under ``deepspeed.zero.Init`` — every parameter is partitioned as it is created, so
no rank ever holds the whole model (7 B bf16 = 15 GB per rank otherwise, before ZeRO cuts it) —
and is dropped right after, so later loads in the same process (scoring's frozen models) stay whole.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from rlhf_core.config.schema import ModelConfig, OptimConfig
from rlhf_core.models import sdpa_varlen as _sdpa_varlen  # noqa: F401  (registers attn_implementation=sdpa_varlen)
from rlhf_core.models.chat import train_every_token_embedding
from rlhf_core.models.storage import load_pretrained, own_aligned_storage
from rlhf_core.training.ds_config import uses_cpu_adam, zero3


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    alpha: int
    target_modules: str
    """'all-linear' or a comma-separated list of module names."""

    @classmethod
    def from_config(cls, model_cfg: ModelConfig) -> Optional["LoraSettings"]:
        if model_cfg.lora_rank <= 0:
            return None
        return cls(model_cfg.lora_rank, model_cfg.lora_alpha, model_cfg.target_modules)

    def peft_config(self):
        from peft import LoraConfig, TaskType

        targets: Any = self.target_modules
        if targets != "all-linear":
            targets = [t.strip() for t in targets.split(",") if t.strip()]
        return LoraConfig(r=self.rank, lora_alpha=self.alpha, target_modules=targets, lora_dropout=0.0,
                          bias="none", task_type=TaskType.CAUSAL_LM)


def disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Set every dropout probability to 0 (nn.Dropout modules and attention-dropout attributes)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    return model


def _prepare(model: torch.nn.Module, gradient_checkpointing: bool) -> torch.nn.Module:
    disable_dropout(model)
    train_every_token_embedding(model)  # pad == EOS: the end-of-turn token's embedding trains too
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    return model.train()


@contextlib.contextmanager
def zero3_init(ds_config: Optional[dict]) -> Iterator[None]:
    """While open, ``from_pretrained`` builds models under ``deepspeed.zero.Init`` with ``ds_config``
    when it is a ZeRO-3 config (transformers honours a live ``HfDeepSpeedConfig``); otherwise nothing."""
    if ds_config is None or not zero3(ds_config):
        yield
        return
    from transformers.integrations import HfDeepSpeedConfig, unset_hf_deepspeed_config

    live_config = HfDeepSpeedConfig(ds_config)  # transformers holds only a weak reference: keep it
    try:
        yield
    finally:
        unset_hf_deepspeed_config()
        del live_config


def _partitioned_for(load: Callable[..., torch.nn.Module]) -> Callable[..., torch.nn.Module]:
    """Give a loader a ``ds_config=`` keyword: the load runs inside ``zero3_init(ds_config)``."""
    @functools.wraps(load)
    def wrapped(*args: Any, ds_config: Optional[dict] = None, **kwargs: Any) -> torch.nn.Module:
        with zero3_init(ds_config):
            return load(*args, **kwargs)

    return wrapped


@_partitioned_for
def load_actor_model(path: str | Path, dtype: torch.dtype, *, lora: Optional[LoraSettings] = None,
                     adapter_path: Optional[Path] = None, gradient_checkpointing: bool = False,
                     seed: int = 0, attention: str = "sdpa") -> torch.nn.Module:
    """The trainable actor. With ``lora``: ``path`` is the frozen base, adapters come from
    ``adapter_path`` (a previous iteration's) or are freshly initialised from ``seed``. ``attention``:
    the implementation scoring and the guard use too (``rlhf_core.models.attention``), so the first
    step's ratio compares log-probs from one kernel."""
    from transformers import AutoModelForCausalLM

    model = load_pretrained(AutoModelForCausalLM, path, dtype=dtype, attn_implementation=attention)
    if lora is not None:
        from peft import PeftModel, get_peft_model

        if gradient_checkpointing:
            model.enable_input_require_grads()  # frozen embeddings: checkpointed blocks still need grad
        if adapter_path is not None:
            model = PeftModel.from_pretrained(model, adapter_path, is_trainable=True)
        else:
            torch.manual_seed(seed)
            model = get_peft_model(model, lora.peft_config())
        own_aligned_storage(model)  # the adapters read from their file
    return _prepare(model, gradient_checkpointing)


@_partitioned_for
def load_critic_model(path: str | Path, dtype: torch.dtype, *, gradient_checkpointing: bool = False,
                      attention: str = "sdpa"):
    from transformers import AutoModelForTokenClassification

    model = load_pretrained(AutoModelForTokenClassification, path, num_labels=1, dtype=dtype,
                            attn_implementation=attention)
    return _prepare(model, gradient_checkpointing)


def lr_schedule(kind: str, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0,
                num_cycles: float = 0.5) -> Callable[[int], float]:
    """The LR multiplier at training step ``step`` (0-based: iteration k trains at step k - 1), as
    verl's ``get_constant_schedule_with_warmup`` / ``get_cosine_schedule_with_warmup`` compute it:

        warm-up (step < W):  step / max(1, W)        (so the first step trains at lr 0 when W > 0)
        constant:            1
        cosine:              max(m, (1 + m)/2 + (1 - m)/2 · cos(2π · num_cycles · p)),
                             p = (step - W) / max(1, total_steps - W),  m = min_lr_ratio
    """
    if kind not in ("constant", "cosine"):
        raise ValueError(f"unknown lr schedule {kind!r}; valid: ['constant', 'cosine']")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return float(step) / float(max(1, warmup_steps))
        if kind == "constant":
            return 1.0
        progress = float(step - warmup_steps) / float(max(1, total_steps - warmup_steps))
        wave = math.cos(math.pi * float(num_cycles) * 2.0 * progress)
        return max(min_lr_ratio, (1 + min_lr_ratio) * 0.5 + (1 - min_lr_ratio) * 0.5 * wave)

    return factor


@dataclass
class TrainEngine:
    """One trained model: the DeepSpeed engine, the client optimizer it steps, the LR schedule.

    The schedule moves once per training step (iteration), as verl steps its scheduler once per
    update call: every optimizer step of one iteration uses the same lr, ``base · schedule(step)``
    with ``lr_schedule_step`` = the training steps this role has already been updated in."""

    role: str  # "actor" | "critic"
    engine: Any  # deepspeed.DeepSpeedEngine
    schedule: Callable[[int], float]
    base_lrs: list[float]
    """optim.lr per parameter group, from the current config (a retry with a smaller lr takes effect)."""
    dtype: str  # "fp32" | "bf16" | "fp16"
    lora: Optional[LoraSettings] = None
    lr_schedule_step: int = 0
    trainable: frozenset[str] = frozenset()
    """Names of the parameters the optimizer trains, fixed when the engine is built: a module lent
    to the stages has its gradients switched off meanwhile (``training.resident``)."""

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def zero_stage(self) -> int:
        return int(self.engine.zero_optimization_stage())

    @property
    def base_optimizer(self) -> torch.optim.Optimizer:
        """The torch AdamW that holds the state (ZeRO wraps it; stage 0 fp32 uses it directly)."""
        opt = self.engine.optimizer
        return getattr(opt, "optimizer", opt)

    def named_trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.module.named_parameters() if n in self.trainable]

    @property
    def lr(self) -> float:
        return float(self.base_optimizer.param_groups[0]["lr"])

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate ``loss``'s gradients. One process at ZeRO 0 skips DeepSpeed's gradient
        all-reduce, which would flatten every gradient into one buffer, reduce it over a group of one
        and copy it back (~40 ms a tensor at 60 M parameters on a CPU) to leave the same values."""
        alone = self.zero_stage == 0 and int(getattr(self.engine, "dp_world_size", 1)) == 1
        with self.engine.no_sync() if alone else contextlib.nullcontext():
            self.engine.backward(loss)

    def set_lr_schedule_step(self, step: int) -> None:
        """Put the schedule at training step ``step`` (the lr of every following optimizer step)."""
        self.lr_schedule_step = int(step)
        for group, base in zip(self.base_optimizer.param_groups, self.base_lrs):
            group["lr"] = base * self.schedule(self.lr_schedule_step)

    def finish_training_step(self) -> None:
        """The role's update of this iteration is done: the next iteration trains at the next lr."""
        self.set_lr_schedule_step(self.lr_schedule_step + 1)


def present(*engines: Optional[TrainEngine]) -> list[TrainEngine]:
    """The engines a run has, in role order (actor, critic): a critic-free run passes critic=None."""
    return [te for te in engines if te is not None]


def make_optimizer(params: list[torch.nn.Parameter], optim: OptimConfig, *, cpu_adam: bool) -> torch.optim.Optimizer:
    """The client optimizer: torch's AdamW, or with ``cpu_adam`` (optimizer offload on CUDA,
    ``ds_config.uses_cpu_adam``) DeepSpeed's ``DeepSpeedCPUAdam`` in AdamW mode — the same update
    rule (decoupled weight decay, eps 1e-8), with a vectorised C++ step for the host-held fp32 state.
    Not on a CPU-only machine: its op is JIT-built with g++ on first use (~75 s).

    torch's AdamW runs its fused kernel (one pass over each tensor, vectorised): on a CPU its
    per-element loop took 0.77 s a step for a 60 M-parameter model on one thread, the fused one
    ~0.05 s (benchmarks/bench_real_shape.py). Same update rule; the last bit of a weight may differ
    from the loop's, which sums in another order."""
    kwargs = dict(lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay)
    if cpu_adam:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, adamw_mode=True, **kwargs)
    return torch.optim.AdamW(params, fused=True, **kwargs)


def build_train_engine(role: str, model: torch.nn.Module, optim: OptimConfig, ds_config: dict, dtype: str,
                 schedule: Callable[[int], float], *, device: str = "cpu") -> TrainEngine:
    """``deepspeed.initialize`` with a client optimizer over the trainable parameters
    (``make_optimizer``: torch AdamW, no JIT-compiled DeepSpeed op, except CPU Adam for optimizer
    offload on CUDA). No scheduler is handed to DeepSpeed, which would step it once per optimizer
    step; ``TrainEngine`` moves the lr once per training step instead."""
    import deepspeed

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, optim, cpu_adam=uses_cpu_adam(ds_config, device))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    te = TrainEngine(role=role, engine=engine, schedule=schedule,
                     base_lrs=[optim.lr] * len(optimizer.param_groups), dtype=dtype,
                     trainable=frozenset(n for n, p in engine.module.named_parameters() if p.requires_grad))
    te.set_lr_schedule_step(0)
    return te


@dataclass
class StepOutcome:
    grad_norm: float
    """Total 2-norm of the mini-batch gradient before clipping (inf/nan when non-finite)."""
    applied: bool
    lr: float
    """The learning rate this step used."""


def _local_grad_norm(te: TrainEngine) -> float:
    grads = [p.grad for _, p in te.named_trainable() if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.nn.utils.get_total_norm(grads, norm_type=2.0))


def full_gradients(te: TrainEngine) -> dict[str, torch.Tensor]:
    """{parameter name: full fp32 gradient on CPU} after the last backward of a mini-batch and
    before the step (ZeRO partitions are gathered: a collective call). For inspection and tests."""
    from deepspeed.utils import safe_get_full_grad

    out = {}
    for name, p in te.named_trainable():
        g = safe_get_full_grad(p) if te.engine.zero_optimization() else p.grad
        if g is not None:
            out[name] = g.detach().float().cpu().clone()
    return out


def optimizer_step(te: TrainEngine) -> StepOutcome:
    """Close the mini-batch: one optimizer step, clipped at ``gradient_clipping``.

    ZeRO stages report the pre-clip norm and skip a non-finite step themselves. Stage 0 in fp32
    does neither (it would write NaN into the weights), so the norm is taken here from the
    (already all-reduced) gradients and a non-finite one drops the gradients without stepping.
    """
    lr = te.lr
    own_norm: Optional[float] = None
    if not te.engine.zero_optimization() and te.dtype == "fp32":
        own_norm = _local_grad_norm(te)
        if not math.isfinite(own_norm):
            te.engine.zero_grad()
            return StepOutcome(grad_norm=own_norm, applied=False, lr=lr)
    te.engine.step()
    reported = te.engine.get_global_grad_norm() if own_norm is None else own_norm
    norm = float(reported) if reported is not None else float("nan")
    return StepOutcome(grad_norm=norm, applied=bool(te.engine.was_step_applied()), lr=lr)


def reference_logprobs(actor: torch.nn.Module, forward: Callable[[torch.nn.Module], torch.Tensor]) -> torch.Tensor:
    """Run ``forward(model)`` as the reference policy: with LoRA, the base model with the adapters
    disabled (the same weights in memory, no second copy); without LoRA this is an error, because
    the reference is then a separate frozen model (``reference_path``)."""
    if not hasattr(actor, "disable_adapter"):
        raise TypeError("reference_logprobs needs a LoRA (peft) actor; load the reference model from "
                        "rlhf_core.run.models.reference_path otherwise")
    with torch.no_grad(), actor.disable_adapter():
        return forward(actor)
