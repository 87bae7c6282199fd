"""Non-compute time of a stage body: counted once per block, by kind, into the manifest record."""

from __future__ import annotations

import time

import pyarrow as pa

from rlhf_core.config import load_config
from rlhf_core.io import timing
from rlhf_core.io.atomic import atomic_dir, atomic_write_json, atomic_write_parquet, atomic_write_text
from rlhf_core.run.manifest import read_manifest
from rlhf_core.run.layout import RunDir
from rlhf_core.stages.base import StageResult, stage_record


def test_nested_blocks_count_once_in_the_outermost_kind():
    with timing.tally() as counts:
        with timing.timed("checkpoint_write"):
            with timing.timed("json_write"):
                time.sleep(0.02)
        with timing.timed("model_load"):
            time.sleep(0.01)
    assert set(counts) == {"checkpoint_write", "model_load"}
    assert counts["checkpoint_write"] >= 0.02 and counts["model_load"] >= 0.01


def test_opaque_hides_inner_blocks_and_add_counts_reported_seconds():
    with timing.tally() as counts:
        with timing.opaque():
            with timing.timed("model_load"):
                time.sleep(0.01)
        timing.add("update_setup", 0.5)
        timing.add("checkpoint_write", 0.0)  # nothing to count
    assert counts == {"update_setup": 0.5}


def test_blocks_outside_a_tally_are_only_spans_when_asked():
    timing.keep_spans()
    try:
        with timing.timed("mlflow"):
            pass
        with timing.tally():
            with timing.timed("model_load"):
                pass
        with timing.span("task:rollout"):
            with timing.timed("hashing"):
                pass
        kinds = [(s.kind, s.in_stage) for s in timing.spans()]
    finally:
        timing.keep_spans(False)
    assert kinds == [("mlflow", False), ("model_load", True), ("hashing", False), ("task:rollout", False)]
    assert timing.spans() == []


def test_atomic_writers_report_their_kind(tmp_path):
    with timing.tally() as counts:
        atomic_write_parquet(tmp_path / "t.parquet", pa.table({"v": [1]}))
        atomic_write_json(tmp_path / "s.json", {"a": 1})
        with atomic_dir(tmp_path / "ckpt") as tmp:
            atomic_write_text(tmp / "weights.bin", "w")  # inside a checkpoint: a checkpoint write
    assert set(counts) == {"table_write", "json_write", "checkpoint_write"}


def test_a_stage_record_keeps_io_seconds_apart_from_compute(tmp_path):
    run, cfg = RunDir(tmp_path / "run"), load_config()
    src = tmp_path / "in.txt"
    atomic_write_text(src, "x")

    with stage_record(stage="rollout", cfg=cfg, run=run, iteration=1, inputs=[src],
                      config_sections=("data.",)) as stage:
        assert stage.skipped is None
        with timing.timed("model_load"):
            time.sleep(0.05)
        time.sleep(0.05)  # compute
        out = atomic_write_parquet(run.rollout(1), pa.table({"v": [1]}))
        result = stage.done(StageResult(stage="rollout", iteration=1, outputs={"rollout": str(out)}))
    record = read_manifest(run, 1)["rollout"]
    assert set(record["io"]) == {"model_load", "table_write"}
    assert record["io"]["model_load"] >= 0.05
    assert abs(record["io_seconds"] - sum(record["io"].values())) < 1e-5
    assert record["io_seconds"] == result.io_seconds
    assert 0.05 <= record["seconds"] - record["io_seconds"] < record["seconds"]
    # the input hashing and the manifest write happen outside the stage's work: not in its tally
    assert "hashing" not in record["io"] and "manifest" not in record["io"]


def test_automatic_full_collections_outside_blocks_are_counted_apart():
    import gc

    with timing.tally() as counts:
        gc.collect()  # outside any timed block: an automatic-looking pause
        with timing.timed("memory_release"):
            gc.collect()  # inside: already counted by its block
    assert counts.get("gc_pause", 0) > 0 and counts.get("memory_release", 0) > 0
    assert set(counts) == {"gc_pause", "memory_release"}
