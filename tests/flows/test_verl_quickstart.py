"""verl's GSM8K PPO quickstart, its 25 overrides verbatim (only the paths changed), through the real
`rlhf run` entry point for one training step on CPU: verl-format Parquet written the way verl's
examples/data_preprocess/gsm8k.py writes it, the tiny model in place of Qwen2.5-0.5B, a real Prefect
server, DeepSpeed on CPU. Then the run is checked for verl's meanings: 256 prompts per step, 64-prompt
mini-batches, the vLLM fall-back said once, verl's metric names."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytestmark = [pytest.mark.prefect, pytest.mark.slow, pytest.mark.deepspeed]

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def verl_gsm8k_rows(raw: list[dict], split: str) -> list[dict]:
    """Rows as verl's gsm8k.py makes them: one user message (question + instruction), the number after
    '#### ' with commas removed as ground truth, extra_info with split/index/answer/question."""
    rows = []
    for index, example in enumerate(raw):
        solution = re.search(r"#### (\-?[0-9\.\,]+)", example["answer"]).group(1).replace(",", "")
        rows.append({
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": example["question"] + " " + INSTRUCTION}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": solution},
            "extra_info": {"split": split, "index": index, "answer": example["answer"],
                           "question": example["question"]},
        })
    return rows


def write_verl_parquet(rows: list[dict], path: Path) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture(scope="module")
def verl_files(repo_root, tmp_path_factory):
    """train.parquet (300 prompts: one 256-prompt step) and test.parquet (16) from the embedded data."""
    out = tmp_path_factory.mktemp("gsm8k")
    lines = (repo_root / "data" / "arith" / "train.jsonl").read_text().splitlines()
    raw = [json.loads(line) for line in lines[:316]]
    train = write_verl_parquet(verl_gsm8k_rows(raw[:300], "train"), out / "train.parquet")
    test = write_verl_parquet(verl_gsm8k_rows(raw[300:], "test"), out / "test.parquet")
    return train, test


@pytest.fixture(scope="module")
def quickstart_run(prefect_server, verl_files, verl_quickstart, tiny_model_dir, tmp_path_factory):
    train, test = verl_files
    work = tmp_path_factory.mktemp("qs")
    overrides = verl_quickstart(train=str(train), val=str(test), model=str(tiny_model_dir))
    env = {**os.environ, "PREFECT_API_URL": prefect_server, "RLHF_HOME": str(work / ".rlhf")}
    cmd = [sys.executable, "-m", "rlhf_cli.main", "run", *overrides, "trainer.total_training_steps=1",
           f"trainer.runs_root={work / 'runs'}", "--run-name", "quickstart"]
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=1500)
    return proc, work / "runs" / "quickstart"


def test_quickstart_runs_one_step(quickstart_run):
    proc, run_dir = quickstart_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert json.loads((run_dir / "last_good.json").read_text())["iteration"] == 1
    assert not (run_dir / "iter_2").exists()


def test_quickstart_says_what_fell_back_once(quickstart_run):
    proc, _ = quickstart_run
    said = proc.stderr.count("rollout.name=vllm needs a CUDA GPU")
    assert said == 1, proc.stderr[-3000:]
    assert proc.stderr.count("trainer.logger=console leaves MLflow off") == 1, proc.stderr[-3000:]  # docs/verl.md


def test_quickstart_has_verl_meanings(quickstart_run):
    _, run_dir = quickstart_run
    rollout = pq.read_table(run_dir / "iter_1" / "rollout.parquet")
    assert rollout.num_rows == 256  # data.train_batch_size prompts × rollout.n (1)
    assert set(rollout.column("engine").to_pylist()) == {"hf"}
    assert max(rollout.column("response_length").to_pylist()) <= 512
    metrics = json.loads((run_dir / "iter_1" / "iteration_metrics.json").read_text())
    # 256 prompts in mini-batches of 64 prompts: 4 optimizer steps per epoch, as in verl
    assert metrics["actor/num_steps"] == 4.0
    for name in ("critic/score/mean", "critic/rewards/mean", "critic/advantages/mean", "actor/pg_loss",
                 "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm", "critic/vf_loss",
                 "critic/vf_clipfrac", "response_length/mean", "timing_s/gen"):
        assert name in metrics, name
