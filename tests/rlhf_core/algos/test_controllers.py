"""KL coefficient controllers: direction, clipping, and exact state round-trips through JSON."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_core.algos.registry import KL_CONTROLLERS
from rlhf_core.algos.controllers import AdaptiveKLController, FixedKLController, kl_controller_from_state, make_kl_controller

SETTINGS = settings(max_examples=50, deadline=None)


@SETTINGS
@given(
    coef=st.floats(1e-4, 1.0),
    target=st.floats(1e-3, 10.0),
    ratio=st.floats(0.0, 5.0),
    horizon=st.floats(10.0, 1e5),
    frac=st.one_of(st.just(0.0), st.floats(0.01, 1.0)),
)
def test_adaptive_moves_toward_target_with_clipped_error(coef, target, ratio, horizon, frac):
    n_steps = frac * horizon
    controller = AdaptiveKLController(init_kl_coef=coef, target_kl=target, horizon=horizon)
    controller.update(current_kl=ratio * target, n_steps=n_steps)
    error = min(max(ratio - 1.0, -0.2), 0.2)
    assert controller.value == pytest.approx(coef * (1 + error * n_steps / horizon), rel=1e-12)
    if n_steps > 0 and ratio > 1 + 1e-6:
        assert controller.value > coef  # KL above target: penalise harder
    if n_steps > 0 and ratio < 1 - 1e-6:
        assert controller.value < coef
    # Never more than +-20% per horizon's worth of samples.
    assert coef * 0.8 - 1e-15 <= controller.value <= coef * 1.2 + 1e-15


def test_adaptive_clip_is_exactly_twenty_percent_per_horizon():
    up = AdaptiveKLController(init_kl_coef=0.1, target_kl=1.0, horizon=100)
    up.update(current_kl=1e6, n_steps=100)
    down = AdaptiveKLController(init_kl_coef=0.1, target_kl=1.0, horizon=100)
    down.update(current_kl=torch.tensor(0.0), n_steps=100)  # 0-dim tensors are accepted
    assert up.value == pytest.approx(0.12) and down.value == pytest.approx(0.08)


def test_fixed_never_moves():
    controller = FixedKLController(kl_coef=0.05)
    controller.update(current_kl=100.0, n_steps=10_000)
    assert controller.value == 0.05


@pytest.mark.parametrize(
    "controller",
    [FixedKLController(kl_coef=0.02), AdaptiveKLController(init_kl_coef=0.2, target_kl=6.0, horizon=10_000)],
)
def test_state_round_trips_exactly_through_json(controller):
    for kl in (3.0, 9.0, 5.5):
        controller.update(current_kl=kl, n_steps=256)
    restored = kl_controller_from_state(json.loads(json.dumps(controller.state_dict())))
    assert type(restored) is type(controller) and restored.state_dict() == controller.state_dict()
    for kl in (1.0, 12.0):
        controller.update(current_kl=kl, n_steps=512)
        restored.update(current_kl=kl, n_steps=512)
        assert restored.value == controller.value  # bit-identical trajectory after resume


def test_loading_a_state_into_the_wrong_type_fails():
    adaptive = AdaptiveKLController(init_kl_coef=0.2, target_kl=6.0, horizon=10_000)
    with pytest.raises(ValueError, match="adaptive"):
        FixedKLController(kl_coef=0.1).load_state_dict(adaptive.state_dict())
    with pytest.raises(ValueError, match="fixed"):
        kl_controller_from_state({"type": "pid", "value": 0.1})


def test_factory_builds_by_name_and_validates():
    assert isinstance(make_kl_controller("fixed", kl_coef=0.1), FixedKLController)
    adaptive = make_kl_controller("adaptive", kl_coef=0.1, target_kl=6.0, horizon=1000)
    assert isinstance(adaptive, AdaptiveKLController) and adaptive.value == 0.1
    with pytest.raises(ValueError, match="target_kl"):
        make_kl_controller("adaptive", kl_coef=0.1)
    with pytest.raises(ValueError) as info:
        make_kl_controller("adaptiv", kl_coef=0.1)
    assert "adaptive" in str(info.value) and "fixed" in str(info.value)
    assert KL_CONTROLLERS.names() == ["adaptive", "fixed"]
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(init_kl_coef=0.1, target_kl=1.0, horizon=0)
