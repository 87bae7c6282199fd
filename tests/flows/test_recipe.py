"""The recipe (flows/recipe.py) is the iteration the flow runs: its steps are the declared iteration
stages, in their order, numbered, in a file a newcomer reads in one sitting."""

from __future__ import annotations

import ast
import inspect
import re

from flows import pipeline, recipe
from rlhf_core.run.stage_order import ITERATION_STAGES
from rlhf_core.stages.catalog import stage_name

SOURCE = inspect.getsource(recipe)


def _stage_calls(function) -> list[str]:
    """The names of the stages ``function`` runs through ``Attempt.stage``, in source order: each is
    called by its function, a name of the recipe's module (what go-to-definition follows)."""
    tree = ast.parse(inspect.getsource(function))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "stage"]
    calls.sort(key=lambda n: (n.lineno, n.col_offset))
    return [stage_name(getattr(recipe, c.args[0].id)) for c in calls]


def test_the_recipe_runs_every_iteration_stage_in_the_declared_order():
    assert _stage_calls(recipe.ppo_iteration) == list(ITERATION_STAGES), (
        "flows/recipe.py ppo_iteration must run each stage declared in_commit (run/stage_order.py), in "
        "the declared order: give a new iteration stage its numbered step there")


def test_the_steps_are_numbered_in_order_and_the_file_stays_short():
    body = inspect.getsource(recipe.ppo_iteration)
    numbers = [int(n) for n in re.findall(r"^\s*# (\d)\. ", body, flags=re.M)]
    assert numbers == list(range(1, len(numbers) + 1)) and len(numbers) >= 8, numbers
    overview = [int(n) for n in re.findall(r"^  (\d)\. ", recipe.__doc__, flags=re.M)]
    assert overview == numbers, "the module docstring's overview lists the same steps as the code"
    assert len(SOURCE.splitlines()) <= 200


def test_the_pipeline_runs_its_iterations_through_the_recipe():
    assert pipeline.ppo_iteration is recipe.ppo_iteration
    assert "ppo_iteration(" in inspect.getsource(pipeline.iterate)
