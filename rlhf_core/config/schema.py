"""Typed configuration: every key a user can set, with its default and the reason for it.

Names follow verl's dotted layout (``actor_rollout_ref.actor.clip_ratio``) so a verl user's overrides
work unchanged, and a key that carries verl's name has verl's meaning and verl's default (docstrings
start "verl:"); where a default differs, its docstring says why and docs/verl.md lists it. Keys of
verl's that change nothing here are accepted and named once (``verl_keys.py``). Each section's
``check(key)`` holds the rules about its own fields, beside them, so a new key and its rule are
written together; rules that compare two sections live in ``validate.py``, which walks the sections;
derived values (budgets that default to another key's) in ``resolve.py``.

Names of algorithms (advantage estimator, policy loss, KL estimator, aggregation mode, KL
controller) are checked against their registries in ``rlhf_core.algos``, so a newly registered
variant is valid at once and a typo fails at load with the valid names.

FSDP → DeepSpeed mapping (the update stage always trains with DeepSpeed ZeRO):
    actor.strategy = fsdp | fsdp2        → accepted as aliases of ``deepspeed`` (ZeRO stage from
                                           ``deepspeed_config.zero_stage``; FSDP's full sharding is
                                           ZeRO-3, so set zero_stage=3 for the same memory profile)
    fsdp_config.param_offload = true     → deepspeed_config.offload_param = true (ZeRO-3 only)
    fsdp_config.optimizer_offload = true → deepspeed_config.offload_optimizer = true
    fsdp_config.offload_policy = true    → both of the above (FSDP2's CPUOffloadPolicy moves
                                           parameters, gradients and optimizer state to CPU)
for the trained roles (actor_rollout_ref.actor.fsdp_config, critic.model.fsdp_config). The frozen
models' (actor_rollout_ref.ref.fsdp_config, reward_model.model.fsdp_config) param_offload or
offload_policy keeps the model held for the run in host memory between passes (scoring.frozen).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from rlhf_core.algos.registry import ADV_ESTIMATORS, AGG_MODES, KL_CONTROLLERS, KL_ESTIMATORS, POLICY_LOSSES
from rlhf_core.algos.correction_specs import parse_is_threshold, parse_rs_options, parse_rs_thresholds
from rlhf_core.config.errors import ConfigError
from rlhf_core.notes import say_once
from rlhf_core.registry import Registry
from rlhf_core.models.attention import IMPLEMENTATIONS as ATTENTION_IMPLEMENTATIONS

LOGGERS_HERE = ("console", "mlflow")
LOGGERS_ELSEWHERE = ("wandb", "swanlab", "tensorboard", "vemlp_wandb", "clearml", "trackio", "file")


MAX_RETRY_LOG10 = 6
"""How far, in powers of ten, a run's retries may scale the KL coefficients
(retry_kl_coef_multiplier ** max_rollbacks): 2 ** 2 = 4 by default; a million already drowns any score."""


def require(ok: bool, key: str, rule: str, value: object) -> None:
    """Raise the one-line error every rule shares: ``<full.key>=<value>: <rule>``."""
    if not ok:
        raise ConfigError(f"{key}={value!r}: {rule}")


def require_registered(registry: Registry, key: str, value: str) -> None:
    """``value`` must name an entry of ``registry`` (looked up at load, so runtime entries count)."""
    require(value in registry, key, f"unknown {registry.kind}; valid: {', '.join(registry.names())}", value)


def require_kl_estimator(key: str, value: str) -> None:
    """A KL estimator name, or its straight-through variant (the name with a '+' suffix)."""
    require(value.removesuffix("+") in KL_ESTIMATORS, key,
            f"must be one of {', '.join(KL_ESTIMATORS.names())}, optionally with a '+' suffix", value)


def note_no_remote_code(key: str, value: bool) -> None:
    """verl's trust_remote_code=true is accepted (a pasted verl command runs) but no model's own code
    is ever run here: say so once rather than let a model that needs it fail later, unexplained."""
    if value:
        say_once(f"config: {key}=true has no effect: models load with transformers' built-in classes and a "
                 "checkpoint's own modelling code is never run (docs/reliability.md)")


def _freq_ok(value: int) -> bool:
    return value == -1 or value >= 1


class Section:
    """A config section. ``check(key)`` enforces the rules about its own fields (``key`` is the
    section's dotted prefix); subsections are checked by the walk in ``validate.py``, not here."""

    def check(self, key: str) -> None:
        """No rules of its own."""


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------


@dataclass
class DataConfig(Section):
    train_files: list[str] = field(default_factory=lambda: ["data/arith/train.jsonl"])
    """Prompt files: verl's preprocessed Parquet, or raw JSONL / Parquet / CSV rows (data.adapter).
    The default is the embedded arithmetic set."""
    val_files: list[str] = field(default_factory=list)
    """Validation prompt files (verl). When empty, val_fraction of train is held out instead."""
    adapter: Literal["auto", "verl", "gsm8k", "generic"] = "auto"
    """How rows become prompts. 'verl': verl's preprocessed layout (prompt_key = chat messages,
    reward_model.ground_truth, data_source, ability, extra_info); 'gsm8k': raw question/answer rows
    with '#### n'; 'generic': a text column + an answer column; 'auto' picks by the file's columns."""
    data_source: str = "openai/gsm8k"
    """gsm8k/generic adapters: value written to the data_source column (verl rows carry their own)."""
    ability: str = "math"
    """gsm8k/generic adapters: value written to verl's ability column."""
    prompt_key: str = "prompt"
    """verl: the column holding the prompt (chat messages; a plain string becomes one user turn)."""
    reward_fn_key: str = "data_source"
    """verl: the column whose value picks the reward function for a row."""
    question_key: str = "question"
    """gsm8k adapter: the column holding the question text."""
    answer_key: str = "answer"
    """Column holding the answer (generic: the ground truth verbatim; gsm8k: the solution ending '#### n')."""
    id_key: str = "id"
    """Column whose values become prompt_id when present on every row and unique ('' = always hash)."""
    instruction: str = "Let's think step by step and output the final answer after \"####\"."
    """gsm8k/generic adapters: appended to every question (verl's GSM8K script uses the same words)."""
    system_prompt: Optional[str] = None
    """gsm8k/generic adapters: optional system message placed before the user turn."""
    val_fraction: float = 0.1
    """Share of rows held out for validation when val_files is empty (deterministic by seed)."""
    max_val_samples: int = -1
    """Our cap on validation prompts: -1 = every prompt of data.val_files (verl scores them all), and
    at most 256 for a split of the training files (data.val_fraction); 0 = no validation set; N = at
    most N. The summary says when a cap held prompts back."""
    train_max_samples: int = -1
    """verl: use at most this many training prompts (-1 = all)."""
    val_max_samples: int = -1
    """verl: use at most this many validation prompts (-1 = all; max_val_samples still caps)."""
    max_prompt_length: int = 512
    """verl: prompt budget in tokens (chat template applied); see filter_overlong_prompts/truncation."""
    max_response_length: int = 512
    """verl: generation budget per response (tokens)."""
    filter_overlong_prompts: bool = False
    """verl: drop prompts longer than max_prompt_length (here into prompts/rejects.parquet with the
    reason). When false, data.truncation decides."""
    truncation: Literal["error", "left", "right", "middle"] = "error"
    """verl: what an overlong prompt does when it is not filtered: 'error' stops preprocess naming the
    row; 'left' / 'right' / 'middle' cut tokens from that side."""
    train_batch_size: int = 1024
    """verl: prompts per training step (before rollout.n samples per prompt)."""
    shuffle: bool = True
    """verl: shuffle the training prompts each epoch (seeded by data.seed)."""
    dedup: bool = True
    """Drop exact duplicate prompts (kept: first occurrence; the rest go to rejects)."""
    min_accepted_fraction: float = 0.5
    """Our name: a run refuses to train when preprocess accepts less than this share of the rows it
    read (rows over a sample cap not counted): losing most of the data is a wrong key or a too small
    data.max_prompt_length far more often than data to train on. 0 turns the check off."""
    seed: int = 42
    """Seed for the train/validation split and the per-epoch prompt order."""

    def check(self, key: str) -> None:
        require(self.train_batch_size > 0, f"{key}.train_batch_size", "must be > 0", self.train_batch_size)
        require(0 <= self.val_fraction < 1, f"{key}.val_fraction", "must be in [0, 1)", self.val_fraction)
        require(self.max_val_samples >= -1, f"{key}.max_val_samples",
                "must be -1 (all), 0 (no validation set) or a positive cap", self.max_val_samples)
        require(self.max_prompt_length > 0, f"{key}.max_prompt_length", "must be > 0", self.max_prompt_length)
        require(self.max_response_length > 0, f"{key}.max_response_length", "must be > 0",
                self.max_response_length)
        require(len(self.train_files) > 0, f"{key}.train_files", "needs at least one file", self.train_files)
        require(0 <= self.min_accepted_fraction <= 1, f"{key}.min_accepted_fraction", "must be in [0, 1] (0 = no check)",
                self.min_accepted_fraction)


# ---------------------------------------------------------------------------------------------
# actor / rollout / reference
# ---------------------------------------------------------------------------------------------


@dataclass
class WarmStartConfig(Section):
    """Supervised warm start (``rlhf_core.sft.warm_start``): fine-tune model.path on the train split's
    worked answers before PPO, so a model with no instruct checkpoint (the tiny one) starts from a
    real but weak policy. Cached under <state dir>/models by a hash of everything below + data + model."""

    enable: bool = False
    """Off by default: real checkpoints are already instruct-tuned; the demo turns it on."""
    steps: int = 1000
    """Optimizer steps; on the demo data this lands strict sampled accuracy near 30 % (measured)."""
    batch_size: int = 32
    """Sequences per step (~105 tokens each on the demo data)."""
    lr: float = 6.0e-3
    """Peak AdamW lr, cosine-decayed to 10 %: tiny models need a large lr, the decay sharpens the end."""
    warmup_steps: int = 30
    """Linear lr warm-up steps: 3 % of the default 1000, so Adam's moment estimates settle before the
    large peak lr reaches the freshly built weights."""
    prose_answer_fraction: float = 0.6
    """Share of SFT answers ending in prose ("The answer is 7.") instead of '#### 7': the warm policy then
    follows the output-format instruction only sometimes, as small instruct models do on GSM8K."""
    prose_endings: Optional[list[str]] = None
    """The prose final lines those answers end with, '{n}' standing for the number, one drawn per answer;
    null = three ("The answer is {n}.", "Answer: {n}", "So the total is {n}."). One ending makes the
    format a single choice (prose or '####') that greedy decoding takes the same way on most prompts."""
    eval_every: int = 200
    """Measure sampled accuracy on the dev prompts every N steps (0 = only at the end); ~1 s each."""
    dev_size: int = 128
    """Train-split prompts held out of the fine-tuning to measure it (validation stays untouched)."""
    seed: int = 0
    """Seed of the data order, the prose endings and the dev sample."""

    def check(self, key: str) -> None:
        require(self.steps >= 1, f"{key}.steps", "must be >= 1", self.steps)
        require(self.batch_size >= 1, f"{key}.batch_size", "must be >= 1", self.batch_size)
        require(self.lr > 0, f"{key}.lr", "must be > 0", self.lr)
        require(self.warmup_steps >= 1, f"{key}.warmup_steps", "must be >= 1", self.warmup_steps)
        require(0 <= self.prose_answer_fraction <= 1, f"{key}.prose_answer_fraction", "must be in [0, 1]",
                self.prose_answer_fraction)
        require(self.prose_endings is None or (len(self.prose_endings) > 0 and all(
            isinstance(e, str) and "{n}" in e for e in self.prose_endings)), f"{key}.prose_endings",
            "must be null or a non-empty list of texts that each hold '{n}' (where the number goes)", self.prose_endings)
        require(self.eval_every >= 0, f"{key}.eval_every", "must be >= 0 (0 = evaluate only at the end)",
                self.eval_every)
        require(self.dev_size >= 1, f"{key}.dev_size", "must be >= 1", self.dev_size)


@dataclass
class ModelOverrideConfig(Section):
    """verl: overrides of the model's config.json. Only attn_implementation acts here; every other
    key under override_config is accepted and named as having no effect."""
    attn_implementation: str = "auto"
    """verl: the attention kernel the model is loaded with — for the actor and the reference here in
    scoring, the update and the KL guard alike (one kernel for the same data, so the first step's
    ratio is 1): sdpa, eager, flash_attention_2, flash_attention_3, or 'auto' (our default: flash_attention_2
    on CUDA when flash-attn is installed, else sdpa). verl's default is flash_attention_2."""

    def check(self, key: str) -> None:
        require(self.attn_implementation in ATTENTION_IMPLEMENTATIONS, f"{key}.attn_implementation",
                f"valid: {', '.join(ATTENTION_IMPLEMENTATIONS)}", self.attn_implementation)


@dataclass
class ModelConfig(Section):
    path: str = "tiny"
    """A local Hugging Face model directory, a hub id resolved offline from the local Hugging Face
    cache (HF_HOME / HF_HUB_CACHE; nothing is downloaded), or 'tiny' for the locally built tiny model."""
    tokenizer_path: Optional[str] = None
    """Defaults to the model path (same forms as path)."""
    trust_remote_code: bool = False
    """verl's default (false). A checkpoint's own modelling code is never run here: every model loads
    with transformers' built-in classes, so true has no effect and says so (docs/reliability.md)."""
    lora_rank: int = 0
    """verl: 0 disables LoRA; > 0 trains rank-r adapters only (peft)."""
    lora_alpha: int = 16
    """LoRA scaling numerator (scale = alpha / rank)."""
    target_modules: str = "all-linear"
    """peft target modules: 'all-linear' or a comma-separated list of module names."""
    enable_gradient_checkpointing: bool = False
    """Trade compute for memory in the update. verl defaults to true; off here because on the laptop
    CPU default (tiny model) it only costs time. Turn it on for real models on GPUs."""
    use_remove_padding: bool = True
    """verl: pack the sequences of a micro-batch into rows without padding (block-diagonal attention)
    in scoring and the update; false = one padded sequence per row."""
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    """Supervised warm start of the initial actor (the embedded demo enables it)."""
    override_config: ModelOverrideConfig = field(default_factory=ModelOverrideConfig)

    def check(self, key: str) -> None:
        require(self.lora_rank >= 0, f"{key}.lora_rank", "must be >= 0", self.lora_rank)
        note_no_remote_code(f"{key}.trust_remote_code", self.trust_remote_code)


@dataclass
class OptimConfig(Section):
    optimizer: Literal["AdamW"] = "AdamW"
    """verl: the optimizer class (AdamW, torch.optim's)."""
    lr: float = 1e-6
    """Peak learning rate (verl's actor default)."""
    weight_decay: float = 0.01
    """verl's default (also torch AdamW's): a light decoupled decay that does not fight the small RL steps."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """verl's default (torch AdamW's): Adam's usual first- and second-moment decay rates."""
    lr_warmup_steps: int = -1
    """verl: linear warm-up over this many training steps; -1 = use lr_warmup_steps_ratio."""
    lr_warmup_steps_ratio: float = 0.0
    """verl: warm-up steps as a share of the total training steps (when lr_warmup_steps < 0)."""
    lr_scheduler_type: Literal["constant", "cosine"] = "constant"
    """verl: the schedule after warm-up, stepped once per training step (iteration)."""
    warmup_style: Optional[Literal["constant", "cosine"]] = None
    """verl's older name of lr_scheduler_type; when set it wins."""
    min_lr_ratio: float = 0.0
    """verl (cosine): the floor of the schedule as a share of lr."""
    num_cycles: float = 0.5
    """verl (cosine): cosine cycles over the decay (0.5 = one half-wave down to min_lr_ratio)."""
    total_training_steps: int = -1
    """verl: filled in from trainer.* when the run starts (-1); a value here is ignored, as in verl."""

    def check(self, key: str) -> None:
        require(self.lr > 0, f"{key}.lr", "must be > 0", self.lr)
        require(len(self.betas) == 2, f"{key}.betas", "needs exactly two values", self.betas)
        require(0 <= self.lr_warmup_steps_ratio <= 1, f"{key}.lr_warmup_steps_ratio", "must be in [0, 1]",
                self.lr_warmup_steps_ratio)
        require(0 <= self.min_lr_ratio <= 1, f"{key}.min_lr_ratio", "must be in [0, 1]", self.min_lr_ratio)
        require(self.num_cycles > 0, f"{key}.num_cycles", "must be > 0", self.num_cycles)


@dataclass
class FSDPConfig(Section):
    """Accepted for verl compatibility; mapped to deepspeed_config (see the module docstring)."""

    param_offload: bool = False
    """verl's default (off): offloading trades step time for device memory. Actor, critic: maps to
    deepspeed_config.offload_param (ZeRO-3); reference, reward model: their held weights wait in host
    memory between passes."""
    optimizer_offload: bool = False
    """verl's default (off), for the same trade; maps to deepspeed_config.offload_optimizer."""
    offload_policy: bool = False
    """FSDP2 CPU offload policy; maps to DeepSpeed parameter + optimizer offload."""


@dataclass
class DeepSpeedConfig(Section):
    zero_stage: int = 0
    """ZeRO stage 0-3. 0 is fastest for one process on a CPU; use 2 or 3 on several GPUs. bf16/fp16 train
    at stage >= 1 (DeepSpeed's stage-0 mixed-precision optimizer hides the per-parameter state we save)."""
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """'auto' = bf16 on CUDA; on a CPU bf16 where it pays — cores with native bf16 matrix units
    (AVX512-BF16 or AMX) on which a bf16 matmul measures at least 1.3x as fast as fp32 (once per run, ~1 s;
    ``RLHF_CPU_BF16=0|1`` says it instead) and a model whose largest weight matrix has at least 1 M
    elements — else fp32. Measured at a 0.5B-shaped 4-layer model: an AMD EPYC with AVX512-BF16 ran its
    iteration in 5.0 s in bf16 against 9.8 s in fp32; an Intel Xeon with AVX512-BF16 but no AMX
    multiplied bf16 at 0.55x its fp32 rate (11.2 s against 7.0 s an iteration). The tiny demo's 64 x 512
    matrices are faster in fp32; a CPU without those units emulates bf16 tens of times slower. The
    choice is said once, with the rates.
    The whole run follows the actor's: rollout, scoring and the KL guard run in its training dtype. bf16
    trains at zero_stage >= 1 (raised to 1 by itself). docs/benchmarks.md §8."""
    offload_optimizer: bool = False
    """Keep Adam's state in host memory (what fsdp_config.optimizer_offload maps to). Off, as verl's FSDP
    default: it slows every step and only pays when the state does not fit on the device."""
    offload_param: bool = False
    """Keep the parameters in host memory (ZeRO-3 only; what fsdp_config.param_offload maps to). Off, as
    verl's FSDP default, for the same reason."""
    config_path: Optional[str] = None
    """A raw DeepSpeed JSON whose keys override the generated config."""

    def check(self, key: str) -> None:
        require(self.zero_stage in (0, 1, 2, 3), f"{key}.zero_stage", "must be 0, 1, 2 or 3", self.zero_stage)


@dataclass
class PolicyLossConfig(Section):
    loss_mode: str = "vanilla"
    """verl: the policy-loss registry name (rlhf_core.algos.registry.POLICY_LOSSES)."""
    clip_cov_ratio: float = 0.0002
    """verl (clip_cov): share of tokens whose gradient is detached."""
    clip_cov_lb: float = 1.0
    """verl's default (clip_cov): only tokens whose covariance is above this can be detached, so the
    ordinary low-covariance tokens keep their gradient."""
    clip_cov_ub: float = 5.0
    """verl's default (clip_cov): nor those above this, so the few extreme outliers are left alone."""
    kl_cov_ratio: float = 0.0002
    """verl (kl_cov): share of tokens that get the KL penalty."""
    ppo_kl_coef: float = 0.1
    """verl (kl_cov): coefficient of that penalty."""
    dro_beta: Optional[float] = None
    """verl (dro): weight of the quadratic log-ratio penalty; required (> 0) with loss_mode=dro, which has
    no sensible default (it sets how far a step may move from the sampling policy)."""

    def check(self, key: str) -> None:
        require_registered(POLICY_LOSSES, f"{key}.loss_mode", self.loss_mode)
        if self.loss_mode == "dro":
            require(self.dro_beta is not None and self.dro_beta > 0, f"{key}.dro_beta",
                    "must be set > 0 with loss_mode=dro (e.g. 0.1)", self.dro_beta)
        if self.loss_mode == "bypass_mode":
            raise ConfigError(f"{key}.loss_mode=bypass_mode is selected by algorithm.rollout_correction.bypass_mode=true "
                              "(as in verl, which also routes the correction settings to it); set that instead")


@dataclass
class ActorConfig(Section):
    strategy: Literal["deepspeed", "fsdp", "fsdp2"] = "deepspeed"
    """Training backend. fsdp/fsdp2 are accepted aliases that map to DeepSpeed ZeRO."""
    ppo_mini_batch_size: int = 256
    """verl: prompts per optimizer step; each brings its rollout.n responses (so a step trains on
    ppo_mini_batch_size × n sequences)."""
    ppo_micro_batch_size: Optional[int] = None
    """verl (deprecated): sequences per forward/backward over all GPUs; divided by the world size."""
    ppo_micro_batch_size_per_gpu: Optional[int] = None
    """verl: sequences per forward/backward per GPU when use_dynamic_bsz is off."""
    use_dynamic_bsz: bool = False
    """verl: split mini-batches into micro-batches by token budget instead of a fixed count."""
    ppo_max_token_len_per_gpu: int = 16384
    """verl: token budget of one micro-batch with use_dynamic_bsz."""
    ppo_epochs: int = 1
    """verl: passes over the step's batch."""
    shuffle: bool = False
    """verl: shuffle the sequences between PPO epochs (seeded by trainer.seed)."""
    clip_ratio: float = 0.2
    """verl: PPO ε, used only where clip_ratio_low / clip_ratio_high are null."""
    clip_ratio_low: Optional[float] = 0.2
    """verl: the lower clip ε (ratio ≥ 1 − ε). verl's default is 0.2, not null, so setting clip_ratio
    alone changes nothing; set this (and clip_ratio_high) to null to follow clip_ratio."""
    clip_ratio_high: Optional[float] = 0.2
    """verl: the upper clip ε (ratio ≤ 1 + ε); 0.28 with a low of 0.2 is DAPO's clip-higher."""
    clip_ratio_c: float = 3.0
    """verl: dual-clip bound c (> 1) for negative advantages."""
    loss_agg_mode: str = "token-mean"
    """verl: token-mean | token-sum | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm."""
    loss_scale_factor: Optional[float] = None
    """verl: the divisor of seq-mean-token-sum-norm; null = data.max_response_length."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    tau_pos: float = 1.0
    """verl (sapo): the gate's temperature for tokens with a positive advantage; verl's default."""
    tau_neg: float = 1.05
    """verl (sapo): for the others; verl's default, a little sharper so that pushing a token down is
    damped a little harder than pushing it up."""
    calculate_sum_pi_squared: bool = False
    """verl: the score stage also records sum over the vocabulary of pi^2 at each response token
    (scored.parquet's sum_pi_squared), which the optimal_token_baseline estimators need. Off by
    default as in verl: it is one more pass over the logits. Those estimators turn it on."""
    entropy_coeff: float = 0.0
    """verl: entropy bonus weight. 0 is verl's default: sampling at temperature 1 already explores, and
    a bonus is a recipe's choice (it pushes towards longer, noisier responses)."""
    use_kl_loss: bool = False
    """verl: add kl_loss_coef·KL(actor‖ref) to the actor loss (GRPO-style)."""
    kl_loss_coef: float = 0.001
    """verl's default (0.001), used only with use_kl_loss: the GRPO recipes' weight of KL(actor‖ref) in
    the loss, small enough to let the policy move."""
    kl_loss_type: str = "low_var_kl"
    """verl: KL estimator for the loss (kl/k1, abs, mse/k2, low_var_kl/k3, and '+' straight-through variants)."""
    grad_clip: float = 1.0
    """verl: gradient-norm clip (DeepSpeed gradient_clipping)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    deepspeed_config: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)

    @property
    def clip_ratios(self) -> tuple[float, float]:
        """(ε_low, ε_high) the policy loss clips with: clip_ratio_low / clip_ratio_high, each falling back
        to clip_ratio where null (verl)."""
        low = self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low
        high = self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high
        return low, high

    def check(self, key: str) -> None:
        require(0 < self.clip_ratio < 1, f"{key}.clip_ratio", "must be in (0, 1)", self.clip_ratio)
        for name in ("clip_ratio_low", "clip_ratio_high"):
            value = getattr(self, name)
            require(value is None or value >= 0, f"{key}.{name}", "must be >= 0 (or null to use clip_ratio)", value)
        require(self.clip_ratio_c > 1, f"{key}.clip_ratio_c", "dual-clip bound must be > 1", self.clip_ratio_c)
        if self.clip_ratio != 0.2 and self.clip_ratio_low is not None and self.clip_ratio_high is not None:
            say_once(f"config: {key}.clip_ratio={self.clip_ratio} has no effect while clip_ratio_low/high are set "
                     f"({self.clip_ratio_low}/{self.clip_ratio_high}, verl's defaults are 0.2); "
                     "set them to null to follow it")
        require(self.grad_clip > 0, f"{key}.grad_clip", "must be > 0", self.grad_clip)
        require(self.ppo_mini_batch_size > 0, f"{key}.ppo_mini_batch_size", "must be > 0", self.ppo_mini_batch_size)
        require(self.ppo_epochs >= 1, f"{key}.ppo_epochs", "must be >= 1", self.ppo_epochs)
        require(self.kl_loss_coef >= 0, f"{key}.kl_loss_coef", "must be >= 0", self.kl_loss_coef)
        require_kl_estimator(f"{key}.kl_loss_type", self.kl_loss_type)
        require_registered(AGG_MODES, f"{key}.loss_agg_mode", self.loss_agg_mode)
        require(self.loss_scale_factor is None or self.loss_scale_factor > 0, f"{key}.loss_scale_factor",
                "must be > 0 (or null = data.max_response_length)", self.loss_scale_factor)
        require(self.tau_pos > 0, f"{key}.tau_pos", "must be > 0", self.tau_pos)
        require(self.tau_neg > 0, f"{key}.tau_neg", "must be > 0", self.tau_neg)


@dataclass
class SamplingConfig(Section):
    """verl's rollout.val_kwargs: how validation decodes (greedy by default)."""

    top_k: int = -1
    """verl's default: -1 = no top-k cut (greedy picks the top token anyway)."""
    top_p: float = 1.0
    """verl's default: 1.0 = no nucleus cut."""
    temperature: float = 0.0
    """verl's default: 0 = greedy, so a validation score is the same on every rerun and comparable across
    iterations."""
    n: int = 1
    """Responses per validation prompt (mean@n and best@n are reported)."""
    do_sample: bool = False
    """verl: false = greedy, whatever the temperature."""

    def check(self, key: str) -> None:
        require(self.temperature >= 0, f"{key}.temperature", "must be >= 0 (0 = greedy)", self.temperature)
        require(0 < self.top_p <= 1, f"{key}.top_p", "must be in (0, 1]", self.top_p)
        require(self.top_k == -1 or self.top_k > 0, f"{key}.top_k", "must be -1 (off) or > 0", self.top_k)
        require(self.n >= 1, f"{key}.n", "must be >= 1", self.n)


@dataclass
class RolloutConfig(Section):
    name: Literal["hf", "vllm", "offline"] = "hf"
    """Engine: Hugging Face generate (CPU/GPU), vLLM (CUDA, or CPU with vLLM's CPU build; falls back to
    hf where neither is there, saying so), or imported offline trajectories."""
    temperature: float = 1.0
    """verl's default: 1.0 samples the policy's own distribution, the on-policy case PPO's ratio assumes."""
    top_p: float = 1.0
    """verl's default: no nucleus cut, for the same reason (a cut distribution is not the policy's)."""
    top_k: int = -1
    """verl's default: -1 = no top-k cut (vLLM's convention), for the same reason."""
    do_sample: bool = True
    """verl's default: sample, so PPO sees varied responses to learn from; false = greedy rollout."""
    n: int = 1
    """verl: responses sampled per prompt."""
    val_kwargs: SamplingConfig = field(default_factory=SamplingConfig)
    """verl: sampling for validation."""
    seed: int = 42
    """verl's default: the sampling seed; the iteration number is added so iterations differ but reruns
    match."""
    generation_batch_tokens: int = 8192
    """hf engine: token budget of one generation batch (prompt + response slots)."""
    gpu_memory_utilization: float = 0.5
    """verl (vLLM): share of GPU memory for weights + KV cache."""
    tensor_model_parallel_size: int = 1
    """verl (vLLM): ranks (GPUs, or CPU processes) per engine; the engines are the rollout's processes
    over this (docs/vllm.md). verl defaults to 2; 1 here so one GPU works unchanged."""
    offline_path: Optional[str] = None
    """name=offline: JSONL/Parquet of responses generated elsewhere."""
    log_prob_micro_batch_size: Optional[int] = None
    """verl (deprecated): old-log-prob sequences per forward over all GPUs."""
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    """verl: sequences per forward when computing the old log-probs (without dynamic batching)."""
    log_prob_use_dynamic_bsz: Optional[bool] = None
    """verl: batch the old log-prob forwards by token budget; null = actor.use_dynamic_bsz."""
    log_prob_max_token_len_per_gpu: Optional[int] = None
    """verl: token budget of one old log-prob forward; null = actor.ppo_max_token_len_per_gpu."""
    cpu_threads: int = 0
    """hf engine on CPU: torch threads while generating; 0 = auto: 1 when the model's largest weight
    matrix has under 1 M elements (its per-token matmuls are too small to split; on shared cores
    extra threads spin-wait: tiny model 3,600 tokens/s on 1 thread vs 220 on 2 busy cores), else
    torch's default (Qwen2.5-0.5B's layer shape decodes 1.5x faster on 2 threads than on 1)."""
    old_log_probs: Literal["auto", "recompute"] = "auto"
    """Where the update's old log-probs come from. 'auto': the rollout's own when they are the trainer's
    arithmetic — the hf engine on the CPU in fp32 (the trainer's own module with resident models, or its
    checkpoint), sampling without a top-k / top-p cut, dynamic KV cache, no LoRA, no
    algorithm.rollout_correction.rollout_is / rollout_rs — measured ~2e-7 from the recomputed ones
    (docs/benchmarks.md §8); the score stage then skips the actor's pass. Recomputed otherwise (bf16
    decoding differs by ~3e-3). 'recompute': always, as verl does outside bypass_mode. The update
    reports the difference it starts from (actor/old_log_prob_diff_max)."""
    hf_decode: Literal["dynamic", "static"] = "dynamic"
    """hf engine: the KV cache ``generate`` decodes with. 'dynamic' grows it every step (transformers'
    default); 'static' allocates it once at data.max_prompt_length + data.max_response_length, and on
    CUDA the decode step is compiled (torch.compile, CUDA graphs: the first call of each batch size
    compiles it, a minute or more at 0.5B). Same tokens on CPU (tested); not yet measured on a GPU,
    hence not the default (benchmarks/gpu/device_check.sh measures it)."""

    def check(self, key: str) -> None:
        require(self.temperature > 0 or not self.do_sample, f"{key}.temperature",
                f"must be > 0 when sampling (set {key}.do_sample=false for greedy)", self.temperature)
        require(0 < self.top_p <= 1, f"{key}.top_p", "must be in (0, 1]", self.top_p)
        require(self.top_k == -1 or self.top_k > 0, f"{key}.top_k", "must be -1 (off) or > 0", self.top_k)
        require(self.n >= 1, f"{key}.n", "must be >= 1", self.n)
        require(0 < self.gpu_memory_utilization <= 1, f"{key}.gpu_memory_utilization", "must be in (0, 1]",
                self.gpu_memory_utilization)
        require(self.tensor_model_parallel_size >= 1, f"{key}.tensor_model_parallel_size", "must be >= 1",
                self.tensor_model_parallel_size)
        require(self.cpu_threads >= 0, f"{key}.cpu_threads", "must be >= 0 (0 = auto)", self.cpu_threads)
        require(self.name != "offline" or bool(self.offline_path), f"{key}.offline_path",
                f"must name a JSONL/Parquet file when {key}.name=offline", self.offline_path)


@dataclass
class RefConfig(Section):
    model_path: Optional[str] = None
    """Reference policy; defaults to the actor's initial model (same forms as model.path)."""
    log_prob_micro_batch_size: Optional[int] = None
    """verl (deprecated): reference-log-prob sequences per forward over all GPUs."""
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    """verl: sequences per forward when computing the reference log-probs (without dynamic batching)."""
    log_prob_use_dynamic_bsz: Optional[bool] = None
    """verl: batch the reference log-prob forwards by token budget; null = actor.use_dynamic_bsz (verl
    interpolates the same key), so one switch sets every pass."""
    log_prob_max_token_len_per_gpu: Optional[int] = None
    """verl: token budget of one reference forward; null = actor.ppo_max_token_len_per_gpu, as in verl."""
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class ActorRolloutRefConfig(Section):
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)


# ---------------------------------------------------------------------------------------------
# critic, reward
# ---------------------------------------------------------------------------------------------


@dataclass
class CriticModelConfig(Section):
    path: Optional[str] = None
    """Backbone for the value model; defaults to the actor's initial model (new scalar head)."""
    tokenizer_path: Optional[str] = None
    """verl: must tokenize as the actor's does; accepted and checked, the actor's tokenizer is used."""
    trust_remote_code: bool = False
    """As actor_rollout_ref.model.trust_remote_code (verl's default follows it: false); no effect here."""
    enable_gradient_checkpointing: bool = False
    """As actor_rollout_ref.model.enable_gradient_checkpointing (verl defaults to true)."""
    use_remove_padding: Optional[bool] = None
    """null = actor_rollout_ref.model.use_remove_padding (true). verl's default is false; packed rows give
    the same values as padded ones (tested) and are faster here."""
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    override_config: ModelOverrideConfig = field(default_factory=ModelOverrideConfig)
    """verl: as actor_rollout_ref.model.override_config, for the value model."""

    def check(self, key: str) -> None:
        note_no_remote_code(f"{key}.trust_remote_code", self.trust_remote_code)


@dataclass
class CriticConfig(Section):
    enable: Optional[bool] = None
    """verl: build and train a critic. null = only when algorithm.adv_estimator uses values (gae);
    false with gae is refused; true with a critic-free estimator trains a critic nobody reads, as verl."""
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    strategy: Literal["deepspeed", "fsdp", "fsdp2"] = "deepspeed"
    """As actor.strategy. verl's default is fsdp; the update here trains with DeepSpeed ZeRO, and
    fsdp/fsdp2 are accepted as aliases."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """verl's critic default lr is 1e-5 (ten times the actor's)."""
    ppo_mini_batch_size: Optional[int] = None
    """verl: prompts (× rollout.n responses) per critic optimizer step; null = the actor's."""
    ppo_micro_batch_size: Optional[int] = None
    """verl (deprecated): sequences per forward/backward over all GPUs."""
    ppo_micro_batch_size_per_gpu: Optional[int] = None
    """verl: sequences per forward/backward when use_dynamic_bsz is off."""
    use_dynamic_bsz: Optional[bool] = None
    """verl: null = actor_rollout_ref.actor.use_dynamic_bsz (verl interpolates the same key), so one
    switch batches both models alike."""
    ppo_max_token_len_per_gpu: int = 32768
    """verl: the critic's token budget per micro-batch with use_dynamic_bsz."""
    forward_micro_batch_size_per_gpu: Optional[int] = None
    """verl: sequences per value forward in scoring; null = ppo_micro_batch_size_per_gpu."""
    forward_max_token_len_per_gpu: Optional[int] = None
    """verl: token budget of one value forward in scoring; null = ppo_max_token_len_per_gpu."""
    ppo_epochs: Optional[int] = None
    """verl: null = the actor's (verl interpolates it), so the critic fits the same data as often."""
    shuffle: Optional[bool] = None
    """verl: null = the actor's (verl interpolates it), so one switch orders both updates alike."""
    cliprange_value: float = 0.5
    """verl: value clipping ε around the old values."""
    loss_agg_mode: Optional[str] = None
    """verl: null = actor_rollout_ref.actor.loss_agg_mode (verl interpolates it), so the value loss
    weighs tokens as the policy loss does."""
    loss_scale_factor: Optional[float] = None
    """verl (0.9.1): the value loss's seq-mean-token-sum-norm divisor; null = the actor's
    (actor.loss_scale_factor, verl interpolates it), else data.max_response_length."""
    grad_clip: float = 1.0
    """verl: the critic's gradient-norm clip."""
    deepspeed_config: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)

    def check(self, key: str) -> None:
        require(self.loss_scale_factor is None or self.loss_scale_factor > 0, f"{key}.loss_scale_factor",
                "must be > 0 (or null = the actor's)", self.loss_scale_factor)
        require(self.cliprange_value > 0, f"{key}.cliprange_value", "must be > 0", self.cliprange_value)
        if self.loss_agg_mode is not None:
            require_registered(AGG_MODES, f"{key}.loss_agg_mode", self.loss_agg_mode)
        require(self.grad_clip > 0, f"{key}.grad_clip", "must be > 0", self.grad_clip)


@dataclass
class RewardModelModelConfig(Section):
    path: Optional[str] = None
    """verl: the sequence-classification reward model (local directory or hub id in the local cache)."""
    input_tokenizer: Optional[str] = None
    """verl: the actor's tokenizer when the reward model's chat template differs (responses are then
    decoded and re-rendered with the reward model's template); null = same tokenizer."""
    trust_remote_code: bool = False
    """verl's default (false); no effect here, as actor_rollout_ref.model.trust_remote_code."""
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)

    def check(self, key: str) -> None:
        note_no_remote_code(f"{key}.trust_remote_code", self.trust_remote_code)


@dataclass
class OverlongBufferConfig(Section):
    """verl (DAPO's overlong reward shaping): with expected = data.max_response_length − len, a response
    of L tokens gets min(0, −(L − expected) / len · penalty_factor) added to its score
    (``rlhf_core.rewards.overlong``). Rule-based scores only: refused with reward_model.enable, whose
    scores verl's DAPO reward manager returns unshaped; len must be < data.max_response_length."""

    enable: bool = False
    """verl's default (off): the shaping changes every long response's score, so it is DAPO's opt-in."""
    len: int = 0
    """verl: the buffer's length in tokens (> 0 and < data.max_response_length when enabled)."""
    penalty_factor: float = 1.0
    """verl: the penalty at the full length."""
    log: bool = False
    """verl: record overlong_reward and overlong in reward_extra."""

    def check(self, key: str) -> None:
        if self.enable:
            require(self.len > 0, f"{key}.len", "must be > 0 when the buffer is enabled", self.len)
        require(self.penalty_factor >= 0, f"{key}.penalty_factor", "must be >= 0", self.penalty_factor)


@dataclass
class RewardModelConfig(Section):
    enable: bool = False
    """verl: score with a sequence-classification reward model instead of the rule-based reward."""
    strategy: Literal["deepspeed", "fsdp", "fsdp2"] = "deepspeed"
    """As actor.strategy (verl's default is fsdp; here DeepSpeed, fsdp/fsdp2 accepted as aliases)."""
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)
    micro_batch_size: Optional[int] = None
    """verl (deprecated): sequences per forward over all GPUs."""
    micro_batch_size_per_gpu: Optional[int] = 16
    """verl: sequences per reward-model forward. verl's default is null (required when enabled)."""
    max_length: Optional[int] = None
    """verl: when responses are re-rendered (model.input_tokenizer set), keep the first max_length
    tokens of the reward model's conversation (null = max_prompt_length + max_response_length)."""
    use_dynamic_bsz: Optional[bool] = None
    """verl: null = critic.use_dynamic_bsz (verl interpolates it), so every scoring pass batches alike."""
    reward_manager: Literal["naive"] = "naive"
    """verl: how rule-based rewards are applied; 'naive' (one compute_score call per response)."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """verl (DAPO): a linear penalty for responses that run into the last overlong_buffer.len tokens."""

    def check(self, key: str) -> None:
        require(self.model.path is not None or not self.enable, f"{key}.model.path",
                f"must be set when {key}.enable=true", self.model.path)


@dataclass
class CustomRewardConfig(Section):
    path: Optional[str] = None
    """verl: a .py file (or 'pkg.module') holding compute_score(data_source, solution_str,
    ground_truth, extra_info); when set it scores every row."""
    name: str = "compute_score"
    """verl: the function's name in that file."""
    gsm8k_method: Literal["strict", "flexible"] = "strict"
    """Built-in GSM8K scorer: 'strict' needs '#### n' (verl's default); 'flexible' takes the last number."""
    format_score: float = 0.0
    """Built-in GSM8K scorer: the score of a well-formed wrong answer (verl's format_score)."""
    score: float = 1.0
    """Built-in GSM8K scorer: the score of a right answer (verl's score)."""
    call_timeout_s: float = 60.0
    """Our name: seconds one call of the ``path`` function (or the import of its module) may take.
    That function runs in a process of its own, so its hang, exit or crash is one error naming it
    instead of the run's end; past this limit the call is stopped and the stage fails in one line.
    A rule-based score takes milliseconds; a minute leaves room for a slow grader or a sandboxed
    execution, raise it for slower ones. Built-in and registered functions run in the run's process."""

    def check(self, key: str) -> None:
        require(self.call_timeout_s > 0, f"{key}.call_timeout_s", "must be > 0 seconds", self.call_timeout_s)


# ---------------------------------------------------------------------------------------------
# algorithm, trainer
# ---------------------------------------------------------------------------------------------


@dataclass
class KLCtrlConfig(Section):
    type: Literal["fixed", "adaptive"] = "fixed"
    """verl: the in-reward KL coefficient's controller."""
    kl_coef: float = 0.001
    """verl: the initial KL-in-reward coefficient."""
    target_kl: float = 0.1
    """verl: the adaptive controller's target (per-token mean KL)."""
    horizon: int = 10000
    """verl: the adaptive controller's horizon (samples)."""

    def check(self, key: str) -> None:
        require_registered(KL_CONTROLLERS, f"{key}.type", self.type)
        require(self.kl_coef >= 0, f"{key}.kl_coef", "must be >= 0", self.kl_coef)
        require(self.target_kl > 0, f"{key}.target_kl", "must be > 0", self.target_kl)
        require(self.horizon > 0, f"{key}.horizon", "must be > 0", self.horizon)


@dataclass
class FilterGroupsConfig(Section):
    """verl (DAPO's dynamic sampling): drop prompt groups whose responses all score the same on
    ``metric`` and draw more prompts until data.train_batch_size groups are kept."""

    enable: bool = False
    """verl's default (off): dynamic sampling costs extra rollouts per step, DAPO's opt-in."""
    metric: Optional[str] = "reward"
    """verl: reward (verl 0.9.1's default: the sequence score before any KL) | acc | score | seq_reward |
    seq_final_reward."""
    max_num_gen_batches: int = 0
    """verl: draws of prompts before giving up (<= 0: no limit). Each draw is one pack slot; a rollout
    stops anyway once every slot was drawn (``rlhf_core.rollout.dynamic_sampling``)."""

    def check(self, key: str) -> None:
        if self.enable:
            require(self.metric in ("reward", "acc", "score", "seq_reward", "seq_final_reward"), f"{key}.metric",
                    "must be reward, acc, score, seq_reward or seq_final_reward when filter_groups is enabled",
                    self.metric)


@dataclass
class RolloutCorrectionConfig(Section):
    """verl: correction for the gap between the rollout engine's policy and the trainer's (vLLM in bf16,
    the trainer in fp32; rlhf_core.algos.rollout_correction). The engine's own log-probs are the rollout
    table's rollout_log_probs; the gae stage turns them into importance weights and a rejection mask
    (advantages.parquet's rollout_is_weights and response_mask), and reports the rollout_corr/ metrics
    on every iteration that has them, whatever is enabled (verl's default: metrics only)."""

    rollout_is: Optional[Literal["token", "sequence"]] = None
    """verl: importance weights per token or per sequence; null (verl's default) = none."""
    rollout_is_threshold: Union[float, str] = 2.0
    """verl: an upper bound the weights are truncated to (truncated IS), or 'lower_upper' (e.g. '0.5_5.0')
    outside which they become 0 (IcePop). verl's default 2.0."""
    rollout_is_batch_normalize: bool = False
    """verl: divide the weights by their batch mean (so they average 1). Off, as verl's default."""
    rollout_rs: Optional[str] = None
    """verl: rejection criteria, comma-separated (token_k1..3, seq_sum_k1..3, seq_mean_k1..3, seq_max_k2/3);
    a rejected token (or sequence) leaves the response mask. null (verl's default) = none."""
    rollout_rs_threshold: Optional[Union[float, str]] = None
    """verl: one bound per criterion (comma-separated) or one for all; k1 criteria take a ratio pair
    'lower_upper'. Required with rollout_rs."""
    bypass_mode: bool = False
    """verl: train against the rollout's own log-probs as the old policy (the score stage skips the
    actor's pass) with loss_mode bypass_mode, which applies the correction inside the loss."""
    loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"
    """verl (bypass_mode): ppo_clip (verl's default) or reinforce with explicit weights."""

    def check(self, key: str) -> None:
        try:
            parse_is_threshold(self.rollout_is_threshold)
            if self.rollout_rs is not None:
                parse_rs_thresholds(parse_rs_options(self.rollout_rs), self.rollout_rs_threshold)
        except ValueError as exc:
            raise ConfigError(f"{key}: {exc}") from None

    @property
    def enabled(self) -> bool:
        """Whether the correction changes training (weights, rejection or bypass), not only reports."""
        return self.rollout_is is not None or self.rollout_rs is not None or self.bypass_mode


@dataclass
class AlgorithmConfig(Section):
    adv_estimator: str = "gae"
    """verl: the advantage-estimator registry name (rlhf_core.algos.registry.ADV_ESTIMATORS)."""
    gamma: float = 1.0
    """verl's default: no discount inside a response, whose reward comes at its last token; a gamma below
    1 would shrink the credit of the early tokens of a long correct answer."""
    lam: float = 1.0
    """verl's default: with gamma 1, GAE's advantage is the Monte-Carlo return minus the value, which does
    not lean on a barely trained critic's bootstrapped estimates."""
    norm_adv: bool = True
    """Our key: whiten the advantages of an estimator that reads the critic's values (gae) over the
    batch's valid tokens, as verl always does for GAE. The critic-free estimators normalise as verl
    defines each of them, whatever this says."""
    norm_adv_by_std_in_grpo: bool = True
    """verl (grpo): divide group-centred rewards by the group's standard deviation."""
    use_kl_in_reward: bool = False
    """verl: subtract kl_coef·KL(actor‖ref) from the token rewards."""
    kl_penalty: str = "kl"
    """verl: KL estimator for the in-reward penalty."""
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    gdpo_reward_keys: Optional[list[str]] = None
    """verl (gdpo): the keys of a dict-valued reward function's result to normalise one by one (e.g.
    [accuracy_reward, format_reward]); null = the one score."""
    gdpo_reward_weights: Optional[list[float]] = None
    """verl (gdpo): one weight per gdpo_reward_keys entry; null = 1 each."""

    def check(self, key: str) -> None:
        if self.adv_estimator == "gdpo":
            require(bool(self.gdpo_reward_keys), f"{key}.gdpo_reward_keys",
                    "gdpo normalises each reward component on its own: list the keys of your reward function's "
                    "dict result, e.g. [accuracy_reward, format_reward]", self.gdpo_reward_keys)
        if self.gdpo_reward_weights is not None:
            require(self.gdpo_reward_keys is not None and len(self.gdpo_reward_weights) == len(self.gdpo_reward_keys),
                    f"{key}.gdpo_reward_weights", "needs one weight per gdpo_reward_keys entry", self.gdpo_reward_weights)
        require(0 <= self.gamma <= 1, f"{key}.gamma", "must be in [0, 1]", self.gamma)
        require(0 <= self.lam <= 1, f"{key}.lam", "must be in [0, 1]", self.lam)
        require_registered(ADV_ESTIMATORS, f"{key}.adv_estimator", self.adv_estimator)
        require_kl_estimator(f"{key}.kl_penalty", self.kl_penalty)


@dataclass
class TrainerConfig(Section):
    project_name: str = "rlhf"
    """verl: the project, recorded on every MLflow run as the tag rlhf.project. verl's default
    verl_examples names verl's examples; this names the toolkit."""
    experiment_name: str = "default"
    """verl: the MLflow experiment runs are filed under. verl's default gsm8k names its example's data;
    here the default data is the embedded arithmetic set, so a neutral name."""
    logger: list[str] = field(default_factory=lambda: ["console", "mlflow"])
    """verl: where metrics go. console and mlflow work here; wandb, swanlab, tensorboard, vemlp_wandb,
    clearml, trackio are accepted and said once to be unavailable. verl's default is console + wandb
    (wandb needs its service and an account; MLflow is this project's tracker)."""
    runs_root: str = "runs"
    """Run directories are created under this folder."""
    total_epochs: int = 30
    """verl: passes over the training prompts; training steps = epochs × (prompts // train_batch_size)."""
    total_training_steps: Optional[int] = None
    """verl: when set, the number of training steps (iterations), whatever total_epochs says."""
    total_iterations: Optional[int] = None
    """Our name for the same count (`--iterations`); when set it wins over both. Filled in from the
    two above when a run starts."""
    val_before_train: bool = True
    """verl: validate the initial policy before the first step (logged at step 0)."""
    val_base_model: bool = True
    """With the warm start on (actor_rollout_ref.model.warm_start.enable), the validation before training
    also validates actor_rollout_ref.model.path itself, the model before the SFT, once: the run then
    reports accuracy before the SFT, after it and after PPO on the same held-out prompts
    (iter_0/validation_base.parquet, val_base/*)."""
    val_only: bool = False
    """verl: only validate the initial policy, then stop."""
    test_freq: int = -1
    """verl: validate every N steps and after the last one (-1 = never)."""
    save_freq: int = -1
    """verl: keep a full checkpoint every N steps and after the last one (-1 = only the last-good
    checkpoint, which the KL guard always keeps for rollback)."""
    resident_models: bool = True
    """Our name: keep the actor, critic and reference loaded for the whole flow run (one update
    process, no LoRA): each stage borrows them, the next rollout samples from the updated weights in
    memory, a KL-guard rollback restores an in-memory snapshot, and a full checkpoint is written only
    every save_freq iterations and at the end, off the critical path. false = every stage loads its
    models from disk and every iteration writes a full checkpoint (the design before; the benchmark
    compares the two)."""
    max_ckpt_to_keep: int = 2
    """Save-point checkpoints kept (oldest pruned first); the last-good one is always kept."""
    critic_warmup: int = 0
    """verl: the actor trains from step N on (verl's `critic_warmup <= global_steps`, steps 1-based), so
    steps 1 .. N-1 train only the critic."""
    n_gpus_per_node: Optional[int] = None
    """verl: devices (processes) of the update per node; null = every visible GPU (1 process on CPU).
    verl's default is 8. More than the machine has falls back (CPU) or is refused (GPU), saying so."""
    nnodes: int = 1
    """verl: machines in the update's training world (world = nnodes × processes per node). With
    nnodes > 1 the flow runs on the head node of a Ray cluster, which places the update's ranks on
    nnodes of its nodes (trainer.ray_address); the run directory must be on storage every node sees
    at the same path (the ranks of every node write their checkpoint shards there). Processes per node: trainer.nproc /
    nnodes when trainer.nproc is set, else n_gpus_per_node on GPUs, else 1 on CPU."""
    curve_freq: int = 1
    """Redraw the learning-curve PNG and the Prefect run report every N iterations (always after the
    last one and after a rollback). 1 = every iteration; each redraw costs ~0.15 s plus two
    artifact calls, which is a visible share of a few-second tiny-model iteration."""
    kl_rollback_threshold: float = 0.05
    """Roll back an iteration whose KL(actor‖ref) per-token mean exceeds this: 0.05 nats per token is
    far above what a healthy PPO step moves (the demo peaks near 0.03) and well below collapse."""
    kl_guard_estimator: Literal["exact", "sampled"] = "exact"
    """How the guard measures KL(actor‖ref) on the iteration's responses (our key). 'exact': summed over
    the whole vocabulary at every response position — a forward of the new actor and one of the
    reference. 'sampled': the new actor's forward alone, against the reference and old log-probs the
    score stage stored: per token ρ·((r − 1) − log r), ρ = p_new/p_old, r = p_ref/p_new on the sampled
    token, an unbiased, never negative one-sample estimate of the same per-position KL (a 0.5B-shaped
    4-layer iteration's guard 0.69 s -> 0.37 s in bf16). Unbiased is not close: its importance weight ρ
    gives it heavy tails, and on 48 response tokens it read 5-8x the exact value, so a threshold tuned
    with one estimator does not mean the same with the other; keep 'exact' (the default) unless an
    iteration has thousands of response tokens."""
    kl_guard_val_prompts: int = 0
    """Also measure KL(actor‖ref) on this many validation prompts, sampled from the new actor (an
    on-policy check; 0 = guard on the iteration's responses only, which costs no generation)."""
    on_kl_breach: Literal["halt", "retry"] = "retry"
    """After a rollback: retry the iteration with a larger KL coefficient and smaller lr, or halt."""
    max_rollbacks: int = 2
    """Retries of one iteration before the run halts (each retry doubles the KL pressure)."""
    retry_kl_coef_multiplier: float = 2.0
    """A retry multiplies the KL coefficients (in reward and in loss) by this: the loss's
    (actor.kl_loss_coef) as a config change saved in config.yaml, the reward's as the retried
    iteration's scale in iter_k/retry.json (its gae's controller starts at the predecessor's state
    times it, and the raised value carries on through the controller's state)."""
    retry_lr_divisor: float = 2.0
    """A retry divides the actor's learning rate by this."""
    export_min_val_score: float = 0.5
    """Export only when the latest validation score is at least this (a half-trained policy is not
    worth shipping by accident)."""
    alert_val_drop: Optional[float] = 0.1
    """Our name: alert (log, events.jsonl, a Prefect event) when val/accuracy falls more than this
    below the best validation of the run so far, once per fall (armed again by a new best). 0.1
    sits above the few-point wobble of a small validation set (the demo's climbs 0.33 → 0.77) and
    below a real regression; null = no such alert."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """'auto' = cuda when available, else cpu (verl assumes cuda)."""
    nproc: Optional[int] = None
    """Our name for the update's data-parallel processes, all nodes together; when set it wins over
    n_gpus_per_node × nnodes and must be a multiple of nnodes (nproc / nnodes on each node)."""
    stage_processes: Optional[int] = None
    """Our name: local processes the rollout and validation (HF engine), the score stage and the KL
    guard run on, each a token-balanced share of the one-process generation batches or micro-batches
    (rlhf_core.stages.ranks); null = every GPU of the node the update uses, 1 on CPU. The outputs
    are the same bit for bit at any count; on CPU more processes only pay off for large models.
    Not read while the update's ranks are a worker group (resident models on several processes):
    the stages then run on those ranks, which hold the weights."""
    ray_address: Optional[str] = None
    """Our name: the Ray cluster the update's ranks are placed on when trainer.nnodes > 1 (ray.init's
    address); null = $RAY_ADDRESS, else "auto": the cluster this node belongs to (`ray start --head`
    here, `ray start --address=HEAD_IP:6379` on each other node). Only places processes: no stage's
    config hash includes it."""
    ray_placement_timeout_s: int = 60
    """Our name: seconds the update's placement group may wait for the cluster's nodes and devices;
    then the start is refused, naming what the cluster has and what is missing."""
    concurrent_critic_actor: Literal["auto", "always", "never"] = "auto"
    """Train the critic and the actor at the same time, one thread each, in a one-process update (their
    updates only share the fixed advantages table, so the weights and metrics are the same as one
    after the other). 'auto': on CPU when both run on one thread (a model of small matmuls, ``models.threads``) and
    there are at least 2 cores — the tiny model's update then takes ~0.6x the time. Needs one process."""
    seed: int = 1
    """Global seed (model init, shuffles)."""

    def check(self, key: str) -> None:
        require(self.total_iterations is None or self.total_iterations >= 1, f"{key}.total_iterations",
                "must be >= 1 (or null: derived from total_training_steps / total_epochs)", self.total_iterations)
        require(self.total_training_steps is None or self.total_training_steps >= 1, f"{key}.total_training_steps",
                "must be >= 1 (or null: total_epochs × steps per epoch)", self.total_training_steps)
        require(self.total_epochs >= 1, f"{key}.total_epochs", "must be >= 1", self.total_epochs)
        require(_freq_ok(self.test_freq), f"{key}.test_freq", "must be >= 1, or -1 for never", self.test_freq)
        require(_freq_ok(self.save_freq), f"{key}.save_freq", "must be >= 1, or -1 for only the last-good checkpoint",
                self.save_freq)
        require(self.critic_warmup >= 0, f"{key}.critic_warmup", "must be >= 0", self.critic_warmup)
        for name in self.logger:
            require(name in LOGGERS_HERE + LOGGERS_ELSEWHERE, f"{key}.logger",
                    f"unknown logger {name!r}; valid: {', '.join(LOGGERS_HERE + LOGGERS_ELSEWHERE)}", self.logger)
        require(self.curve_freq >= 1, f"{key}.curve_freq", "must be >= 1", self.curve_freq)
        require(self.kl_rollback_threshold > 0, f"{key}.kl_rollback_threshold", "must be > 0",
                self.kl_rollback_threshold)
        require(self.alert_val_drop is None or self.alert_val_drop > 0, f"{key}.alert_val_drop",
                "must be > 0 (a drop in val/accuracy), or null for no validation-drop alert", self.alert_val_drop)
        require(self.max_rollbacks >= 0, f"{key}.max_rollbacks", "must be >= 0", self.max_rollbacks)
        require(self.retry_kl_coef_multiplier >= 1, f"{key}.retry_kl_coef_multiplier", "must be >= 1",
                self.retry_kl_coef_multiplier)
        require(self.retry_lr_divisor >= 1, f"{key}.retry_lr_divisor", "must be >= 1", self.retry_lr_divisor)
        factor = self.retry_kl_coef_multiplier
        last = self.max_rollbacks * math.log10(factor) if math.isfinite(factor) else math.inf
        require(last <= MAX_RETRY_LOG10, f"{key}.retry_kl_coef_multiplier",
                f"its power trainer.max_rollbacks={self.max_rollbacks} (the last retry's factor) would be "
                f"10^{last:.4g}, beyond 10^{MAX_RETRY_LOG10}: the KL coefficients it scales would leave any sensible "
                "range and overflow the rewards; e.g. retry_kl_coef_multiplier=2 (the default)", factor)
        require(self.nproc is None or self.nproc >= 1, f"{key}.nproc",
                "must be >= 1 (or null: n_gpus_per_node × nnodes)", self.nproc)
        require(self.nnodes >= 1, f"{key}.nnodes", "must be >= 1", self.nnodes)
        require(self.stage_processes is None or self.stage_processes >= 1, f"{key}.stage_processes",
                "must be >= 1 (or null: every GPU of the node, 1 on CPU)", self.stage_processes)
        require(self.nproc is None or self.nproc % self.nnodes == 0, f"{key}.nproc",
                f"must be a multiple of {key}.nnodes={self.nnodes} (the same processes on every node)", self.nproc)
        require(self.ray_address is None or self.ray_address.strip() != "", f"{key}.ray_address",
                "must be a Ray cluster's address (HOST:PORT, ray://HOST:PORT or auto; or null: $RAY_ADDRESS, else auto)",
                self.ray_address)
        require(self.ray_placement_timeout_s >= 1, f"{key}.ray_placement_timeout_s", "must be >= 1 second",
                self.ray_placement_timeout_s)
        require(self.concurrent_critic_actor != "always" or (self.nproc or 1) == 1, f"{key}.concurrent_critic_actor",
                f"'always' needs {key}.nproc=1 (two threads' collectives could pair up differently on each rank); "
                "use 'auto' or 'never'", self.concurrent_critic_actor)


@dataclass
class RLHFConfig(Section):
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    custom_reward_function: CustomRewardConfig = field(default_factory=CustomRewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
