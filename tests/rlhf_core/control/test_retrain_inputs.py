"""Retraining inputs: the newest export, the base-model spec, data snapshots, input checks, run names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_core.config import ConfigError, load_config
from rlhf_core.io.hashing import sha256_file
from rlhf_core.control.retrain_inputs import LAST_EXPORTED, find_exports, latest_export, resolve_base_model, retrain_run_name, snapshot_files
from rlhf_core.run.inputs import check_inputs


def _export(runs_root: Path, run: str, when: float, iteration: int = 2) -> Path:
    actor = runs_root / run / "export" / "actor"
    actor.mkdir(parents=True)
    (actor / "config.json").write_text("{}")
    (actor / "export.json").write_text(json.dumps({"iteration": iteration, "val_accuracy": 0.5, "time": when}))
    return actor


def test_latest_export_is_the_newest_record_not_the_newest_name(tmp_path):
    _export(tmp_path, "zzz-old", when=100.0)
    newest = _export(tmp_path, "aaa-new", when=200.0, iteration=7)
    (tmp_path / "broken" / "export" / "actor").mkdir(parents=True)
    (tmp_path / "broken" / "export" / "actor" / "export.json").write_text("{not json")
    for name, damage in (("bytes", b'{"time": "\xff"}'), ("list", b"[1, 2]")):  # issue 38: these raised
        (tmp_path / name / "export" / "actor").mkdir(parents=True)
        (tmp_path / name / "export" / "actor" / "export.json").write_bytes(damage)
    assert [e.run_dir.name for e in find_exports(tmp_path)] == ["zzz-old", "aaa-new"]
    latest = latest_export(tmp_path)
    assert latest.path == newest and latest.iteration == 7 and latest.run_dir == tmp_path / "aaa-new"
    assert latest_export(tmp_path / "absent") is None


def test_base_model_specs(tmp_path):
    cfg = load_config(None, ["actor_rollout_ref.model.path=tiny"])
    with pytest.raises(ConfigError, match="no exported model under .*Run rlhf-train first"):
        resolve_base_model(LAST_EXPORTED, tmp_path, cfg)
    actor = _export(tmp_path, "r1", when=1.0)
    assert resolve_base_model(LAST_EXPORTED, tmp_path, cfg) == (str(actor), latest_export(tmp_path))
    assert resolve_base_model("config", tmp_path, cfg) == ("tiny", None)
    assert resolve_base_model(str(actor), tmp_path, cfg) == (str(actor), None)
    with pytest.raises(ConfigError, match="not a Hugging Face model directory"):
        resolve_base_model(str(tmp_path), tmp_path, cfg)


def test_snapshot_copies_and_hashes_every_file_without_name_clashes(tmp_path):
    a, b = tmp_path / "a" / "train.jsonl", tmp_path / "b" / "train.jsonl"
    for path, text in ((a, '{"q": 1}\n'), (b, '{"q": 2}\n')):
        path.parent.mkdir()
        path.write_text(text)
    entries = snapshot_files([str(a), str(b)], tmp_path / "snap")
    assert [Path(e["path"]).name for e in entries] == ["00-train.jsonl", "01-train.jsonl"]
    assert [e["sha256"] for e in entries] == [sha256_file(a), sha256_file(b)]
    a.write_text("changed later\n")  # the run keeps reading the bytes it started with
    assert Path(entries[0]["path"]).read_text() == '{"q": 1}\n'
    record = json.loads((tmp_path / "snap" / "snapshot.json").read_text())
    assert record["files"] == entries
    with pytest.raises(ConfigError, match=r"data.train_files: file\(s\) not found: .*missing.jsonl"):
        snapshot_files([str(tmp_path / "missing.jsonl")], tmp_path / "snap2")
    assert not (tmp_path / "snap2").exists()


def test_check_inputs_lists_every_missing_path(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("{}\n")
    check_inputs(load_config(None, [f"data.train_files=[{data}]", "actor_rollout_ref.model.path=tiny"]))
    cfg = load_config(None, [f"data.train_files=[{data},{tmp_path}/gone.jsonl]", f"data.val_files=[{tmp_path}/v.csv]",
                             f"actor_rollout_ref.model.path={tmp_path}/no-model"])
    with pytest.raises(ConfigError) as info:
        check_inputs(cfg)
    message = str(info.value)
    assert "data.train_files: " in message and "gone.jsonl not found" in message
    assert "data.val_files" in message and "actor_rollout_ref.model.path" in message and "no-model" in message


def test_run_names_never_collide():
    same_second = 1_800_000_000.0
    a = retrain_run_name("retrain", "1a2b3c4d-0000-0000-0000-000000000000", now=same_second)
    b = retrain_run_name("retrain", "9f8e7d6c-0000-0000-0000-000000000000", now=same_second)
    assert a == "retrain-20270115-080000-1a2b3c4d" and a != b
    assert retrain_run_name("retrain", None, now=same_second) != retrain_run_name("retrain", None, now=same_second)
