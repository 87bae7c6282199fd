"""The held models of a run session: what a flow run keeps in memory, passed to each stage call. A
loader asked with a session that holds a checkpoint directory lends the held module; an empty
session (a CLI rerun) reads the directory from disk; two sessions in one process never see each
other's models."""

from __future__ import annotations

import shutil
import weakref

import pytest
import torch

from rlhf_core.errors import CheckpointError
from rlhf_core.models.live import LiveModel
from rlhf_core.scoring import cache
from rlhf_core.scoring.models import load_causal_lm, load_tokenizer, reference_policy, release
from rlhf_core.scoring.held import HeldModels

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _no_model_cache(monkeypatch):
    monkeypatch.setenv(cache.BUDGET_ENV, "0")  # every disk read is a fresh load: identity tells them apart
    cache.clear()


def test_a_session_lends_what_it_holds_and_an_empty_one_reads_the_disk(tiny_model_dir, tmp_path):
    checkpoint = tmp_path / "iter_1" / "checkpoint" / "actor"  # held in memory only: no files there
    module = load_causal_lm(tiny_model_dir, CPU, torch.float32, session=HeldModels())
    flow = HeldModels()
    flow.live.hold(checkpoint, LiveModel(module, "causal_lm", tiny_model_dir))

    assert load_causal_lm(checkpoint, CPU, torch.float32, session=flow) is module
    assert load_tokenizer(checkpoint, session=flow).name_or_path == str(tiny_model_dir)  # the one it would copy
    with pytest.raises(CheckpointError, match="missing config.json"):  # a CLI rerun finds no checkpoint
        load_causal_lm(checkpoint, CPU, torch.float32, session=HeldModels())
    with pytest.raises(CheckpointError, match="asked for"):  # lent only in the arithmetic asked for
        load_causal_lm(checkpoint, CPU, torch.float64, session=flow)
    flow.live.drop(tmp_path)
    assert flow.live.lookup(checkpoint) is None


def test_two_sessions_hold_their_own_reference(tiny_model_dir, tmp_path):
    reference = tmp_path / "reference"
    shutil.copytree(tiny_model_dir, reference)
    one, two = HeldModels(), HeldModels()
    with reference_policy(reference, CPU, torch.float32, "sdpa", False, session=one) as first:
        pass
    with reference_policy(reference, CPU, torch.float32, "sdpa", False, session=two) as second:
        pass
    assert first is not second
    assert one.frozen.held_model("reference") is first and two.frozen.held_model("reference") is second
    with reference_policy(reference, CPU, torch.float32, "sdpa", False, session=one) as again:
        assert again is first  # held for the run: not read again
    assert one.holds(first) and not two.holds(first)


def test_release_leaves_what_the_session_keeps(tiny_model_dir, tmp_path):
    reference = tmp_path / "reference"
    shutil.copytree(tiny_model_dir, reference)
    session = HeldModels()
    with reference_policy(reference, CPU, torch.float32, "sdpa", False, session=session) as model:
        alive = weakref.ref(model)
    del model
    release(alive, CPU, session)
    assert alive() is session.frozen.held_model("reference") is not None
    session.frozen.drop()
    assert alive() is None  # the session was its last holder
