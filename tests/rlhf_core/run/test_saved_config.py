"""config.yaml is sealed when written, and a command continues a run whose config.yaml no longer
matches its seal with the config its newest committed iteration recorded, naming the keys that
differ (``run.saved_config``)."""

from __future__ import annotations

import json

import yaml

from rlhf_core.config import load_config, to_dict, to_yaml
from rlhf_core.run.layout import CONFIG_SEAL, RunDir, read_config_text, write_config
from rlhf_core.run.migrate import RUN_FORMAT, migrate, stamp
from rlhf_core.run.saved_config import differences, run_config_tree
from rlhf_core.config.schema import KLCtrlConfig


def _run_with_commit(tmp_path, lr: float = 1e-4) -> RunDir:
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    stamp(run)
    cfg = load_config(None, [f"actor_rollout_ref.actor.optim.lr={lr}", "trainer.total_iterations=3"])
    write_config(run, to_yaml(cfg))
    run.iter_dir(1).mkdir(parents=True)
    run.state_record(1).write_text(json.dumps({"iteration": 1, "id": "x", "config": to_dict(cfg)}))
    run.last_good_path.write_text(json.dumps({"iteration": 1, "checkpoint": "iter_1/checkpoint", "committed": [1]}))
    return run


def test_a_sealed_config_reads_back_as_written(tmp_path):
    run = _run_with_commit(tmp_path)
    text, problem = read_config_text(run)
    assert problem is None and run.config_path.read_text().startswith(CONFIG_SEAL)
    tree, damaged = run_config_tree(run)
    assert damaged is None and tree["actor_rollout_ref"]["actor"]["optim"]["lr"] == 1e-4


def test_a_lost_line_is_found_and_the_recorded_config_continues(tmp_path):
    run = _run_with_commit(tmp_path)
    lines = run.config_path.read_text().splitlines(keepends=True)
    lr_line = next(i for i, line in enumerate(lines) if line.strip().startswith("lr: 0.0001"))
    run.config_path.write_text("".join(lines[:lr_line] + lines[lr_line + 1:]))  # the schema default would fill it
    tree, damaged = run_config_tree(run)
    assert tree["actor_rollout_ref"]["actor"]["optim"]["lr"] == 1e-4
    assert "was changed since rlhf wrote it" in damaged and "actor_rollout_ref.actor.optim.lr: missing in config.yaml, " \
                                                           "0.0001 recorded" in damaged
    assert "iteration 1 trained with (iter_1/state.json)" in damaged and "KEY=VALUE" in damaged


def test_a_cut_section_is_counted_and_restored(tmp_path):
    run = _run_with_commit(tmp_path)
    tree = yaml.safe_load(read_config_text(run)[0])
    del tree["trainer"]
    run.config_path.write_text(CONFIG_SEAL + "0" * 64 + "\n" + yaml.safe_dump(tree))
    restored, damaged = run_config_tree(run)
    assert restored["trainer"]["total_iterations"] == 3
    assert "more under trainer." in damaged


def test_differences_name_changed_and_missing_keys():
    said = differences({"a": {"x": 1, "y": 2}}, {"a": {"x": 1, "y": 3, "z": 4}})
    assert said == "a.y: 2 in config.yaml, 3 recorded; a.z: missing in config.yaml, 4 recorded"


def test_without_a_commit_a_damaged_config_is_used_as_it_is_and_said(tmp_path):
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    stamp(run)
    write_config(run, to_yaml(load_config(None, [])))
    run.config_path.write_text(run.config_path.read_text() + "# edited\n")
    _, damaged = run_config_tree(run)
    assert "no committed iteration recorded its config" in damaged


def test_a_format_3_directory_is_trusted_and_sealed_by_its_upgrade(tmp_path):
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    run.format_path.write_text(json.dumps({"format": 3}))
    run.config_path.write_text(to_yaml(load_config(None, [])))
    assert run_config_tree(run)[1] is None  # written before seals: trusted
    said = migrate(run, KLCtrlConfig(), "data_source")
    assert "config.yaml sealed" in said and read_config_text(run)[1] is None
    assert json.loads(run.format_path.read_text()) == {"format": RUN_FORMAT}
