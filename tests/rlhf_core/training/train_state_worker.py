"""Run by torchrun from test_train_state.py (not collected): on every rank, for each
"stage:dtype" given, (1) capture → train 2 steps → restore → one step, against the step taken
right after the capture; (2) a sharded checkpoint of that capture → fresh engines →
load_optimizer_state → the same step. Rank 0 writes {case: {"restore": {role: max |difference|},
"resume": {...}, "shards": [files under deepspeed/]}} to the output JSON."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path


def main(model_dir: str, critic_dir: str, advantages: str, out: str, cases: list[str]) -> None:
    import deepspeed
    import torch

    from rlhf_core.config import load_config
    from rlhf_core.training.batch import MicroBatchPlan, read_advantages
    from rlhf_core.training.checkpoint import BackgroundWriter, can_write_in_background, prepare_staging, save_checkpoint
    from rlhf_core.training.checkpoint_load import load_optimizer_state, load_rng
    from rlhf_core.training.distributed import barrier, init_distributed, shutdown_distributed
    from rlhf_core.training.ppo import ActorLoss, CriticLoss, train_step
    from rlhf_core.config.reads import build
    from rlhf_core.training.rank_update import UpdateSources, _zero_loss, build_engines
    from rlhf_core.training.settings import engine_settings
    from rlhf_core.training.train_state import capture, restore

    torch.set_num_threads(1)
    dist = init_distributed("cpu")
    data = read_advantages(advantages)
    plan = MicroBatchPlan(use_dynamic_bsz=True, token_budget=40, micro_batch_size=1)
    steps = ([0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11])

    def engines(stage, dtype, actor, critic):
        cfg = load_config(None, [f"actor_rollout_ref.model.path={actor}", "actor_rollout_ref.actor.optim.lr=1e-3",
                                 "actor_rollout_ref.actor.optim.lr_warmup_steps=4", "critic.optim.lr=1e-3",
                                 f"actor_rollout_ref.actor.deepspeed_config.zero_stage={stage}",
                                 f"critic.deepspeed_config.zero_stage={stage}",
                                 f"actor_rollout_ref.actor.deepspeed_config.dtype={dtype}",
                                 f"critic.deepspeed_config.dtype={dtype}"])
        return build_engines(build(engine_settings, cfg, device="cpu", world_size=dist.world_size),
                             UpdateSources(Path(actor), None, Path(critic), Path(model_dir), None))

    def step(actor, critic, rows):
        train_step(critic, data, rows, plan, CriticLoss(), dist, 0)
        train_step(actor, data, rows, plan, ActorLoss(entropy_coeff=0.01), dist, 0)
        actor.finish_training_step()
        critic.finish_training_step()

    def params(te):
        ps = list(te.module.named_parameters())
        ctx = deepspeed.zero.GatheredParameters([p for _, p in ps]) if te.zero_stage == 3 else contextlib.nullcontext()
        with ctx:
            return {n: p.detach().float().clone() for n, p in ps}

    def diff(want, got):
        return {role: max(float((w[n] - g[n]).abs().max()) for n in w)
                for role, w, g in zip(("actor", "critic"), want, got)}

    report = {}
    for case in cases:
        stage, dtype = int(case.split(":")[0]), case.split(":")[1]
        actor, critic = engines(stage, dtype, model_dir, critic_dir)
        step(actor, critic, steps[0])
        state = capture([actor, critic])
        step(actor, critic, steps[1])
        want = params(actor), params(critic)
        step(actor, critic, steps[2])
        step(actor, critic, steps[0])
        restore([actor, critic], state)
        step(actor, critic, steps[1])
        restored = diff(want, (params(actor), params(critic)))

        tmp = Path(out).parent / f"checkpoint_{stage}_{dtype}"  # the test's own directory, removed with it
        ckpt = save_checkpoint(tmp, actor=actor, critic=critic, tokenizer_path=Path(model_dir), trainer_state={},
                               dist=dist, state=state)
        background = None
        if can_write_in_background([actor, critic], dist.world_size):  # every rank its part, no collective
            later = tmp.with_name(tmp.name + "_background")
            writer = BackgroundWriter()
            writer.submit(later, state, actor=actor, critic=critic, tokenizer_path=Path(model_dir), trainer_state={},
                          dist=dist, staging=prepare_staging(later, dist, "test"))
            writer.wait()
            barrier()  # rank 0 sealed it
            background = sorted(str(f.relative_to(later)) for f in later.rglob("*") if f.is_file()
                                and f.read_bytes() != (ckpt / f.relative_to(later)).read_bytes())
        actor, critic = engines(stage, dtype, ckpt / "actor", ckpt / "critic")
        for te in (actor, critic):
            load_optimizer_state(ckpt, te, _zero_loss(te, 0))
        load_rng(ckpt)
        step(actor, critic, steps[1])
        report[case] = {"restore": restored, "resume": diff(want, (params(actor), params(critic))),
                        "shards": sorted(p.name for p in (ckpt / "deepspeed").iterdir()),
                        "background_differs": background}
    if dist.is_main:
        Path(out).write_text(json.dumps(report))
    shutdown_distributed()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:])
