"""A run directory in format 2 — tables written before some of their columns existed — is upgraded
once by ``run.migrate`` (to the current format) and then reads like a new one: nothing reruns, nothing reads as
damage, a forced rescore gives the same numbers, and the readers hold no old-format branch.

The format-2 directory is the session's real 2-iteration run with the columns taken out that older
versions did not write (prompts ``reward_source``; rollout ``uid``, ``rollout_log_probs``,
``reward_source``, ``extra_info``; scored the same, its ``uid`` null) and the manifests' hashes
set to those tables, as an older version recorded them."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf_cli.main import main
from rlhf_core.io.atomic import atomic_write_json
from rlhf_core.io.hashing import sha256_tree
from rlhf_core.run import migrate
from rlhf_core.run.integrity import find_damage
from rlhf_core.run.layout import RunDir
from rlhf_core.run.manifest import read_manifest, record_key
from rlhf_core.control.plan import saved_config, upgrade_format

pytestmark = [pytest.mark.slow, pytest.mark.deepspeed]

RESPONSE_COLUMNS = ("uid", "rollout_log_probs", "reward_source", "extra_info")


def _tables(run: RunDir) -> list[Path]:
    return [run.train_prompts, run.val_prompts] + [p for k in (1, 2) for p in (run.rollout(k), run.scored(k))]


def format_2_copy(pristine: RunDir, where: Path) -> RunDir:
    run = RunDir(where)
    shutil.copytree(pristine.root, run.root, symlinks=True)
    plan = {}
    for path in _tables(run):
        table, before = pq.read_table(path), sha256_tree(path)
        if path.parent.name == "prompts":
            table = table.drop_columns(["reward_source"])
        elif path.name == "rollout.parquet":
            table = table.drop_columns(list(RESPONSE_COLUMNS))
        else:
            table = table.drop_columns(list(RESPONSE_COLUMNS[1:]))
            table = table.set_column(table.column_names.index("uid"), "uid", pa.nulls(len(table), pa.string()))
        pq.write_table(table, path, compression="zstd")
        plan[record_key(run, path)] = {"from": before, "to": sha256_tree(path)}
    migrate._replace_digests(run, plan)  # the hashes an older version recorded for these tables
    atomic_write_json(run.format_path, {"format": 2})
    return run


def rlhf(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out + out.err


def test_a_format_2_run_is_upgraded_once_and_nothing_reruns(two_iterations, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RLHF_HOME", str(two_iterations.home))
    pristine = two_iterations.pristine
    run = format_2_copy(pristine, tmp_path / "old")
    assert "run-directory format 2" in migrate.outdated(run)
    code, out = rlhf(capsys, "status", str(run.root))
    assert code == 0 and "run-directory format 2" in out, out

    code, out = rlhf(capsys, "stage", "score", "--run-dir", str(run.root), "--iteration", "2", "--local")
    assert code == 0, out
    assert "[score iteration 2] skipped (up to date)" in out, out  # its inputs, upgraded, are the ones it scored
    assert migrate.run_format(run) == migrate.RUN_FORMAT and migrate.outdated(run) is None and not run.format_journal.exists()
    (event,) = [e for e in run.events() if e["kind"] == "migrated"]
    assert "6 table(s) given the columns they lacked" in event["message"]
    assert find_damage(run) == []
    for k in (1, 2):
        for stage in ("rollout", "score", "gae"):
            assert read_manifest(run, k)[stage]["status"] == "done"
        rollout = pq.read_table(run.rollout(k)).to_pylist()
        prompts = {r["prompt_id"]: r for r in pq.read_table(run.train_prompts).to_pylist()}
        assert all(r["uid"] == f"{k}-{r['prompt_id']}" and r["rollout_log_probs"] is None for r in rollout)
        assert all(r["reward_source"] == prompts[r["prompt_id"]]["reward_source"] == prompts[r["prompt_id"]]["data_source"]
                   and r["extra_info"] == prompts[r["prompt_id"]]["extra_info"] for r in rollout)
        assert pq.read_schema(run.scored(k)).names == pq.read_schema(pristine.scored(k)).names

    code, out = rlhf(capsys, "stage", "score", "--run-dir", str(run.root), "--iteration", "2", "--local", "--force")
    assert code == 0, out
    upgraded, new = pq.read_table(run.scored(2)), pq.read_table(pristine.scored(2))
    for column in ("reward", "ref_log_probs", "values", "reward_source", "extra_info"):
        assert upgraded.column(column).equals(new.column(column)), column
    # the new run's old log-probs are its rollout's own (rollout.old_log_probs=auto); a format-2 rollout
    # recorded none, so the actor's pass recomputes them: the same arithmetic up to summation order
    recomputed = np.concatenate([np.asarray(r) for r in upgraded.column("old_log_probs").to_pylist()])
    sampled = np.concatenate([np.asarray(r) for r in new.column("old_log_probs").to_pylist()])
    assert np.abs(recomputed - sampled).max() < 1e-5
    assert upgrade_format(run, saved_config(run)) is None  # once


def test_an_upgrade_killed_part_way_is_finished_and_damage_is_left_to_its_stage(two_iterations, tmp_path):
    whole = format_2_copy(two_iterations.pristine, tmp_path / "whole")
    upgrade_format(whole, saved_config(whole))

    killed = format_2_copy(two_iterations.pristine, tmp_path / "killed")
    damaged = record_key(killed, killed.rollout(2))
    table = pq.read_table(killed.rollout(2))
    pq.write_table(table.slice(0, len(table) - 1), killed.rollout(2))  # not what its rollout recorded
    migrate._stage_tables(killed, saved_config(killed).data.reward_fn_key)  # staged and listed, then the process dies
    assert killed.format_journal.is_file() and migrate.run_format(killed) == 2
    # what `rlhf status` says meanwhile: an upgrade to finish, not a dozen "changed" tables
    assert "was interrupted part-way" in migrate.outdated(killed)
    line = upgrade_format(killed, saved_config(killed))
    assert "5 table(s) given the columns they lacked" in line and damaged not in line
    for path in _tables(whole):
        if record_key(whole, path) != damaged:
            assert sha256_tree(path) == sha256_tree(killed.root / record_key(whole, path)), path
    assert "uid" not in pq.read_schema(killed.rollout(2)).names  # left for its stage to rewrite
    assert [(d.iteration, d.stage) for d in find_damage(killed)] == [(2, "rollout")]
    assert not list(killed.root.rglob("*.format3"))
