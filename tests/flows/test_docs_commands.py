"""The commands of README.md, docs/*.md and deployments/README.md, run as written against a real
finished run (issue 18: several did not run as written).

Every fenced block is accounted for: its commands run (bash: each command; sql: each statement
through `rlhf query RUN`), or it is a picture that is checked against the run (the run-directory
tree, the package layout), or it is a python example that a named test runs (``RUN_ELSEWHERE``), or it
is listed in ``NOT_COMMANDS`` / ``SKIPPED`` with the reason it cannot run in the test suite. A block or command that is none of these fails the test, so a new one
has to be sorted when it is written. Every inline `rlhf ...` of the same files names a command and
options the real parser has, and the ones that are whole read-only commands (status, query, export,
config show) run.

The README's CPU smoke recipe for a real model runs with stand-ins for what this machine lacks
(``STAND_INS``: the tiny model for Qwen2.5-0.5B-Instruct, verl-format Parquet written from the
embedded data for GSM8K's), every override as written.

The run is the session's 2-iteration tiny pipeline run (``two_iterations.pristine``, a copy taken
before other tests rerun its stages): ``runs/<run>``, ``RUN`` and ``K`` stand for it and iteration 2.
`rlhf ...` runs in this process through the console entry point's function (``rlhf_cli.main.main``,
~4 s less per command than a new interpreter); anything else runs in bash from the project root.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_cli.main import build_parser, main, parse_args

pytestmark = [pytest.mark.prefect, pytest.mark.slow, pytest.mark.deepspeed]

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "deployments" / "README.md"]
VENV_BIN = Path(sys.executable).parent
"""The README's `.venv/bin/` (`make test` runs this suite with that interpreter)."""

_SERVER = "starts or needs a Prefect / MLflow server (tests/deployments, -m server; tests/tasks/test_events.py)"
_QWEN = ("needs Qwen2.5-0.5B-Instruct in the Hugging Face cache, verl's GSM8K Parquet and a GPU; "
         "tests/flows/test_verl_quickstart.py runs verl's quickstart overrides on the tiny model")
SKIPPED = {
    "make demo": "creates .venv and runs the 30-iteration demo (~2 min); tests/flows/test_pipeline_flow.py runs "
                 "the same flow on the tiny model",
    ".venv-vllm/bin/rlhf": "needs the vLLM CPU environment that make test-vllm builds; tests/flows/test_vllm_flow.py "
                           "runs the same flow there",
    "make test-verl": "builds verl 0.9.1's environment and runs tests/conformance: CI's own step after make test",
    "make test": "runs this whole suite",
    ".venv/bin/rlhf demo --grpo": "a 30-iteration GRPO run (~3.5 min); tests/flows/test_demo_grpo.py runs it shortened",
    "rlhf run -c configs/demo.yaml": "a 30-iteration demo run (~2 min); its config is checked here with `rlhf config "
                                     "show` and the flow by tests/flows/test_pipeline_flow.py",
    "rlhf run data.train_files=$HOME/data/gsm8k": _QWEN,
    "rlhf run -c configs/gsm8k.yaml actor_rollout_ref.model.path=Qwen": _QWEN,
    "rlhf run \\": _QWEN,  # docs/verl.md: the quickstart's overrides, "... every other override unchanged ..."
    "python3 -m verl.trainer.main_ppo": "verl's own command, shown beside ours for comparison",
    "make services-up": _SERVER,
    "make services-down": _SERVER,
    "python -m deployments.services": _SERVER,
    "python -m deployments.alerts": _SERVER,
    "prefect automation create": _SERVER,
    "curl -s -X POST \"$PREFECT_API_URL": _SERVER,
    "bash benchmarks/gpu/device_check.sh OUT_DIR": "needs a GPU and the .wheelhouse/ of make wheelhouse; its --dry-run runs here in "
                                                   "tests/benchmarks/test_gpu_dry_runs.py",
    "make smollm2-arith": "downloads the SmolLM2 wheel and trains a real 135 M model for ~37 min; "
                          "tests/rlhf_core/models/test_gguf_import.py imports a GGUF and "
                          "tests/benchmarks/test_bench_real_model.py runs a preset the same way on the demo model",
    "docker build": "needs Docker",
    "prefect work-pool create": "needs a Prefect server and Docker / Kubernetes workers",
    "prefect --no-prompt deploy": "needs a Prefect server and a container registry",
    "pip install prefect-docker": "installs packages and starts a worker on a Docker GPU host",
    "pip install prefect-kubernetes": "installs packages and starts a worker in a Kubernetes cluster",
}
"""Command prefix → why it does not run in the test suite."""

QWEN_GSM8K = "rlhf run -c configs/gsm8k.yaml actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct"
SMOKE_MARK = "trainer.total_training_steps=1"
"""The README's CPU smoke recipe: the GSM8K preset on a real model, shrunk to one step. It runs."""
STAND_INS = ("Qwen/Qwen2.5-0.5B-Instruct", "$HOME/data/gsm8k/")
"""What the smoke recipe names that this machine lacks (a hub model, verl's GSM8K Parquet)."""

NOT_COMMANDS = {
    ("docs/architecture.md", "rlhf_core   the library"): "the layer diagram",
    ("docs/architecture.md", "rollout → score → gae"): "the lifecycle of one iteration and of a resume, as a diagram",
    ("docs/checkpoints.md", '{"iteration": k'): "the fields of iter_k/state.json, as a sketch",
    ("deployments/README.md", "Prefect UI"): "the addresses `services up` prints",
    ("README.md", "held-out accuracy (256 validation prompts"): "what the SmolLM2 run printed at its end",
}
"""(file, first line) of a fenced block → what it shows instead of commands."""

RUN_ELSEWHERE = {
    ("docs/guide.md", '@register_adv_estimator("sign_of_reward")'): "tests/test_readme_extending.py",
    ("docs/guide.md", "def compute_score("): "tests/test_readme_extending.py",
}
"""(file, start of the first line) of a python example → the test that runs it as written (an example
is code a user pastes into a module of theirs, not a command)."""

READ_ONLY = {"status", "query", "export", "config"}
"""Inline commands that run when they are whole commands; the others start flow runs, servers or
builds (their pipelines are tested elsewhere) and are checked for their command and options only."""


# ---------------------------------------------------------------------------------------------
# reading the docs
# ---------------------------------------------------------------------------------------------


def fenced_blocks() -> list[tuple[str, str, str]]:
    """(file relative to the project, language, body) of every fenced block."""
    out = []
    for path in DOCS:
        for m in re.finditer(r"^```(\w*)\n(.*?)^```", path.read_text(encoding="utf-8"), re.S | re.M):
            out.append((str(path.relative_to(REPO)), m.group(1), m.group(2)))
    return out


def shell_commands(body: str) -> list[str]:
    """A bash block's commands: continuation lines joined, comments and blank lines dropped."""
    commands, current = [], ""
    for line in body.splitlines():
        stripped = line.split("  #")[0].rstrip() if not line.lstrip().startswith("#") else ""
        current += stripped.lstrip() if current else stripped
        if current.endswith("\\"):
            current = current[:-1].rstrip() + " "
            continue
        if current.strip():
            commands.append(current.strip())
        current = ""
    return commands


def sql_statements(body: str) -> list[str]:
    text = "\n".join(line for line in body.splitlines() if not line.lstrip().startswith("--"))
    return [s.strip() for s in text.split(";") if s.strip()]


def inline_rlhf_commands() -> list[tuple[str, str]]:
    """(file, text) of every inline code span that starts with `rlhf `."""
    found = []
    for path in DOCS:
        prose = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
        found += [(str(path.relative_to(REPO)), span) for span in re.findall(r"`(rlhf [^`]+)`", prose)]
    return found


def skip_reason(command: str) -> str | None:
    return next((why for prefix, why in SKIPPED.items() if command.startswith(prefix)), None)


# ---------------------------------------------------------------------------------------------
# running commands
# ---------------------------------------------------------------------------------------------


def placeholders(text: str, run: Path) -> str:
    """The docs' stand-ins for a run: `runs/<run>` and RUN (the directory), K (an iteration)."""
    text = text.replace("runs/<run>", str(run))
    return re.sub(r"\bK\b", "2", re.sub(r"\bRUN\b", str(run), text))


def run_rlhf(argv: list[str]) -> tuple[int, str]:
    """`rlhf ARGV` in this process; (exit status, stdout + stderr). The environment comes back as it
    was: the CLI sets Prefect's home and quiet defaults for its own process."""
    saved = dict(os.environ)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = main(argv)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return code, out.getvalue()


def run_shell(command: str) -> tuple[int, str]:
    command = re.sub(r"^\.venv/bin/", f"{VENV_BIN}/", command)
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}"}  # as after `source .venv/bin/activate`
    done = subprocess.run(["bash", "-c", command], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    return done.returncode, done.stdout + done.stderr


def run_command(command: str, run: Path) -> tuple[int, str]:
    command = placeholders(command, run)
    words = shlex.split(command)
    if words[0] in ("rlhf", ".venv/bin/rlhf") and not re.search(r"[$|;&<>`]", command):
        return run_rlhf(words[1:])
    return run_shell(command)


def rows_printed(output: str) -> int:
    found = re.findall(r"^\((\d+) rows?\)$", output, re.M)
    assert found, output
    return int(found[-1])


# ---------------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def run(two_iterations, monkeypatch) -> Path:
    monkeypatch.setenv("RLHF_HOME", str(two_iterations.home))
    return two_iterations.pristine.root


def is_smoke_recipe(command: str) -> bool:
    return command.startswith(QWEN_GSM8K) and SMOKE_MARK in command


def with_stand_ins(command: str, model: Path, data: Path) -> str:
    """The smoke recipe with the tiny model and local Parquet in place of ``STAND_INS``."""
    hub_model, gsm8k = STAND_INS
    return command.replace(hub_model, str(model)).replace(gsm8k, f"{data}/")


def gsm8k_stand_in(out: Path, repo: Path = REPO) -> Path:
    """train.parquet (8 prompts) and test.parquet (8) in verl's GSM8K layout, from the embedded data."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = (repo / "data" / "arith" / "train.jsonl").read_text().splitlines()[:16]
    rows = [{"data_source": "openai/gsm8k", "ability": "math",
             "prompt": [{"role": "user", "content": r["question"] + " Let's think step by step and output the "
                                                                    "final answer after \"####\"."}],
             "reward_model": {"style": "rule", "ground_truth": r["answer"].rsplit("####", 1)[1].strip()},
             "extra_info": {"index": i}} for i, r in enumerate(json.loads(line) for line in lines)]
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows[:8]), out / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows[8:]), out / "test.parquet")
    return out


def run_smoke_recipe(command: str, tmp_path: Path, model: Path) -> tuple[int, str]:
    """The smoke recipe as written but for ``STAND_INS``, from an empty directory (its runs go there)."""
    data = gsm8k_stand_in(tmp_path / "gsm8k")
    cwd = Path.cwd()
    os.chdir(tmp_path)
    try:
        return run_rlhf(shlex.split(with_stand_ins(command, model, data))[1:])
    finally:
        os.chdir(cwd)


def test_every_fenced_block_runs_as_written_or_says_why_not(run, tmp_path, tiny_model_dir):
    unsorted, failed, ran = [], [], []
    for where, lang, body in fenced_blocks():
        first = body.strip().splitlines()[0]
        if lang == "sql":
            for statement in sql_statements(body):
                code, out = run_rlhf(["query", str(run), statement])
                if code != 0 or rows_printed(out) == 0:  # the README promises rows on the demo
                    failed.append(f"{where}: rlhf query RUN {statement!r} → {code}\n{out[-2000:]}")
                ran.append(statement)
        elif lang in ("bash", "sh", "shell", "console"):
            for command in shell_commands(body):
                why = skip_reason(command)
                if is_smoke_recipe(command):
                    code, out = run_smoke_recipe(command, tmp_path, tiny_model_dir)
                    if code != 0 or "last-good: iteration 1" not in out:
                        failed.append(f"{where}: {command} (tiny model, local Parquet) → exit {code}\n{out[-2000:]}")
                    ran.append(command)
                elif why is None:
                    code, out = run_command(command, run)
                    if code != 0:
                        failed.append(f"{where}: {command} → exit {code}\n{out[-2000:]}")
                    ran.append(command)
                elif command.startswith("rlhf run -c configs/demo.yaml"):
                    failed += config_check(where, command)
        elif runner_of(where, first):
            if not (REPO / runner_of(where, first)).is_file():
                failed.append(f"{where}: the example {first!r} names {runner_of(where, first)}, which does not exist")
        elif picture_check(where, first):
            failed += picture_check(where, first)(run)
        elif not any(where == f and first.startswith(p) for f, p in NOT_COMMANDS):
            unsorted.append(f"{where}: ```{lang} block starting {first!r}")
    assert not unsorted, "blocks that neither run nor say why not (add them to SKIPPED / NOT_COMMANDS):\n" + \
        "\n".join(unsorted)
    assert not failed, "commands that do not run as written:\n" + "\n\n".join(failed)
    assert len(ran) >= 7, ran  # the DuckDB one-liner, the four queries, `rlhf config show`, the smoke recipe
    assert any(is_smoke_recipe(command) for command in ran), "the README's CPU smoke recipe did not run"


def runner_of(where: str, first: str) -> str | None:
    return next((test for (f, start), test in RUN_ELSEWHERE.items() if f == where and first.startswith(start)), None)


def config_check(where: str, command: str) -> list[str]:
    """A skipped `rlhf run` still has its config checked as `rlhf config show` checks it."""
    code, out = run_rlhf(["config", "show", *shlex.split(command)[2:]])
    return [] if code == 0 else [f"{where}: the config of {command!r} is refused: {out[-1000:]}"]


def test_every_inline_rlhf_command_and_option_exists_and_the_read_only_ones_run(run):
    wrong, ran = [], []
    for where, text in inline_rlhf_commands():
        problem = unknown_option(text)
        if problem:
            wrong.append(f"{where}: `{text}`: {problem}")
            continue
        argv = shlex.split(placeholders(text, run))[1:]
        if argv[0] in READ_ONLY and parses(argv):
            code, out = run_rlhf(argv)
            if code != 0:
                wrong.append(f"{where}: `{text}` → exit {code}\n{out[-2000:]}")
            ran.append(text)
    assert not wrong, "\n".join(wrong)
    assert {"rlhf status RUN", "rlhf export RUN", "rlhf config show --flat"} <= set(ran), ran


def unknown_option(text: str) -> str | None:
    """What in an inline `rlhf ...` the parser does not have (a command or an option), else None.
    Synopsis notation is read as such: [optional] parts, NAME / <name> for a stage, `...`."""
    words = [w.strip("[]") for w in shlex.split(re.sub(r"\bNAME\b|<name>", "score", text))[1:]]
    words = words[:words.index("|")] if "|" in words else words  # `rlhf run … | head -3`: the pipe's reader is not ours
    parser = build_parser()
    while words and _subcommands(parser) and words[0] not in ("-h", "--help"):
        choices = _subcommands(parser)
        if words[0] not in choices:
            return f"no command {words[0]!r} (valid: {', '.join(choices)})"
        parser = choices[words.pop(0)]
    options = {o for action in parser._actions for o in action.option_strings}
    bad = [w for w in words if w.startswith("-") and w.split("=")[0] not in options]
    return f"no option {', '.join(bad)} (valid: {', '.join(sorted(options))})" if bad else None


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})


def parses(argv: list[str]) -> bool:
    """Whether ``argv`` is a whole command (a mention such as `rlhf status` lacks its RUN)."""
    with contextlib.redirect_stderr(io.StringIO()):
        try:
            parse_args(argv)
        except SystemExit:
            return False
    return True


# ---------------------------------------------------------------------------------------------
# pictures checked against the run and the checkout
# ---------------------------------------------------------------------------------------------

WHILE_WRITING = {"run.lock": "exists only while a process writes the run",
                 "logs": "only after an update on several processes (torchrun's output)"}


def run_tree_entries(body: str) -> list[str]:
    """The file names of the README's run-directory picture, iter_<k> as iter_2 (it has them all)."""
    names = []
    for line in body.splitlines()[1:]:
        if line.startswith("  ") and not line.startswith("   "):  # an entry, not a continuation line
            names.append(line.split()[0].replace("<k>", "2").rstrip("/"))
    return names


def check_run_tree(run: Path) -> list[str]:
    body = next(b for f, lang, b in fenced_blocks() if f == "docs/guide.md" and b.startswith("runs/<name>/"))
    listed = run_tree_entries(body)
    missing = [n for n in listed if n not in WHILE_WRITING and not (run / n).exists()]
    unlisted = [p for p in _run_files(run) if re.sub(r"^iter_\d+", "iter_2", p) not in listed]
    return ([f"README run directory lists {missing}, not in a finished run"] if missing else []) + \
        ([f"README run directory does not list {unlisted}"] if unlisted else [])


def _run_files(run: Path) -> list[str]:
    """A finished run's files and folders down to iter_k/*, prompts/*, pack/* (not inside checkpoints,
    models, exports or plots, which the picture names as a whole)."""
    out = []
    for p in sorted(run.iterdir()):
        if p.is_dir() and (p.name.startswith("iter_") or p.name in ("prompts", "pack")):
            out += [f"{p.name}/{q.name}" for q in sorted(p.iterdir())]
        elif not p.is_dir():
            out.append(p.name)
    return out


def check_package_layout(_run: Path) -> list[str]:
    body = next(b for f, lang, b in fenced_blocks() if f == "docs/guide.md" and b.startswith("rlhf_core/"))
    listed, top = set(), ""
    for line in body.splitlines():
        if not line.startswith(" "):
            top = line.split()[0]
            listed.add(top.rstrip("/"))
            continue
        for word in line.split():
            if not word.endswith("/"):
                break
            listed.add(top + word.rstrip("/"))
    missing = sorted(n for n in listed if not (REPO / n).is_dir())
    packages = {p.parent.relative_to(REPO).as_posix() for p in REPO.glob("*/__init__.py")} | \
        {p.parent.relative_to(REPO).as_posix() for p in REPO.glob("rlhf_core/*/__init__.py")}
    unlisted = sorted(packages - listed)
    return ([f"README layout lists {missing}, not in the checkout"] if missing else []) + \
        ([f"README layout does not list the packages {unlisted}"] if unlisted else [])


PICTURES = {
    ("docs/guide.md", "runs/<name>/"): check_run_tree,
    ("docs/guide.md", "rlhf_core/   the library"): check_package_layout,
}
"""(file, start of the first line) of a picture checked against the run / the checkout → its check."""


def picture_check(where: str, first: str):
    return next((check for (f, start), check in PICTURES.items() if f == where and first.startswith(start)), None)
