"""Rollout correction's settings as plain values, and the parsers of its threshold specs: what the
config check needs of ``rollout_correction``, without torch (``rlhf status`` reads a run's config in
well under a second only while nothing it imports imports torch). The math is in ``rollout_correction``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

SAFETY_BOUND = 20.0
"""Exponents of importance ratios are clamped to +-20: exp(20) ~ 4.9e8, exp(-20) ~ 2e-9."""

RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
IS_LEVELS = ("token", "sequence")
LOSS_TYPES = ("ppo_clip", "reinforce")

Threshold = Union[str, float, int]


@dataclass(frozen=True)
class RolloutCorrection:
    """verl's ``algorithm.rollout_correction`` keys, as plain values.

    ``rollout_is``: None (no weights, metrics only), "token" or "sequence"; ``rollout_is_threshold``:
    an upper bound or "lower_upper"; ``rollout_rs``: None or comma-separated ``RS_OPTIONS``;
    ``rollout_rs_threshold``: one spec shared by every criterion or one per criterion, comma
    separated; ``bypass_mode``: train against the rollout's own log-probs (no recomputed old
    log-probs), with ``loss_type`` "ppo_clip" or "reinforce"."""

    rollout_is: Optional[str] = None
    rollout_is_threshold: Threshold = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: Optional[str] = None
    rollout_rs_threshold: Optional[Threshold] = None
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"


def parse_is_threshold(spec: Threshold) -> tuple[float, Optional[float]]:
    """``(upper, lower)`` of an IS threshold: ``2.0`` / ``"2.0"`` → (2.0, None) (truncate), ``"0.5_5"``
    → (5.0, 0.5) (IcePop). Raises ``ValueError`` saying what a valid spec looks like."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ValueError(f"rollout_is_threshold must be a number or a 'lower_upper' string, got {spec!r}")
    text = str(spec).strip()
    lower_text, _, upper_text = text.partition("_") if "_" in text else ("", "", text)
    try:
        upper = float(upper_text)
        lower = float(lower_text) if lower_text else None
    except ValueError:
        raise ValueError(f"rollout_is_threshold {spec!r} is not a number or a 'lower_upper' pair such as '0.5_5.0'") from None
    if not upper > 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"rollout_is_threshold {spec!r}: bounds must be positive with lower <= upper")
    return upper, lower


def parse_rs_options(rollout_rs: str) -> list[str]:
    """The criteria of a ``rollout_rs`` string, in order, duplicates dropped."""
    options = list(dict.fromkeys(o.strip() for o in str(rollout_rs).split(",") if o.strip()))
    unknown = [o for o in options if o not in RS_OPTIONS]
    if not options or unknown:
        raise ValueError(f"rollout_rs {rollout_rs!r}: unknown criterion {unknown or '(none given)'}; "
                         f"valid: {', '.join(RS_OPTIONS)} (comma-separated for several)")
    return options


def parse_rs_thresholds(options: list[str], spec: Optional[Threshold]) -> dict[str, tuple[Optional[float], float]]:
    """criterion → (lower, upper). k1 criteria bound the ratio (lower and upper); the others take one
    upper bound on the divergence. One spec is shared by every criterion, or one per criterion."""
    if spec is None:
        raise ValueError("rollout_rs_threshold must be set when rollout_rs is (one bound per criterion, comma-separated)")
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ValueError(f"rollout_rs_threshold must be a number or a string, got {spec!r}")
    parts = [p.strip() for p in str(spec).split(",") if p.strip()]
    if len(parts) not in (1, len(options)):
        raise ValueError(f"rollout_rs_threshold {spec!r}: give one bound for all {len(options)} criteria or one each")
    parts = parts * len(options) if len(parts) == 1 else parts
    bounds: dict[str, tuple[Optional[float], float]] = {}
    for option, part in zip(options, parts):
        try:
            if option.endswith("k1"):
                lower_text, _, upper_text = part.partition("_") if "_" in part else (str(1.0 / float(part)), "", part)
                lower, upper = float(lower_text), float(upper_text)
            elif "_" in part:
                raise ValueError
            else:
                lower, upper = None, float(part)
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"rollout_rs_threshold {part!r} for {option}: "
                             + ("a ratio bound 'lower_upper' or one upper bound" if option.endswith("k1")
                                else "one positive upper bound (no '_')")) from None
        if not upper > 0 or (lower is not None and not 0 < lower <= upper):
            raise ValueError(f"rollout_rs_threshold {part!r} for {option}: bounds must be positive with lower <= upper")
        bounds[option] = (lower, upper)
    return bounds
