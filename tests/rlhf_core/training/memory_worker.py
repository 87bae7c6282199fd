"""Run by torchrun from test_memory.py (not collected): on each rank, the resident-memory growth of
building the actor and critic engines and training one step of each, beside the estimate of the
same state. Rank 0 writes {"ranks": [{"growth": bytes, ...}, ...], "estimate": {...}} as JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rss(field: str) -> int:
    """VmRSS / VmHWM of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def main(model_dir: str, critic_dir: str, advantages: str, out: str, stage: int) -> None:
    import torch
    import torch.distributed as tdist

    from rlhf_core.config import load_config
    from rlhf_core.training.batch import MicroBatchPlan, read_advantages
    from rlhf_core.training.distributed import init_distributed, shutdown_distributed
    from rlhf_core.training.memory import Shapes, estimate, memory_settings
    from rlhf_core.training.ppo import ActorLoss, CriticLoss, train_step
    from rlhf_core.config.reads import build
    from rlhf_core.training.rank_update import UpdateSources, build_engines, reset_peak_rss
    from rlhf_core.training.settings import engine_settings

    torch.set_num_threads(1)
    dist = init_distributed("cpu")
    data = read_advantages(advantages)
    cfg = load_config(None, [f"actor_rollout_ref.model.path={model_dir}",
                             f"actor_rollout_ref.actor.deepspeed_config.zero_stage={stage}",
                             f"critic.deepspeed_config.zero_stage={stage}"])
    plan = MicroBatchPlan(use_dynamic_bsz=True, token_budget=64, micro_batch_size=1)
    tdist.barrier()
    before = rss("VmRSS")
    reset_peak_rss()
    actor, critic = build_engines(build(engine_settings, cfg, device="cpu", world_size=dist.world_size),
                                  UpdateSources(Path(model_dir), None, Path(critic_dir), Path(model_dir), None))
    rows = list(range(min(8, len(data))))
    train_step(critic, data, rows, plan, CriticLoss(), dist, 0)
    train_step(actor, data, rows, plan, ActorLoss(), dist, 0)
    peak = rss("VmHWM")
    est = estimate(memory_settings(cfg, dist.world_size), Shapes.read(Path(model_dir), Path(critic_dir), Path(model_dir)),
                   device="cpu")
    mine = {"before": before, "peak": peak, "growth": peak - before}
    gathered = [None] * dist.world_size
    tdist.all_gather_object(gathered, mine)
    if dist.rank == 0:
        state = [t for t in est.phases["update"] if "activations" not in t.name and "logits" not in t.name]
        Path(out).write_text(json.dumps({
            "ranks": gathered, "state": sum(t.device for t in state),
            "update": est.device_bytes("update"), "terms": {t.name: t.device for t in est.phases["update"]}}))
    tdist.barrier()
    shutdown_distributed()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
