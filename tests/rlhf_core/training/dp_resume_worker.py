"""Run by torchrun from test_multirank_resume.py (not collected): on every rank, for each ZeRO
stage given, three iterations straight vs two + checkpoint + fresh engines + resume + one more.
Rank 0 writes {stage: {"actor": max |difference|, "critic": ...}} to the output JSON."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path


def main(model_dir: str, critic_dir: str, advantages: str, out: str, stages: list[int]) -> None:
    import deepspeed
    import torch

    from rlhf_core.config import load_config
    from rlhf_core.training.batch import MicroBatchPlan, read_advantages
    from rlhf_core.training.checkpoint import save_checkpoint
    from rlhf_core.training.distributed import init_distributed, shutdown_distributed
    from rlhf_core.training.ppo import ActorLoss, CriticLoss, train_step
    from rlhf_core.config.reads import build
    from rlhf_core.training.rank_update import UpdateSources, build_engines, resume_optimizers
    from rlhf_core.training.settings import engine_settings

    torch.set_num_threads(1)
    dist = init_distributed("cpu")
    data = read_advantages(advantages)
    plan = MicroBatchPlan(use_dynamic_bsz=True, token_budget=40, micro_batch_size=1)
    steps = ([0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11])

    def engines(stage, actor, critic):
        cfg = load_config(None, [f"actor_rollout_ref.model.path={actor}", "actor_rollout_ref.actor.optim.lr=1e-3",
                                 "actor_rollout_ref.actor.optim.lr_warmup_steps=4", "critic.optim.lr=1e-3",
                                 f"actor_rollout_ref.actor.deepspeed_config.zero_stage={stage}",
                                 f"critic.deepspeed_config.zero_stage={stage}"])
        return build_engines(build(engine_settings, cfg, device="cpu", world_size=dist.world_size),
                             UpdateSources(Path(actor), None, Path(critic), Path(model_dir), None))

    def step(actor, critic, rows):  # one iteration: the lr schedule moves after it
        train_step(critic, data, rows, plan, CriticLoss(), dist, 0)
        train_step(actor, data, rows, plan, ActorLoss(entropy_coeff=0.01), dist, 0)
        actor.finish_training_step()
        critic.finish_training_step()

    def params(te):
        ps = list(te.module.named_parameters())
        ctx = deepspeed.zero.GatheredParameters([p for _, p in ps]) if te.zero_stage == 3 else contextlib.nullcontext()
        with ctx:
            return {n: p.detach().clone() for n, p in ps}

    report = {}
    for stage in stages:
        actor, critic = engines(stage, model_dir, critic_dir)
        for rows in steps:
            step(actor, critic, rows)
        want = params(actor), params(critic)
        actor, critic = engines(stage, model_dir, critic_dir)
        for rows in steps[:2]:
            step(actor, critic, rows)
        tmp = Path(out).parent / f"checkpoint_{Path(out).stem}_{stage}"  # the test's own directory, removed with it
        ckpt = save_checkpoint(tmp, actor=actor, critic=critic, tokenizer_path=Path(model_dir),
                               trainer_state={}, dist=dist)
        actor, critic = engines(stage, ckpt / "actor", ckpt / "critic")
        resume_optimizers(ckpt, [actor, critic], pad_id=0)
        step(actor, critic, steps[2])
        got = params(actor), params(critic)
        report[stage] = {role: max(float((w[n] - g[n]).abs().max()) for n in w)
                         for role, w, g in zip(("actor", "critic"), want, got)}
    if dist.is_main:
        Path(out).write_text(json.dumps(report))
    shutdown_distributed()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], [int(s) for s in sys.argv[5:]])
