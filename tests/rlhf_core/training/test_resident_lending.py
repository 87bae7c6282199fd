"""The resident trainer lends its modules to the stages (rollout, score, guard) between updates. A
lent module must compute the bits its checkpoint gives when loaded from disk — a resumed run loads
it, the uninterrupted run borrows it, and their numbers must agree — and must train as before once
it is withdrawn."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.rollout.base import SamplingParams
from rlhf_core.rollout.hf import HFEngine
from rlhf_core.run.layout import RunDir
from rlhf_core.scoring.models import load_causal_lm
from rlhf_core.run.session import RunSession
from rlhf_core.training.resident import ResidentTrainer

pytestmark = pytest.mark.deepspeed


def _lending_trainer(run: RunDir, actor, critic, dist, session: RunSession) -> ResidentTrainer:
    """A resident trainer of ``session`` holding ``actor``/``critic`` as iteration 1's state."""
    trainer = ResidentTrainer(run, session.live)
    trainer.actor, trainer.critic, trainer.dist, trainer.holds = actor, critic, dist, 1
    return trainer


def test_a_lent_module_gives_the_bits_of_its_reloaded_checkpoint(make_engines, dist, tmp_path):
    _, actor, critic = make_engines(0)
    trained = {n for n, _ in actor.named_trainable()}
    run = RunDir(tmp_path / "run")
    saved = tmp_path / "saved_actor"
    actor.module.save_pretrained(saved)
    session = RunSession()
    trainer = _lending_trainer(run, actor, critic, dist, session)
    trainer._offer()
    try:
        lent = session.live.lookup(run.checkpoint(1) / "actor")
        assert RunSession().live.lookup(run.checkpoint(1) / "actor") is None  # another session sees nothing
        assert lent is not None and lent.module is actor.module
        assert not any(p.requires_grad for p in actor.module.parameters())  # lent frozen, as loads are
        assert {n for n, _ in actor.named_trainable()} == trained  # the optimizer's view is unchanged

        prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17, 18, 19, 20, 21]]
        sampling = SamplingParams(max_new_tokens=12, n=2, seed=3)
        borrowed = HFEngine(run.checkpoint(1) / "actor", tokenizer_path=saved, session=session).generate(
            prompts, sampling)
        loaded = HFEngine(saved).generate(prompts, sampling)
        assert [s.token_ids for s in borrowed] == [s.token_ids for s in loaded]
        assert [s.log_probs for s in borrowed] == [s.log_probs for s in loaded]  # bit for bit
        assert not load_causal_lm(saved, torch.device("cpu"), torch.float32,
                                  session=RunSession()).model.embed_tokens.weight.requires_grad
    finally:
        trainer._withdraw()
    assert {n for n, p in actor.module.named_parameters() if p.requires_grad} == trained  # trains again


def test_a_bf16_trainer_lends_its_modules_to_the_rollout_and_the_guard_on_a_cpu(make_engines, dist, tmp_path,
                                                                                 tiny_model_dir):
    """deepspeed_config.dtype=bf16 on a CPU (fast on AVX512-BF16 / AMX cores): the rollout engine and the
    scoring/guard passes ask for the trainer's dtype, so they borrow its bf16 module instead of refusing
    it ("held in memory as bfloat16, but float32 was asked for")."""
    from rlhf_core.rollout.generate import build_rollout_engine
    from rlhf_core.stages.settings import generation
    from rlhf_core.config.reads import build
    from rlhf_core.scoring.models import scoring_device, scoring_dtype
    from rlhf_core.scoring.policy_kl import load_actor_for_kl

    bf16 = [f"{role}.deepspeed_config.dtype=bf16" for role in ("actor_rollout_ref.actor", "critic")]
    cfg, actor, critic = make_engines(1, *bf16, f"actor_rollout_ref.model.tokenizer_path={tiny_model_dir}")
    assert next(actor.module.parameters()).dtype == torch.bfloat16
    run = RunDir(tmp_path / "run")
    session = RunSession()
    trainer = _lending_trainer(run, actor, critic, dist, session)
    trainer._offer()
    try:
        device = scoring_device(cfg.trainer.device)
        dtype = scoring_dtype(device, cfg.actor_rollout_ref.actor.deepspeed_config.dtype)
        assert load_actor_for_kl(session, run.checkpoint(1) / "actor", device, dtype) is actor.module
        engine = build_rollout_engine(build(generation, cfg), run.checkpoint(1) / "actor", session=session)
        assert engine.model is actor.module
        samples = engine.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=4, n=1, seed=0))
        assert len(samples[0].token_ids) > 0
    finally:
        trainer._withdraw()
