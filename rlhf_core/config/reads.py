"""A stage's settings builder names the config keys it reads in its parameters, and nowhere else.

Each parameter of a builder is typed ``Annotated[<type>, At("<dotted key>")]``: ``At("data.seed")``
one setting, ``At("data.")`` a whole section. ``build(builder, cfg)`` passes each parameter the
config's value at its key; ``config_keys(builder)`` returns the keys, which are the prefixes of the
flattened config a stage's config hash covers (``loader.config_hash``). So a stage's keys are read
from the one function that derives its settings: a key it does not name it cannot read.

    def gae_settings(algorithm: Algorithm, critic_enable: CriticEnable) -> GaeSettings: ...
    config_keys(gae_settings)     -> ("algorithm.", "critic.enable")
    build(gae_settings, cfg)      -> gae_settings(algorithm=cfg.algorithm, critic_enable=cfg.critic.enable)

A parameter typed ``Annotated[T, Built(other_builder)]`` takes that builder's settings, and its keys
are the outer builder's too: a settings builder several stages share (generation, for the rollout,
validation and the guard's check: ``stages.settings.generation``) names its keys once.

``Built(part, when=decides)`` reads a part only where ``decides`` (a builder too) says so: the
rollout's dynamic-sampling filter, a reward model's batching. Its keys then depend on the config:
``config_keys(builder, cfg=cfg)``.

``At("actor_rollout_ref.rollout.", only=("val_kwargs.", "seed"), unhashed=why)`` passes a whole
section and hashes a few of its keys: validation hands the engine the rollout section, but samples
with val_kwargs, so the training sampling keys cannot change what it measures.

A keyword-only parameter without a key is a value of the process, not of the config (the
update's world size): ``build(builder, cfg, world_size=2)`` passes it, to the parts that take it too,
and no key is hashed for it.

A key is a prefix, as the config hash matches it: ``At("actor_rollout_ref.rollout.n")`` also covers
``rollout.name``; a builder that names a key inside a section it names adds nothing to the hash.
"""

from __future__ import annotations

import functools
import inspect
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Optional, TypeVar

from rlhf_core.config.schema import AlgorithmConfig, DataConfig, ModelConfig, RolloutConfig

T = TypeVar("T")


@dataclass(frozen=True)
class At:
    """Where a builder's parameter comes from in the config: a dotted key, a section when it ends in "."."""

    key: str
    unhashed: str = ""
    """Why a change to this key cannot change the stage's outputs, for a key the builder reads but the
    config hash leaves out (``trainer.device`` for generation: a run keeps its device, and the update
    hashes it); empty: hashed."""
    only: tuple[str, ...] = ()
    """For a section read whole whose outputs depend on a few of its keys: those keys (relative to the
    section), the ones hashed; ``unhashed`` then says why the rest cannot change the outputs."""

    def __post_init__(self) -> None:
        if self.only and not (self.key.endswith(".") and self.unhashed):
            raise TypeError(f"At({self.key!r}, only=...) hashes part of a section: the key must end in '.' and "
                            "unhashed= must say why the rest of it cannot change the stage's outputs")

    @property
    def hashed(self) -> tuple[str, ...]:
        """The keys of this parameter the config hash covers."""
        if self.only:
            return tuple(self.key + sub for sub in self.only)
        return () if self.unhashed else (self.key,)

    @property
    def path(self) -> tuple[str, ...]:
        return tuple(self.key.rstrip(".").split("."))


@dataclass(frozen=True)
class Built:
    """A parameter that is another builder's settings, built from the same config."""

    builder: Callable[..., Any]
    when: Optional[Callable[..., bool]] = None
    """A builder of whether the part is read at all (None: always). Off, the parameter is None and
    the part's keys are not hashed; the deciding keys themselves are not hashed either: switching the
    part on or off changes the key set, so the stage reruns, and turning on a part a config never
    used leaves the hashes recorded without it as they were."""


Data = Annotated[DataConfig, At("data.")]
Rollout = Annotated[RolloutConfig, At("actor_rollout_ref.rollout.")]
ActorModel = Annotated[ModelConfig, At("actor_rollout_ref.model.")]
Algorithm = Annotated[AlgorithmConfig, At("algorithm.")]
AdvEstimator = Annotated[str, At("algorithm.adv_estimator")]
CriticEnable = Annotated[Optional[bool], At("critic.enable")]
TrainerDevice = Annotated[str, At("trainer.device")]
RunDevice = Annotated[str, At("trainer.device", unhashed="a run keeps its device (the update hashes it); it decides "
                                                         "where a pass runs, its dtype and numbers come from the rest")]
ActorDtype = Annotated[str, At("actor_rollout_ref.actor.deepspeed_config.dtype")]
"""The keys several stages' builders read, declared once."""


@functools.cache
def _parameters(builder: Callable[..., Any]) -> tuple[tuple[str, At | Built], ...]:
    """(parameter name, its key or builder) for each parameter of ``builder``, in order; a parameter
    without either is a mistake in the builder, named."""
    hints = typing.get_type_hints(builder, include_extras=True)
    found = []
    for name, parameter in inspect.signature(builder).parameters.items():
        source = next((m for m in getattr(hints.get(name), "__metadata__", ()) if isinstance(m, (At, Built))), None)
        if source is None and parameter.kind is inspect.Parameter.KEYWORD_ONLY:
            continue  # a value of the process, not of the config: the caller's (``build``'s keywords)
        if source is None:
            raise TypeError(f"{builder.__module__}.{builder.__qualname__}: parameter {name!r} names no config key; "
                            "type it Annotated[<type>, At('<dotted key>')] (rlhf_core.config.reads)")
        found.append((name, source))
    return tuple(found)


def config_keys(*builders: Callable[..., Any], cfg: Any = None) -> tuple[str, ...]:
    """The keys ``builders`` read and hash (a built parameter's builder's included; not the ``unhashed``
    ones; a part read only ``when`` its builder says so: only then, which needs ``cfg``), each once,
    in the order they name them."""
    keys: list[str] = []
    for builder in builders:
        for _, source in _parameters(builder):
            if isinstance(source, At):
                more = source.hashed
            elif _reads(source, cfg, builder):
                more = config_keys(source.builder, cfg=cfg)
            else:
                more = ()
            keys += [key for key in more if key not in keys]
    return tuple(keys)


def _reads(part: Built, cfg: Any, builder: Callable[..., Any]) -> bool:
    if part.when is None:
        return True
    if cfg is None:
        raise TypeError(f"{builder.__qualname__} reads {part.builder.__qualname__} only when "
                        f"{part.when.__qualname__} says so: give the config, config_keys(..., cfg=cfg)")
    return bool(build(part.when, cfg))


def config_values(builder: Callable[..., Any], cfg: Any) -> dict[str, Any]:
    """Each key ``builder`` reads with its value in ``cfg`` (what a stage records of its config)."""
    return {key: functools.reduce(getattr, At(key).path, cfg) for key in config_keys(builder, cfg=cfg)}


def build(builder: Callable[..., T], cfg: Any, **given: Any) -> T:
    """``builder`` called with the value of ``cfg`` at each of its parameters' keys (a built
    parameter: its builder's settings from ``cfg``, or None where its ``when`` says it is not read).
    ``given``: the values of the process a builder takes as keyword-only parameters without a key
    (the update's world size, say), passed on to each built part that takes them too."""
    values = {name: _value(source, cfg, builder, given) for name, source in _parameters(builder)}
    return builder(**values, **_given_to(builder, given))


def _given_to(builder: Callable[..., Any], given: dict[str, Any]) -> dict[str, Any]:
    taken = {name for name, p in inspect.signature(builder).parameters.items()
             if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in dict(_parameters(builder))}
    return {name: value for name, value in given.items() if name in taken}


def _value(source: At | Built, cfg: Any, builder: Callable[..., Any], given: dict[str, Any]) -> Any:
    if isinstance(source, At):
        return functools.reduce(getattr, source.path, cfg)
    return build(source.builder, cfg, **given) if _reads(source, cfg, builder) else None
