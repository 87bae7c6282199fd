"""PPO / RLHF algorithm core: pure torch functions on (B, T) tensors.

No configs, no distributed or orchestration imports: every function takes keyword arguments
and tensors shaped (B, T) = (rows, response tokens) with masks where 1 marks a counted token.
Micro-batch and data-parallel loss scaling is documented once, in ``aggregation``.

Import from the modules themselves: ``advantage`` (GAE), ``outcome`` (the outcome-reward estimators:
GRPO, RLOO, REINFORCE++, ReMax, OPO, GPG), ``losses`` and ``loss_modes`` (policy and value losses),
``kl`` (estimators and the KL penalty), ``controllers`` (fixed / adaptive KL coefficient),
``aggregation`` (masked statistics, loss aggregation), ``logits`` (log-probs, entropy),
``rollout_correction`` (importance weights, rejection masks; its settings in ``correction_specs``),
``registry`` (the name tables of every family). This package itself imports nothing, so a module
that only needs a name table or a settings parser (the config's schema) does not import torch.
"""
