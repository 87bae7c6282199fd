"""The preprocess stage on the real GSM8K train split (7,473 rows) and on small files: counts, the
manifest skip, --force, the CLI, and the errors a user sees."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rlhf_core.config import apply_overrides, load_config
from rlhf_core.data.outcome import NoPromptsError
from rlhf_core.errors import DataError
from rlhf_core.run.manifest import read_manifest
from rlhf_core.run.layout import RunDir
from rlhf_core.stages.preprocess import run_preprocess

GSM8K_ROWS = 7473
NUMBER = re.compile(r"-?\d+(\.\d+)?")


def gsm8k_overrides(gsm8k_train, tiny_model_dir) -> list[str]:
    return [f"data.train_files=[{gsm8k_train}]", f"actor_rollout_ref.model.path={tiny_model_dir}"]


@pytest.fixture(scope="module")
def gsm8k_run(tmp_path_factory, gsm8k_train, tiny_model_dir, repo_root):
    cfg = load_config(repo_root / "configs" / "gsm8k.yaml", gsm8k_overrides(gsm8k_train, tiny_model_dir))
    run = RunDir(tmp_path_factory.mktemp("gsm8k_run"))
    return cfg, run, run_preprocess(cfg, run)


def test_gsm8k_every_row_accounted_for_with_numeric_truths(gsm8k_run, gsm8k_train):
    cfg, run, result = gsm8k_run
    assert not result.skipped
    rows = result.rows
    assert rows["input"] == GSM8K_ROWS
    assert rows["train"] + rows["val"] + rows["rejected"] == GSM8K_ROWS
    assert rows["val"] == 256 and cfg.data.max_val_samples == -1  # 10 % of 7,473: a split holds at most 256
    train, val, rejects = (pq.read_table(p) for p in (run.train_prompts, run.val_prompts, run.rejects))
    assert (train.num_rows, val.num_rows, rejects.num_rows) == (rows["train"], rows["val"], rows["rejected"])
    # every row is somewhere exactly once: accepted source rows and rejected source rows partition 0..N-1
    accepted = train.column("source_row").to_pylist() + val.column("source_row").to_pylist()
    assert sorted(accepted + rejects.column("source_row").to_pylist()) == list(range(GSM8K_ROWS))
    assert all(r.startswith("prompt too long") for r in rejects.column("reason").to_pylist())
    assert max(train.column("prompt_length").to_pylist()) <= cfg.data.max_prompt_length
    source = gsm8k_train.read_text().splitlines()
    for record in train.to_pylist()[:: 97]:
        truth = record["reward_model"]["ground_truth"]
        assert NUMBER.fullmatch(truth), truth
        raw = json.loads(source[record["source_row"]])
        assert truth == raw["answer"].rsplit("####", 1)[1].strip().replace(",", "")
        assert json.loads(record["extra_info"])["question"] == raw["question"]
    assert all(NUMBER.fullmatch(t["ground_truth"]) for t in train.column("reward_model").to_pylist())
    assert len(set(train.column("prompt_id").to_pylist() + val.column("prompt_id").to_pylist())) == (
        rows["train"] + rows["val"])
    assert any(line.startswith("prompt length (tokens): min") for line in result.summary)
    assert result.metrics["data/prompt_length_max"] <= cfg.data.max_prompt_length
    assert result.metrics["data/prompts_truncated"] == 0
    assert any(line.endswith("rows (gsm8k layout)") for line in result.summary)  # what adapter 'auto' picked


def _cli(args: list[str]) -> subprocess.CompletedProcess:
    rlhf = Path(sys.executable).with_name("rlhf")
    command = [str(rlhf)] if rlhf.is_file() else [sys.executable, "-m", "rlhf_cli.main"]
    return subprocess.run(command + args, capture_output=True, text=True, env=dict(os.environ), timeout=300)


def test_rerun_is_skipped_and_cli_force_reruns_identically(gsm8k_run, gsm8k_train, tiny_model_dir, repo_root):
    """Second run in-process: skipped by the manifest. Through the CLI: skipped again, then --force
    recomputes everything from scratch and must reproduce the same counts and the same split."""
    cfg, run, first = gsm8k_run
    val_before = pq.read_table(run.val_prompts).column("prompt_id").to_pylist()
    train_before = pq.read_table(run.train_prompts).column("prompt_id").to_pylist()
    again = run_preprocess(cfg, run)
    assert again.skipped and again.rows == first.rows
    args = ["stage", "preprocess", "--run-dir", str(run.root), "-c", str(repo_root / "configs" / "gsm8k.yaml"),
            *gsm8k_overrides(gsm8k_train, tiny_model_dir)]
    skipped = _cli(args)
    assert skipped.returncode == 0, skipped.stderr[-2000:]
    assert "[preprocess] skipped (up to date)" in skipped.stdout
    forced = _cli(args + ["--force"])
    assert forced.returncode == 0, forced.stderr[-2000:]
    r = first.rows
    assert "[preprocess] done in" in forced.stdout
    assert f"rows in: {GSM8K_ROWS} = train {r['train']} + val {r['val']} + rejected {r['rejected']}" in forced.stdout
    assert pq.read_table(run.val_prompts).column("prompt_id").to_pylist() == val_before
    assert pq.read_table(run.train_prompts).column("prompt_id").to_pylist() == train_before
    assert read_manifest(run, None)["preprocess"]["rows"] == first.rows


# ---------------------------------------------------------------------------------------------
# small files
# ---------------------------------------------------------------------------------------------


def _small_cfg(tmp_path, tiny_model_dir, rows, *extra):
    path = tmp_path / "raw.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_config(None, [f"data.train_files=[{path}]", f"actor_rollout_ref.model.path={tiny_model_dir}",
                              *extra])


def test_config_change_reruns_and_unrelated_change_does_not(tmp_path, tiny_model_dir, repo_root):
    rows = [json.loads(line) for line in (repo_root / "data/arith/train.jsonl").read_text().splitlines()[:60]]
    run = RunDir(tmp_path / "run")
    cfg = _small_cfg(tmp_path, tiny_model_dir, rows)
    first = run_preprocess(cfg, run)
    assert first.rows == {"input": 60, "train": 54, "val": 6, "rejected": 0}
    assert first.outputs["train"] == str(run.train_prompts)
    assert run_preprocess(apply_overrides(cfg, ["algorithm.gamma=0.9"]), run).skipped
    reseeded = run_preprocess(apply_overrides(cfg, ["data.seed=7"]), run)
    assert not reseeded.skipped and reseeded.rows == first.rows
    assert not run_preprocess(apply_overrides(cfg, ["data.seed=7"]), run, force=True).skipped


def test_nothing_accepted_is_an_error_that_points_at_the_rejects(tmp_path, tiny_model_dir):
    cfg = _small_cfg(tmp_path, tiny_model_dir, [{"question": "Q?", "answer": "no number"},
                                                {"question": " ", "answer": "#### 1"}])
    run = RunDir(tmp_path / "run")
    expected = (r"no train prompts accepted .*no #### number 1, empty question 1; e\.g\. .* row 0: .*; every "
                r"rejected row and its reason: rlhf query .* FROM rejects")
    with pytest.raises(NoPromptsError, match=expected) as raised:
        run_preprocess(cfg, run)
    assert pq.read_table(run.rejects).num_rows == 2
    assert not run.train_prompts.exists()
    assert isinstance(raised.value, DataError) and raised.value.rows["rejected"] == 2  # the caller's headline


def test_overlong_prompt_stops_the_stage_unless_filtered_or_cut(tmp_path, tiny_model_dir):
    """verl's defaults (filter_overlong_prompts=false, truncation=error) stop on the first overlong
    row with one line; truncation=left cuts it and the manifest counts the cut prompts."""
    rows = [{"question": "Sam has 2 pens and gets 3 more. How many?", "answer": "#### 5"},
            {"question": "pens " * 300 + "How many?", "answer": "#### 1"}]
    run = RunDir(tmp_path / "run")
    cfg = _small_cfg(tmp_path, tiny_model_dir, rows, "data.val_fraction=0.0", "data.max_prompt_length=128")
    with pytest.raises(DataError, match=r"raw\.jsonl row 1: prompt is \d+ tokens .*data\.filter_overlong_prompts=true"):
        run_preprocess(cfg, run)
    cut = run_preprocess(apply_overrides(cfg, ["data.truncation=left"]), run)
    assert cut.rows == {"input": 2, "train": 2, "val": 0, "rejected": 0}
    assert read_manifest(run, None)["preprocess"]["metrics"]["data/prompts_truncated"] == 1
    assert pq.read_table(run.train_prompts).column("prompt_tokens_cut").to_pylist()[0] == 0
    filtered = run_preprocess(apply_overrides(cfg, ["data.filter_overlong_prompts=true"]), run)
    assert filtered.rows == {"input": 2, "train": 1, "val": 0, "rejected": 1, "rejected/prompt too long": 1}


def test_missing_file_names_the_key_and_the_file(tmp_path, tiny_model_dir):
    cfg = load_config(None, [f"data.train_files=[{tmp_path / 'nope.jsonl'}]",
                             f"actor_rollout_ref.model.path={tiny_model_dir}"])
    with pytest.raises(DataError, match=r"data\.train_files: file\(s\) not found: .*nope\.jsonl"):
        run_preprocess(cfg, RunDir(tmp_path / "run"))


# ---------------------------------------------------------------------------------------------
# issue 29: too little left to train on (the run refuses after preprocess: rlhf_core.control.plan)
# ---------------------------------------------------------------------------------------------


def _rows(train: int, val: int, **rejected: int) -> dict[str, int]:
    reasons = {f"rejected/{kind.replace('_', ' ')}": n for kind, n in rejected.items()}
    return {"input": train + val + sum(rejected.values()), "train": train, "val": val,
            "rejected": sum(rejected.values()), **reasons}


BATCH_8 = ("data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8")


@pytest.mark.parametrize("rows, overrides, words", [
    (_rows(2, 0, prompt_too_long=196, duplicate=2), [],
     ["accepted 1.0% of the rows, under data.min_accepted_fraction=0.5", "prompt too long 196, duplicate 2",
      'rlhf query RUN "SELECT reason, count(*)', "raise data.max_prompt_length=512"]),
    (_rows(2, 0, prompt_too_long=196, duplicate=2), ["data.min_accepted_fraction=0"],
     ["2 train prompts are fewer than one training batch (data.train_batch_size=1024",
      "lower data.train_batch_size to at most 2"]),
    (_rows(40, 0), [*BATCH_8], ["the run validates", "no validation prompt was accepted",
                                                 "data.val_files=[...]", "trainer.test_freq=-1"]),
    # capped rows are sampling asked for, not data lost: 10 accepted of 1000 read is no problem here
    (_rows(8, 2, over_validation_cap=990), [*BATCH_8], None),
    (_rows(40, 0), [*BATCH_8, "trainer.val_before_train=false"], None),
    (_rows(1, 1), ["trainer.val_only=true"], None),  # validation only: no training batch needed
])
def test_a_run_refuses_too_little_to_train_on(rows, overrides, words):
    from rlhf_core.control.plan import supply_problem
    from rlhf_core.data.outcome import rejects_query

    cfg = load_config(None, overrides)
    problem = supply_problem(cfg, rows, rejects_query("RUN"))
    if words is None:
        assert problem is None
    else:
        assert problem is not None and all(w in problem for w in words), problem


def test_the_preprocess_record_counts_rejects_by_reason_for_the_console_line(tmp_path, tiny_model_dir):
    from rlhf_core.data.outcome import preprocess_headline

    rows = [{"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(3)]
    rows += [{"question": "pens " * 300, "answer": "#### 1"}, {"question": "What is 0 + 1?", "answer": "#### 1"}]
    run = RunDir(tmp_path / "run")
    result = run_preprocess(_small_cfg(tmp_path, tiny_model_dir, rows, "data.val_fraction=0.0",
                                       "data.max_prompt_length=128", "data.filter_overlong_prompts=true"), run)
    recorded = read_manifest(run, None)["preprocess"]["rows"]
    assert recorded == result.rows == {"input": 5, "train": 3, "val": 0, "rejected": 2,
                                       "rejected/prompt too long": 1, "rejected/duplicate": 1}
    line = preprocess_headline(recorded, run.root)
    assert line.startswith("preprocess: 5 rows -> train 3, validation 0, rejected 2 (duplicate 1, prompt too long 1)")
    assert f'rlhf query {run.root} "SELECT reason, count(*) AS n FROM rejects' in line
