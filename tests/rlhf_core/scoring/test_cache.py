"""The shared model cache: one load per unchanged directory, never a removed or rewritten one."""

from __future__ import annotations

import gc
import shutil
import weakref

import pytest
import torch

from rlhf_core.io.atomic import atomic_dir
from rlhf_core.scoring import cache
from rlhf_core.scoring.models import load_causal_lm, load_tokenizer, release
from rlhf_core.run.session import RunSession

DISK = RunSession()  # nothing held in memory: every model is read from its directory

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _empty_cache():
    cache.clear()
    yield
    cache.clear()


@pytest.fixture
def model_copy(tiny_model_dir, tmp_path):
    """A checkpoint-like copy of the tiny model the test may replace or delete."""
    path = tmp_path / "iter_1" / "checkpoint" / "actor"
    shutil.copytree(tiny_model_dir, path)
    return path


def test_shared_load_is_one_frozen_model_per_directory(model_copy):
    a = load_causal_lm(model_copy, CPU, torch.float32, shared=True, session=DISK)
    b = load_causal_lm(model_copy, CPU, torch.float32, shared=True, session=DISK)
    assert a is b and cache.holds(a)
    assert not a.training and not any(p.requires_grad for p in a.parameters())
    assert load_causal_lm(model_copy, CPU, torch.float32, session=DISK) is not a  # not shared: a private copy
    assert load_causal_lm(model_copy, CPU, torch.float64, shared=True, session=DISK) is not a  # dtype is in the key
    assert load_tokenizer(model_copy, shared=True, session=DISK) is load_tokenizer(model_copy, shared=True, session=DISK)


def test_a_rewritten_directory_is_loaded_afresh(model_copy, tiny_model_dir):
    first = load_causal_lm(model_copy, CPU, torch.float32, shared=True, session=DISK)
    with atomic_dir(model_copy) as tmp:  # the update writing the same iteration's checkpoint again
        shutil.copytree(tiny_model_dir, tmp, dirs_exist_ok=True)
    second = load_causal_lm(model_copy, CPU, torch.float32, shared=True, session=DISK)
    assert second is not first and not cache.holds(first)


def test_a_discarded_checkpoint_is_never_served_and_its_entry_goes(model_copy, tiny_model_dir, tmp_path):
    first = load_causal_lm(model_copy, CPU, torch.float32, shared=True, session=DISK)
    shutil.rmtree(model_copy)  # a rollback discards the checkpoint
    from rlhf_core.errors import CheckpointError

    with pytest.raises(CheckpointError):
        load_causal_lm(model_copy, CPU, torch.float32, shared=True, session=DISK)
    load_causal_lm(tiny_model_dir, CPU, torch.float32, shared=True, session=DISK)  # any miss drops entries of gone directories
    assert not cache.holds(first)
    shutil.copytree(tiny_model_dir, model_copy)  # a retry writes the same path again
    assert load_causal_lm(model_copy, CPU, torch.float32, shared=True, session=DISK) is not first


def test_budget_zero_turns_it_off_and_cuda_is_off_by_default(model_copy, monkeypatch):
    monkeypatch.setenv(cache.BUDGET_ENV, "0")
    a = load_causal_lm(model_copy, CPU, torch.float32, shared=True, session=DISK)
    assert load_causal_lm(model_copy, CPU, torch.float32, shared=True, session=DISK) is not a and not cache.holds(a)
    monkeypatch.delenv(cache.BUDGET_ENV)
    assert cache.budget_bytes("cuda") == 0 and cache.budget_bytes("cpu") > 0
    monkeypatch.setenv(cache.BUDGET_ENV, "lots")
    with pytest.raises(ValueError, match=cache.BUDGET_ENV):
        cache.budget_bytes("cpu")


def test_least_recently_used_goes_first(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "MAX_ENTRIES", 2)
    paths = []
    for i in range(3):
        paths.append(tmp_path / f"m{i}")
        shutil.copytree(tiny_model_dir, paths[-1])
    models = [load_causal_lm(p, CPU, torch.float32, shared=True, session=DISK) for p in paths]
    assert [cache.holds(m) for m in models] == [False, True, True]


def test_release_frees_a_private_model_and_keeps_a_shared_one(model_copy):
    private = load_causal_lm(model_copy, CPU, torch.float32, session=DISK)
    alive = weakref.ref(private)
    del private
    release(alive, CPU, DISK)
    assert alive() is None
    shared = load_causal_lm(model_copy, CPU, torch.float32, shared=True, session=DISK)
    alive = weakref.ref(shared)
    del shared
    collections = gc.get_stats()[2]["collections"]
    release(alive, CPU, DISK)
    assert alive() is not None  # the cache keeps it for the next stage
    assert gc.get_stats()[2]["collections"] == collections  # and no full collection was paid for nothing
