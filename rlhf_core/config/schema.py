"""Typed configuration: every key a user can set, with its default and the reason for it.

Names follow verl's dotted layout (``actor_rollout_ref.actor.clip_ratio``) so a verl user's overrides
work unchanged. Defaults marked "seed" come from the project's seed design; the others are chosen for
the laptop-CPU default and say why. Rules that a value must obey live in ``validate.py``.

FSDP → DeepSpeed mapping (the update stage always trains with DeepSpeed ZeRO):
    actor.strategy = fsdp | fsdp2        → accepted as aliases of ``deepspeed`` (ZeRO stage from
                                           ``deepspeed_config.zero_stage``; FSDP's full sharding is
                                           ZeRO-3, so set zero_stage=3 for the same memory profile)
    fsdp_config.param_offload = true     → deepspeed_config.offload_param = true (ZeRO-3 only)
    fsdp_config.optimizer_offload = true → deepspeed_config.offload_optimizer = true
    fsdp_config.offload_policy = true    → both of the above (FSDP2's CPUOffloadPolicy moves
                                           parameters, gradients and optimizer state to CPU)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=lambda: ["data/arith/train.jsonl"])
    """Raw prompt files (JSONL, Parquet or CSV). The default is the embedded arithmetic set."""
    val_files: list[str] = field(default_factory=list)
    """Optional separate validation files; when empty, val_fraction of train is held out."""
    adapter: Literal["gsm8k", "generic"] = "gsm8k"
    """How raw rows become prompts: 'gsm8k' (question/answer with '#### n') or 'generic' (column map)."""
    data_source: str = "openai/gsm8k"
    """Value written to the data_source column; routes the reward function (verl convention)."""
    ability: str = "math"
    """Value written to verl's ability column; GSM8K-style word problems are 'math'."""
    prompt_key: str = "question"
    """Column holding the prompt text (gsm8k: the question)."""
    answer_key: str = "answer"
    """Column holding the answer (generic: the ground truth verbatim; gsm8k: the solution ending '#### n')."""
    id_key: str = "id"
    """Column whose values become prompt_id when present on every row and unique ('' = always hash)."""
    instruction: str = "Let's think step by step and output the final answer after \"####\"."
    """Appended to every question in the chat prompt (verl's GSM8K recipe uses the same wording)."""
    system_prompt: Optional[str] = None
    """Optional system message placed before the user turn."""
    val_fraction: float = 0.1
    """Share of rows held out for validation when val_files is empty (deterministic by seed)."""
    max_val_samples: int = 256
    """Cap on validation prompts: validation is sampled, so a few hundred is enough signal."""
    max_prompt_length: int = 256
    """Prompts longer than this (tokens, chat template applied) are rejected with a reason."""
    max_response_length: int = 128
    """Generation budget per response (tokens)."""
    train_batch_size: int = 256
    """seed: prompts per PPO iteration (before n samples per prompt)."""
    dedup: bool = True
    """Drop exact duplicate prompts (kept: first occurrence; the rest go to rejects)."""
    use_sequence_packing: bool = True
    """Pack several sequences into one row (block-diagonal attention) instead of padding."""
    seed: int = 42
    """Seed for the train/validation split and the per-iteration prompt sampling."""


# ---------------------------------------------------------------------------------------------
# actor / rollout / reference
# ---------------------------------------------------------------------------------------------


@dataclass
class WarmStartConfig:
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
    """Linear lr warm-up steps."""
    prose_answer_fraction: float = 0.6
    """Share of SFT answers ending in prose ("The answer is 7.") instead of '#### 7': the warm policy then
    follows the output-format instruction only sometimes, as small instruct models do on GSM8K."""
    eval_every: int = 200
    """Measure sampled accuracy on the dev prompts every N steps (0 = only at the end); ~1 s each."""
    dev_size: int = 128
    """Train-split prompts held out of the fine-tuning to measure it (validation stays untouched)."""
    seed: int = 0
    """Seed of the data order, the prose endings and the dev sample."""


@dataclass
class ModelConfig:
    path: str = "tiny"
    """Hugging Face model directory, or 'tiny' for the project's locally built tiny model."""
    tokenizer_path: Optional[str] = None
    """Defaults to the model path."""
    lora_rank: int = 0
    """seed: 0 disables LoRA; > 0 trains rank-r adapters only (peft)."""
    lora_alpha: int = 16
    """LoRA scaling numerator (scale = alpha / rank)."""
    target_modules: str = "all-linear"
    """peft target modules: 'all-linear' or a comma-separated list of module names."""
    enable_gradient_checkpointing: bool = False
    """Trade compute for memory in the update; off for tiny models where it only costs time."""
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    """Supervised warm start of the initial actor (the embedded demo enables it)."""


@dataclass
class OptimConfig:
    lr: float = 1e-6
    """Learning rate (verl's actor default)."""
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    lr_warmup_steps: int = 0
    """Linear warm-up over this many optimizer steps (0 = none)."""


@dataclass
class FSDPConfig:
    """Accepted for verl compatibility; mapped to deepspeed_config (see the module docstring)."""

    param_offload: bool = False
    optimizer_offload: bool = False
    offload_policy: bool = False
    """seed: FSDP2 CPU offload policy; maps to DeepSpeed parameter + optimizer offload."""


@dataclass
class DeepSpeedConfig:
    zero_stage: int = 0
    """ZeRO stage 0-3. 0 is fastest for one process on a CPU; use 2 or 3 on several GPUs. bf16/fp16 train
    at stage >= 1 (DeepSpeed's stage-0 mixed-precision optimizer hides the per-parameter state we save)."""
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """'auto' = fp32 on CPU (no fast bf16 there), bf16 on CUDA."""
    offload_optimizer: bool = False
    offload_param: bool = False
    config_path: Optional[str] = None
    """A raw DeepSpeed JSON whose keys override the generated config."""


@dataclass
class ActorConfig:
    strategy: Literal["deepspeed", "fsdp", "fsdp2"] = "deepspeed"
    """Training backend. fsdp/fsdp2 are accepted aliases that map to DeepSpeed ZeRO."""
    ppo_mini_batch_size: int = 64
    """seed: sequences (prompts × n) per optimizer step."""
    ppo_micro_batch_size_per_gpu: int = 8
    """Sequences per forward/backward when use_dynamic_bsz is off."""
    use_dynamic_bsz: bool = True
    """Split mini-batches into micro-batches by token budget instead of a fixed count."""
    ppo_max_token_len_per_gpu: int = 3072
    """seed: token budget of one micro-batch with use_dynamic_bsz."""
    ppo_epochs: int = 1
    """Passes over the iteration's batch."""
    shuffle: bool = True
    """Shuffle sequences between PPO epochs (seeded)."""
    clip_ratio: float = 0.2
    """seed: PPO ε; clip_ratio_low / clip_ratio_high default to it."""
    clip_ratio_low: Optional[float] = None
    clip_ratio_high: Optional[float] = None
    clip_ratio_c: float = 3.0
    """seed: dual-clip bound c (> 1) for negative advantages."""
    loss_agg_mode: str = "token-mean"
    """token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm."""
    policy_loss: str = "vanilla"
    """Policy-loss registry name."""
    entropy_coeff: float = 0.0
    """Entropy bonus weight (verl's default 0)."""
    use_kl_loss: bool = False
    """Add kl_loss_coef·KL(actor‖ref) to the actor loss (GRPO-style) instead of/as well as in reward."""
    kl_loss_coef: float = 0.001
    """seed."""
    kl_loss_type: str = "k1+"
    """seed: KL estimator for the loss (k1, k2, k3, abs, … and '+' straight-through variants)."""
    max_grad_norm: float = 1.0
    """seed: gradient-norm clip (DeepSpeed gradient_clipping)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    deepspeed_config: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)


@dataclass
class RolloutConfig:
    name: Literal["hf", "vllm", "offline"] = "hf"
    """Engine: Hugging Face generate (CPU/GPU), vLLM (GPU), or imported offline trajectories."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1 disables top-k (vLLM convention)."""
    n: int = 1
    """Responses sampled per prompt."""
    seed: int = 0
    """Sampling seed; the iteration number is added so iterations differ but reruns match."""
    generation_batch_tokens: int = 8192
    """Token budget of one generation batch (prompt + response slots) for the hf engine."""
    gpu_memory_utilization: float = 0.5
    """vLLM: share of GPU memory for weights + KV cache."""
    tensor_model_parallel_size: int = 1
    """vLLM tensor parallel degree."""
    offline_path: Optional[str] = None
    """name=offline: JSONL/Parquet of responses generated elsewhere."""
    log_prob_max_token_len_per_gpu: int = 8192
    """Token budget of one scoring micro-batch (old/ref log-probs, values)."""
    cpu_threads: int = 0
    """hf engine on CPU: torch threads while generating; 0 = auto: 1 for models under 100 M parameters
    (their per-token matmuls are too small to split; on shared cores extra threads spin-wait: tiny
    model 3,600 tokens/s on 1 thread vs 220 on 2 busy cores), else torch's default."""


@dataclass
class RefConfig:
    model_path: Optional[str] = None
    """Reference policy; defaults to the actor's initial model."""


@dataclass
class ActorRolloutRefConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)


# ---------------------------------------------------------------------------------------------
# critic, reward
# ---------------------------------------------------------------------------------------------


@dataclass
class CriticModelConfig:
    path: Optional[str] = None
    """Backbone for the value model; defaults to the actor's initial model (new scalar head)."""


@dataclass
class CriticConfig:
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """verl's critic default lr is 1e-5 (ten times the actor's)."""
    cliprange_value: float = 0.5
    """Value clipping ε around the old values."""
    loss_agg_mode: str = "token-mean"
    ppo_epochs: Optional[int] = None
    """Defaults to the actor's."""
    max_grad_norm: float = 1.0
    deepspeed_config: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)


@dataclass
class RewardModelConfig:
    enable: bool = False
    """Score with a sequence-classification reward model instead of rule-based rewards."""
    model_path: Optional[str] = None
    micro_batch_size: int = 16


@dataclass
class CustomRewardConfig:
    path: Optional[str] = None
    """'module' or a .py file holding a verl-style compute_score; loaded only when set."""
    name: str = "compute_score"
    gsm8k_method: Literal["strict", "flexible"] = "strict"
    """GSM8K answer extraction: strict needs '#### n'; flexible finds the last number stated."""
    format_score: float = 0.0
    score: float = 1.0


# ---------------------------------------------------------------------------------------------
# algorithm, trainer
# ---------------------------------------------------------------------------------------------


@dataclass
class KLCtrlConfig:
    type: Literal["fixed", "adaptive"] = "adaptive"
    """seed."""
    kl_coef: float = 0.001
    """seed: initial KL-in-reward coefficient."""
    target_kl: float = 0.02
    """seed: adaptive controller target (per-token mean KL)."""
    horizon: int = 10000
    """Adaptive controller horizon (samples)."""


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv: bool = True
    """Whiten advantages over the batch's valid tokens."""
    use_kl_in_reward: bool = True
    """seed: subtract kl_coef·KL(actor‖ref) from the token rewards."""
    kl_penalty: str = "kl"
    """KL estimator for the in-reward penalty."""
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)


@dataclass
class TrainerConfig:
    project_name: str = "rlhf"
    experiment_name: str = "default"
    runs_root: str = "runs"
    """Run directories are created under this folder."""
    total_iterations: int = 20
    """PPO iterations (rollout → score → gae → update → guard)."""
    test_freq: int = 10
    """seed: validate every N iterations (and after the last)."""
    save_freq: int = 10
    """seed: keep a full checkpoint every N iterations (and the last-good one always)."""
    max_ckpt_to_keep: int = 2
    curve_freq: int = 1
    """Redraw the learning-curve PNG and the Prefect run report every N iterations (always after the
    last one and after a rollback). 1 = every iteration; each redraw costs ~0.15 s plus two
    artifact calls, which is a visible share of a few-second tiny-model iteration."""
    kl_rollback_threshold: float = 0.05
    """seed: roll back an iteration whose KL(actor‖ref) per-token mean exceeds this."""
    kl_guard_val_prompts: int = 0
    """Also measure KL(actor‖ref) on this many validation prompts, sampled from the new actor (an
    on-policy check; 0 = guard on the iteration's responses only, which costs no generation)."""
    on_kl_breach: Literal["halt", "retry"] = "retry"
    max_rollbacks: int = 2
    retry_kl_coef_multiplier: float = 2.0
    retry_lr_divisor: float = 2.0
    export_min_val_score: float = 0.5
    """seed: export only when the latest validation score is at least this."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    nproc: int = 1
    """Data-parallel processes for the update stage."""
    concurrent_critic_actor: Literal["auto", "always", "never"] = "auto"
    """Train the critic and the actor at the same time, one thread each, in a one-process update (their
    updates only share the fixed advantages table, so the weights and metrics are the same as one
    after the other). 'auto': on CPU when both run on one thread (models under 100 M parameters) and
    there are at least 2 cores — the tiny model's update then takes ~0.6x the time. Needs nproc=1."""
    seed: int = 1
    """Global seed (model init, shuffles)."""


@dataclass
class RLHFConfig:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    custom_reward_function: CustomRewardConfig = field(default_factory=CustomRewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
