"""A stage rerun with overrides (`rlhf stage gae --run-dir RUN -k 1 algorithm.lam=0.9`) leaves the
run's config.yaml as it was and records its overrides in the stage's manifest record; `rlhf status`
shows them; `rlhf run --resume` and `rlhf export` refuse, naming the stages and `rlhf rebuild`, until
`rlhf rebuild RUN` reruns them with config.yaml; then both work. All through the real CLI."""

from __future__ import annotations

import hashlib

import pytest

from rlhf_cli.main import main
from rlhf_core.run.layout import RunDir
from rlhf_core.run.lifecycle import read_last_good
from rlhf_core.run.manifest import read_manifest
from rlhf_core.stages.base import out_of_date

pytestmark = [pytest.mark.prefect, pytest.mark.slow, pytest.mark.deepspeed]


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _error_line(err: str) -> str:
    errors = [line for line in err.splitlines() if line.startswith("rlhf: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def test_a_stage_rerun_with_overrides_is_recorded_refused_and_rebuilt(prefect_server, demo_preset, tiny_overrides,
                                                                      tmp_path, capsys):
    runs = tmp_path / "runs"
    assert main(["run", "-c", demo_preset, *tiny_overrides(runs), "--iterations", "2", "--run-name", "ov"]) == 0
    run = RunDir(runs / "ov")
    config, advantages = run.config_path.read_bytes(), _digest(run.advantages(1))
    exported = run.root / "export" / "actor" / "export.json"  # the run exported its last-good actor
    first_export = exported.read_bytes()

    assert main(["stage", "gae", "--run-dir", str(run.root), "-k", "1", "algorithm.lam=0.9"]) == 0
    assert run.config_path.read_bytes() == config
    assert read_manifest(run, 1)["gae"]["overrides"] == ["algorithm.lam=0.9"]
    assert _digest(run.advantages(1)) != advantages
    capsys.readouterr()
    assert main(["status", str(run.root)]) == 0
    assert "iter_1/gae rerun with overrides algorithm.lam=0.9" in capsys.readouterr().out
    assert main(["stage", "rollout", "--run-dir", str(run.root), "-k", "9"]) != 0  # not reached: no stray iter_9
    line = _error_line(capsys.readouterr().err)
    assert "has not reached iteration 9: last-good is 2" in line and not (run.root / "iter_9").exists(), line

    assert main(["run", "--resume", str(run.root), "--iterations", "3"]) == 2
    line = _error_line(capsys.readouterr().err)
    assert "cannot resume" in line and "iter_1/gae (rerun with overrides algorithm.lam=0.9)" in line, line
    assert "iter_1/update (stale)" in line and f"rlhf rebuild {run.root}" in line, line
    assert main(["export", str(run.root)]) == 2
    line = _error_line(capsys.readouterr().err)
    assert "cannot export" in line and f"rlhf rebuild {run.root}" in line, line
    assert exported.read_bytes() == first_export

    assert main(["rebuild", str(run.root)]) == 0
    out, err = capsys.readouterr()
    assert "[gae iteration 1]" in out and "[validate iteration 2]" in out, out
    # a committed iteration's guard is re-measured by design: said on its stage's line, not as a warning
    assert "guard verdict applied: recorded (the iteration is at or before last-good" in out, out
    assert "WARNING" not in err, err[-2000:]
    assert out_of_date(run, 2) == [] and "overrides" not in read_manifest(run, 1)["gae"]
    assert run.config_path.read_bytes() == config
    assert _digest(run.advantages(1)) == advantages  # config.yaml's lam again

    assert main(["run", "--resume", str(run.root), "--iterations", "3"]) == 0
    assert read_last_good(run)["iteration"] == 3
    assert main(["export", str(run.root)]) == 0
    assert exported.read_bytes() != first_export and '"iteration": 3' in exported.read_text()
