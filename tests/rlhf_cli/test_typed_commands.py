"""The commands a run prints work as typed: the environment's console scripts by name where the PATH
finds them, by path where it does not (after `make demo`, without `source .venv/bin/activate`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rlhf_cli.orchestrated import where_to_look
from rlhf_cli.typed_commands import as_typed

BIN = Path(sys.executable).parent


def test_a_script_the_path_finds_is_typed_by_name(monkeypatch):
    monkeypatch.setenv("PATH", f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    assert as_typed("rlhf") == "rlhf" and as_typed("mlflow") == "mlflow"


def test_a_script_off_the_path_is_typed_by_its_path_relative_to_here(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.chdir(BIN.parent.parent)  # the directory holding the environment, as `make demo` leaves it
    typed = as_typed("rlhf")
    assert typed == str((BIN / "rlhf").absolute().relative_to(Path.cwd()))
    out = subprocess.run(f"{typed} --help", shell=True, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0 and "usage: rlhf" in out.stdout, out.stderr  # what is printed runs
    monkeypatch.chdir(tmp_path)  # elsewhere: the absolute path
    assert as_typed("rlhf") == str((BIN / "rlhf").absolute())
    assert as_typed("no-such-script") == "no-such-script"


def test_the_closing_block_prints_the_commands_as_typed(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setenv("RLHF_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    text = where_to_look({"run_dir": "runs/r", "mlflow_run_id": "abc123"})
    rlhf, mlflow = BIN / "rlhf", BIN / "mlflow"
    assert f"({rlhf.absolute()} status runs/r; {rlhf.absolute()} query runs/r" in text, text
    assert f"{mlflow.absolute()} ui --host 127.0.0.1" in text, text
