"""Rules a config must obey, each stated in its error, plus the FSDP → DeepSpeed mapping."""

from __future__ import annotations

from rlhf_core.config.schema import DeepSpeedConfig, RLHFConfig

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


def _fail(key: str, rule: str, value: object) -> None:
    from rlhf_core.config.loader import ConfigError

    raise ConfigError(f"{key}={value!r}: {rule}")


def _check(ok: bool, key: str, rule: str, value: object) -> None:
    if not ok:
        _fail(key, rule, value)


def _kl_kind_ok(kind: str) -> bool:
    return kind.removesuffix("+") in KL_KINDS


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
    _check(a.max_grad_norm > 0, pre + "max_grad_norm", "must be > 0", a.max_grad_norm)
    _check(a.ppo_mini_batch_size > 0, pre + "ppo_mini_batch_size", "must be > 0", a.ppo_mini_batch_size)
    _check(a.ppo_micro_batch_size_per_gpu > 0, pre + "ppo_micro_batch_size_per_gpu", "must be > 0",
           a.ppo_micro_batch_size_per_gpu)
    _check(a.ppo_epochs >= 1, pre + "ppo_epochs", "must be >= 1", a.ppo_epochs)
    _check(a.kl_loss_coef >= 0, pre + "kl_loss_coef", "must be >= 0", a.kl_loss_coef)
    _check(_kl_kind_ok(a.kl_loss_type), pre + "kl_loss_type",
           f"must be one of {', '.join(KL_KINDS)}, optionally with a '+' suffix", a.kl_loss_type)
    _check(a.loss_agg_mode in AGG_MODES, pre + "loss_agg_mode", f"must be one of {', '.join(AGG_MODES)}",
           a.loss_agg_mode)
    # a micro-batch must hold at least one full sequence, or dynamic batching cannot place it
    longest = d.max_prompt_length + d.max_response_length
    _check(not a.use_dynamic_bsz or a.ppo_max_token_len_per_gpu >= longest,
           pre + "ppo_max_token_len_per_gpu",
           f"must be >= data.max_prompt_length + data.max_response_length = {longest}",
           a.ppo_max_token_len_per_gpu)
    _check(a.optim.lr > 0, pre + "optim.lr", "must be > 0", a.optim.lr)
    _check(len(a.optim.betas) == 2, pre + "optim.betas", "needs exactly two values", a.optim.betas)
    _check(cfg.actor_rollout_ref.model.lora_rank >= 0, "actor_rollout_ref.model.lora_rank", "must be >= 0",
           cfg.actor_rollout_ref.model.lora_rank)
    for key, ds in (("actor_rollout_ref.actor", a.deepspeed_config), ("critic", cfg.critic.deepspeed_config)):
        _check(ds.zero_stage in (0, 1, 2, 3), key + ".deepspeed_config.zero_stage", "must be 0, 1, 2 or 3",
               ds.zero_stage)

    rp = "actor_rollout_ref.rollout."
    _check(r.temperature > 0, rp + "temperature", "must be > 0 (use a small value for near-greedy)",
           r.temperature)
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
    _check(_kl_kind_ok(al.kl_penalty), "algorithm.kl_penalty",
           f"must be one of {', '.join(KL_KINDS)}, optionally with a '+' suffix", al.kl_penalty)
    _check(al.kl_ctrl.kl_coef >= 0, "algorithm.kl_ctrl.kl_coef", "must be >= 0", al.kl_ctrl.kl_coef)
    _check(al.kl_ctrl.target_kl > 0, "algorithm.kl_ctrl.target_kl", "must be > 0", al.kl_ctrl.target_kl)
    _check(al.kl_ctrl.horizon > 0, "algorithm.kl_ctrl.horizon", "must be > 0", al.kl_ctrl.horizon)
    _check(cfg.critic.cliprange_value > 0, "critic.cliprange_value", "must be > 0", cfg.critic.cliprange_value)
    _check(cfg.critic.loss_agg_mode in AGG_MODES, "critic.loss_agg_mode",
           f"must be one of {', '.join(AGG_MODES)}", cfg.critic.loss_agg_mode)

    t = cfg.trainer
    _check(t.total_iterations >= 1, "trainer.total_iterations", "must be >= 1", t.total_iterations)
    _check(t.test_freq >= 1, "trainer.test_freq", "must be >= 1", t.test_freq)
    _check(t.save_freq >= 1, "trainer.save_freq", "must be >= 1", t.save_freq)
    _check(t.curve_freq >= 1, "trainer.curve_freq", "must be >= 1", t.curve_freq)
    _check(t.kl_rollback_threshold > 0, "trainer.kl_rollback_threshold", "must be > 0", t.kl_rollback_threshold)
    _check(t.max_rollbacks >= 0, "trainer.max_rollbacks", "must be >= 0", t.max_rollbacks)
    _check(t.retry_kl_coef_multiplier >= 1, "trainer.retry_kl_coef_multiplier", "must be >= 1",
           t.retry_kl_coef_multiplier)
    _check(t.retry_lr_divisor >= 1, "trainer.retry_lr_divisor", "must be >= 1", t.retry_lr_divisor)
    _check(t.nproc >= 1, "trainer.nproc", "must be >= 1", t.nproc)
    _check(t.concurrent_critic_actor != "always" or t.nproc == 1, "trainer.concurrent_critic_actor",
           "'always' needs trainer.nproc=1 (two threads' collectives could pair up differently on each rank); "
           "use 'auto' or 'never'", t.concurrent_critic_actor)
    _check(cfg.reward_model.model_path is not None or not cfg.reward_model.enable,
           "reward_model.model_path", "must be set when reward_model.enable=true", cfg.reward_model.model_path)
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
