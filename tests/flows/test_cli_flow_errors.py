"""A user error raised inside the flow (here: no acceptable training prompt, found by preprocess)
reaches the terminal of `rlhf run` as one line: no Prefect traceback, no 'Finished in state Failed'."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.prefect, pytest.mark.slow]


def test_a_data_error_inside_the_flow_is_one_line(tmp_path, demo_preset, tiny_model_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps({"question": f"What is {i} + 1?"}) + "\n" for i in range(5)))  # no answers
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env["RLHF_HOME"] = str(tmp_path / "home")
    exe = shutil.which("rlhf", path=str(Path(sys.executable).parent)) or "rlhf"
    out = subprocess.run([exe, "run", "-c", demo_preset, f"data.train_files=[{bad}]",
                          f"actor_rollout_ref.model.path={tiny_model_dir}",
                          "actor_rollout_ref.model.warm_start.enable=false", f"trainer.runs_root={tmp_path / 'runs'}"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("rlhf: error:")]
    assert len(errors) == 1 and "no train prompts accepted" in errors[0] and "rejects.parquet" in errors[0]
    assert "Traceback" not in out.stderr and "Finished in state Failed" not in out.stderr, out.stderr[-3000:]
    assert "ERROR" not in out.stderr, out.stderr[-3000:]
