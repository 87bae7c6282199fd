"""The reference's last hidden states kept from the score stage's pass for the KL guard
(``scoring.ref_states``): the guard's exact KL on them is the KL on the reference's own forward."""

from __future__ import annotations

import shutil

import pytest
import torch

from rlhf_core.scoring import ref_states
from rlhf_core.scoring.logprobs import compute_token_logprobs
from rlhf_core.scoring.policy_kl import token_kl

F32 = torch.float32
KEPT = ref_states.RefStates()
"""One run session's kept states (``run.session.RunSession.ref_states``)."""


@pytest.fixture(autouse=True)
def _nothing_kept():
    KEPT.forget()
    yield
    KEPT.forget()


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=F32, attn_implementation="sdpa").eval()


def _sequences(n=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs, plens = [], []
    for _ in range(n):
        p, r = int(torch.randint(3, 12, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
        seqs.append(torch.randint(3, 500, (p + r,), generator=g).tolist())
        plens.append(p)
    return seqs, plens


@pytest.fixture
def models(tiny_model_dir, tmp_path):
    """(reference directory, reference, a moved actor)."""
    ref_dir = tmp_path / "reference"
    shutil.copytree(tiny_model_dir, ref_dir)
    actor = _load(ref_dir)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in actor.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3 * (p.abs().mean() + 1e-3))
    return ref_dir, _load(ref_dir), actor


def _score_reference(ref_dir, ref, seqs, plens, budget=64):
    """The score stage's reference pass, keeping the states as it does."""
    with KEPT.recording(ref_dir, F32, "sdpa") as record:
        states: dict = {}
        log_probs = compute_token_logprobs(ref, seqs, plens, budget, head_inputs=states)
        ref_states.keep(record, seqs, plens, states)
    return log_probs, states


def test_the_exact_kl_on_kept_states_is_the_kl_on_the_references_forward_bit_for_bit(models):
    ref_dir, ref, actor = models
    seqs, plens = _sequences()
    log_probs, states = _score_reference(ref_dir, ref, seqs, plens)
    assert sorted(states) == list(range(len(seqs)))
    assert all(states[i].shape == (len(s) - p, ref.config.hidden_size) for i, (s, p) in enumerate(zip(seqs, plens)))
    kept = KEPT.lookup(ref_dir, F32, "sdpa", seqs, plens)
    assert kept is not None
    # the kept states through the LM head give the pass's own log-probs back (to rounding: one sequence
    # at a time through the head here, the whole micro-batch in the pass)
    head = ref.get_output_embeddings()
    with torch.no_grad():
        for i, (state, lp) in enumerate(zip(kept, log_probs)):
            labels = torch.tensor(seqs[i][plens[i]:])
            again = torch.log_softmax(head(state).float(), -1).gather(1, labels[:, None])[:, 0]
            assert torch.allclose(again, lp, atol=1e-5, rtol=0)

    bodies = []  # the reference's transformer body runs only without the kept states
    hook = ref.model.register_forward_hook(lambda *_: bodies.append(1))
    with_states = token_kl(actor, ref, seqs, plens, budget=64, temperature=1.0, ref_head_inputs=kept)
    assert not bodies
    forward = token_kl(actor, ref, seqs, plens, budget=64, temperature=1.0)
    assert bodies
    hook.remove()
    for a, b in zip(with_states[0] + with_states[1], forward[0] + forward[1]):
        assert torch.equal(a, b)
    assert max(float(t.max()) for t in forward[0]) > 1e-3  # the actor did move: a KL worth measuring


def test_a_kept_state_serves_only_its_reference_its_dtype_and_its_sequences(models, tmp_path):
    ref_dir, ref, _ = models
    seqs, plens = _sequences()
    _score_reference(ref_dir, ref, seqs, plens)
    assert KEPT.lookup(ref_dir, F32, "sdpa", seqs[2:5], plens[2:5]) is not None  # any subset, in its order
    assert KEPT.lookup(ref_dir, torch.bfloat16, "sdpa", seqs, plens) is None
    assert KEPT.lookup(ref_dir, F32, "eager", seqs, plens) is None
    other, _ = _sequences(seed=1)
    assert KEPT.lookup(ref_dir, F32, "sdpa", other, plens) is None
    moved = list(plens)
    moved[0] += 1  # the same tokens with another prompt length are other positions
    assert KEPT.lookup(ref_dir, F32, "sdpa", seqs, moved) is None
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(ref_dir, elsewhere)
    assert KEPT.lookup(elsewhere, F32, "sdpa", seqs, plens) is None
    (ref_dir / "config.json").write_text((ref_dir / "config.json").read_text() + " ")  # the directory changed
    assert KEPT.lookup(ref_dir, F32, "sdpa", seqs, plens) is None


def test_nothing_is_kept_past_the_limit(models, monkeypatch):
    ref_dir, ref, _ = models
    seqs, plens = _sequences()
    monkeypatch.setattr(ref_states, "KEEP_LIMIT_BYTES", 4 * ref.config.hidden_size * 5)  # five positions' worth
    _score_reference(ref_dir, ref, seqs, plens)
    assert KEPT.lookup(ref_dir, F32, "sdpa", seqs[:1], plens[:1]) is None


def test_the_next_pass_replaces_what_the_last_one_kept(models):
    ref_dir, ref, _ = models
    first, plens = _sequences(seed=2)
    _score_reference(ref_dir, ref, first, plens)
    second, plens2 = _sequences(seed=3)
    _score_reference(ref_dir, ref, second, plens2)
    assert KEPT.lookup(ref_dir, F32, "sdpa", first, plens) is None
    assert KEPT.lookup(ref_dir, F32, "sdpa", second, plens2) is not None
