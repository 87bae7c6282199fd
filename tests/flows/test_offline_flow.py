"""A run whose training responses are imported (rollout.name=offline) goes through the whole flow:
validation generates with the hf engine, saying so, and a logged reward column is named as unused
(the score stage scores every response with the run's reward function)."""

from __future__ import annotations

import json

import pytest

from rlhf_cli.main import main
from rlhf_core.notes import said
from rlhf_core.run.layout import RunDir
from rlhf_core.run.lifecycle import read_last_good

pytestmark = [pytest.mark.prefect, pytest.mark.deepspeed]


def test_an_offline_run_validates_with_hf_and_names_the_unused_reward(prefect_server, demo_preset, tiny_overrides,
                                                                      repo_root, tmp_path, capsys):
    problems = [json.loads(line) for line in (repo_root / "data" / "arith" / "demo.jsonl").read_text().splitlines()]
    offline = tmp_path / "logged.jsonl"
    offline.write_text("".join(json.dumps({"prompt": p["question"], "response": p["answer"], "reward": 1.0}) + "\n"
                               for p in problems[:8]))
    runs = tmp_path / "runs"
    code = main(["run", "-c", demo_preset, *tiny_overrides(runs, "actor_rollout_ref.rollout.name=offline",
                                                           f"actor_rollout_ref.rollout.offline_path={offline}"),
                 "--iterations", "1", "--run-name", "off"])
    err = capsys.readouterr().err
    assert code == 0, err[-3000:]
    run = RunDir(runs / "off")
    assert read_last_good(run)["iteration"] == 1 and run.validation(0).is_file()
    notes = " ".join(said())  # each said once per process: maybe by an earlier test
    assert "validation generates with the hf engine" in notes and "reward column is not used" in notes
