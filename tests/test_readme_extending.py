"""The README's "Extending" recipes, applied as written to a copy of the project and run there.

Each recipe is read from docs/guide.md's Extending section (its code, the files and the command it
names) and applied to one copy of the packages in a temporary directory; the copy's code then runs
in child processes (PYTHONPATH = the copy, so the edited modules are the ones imported):

- a new setup stage and a new in-commit iteration stage (module, file names in the layout, one
  ``StageSpec`` each and its function in the catalog, README rows), an advantage estimator under a name of our own and a reward
  function by ``custom_reward_function.path``, run by one 1-iteration ``rlhf run`` of the shrunk
  demo (the README's reward command plus the estimator's override);
- a verl key listed in ``NO_EFFECT`` made a schema field;
- the copy's own checks the recipes name, in one session of its tests: the stage table and tasks,
  the layers, the conformance step's names (against verl 0.9.1 itself under ``make test-verl``,
  which names its environment by VERL_PYTHON) and the schema against verl_keys.py, which fails naming the
  entry to remove, and holds once it is removed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[1]
GUIDE = REPO / "docs" / "guide.md"
"""Where the Extending recipes and the stage table live (the README links there)."""
COPIED = ("rlhf_core", "tasks", "flows", "rlhf_cli", "deployments", "configs", "data", "docs", "pyproject.toml",
          "README.md", "docs/guide.md", "tests/conftest.py", "tests/test_layers.py", "tests/rlhf_core/run/test_stage_order.py",
          "tests/flows/test_recipe.py",
          "tests/rlhf_core/config/test_verl_keys.py", "tests/conformance")
"""What the copy holds: the packages, what they read at run time, and the checks run on it."""
RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
SHRUNK = ("data.train_batch_size=4", "data.max_val_samples=4", "data.max_response_length=12",
          "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
          "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1024",
          "actor_rollout_ref.rollout.generation_batch_tokens=2048", "trainer.val_before_train=false",
          "trainer.test_freq=-1", "trainer.device=cpu", "trainer.logger=[console]")
"""configs/demo.yaml shrunk as tests/flows/conftest.py's tiny_overrides shrink it (its shipped model
kept), without validation or MLflow: what is checked here is the stages' order and outputs."""


# ---------------------------------------------------------------------------------------------
# the README's recipes
# ---------------------------------------------------------------------------------------------


def _section() -> str:
    return GUIDE.read_text(encoding="utf-8").split("## Extending", 1)[1].split("\n## ", 1)[0]


def _recipe(title: str) -> str:
    """The paragraph(s) of the Extending section under ``**<title>**``, up to the next recipe."""
    text = _section()
    assert f"**{title}**" in text, f"docs/guide.md's Extending section has no recipe '{title}'"
    return re.split(r"\n\*\*A new ", text.split(f"**{title}**", 1)[1], maxsplit=1)[0]


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def _named(text: str) -> set[str]:
    """Every `code span` of ``text``."""
    return set(re.findall(r"`([^`\n]+)`", text))


def test_every_python_example_of_the_section_is_applied_below():
    assert _python_blocks(_section()) == (_python_blocks(_recipe("A new advantage estimator"))
                                          + _python_blocks(_recipe("A new reward")))
    assert len(_python_blocks(_section())) == 2


# ---------------------------------------------------------------------------------------------
# the copy and its child processes
# ---------------------------------------------------------------------------------------------


def _copy(dest: Path) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for name in COPIED:
        source, target = REPO / name, dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, ignore=ignore, symlinks=True)
        else:
            shutil.copy2(source, target)
    return dest


def _insert(path: Path, text: str, *, before: str = "", after: str = "") -> None:
    """``text`` put before (or after) the one occurrence of an anchor in ``path``."""
    anchor = before or after
    body = path.read_text(encoding="utf-8")
    assert body.count(anchor) == 1, f"{path}: expected one {anchor!r} to place the recipe's lines at"
    path.write_text(body.replace(anchor, text + anchor if before else anchor + text), encoding="utf-8")


def _child(copy: Path, *args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """``python ARGS`` in the copy, importing the copy's packages."""
    base = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS + ("VERL_PYTHON", "RLHF_REQUIRE_VERL")}
    return subprocess.run([sys.executable, *args], cwd=copy, env={**base, "PYTHONPATH": str(copy), **env},
                          capture_output=True, text=True, timeout=timeout)


def _ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, (proc.stdout[-4000:] + "\n" + proc.stderr[-4000:])
    return proc.stdout


def _pytest(copy: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """The copy's own tests (its tests/conftest.py: offline, a tiny model built once)."""
    basetemp = tempfile.mkdtemp(prefix="pytest-", dir=copy.parent)
    return _child(copy, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-v", "-rA", f"--basetemp={basetemp}",
                  *args, timeout=600, **env)


def _verl_python() -> Path | None:
    """verl's environment where ``make test-verl`` names it (VERL_PYTHON); `make test` consults none, so
    the README's test command gives the same outcomes on a fresh clone and beside a built .venv-verl."""
    given = os.environ.get("VERL_PYTHON")  # make test-verl gives it relative to the project; the copy runs elsewhere
    return Path(given).absolute() if given and Path(given).is_file() else None


# ---------------------------------------------------------------------------------------------
# a new stage: what the test writes where the README says to
# ---------------------------------------------------------------------------------------------

SETUP_STAGE = "prompt_lengths"
ITERATION_STAGE = "advantage_signs"

SETUP_MODULE = '''"""Stage `prompt_lengths`: prompts/train.parquet → stats/prompt_lengths.json, the train prompts'
lengths against data.max_prompt_length."""

from __future__ import annotations

from typing import Annotated, Optional

import pyarrow.parquet as pq

from rlhf_core.config import RLHFConfig
from rlhf_core.config.reads import At, build, config_keys
from rlhf_core.errors import DataError
from rlhf_core.io.atomic import atomic_write_json
from rlhf_core.run.layout import RunDir
from rlhf_core.stages.base import StageResult, stage_record


def prompt_lengths_settings(budget: Annotated[int, At("data.max_prompt_length")]) -> int:
    return budget


def config_sections(cfg: RLHFConfig) -> tuple[str, ...]:
    return config_keys(prompt_lengths_settings)


def run_prompt_lengths(cfg: RLHFConfig, run: RunDir, iteration: Optional[int] = None,
                       force: bool = False) -> StageResult:
    if not run.train_prompts.is_file():
        raise DataError(f"{run.train_prompts} not found: run `rlhf stage preprocess --run-dir {run.root}` first")

    with stage_record(stage="prompt_lengths", cfg=cfg, run=run, iteration=None, inputs=[run.train_prompts],
                      config_sections=config_sections(cfg), force=force) as record:
        if record.skipped:
            return record.skipped
        budget = build(prompt_lengths_settings, cfg)
        lengths = pq.read_table(run.train_prompts, columns=["prompt_length"])["prompt_length"].to_pylist()
        metrics = {"prompt_lengths/max": float(max(lengths)), "prompt_lengths/budget_used": max(lengths) / budget}
        atomic_write_json(run.prompt_lengths, {"prompts": len(lengths), **metrics})
        return record.done(StageResult(stage="prompt_lengths", outputs={"summary": str(run.prompt_lengths)},
                                       rows={"prompts": len(lengths)}, metrics=metrics,
                                       summary=[f"{len(lengths)} prompts, the longest {max(lengths)} tokens"]))
'''

ITERATION_MODULE = '''"""Stage `advantage_signs`: iter_K/advantages.parquet → iter_K/advantage_signs.json,
the share of response tokens with a positive advantage."""

from __future__ import annotations

from typing import Optional

import pyarrow.parquet as pq

from rlhf_core.config import RLHFConfig
from rlhf_core.errors import DataError, RLHFError
from rlhf_core.io.atomic import atomic_write_json
from rlhf_core.run.layout import RunDir
from rlhf_core.stages.base import StageResult, stage_record


def config_sections(cfg: RLHFConfig) -> tuple[str, ...]:
    return ()


def run_advantage_signs(cfg: RLHFConfig, run: RunDir, iteration: Optional[int] = None,
                        force: bool = False) -> StageResult:
    if iteration is None or iteration < 1:
        raise RLHFError("advantage_signs is a per-iteration stage: give --iteration K (K >= 1)")
    advantages = run.advantages(iteration)
    if not advantages.is_file():
        raise DataError(f"{advantages} not found: run `rlhf stage gae --run-dir {run.root} -k {iteration}` first")

    with stage_record(stage="advantage_signs", cfg=cfg, run=run, iteration=iteration, inputs=[advantages],
                      config_sections=config_sections(cfg), force=force) as record:
        if record.skipped:
            return record.skipped
        rows = pq.read_table(advantages, columns=["advantages"])["advantages"].to_pylist()
        tokens = [a for row in rows for a in row]
        share = sum(a > 0 for a in tokens) / max(len(tokens), 1)
        atomic_write_json(run.advantage_signs(iteration), {"tokens": len(tokens), "positive": share})
        return record.done(StageResult(stage="advantage_signs", iteration=iteration,
                                       outputs={"signs": str(run.advantage_signs(iteration))},
                                       rows={"responses": len(rows)}, metrics={"advantage_signs/positive": share},
                                       summary=[f"{share:.0%} of {len(tokens)} tokens with a positive advantage"]))
'''

LAYOUT_NAMES = '''    @property
    def prompt_lengths(self) -> Path:
        return self.root / "stats" / "prompt_lengths.json"

    def advantage_signs(self, k: int) -> Path:
        return self.iter_dir(k) / "advantage_signs.json"

'''

SPECS = {  # the declaration, and the stage it goes before in the order
    "pack": '''        StageSpec("prompt_lengths", False,
                  "the train prompts' lengths against data.max_prompt_length → stats/prompt_lengths.json",
                  task="prompt-lengths"),
''',
    "update": '''        StageSpec("advantage_signs", True,
                  "the share of response tokens with a positive advantage → iter_K/advantage_signs.json",
                  task="advantage-signs", in_commit=True, rolled_back=True),
''',
}

CATALOG_ENTRIES = {  # the functions, imported, and the stage they go before in the catalog
    "pack": ("from rlhf_core.stages.prompt_lengths import run_prompt_lengths\n",
             '    "prompt_lengths": StageFunctions(run_prompt_lengths),\n'),
    "update": ("from rlhf_core.stages.advantage_signs import run_advantage_signs\n",
               '    "advantage_signs": StageFunctions(run_advantage_signs),\n'),
}

RECIPE_IMPORT = "from rlhf_core.stages.advantage_signs import run_advantage_signs\n"
RECIPE_STEP = '''        #    The share of tokens with a positive advantage, before the update uses them.
        steps.stage(run_advantage_signs, cfg)

'''
"""The iteration stage's step in flows/recipe.py, before the update (a comment continuing step 4's)."""

ROWS = {  # the README's stage table row, and the stage whose row it goes before
    "pack": "| prompt_lengths | `rlhf stage prompt_lengths --run-dir RUN` | `prompts/train.parquet` | "
            "`stats/prompt_lengths.json` |\n",
    "update": "| advantage_signs | `rlhf stage advantage_signs --run-dir RUN -k K` | advantages | "
              "`iter_K/advantage_signs.json` |\n",
}


def _stage_steps() -> str:
    """The numbered steps of the README's stage recipe."""
    steps = re.findall(r"^\d\. .*?(?=^\d\. |^\s*$)", _recipe("A new stage"), flags=re.MULTILINE | re.DOTALL)
    assert len(steps) == 4, f"the stage recipe's numbered steps changed: {steps}"
    return "".join(steps)


def _add_stages(copy: Path) -> None:
    """The README's stage recipe, step by step, for a setup stage and an in-commit iteration stage."""
    steps = _stage_steps()
    named = _named(steps)
    # 1. the module, with run_<name> and config_sections; the names of the files it writes in the layout
    assert {"rlhf_core/stages/<name>.py", "config_sections(cfg)", "with stage_record(...) as record:",
            "rlhf_core/run/layout.py", "config_keys(<name>_settings)", "build(<name>_settings, cfg)",
            "rlhf_core/config/reads.py"} <= named
    assert "run_<name>(cfg, run, iteration=None, force=False) -> StageResult" in named
    (copy / "rlhf_core" / "stages" / f"{SETUP_STAGE}.py").write_text(SETUP_MODULE, encoding="utf-8")
    (copy / "rlhf_core" / "stages" / f"{ITERATION_STAGE}.py").write_text(ITERATION_MODULE, encoding="utf-8")
    _insert(copy / "rlhf_core" / "run" / "layout.py", LAYOUT_NAMES, before="    def iter_dir(self, k: int) -> Path:\n")
    # 2. one StageSpec each in the stage order, at its place, and its function in the catalog
    assert {"StageSpec", "rlhf_core/run/stage_order.py", "in_commit=True", "rolled_back=True",
            "rlhf_core/stages/catalog.py", "StageFunctions(run_<name>)"} <= named
    catalog = copy / "rlhf_core" / "stages" / "catalog.py"
    for following, spec in SPECS.items():
        _insert(copy / "rlhf_core" / "run" / "stage_order.py", spec, before=f'        StageSpec("{following}",')
        imported, entry = CATALOG_ENTRIES[following]
        _insert(catalog, imported, before="from rlhf_core.stages.base import StageResult\n")
        _insert(catalog, entry, before=f'    "{following}": StageFunctions(')
    # 3. the iteration stage's numbered step in the recipe, at its place, its function imported there
    assert {"flows/recipe.py", "steps.stage(run_<name>, cfg)"} <= named
    _insert(copy / "flows" / "recipe.py", RECIPE_IMPORT, before="from tasks.breach import handle_breach_task\n")
    _insert(copy / "flows" / "recipe.py", RECIPE_STEP, before="        steps.stage(run_update, cfg)\n")
    # 4. its row in the README's stage table
    assert "the stage table above" in steps
    for following, row in ROWS.items():
        _insert(copy / "docs" / "guide.md", row, before=f"| {following} | `rlhf stage {following} ")


# ---------------------------------------------------------------------------------------------
# a new advantage estimator and a new reward
# ---------------------------------------------------------------------------------------------


def _estimator_name() -> str:
    (example,) = _python_blocks(_recipe("A new advantage estimator"))
    return re.search(r'@register_adv_estimator\("(\w+)"\)', example).group(1)


def _add_estimator(copy: Path) -> str:
    """The README's example in the module it names, and the name listed as our own where it says."""
    recipe = _recipe("A new advantage estimator")
    (example,) = _python_blocks(recipe)
    home = re.search(r"registered under its name in\s+`([\w/]+\.py)`", recipe).group(1)
    with open(copy / home, "a", encoding="utf-8") as module:
        module.write("\n\n" + example)
    listed = re.search(r"a name of our own goes into `OUR_OWN` in\s+`([\w/]+\.py)`", recipe).group(1)
    entry = f'    "advantage estimator": {{"{_estimator_name()}": "the README example: the sign of the reward"}},\n'
    _insert(copy / listed, entry, after="OUR_OWN: dict[str, dict[str, str]] = {\n")
    return _estimator_name()


def _reward_command() -> list[str]:
    """The README's `rlhf run ...` line for a reward function, as arguments."""
    command = re.search(r"`(rlhf run [^`]*custom_reward_function[^`]*)`", _recipe("A new reward")).group(1)
    return command.split()[1:]


# ---------------------------------------------------------------------------------------------
# a new verl key
# ---------------------------------------------------------------------------------------------

VERL_KEY = "data.dataloader_num_workers"
FIELD = '''    dataloader_num_workers: int = 8
    """verl: worker processes that read the prompts (a field here only to show the recipe)."""
'''
RULE = '''        require(self.dataloader_num_workers >= 0, f"{key}.dataloader_num_workers", "must be >= 0",
                self.dataloader_num_workers)
'''
VERL_KEY_ENTRY = f'"{VERL_KEY}": _DATA, '


def _add_verl_key(copy: Path) -> None:
    """The README's verl-key recipe for a key verl_keys.py lists as having no effect here: a field
    with verl's name and default in its section, its docstring, its rule in the section's check."""
    recipe = _recipe("A new verl key")
    assert {"rlhf_core/config/schema.py", "rlhf_core/config/verl_keys.py", "NO_EFFECT", "require(...)",
            "check(key)", "tests/rlhf_core/config/test_verl_keys.py"} <= _named(recipe)
    assert VERL_KEY_ENTRY in (copy / "rlhf_core" / "config" / "verl_keys.py").read_text()
    schema = copy / "rlhf_core" / "config" / "schema.py"
    _insert(schema, FIELD, before="    dedup: bool = True\n")
    _insert(schema, RULE, before='        require(len(self.train_files) > 0, f"{key}.train_files"')


# ---------------------------------------------------------------------------------------------
# the copy with every recipe applied, its run and its checks
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A copy of the project with every recipe of the Extending section applied."""
    copy = _copy(tmp_path_factory.mktemp("extended") / "project")
    _add_stages(copy)
    _add_estimator(copy)
    (reward,) = _python_blocks(_recipe("A new reward"))
    (copy / "my_reward.py").write_text(reward, encoding="utf-8")
    _add_verl_key(copy)
    return copy


@pytest.fixture(scope="module")
def extended(project, prefect_server):
    """One 1-iteration `rlhf run` of the copy: the README's reward command plus the estimator's
    override, on the shrunk demo."""
    root = project.parent
    override = re.search(r"`(algorithm\.adv_estimator=\w+)`", _recipe("A new advantage estimator")).group(1)
    assert override == f"algorithm.adv_estimator={_estimator_name()}"
    proc = _child(project, "-m", "rlhf_cli.main", *_reward_command(), override, f"trainer.runs_root={root / 'runs'}",
                  *SHRUNK, "--iterations", "1", "--run-name", "extended", timeout=900,
                  PREFECT_API_URL=prefect_server, RLHF_HOME=str(root / "home"))
    _ok(proc)
    from rlhf_core.run.layout import RunDir

    return SimpleNamespace(copy=project, run=RunDir(root / "runs" / "extended"))


CHECKS = ("tests/rlhf_core/run/test_stage_order.py", "tests/flows/test_recipe.py", "tests/test_layers.py", "tests/conformance",
          "tests/rlhf_core/config/test_verl_keys.py")


@pytest.fixture(scope="module")
def copy_checks(project):
    """The copy's own checks the recipes name, in one session of its tests: the stage table and
    tasks, the layers, the conformance step's names (with verl 0.9.1 itself under ``make test-verl``) and the schema against verl_keys.py. Returns the outcome
    of each test (``PASSED`` / ``FAILED`` / ``SKIPPED``) and the session's output."""
    verl = _verl_python()
    env = {"VERL_PYTHON": str(verl), "RLHF_REQUIRE_VERL": "1"} if verl else {}
    selected = (f"test_stage_order or test_recipe or test_layers or registered_name or our_own_names or {_estimator_name()} "
                f"or no_key_is_both_a_schema_field")
    proc = _pytest(project, *CHECKS, "-k", selected, **env)
    # the verbose lines, "path::test OUTCOME [ n%]": the summary's skip lines name a file and line, not the test
    outcomes = dict(re.findall(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR)\b", proc.stdout, flags=re.MULTILINE))
    assert outcomes, proc.stdout[-3000:] + proc.stderr[-3000:]
    return SimpleNamespace(outcomes=outcomes, output=proc.stdout, verl=verl is not None)


# ---------------------------------------------------------------------------------------------
# the stage recipe
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.prefect
def test_the_flow_runs_both_new_stages_in_their_places(extended):
    run = extended.run
    setup = json.loads(run.manifest_path(None).read_text())
    assert [setup[s]["status"] for s in ("preprocess", SETUP_STAGE, "pack")] == ["done"] * 3
    assert setup["preprocess"]["started_at"] < setup[SETUP_STAGE]["started_at"] < setup["pack"]["started_at"]
    lengths = json.loads((run.root / "stats" / "prompt_lengths.json").read_text())
    prompts = pq.read_table(run.train_prompts, columns=["prompt_length"])["prompt_length"].to_pylist()
    assert lengths["prompts"] == len(prompts) and lengths["prompt_lengths/max"] == max(prompts)
    iteration = json.loads(run.manifest_path(1).read_text())
    assert [iteration[s]["status"] for s in ("gae", ITERATION_STAGE, "update")] == ["done"] * 3
    assert iteration["gae"]["started_at"] < iteration[ITERATION_STAGE]["started_at"] < iteration["update"]["started_at"]
    signs = json.loads((run.iter_dir(1) / "advantage_signs.json").read_text())
    tokens = [a for row in pq.read_table(run.advantages(1))["advantages"].to_pylist() for a in row]
    assert signs == {"tokens": len(tokens), "positive": sum(a > 0 for a in tokens) / len(tokens)}
    assert json.loads(run.last_good_path.read_text())["committed"] == [1]


@pytest.mark.slow
def test_the_new_stages_are_prefect_tasks_commands_and_flow_choices(project):
    facts = json.loads(_ok(_child(project, "-c", """
import json
from flows.stage import StageParams
from rlhf_core.run import stage_order
from tasks.stages import STAGE_TASKS
print(json.dumps({"tasks": {n: t.name for n, t in STAGE_TASKS.items()}, "setup": stage_order.SETUP_STAGES,
                  "commit": stage_order.ITERATION_STAGES, "rolled_back": stage_order.ROLLED_BACK_STAGES,
                  "choices": StageParams.model_json_schema()["properties"]["stage"]["enum"]}))
""")).splitlines()[-1])
    assert facts["tasks"][SETUP_STAGE] == "prompt-lengths" and facts["tasks"][ITERATION_STAGE] == "advantage-signs"
    assert facts["setup"] == ["warm_start", "init_critic", "preprocess", SETUP_STAGE, "pack"]
    assert facts["commit"] == ["rollout", "score", "gae", ITERATION_STAGE, "update", "guard"]
    assert ITERATION_STAGE in facts["rolled_back"]
    listing = re.search(r"\{([\w,]+)\}", _ok(_child(project, "-m", "rlhf_cli.main", "stage", "--help"))).group(1)
    assert listing.split(",") == facts["choices"] == list(facts["tasks"])
    usage = _ok(_child(project, "-m", "rlhf_cli.main", "stage", ITERATION_STAGE, "--help"))
    assert "--iteration" in usage and "positive advantage" in usage


@pytest.mark.slow
def test_the_copys_checks_hold_the_new_stages_to_their_declaration(copy_checks):
    """The tests the README names (the config-reads trace, which runs every stage, is the suite's)."""
    assert {"tests/rlhf_core/run/test_stage_order.py", "tests/flows/test_recipe.py", "tests/test_layers.py",
            "tests/rlhf_core/stages/test_config_reads.py"} <= _named(_recipe("A new stage"))
    ran = {test: outcome for test, outcome in copy_checks.outcomes.items()
           if test.startswith(("tests/rlhf_core/run/test_stage_order.py", "tests/flows/test_recipe.py",
                               "tests/test_layers.py"))}
    failed = [test for test, outcome in ran.items() if outcome != "PASSED"]
    assert len(ran) >= 13 and not failed, f"{failed}\n{copy_checks.output[-4000:]}"
    assert any(t.startswith("tests/flows/test_recipe.py") for t in ran), ran


# ---------------------------------------------------------------------------------------------
# the estimator and reward recipes
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_conformance_step_takes_the_estimator_as_a_name_of_our_own(copy_checks):
    """No case is built for it (make test-verl failed on every one: verl has no such estimator), and
    the names check passes — against verl 0.9.1 itself where its environment is built."""
    conformance = {test.rpartition("::")[2]: outcome for test, outcome in copy_checks.outcomes.items()
                   if test.startswith("tests/conformance/")}
    assert conformance == {"test_every_registered_name_is_compared_or_listed_as_ours": "PASSED",
                           "test_our_own_names_are_not_verls": "PASSED" if copy_checks.verl else "SKIPPED"}
    assert _estimator_name() not in copy_checks.output


@pytest.mark.slow
@pytest.mark.prefect
def test_the_estimator_runs_in_the_flow_without_a_critic(extended):
    """Its function names no ``values``: the run builds no critic, and every token's advantage is
    the sign of its response's reward."""
    assert not extended.run.critic_init.exists()
    checkpoint = extended.run.checkpoint(1)
    assert (checkpoint / "actor").is_dir() and not (checkpoint / "critic").exists()
    import torch

    table = pq.read_table(extended.run.advantages(1)).to_pylist()
    assert table and all(row["response_mask"] is None for row in table)
    for row in table:  # every token: the sign of the response's (KL-shaped) reward
        sign = float(torch.sign(torch.tensor(row["token_level_rewards"], dtype=torch.float32).sum()))
        assert row["advantages"] == [sign] * len(row["advantages"]) == row["returns"], row["prompt_id"]


@pytest.mark.slow
@pytest.mark.prefect
def test_the_reward_scores_every_row_of_the_run_in_its_own_process(extended):
    saved = extended.run.config_path.read_text()
    assert "path: my_reward.py" in saved and "name: compute_score" in saved
    namespace: dict = {}
    exec(_python_blocks(_recipe("A new reward"))[0], namespace)
    rows = pq.read_table(extended.run.scored(1), columns=["response_text", "ground_truth", "data_source",
                                                          "reward"]).to_pylist()
    assert rows and [row["reward"] for row in rows] == [
        namespace["compute_score"](row["data_source"], row["response_text"], row["ground_truth"]) for row in rows]
    scores = json.loads(_ok(_child(extended.copy, "-c", """
import json
from rlhf_core.config import load_config
from rlhf_core.rewards.registry import UserReward, reward_function
cfg = load_config(None, ["custom_reward_function.path=my_reward.py", "custom_reward_function.name=compute_score"])
with reward_function(cfg.custom_reward_function) as score:
    print(json.dumps([score("anything", "so the answer is 42", "42"), score("anything", "no idea", "42"),
                      isinstance(score, UserReward)]))
""")).splitlines()[-1])
    assert scores == [1.0, 0.0, True]


# ---------------------------------------------------------------------------------------------
# the verl key recipe
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_verl_key_made_a_field_must_leave_verl_keys(project, copy_checks):
    """The copy's check fails naming the NO_EFFECT entry to remove; removed, the field loads with
    its rule and the check holds."""
    check = "tests/rlhf_core/config/test_verl_keys.py::test_no_key_is_both_a_schema_field_and_a_verl_keys_entry"
    assert copy_checks.outcomes[check] == "FAILED"
    assert (f"{VERL_KEY}: a field of rlhf_core/config/schema.py and listed in NO_EFFECT" in copy_checks.output
            and "remove it from NO_EFFECT" in copy_checks.output), copy_checks.output[-3000:]
    keys = project / "rlhf_core" / "config" / "verl_keys.py"
    keys.write_text(keys.read_text().replace(VERL_KEY_ENTRY, ""))
    loaded = _ok(_child(project, "-c", f"""
from rlhf_core.config import ConfigError, load_config, valid_keys, verl_keys
print(verl_keys.entries_shadowing_fields(valid_keys()))
print(load_config(None, ["{VERL_KEY}=3"]).data.dataloader_num_workers)
try:
    load_config(None, ["{VERL_KEY}=-1"])
except ConfigError as exc:
    print(exc)
"""))
    assert loaded.splitlines()[-3:] == ["[]", "3", f"{VERL_KEY}=-1: must be >= 0"]

