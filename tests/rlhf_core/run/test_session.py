"""The run session types its trainer by what the stages ask of it: both trainers a session can keep
answer every call of ``KeptTrainer`` with its signature."""

from __future__ import annotations

import inspect

import pytest

from rlhf_core.run.session import KeptTrainer, RunSession
from rlhf_core.scoring.held import HeldModels
from rlhf_core.training.group_trainer import GroupTrainer
from rlhf_core.training.resident import ResidentTrainer


def _calls(cls) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(member) for name, member in vars(cls).items()
            if callable(member) and not name.startswith("_")}


@pytest.mark.parametrize("trainer", [ResidentTrainer, GroupTrainer])
def test_each_kept_trainer_answers_what_the_session_asks_of_it(trainer):
    for name, wanted in _calls(KeptTrainer).items():
        assert hasattr(trainer, name), f"{trainer.__name__} lacks {name}{wanted}"
        assert inspect.signature(getattr(trainer, name)) == wanted, (name, inspect.signature(getattr(trainer, name)))
    assert "holds" in KeptTrainer.__annotations__


def test_a_new_session_holds_nothing_and_is_the_held_models_of_the_passes_below():
    session = RunSession()
    assert isinstance(session, HeldModels) and session.trainer is None
    assert list(session.live.held_directories()) == []
    assert repr(session) == "RunSession(held=[], trainer=None)"
