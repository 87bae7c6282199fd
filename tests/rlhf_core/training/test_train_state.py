"""In-memory training state of real DeepSpeed engines: capture, train on, restore, and the next
step is the one that would have followed the capture (bit for bit)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhf_core.training.batch import MicroBatchPlan
from rlhf_core.training.ppo import ActorLoss, CriticLoss, train_step

pytestmark = pytest.mark.deepspeed

PLAN = MicroBatchPlan(use_dynamic_bsz=True, token_budget=40, micro_batch_size=1)
OVERRIDES = ("actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.actor.optim.lr_warmup_steps=4",
             "critic.optim.lr=1e-3", "critic.optim.lr_warmup_steps=4")
STEP_ROWS = ([0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11])
CASES = [(0, "fp32"), (2, "fp32"), (3, "fp32"), (0, "bf16")]


def step_both(actor, critic, data, rows, dist):
    """One iteration: one optimizer step per role (critic first), then the lr schedule moves;
    a dropout-free forward with a random mini-batch order would still draw from the RNG."""
    train_step(critic, data, rows, PLAN, CriticLoss(), dist, pad_id=0)
    train_step(actor, data, rows, PLAN, ActorLoss(entropy_coeff=0.01), dist, pad_id=0)
    for te in (actor, critic):
        te.finish_training_step()


def dtype_overrides(dtype):
    return (f"actor_rollout_ref.actor.deepspeed_config.dtype={dtype}", f"critic.deepspeed_config.dtype={dtype}")


@pytest.mark.parametrize("warm", [True, False], ids=["after-a-step", "before-any-step"])
@pytest.mark.parametrize("stage, dtype", CASES + [(3, "bf16")])  # ZeRO-3 bf16: the fp32 master through DeepSpeed's local API
def test_restore_then_step_equals_the_step_after_capture(stage, dtype, warm, make_engines, ppo_data, dist,
                                                         full_params):
    from rlhf_core.training.optim_state import adam_step_count
    from rlhf_core.training.train_state import capture, restore

    _, actor, critic = make_engines(stage, *OVERRIDES, *dtype_overrides(dtype))
    if warm:
        step_both(actor, critic, ppo_data, STEP_ROWS[0], dist)
    state = capture([actor, critic])
    torch.manual_seed(1234)  # the RNG moves on; restore must bring it back
    probe = torch.rand(3)
    step_both(actor, critic, ppo_data, STEP_ROWS[1], dist)
    expected = full_params(actor), full_params(critic), actor.lr, adam_step_count(actor)
    step_both(actor, critic, ppo_data, STEP_ROWS[2], dist)
    step_both(actor, critic, ppo_data, STEP_ROWS[0], dist)

    restore([actor, critic], state)
    torch.manual_seed(1234)
    assert torch.equal(torch.rand(3), probe)
    step_both(actor, critic, ppo_data, STEP_ROWS[1], dist)
    got = full_params(actor), full_params(critic), actor.lr, adam_step_count(actor)
    for want, have in zip(expected[:2], got[:2]):
        assert [n for n in want if not torch.equal(want[n], have[n])] == []
    assert got[2:] == expected[2:]
    assert state.nbytes() > 0 and set(state.roles) == {"actor", "critic"}


def test_two_ranks_restore_and_sharded_resume_are_exact(tiny_model_dir, critic_init_dir, advantages_table, tmp_path,
                                                       subprocess_env):
    """The same on 2 gloo ranks (torchrun): each rank captures, restores and writes only its own
    partition; a fresh pair of engines loads its rank's shard and continues bit for bit; and where
    no gather is needed the ranks' background writers produce the same checkpoint files."""
    from rlhf_core.data.schemas import ADVANTAGES
    from rlhf_core.io.atomic import atomic_write_parquet

    adv = tmp_path / "adv.parquet"
    atomic_write_parquet(adv, advantages_table, ADVANTAGES)
    out = tmp_path / "report.json"
    worker = Path(__file__).with_name("train_state_worker.py")
    cases = [f"{stage}:{dtype}" for stage, dtype in CASES]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
                           "--nproc_per_node=2", str(worker), str(tiny_model_dir), str(critic_init_dir), str(adv),
                           str(out), *cases], env=subprocess_env(OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    zero = {"actor": 0.0, "critic": 0.0}
    assert {c: (r["restore"], r["resume"]) for c, r in report.items()} == {c: (zero, zero) for c in cases}
    for r in report.values():
        assert {f"{role}_shard.rank{k}-of-2.{ext}" for role in ("actor", "critic") for k in (0, 1)
                for ext in ("safetensors", "json")} <= set(r["shards"])
        assert not [f for f in r["shards"] if f.startswith(".digests")]
    # a background save by both ranks (ZeRO 0-2) writes the very files the save in step writes
    assert {c: r["background_differs"] for c, r in report.items()} == {
        c: (None if c.startswith("3:") else []) for c in cases}


def test_a_capture_into_an_earlier_ones_buffers_restores_exactly(make_engines, ppo_data, dist, full_params):
    """``reuse``: the released snapshot's host buffers are overwritten, not reallocated."""
    from rlhf_core.training.train_state import capture, restore

    _, actor, critic = make_engines(2, *OVERRIDES)
    step_both(actor, critic, ppo_data, STEP_ROWS[0], dist)
    old = capture([actor, critic])
    step_both(actor, critic, ppo_data, STEP_ROWS[2], dist)
    pointers = {k: v.data_ptr() for k, v in old.roles["actor"].optim.items()}
    state = capture([actor, critic], reuse=old)
    assert {k: v.data_ptr() for k, v in state.roles["actor"].optim.items()} == pointers and pointers
    step_both(actor, critic, ppo_data, STEP_ROWS[1], dist)
    want = full_params(actor), full_params(critic)
    step_both(actor, critic, ppo_data, STEP_ROWS[2], dist)
    restore([actor, critic], state)
    step_both(actor, critic, ppo_data, STEP_ROWS[1], dist)
    for w, g in zip(want, (full_params(actor), full_params(critic))):
        assert [n for n in w if not torch.equal(w[n], g[n])] == []


def test_a_capture_before_the_first_step_does_not_cover_the_state_after_it(make_engines, ppo_data, dist):
    """``covers``: a capture made before any step has no buffers for Adam's moments, so reusing it
    after the first step allocates fresh memory (the resident trainer then copies in the foreground)."""
    from rlhf_core.training.train_state import capture, covers

    _, actor, critic = make_engines(0, *OVERRIDES)
    initial = capture([actor, critic])
    assert covers(initial, [actor, critic])  # nothing has changed yet
    step_both(actor, critic, ppo_data, STEP_ROWS[0], dist)
    assert not covers(initial, [actor, critic]) and not covers(initial, [actor])
    after = capture([actor, critic], reuse=initial)
    assert covers(after, [actor, critic]) and covers(after, [critic])
    assert not covers(capture([actor]), [actor, critic])  # the critic's state is not there at all
