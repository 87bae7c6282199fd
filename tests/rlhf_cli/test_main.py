"""The CLI commands that need no Prefect server: status, query, export (refusal), argument errors."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf_cli.main import build_parser, main
from rlhf_core.io.atomic import atomic_write_json
from rlhf_core.io.checksums import write_checksums
from rlhf_core.run.manifest import path_digest, record_key, record_stage
from rlhf_core.run.migrate import stamp
from rlhf_core.run.lifecycle import commit_iteration as write_last_good
from rlhf_core.run.layout import RunDir, write_config


@pytest.fixture
def run(tmp_path):
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    stamp(run)  # a current run directory: status reports no format upgrade to do
    write_config(run, "trainer:\n  export_min_val_score: 0.5\n")
    for k in (1, 2):
        for stage in ("rollout", "score", "gae", "update", "guard"):
            record_stage(run, k, stage, status="done", inputs={}, outputs={}, config_hash="h")
        # validation's table as the stage writes and records it: the export gate scores it (k/4 correct)
        table = run.validation(k)
        table.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"correct": [i < k for i in range(4)]}), table)
        record_stage(run, k, "validate", status="done", inputs={}, config_hash="h",
                     outputs={record_key(run, table): path_digest(run, table)})
        atomic_write_json(run.metrics(k), {"reward/mean": 0.1 * k, "kl/mean": 0.01, "val/accuracy": 0.25 * k})
    run.checkpoint(1).joinpath("actor").mkdir(parents=True)
    write_checksums(run.checkpoint(1))  # sealed, as the update seals it: status and export verify it
    write_last_good(run, 1)
    return run


def test_every_command_is_registered():
    parser = build_parser()
    for argv in (["run", "--resume", "x"], ["demo"], ["status", "r"], ["query", "r", "SELECT 1"], ["export", "r"],
                 ["stage", "guard", "--run-dir", "r", "-k", "2"], ["stage", "validate", "--run-dir", "r", "-k", "1"]):
        assert parser.parse_args(argv).command == argv[0]


def test_status(run, capsys):
    assert main(["status", str(run.root)]) == 0
    out = capsys.readouterr().out
    assert "last-good: iteration 1 (iter_1/checkpoint)" in out
    assert "committed" in out and "setup: warm_start -, init_critic -, preprocess -, pack -" in out


def test_query(run, capsys, tmp_path):
    csv = tmp_path / "out.csv"
    sql = "SELECT iteration, value FROM metrics WHERE name = 'val/accuracy' ORDER BY 1"
    assert main(["query", str(run.root), sql, "--csv", str(csv)]) == 0
    out = capsys.readouterr().out
    assert "(2 rows)" in out and "0.25" in out
    assert csv.read_text().splitlines()[0] == '"iteration","value"'


def test_query_keeps_a_response_with_line_breaks_on_its_row(run, capsys):
    """Issue 43: a newline inside a cell (a sampled response) started a new line of the table."""
    sql = "SELECT 1 AS iteration, 'first' || chr(10) || 'second' || chr(9) || 'x' AS response"
    assert main(["query", str(run.root), sql]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2].split() == ["1", "first\\nsecond\\tx"] and out[3] == "(1 row)", out


def test_bad_sql_names_the_views(run, capsys):
    assert main(["query", str(run.root), "SELECT * FROM nope"]) == 2
    err = capsys.readouterr().err
    assert "query failed" in err and "rollouts, scored" in err


def test_export_refuses_with_the_score(run, capsys):
    assert main(["export", str(run.root)]) == 2
    err = capsys.readouterr().err
    # iteration 2 is not committed: its validation (0.5) does not count
    assert "latest validation accuracy 0.2500 (iteration 1)" in err and "export_min_val_score=0.5" in err
    assert not (run.root / "export").exists()


def test_not_a_run_directory(tmp_path, capsys):
    assert main(["status", str(tmp_path)]) == 2
    assert "not a run directory" in capsys.readouterr().err


def test_core_and_the_cli_module_import_neither_prefect_nor_mlflow():
    """Layering: rlhf_core never imports prefect or mlflow; the CLI loads flows only inside the
    commands that run them, so `rlhf status`/`query`/`--help` stay fast."""
    import subprocess
    import sys

    code = ("import sys, rlhf_cli.main, rlhf_core.stages.guard, rlhf_core.control.query, rlhf_core.control.export, rlhf_core.control.plan, "
            "rlhf_core.stages.validate; rlhf_cli.main.build_parser(); "
            "print(sorted(m for m in ('prefect', 'mlflow', 'tasks', 'flows') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_run_ends_by_saying_where_to_look(tmp_path, monkeypatch):
    from rlhf_cli.orchestrated import where_to_look

    monkeypatch.setenv("RLHF_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    assert "learning curve  none" in where_to_look({"run_dir": str(tmp_path / "run"), "mlflow_run_id": None})
    (tmp_path / "run" / "plots").mkdir(parents=True)
    (tmp_path / "run" / "plots" / "learning_curve.png").write_bytes(b"png")
    text = where_to_look({"run_dir": str(tmp_path / "run"), "mlflow_run_id": "abc123"})
    assert f"run directory   {tmp_path / 'run'}" in text
    assert str(tmp_path / "run" / "plots" / "learning_curve.png") in text
    assert f"--backend-store-uri sqlite:///{tmp_path / 'home' / 'mlflow' / 'mlflow.db'}" in text and "abc123" in text
    assert "(then http://127.0.0.1:5000/#/experiments" in text and "?workflowType=machine_learning)" in text
    assert "make services-up" in text  # the demo's temporary Prefect server is gone by now

    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")
    assert "Prefect UI      http://127.0.0.1:4200/runs" in where_to_look({"run_dir": "r", "mlflow_run_id": "x"})
    assert "not tracked (trainer.logger has no mlflow)" in where_to_look({"run_dir": "r", "mlflow_run_id": None})


# ---------------------------------------------------------------------------------------------
# through the real entry point (a subprocess): user errors are one line, before any work
# ---------------------------------------------------------------------------------------------


def _rlhf(tmp_path, *args: str, timeout: float = 600):  # a bound on a hang, not a speed goal: a loaded CI machine took >120 s
    """Run the installed `rlhf` console script with a private state directory."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env["RLHF_HOME"] = str(tmp_path / "home")
    exe = shutil.which("rlhf", path=str(Path(sys.executable).parent)) or "rlhf"
    return subprocess.run([exe, *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=timeout)


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("rlhf: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def test_run_with_an_unknown_key_fails_before_any_work(tmp_path):
    out = _rlhf(tmp_path, "run", "trainer.total_epochz=3", f"trainer.runs_root={tmp_path / 'runs'}")
    assert out.returncode == 2
    line = _one_error_line(out.stderr)
    assert "unknown config key 'trainer.total_epochz'" in line and "trainer.total_epochs" in line
    assert not (tmp_path / "runs").exists() and not (tmp_path / "home" / "prefect").exists()


def test_verl_quickstart_with_missing_data_fails_before_any_work_and_config_show_agrees(tmp_path, verl_quickstart):
    overrides = verl_quickstart(train=str(tmp_path / "gsm8k" / "train.parquet"),
                                val=str(tmp_path / "gsm8k" / "test.parquet"), model="tiny")
    run = _rlhf(tmp_path, "run", *overrides, f"trainer.runs_root={tmp_path / 'runs'}")
    assert run.returncode == 2
    line = _one_error_line(run.stderr)
    assert "data.train_files" in line and "data.val_files" in line and "train.parquet" in line
    assert not (tmp_path / "runs").exists() and not (tmp_path / "home" / "prefect").exists()
    show = _rlhf(tmp_path, "config", "show", *overrides)
    assert show.returncode == 2 and _one_error_line(show.stderr) == line


def test_config_notes_print_once_each_as_one_line(tmp_path):
    out = _rlhf(tmp_path, "config", "show", "--flat", "trainer.logger=[console,wandb]",
                "actor_rollout_ref.actor.max_grad_norm=0.5")  # a renamed verl key: its note too
    assert out.returncode == 0, out.stderr
    notes = [line for line in out.stderr.splitlines() if line.strip()]
    assert all(line.startswith("rlhf: config: ") for line in notes), notes
    assert sum("wandb not available here" in line for line in notes) == 1
    assert sum("max_grad_norm is read as" in line for line in notes) == 1
    assert "WARNING" not in out.stderr
    assert "trainer.logger=['console', 'wandb']" in out.stdout


def test_a_logger_list_without_mlflow_says_once_that_mlflow_is_off(tmp_path):
    """Issue 43: docs/verl.md promised this note for verl's quickstart (trainer.logger=console); none came."""
    out = _rlhf(tmp_path, "config", "show", "--flat", "trainer.logger=console")
    assert out.returncode == 0, out.stderr
    notes = [line for line in out.stderr.splitlines() if line.strip()]
    assert notes == ["rlhf: config: trainer.logger=console leaves MLflow off: no MLflow run; metrics go to console "
                     "and the run directory (trainer.logger=[console,mlflow] tracks it too)"], notes
    both = _rlhf(tmp_path, "config", "show", "--flat", "trainer.logger=[console,mlflow]")
    assert both.returncode == 0 and "MLflow" not in both.stderr, both.stderr


def test_a_hub_id_missing_for_actor_and_critic_is_said_once(tmp_path):
    """Issue 43: verl's quickstart names the same hub id for the actor and the critic; its ~500-character
    advice came twice in one line."""
    hub = "Qwen/Qwen2.5-0.5B-Instruct"
    out = _rlhf(tmp_path, "config", "show", f"actor_rollout_ref.model.path={hub}", f"critic.model.path={hub}")
    assert out.returncode == 2
    line = _one_error_line(out.stderr)
    assert f"actor_rollout_ref.model.path, critic.model.path: model '{hub}' is not a local directory" in line, line
    assert line.count("huggingface-cli download") == 1, line


def test_demo_takes_iterations_as_run_does():
    """Issue 29: `rlhf demo` had no --iterations (`rlhf run` has)."""
    from rlhf_cli.inspection import GRPO_DEMO, demo_as_run
    from rlhf_cli.main import parse_args

    run = demo_as_run(parse_args(["demo", "--iterations", "2", "--grpo", "trainer.test_freq=1"]))
    assert (run.command, run.iterations, run.resume) == ("run", 2, None) and run.preset.endswith("configs/demo.yaml")
    assert run.overrides == [*GRPO_DEMO, "trainer.test_freq=1"]


def test_overrides_may_follow_options():
    from rlhf_cli.main import parse_args

    args = parse_args(["run", "a.b=1", "--iterations", "2", "trainer.val_before_train=false"])
    assert args.overrides == ["a.b=1", "trainer.val_before_train=false"] and args.iterations == 2
    with pytest.raises(SystemExit):
        parse_args(["run", "--iterations", "2", "--bogus"])
    with pytest.raises(SystemExit):
        parse_args(["status", "r", "a.b=1"])  # status takes no overrides
