"""Rules a config must obey, each stated in its error, plus the FSDP → DeepSpeed mapping.

Names of algorithms (advantage estimator, policy loss, KL estimator, aggregation mode, KL
controller) are checked against their registries in ``rlhf_core.algos``, so a newly registered
variant is valid at once and a typo fails at load with the valid names.
"""

from __future__ import annotations

from rlhf_core.algos.registry import ADV_ESTIMATORS, AGG_MODES, KL_CONTROLLERS, KL_ESTIMATORS, POLICY_LOSSES
from rlhf_core.algos import kl as _kl  # noqa: F401  (registers the KL estimators)
from rlhf_core.algos import advantage as _advantage  # noqa: F401  (registers the estimators)
from rlhf_core.algos import losses as _losses  # noqa: F401  (registers the policy losses)
from rlhf_core.algos import controllers as _controllers  # noqa: F401  (registers the KL controllers)
from rlhf_core.config.errors import ConfigError
from rlhf_core.config.notes import say_once
from rlhf_core.config.resolve import micro_batching
from rlhf_core.config.schema import DeepSpeedConfig, RLHFConfig

LOGGERS_HERE = ("console", "mlflow")
LOGGERS_ELSEWHERE = ("wandb", "swanlab", "tensorboard", "vemlp_wandb", "clearml", "trackio", "file")


def _fail(key: str, rule: str, value: object) -> None:
    raise ConfigError(f"{key}={value!r}: {rule}")


def _check(ok: bool, key: str, rule: str, value: object) -> None:
    if not ok:
        _fail(key, rule, value)


def _kl_kind_ok(kind: str) -> bool:
    return kind.removesuffix("+") in KL_ESTIMATORS


def _in_registry(registry, key: str, value: str) -> None:
    _check(value in registry, key, f"unknown {registry.kind}; valid: {', '.join(registry.names())}", value)


def _freq_ok(value: int) -> bool:
    return value == -1 or value >= 1


def validate(cfg: RLHFConfig) -> None:
    d, a, r = cfg.data, cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    _check(d.train_batch_size > 0, "data.train_batch_size", "must be > 0", d.train_batch_size)
    _check(0 <= d.val_fraction < 1, "data.val_fraction", "must be in [0, 1)", d.val_fraction)
    _check(d.max_val_samples >= 0, "data.max_val_samples", "must be >= 0 (0 = no validation set)",
           d.max_val_samples)
    _check(d.max_prompt_length > 0, "data.max_prompt_length", "must be > 0", d.max_prompt_length)
    _check(d.max_response_length > 0, "data.max_response_length", "must be > 0", d.max_response_length)
    _check(len(d.train_files) > 0, "data.train_files", "needs at least one file", d.train_files)

    pre = "actor_rollout_ref.actor."
    _check(0 < a.clip_ratio < 1, pre + "clip_ratio", "must be in (0, 1)", a.clip_ratio)
    for name in ("clip_ratio_low", "clip_ratio_high"):
        value = getattr(a, name)
        _check(value is None or value >= 0, pre + name, "must be >= 0 (or null to use clip_ratio)", value)
    _check(a.clip_ratio_c > 1, pre + "clip_ratio_c", "dual-clip bound must be > 1", a.clip_ratio_c)
    if a.clip_ratio != 0.2 and a.clip_ratio_low is not None and a.clip_ratio_high is not None:
        say_once(f"config: {pre}clip_ratio={a.clip_ratio} has no effect while clip_ratio_low/high are set "
                 f"({a.clip_ratio_low}/{a.clip_ratio_high}, verl's defaults are 0.2); set them to null to follow it")
    _check(a.grad_clip > 0, pre + "grad_clip", "must be > 0", a.grad_clip)
    _check(a.ppo_mini_batch_size > 0, pre + "ppo_mini_batch_size", "must be > 0", a.ppo_mini_batch_size)
    _check(a.ppo_epochs >= 1, pre + "ppo_epochs", "must be >= 1", a.ppo_epochs)
    _check(a.kl_loss_coef >= 0, pre + "kl_loss_coef", "must be >= 0", a.kl_loss_coef)
    _check(_kl_kind_ok(a.kl_loss_type), pre + "kl_loss_type",
           f"must be one of {', '.join(KL_ESTIMATORS.names())}, optionally with a '+' suffix", a.kl_loss_type)
    _in_registry(AGG_MODES, pre + "loss_agg_mode", a.loss_agg_mode)
    _in_registry(POLICY_LOSSES, pre + "policy_loss.loss_mode", a.policy_loss.loss_mode)
    _check(a.loss_scale_factor is None or a.loss_scale_factor > 0, pre + "loss_scale_factor",
           "must be > 0 (or null = data.max_response_length)", a.loss_scale_factor)
    _check(a.ppo_mini_batch_size <= d.train_batch_size, pre + "ppo_mini_batch_size",
           f"counts prompts, as in verl, and must be <= data.train_batch_size={d.train_batch_size}",
           a.ppo_mini_batch_size)
    _validate_batching(cfg)
    for key, optim in ((pre + "optim.", a.optim), ("critic.optim.", cfg.critic.optim)):
        _check(optim.lr > 0, key + "lr", "must be > 0", optim.lr)
        _check(len(optim.betas) == 2, key + "betas", "needs exactly two values", optim.betas)
        _check(0 <= optim.lr_warmup_steps_ratio <= 1, key + "lr_warmup_steps_ratio", "must be in [0, 1]",
               optim.lr_warmup_steps_ratio)
        _check(0 <= optim.min_lr_ratio <= 1, key + "min_lr_ratio", "must be in [0, 1]", optim.min_lr_ratio)
        _check(optim.num_cycles > 0, key + "num_cycles", "must be > 0", optim.num_cycles)
    _check(cfg.actor_rollout_ref.model.lora_rank >= 0, "actor_rollout_ref.model.lora_rank", "must be >= 0",
           cfg.actor_rollout_ref.model.lora_rank)
    for key, ds in (("actor_rollout_ref.actor", a.deepspeed_config), ("critic", cfg.critic.deepspeed_config)):
        _check(ds.zero_stage in (0, 1, 2, 3), key + ".deepspeed_config.zero_stage", "must be 0, 1, 2 or 3",
               ds.zero_stage)

    rp = "actor_rollout_ref.rollout."
    _check(r.temperature > 0 or not r.do_sample, rp + "temperature",
           "must be > 0 when sampling (set actor_rollout_ref.rollout.do_sample=false for greedy)", r.temperature)
    v = r.val_kwargs
    _check(v.temperature >= 0, rp + "val_kwargs.temperature", "must be >= 0 (0 = greedy)", v.temperature)
    _check(0 < v.top_p <= 1, rp + "val_kwargs.top_p", "must be in (0, 1]", v.top_p)
    _check(v.top_k == -1 or v.top_k > 0, rp + "val_kwargs.top_k", "must be -1 (off) or > 0", v.top_k)
    _check(v.n >= 1, rp + "val_kwargs.n", "must be >= 1", v.n)
    _check(0 < r.top_p <= 1, rp + "top_p", "must be in (0, 1]", r.top_p)
    _check(r.top_k == -1 or r.top_k > 0, rp + "top_k", "must be -1 (off) or > 0", r.top_k)
    _check(r.n >= 1, rp + "n", "must be >= 1", r.n)
    _check(0 < r.gpu_memory_utilization <= 1, rp + "gpu_memory_utilization", "must be in (0, 1]",
           r.gpu_memory_utilization)
    _check(r.tensor_model_parallel_size >= 1, rp + "tensor_model_parallel_size", "must be >= 1",
           r.tensor_model_parallel_size)
    _check(r.cpu_threads >= 0, rp + "cpu_threads", "must be >= 0 (0 = auto)", r.cpu_threads)
    _check(r.name != "offline" or bool(r.offline_path), rp + "offline_path",
           "must name a JSONL/Parquet file when actor_rollout_ref.rollout.name=offline", r.offline_path)

    al = cfg.algorithm
    _check(0 <= al.gamma <= 1, "algorithm.gamma", "must be in [0, 1]", al.gamma)
    _check(0 <= al.lam <= 1, "algorithm.lam", "must be in [0, 1]", al.lam)
    _in_registry(ADV_ESTIMATORS, "algorithm.adv_estimator", al.adv_estimator)
    _in_registry(KL_CONTROLLERS, "algorithm.kl_ctrl.type", al.kl_ctrl.type)
    _check(_kl_kind_ok(al.kl_penalty), "algorithm.kl_penalty",
           f"must be one of {', '.join(KL_ESTIMATORS.names())}, optionally with a '+' suffix", al.kl_penalty)
    _check(al.kl_ctrl.kl_coef >= 0, "algorithm.kl_ctrl.kl_coef", "must be >= 0", al.kl_ctrl.kl_coef)
    _check(al.kl_ctrl.target_kl > 0, "algorithm.kl_ctrl.target_kl", "must be > 0", al.kl_ctrl.target_kl)
    _check(al.kl_ctrl.horizon > 0, "algorithm.kl_ctrl.horizon", "must be > 0", al.kl_ctrl.horizon)
    _check(cfg.critic.cliprange_value > 0, "critic.cliprange_value", "must be > 0", cfg.critic.cliprange_value)
    if cfg.critic.loss_agg_mode is not None:
        _in_registry(AGG_MODES, "critic.loss_agg_mode", cfg.critic.loss_agg_mode)
    _check(cfg.critic.grad_clip > 0, "critic.grad_clip", "must be > 0", cfg.critic.grad_clip)
    cm = cfg.critic.ppo_mini_batch_size
    _check(cm is None or 0 < cm <= d.train_batch_size, "critic.ppo_mini_batch_size",
           f"counts prompts, as in verl, and must be in [1, data.train_batch_size={d.train_batch_size}]", cm)

    t = cfg.trainer
    _check(t.total_iterations is None or t.total_iterations >= 1, "trainer.total_iterations",
           "must be >= 1 (or null: derived from total_training_steps / total_epochs)", t.total_iterations)
    _check(t.total_training_steps is None or t.total_training_steps >= 1, "trainer.total_training_steps",
           "must be >= 1 (or null: total_epochs × steps per epoch)", t.total_training_steps)
    _check(t.total_epochs >= 1, "trainer.total_epochs", "must be >= 1", t.total_epochs)
    _check(_freq_ok(t.test_freq), "trainer.test_freq", "must be >= 1, or -1 for never", t.test_freq)
    _check(_freq_ok(t.save_freq), "trainer.save_freq", "must be >= 1, or -1 for only the last-good checkpoint",
           t.save_freq)
    _check(t.critic_warmup >= 0, "trainer.critic_warmup", "must be >= 0", t.critic_warmup)
    for name in t.logger:
        _check(name in LOGGERS_HERE + LOGGERS_ELSEWHERE, "trainer.logger",
               f"unknown logger {name!r}; valid: {', '.join(LOGGERS_HERE + LOGGERS_ELSEWHERE)}", t.logger)
    _check(t.curve_freq >= 1, "trainer.curve_freq", "must be >= 1", t.curve_freq)
    _check(t.kl_rollback_threshold > 0, "trainer.kl_rollback_threshold", "must be > 0", t.kl_rollback_threshold)
    _check(t.max_rollbacks >= 0, "trainer.max_rollbacks", "must be >= 0", t.max_rollbacks)
    _check(t.retry_kl_coef_multiplier >= 1, "trainer.retry_kl_coef_multiplier", "must be >= 1",
           t.retry_kl_coef_multiplier)
    _check(t.retry_lr_divisor >= 1, "trainer.retry_lr_divisor", "must be >= 1", t.retry_lr_divisor)
    _check(t.nproc is None or t.nproc >= 1, "trainer.nproc", "must be >= 1 (or null: n_gpus_per_node × nnodes)",
           t.nproc)
    _check(t.concurrent_critic_actor != "always" or (t.nproc or 1) == 1, "trainer.concurrent_critic_actor",
           "'always' needs trainer.nproc=1 (two threads' collectives could pair up differently on each rank); "
           "use 'auto' or 'never'", t.concurrent_critic_actor)
    rm = cfg.reward_model
    _check(rm.model.path is not None or not rm.enable, "reward_model.model.path",
           "must be set when reward_model.enable=true", rm.model.path)
    _validate_warm_start(cfg)


def _validate_warm_start(cfg: RLHFConfig) -> None:
    w, key = cfg.actor_rollout_ref.model.warm_start, "actor_rollout_ref.model.warm_start."
    _check(w.steps >= 1, key + "steps", "must be >= 1", w.steps)
    _check(w.batch_size >= 1, key + "batch_size", "must be >= 1", w.batch_size)
    _check(w.lr > 0, key + "lr", "must be > 0", w.lr)
    _check(w.warmup_steps >= 1, key + "warmup_steps", "must be >= 1", w.warmup_steps)
    _check(0 <= w.prose_answer_fraction <= 1, key + "prose_answer_fraction", "must be in [0, 1]",
           w.prose_answer_fraction)
    _check(w.eval_every >= 0, key + "eval_every", "must be >= 0 (0 = evaluate only at the end)", w.eval_every)
    _check(w.dev_size >= 1, key + "dev_size", "must be >= 1", w.dev_size)


def effective_deepspeed(cfg: RLHFConfig) -> DeepSpeedConfig:
    """The actor's DeepSpeed settings with verl's FSDP offload flags folded in."""
    a = cfg.actor_rollout_ref.actor
    ds, fsdp = a.deepspeed_config, a.fsdp_config
    return DeepSpeedConfig(
        zero_stage=ds.zero_stage,
        dtype=ds.dtype,
        offload_optimizer=ds.offload_optimizer or fsdp.optimizer_offload or fsdp.offload_policy,
        offload_param=ds.offload_param or fsdp.param_offload or fsdp.offload_policy,
        config_path=ds.config_path,
    )


def _validate_batching(cfg: RLHFConfig) -> None:
    """Each role's micro-batching is complete (a count without dynamic batching, a budget that holds
    the longest sequence with it), named by the key to set."""
    d = cfg.data
    longest = d.max_prompt_length + d.max_response_length
    keys = {
        "actor": ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"),
        "critic": ("critic.ppo_micro_batch_size_per_gpu", "critic.ppo_max_token_len_per_gpu"),
        "rollout": ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
                    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"),
        "ref": ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
                "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"),
    }
    for role, (count_key, budget_key) in keys.items():
        mb = micro_batching(cfg, role)
        if mb.use_dynamic_bsz:
            # a micro-batch must hold at least one full sequence, or dynamic batching cannot place it
            _check(mb.token_budget >= longest, budget_key,
                   f"must be >= data.max_prompt_length + data.max_response_length = {longest}", mb.token_budget)
        else:
            _check(mb.micro_batch_size > 0, count_key, "must be > 0", mb.micro_batch_size)
