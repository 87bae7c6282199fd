"""The rollout stage on a real run directory (preprocess → pack → rollout): table contract, slot
choice, manifest skip, forced rerun reproducing the table, offline import, and the CLI."""

from __future__ import annotations

import json

import duckdb
import pyarrow.parquet as pq
import pytest

from rlhf_core.config import load_config, to_yaml
from rlhf_core.data.schemas import REJECTS, ROLLOUT, decode_extra_info
from rlhf_core.errors import DataError, RLHFError
from rlhf_core.run.manifest import read_manifest
from rlhf_core.run.layout import RunDir, write_config
from rlhf_core.stages.pack import run_pack
from rlhf_core.stages.preprocess import run_preprocess
from rlhf_core.stages.rollout import rollout_rejects_path, run_rollout


def small_config(raw_file, model_dir, *extra):
    """Demo-like settings shrunk for a test: 12 prompts, 2 slots of 6, 12-token responses."""
    return load_config(None, [
        f"data.train_files=[{raw_file}]", "data.val_fraction=0.0", "data.data_source=arith",
        "data.train_batch_size=6", "data.max_response_length=12", "data.max_prompt_length=128",
        f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.generation_batch_tokens=1024", "actor_rollout_ref.actor.ppo_mini_batch_size=6",
        "trainer.device=cpu", *extra])


@pytest.fixture
def run_setup(tmp_path, repo_root, tiny_model_dir):
    """A run directory after the real preprocess and pack stages on 12 embedded problems."""
    raw = tmp_path / "arith.jsonl"
    raw.write_text("".join((repo_root / "data/arith/train.jsonl").read_text().splitlines(True)[:12]))
    cfg = small_config(raw, tiny_model_dir)
    run = RunDir(tmp_path / "run")
    write_config(run, to_yaml(cfg))
    run_preprocess(cfg, run)
    run_pack(cfg, run)
    return cfg, run, raw


def _slot_prompt_ids(run, slot):
    table = pq.read_table(run.generation_batches).to_pylist()
    return [pid for row in sorted(table, key=lambda r: r["batch_id"]) if row["slot"] == slot
            for pid in row["prompt_ids"]]


def test_rollout_writes_the_declared_table_for_the_iterations_slot(run_setup):
    cfg, run, _ = run_setup
    result = run_rollout(cfg, run, 1)
    table = pq.read_table(run.rollout(1))
    assert table.schema.equals(ROLLOUT)
    rows = table.to_pylist()
    slot_ids = _slot_prompt_ids(run, 0)
    assert len(slot_ids) == 6 and len(rows) == 12  # 6 prompts × n=2
    assert [(r["prompt_id"], r["sample_index"]) for r in rows] == [(p, j) for p in slot_ids for j in range(2)]
    prompts = {p["prompt_id"]: p for p in pq.read_table(run.train_prompts).to_pylist()}
    for r in rows:
        p = prompts[r["prompt_id"]]
        assert r["prompt_token_ids"] == p["prompt_token_ids"] and r["data_source"] == "arith"
        assert r["ground_truth"] == p["reward_model"]["ground_truth"]
        assert r["response_length"] == len(r["response_token_ids"]) <= 12
        assert r["finish_reason"] in ("stop", "length") and r["engine"] == "hf" and r["iteration"] == 1
        assert r["reward_source"] == "arith" and r["extra_info"] == p["extra_info"]
    assert result.rows == {"prompts": 6, "responses": 12}
    assert result.metrics["perf/rollout_tokens_per_s"] > 0
    m = result.metrics
    assert m["response_length/mean"] == sum(r["response_length"] for r in rows) / 12
    assert m["response_length/clip_ratio"] == sum(r["response_length"] == 12 for r in rows) / 12
    assert m["prompt_length/mean"] == sum(len(r["prompt_token_ids"]) for r in rows) / 12
    assert m["prompt_length/max"] == max(len(r["prompt_token_ids"]) for r in rows)
    assert m["prompt_length/clip_ratio"] == 0  # every prompt is well under data.max_prompt_length
    assert m["prompt_length/min"] <= m["prompt_length/mean"] <= m["prompt_length/max"]
    assert any("tokens/s" in line for line in result.summary)
    assert read_manifest(run, 1)["rollout"]["status"] == "done"


def test_rerun_is_skipped_and_a_forced_rerun_reproduces_the_table(run_setup):
    cfg, run, raw = run_setup
    run_rollout(cfg, run, 1)
    first = pq.read_table(run.rollout(1))
    assert run_rollout(cfg, run, 1).skipped
    forced = run_rollout(cfg, run, 1, force=True)
    assert not forced.skipped
    assert pq.read_table(run.rollout(1)).equals(first)
    # a sampling change is a config change of this stage: it reruns without --force
    cooler = small_config(raw, cfg.actor_rollout_ref.model.path, "actor_rollout_ref.rollout.temperature=0.5")
    assert not run_rollout(cooler, run, 1).skipped


def test_iterations_use_their_own_slot_and_seed(run_setup):
    cfg, run, _ = run_setup
    run_rollout(cfg, run, 1)
    run_rollout(cfg, run, 3)  # 2 slots: iteration 3 replays slot 0 with another seed
    one, three = pq.read_table(run.rollout(1)).to_pylist(), pq.read_table(run.rollout(3)).to_pylist()
    assert [r["prompt_id"] for r in one] == [r["prompt_id"] for r in three]
    assert [r["response_token_ids"] for r in one] != [r["response_token_ids"] for r in three]
    run_rollout(cfg, run, 2)
    assert {r["prompt_id"] for r in pq.read_table(run.rollout(2)).to_pylist()} == set(_slot_prompt_ids(run, 1))


def test_rollout_log_probs_are_the_score_stages_old_log_probs_and_pass_into_the_scored_table(run_setup,
                                                                                           tiny_model_dir):
    """The hf engine records each sampled token's log-prob at the rollout temperature, from the
    scores it sampled with (no extra forward); at fp32 it is the score stage's old_log_probs to
    float precision, and the scored table carries the rollout's column unchanged."""
    from rlhf_core.stages.init_critic import run_init_critic
    from rlhf_core.stages.score import run_score

    _, run, raw = run_setup
    cfg = small_config(raw, tiny_model_dir, "actor_rollout_ref.rollout.temperature=0.7")
    run_rollout(cfg, run, 1)
    run_init_critic(cfg, run)
    run_score(cfg, run, 1)
    rollout = pq.read_table(run.rollout(1)).to_pylist()
    scored = pq.read_table(run.scored(1)).to_pylist()
    assert [r["rollout_log_probs"] for r in scored] == [r["rollout_log_probs"] for r in rollout]
    worst = 0.0
    for r in scored:
        assert len(r["rollout_log_probs"]) == r["response_length"] == len(r["old_log_probs"])
        assert all(lp <= 0.0 for lp in r["rollout_log_probs"])
        worst = max([worst] + [abs(a - b) for a, b in zip(r["rollout_log_probs"], r["old_log_probs"])])
    assert worst < 1e-5, worst


def test_offline_import_through_the_stage(run_setup, tmp_path, tiny_model_dir):
    cfg, run, raw = run_setup
    prompts = pq.read_table(run.train_prompts).to_pylist()
    logged = tmp_path / "logged.jsonl"
    logged.write_text("".join(json.dumps(r) + "\n" for r in [
        {"prompt_id": prompts[0]["prompt_id"], "response": "#### 2"},
        {"prompt": decode_extra_info(prompts[1]["extra_info"])["question"], "response": "#### 37"},
        {"prompt_id": "elsewhere-17", "response": "#### 1"},
    ]))
    offline_cfg = small_config(raw, tiny_model_dir, "actor_rollout_ref.rollout.name=offline",
                               f"actor_rollout_ref.rollout.offline_path={logged}")
    result = run_rollout(offline_cfg, run, 1)
    rows = pq.read_table(run.rollout(1)).to_pylist()
    assert [(r["prompt_id"], r["engine"], r["finish_reason"]) for r in rows] == [
        (prompts[0]["prompt_id"], "offline", "offline"), (prompts[1]["prompt_id"], "offline", "offline")]
    assert rows[1]["ground_truth"] == prompts[1]["reward_model"]["ground_truth"]
    assert [r["rollout_log_probs"] for r in rows] == [None, None]  # no engine sampled them
    rejects = pq.read_table(rollout_rejects_path(run, 1))
    assert rejects.schema.equals(REJECTS)
    assert rejects.column("reason").to_pylist() == ["row 2: prompt_id 'elsewhere-17' not in prompts/train.parquet"]
    assert result.rows == {"prompts": 2, "responses": 2, "rejected": 1}
    assert run_rollout(offline_cfg, run, 1).skipped


def test_verl_rows_carry_extra_info_and_reward_source_into_the_rollout_table(tmp_path, tiny_model_dir):
    """A verl-layout Parquet with its own extra_info keys and data.reward_fn_key pointing at another
    column: both reach iter_1/rollout.parquet, and extra_info is queryable there with DuckDB."""
    import pandas as pd

    instruction = 'Let\'s think step by step and output the final answer after "####".'
    rows = [{"data_source": "openai/gsm8k", "task": f"family-{i % 2}",
             "prompt": [{"role": "user", "content": f"Sam has {i} and gets {i + 1}. How many? {instruction}"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * i + 1)},
             "extra_info": {"split": "train", "index": i, "difficulty": "easy" if i < 3 else "hard"}}
            for i in range(6)]
    raw = tmp_path / "train.parquet"
    pd.DataFrame(rows).to_parquet(raw)
    cfg = small_config(raw, tiny_model_dir, "data.reward_fn_key=task")
    run = RunDir(tmp_path / "run")
    write_config(run, to_yaml(cfg))
    run_preprocess(cfg, run)
    run_pack(cfg, run)
    run_rollout(cfg, run, 1)
    table = pq.read_table(run.rollout(1))
    assert table.schema.equals(ROLLOUT) and table.num_rows == 12
    by_index = {decode_extra_info(r["extra_info"])["index"]: r for r in table.to_pylist()}
    assert sorted(by_index) == list(range(6))
    for i, r in by_index.items():
        assert r["reward_source"] == f"family-{i % 2}" and r["data_source"] == "openai/gsm8k"
        assert r["ground_truth"] == str(2 * i + 1)
    con = duckdb.connect()
    hard = con.execute(f"SELECT count(*), count(DISTINCT prompt_id) FROM '{run.rollout(1)}' "
                       f"WHERE extra_info->>'$.difficulty' = 'hard'").fetchone()
    assert hard == (6, 3)  # 3 hard prompts × n=2


def test_missing_inputs_and_iteration_are_clear_errors(tmp_path, tiny_model_dir, repo_root):
    cfg = small_config(repo_root / "data/arith/train.jsonl", tiny_model_dir)
    with pytest.raises(RLHFError, match="--iteration"):
        run_rollout(cfg, RunDir(tmp_path / "run"), None)
    with pytest.raises(DataError, match="rlhf stage preprocess"):
        run_rollout(cfg, RunDir(tmp_path / "run"), 1)


def test_rollout_from_the_cli(run_setup, capsys):
    from rlhf_cli.main import main

    _, run, _ = run_setup
    assert main(["stage", "rollout", "--local", "--run-dir", str(run.root), "--iteration", "1"]) == 0
    out = capsys.readouterr().out
    assert "[rollout iteration 1] done" in out and "tokens/s" in out
    assert pq.read_table(run.rollout(1)).num_rows == 12
    assert main(["stage", "rollout", "--local", "--run-dir", str(run.root), "--iteration", "1"]) == 0
    assert "skipped" in capsys.readouterr().out


@pytest.mark.deepspeed  # torchrun processes: the slow lane
def test_rollout_on_two_processes_equals_one_process(tmp_path, repo_root, tiny_model_dir):
    """trainer.stage_processes=2: the generation batches are dealt to two processes, each batch
    seeded and composed as in one process; the rollout table is the one-process table."""
    raw = tmp_path / "arith.jsonl"
    raw.write_text("".join((repo_root / "data/arith/train.jsonl").read_text().splitlines(True)[:12]))
    cfg = small_config(raw, tiny_model_dir, "actor_rollout_ref.rollout.generation_batch_tokens=260")
    run = RunDir(tmp_path / "run")
    write_config(run, to_yaml(cfg))
    run_preprocess(cfg, run)
    run_pack(cfg, run)
    assert len({r["batch_id"] for r in pq.read_table(run.generation_batches).to_pylist() if r["slot"] == 0}) >= 3
    run_rollout(cfg, run, 1)
    one = pq.read_table(run.rollout(1))
    two = small_config(raw, tiny_model_dir, "actor_rollout_ref.rollout.generation_batch_tokens=260",
                       "trainer.stage_processes=2")
    result = run_rollout(two, run, 1, force=True)
    assert not result.skipped and result.metrics["rollout/num_responses"] == one.num_rows
    assert pq.read_table(run.rollout(1)).equals(one)
    assert not run.stage_ranks_dir(1, "rollout").exists()
