"""verl's keys that are not fields of the schema: older names, and knobs with no effect here.

A verl user pastes a whole command; every key of it must either act with verl's meaning (a schema
field), move to the field that now holds its meaning (``RENAMED``), be accepted and named once as
having no effect here, with the reason (``NO_EFFECT``), or be refused at once with the fix because a
value other than verl's default would change the result and this project cannot do it
(``ONLY_DEFAULT``). Entries ending in '.' cover every key under that section.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

A, R, C = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout.", "critic."

RENAMED: dict[str, str] = {
    # our earlier names → the verl name that now holds the meaning
    A + "max_grad_norm": A + "grad_clip",
    C + "max_grad_norm": C + "grad_clip",
    "reward_model.model_path": "reward_model.model.path",
    "data.use_sequence_packing": "actor_rollout_ref.model.use_remove_padding",
    # verl's own second spellings
    A + "optim.clip_grad": A + "grad_clip",
    A + "optim.grad_clip": A + "grad_clip",
    C + "optim.clip_grad": C + "grad_clip",
    C + "optim.grad_clip": C + "grad_clip",
    "trainer.max_actor_ckpt_to_keep": "trainer.max_ckpt_to_keep",
    # verl 0.9.1's reward section (reward.*) holds what the legacy reward_model.* / custom_reward_function.* held
    "reward.custom_reward_function.path": "custom_reward_function.path",
    "reward.custom_reward_function.name": "custom_reward_function.name",
    "reward.reward_model.enable": "reward_model.enable",
    "reward.reward_model.model_path": "reward_model.model.path",
    "reward.reward_manager.name": "reward_model.reward_manager",
    **{f"{section}.reward_kwargs.overlong_buffer_cfg.{name}": f"reward_model.overlong_buffer.{name}"
       for section in ("reward", "reward_model") for name in ("enable", "len", "penalty_factor", "log")},
    # verl 0.9.1's critic.fsdp (the engine config) beside critic.model.fsdp_config
    C + "fsdp.param_offload": C + "model.fsdp_config.param_offload",
    C + "fsdp.optimizer_offload": C + "model.fsdp_config.optimizer_offload",
    C + "fsdp.offload_policy": C + "model.fsdp_config.offload_policy",
}
"""old dotted key → its schema key. ``actor.policy_loss=<name>`` (a plain name where verl now has a
section) is handled by the loader as ``actor.policy_loss.loss_mode``."""

_ENGINE = "a vLLM / FSDP engine knob; the HF engine and DeepSpeed here have no such setting"
_PERF = "a speed knob of verl's engines with no counterpart here; results do not depend on it"
_DATA = "verl's data-loader plumbing; preprocess writes every prompt to Parquet up front"
_LOG = "every rollout and validation row is already kept in the run directory's Parquet tables"
_QUANT = "quantized training and rollout are not implemented; their settings are read only when enabled"
_TEXT = "text-only prompts here"
_DETERMINISTIC = "runs here are deterministic for a seed (fixed reduction order on CPU)"
_LORA_ADAPTER = "LoRA starts from fresh adapters (model.lora_rank > 0); load a trained one by merging it first"
_MEGATRON_LORA = "Megatron's LoRA settings; the FSDP ones (model.lora_rank, lora_alpha, target_modules) act here"
_MANAGER = "reward functions are looked up by data source or custom_reward_function.path"

NO_EFFECT: dict[str, str] = {
    "data.tokenizer": "the tokenizer is the actor's (actor_rollout_ref.model.tokenizer_path)",
    "data.use_shm": _DATA, "data.dataloader_num_workers": _DATA, "data.return_raw_input_ids": _DATA,
    "data.return_raw_chat": _DATA, "data.return_full_prompt": _DATA, "data.return_multi_modal_inputs": _DATA,
    "data.filter_overlong_prompts_workers": _DATA, "data.image_key": "text-only prompts here",
    "data.video_key": "text-only prompts here", "data.trust_remote_code": _DATA,
    "data.val_batch_size": "validation is batched by token budget (rollout.generation_batch_tokens)",
    "data.gen_batch_size": "dynamic sampling (algorithm.filter_groups) draws one pack slot of data.train_batch_size "
                           "prompts at a time until enough groups are kept; without it every draw is one slot",
    "data.validation_shuffle": "validation prompts are a fixed, seeded set", "data.apply_chat_template_kwargs": _DATA,
    "data.custom_cls.": _DATA, "data.sampler.": _DATA, "data.datagen.": _DATA, "data.tool_config_path": _DATA,
    "actor_rollout_ref.hybrid_engine": "actor and rollout always share the weights here",
    "actor_rollout_ref.nccl_timeout": _PERF,
    "actor_rollout_ref.model.use_shm": _PERF, "actor_rollout_ref.model.external_lib": _DATA,
    "actor_rollout_ref.model.override_config.": "only override_config.attn_implementation acts here; "
                                                "the model's config.json is used as saved",
    "actor_rollout_ref.model.hf_config_path": "the model's config.json is used as saved",
    "actor_rollout_ref.model.custom_chat_template": "the tokenizer's own chat template is used",
    "actor_rollout_ref.model.enable_activation_offload": _PERF, "actor_rollout_ref.model.use_liger": _PERF,
    "actor_rollout_ref.model.use_fused_kernels": _PERF, "actor_rollout_ref.model.fused_kernel_options.": _PERF,
    "actor_rollout_ref.model.exclude_modules": "LoRA targets are model.target_modules",
    "actor_rollout_ref.model.tiled_mlp.": _PERF,
    A + "use_torch_compile": _PERF, A + "entropy_from_logits_with_chunking": _PERF,
    A + "entropy_checkpointing": _PERF, A + "checkpoint.": "checkpoints always hold model, optimizer and RNG state",
    A + "profiler.": _PERF, A + "data_loader_seed": "shuffles are seeded by trainer.seed",
    A + "calculate_entropy": "actor/entropy is always computed", A + "use_remove_padding": _PERF,
    A + "fsdp_config.wrap_policy.": _ENGINE, A + "fsdp_config.reshard_after_forward": _ENGINE,
    A + "fsdp_config.fsdp_size": _ENGINE, A + "fsdp_config.forward_prefetch": _ENGINE,
    A + "fsdp_config.model_dtype": "dtype is deepspeed_config.dtype", A + "fsdp_config.use_orig_params": _ENGINE,
    A + "fsdp_config.dtype": "dtype is deepspeed_config.dtype", A + "fsdp_config.strategy": _ENGINE,
    A + "fsdp_config.seed": "seeds come from trainer.seed", A + "fsdp_config.use_torch_compile": _PERF,
    A + "optim.optimizer_impl": "torch.optim's AdamW", A + "optim.override_optimizer_config": _ENGINE,
    A + "rollout_n": "it is actor_rollout_ref.rollout.n",
    "actor_rollout_ref.ref.strategy": _ENGINE, "actor_rollout_ref.ref.use_torch_compile": _PERF,
    "actor_rollout_ref.ref.profiler.": _PERF, "actor_rollout_ref.ref.ulysses_sequence_parallel_size": _PERF,
    "actor_rollout_ref.ref.entropy_from_logits_with_chunking": _PERF,
    "actor_rollout_ref.ref.entropy_checkpointing": _PERF, "actor_rollout_ref.ref.rollout_n": _PERF,
    R + "mode": _ENGINE, R + "dtype": "the rollout uses the actor's dtype", R + "ignore_eos": _ENGINE,
    R + "enforce_eager": _ENGINE, R + "cudagraph_capture_sizes": _ENGINE, R + "free_cache_engine": _ENGINE,
    R + "max_num_batched_tokens": _ENGINE, R + "max_model_len": _ENGINE, R + "max_num_seqs": _ENGINE,
    R + "enable_chunked_prefill": _ENGINE, R + "enable_prefix_caching": _ENGINE, R + "load_format": _ENGINE,
    R + "disable_log_stats": _ENGINE, R + "engine_kwargs.": _ENGINE, R + "prompt_length": "it is data.max_prompt_length",
    R + "response_length": "it is data.max_response_length", R + "layered_summon": _ENGINE,
    R + "calculate_log_probs": "the rollout's own log-probs are always recorded (rollout_log_probs)",
    R + "logprobs_mode": _ENGINE, R + "scheduling_policy": _ENGINE, R + "profiler.": _PERF,
    R + "prometheus.": _PERF, R + "trace.": _LOG, R + "checkpoint_engine.": _ENGINE, R + "agent.": _ENGINE,
    R + "skip_tokenizer_init": _ENGINE, R + "multi_stage_wake_up": _ENGINE,
    R + "multi_turn.": "multi-turn rollouts are off (multi_turn.enable=false)",
    C + "rollout_n": "it is actor_rollout_ref.rollout.n", C + "data_loader_seed": "shuffles are seeded by trainer.seed",
    C + "checkpoint.": "checkpoints always hold model, optimizer and RNG state", C + "profiler.": _PERF,
    C + "model.override_config.": "only override_config.attn_implementation acts here; the model's config.json "
                                  "is used as saved", C + "model.external_lib": _DATA,
    C + "model.use_shm": _PERF, C + "model.enable_activation_offload": _PERF, C + "model.lora_rank": _ENGINE,
    C + "model.lora_alpha": _ENGINE, C + "model.target_modules": _ENGINE, C + "model.tiled_mlp.": _PERF,
    C + "optim.optimizer_impl": "torch.optim's AdamW", C + "optim.override_optimizer_config": _ENGINE,
    "reward_model.enable_resource_pool": _ENGINE, "reward_model.n_gpus_per_node": _ENGINE,
    "reward_model.nnodes": _ENGINE, "reward_model.model.external_lib": _DATA,
    "reward_model.model.override_config.": "the model's config.json is used as saved",
    "reward_model.model.use_shm": _PERF, "reward_model.model.use_remove_padding": _PERF,
    "reward_model.model.use_fused_kernels": _PERF, "reward_model.forward_max_token_len_per_gpu": _PERF,
    "reward_model.launch_reward_fn_async": _PERF, "reward_model.sandbox_fusion.": "no code sandbox here",
    "reward_model.profiler.": _PERF, "reward_model.ulysses_sequence_parallel_size": _PERF,
    "reward_model.use_reward_loop": _ENGINE, "reward_model.num_workers": _PERF, "reward_model.rollout.": _ENGINE,
    "reward_model.reward_loop_source": _ENGINE, "reward_model.reward_loop_module_path": _ENGINE,
    "reward_model.reward_loop_class_name": _ENGINE,
    "reward_manager.": "the naive reward manager (reward_model.reward_manager=naive)",
    "algorithm.use_pf_ppo": "not implemented; the batch is used as sampled",
    "algorithm.pf_ppo.": "not implemented",
    "trainer.balance_batch": "generation and micro-batches are balanced by token budget always",
    "trainer.log_val_generations": _LOG, "trainer.rollout_data_dir": _LOG, "trainer.validation_data_dir": _LOG,
    "trainer.esi_redundant_time": _PERF, "trainer.resume_mode": "resume with `rlhf run --resume RUN_DIR`",
    "trainer.resume_from_path": "resume with `rlhf run --resume RUN_DIR`",
    "trainer.default_hdfs_dir": "checkpoints live in the run directory",
    "trainer.default_local_dir": "checkpoints live in the run directory (trainer.runs_root)",
    "trainer.del_local_ckpt_after_load": "checkpoints live in the run directory",
    "trainer.max_critic_ckpt_to_keep": "actor and critic are kept together (trainer.max_ckpt_to_keep)",
    "trainer.ray_wait_register_center_timeout": _ENGINE, "trainer.use_legacy_worker_impl": _ENGINE,
    "trainer.profile_steps": _PERF, "trainer.profile_continuous_steps": _PERF, "trainer.controller_nsight_options.": _PERF,
    "trainer.worker_nsight_options.": _PERF, "trainer.npu_profile.": _PERF,
    "global_profiler.": _PERF, "ray_kwargs.": "no Ray here", "ray_init.": "no Ray here",
    "transfer_queue.": _ENGINE,
    # verl 0.9.1's engine sections and knobs
    A + "fsdp_config.": _ENGINE, "actor_rollout_ref.ref.fsdp_config.": _ENGINE, C + "fsdp.": _ENGINE,
    A + "qat.": _QUANT, A + "entropy_from_logits_chunk_size": _PERF, A + "pad_to_length": _PERF,
    A + "use_fused_kernels": _PERF, A + "use_prefix_grouper": _PERF, A + "freeze_vision_tower": _TEXT,
    "actor_rollout_ref.ref.entropy_from_logits_chunk_size": _PERF, "actor_rollout_ref.ref.pad_to_length": _PERF,
    R + "nnodes": "the rollout runs where the flow runs", R + "n_gpus_per_node": "the rollout uses the run's GPUs",
    R + "full_determinism": _DETERMINISTIC, R + "router_config_path": _ENGINE, R + "enable_rollout_routing_replay": _ENGINE,
    R + "moe_load_balance_metrics_interval": _PERF, R + "quantization_config_file": _QUANT, R + "mtp": _ENGINE,
    R + "qat": _QUANT, R + "disaggregation.": _ENGINE,
    "actor_rollout_ref.model.lora_adapter_path": _LORA_ADAPTER, "actor_rollout_ref.model.mtp.": _ENGINE,
    "actor_rollout_ref.model.lora.": _MEGATRON_LORA,
    C + "model.hf_config_path": "the model's config.json is used as saved",
    C + "model.custom_chat_template": "the tokenizer's own chat template is used", C + "model.exclude_modules": _ENGINE,
    C + "model.lora_adapter_path": _LORA_ADAPTER, C + "model.use_liger": _PERF, C + "model.use_fused_kernels": _PERF,
    C + "model.fused_kernel_options.": _PERF, C + "model.mtp.": _ENGINE, C + "model.lora.": _MEGATRON_LORA,
    C + "forward_micro_batch_size": "the critic's forward passes are cut by critic.forward_micro_batch_size_per_gpu "
                                     "or its token budget; results do not depend on it",
    "data.function_tool_path": "multi-turn rollouts are off", "data.mm_processor_kwargs.": _TEXT, "data.image_patch_size": _TEXT, "data.audio_key": _TEXT,
    "sandbox_fusion.": "no code sandbox here", "reward.num_workers": _PERF, "reward.reward_manager.source": _MANAGER,
    "reward.reward_manager.module.": _MANAGER, "reward.reward_model.": _ENGINE, "reward.sandbox_fusion.": "no code sandbox here",
    "reward_model.num_workers": _PERF, "reward_model.reward_loop_source": _ENGINE,
    "reward_model.reward_loop_module_path": _ENGINE, "reward_model.reward_loop_class_name": _ENGINE,
    "algorithm.filter_groups.max_inflight_gen_batches": "refill draws run one at a time here",
    "trainer.checkpoint_callback_class": "checkpoints are written by the update stage",
    "trainer.use_v1": "one trainer here: the staged flow", "trainer.v1.": "one trainer here: the staged flow, synchronous",
    "distillation.": "distillation is off (distillation.enabled=false)",
    "skip.": "skipping rollouts is off (skip.*.enable=false); rollout.name=offline reuses responses",
}
"""verl key (or section prefix ending in '.') → why it changes nothing here."""

RAY_STEPS = ("the update's nodes are a Ray cluster: `ray start --head` on the node that runs the flow, "
             "`ray start --address=HEAD_IP:6379` on each other one (docs/scaling.md)")
"""How a multi-node run starts, as a refusal of the retired node-join keys and command says it."""

ONLY_DEFAULT: dict[str, tuple[tuple[Any, ...], str]] = {
    # our keys of the node-join protocol, retired for Ray: a saved config's defaults are dropped
    "trainer.master_addr": ((None,), f"retired: {RAY_STEPS}; trainer.ray_address names the cluster"),
    "trainer.master_port": ((None,), f"retired: {RAY_STEPS}"),
    "trainer.node_join_timeout_s": ((600,), f"retired: {RAY_STEPS}; trainer.ray_placement_timeout_s bounds the "
                                            "wait for the cluster's nodes"),
    A + "ulysses_sequence_parallel_size": ((1,), "sequence parallelism is not implemented; use 1"),
    C + "ulysses_sequence_parallel_size": ((1,), "sequence parallelism is not implemented; use 1"),
    R + "data_parallel_size": ((1,), "use 1: the rollout's engines are its processes over "
                                     "rollout.tensor_model_parallel_size (trainer.stage_processes, one per GPU by "
                                     "default; a worker group's ranks), as in verl"),
    R + "expert_parallel_size": ((1,), "expert parallelism is not implemented; use 1"),
    R + "pipeline_model_parallel_size": ((1,), "pipeline parallelism is not implemented; use 1"),
    R + "over_sample_rate": ((0, 0.0), "over-sampling is not implemented; use 0"),
    R + "skip_rollout": ((False,), "to reuse responses, use rollout.name=offline with rollout.offline_path"),
    R + "multi_turn.enable": ((False,), "multi-turn rollouts are not implemented; use false"),
    R + "quantization": ((None,), "quantized rollout is not implemented; leave it null"),
    A + "optim.zero_indexed_step": ((True,), "the lr schedule counts training steps from 0 (iteration k trains at "
                                             "lr(k - 1)), verl's default; leave it true"),
    C + "optim.zero_indexed_step": ((True,), "the lr schedule counts training steps from 0, verl's default; leave it true"),
    "distillation.enabled": ((False,), "distillation is not implemented; leave it false"),
    "skip.rollout.enable": ((False,), "to reuse responses, use rollout.name=offline with rollout.offline_path"),
    "skip.rollout_tq.enable": ((False,), "to reuse responses, use rollout.name=offline with rollout.offline_path"),
    "skip.async_rollout.enable": ((False,), "to reuse responses, use rollout.name=offline with rollout.offline_path"),
    A + "fsdp_config.ulysses_sequence_parallel_size": ((1,), "sequence parallelism is not implemented; use 1"),
}
"""verl key → (values that work here, the fix when another is given). Keys under a matched
section that are not listed (e.g. rollout.multi_turn.format) have no effect once the switch is off."""



def lookup(table: dict[str, Any], dotted: str) -> Optional[str]:
    """The entry of ``table`` that covers ``dotted`` (exact key or section prefix), else None."""
    if dotted in table:
        return dotted
    for key in table:
        if key.endswith(".") and dotted.startswith(key):
            return key
    return None


def entries_shadowing_fields(fields: Iterable[str]) -> list[str]:
    """What is wrong when a key is both a schema field (``fields``: the schema's dotted keys) and an
    entry above: the loader sets a field, so its NO_EFFECT note would never be said, a RENAMED
    spelling would move the field's value elsewhere, and an ONLY_DEFAULT entry would refuse what the
    field now does. One line per such key, saying which entry to remove. (A section entry, ending in
    '.', covers only the keys under it that are not fields.)"""
    fields = set(fields)
    tables = (("NO_EFFECT", NO_EFFECT, "its note says it has no effect here, and the loader never says it"),
              ("RENAMED", RENAMED, "the loader moves its value to another key"),
              ("ONLY_DEFAULT", ONLY_DEFAULT, "the loader refuses every value but verl's default"))
    return [f"{key}: a field of rlhf_core/config/schema.py and listed in {name} (rlhf_core/config/verl_keys.py), "
            f"where {why}: remove it from {name}"
            for name, table, why in tables for key in sorted(table) if key in fields]
