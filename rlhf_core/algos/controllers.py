"""KL coefficient controllers for the reward-side KL penalty.

State is plain JSON (floats and the registered type name) so it can live in a run's
checkpoint manifest and be restored exactly on resume; loading a state into a controller of
another type fails loudly rather than silently resetting the coefficient.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Union

from .registry import KL_CONTROLLERS, register_kl_controller

if TYPE_CHECKING:  # plain floats in, plain floats out: a run's records are read without torch (run.migrate)
    import torch

Number = Union[float, int, "torch.Tensor"]


class _KLController:
    type_name = ""  # the registry name; stored in the state so loads can check it
    value: float

    def update(self, current_kl: Number, n_steps: int) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError  # pragma: no cover - abstract

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("type") != self.type_name:
            raise ValueError(f"cannot load a {state.get('type')!r} KL controller state into {self.type_name!r}")
        self._load(state)

    def _load(self, state: dict[str, Any]) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    @classmethod
    def create(cls, kl_coef: float, target_kl: Optional[float], horizon: Optional[float]) -> "_KLController":
        """Factory hook used by ``make_kl_controller``; subclasses take what they need."""
        raise NotImplementedError  # pragma: no cover - abstract

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "_KLController":
        controller = cls.__new__(cls)
        controller.load_state_dict(state)
        return controller

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.state_dict()})"


@register_kl_controller("fixed")
class FixedKLController(_KLController):
    """Constant coefficient; ``update`` is a no-op."""

    type_name = "fixed"

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: Number, n_steps: int) -> None:
        del current_kl, n_steps

    def state_dict(self) -> dict[str, Any]:
        return {"type": self.type_name, "value": self.value}

    def _load(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])

    @classmethod
    def create(cls, kl_coef: float, target_kl: Optional[float], horizon: Optional[float]) -> "FixedKLController":
        return cls(kl_coef)


@register_kl_controller("adaptive")
class AdaptiveKLController(_KLController):
    """Proportional controller of Ziegler et al. 2019 (https://arxiv.org/abs/1909.08593):

        e = clip(current_kl / target_kl - 1, -0.2, 0.2)
        value <- value * (1 + e * n_steps / horizon)

    ``n_steps`` is the number of samples (or steps) the measured KL covers, so the coefficient
    moves by at most 20% per ``horizon`` samples, toward keeping KL near ``target_kl``.
    """

    type_name = "adaptive"

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        if not target_kl > 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if not horizon > 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: Number, n_steps: int) -> None:
        # float(): the coefficient is host-side state; a 0-dim tensor KL is synced here once.
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"type": self.type_name, "value": self.value, "target_kl": self.target, "horizon": self.horizon}

    def _load(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])
        self.target = float(state["target_kl"])
        self.horizon = float(state["horizon"])

    @classmethod
    def create(cls, kl_coef: float, target_kl: Optional[float], horizon: Optional[float]) -> "AdaptiveKLController":
        if target_kl is None or horizon is None:
            raise ValueError("the adaptive KL controller needs target_kl and horizon")
        return cls(kl_coef, target_kl, horizon)


KLController = Union[FixedKLController, AdaptiveKLController]


def make_kl_controller(
    kind: str, kl_coef: float, target_kl: Optional[float] = None, horizon: Optional[float] = None
) -> KLController:
    """``fixed`` -> FixedKLController(kl_coef); ``adaptive`` -> AdaptiveKLController(kl_coef,
    target_kl, horizon), which then needs both. Unknown kinds raise listing the valid ones."""
    return KL_CONTROLLERS.get(kind).create(kl_coef, target_kl, horizon)


def kl_controller_from_state(state: dict[str, Any]) -> KLController:
    """Rebuild a controller from ``state_dict()`` output (e.g. after a JSON round-trip)."""
    return KL_CONTROLLERS.get(state.get("type")).from_state(state)
