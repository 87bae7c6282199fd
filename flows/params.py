"""What every flow's parameter model shares: the Prefect UI's Run form is built from these pydantic
models (as Prefect requires), so the flow parameters are pydantic while the run's config is the one
typed dataclass tree (``rlhf_core.config``), where each override given here is checked against the
schema. Two config systems by design: each flow's few fields (a preset, a run name, a stage) in the
form; every setting of the run in the config, reached only through ``overrides``.

Each model declares its own fields (their order is the form's); the checks of ``overrides`` live
here once: every override is ``dotted.key=value``, and what Prefect records of a flow run's
parameters masks secrets."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, field_serializer, field_validator

from rlhf_core.security import redact_text


def dotted_overrides(values: list[str]) -> list[str]:
    """Form-level check: every override is dotted.key=value (the key itself is checked against the
    schema when the config is built, with the closest valid keys named)."""
    for v in values:
        if "=" not in v or v.startswith("="):
            raise ValueError(f"override {v!r} must look like dotted.key=value")
    return values


def recorded_overrides(values: list[str]) -> list[str]:
    """The overrides as Prefect records a flow run's parameters (JSON): secrets masked
    (``rlhf_core.security``). The flow itself receives them as given: a direct call hands over the
    object, and a deployment run gets what its caller sent (keep secrets out of those: environment
    variables of the worker)."""
    return [redact_text(v) for v in values]


class FlowParams(BaseModel):
    """A flow's parameters: no unknown field (a typo is refused, not ignored), and an ``overrides``
    field (declared by each model where its form shows it) checked and recorded as above."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("overrides", check_fields=False)
    @classmethod
    def _dotted(cls, values: list[str]) -> list[str]:
        return dotted_overrides(values)

    @field_serializer("overrides", when_used="json", check_fields=False)
    def _recorded(self, values: list[str]) -> list[str]:
        return recorded_overrides(values)
