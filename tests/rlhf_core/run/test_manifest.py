"""The stage contract: skip unchanged stages, rerun on changed input/config/output, mark downstream stale
when a rerun changed an output (a rerun that writes the same bytes leaves everything as it was)."""

from __future__ import annotations

import pytest
import pyarrow as pa

from rlhf_core.config import apply_overrides, load_config
from rlhf_core.io.atomic import atomic_write_parquet, atomic_write_text
from rlhf_core.run.manifest import read_manifest
from rlhf_core.run.layout import RunDir
from rlhf_core.stages.base import StageResult, stage_record


def _stage(run, cfg, name, iteration, src, out, calls, force=False):
    with stage_record(stage=name, cfg=cfg, run=run, iteration=iteration, inputs=[src],
                      config_sections=("data.",), force=force) as record:
        if record.skipped:
            return record.skipped
        calls.append(name)
        atomic_write_parquet(out, pa.table({"v": [src.read_bytes()], "seed": [cfg.data.seed]}))
        return record.done(StageResult(stage=name, iteration=iteration, outputs={"out": str(out)}, rows={"out": 1}))


def test_skip_rerun_and_stale(tmp_path):
    run, cfg, calls = RunDir(tmp_path / "run"), load_config(), []
    src = tmp_path / "in.txt"
    atomic_write_text(src, "a")
    a_out, b_out = run.root / "a.parquet", run.root / "b.parquet"

    first = _stage(run, cfg, "preprocess", None, src, a_out, calls)
    _stage(run, cfg, "pack", None, a_out, b_out, calls)
    assert not first.skipped and calls == ["preprocess", "pack"]

    again = _stage(run, cfg, "preprocess", None, src, a_out, calls)
    assert again.skipped and calls == ["preprocess", "pack"]

    # unrelated config change: still skipped; a data.* change reruns
    assert _stage(run, apply_overrides(cfg, ["trainer.total_iterations=3"]), "preprocess", None, src, a_out,
                  calls).skipped
    rerun = _stage(run, apply_overrides(cfg, ["data.seed=7"]), "preprocess", None, src, a_out, calls)
    assert not rerun.skipped
    assert read_manifest(run, None)["pack"]["status"] == "stale"
    assert any("pack" in line for line in rerun.summary)

    # changed input content reruns
    atomic_write_text(src, "b")
    assert not _stage(run, cfg, "preprocess", None, src, a_out, calls).skipped
    # an output modified behind the manifest's back reruns
    atomic_write_parquet(a_out, pa.table({"v": ["tampered"]}))
    assert not _stage(run, cfg, "preprocess", None, src, a_out, calls).skipped
    # force always reruns
    assert not _stage(run, cfg, "preprocess", None, src, a_out, calls, force=True).skipped


def test_iteration_rerun_marks_later_iterations_stale(tmp_path):
    run, cfg, calls = RunDir(tmp_path / "run"), load_config(), []
    src = tmp_path / "in.txt"
    atomic_write_text(src, "x")
    for k in (1, 2):
        _stage(run, cfg, "rollout", k, src, run.rollout(k), calls)
        _stage(run, cfg, "score", k, run.rollout(k), run.scored(k), calls)
    assert run.iterations() == [1, 2]
    same = _stage(run, cfg, "rollout", 1, src, run.rollout(1), calls, force=True)  # the same bytes again
    assert not same.skipped and "nothing downstream is stale" in same.summary[-1]
    assert {r["status"] for k in (1, 2) for r in read_manifest(run, k).values()} == {"done"}
    atomic_write_text(src, "y")
    _stage(run, cfg, "rollout", 1, src, run.rollout(1), calls, force=True)
    assert read_manifest(run, 1)["score"]["status"] == "stale"
    assert read_manifest(run, 2)["rollout"]["status"] == "stale"
    assert read_manifest(run, 1)["rollout"]["status"] == "done"


def test_a_stage_that_raises_records_nothing_and_one_without_a_result_is_refused(tmp_path):
    from rlhf_core.errors import RLHFError

    run, cfg = RunDir(tmp_path / "run"), load_config()
    src = tmp_path / "in.txt"
    atomic_write_text(src, "a")
    with pytest.raises(ValueError, match="half-way"):
        with stage_record(stage="a", cfg=cfg, run=run, iteration=1, inputs=[src], config_sections=("data.",)):
            raise ValueError("half-way")
    assert "a" not in read_manifest(run, 1)
    with pytest.raises(RLHFError, match="stage a finished without a result"):
        with stage_record(stage="a", cfg=cfg, run=run, iteration=1, inputs=[src], config_sections=("data.",)):
            pass
    assert "a" not in read_manifest(run, 1)
