"""Alerts fire on a change worth a person's attention, not on a level: each KL breach, and the clip
fraction falling below 0.1 only after it had reached 0.15 (hysteresis). Checked through
finish-iteration on a run directory of committed iterations: its events, its log, what it returns
(the console's note and the report's alerts)."""

from __future__ import annotations

import logging

import pytest

from rlhf_core.config import load_config
from rlhf_core.run.layout import RunDir
from rlhf_core.run.lifecycle import commit_iteration
from rlhf_core.run.manifest import record_stage
from rlhf_core.run.report import fell_below
from tasks.iteration import finish_iteration_task


def _close(cfg, run: RunDir, k: int, clipfrac: float, kl: float) -> list[str]:
    """Commit iteration k with these numbers, then close it as the pipeline does; its alerts."""
    for stage, metrics in (("update", {"actor/pg_clipfrac": clipfrac}), ("guard", {"guard/kl_mean": kl})):
        record_stage(run, k, stage, status="done", inputs={}, outputs={}, config_hash="h", metrics=metrics, seconds=0.1)
    run.checkpoint(k).joinpath("actor").mkdir(parents=True)
    commit_iteration(run, k)
    return finish_iteration_task.fn(cfg, str(run.root), k, prune=False, publish=False)["alerts"]


def test_alerts_fire_on_a_crossing_not_on_every_iteration(tmp_path, caplog):
    cfg = load_config(None, ["trainer.kl_rollback_threshold=0.05"])
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    clipfracs = [0.0, 0.02, 0.2, 0.12, 0.08, 0.09, 0.11, 0.16, 0.05, 0.0]
    kls = [0.01, 0.07, 0.08, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01]
    with caplog.at_level(logging.INFO, logger="rlhf"):
        fired = {k: _close(cfg, run, k, c, kl) for k, (c, kl) in enumerate(zip(clipfracs, kls), start=1)}
    # a run that starts (and stays) under 0.1 is no news; a fall from 0.2 is, once; 0.11 does not re-arm, 0.16 does
    assert [k for k, lines in fired.items() if any("pg_clipfrac" in a for a in lines)] == [5, 9]
    assert "fell to 0.080" in fired[5][0] and "had reached 0.200" in fired[5][0]
    assert [k for k, lines in fired.items() if any(a.startswith("KL") for a in lines)] == [2, 3]  # every breach
    events = [(e["iteration"], e["message"][:2]) for e in run.events() if e["kind"] == "alert"]
    assert events == [(2, "KL"), (3, "KL"), (5, "ac"), (9, "ac")]
    assert sum("alert (iteration" in r.getMessage() for r in caplog.records) == 4


@pytest.mark.parametrize("values, fell", [
    ([0.05], False),                    # never armed
    ([0.2, 0.05], True),
    ([0.2, 0.05, 0.04], False),         # once per fall
    ([0.2, None, 0.05], True),          # an iteration without an update changes nothing
    ([0.2, 0.05, 0.14, 0.05], False),   # under the re-arm level: still quiet
    ([0.2, 0.05, 0.15, 0.05], True),
    ([0.2, 0.1], False),                # 0.1 is not below 0.1
])
def test_fell_below_hysteresis(values, fell):
    assert fell_below(values, 0.1, 0.15) is fell
