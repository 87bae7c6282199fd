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
ACTOR_SHARD = "actor_shard.rank0-of-1"


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
    assert {"actor/model.safetensors", "critic/model.safetensors", f"deepspeed/{ACTOR_SHARD}.safetensors",
            f"deepspeed/{ACTOR_SHARD}.json", "deepspeed/critic_state.json", "trainer_state.json",
            "rng.safetensors"} <= set(manifest["files"])
    target = saved_checkpoint / (f"deepspeed/{ACTOR_SHARD}.safetensors" if damage != "flip" else "actor/model.safetensors")
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

    f = saved_checkpoint / "deepspeed" / "critic_shard.rank0-of-1.safetensors"
    f.write_bytes(f.read_bytes()[:-1] + b"\x00")
    _, actor, critic = make_engines(0)
    with pytest.raises(CheckpointError, match="critic_shard.rank0-of-1.safetensors is corrupt"):
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


# ---------------------------------------------------------------------------------------------
# the sharded layout: each rank's own partition, loaded back into fresh engines
# ---------------------------------------------------------------------------------------------

CASES = [(0, "fp32"), (2, "fp32"), (3, "fp32"), (0, "bf16")]


def _dtype(dtype):
    return (f"actor_rollout_ref.actor.deepspeed_config.dtype={dtype}", f"critic.deepspeed_config.dtype={dtype}")


def _resume(ckpt, stage, overrides, make_engines):
    from rlhf_core.training.checkpoint_load import load_optimizer_state, load_rng
    from rlhf_core.training.rank_update import _zero_loss

    _, actor, critic = make_engines(stage, *overrides, actor_dir=ckpt / "actor", critic_dir=ckpt / "critic")
    for te in (actor, critic):
        load_optimizer_state(ckpt, te, _zero_loss(te, 0))
    load_rng(ckpt)
    return actor, critic


@pytest.mark.parametrize("stage, dtype", CASES)
def test_sharded_save_from_a_capture_resumes_the_next_step_exactly(stage, dtype, make_engines, ppo_data,
                                                                   tiny_model_dir, tmp_path, dist, full_params):
    """Capture after step 2, train on (step 3 and a stray one), save the capture: fresh engines
    loaded from it take step 3 bit for bit; the capture's save equals a save of the live engines
    taken at the capture, file for file (sha256)."""
    from rlhf_core.io.checksums import verify_checkpoint
    from rlhf_core.training.train_state import capture

    overrides = (*OVERRIDES, *_dtype(dtype))
    _, actor, critic = make_engines(stage, *overrides)
    for rows in STEP_ROWS[:2]:
        _step_both(actor, critic, ppo_data, rows, dist)
    live = _save(tmp_path / "live", actor, critic, tiny_model_dir, dist)
    state = capture([actor, critic])
    _step_both(actor, critic, ppo_data, STEP_ROWS[2], dist)
    expected = full_params(actor), full_params(critic)
    _step_both(actor, critic, ppo_data, STEP_ROWS[0], dist)
    ckpt = _save(tmp_path / "ckpt", actor, critic, tiny_model_dir, dist, state=state)

    assert verify_checkpoint(ckpt)["files"] == verify_checkpoint(live)["files"]
    actor, critic = _resume(ckpt, stage, overrides, make_engines)
    _step_both(actor, critic, ppo_data, STEP_ROWS[2], dist)
    for want, got in zip(expected, (full_params(actor), full_params(critic))):
        assert [n for n in want if not torch.equal(want[n], got[n])] == []
    assert not list((ckpt / "deepspeed").glob("*_optim.safetensors"))  # nothing gathered


def test_a_checkpoint_in_the_old_gathered_layout_still_resumes(make_engines, ppo_data, tiny_model_dir, tmp_path,
                                                               dist, full_params):
    """Runs written before the sharded layout ({role}_optim.safetensors with full tensors by name +
    {role}_state.json) load through load_optimizer_state and continue exactly."""
    from safetensors.torch import save_file

    from rlhf_core.io.checksums import write_checksums
    from rlhf_core.training.optim_state import counters, gather_optimizer_state

    overrides = (*OVERRIDES, *_dtype("bf16"))
    _, actor, critic = make_engines(2, *overrides)
    for rows in STEP_ROWS[:2]:
        _step_both(actor, critic, ppo_data, rows, dist)
    ckpt = _save(tmp_path / "ckpt", actor, critic, tiny_model_dir, dist)
    for te in (actor, critic):  # rewrite deepspeed/ as the old save_checkpoint wrote it
        for f in (ckpt / "deepspeed").glob(f"{te.role}_*"):
            f.unlink()
        save_file(gather_optimizer_state(te), str(ckpt / "deepspeed" / f"{te.role}_optim.safetensors"))
        (ckpt / "deepspeed" / f"{te.role}_state.json").write_text(json.dumps(counters(te)))
    (ckpt / "manifest.json").unlink()
    write_checksums(ckpt)
    _step_both(actor, critic, ppo_data, STEP_ROWS[2], dist)
    expected = full_params(actor), full_params(critic)

    actor, critic = _resume(ckpt, 2, overrides, make_engines)
    _step_both(actor, critic, ppo_data, STEP_ROWS[2], dist)
    for want, got in zip(expected, (full_params(actor), full_params(critic))):
        assert [n for n in want if not torch.equal(want[n], got[n])] == []


def test_a_changed_zero_stage_reassembles_the_shards(make_engines, ppo_data, tiny_model_dir, tmp_path, dist):
    """Saved at ZeRO-2, resumed at ZeRO-3: the partitions are reassembled by parameter name and
    scattered into the new layout (the moments and Adam step carry over unchanged)."""
    from rlhf_core.training.optim_state import adam_step_count, gather_optimizer_state

    _, actor, critic = make_engines(2, *OVERRIDES)
    _step_both(actor, critic, ppo_data, STEP_ROWS[0], dist)
    want = gather_optimizer_state(actor)
    ckpt = _save(tmp_path / "ckpt", actor, critic, tiny_model_dir, dist)
    actor, critic = _resume(ckpt, 3, OVERRIDES, make_engines)
    got = gather_optimizer_state(actor)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert adam_step_count(actor) == 1 and actor.lr_schedule_step == 1


def test_a_missing_shard_is_named(saved_checkpoint, make_engines):
    from rlhf_core.training.checkpoint_load import load_optimizer_state
    from rlhf_core.training.rank_update import _zero_loss

    (saved_checkpoint / "deepspeed" / "critic_shard.rank0-of-1.json").unlink()
    _, actor, critic = make_engines(0)
    with pytest.raises(CheckpointError, match="no optimizer state for the critic"):
        load_optimizer_state(saved_checkpoint, critic, _zero_loss(critic, 0))


# ---------------------------------------------------------------------------------------------
# the background writer
# ---------------------------------------------------------------------------------------------


def test_background_write_runs_while_training_and_equals_a_synchronous_save(make_engines, ppo_data, tiny_model_dir,
                                                                           tmp_path, dist):
    import threading

    from rlhf_core.io.checksums import verify_checkpoint
    from rlhf_core.training.checkpoint import BackgroundWriter
    from rlhf_core.training.train_state import capture

    _, actor, critic = make_engines(0, *OVERRIDES)
    _step_both(actor, critic, ppo_data, STEP_ROWS[0], dist)
    sync = _save(tmp_path / "sync", actor, critic, tiny_model_dir, dist)
    trained, done = threading.Event(), []

    def on_done(path):  # holds the writer until the trainer has taken a step meanwhile
        assert trained.wait(60)
        done.append((path, path.is_dir()))

    writer = BackgroundWriter()
    writer.submit(tmp_path / "bg", capture([actor, critic]), actor=actor, critic=critic,
                  tokenizer_path=tiny_model_dir, trainer_state={"iteration": 1}, on_done=on_done)
    _step_both(actor, critic, ppo_data, STEP_ROWS[1], dist)  # the live engines move on
    trained.set()
    writer.wait()
    writer.close()
    assert done == [(tmp_path / "bg", True)]  # on_done ran after the rename
    assert verify_checkpoint(tmp_path / "bg")["files"] == verify_checkpoint(sync)["files"]


def test_a_failed_background_write_surfaces_on_wait(make_engines, tiny_model_dir, tmp_path):
    from rlhf_core.training.checkpoint import BackgroundWriter
    from rlhf_core.training.train_state import capture

    _, actor, critic = make_engines(0)
    (tmp_path / "a_file").write_text("not a directory")
    writer = BackgroundWriter()
    writer.submit(tmp_path / "a_file" / "ckpt", capture([actor, critic]), actor=actor, critic=critic,
                  tokenizer_path=tiny_model_dir, trainer_state={})
    writer.idle()  # waiting without taking the failure leaves it for wait()
    with pytest.raises(CheckpointError, match=r"writing .*a_file/ckpt in the background failed") as info:
        writer.wait()
    assert isinstance(info.value.__cause__, OSError)
    writer.wait()  # reported once
    assert not (tmp_path / "a_file" / "ckpt").exists()
