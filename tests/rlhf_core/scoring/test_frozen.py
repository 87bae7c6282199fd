"""The run's frozen models (reference policy, reward model): read once per process for the run
whatever the model cache's budget, and with param_offload kept in host memory between passes.

The offload path is checked with torch's ``meta`` device standing in for the accelerator: tensors
really leave the host for the pass and the host copies come back untouched (on CUDA the same code
moves them to the GPU)."""

from __future__ import annotations

import gc
import shutil
import weakref

import pytest
import torch

from rlhf_core.config import load_config
from rlhf_core.config.reads import build
from rlhf_core.io.timing import MODEL_LOAD, tally
from rlhf_core.rewards.reward_model import held_reward_model
from rlhf_core.scoring import cache, frozen
from rlhf_core.run.session import RunSession
from rlhf_core.scoring.models import load_causal_lm, reference_policy
from rlhf_core.scoring.policy_kl import actor_ref_kl
from rlhf_core.stages.settings import kl_pass

CPU = torch.device("cpu")
META = torch.device("meta")


@pytest.fixture(autouse=True)
def _nothing_cached(monkeypatch):
    monkeypatch.setenv(cache.BUDGET_ENV, "0")  # as on CUDA: the model cache holds nothing
    cache.clear()


@pytest.fixture
def session():
    """A flow run's session: the frozen models are held there, for the run."""
    return RunSession()


@pytest.fixture
def reference(tiny_model_dir, tmp_path):
    path = tmp_path / "reference"
    shutil.copytree(tiny_model_dir, path)
    return path


def loads(fn) -> float:
    with tally() as seconds:
        fn()
    return seconds.get(MODEL_LOAD, 0.0)


def test_the_reference_is_read_once_for_the_run_with_the_model_cache_off(reference, session):
    def one_pass():
        with reference_policy(reference, CPU, torch.float32, "sdpa", param_offload=False, session=session) as model:
            return model

    first_seconds = loads(one_pass)
    first = session.frozen.held_model("reference")
    assert first_seconds > 0 and first is not None
    assert loads(one_pass) == 0.0 and session.frozen.held_model("reference") is first  # not read again
    assert not first.training and not any(p.requires_grad for p in first.parameters())
    with reference_policy(reference, CPU, torch.float64, "sdpa", param_offload=False, session=session) as other:
        assert other is not first  # the dtype is part of what is held
    alive = weakref.ref(first)
    del first
    gc.collect()
    assert alive() is None  # one model per role: the float32 copy was let go


def test_a_rewritten_or_other_reference_is_read_afresh(reference, tmp_path, tiny_model_dir, session):
    with reference_policy(reference, CPU, torch.float32, "sdpa", param_offload=False, session=session) as first:
        pass
    (reference / "config.json").write_text((reference / "config.json").read_text() + "\n")
    with reference_policy(reference, CPU, torch.float32, "sdpa", param_offload=False, session=session) as rewritten:
        assert rewritten is not first
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    with reference_policy(other, CPU, torch.float32, "sdpa", param_offload=False, session=session) as moved:
        assert moved is not rewritten and session.frozen.held_model("reference") is moved


def test_offloaded_weights_leave_the_host_only_for_the_pass(reference, session):
    with reference_policy(reference, META, torch.float32, "sdpa", param_offload=True, session=session) as model:
        on_pass = {name: p.device for name, p in model.named_parameters()}
        buffers = {name: b.device for name, b in model.named_buffers()}
        assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied on the device
    assert set(on_pass.values()) == {META} and set(buffers.values()) <= {META}
    assert all(p.device == CPU for p in model.parameters()) and all(b.device == CPU for b in model.buffers())
    expected = load_causal_lm(reference, CPU, torch.float32, attention="sdpa", session=RunSession())
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), expected.state_dict().values()))
    host = {name: p.data_ptr() for name, p in model.named_parameters()}
    with reference_policy(reference, META, torch.float32, "sdpa", param_offload=True, session=session) as again:
        assert again is model  # held, not read again
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == host  # the same host copy


def test_without_offload_the_weights_stay_on_the_device(reference, session):
    with reference_policy(reference, META, torch.float32, "sdpa", param_offload=False, session=session) as model:
        pass
    assert all(p.device == META for p in model.parameters())
    assert not frozen.offloads(True, CPU)  # on CPU the device is the host: nothing to move


def test_the_guard_and_validation_kl_reuse_the_held_reference(reference, tiny_model_dir, session):
    cfg = load_config(overrides=["actor_rollout_ref.model.override_config.attn_implementation=sdpa"])
    sequences, prompts = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 11]], [3, 2]
    first, _ = actor_ref_kl(build(kl_pass, cfg), session, tiny_model_dir, reference, sequences, prompts)
    held = session.frozen.held_model("reference")
    assert held is not None
    actor_ref_kl(build(kl_pass, cfg), session, tiny_model_dir, reference, sequences, prompts)
    assert session.frozen.held_model("reference") is held  # the actor is read again (the cache is off), not the reference
    assert [len(kl) for kl in first] == [3, 2]
    assert [float(x) for kl in first for x in kl] == pytest.approx([0.0] * 5, abs=1e-6)  # actor = reference


def test_the_reward_model_is_held_and_placed_like_the_reference(tiny_model_dir, tmp_path, monkeypatch, session):
    from transformers import AutoModelForSequenceClassification

    rm_dir = tmp_path / "rm"
    torch.manual_seed(3)
    AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1).save_pretrained(rm_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, rm_dir / name)
    monkeypatch.delenv(cache.BUDGET_ENV)  # the tokenizer may be cached (the model never is)

    def one_pass():
        with held_reward_model(rm_dir, CPU, torch.float32, session=session) as rm:
            return rm

    assert loads(one_pass) > 0
    first = session.frozen.held_model("reward_model")
    assert loads(one_pass) == 0.0 and session.frozen.held_model("reward_model") is first
    with held_reward_model(rm_dir, META, torch.float32, param_offload=True, session=session) as offloaded:
        assert all(p.device == META for p in offloaded.model.parameters())
    assert offloaded.model is not first  # another placement: read afresh, the old one let go
    assert all(p.device == CPU for p in offloaded.model.parameters())
