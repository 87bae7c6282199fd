"""Checkpoints of real DeepSpeed engines: exact resume, corruption detection, LoRA export."""

from __future__ import annotations

import json

import pytest
import torch

from rlhf_core.errors import CheckpointError
from rlhf_core.training.batch import MicroBatchPlan
from rlhf_core.training.ppo import ActorLoss, CriticLoss, train_step

pytestmark = pytest.mark.deepspeed

PLAN = MicroBatchPlan(use_dynamic_bsz=True, token_budget=40, micro_batch_size=1)
LOSS = ActorLoss(entropy_coeff=0.01)
OVERRIDES = ("actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.actor.optim.lr_warmup_steps=4",
             "critic.optim.lr=1e-3", "critic.optim.lr_warmup_steps=4")
STEP_ROWS = ([0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11])


def _step_both(actor, critic, data, rows, dist):
    """One iteration of one optimizer step per role; the lr schedule then moves one training step."""
    train_step(critic, data, rows, PLAN, CriticLoss(), dist, pad_id=0)
    metrics = train_step(actor, data, rows, PLAN, LOSS, dist, pad_id=0).metrics
    for te in (actor, critic):
        te.finish_training_step()
    return metrics


def _save(path, actor, critic, tokenizer, dist, **kw):
    from rlhf_core.training.checkpoint import save_checkpoint

    return save_checkpoint(path, actor=actor, critic=critic, tokenizer_path=tokenizer,
                           trainer_state={"iteration": 1}, dist=dist, **kw)


@pytest.mark.parametrize("stage, dtype", [(0, "fp32"), (2, "fp32"), (3, "fp32"), (0, "bf16")])
def test_resume_from_checkpoint_reproduces_the_next_step_exactly(stage, dtype, make_engines, ppo_data,
                                                                 tiny_model_dir, tmp_path, dist, full_params):
    """Three iterations straight == two, checkpoint, fresh engines from it, one more (bit for bit):
    the lr-schedule position (training steps), AdamW moments and step count of both actor and critic
    carry over, and in bf16 the fp32 master weights too (the HF export is rounded to bf16)."""
    from rlhf_core.training.rank_update import resume_optimizers

    overrides = (*OVERRIDES, f"actor_rollout_ref.actor.deepspeed_config.dtype={dtype}",
                 f"critic.deepspeed_config.dtype={dtype}")
    _, actor, critic = make_engines(stage, *overrides)
    for rows in STEP_ROWS:
        straight = _step_both(actor, critic, ppo_data, rows, dist)
    expected = full_params(actor), full_params(critic)

    _, actor, critic = make_engines(stage, *overrides)
    for rows in STEP_ROWS[:2]:
        _step_both(actor, critic, ppo_data, rows, dist)
    ckpt = _save(tmp_path / "ckpt", actor, critic, tiny_model_dir, dist)
    _, actor, critic = make_engines(stage, *overrides, actor_dir=ckpt / "actor", critic_dir=ckpt / "critic")
    resume_optimizers(ckpt, [actor, critic], pad_id=0)
    resumed = _step_both(actor, critic, ppo_data, STEP_ROWS[2], dist)

    assert resumed["actor/lr"] == straight["actor/lr"] == pytest.approx(0.5e-3)  # verl: step 2 of a 4-step warm-up
    for want, got in zip(expected, (full_params(actor), full_params(critic))):
        assert all(torch.equal(want[n], got[n]) for n in want), [n for n in want if not torch.equal(want[n], got[n])]
    state = json.loads((ckpt / "deepspeed" / "actor_state.json").read_text())
    assert state["adam_step"] == 2 and state["lr_schedule_step"] == 2
    assert state["zero_stage"] == (stage if dtype == "fp32" else max(stage, 1))  # mixed precision: ZeRO >= 1


@pytest.fixture
def saved_checkpoint(make_engines, ppo_data, tiny_model_dir, tmp_path, dist):
    _, actor, critic = make_engines(0, *OVERRIDES)
    _step_both(actor, critic, ppo_data, STEP_ROWS[0], dist)
    return _save(tmp_path / "ckpt", actor, critic, tiny_model_dir, dist)


@pytest.mark.parametrize("damage, words", [
    ("flip", "corrupt"), ("truncate", "truncated"), ("delete", "missing"), ("manifest", "manifest.json"),
])
def test_damaged_checkpoint_file_is_named(saved_checkpoint, damage, words):
    from rlhf_core.io.checksums import verify_checkpoint

    manifest = verify_checkpoint(saved_checkpoint)
    assert {"actor/model.safetensors", "critic/model.safetensors", "deepspeed/actor_optim.safetensors",
            "deepspeed/critic_state.json", "trainer_state.json", "rng.safetensors"} <= set(manifest["files"])
    target = saved_checkpoint / ("deepspeed/actor_optim.safetensors" if damage != "flip" else "actor/model.safetensors")
    if damage == "flip":
        raw = bytearray(target.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        target.write_bytes(bytes(raw))
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:-7])
    elif damage == "delete":
        target.unlink()
    else:
        target = saved_checkpoint / "manifest.json"
        target.unlink()
    with pytest.raises(CheckpointError) as err:
        verify_checkpoint(saved_checkpoint)
    assert str(target) in str(err.value) and words in str(err.value)


def test_resume_refuses_a_corrupt_checkpoint_before_loading(saved_checkpoint, make_engines):
    from rlhf_core.training.rank_update import resume_optimizers

    f = saved_checkpoint / "deepspeed" / "critic_optim.safetensors"
    f.write_bytes(f.read_bytes()[:-1] + b"\x00")
    _, actor, critic = make_engines(0)
    with pytest.raises(CheckpointError, match="critic_optim.safetensors is corrupt"):
        resume_optimizers(saved_checkpoint, [actor, critic], pad_id=0)


@pytest.mark.parametrize("stage", [0, 3])
def test_lora_trains_only_adapters_and_exports_merged_weights(stage, make_engines, ppo_data, tiny_model_dir,
                                                              tmp_path, dist, full_params):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlhf_core.training.batch import build_micro_batch
    from rlhf_core.training.engines import reference_logprobs
    from rlhf_core.training.forward import actor_forward

    _, actor, critic = make_engines(stage, "actor_rollout_ref.model.lora_rank=4",
                                    "actor_rollout_ref.model.lora_alpha=8", "actor_rollout_ref.actor.optim.lr=1e-2")
    trainable = {n for n, _ in actor.named_trainable()}
    assert trainable and all("lora_" in n for n in trainable)
    before = full_params(actor)
    _step_both(actor, critic, ppo_data, STEP_ROWS[0], dist)
    after = full_params(actor)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and changed <= trainable

    ckpt = _save(tmp_path / "ckpt", actor, critic, tiny_model_dir, dist, lora_base=tiny_model_dir)
    mb = build_micro_batch(ppo_data, [[0, 1, 2]], 0)
    merged = AutoModelForCausalLM.from_pretrained(ckpt / "actor", dtype=torch.float32)
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), ckpt / "actor_adapter")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        trained_lp, _ = actor_forward(actor.engine, mb, entropy=False)
        merged_lp, _ = actor_forward(merged, mb, entropy=False)
        adapter_lp, _ = actor_forward(adapter, mb, entropy=False)
        base_lp, _ = actor_forward(base, mb, entropy=False)
    assert torch.allclose(merged_lp, trained_lp, atol=1e-5) and torch.allclose(adapter_lp, trained_lp, atol=1e-6)
    assert not torch.allclose(trained_lp, base_lp, atol=1e-4)
    if stage == 0:  # the reference = the same module with its adapters switched off
        ref_lp = reference_logprobs(actor.module, lambda m: actor_forward(m, mb, entropy=False)[0])
        assert torch.allclose(ref_lp, base_lp, atol=1e-6)
