"""Bad data with the demo preset, through the `rlhf` console script: each problem with the file ends
in one `rlhf: error:` line from preprocess naming the file, the problem and the fix (no Prefect
traceback, no 'Finished in state Failed'), after the preprocess line with its counts; and the run
directory it leaves is taken over by the same command once the data is fixed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.prefect, pytest.mark.slow]

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"

SMALL = ["data.train_batch_size=4", "data.max_val_samples=4", "data.max_response_length=12",
         "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
         "trainer.device=cpu", "trainer.export_min_val_score=0.0"]


def _rlhf(tmp_path: Path, prefect_server: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env["RLHF_HOME"], env["PREFECT_API_URL"] = str(tmp_path / "home"), prefect_server
    exe = shutil.which("rlhf", path=str(Path(sys.executable).parent)) or "rlhf"
    return subprocess.run([exe, *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)


def _demo_run(tmp_path: Path, prefect_server: str, data: Path, *extra: str) -> subprocess.CompletedProcess:
    """`rlhf run -c configs/demo.yaml` (its shipped model, no warm start) on ``data``, shrunk to one iteration."""
    return _rlhf(tmp_path, prefect_server, "run", "-c", str(DEMO), f"data.train_files=[{data}]", *SMALL,
                 f"trainer.runs_root={tmp_path / 'runs'}", "--iterations", "1", "--run-name", "bad", *extra)


def _refusal(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("rlhf: error:")]
    assert len(errors) == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "Finished in state Failed" not in out.stderr, out.stderr[-3000:]
    assert "ERROR" not in out.stderr and "warm start" not in out.stderr, out.stderr[-3000:]
    return errors[0]


CASES = {
    "empty": ("", ["no rows to read (empty)", '{"question": "...", "answer": "... #### 42"}']),
    "other-keys": ("".join(json.dumps({"q": f"What is {i} + 1?", "a": str(i + 1)}) + "\n" for i in range(5)),
                   ["no row has the fields data.adapter=gsm8k reads", "its rows have 'q', 'a'",
                    "data.question_key=q data.answer_key=a"]),
    "not-json": ("hello, this is not JSON\nnor is this\n",
                 ["no row could be read as a record", "malformed JSON", "one JSON object per line"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_data_with_the_demo_preset_is_one_line_before_the_run_starts(tmp_path, prefect_server, repo_root, case):
    """The plan reads the data before anything starts (issue 50): one line naming the file, nothing on
    stdout, no run directory, no wait for torch, Prefect or MLflow to load."""
    text, said = CASES[case]
    data = tmp_path / f"{case}.jsonl"
    data.write_text(text)
    out = _demo_run(tmp_path, prefect_server, data)
    error = _refusal(out)
    assert str(data) in error and all(s in error for s in said), error
    assert out.stdout == "" and "starting:" not in out.stderr, out.stdout[-2000:] + out.stderr[:2000]
    assert not (tmp_path / "runs").exists()
    if case == "other-keys":  # the same command once the data is fixed runs
        good = (repo_root / "data" / "arith" / "demo.jsonl").read_text().splitlines()[:40]
        data.write_text("\n".join(good) + "\n")
        again = _demo_run(tmp_path, prefect_server, data)
        assert again.returncode == 0, again.stderr[-3000:]
        assert (tmp_path / "runs" / "bad" / "iter_1").is_dir()
        assert "preprocess: 40 rows -> train 36" in again.stdout, again.stdout[-2000:]


def test_a_run_directory_that_trained_is_still_refused(tmp_path, prefect_server, repo_root):
    """Only a directory whose run never reached an iteration is taken over."""
    run = tmp_path / "runs" / "bad"
    (run / "iter_1").mkdir(parents=True)
    (run / "config.yaml").write_text("data: {}\n")
    out = _demo_run(tmp_path, prefect_server, repo_root / "data" / "arith" / "demo.jsonl")
    assert out.returncode == 2 and "already exists" in out.stderr, out.stderr[-3000:]
    assert (run / "iter_1").is_dir()
