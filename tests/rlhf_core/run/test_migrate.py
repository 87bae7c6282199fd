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
    assert states[3]["used"] == states[2]["next"] and states[3]["next"]["value"] == 0.23
    assert states[3]["retry_scale"] == 1.0 and "scale" not in states[3]  # and on to format 5
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


# ---------------------------------------------------------------------------------------------
# format 4 → 5: β's retry scale leaves config.yaml (issue 40)
# ---------------------------------------------------------------------------------------------


def _scored(run: RunDir, k: int) -> None:
    """A small scored table whose old log-probs sit above ref: the adaptive controller moves."""
    import random

    import pyarrow as pa

    from rlhf_core.data.schemas import SCORED
    from rlhf_core.io.atomic import atomic_write_parquet

    rng = random.Random(k)
    rows = []
    for i, n in enumerate((4, 7, 1, 5)):
        ref = [rng.uniform(-3, -0.5) for _ in range(n)]
        rows.append(dict(prompt_id=f"p{i}", sample_index=0, iteration=k, data_source="arith", ground_truth="7",
                         prompt_token_ids=[1, 2], response_text="r" * n, response_token_ids=list(range(n)),
                         response_length=n, finish_reason="stop", engine="offline", sampling_seed=0,
                         reward=float(i % 2), reward_extra="{}", old_log_probs=[x + 0.2 * k for x in ref],
                         ref_log_probs=ref, values=[0.0] * n, uid=f"{k}-p{i}"))
    atomic_write_parquet(run.scored(k), pa.Table.from_pylist(rows, schema=SCORED), schema=SCORED)


def format_4_run(tmp_path, config_scale: float):
    """Iterations 1 and 2 committed as format 4 left them: 1 ran at scale 1, 2 was retried once (scale 2
    in config.yaml, its kl_ctrl.json {"used": 1's next, "scale": 2, "next": unscaled}); config.yaml's
    trainer.kl_coef_scale is ``config_scale`` (4: a retry of iteration 3 decided, its gae not rerun).
    Built from this code's own gae, then written back in format 4. Returns (cfg, run, what format 5
    wrote: {k: kl_ctrl.json})."""
    import hashlib

    import yaml

    from rlhf_core.config import flatten, to_dict
    from rlhf_core.run.lifecycle import record_retry
    from rlhf_core.stages.gae import run_gae

    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    cfg = load_config(None, ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
                             "algorithm.kl_ctrl.kl_coef=0.1", "algorithm.kl_ctrl.target_kl=0.05",
                             "algorithm.kl_ctrl.horizon=40", "trainer.retry_kl_coef_multiplier=2"])
    for k in (1, 2, 3):
        _scored(run, k)
    def commit(*iterations):  # the commit log only (what gae asks)
        atomic_write_json(run.last_good_path, {"iteration": iterations[-1], "time": 0.0, "committed": list(iterations),
                                               "checkpoint": f"iter_{iterations[-1]}/checkpoint"})

    run_gae(cfg, run, 1)
    commit(1)
    record_retry(run, 2, 1, {}, 2.0)
    run_gae(cfg, run, 2)
    commit(1, 2)
    current = {k: json.loads(run.kl_state(k).read_text()) for k in (1, 2)}
    # back to format 4
    run.retry_record(2).unlink()
    scales = {1: 1.0, 2: 2.0}
    for k, state in current.items():
        atomic_write_json(run.kl_state(k), {"iteration": k, "used": current[1]["next"] if k == 2 else state["used"],
                                            "scale": scales[k],
                                            "next": {**state["next"], "value": state["next"]["value"] / scales[k]}})
    flat = {key: v for key, v in flatten(cfg).items() if key.startswith(("algorithm.", "critic.enable"))}
    for k in (1, 2):
        manifest = read_manifest(run, k)
        gae = manifest["gae"]
        gae["inputs"] = {key: (sha256_tree(run.root / key) if "kl_ctrl" in key else digest)
                         for key, digest in gae["inputs"].items() if "retry" not in key}
        gae["outputs"][f"iter_{k}/kl_ctrl.json"] = sha256_tree(run.kl_state(k))
        old = {**flat, "trainer.kl_coef_scale": scales[k]}
        gae["config_hash"] = hashlib.sha256(json.dumps(old, sort_keys=True, default=str).encode()).hexdigest()
        record_stage(run, k, "gae", **gae)
    tree = to_dict(cfg)
    tree["trainer"]["kl_coef_scale"] = config_scale
    write_config(run, yaml.safe_dump(tree, sort_keys=False, default_flow_style=False))
    atomic_write_json(run.format_path, {"format": 4})
    return cfg, run, current


@pytest.mark.parametrize("config_scale", [2.0, 4.0])
def test_a_format_4_run_with_a_retry_scale_resumes_with_the_same_coefficients(tmp_path, config_scale):
    from rlhf_core.run.layout import read_config_text
    from rlhf_core.stages.gae import run_gae

    cfg, run, current = format_4_run(tmp_path, config_scale)
    old_next = json.loads(run.kl_state(2).read_text())["next"]["value"]
    expected = old_next * config_scale  # what format 4 used for iteration 3: 2's next × config.yaml's scale
    assert migrate.contents_format(run) == 4 and "format 4" in migrate.outdated(run)
    assert resolve_run_config(run.root, None, ()) == cfg  # read before the upgrade, without the removed key
    line = migrate.migrate(run, cfg.algorithm.kl_ctrl, cfg.data.reward_fn_key)
    assert "config.yaml sealed without trainer.kl_coef_scale" in line and "iterations [1, 2]" in line
    assert migrate.run_format(run) == migrate.RUN_FORMAT == 5 and migrate.outdated(run) is None
    body, problem = read_config_text(run)
    assert problem is None and "kl_coef_scale" not in body and resolve_run_config(run.root, None, ()) == cfg
    states = {k: json.loads(run.kl_state(k).read_text()) for k in (1, 2)}
    assert states[1] == current[1]
    assert states[2]["retry_scale"] == 1.0 and states[2]["used"]["value"] == current[1]["next"]["value"] * 2
    assert states[2]["next"] == current[2]["next"]  # what format 5 wrote itself
    for k in (1, 2):  # recorded hashes follow, and the removal of the key alone reruns nothing
        assert read_manifest(run, k)["gae"]["outputs"][f"iter_{k}/kl_ctrl.json"] == sha256_tree(run.kl_state(k))
        assert run_gae(cfg, run, k).skipped
    assert read_manifest(run, 2)["gae"]["inputs"]["iter_1/kl_ctrl.json"] == sha256_tree(run.kl_state(1))
    if config_scale == 2.0:
        assert not run.retry_record(3).exists()
    else:  # the retry of iteration 3 that config.yaml held: 4 / 2
        assert run.read_json(run.retry_record(3))["kl_coef_scale"] == 2.0
    third = run_gae(cfg, run, 3)
    assert third.metrics["kl/coef"] == pytest.approx(expected, rel=1e-15)
    assert migrate.migrate(run, cfg.algorithm.kl_ctrl, cfg.data.reward_fn_key) is None  # once


def test_a_format_4_upgrade_killed_part_way_is_finished_by_the_next_command(tmp_path, monkeypatch):
    from rlhf_core.stages.gae import run_gae

    (tmp_path / "killed").mkdir()
    (tmp_path / "whole").mkdir()
    cfg, run, _ = format_4_run(tmp_path / "killed", 4.0)
    _, whole, _ = format_4_run(tmp_path / "whole", 4.0)
    migrate.migrate(whole, cfg.algorithm.kl_ctrl, cfg.data.reward_fn_key)
    real = migrate.os.replace

    def killed(*args):
        monkeypatch.setattr(migrate.os, "replace", real)
        raise KeyboardInterrupt  # after the manifests took the new hash, before the file is in place

    monkeypatch.setattr(migrate.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        migrate.migrate(run, cfg.algorithm.kl_ctrl, cfg.data.reward_fn_key)
    assert migrate.run_format(run) == 4
    assert "upgraded" in migrate.migrate(run, cfg.algorithm.kl_ctrl, cfg.data.reward_fn_key)
    for k in (1, 2):
        assert run.kl_state(k).read_text() == whole.kl_state(k).read_text()
        assert read_manifest(run, k)["gae"]["outputs"][f"iter_{k}/kl_ctrl.json"] == sha256_tree(run.kl_state(k))
        assert run_gae(cfg, run, k).skipped
    assert run.read_json(run.retry_record(3))["kl_coef_scale"] == 2.0
