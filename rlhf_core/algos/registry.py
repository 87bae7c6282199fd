"""Name -> implementation registries, one per algorithm family.

New variants plug in by name, e.g.::

    @register_policy_loss("my_loss")
    def my_loss(*, old_log_prob, log_prob, advantages, response_mask, **kw): ...

Lookups of unknown names raise ``ValueError`` listing the valid names, so a typo in a run
config fails at start-up with the fix in the message rather than deep inside training.

Each registry names the modules whose decorators register its built-in entries (``providers``,
``rlhf_core.registry``) and imports them at its first lookup: the config's schema checks names
against these tables, and a command that reads a run without training (``rlhf status``) then never
pays torch's import (1.7 s of a 2-core machine's start-up), which every provider needs.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping

from rlhf_core.registry import Registry


ADV_ESTIMATORS: Registry[Callable[..., Any]] = Registry(
    "advantage estimator", ("rlhf_core.algos.advantage", "rlhf_core.algos.outcome"))
POLICY_LOSSES: Registry[Callable[..., Any]] = Registry(
    "policy loss", ("rlhf_core.algos.losses", "rlhf_core.algos.loss_modes"))
KL_ESTIMATORS: Registry[Callable[..., Any]] = Registry("KL estimator", ("rlhf_core.algos.kl",))
AGG_MODES: Registry[Callable[..., Any]] = Registry("loss aggregation mode", ("rlhf_core.algos.aggregation",))
KL_CONTROLLERS: Registry[type] = Registry("KL controller", ("rlhf_core.algos.controllers",))


def accepted_kwargs(fn: Callable[..., Any], offered: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``offered`` that ``fn`` takes (all of them when it has ``**kwargs``): callers
    offer every input they have, and each implementation declares what it needs by its signature."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(offered)
    return {k: v for k, v in offered.items() if k in params}


def estimator_takes(name: str, argument: str) -> bool:
    """Whether estimator ``name`` names ``argument`` in its signature (``values``: it needs a critic;
    ``reward_baselines``: it needs a greedy baseline rollout; ``index``: it groups by prompt)."""
    return argument in inspect.signature(ADV_ESTIMATORS.get(name)).parameters


def register_adv_estimator(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register ``fn(*, token_level_rewards, response_mask, ...) -> (advantages, returns)``.

    Inputs an estimator may name (it receives only those it names, see ``accepted_kwargs``):
    ``values`` (B, T) — naming it makes a run build a critic; ``index`` (B,) numpy array of group ids
    (verl's uid: one per prompt, shared by its rollout.n responses); ``reward_baselines`` (B,) — the
    score of a greedy response to the same prompt (a baseline rollout is generated for it);
    ``gamma``, ``lam``, ``norm_adv_by_std_in_grpo``. All tensors are float with 0 at padding."""
    return ADV_ESTIMATORS.register(name)


def get_adv_estimator(name: str) -> Callable[..., Any]:
    return ADV_ESTIMATORS.get(name)


def register_policy_loss(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register ``fn(*, old_log_prob, log_prob, advantages, response_mask, **hyper) -> (loss, metrics)``."""
    return POLICY_LOSSES.register(name)


def get_policy_loss_fn(name: str) -> Callable[..., Any]:
    return POLICY_LOSSES.get(name)


def register_kl_estimator(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a base KL estimator ``fn(logprob, ref_logprob) -> (B, T)``.

    Its straight-through variant ``name + "+"`` comes for free (see ``kl.get_kl_estimator``).
    """
    if name.endswith("+"):
        raise ValueError("the '+' suffix is reserved for straight-through variants")
    return KL_ESTIMATORS.register(name)


def register_agg_mode(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register ``fn(loss_mat, valid_bool_mask, *, global_num_tokens, global_num_seqs,
    loss_scale_factor) -> 0-dim tensor`` (see ``aggregation`` for the global-count convention)."""
    return AGG_MODES.register(name)


def get_agg_fn(name: str) -> Callable[..., Any]:
    return AGG_MODES.get(name)


def register_kl_controller(name: str) -> Callable[[type], type]:
    """Register a controller class with ``create(kl_coef, target_kl, horizon)`` and ``from_state``."""
    return KL_CONTROLLERS.register(name)


def get_kl_controller_cls(name: str) -> type:
    return KL_CONTROLLERS.get(name)
