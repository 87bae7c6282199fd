"""PPO training with DeepSpeed: config, engines, the update loop, checkpoints.

    ds_config     our config → DeepSpeed config dict (ZeRO stage, offload, dtype, clipping)
    distributed   process group for one process or one torchrun rank
    engines       actor / critic models (LoRA), client AdamW, verl's lr schedule, the optimizer step
    batch         advantages table → mini-batches → token-budget micro-batches → tensors
    forward       packed forward with gradients → (B, T) log-probs, entropy, values
    ppo           the loop: losses with global token counts, accumulation, metrics
    optim_state   optimizer state by parameter name (safetensors), any ZeRO stage / world size
    checkpoint    HF actor/critic + optimizer state + manifest, written atomically, verified on load
    memory        per-rank memory estimate from config.json; a config that cannot fit is refused
    rank_update   one iteration's training loop on one rank (``iteration_plan``, then ``ppo.run_ppo``)
    resident      the trainer holding the engines: kept for a flow run, or made for one update
                  (``one_update_trainer``); in this process or as a worker group of torchrun ranks

DeepSpeed is imported only inside functions, so importing this package stays cheap.
"""
