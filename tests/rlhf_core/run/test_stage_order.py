"""The stage declarations (``run.stage_order.STAGES``) are the one list: the Prefect tasks, the CLI's
stage commands and the guide's stage table (docs/guide.md) follow them."""

from __future__ import annotations

import re
from pathlib import Path

from rlhf_core.run.stage_order import STAGES

GUIDE = Path(__file__).resolve().parents[3] / "docs" / "guide.md"


def test_the_readmes_stage_table_lists_every_declared_stage_in_order():
    section = GUIDE.read_text(encoding="utf-8").split("## Stages", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\w+) \| `rlhf stage (\w+) --run-dir RUN( -k K)?", section, flags=re.MULTILINE)
    assert [name for name, _, _ in rows] == list(STAGES)
    assert all(name == command for name, command, _ in rows)
    assert {name: bool(k) for name, _, k in rows} == {name: spec.per_iteration for name, spec in STAGES.items()}


def test_each_declared_stage_is_one_prefect_task_named_as_declared():
    from tasks.stages import STAGE_TASKS

    assert list(STAGE_TASKS) == list(STAGES)
    for name, spec in STAGES.items():
        task = STAGE_TASKS[name]
        assert task.name == spec.task and task.__doc__ == spec.help
        assert (task.retries > 0) == spec.retries
        assert (task.task_run_name == f"{spec.task}-iter{{iteration}}") == spec.per_iteration
        assert spec.load().__name__ == f"run_{name}"


def test_a_stage_takes_the_run_session_exactly_when_it_declares_models():
    """``uses_models``: the stage function takes ``session=`` (the flow hands it the run session) and
    so does its share function (last parameter); a stage without models takes none."""
    import inspect

    for name, spec in STAGES.items():
        takes = "session" in inspect.signature(spec.load()).parameters
        assert takes == spec.uses_models, f"stage {name}: uses_models={spec.uses_models}, takes session={takes}"
        if spec.share is not None:
            assert spec.uses_models and list(inspect.signature(spec.load_share()).parameters)[-1] == "session", name
