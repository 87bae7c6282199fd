"""`rlhf status`: "-" where a value was not measured (never SQL's NULL), and the validation score
beside the validation accuracy."""

from __future__ import annotations

from rlhf_cli.main import main
from rlhf_core.config import load_config, to_yaml
from rlhf_core.run.layout import RunDir, write_config
from rlhf_core.run.manifest import record_stage
from rlhf_core.run.report import iteration_metrics


def test_status_shows_dashes_and_the_validation_score(tmp_path, capsys):
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    cfg = load_config(None, [])
    write_config(run, to_yaml(cfg))
    for k in (1, 2):
        record_stage(run, k, "rollout", status="done", inputs={}, outputs={}, config_hash="h",
                     metrics={"reward/mean": 0.25 * k}, seconds=1.0)
    record_stage(run, 2, "validate", status="done", inputs={}, outputs={}, config_hash="h",
                 metrics={"val/accuracy": 0.5, "val/reward_mean": 0.625}, seconds=1.0)
    for k in (1, 2):
        iteration_metrics(cfg.data, run, k)  # what finish-iteration writes: the metrics status reads
    assert main(["status", str(run.root)]) == 0
    out = capsys.readouterr().out
    assert "NULL" not in out
    header, _, first, second = out.splitlines()[2:6]
    names = header.split()
    assert names[names.index("val_acc") + 1] == "val_score"
    cells = dict(zip(names, first.split())), dict(zip(names, second.split()))
    assert (cells[0]["val_acc"], cells[0]["val_score"], cells[0]["kl"]) == ("-", "-", "-")
    assert (cells[1]["val_acc"], cells[1]["val_score"], cells[1]["reward"]) == ("0.5", "0.625", "0.5")


def test_status_after_ctrl_c_advises_the_resume_not_a_stage_rerun(tmp_path, capsys):
    """Issue 29: Ctrl-C right after iteration 3 began (only its KL controller snapshot written) made
    `rlhf status` report a problem and advise `rlhf stage <stage> ... --iteration 3`, while the
    interrupt line said `rlhf run --resume`, which is what continues the run."""
    from rlhf_core.io.checksums import write_checksums
    from rlhf_core.run.lifecycle import commit_iteration

    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    write_config(run, to_yaml(load_config(None, [])))
    for k in (1, 2):
        for stage in ("rollout", "score", "gae", "update", "guard"):
            record_stage(run, k, stage, status="done", inputs={}, outputs={}, config_hash="h")
        run.checkpoint(k).joinpath("actor").mkdir(parents=True)
        write_checksums(run.checkpoint(k))  # a sealed checkpoint, as the update leaves it
        commit_iteration(run, k)
    run.iter_dir(3).mkdir()
    run.rollout(3).write_bytes(b"PAR1")  # iteration 3 began: its rollout was being written when Ctrl-C came
    assert main(["status", str(run.root)]) == 0
    out = capsys.readouterr().out
    assert "problem:" not in out and "rlhf stage" not in out, out
    assert "last-good: iteration 2 (iter_2/checkpoint)" in out
    assert (f"not committed: iteration 3 (running, or stopped before its commit); `rlhf run --resume {run.root}` "
            "continues from last-good") in out


def test_a_reader_that_goes_away_is_a_clean_exit(tmp_path):
    """Issue 49, 10: `rlhf … | head -3` died of BrokenPipeError tracebacks with status 1. With its
    reader gone before the first line, `rlhf status` ends as it would have: status 0, nothing on
    stderr but its own lines."""
    import subprocess
    import sys

    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    cfg = load_config(None, [])
    write_config(run, to_yaml(cfg))
    for k in range(1, 40):
        record_stage(run, k, "rollout", status="done", inputs={}, outputs={}, config_hash="h",
                     metrics={"reward/mean": 0.01 * k}, seconds=1.0)
        iteration_metrics(cfg.data, run, k)
    shell = f"{sys.executable} -m rlhf_cli.main status {run.root} | true; echo ${{PIPESTATUS[0]}} >&2"
    out = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.splitlines()[-1] == "0", out.stderr[-3000:]


def test_status_names_a_newer_format_and_a_damaged_retry_record(tmp_path, capsys):
    """Issue 49, 11: `rlhf status` said nothing about a format.json from a newer version or a damaged
    retry.json, on which every writing command refuses."""
    import json

    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    write_config(run, to_yaml(load_config(None, [])))
    run.iter_dir(1).mkdir(parents=True)
    run.retry_record(1).write_text(json.dumps({"attempt": 1, "kl_coef_scale": "two"}))
    assert main(["status", str(run.root)]) == 0
    problems = [line for line in capsys.readouterr().out.splitlines() if line.startswith("problem:")]
    assert problems == [f"problem: {run.retry_record(1)} is damaged (its 'kl_coef_scale' is 'two', not a number > 0); "
                        "delete it to run iteration 1 with the controller's own KL coefficient"]
    run.format_path.write_text(json.dumps({"format": 99}))
    assert main(["status", str(run.root)]) == 0
    problems = [line for line in capsys.readouterr().out.splitlines() if line.startswith("problem:")]
    from rlhf_core.run.migrate import RUN_FORMAT

    assert problems == [f"problem: {run.root} is in run-directory format 99, newer than this rlhf-dag reads ({RUN_FORMAT}); "
                        "use the version that wrote it"]
