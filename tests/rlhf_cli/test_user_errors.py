"""User errors of issue 18 through the `rlhf` command line: each is one line
`rlhf: error: <cause>; <fix>`, a non-zero exit, no traceback, and nothing written before the refusal."""

from __future__ import annotations

import csv
import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors

from rlhf_cli.main import main
from rlhf_core.data.readers import read_rows
from rlhf_core.errors import DataError, DiskFullError, is_disk_full
from rlhf_core.io.atomic import TMP_MARK, atomic_write_json
from rlhf_core.run.layout import RunDir


def one_error_line(err: str) -> str:
    """The single `rlhf: error:` line of ``err`` (and nothing that looks like a traceback)."""
    errors = [line for line in err.splitlines() if line.startswith("rlhf: error:")]
    assert len(errors) == 1 and "Traceback" not in err and "ValidationError" not in err, err
    return errors[0]


@pytest.fixture
def run(tmp_path) -> RunDir:
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    run.config_path.write_text("trainer:\n  export_min_val_score: 0.5\n")
    return run


# ---------------------------------------------------------------------------------------------
# flow parameters: refused before a Prefect server starts or a directory is made
# ---------------------------------------------------------------------------------------------


def test_a_run_name_that_leaves_runs_root_is_refused_before_anything_is_created(tmp_path):
    """Through the console entry point (`python -m rlhf_cli.main`), as a user types it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env["RLHF_HOME"] = str(tmp_path / "home")
    runs = tmp_path / "a" / "runs"
    out = subprocess.run([sys.executable, "-m", "rlhf_cli.main", "run", "--run-name", "../../x",
                          f"trainer.runs_root={runs}"], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=600)
    assert out.returncode == 2, out.stderr[-3000:]
    line = one_error_line(out.stderr)
    assert "--run-name '../../x'" in line and "plain directory name" in line, line
    assert [p.name for p in tmp_path.iterdir() if p.name != "home"] == []  # no runs root, no x beside it
    assert not (tmp_path / "home" / "prefect" / "temporary-server.log").exists()  # no server was started


@pytest.mark.parametrize("argv, words", [
    (["stage", "validate", "-k", "-1"], ["--iteration -1", "validate also takes 0"]),
    (["stage", "rollout", "-k", "0"], ["stage 'rollout' needs iteration K >= 1"]),
    (["stage", "validate", "-k", "-1", "--local"], ["--iteration -1", "takes iteration K >= 0"]),
    (["stage", "gae", "-k", "0", "--local"], ["--iteration 0", "takes iteration K >= 1"]),
    (["run", "--iterations", "0"], ["--iterations 0", "N >= 1"]),
])
def test_a_bad_iteration_is_one_line_before_anything_is_created(tmp_path, capsys, argv, words):
    target = tmp_path / "runs" / "r"
    where = ["--run-dir", str(target)] if argv[0] == "stage" else [f"trainer.runs_root={tmp_path / 'runs'}"]
    assert main([*argv, *where]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert all(word in line for word in words), line
    assert not (tmp_path / "runs").exists()
    assert not (Path(os.environ["RLHF_HOME"]) / "prefect" / "temporary-server.log").exists()


# ---------------------------------------------------------------------------------------------
# rlhf query --csv: nested columns as JSON text
# ---------------------------------------------------------------------------------------------


def test_query_csv_writes_struct_and_list_columns_as_json(run, tmp_path, capsys):
    atomic_write_json(run.metrics(1), {"reward/mean": 0.5})
    out = tmp_path / "nested.csv"
    sql = ("SELECT iteration, {'name': name, 'v': value} AS s, [value, value * 2] AS l, MAP {name: value} AS m, "
           "CAST(NULL AS INTEGER[]) AS empty, INTERVAL 1 DAY AS gap FROM metrics")
    assert main(["query", str(run.root), sql, "--csv", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 1
    assert json.loads(rows[0]["s"]) == {"name": "reward/mean", "v": 0.5}
    assert json.loads(rows[0]["l"]) == [0.5, 1.0] and json.loads(rows[0]["m"]) == {"reward/mean": 0.5}
    assert rows[0]["empty"] == "" and rows[0]["iteration"] == "1" and "days=1" in rows[0]["gap"]
    assert "wrote" in capsys.readouterr().out


def test_query_csv_on_a_full_disk_is_one_line(run, capsys):
    atomic_write_json(run.metrics(1), {"reward/mean": 0.5})
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    sql = "SELECT * FROM range(200000)"  # enough rows that the writer flushes into the full device
    assert main(["query", str(run.root), sql, "--max-rows", "1", "--csv", "/dev/full"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "no space left on the device writing /dev/full" in line and " free" in line and "rerun" in line, line


# ---------------------------------------------------------------------------------------------
# disk full inside an atomic write (the project's fault hook raises ENOSPC at a real write point)
# ---------------------------------------------------------------------------------------------


def test_a_full_disk_while_writing_a_model_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    out = tmp_path / "models" / "tiny2"
    monkeypatch.setenv("RLHF_FAULT", "enospc@before_rename:tiny2")
    assert main(["model", "build-tiny", "--out", str(out), "--hidden-size", "16", "--layers", "1",
                 "--vocab-size", "300"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"no space left on the device writing {out}" in line and " free)" in line, line
    assert "trainer.runs_root" in line
    assert list((tmp_path / "models").iterdir()) == []  # neither the model nor a .tmp- sibling


def test_safetensors_disk_full_is_recognised_and_other_errors_are_not():
    full = safetensors.SafetensorError(
        'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })')
    assert is_disk_full(full) and is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert not is_disk_full(safetensors.SafetensorError("Error while deserializing header: HeaderTooLarge"))
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied")) and not is_disk_full(ValueError("x"))


# ---------------------------------------------------------------------------------------------
# data files that are not files
# ---------------------------------------------------------------------------------------------


def data_error(path: Path) -> str:
    with pytest.raises(DataError) as failure:
        read_rows(path)
    return failure.value.args[0]


def test_a_symlink_loop_a_directory_and_a_non_utf8_name_are_named_as_such(tmp_path):
    (tmp_path / "a.jsonl").symlink_to(tmp_path / "b.jsonl")
    (tmp_path / "b.jsonl").symlink_to(tmp_path / "a.jsonl")
    assert "a.jsonl is a symlink loop; point the link" in data_error(tmp_path / "a.jsonl")
    (tmp_path / "gone.jsonl").symlink_to(tmp_path / "missing.jsonl")
    assert "which does not exist; fix the link" in data_error(tmp_path / "gone.jsonl")
    (tmp_path / "train.jsonl").mkdir()
    assert "train.jsonl is a directory, not a data file; list its files" in data_error(tmp_path / "train.jsonl")
    raw = os.fsencode(tmp_path) + b"/caf\xe9.jsonl"  # Latin-1 bytes: not UTF-8
    message = data_error(Path(os.fsdecode(raw)))
    assert "caf\\xe9.jsonl not found" in message and "\udce9" not in message
    message.encode("utf-8")  # printable: no lone surrogate left


def test_no_temporary_file_survives_a_refused_write(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_FAULT", "enospc@before_rename:state.json")
    with pytest.raises(DiskFullError, match="state.json"):
        atomic_write_json(tmp_path / "state.json", {"a": 1})
    assert not any(TMP_MARK in p.name for p in tmp_path.iterdir()) and not (tmp_path / "state.json").exists()


def test_the_config_check_names_a_symlink_loop_and_a_directory_in_one_line(tmp_path, capsys):
    (tmp_path / "loop.jsonl").symlink_to(tmp_path / "loop.jsonl")
    (tmp_path / "dir.jsonl").mkdir()
    code = main(["config", "show", f"data.train_files=[{tmp_path}/loop.jsonl,{tmp_path}/dir.jsonl]"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "loop.jsonl is a symlink loop" in err and "dir.jsonl is a directory, not a data file" in err


def test_an_override_with_non_utf8_bytes_is_refused_showing_the_bytes(tmp_path):
    """A data path typed in a Latin-1 shell reaches argv as raw bytes. YAML used to fall back to the
    raw text, so `[path]` became one literal path with its brackets; now it is one line that shows
    the bytes as \\xNN, through the console entry point with bytes argv. `config show` makes the
    same check as `rlhf run` before any work (one parser for every command's overrides) without
    importing Prefect: ~2 s here against ~12 s for `run`."""
    raw = os.fsencode(tmp_path) + b"/caf\xe9.jsonl"
    Path(os.fsdecode(raw)).write_text('{"question": "1 + 1?", "answer": "#### 2"}\n')  # it exists
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env["RLHF_HOME"] = str(tmp_path / "home")
    argv = [sys.executable.encode(), b"-m", b"rlhf_cli.main", b"config", b"show", b"data.train_files=[" + raw + b"]"]
    out = subprocess.run(argv, capture_output=True, env=env, cwd=tmp_path, timeout=600)
    err = out.stderr.decode("utf-8")  # printable as UTF-8: no lone surrogate reached the terminal
    assert out.returncode == 2, err[-3000:]
    line = one_error_line(err)
    assert "override data.train_files=[" in line and "/caf\\xe9.jsonl]" in line, line
    assert "not UTF-8" in line and "rename the file" in line, line


def test_a_preset_that_is_not_utf8_is_one_line(tmp_path, capsys):
    preset = tmp_path / "latin1.yaml"
    preset.write_bytes(b"trainer:\n  experiment_name: caf\xe9\n")
    assert main(["config", "show", "-c", str(preset)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "latin1.yaml: line 2 holds bytes that are not UTF-8 (\\xe9); save the preset as UTF-8" in line, line


# ---------------------------------------------------------------------------------------------
# issue 29: `rlhf run` checks its config and model folders before Prefect, MLflow and DeepSpeed load
# ---------------------------------------------------------------------------------------------

HEAVY = ("prefect", "mlflow", "deepspeed", "flows", "tasks")


def test_a_config_mistake_in_run_and_demo_is_found_before_prefect_mlflow_and_deepspeed_load(tmp_path):
    """`rlhf run` used to import the flows (Prefect, MLflow, DeepSpeed) before it read its config:
    a typo took 10-23 s to show (`rlhf config show`: 3 s). Now its one line comes first."""
    code = ("import sys; from rlhf_cli.main import main; "
            f"codes = [main(['run', 'algorithm.kl_ctrl.kl_cof=0.1', 'trainer.runs_root={tmp_path / 'runs'}']), "
            "main(['demo', '--iterations', '0'])]; "
            f"print(codes, sorted(m for m in {HEAVY!r} if m in sys.modules))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=600)
    assert out.stdout.strip() == "[2, 2] []", out.stdout + out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("rlhf: error:")]
    assert "unknown config key 'algorithm.kl_ctrl.kl_cof'" in errors[0] and "kl_ctrl.kl_coef" in errors[0]
    assert "--iterations 0" in errors[1] and "N >= 1" in errors[1]
    assert not (tmp_path / "runs").exists()


def _model_folders(tmp_path: Path, tiny: Path, other: Path) -> dict[str, Path]:
    """An empty folder, a config without weights, weights of another model, no tokenizer."""
    import shutil

    folders = {name: tmp_path / name for name in ("empty", "config_only", "other_weights", "no_tokenizer")}
    for folder in folders.values():
        folder.mkdir()
    shutil.copy(tiny / "config.json", folders["config_only"])
    shutil.copytree(tiny, folders["other_weights"], dirs_exist_ok=True)
    shutil.copy(other / "model.safetensors", folders["other_weights"])
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny / name, folders["no_tokenizer"])
    return folders


@pytest.fixture(scope="module")
def other_tiny(tmp_path_factory) -> Path:
    """A tiny model of another shape (hidden size 32 where the tiny model has 64)."""
    from rlhf_core.models.tiny import TinyModelSpec, build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("other") / "m", TinyModelSpec(hidden_size=32, num_hidden_layers=1))


def test_an_unusable_model_folder_is_one_line_before_any_run_directory(tmp_path, tiny_model_dir, other_tiny, capsys):
    """An existing but empty model folder cost 206 lines, three tracebacks, a run directory and a
    FAILED MLflow run. The console script, on the empty folder: one line, nothing made. The other
    kinds in-process (the same code path)."""
    folders = _model_folders(tmp_path, tiny_model_dir, other_tiny)
    runs, home = tmp_path / "runs", tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env["RLHF_HOME"] = str(home)
    exe = Path(sys.executable).parent / "rlhf"
    out = subprocess.run([str(exe), "run", f"actor_rollout_ref.model.path={folders['empty']}",
                          f"trainer.runs_root={runs}"], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=600)
    assert out.returncode == 2, out.stderr[-3000:]
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    line = one_error_line(out.stderr)
    assert f"actor_rollout_ref.model.path: {folders['empty']} is not a usable model folder" in line, line
    assert "no config.json; no weights; no tokenizer files; it holds nothing" in line
    assert "a model folder must hold config.json" in line and "tokenizer.json" in line
    assert not runs.exists() and not (home / "mlflow").exists()
    assert not (home / "prefect" / "temporary-server.log").exists()

    expected = {"config_only": "(no weights; no tokenizer files; it holds config.json)",
                "other_weights": "its weights do not fit its config.json (qwen2: no token embedding of "
                                 "[vocab_size, hidden_size] = [512, 64]",
                "no_tokenizer": "(no tokenizer files; it holds config.json, model.safetensors)"}
    for name, words in expected.items():
        assert main(["run", f"actor_rollout_ref.model.path={folders[name]}", f"trainer.runs_root={runs}"]) == 2
        line = one_error_line(capsys.readouterr().err)
        assert f"{folders[name]} is not a usable model folder" in line and words in line, line
    # a critic needs no tokenizer of its own; a separate tokenizer_path lets the actor's folder go without one
    assert main(["config", "show", f"critic.model.path={folders['no_tokenizer']}",
                 f"actor_rollout_ref.model.path={folders['no_tokenizer']}",
                 f"actor_rollout_ref.model.tokenizer_path={tiny_model_dir}"]) == 0
    assert not runs.exists()


def test_pickled_weights_a_safe_load_refuses_are_one_line_naming_the_fix(tmp_path, tiny_model_dir, capsys):
    """Issue 38: a folder whose only weights are a pytorch_model.bin holding a numpy scalar beside its
    tensors was refused by torch's safe loader deep in the init-critic task: 225 lines, two tracebacks,
    exit 1, a run directory made. Now one line naming the folder, the objects and the conversion, before
    anything is made; a pickle of tensors alone is still accepted (torch's safe loader reads it)."""
    import shutil

    import numpy as np
    import torch
    from safetensors.torch import load_file

    tensors = load_file(str(tiny_model_dir / "model.safetensors"))
    folders = {}
    for name, extra in (("objects", {"step": np.float64(3.0)}), ("tensors", {})):
        folder = folders[name] = tmp_path / name
        shutil.copytree(tiny_model_dir, folder)
        (folder / "model.safetensors").unlink()
        torch.save({**tensors, **extra}, folder / "pytorch_model.bin")
    runs, home = tmp_path / "runs", tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env["RLHF_HOME"] = str(home)
    out = subprocess.run([str(Path(sys.executable).parent / "rlhf"), "run", f"actor_rollout_ref.model.path={folders['objects']}",
                          f"trainer.runs_root={runs}"], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=600)
    assert out.returncode == 2, out.stderr[-3000:]
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr[-3000:]
    line = one_error_line(out.stderr)
    assert f"{folders['objects']} is not a usable model folder (its weights pytorch_model.bin are a pickle holding " \
           "Python objects besides tensors (numpy." in line, line
    assert "convert them to safetensors" in line and "safetensors.torch.save_file" in line, line
    assert not runs.exists() and not (home / "mlflow").exists()
    assert main(["config", "show", f"actor_rollout_ref.model.path={folders['tensors']}"]) == 0, capsys.readouterr().err


def test_the_quiet_console_drops_library_deprecations_and_prints_other_warnings_in_one_line(tmp_path):
    """Issue 29: LoRA runs left a bare `warnings.warn(` line on the terminal (transformers'
    FutureWarning about is_gradient_checkpointing, which peft triggers: its first line landed behind
    the progress bar). `rlhf run`'s console (not --verbose) drops FutureWarnings, in its own process
    and the ones it starts, and prints any other warning as one line."""
    code = ("import os, warnings; from rlhf_cli.main import parse_args, prepare_environment; "
            "prepare_environment(parse_args(['run'])); "
            "warnings.warn('`is_gradient_checkpointing` is deprecated', FutureWarning); "
            "warnings.warn('look\\nhere', UserWarning); print(os.environ['PYTHONWARNINGS'])")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env["RLHF_HOME"] = str(tmp_path / "home")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("rlhf: warning: UserWarning: look here (<string>:1)"), lines
    assert out.stdout.strip() == "ignore::FutureWarning"  # torchrun ranks and worker processes too
