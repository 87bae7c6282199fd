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
    from rlhf_core.stages.catalog import CATALOG
    from tasks.stages import STAGE_TASKS, stage_task

    assert list(STAGE_TASKS) == list(STAGES) == list(CATALOG)
    for name, spec in STAGES.items():
        task = STAGE_TASKS[name]
        assert task.name == spec.task and task.__doc__ == spec.help
        assert (task.retries > 0) == spec.retries
        assert (task.task_run_name == f"{spec.task}-iter{{iteration}}") == spec.per_iteration
        assert CATALOG[name].run.__name__ == f"run_{name}" and stage_task(CATALOG[name].run) is task


def test_a_share_takes_the_run_session_as_its_stage_does():
    """A stage whose function takes ``session`` gets the flow's run session; its share function, when
    it has one, takes it too (last parameter): a rank keeps its own session for the group's life."""
    import inspect

    from rlhf_core.stages.catalog import CATALOG

    for name, functions in CATALOG.items():
        if functions.share is not None:
            assert functions.uses_models, name
            assert list(inspect.signature(functions.share).parameters)[-1] == "session", name
            assert functions.share.__name__ == f"{name}_share"
    assert [name for name, f in CATALOG.items() if f.uses_models] == ["rollout", "score", "update", "guard", "validate"]


def test_the_catalog_refuses_to_load_unless_it_lists_every_declared_stage(tmp_path):
    """A stage declared in run/stage_order.py without its functions in stages/catalog.py fails at
    import, naming both files, rather than when a flow reaches it."""
    import subprocess
    import sys

    code = ("from rlhf_core.run import stage_order\n"
            "stage_order.STAGES['extra'] = stage_order.StageSpec('extra', False, 'h', task='extra')\n"
            "import rlhf_core.stages.catalog")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "rlhf_core/stages/catalog.py lists" in proc.stderr, proc.stderr[-2000:]
    assert "give each declared stage its functions here" in proc.stderr
