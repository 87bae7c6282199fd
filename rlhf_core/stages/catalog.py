"""Every stage's functions, under the name its declaration gives it (``run.stage_order.STAGES``: the
order and what the run's state needs to know of each stage). Imported, not named by strings: a reader
(and an editor's go-to-definition) goes from here, from the recipe (``flows/recipe.py``) and from a
Prefect task (``tasks/stages.py``) straight into the stage.

    run_<stage>(cfg, run, iteration=None, force=False[, session=None]) -> StageResult
    <stage>_share(cfg, run, iteration, rank, world, out, session) -> None

A stage function that takes ``session`` gets the flow run's models in memory (``run.session``);
its share, when it has one, is what each process runs of its model passes spread over several
(``stages.ranks``, ``stages.rank_entry``, a worker group's rank: ``stages.group_entry``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Optional

from rlhf_core.errors import RLHFError
from rlhf_core.run.stage_order import STAGES
from rlhf_core.stages.base import StageResult
from rlhf_core.stages.gae import run_gae
from rlhf_core.stages.guard import guard_share, run_guard
from rlhf_core.stages.init_critic import run_init_critic
from rlhf_core.stages.pack import run_pack
from rlhf_core.stages.preprocess import run_preprocess
from rlhf_core.stages.rollout import rollout_share, run_rollout
from rlhf_core.stages.score import run_score, score_share
from rlhf_core.stages.update import run_update
from rlhf_core.stages.validate import run_validate, validate_share
from rlhf_core.stages.warm_start import run_warm_start


@dataclass(frozen=True)
class StageFunctions:
    run: Callable[..., StageResult]
    share: Optional[Callable[..., None]] = None
    """What each process runs when the stage's model passes are spread over several; None: the
    stage runs in one process."""

    @property
    def uses_models(self) -> bool:
        """Whether the stage takes the flow run's session (its signature names ``session``)."""
        return "session" in inspect.signature(self.run).parameters


CATALOG: dict[str, StageFunctions] = {
    "warm_start": StageFunctions(run_warm_start),
    "init_critic": StageFunctions(run_init_critic),
    "preprocess": StageFunctions(run_preprocess),
    "pack": StageFunctions(run_pack),
    "rollout": StageFunctions(run_rollout, share=rollout_share),
    "score": StageFunctions(run_score, share=score_share),
    "gae": StageFunctions(run_gae),
    "update": StageFunctions(run_update),
    "guard": StageFunctions(run_guard, share=guard_share),
    "validate": StageFunctions(run_validate, share=validate_share),
}
"""Every declared stage, in the declared order (checked below, as this module loads)."""

if list(CATALOG) != list(STAGES):
    raise RLHFError(f"rlhf_core/stages/catalog.py lists {list(CATALOG)}, but rlhf_core/run/stage_order.py declares "
                    f"{list(STAGES)}: give each declared stage its functions here, in the same order")

SHARED = tuple(name for name, functions in CATALOG.items() if functions.share is not None)
"""The stages whose model passes can be spread over several processes."""


def stage_functions(name: str) -> StageFunctions:
    if name not in CATALOG:
        raise RLHFError(f"unknown stage {name!r}; valid stages: {', '.join(CATALOG)}")
    return CATALOG[name]


def stage_name(function: Callable[..., StageResult]) -> str:
    """The declared name of stage function ``function`` (the recipe calls stages by their functions)."""
    for name, functions in CATALOG.items():
        if functions.run is function:
            return name
    raise RLHFError(f"{getattr(function, '__qualname__', function)!r} is not a stage function of "
                    "rlhf_core/stages/catalog.py")
