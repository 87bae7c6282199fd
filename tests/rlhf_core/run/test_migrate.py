"""The run directory's format (rlhf_core.run.migrate): a format-1 directory — the KL controller's state
in one kl_ctrl.json at the root plus a snapshot before each iteration, and a commit log perhaps
without its "committed" list — is upgraded once, by the one migration function, into each gae's own
output, recorded in its manifest like any other; nothing else in the code reads the old files."""

from __future__ import annotations

import json

import pytest

from rlhf_core.config import load_config, to_yaml
from rlhf_core.errors import RLHFError
from rlhf_core.io.atomic import atomic_write_json
from rlhf_core.io.hashing import sha256_tree
from rlhf_core.run import migrate
from rlhf_core.run.layout import RunDir, StateFileError, write_config
from rlhf_core.run.lifecycle import committed_iterations
from rlhf_core.run.manifest import read_manifest, record_stage
from rlhf_core.control.plan import resolve_run_config

ADAPTIVE = {"type": "adaptive", "target_kl": 0.02, "horizon": 10000.0}


def format_1_run(tmp_path) -> RunDir:
    """Two committed iterations and a third whose gae finished before a crash, as format 1 left them:
    iteration 1 started from a fresh controller (snapshot None), 2 from 1's state, 3 from 2's."""
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    cfg = load_config(None, ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
                             "algorithm.kl_ctrl.kl_coef=0.2", "algorithm.kl_ctrl.target_kl=0.02"])
    write_config(run, to_yaml(cfg))
    coefs = {1: (0.2, 0.21), 2: (0.21, 0.22), 3: (0.22, 0.23)}
    for k, (used, after) in coefs.items():
        snapshot = run.legacy_kl_snapshot(k)
        atomic_write_json(snapshot, {"state": None if k == 1 else {**ADAPTIVE, "value": used}})
        run.advantages(k).parent.mkdir(parents=True, exist_ok=True)
        run.advantages(k).write_bytes(b"table %d" % k)
        record_stage(run, k, "gae", status="done", config_hash="h",
                     inputs={f"iter_{k}/scored.parquet": "s", f"iter_{k}/kl_ctrl_before.json": sha256_tree(snapshot)},
                     outputs={f"iter_{k}/advantages.parquet": sha256_tree(run.advantages(k))},
                     outputs_paths={"advantages": str(run.advantages(k))},
                     metrics={"kl/coef": used, "kl/coef_next": after})
    record_stage(run, 1, "guard", status="done", committed=True)
    atomic_write_json(run.legacy_kl_ctrl_path, {**ADAPTIVE, "value": 0.23})
    atomic_write_json(run.last_good_path, {"iteration": 2, "checkpoint": "iter_2/checkpoint", "time": 0})
    return run


def test_a_format_1_directory_is_upgraded_once(tmp_path):
    run = format_1_run(tmp_path)
    assert migrate.run_format(run) == 1 and "format 1" in migrate.outdated(run)
    saved = resolve_run_config(run.root, None, ())
    line = migrate.migrate(run, saved.algorithm.kl_ctrl, saved.data.reward_fn_key)
    assert "the KL controller state of iterations [1, 2, 3] is now each gae's output" in line
    assert migrate.run_format(run) == migrate.RUN_FORMAT and migrate.outdated(run) is None
    states = {k: json.loads(run.kl_state(k).read_text()) for k in (1, 2, 3)}
    assert states[1]["used"] == {"type": "adaptive", "value": 0.2, "target_kl": 0.02, "horizon": 10000.0}
    assert states[1]["next"]["value"] == 0.21 and states[2]["used"]["value"] == 0.21
    assert states[3]["used"] == states[2]["next"] and states[3]["next"]["value"] == 0.23 and states[3]["scale"] == 1.0
    for k in (1, 2, 3):  # recorded like any output; the predecessor's is an input
        gae = read_manifest(run, k)["gae"]
        assert gae["outputs"][f"iter_{k}/kl_ctrl.json"] == sha256_tree(run.kl_state(k))
        assert not [key for key in gae["inputs"] if "kl_ctrl_before" in key]
        assert (f"iter_{k - 1}/kl_ctrl.json" in gae["inputs"]) == (k > 1)
        assert not run.legacy_kl_snapshot(k).exists()
    assert not run.legacy_kl_ctrl_path.exists()
    assert committed_iterations(run) == [1, 2]  # the commit log got its list from the guard records
    assert [e["kind"] for e in run.events()] == ["migrated"]
    assert migrate.migrate(run, saved.algorithm.kl_ctrl, saved.data.reward_fn_key) is None  # once


def test_a_new_directory_is_current_and_a_newer_one_is_refused(tmp_path):
    run = RunDir(tmp_path / "new")
    assert migrate.run_format(run) == migrate.RUN_FORMAT
    run.root.mkdir()
    migrate.stamp(run)
    assert json.loads(run.format_path.read_text()) == {"format": migrate.RUN_FORMAT}
    run.format_path.write_text(json.dumps({"format": migrate.RUN_FORMAT + 1}))
    with pytest.raises(RLHFError, match="newer than this rlhf-dag reads"):
        migrate.migrate(run, load_config(None, []).algorithm.kl_ctrl, "data_source")


def test_a_damaged_format_file_is_answered_with_the_format_of_the_contents(tmp_path):
    """Issue 38: a format.json that did not parse was answered with advice to write {"format": 1},
    whatever the directory held. The advice now names the format of what it holds: 1 with format-1 KL
    state, 3 with an unsealed config.yaml, the current one otherwise; written as advised, the upgrade
    finishes the job."""
    (tmp_path / "old").mkdir()
    old = format_1_run(tmp_path / "old")
    current = RunDir(tmp_path / "current")
    current.root.mkdir()
    write_config(current, to_yaml(load_config(None, [])))
    unsealed = RunDir(tmp_path / "unsealed")
    unsealed.root.mkdir()
    unsealed.config_path.write_text(to_yaml(load_config(None, [])))
    for run, n in ((old, 1), (unsealed, 3), (current, migrate.RUN_FORMAT)):
        assert migrate.contents_format(run) == n
        for damage in (b"\xff\xfe", b"[3]", b'{"format": "3"}', b'{"format": true}'):
            run.format_path.write_bytes(damage)
            with pytest.raises(StateFileError, match=rf"^{run.format_path} is damaged .*; its contents are format {n} "
                                                     rf"\(.*\): write {{\"format\": {n}}} there"):
                migrate.run_format(run)
        run.format_path.write_text(json.dumps({"format": n}))
        saved = resolve_run_config(run.root, None, ())
        migrate.migrate(run, saved.algorithm.kl_ctrl, saved.data.reward_fn_key)
        assert migrate.run_format(run) == migrate.RUN_FORMAT and migrate.outdated(run) is None
    # a seal that no longer matches is damage (named by every command), not a format-3 file to seal again
    current.config_path.write_text(current.config_path.read_text() + "# edited\n")
    assert migrate.contents_format(current) == migrate.RUN_FORMAT
