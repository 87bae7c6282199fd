"""Numerical faults: a non-finite loss or gradient norm skips that optimizer step (counted as
``actor/skipped_steps``, the weights untouched, as verl does), and an update whose every actor step
was skipped is not committed: the KL guard rolls the iteration back with reason "non-finite update"
even though the unmoved actor's KL looks harmless.

The fault is injected the way it arrives in practice: NaN advantages in the table the update reads
(a real tiny pipeline up to gae, then the real DeepSpeed update and the real guard).
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf_core.run.lifecycle import halt_message, nonfinite_update, read_verdict, rollback_iteration
from rlhf_core.stages.guard import decide
from rlhf_core.run.layout import RunDir

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo.yaml"


# ---------------------------------------------------------------------------------------------
# the rule (fast)
# ---------------------------------------------------------------------------------------------


def record(steps: float, skipped: float) -> dict:
    return {"metrics": {"actor/num_steps": steps, "actor/skipped_steps": skipped}}


def test_every_actor_step_skipped_is_a_breach():
    assert "all 2 actor steps skipped" in nonfinite_update(record(2, 2), kl=0.0)


@pytest.mark.parametrize("kl", [math.nan, math.inf])
def test_non_finite_kl_is_a_breach(kl):
    assert "KL" in nonfinite_update(record(2, 0), kl=kl)
    assert decide(kl, 1.0) == "rollback"


@pytest.mark.parametrize("rec", [record(2, 1), record(2, 0), {}, record(0, 0)])
def test_some_steps_applied_or_no_record_is_no_breach(rec):
    assert nonfinite_update(rec, kl=0.01) is None


# ---------------------------------------------------------------------------------------------
# the real update and guard (slow)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scored_run(tmp_path_factory, tiny_model_dir) -> Path:
    """A tiny run after gae of iteration 1 (4 prompts, one PPO mini-batch: one actor step)."""
    from rlhf_core.config import load_config, to_yaml
    from rlhf_core.run.layout import write_config
    from rlhf_core.stages.catalog import stage_functions

    base = tmp_path_factory.mktemp("nan_run")
    overrides = [f"actor_rollout_ref.model.path={tiny_model_dir}", f"trainer.runs_root={base}",
                 "actor_rollout_ref.model.warm_start.enable=false", "data.train_batch_size=4",
                 "data.max_val_samples=4", "data.max_response_length=12",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                 "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1024",
                 "actor_rollout_ref.rollout.generation_batch_tokens=2048", "trainer.device=cpu",
                 "trainer.kl_guard_val_prompts=0"]
    cfg = load_config(str(DEMO), overrides)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLHF_HOME", str(base / ".rlhf"))
        run = RunDir(base / "run")
        run.root.mkdir()
        write_config(run, to_yaml(cfg))
        for stage in ("init_critic", "preprocess", "pack", "rollout", "score", "gae"):  # registry order
            stage_functions(stage).run(cfg, run, 1 if stage in ("rollout", "score", "gae") else None)
    return run.root


def poison_advantages(run: RunDir, rows: list[int]) -> None:
    """NaN in every advantage of ``rows`` (as a broken reward or value model would produce)."""
    from rlhf_core.data.schemas import ADVANTAGES
    from rlhf_core.io.atomic import atomic_write_parquet

    table = pq.read_table(run.advantages(1))
    adv = table.column("advantages").to_pylist()
    for i in rows:
        adv[i] = [math.nan] * len(adv[i])
    table = table.set_column(table.schema.get_field_index("advantages"), "advantages",
                             pa.array(adv, type=pa.list_(pa.float32())))
    atomic_write_parquet(run.advantages(1), table, schema=ADVANTAGES)


@pytest.mark.slow
@pytest.mark.deepspeed
def test_nan_advantages_skip_the_step_and_the_guard_rolls_back(scored_run, tmp_path, tiny_model_dir):
    from safetensors.torch import load_file

    from rlhf_core.stages.guard import run_guard
    from rlhf_core.control.plan import resolve_run_config
    from rlhf_core.stages.update import run_update

    run = RunDir(shutil.copytree(scored_run, tmp_path / "run"))
    cfg = resolve_run_config(run.root, None, [])
    poison_advantages(run, rows=[0, 2])

    metrics = run_update(cfg, run, 1).metrics
    assert metrics["actor/num_steps"] == 1 and metrics["actor/skipped_steps"] == 1
    assert metrics["critic/skipped_steps"] == 0  # values and returns are finite: the critic still trains
    before = load_file(str(tiny_model_dir / "model.safetensors"))
    after = load_file(str(run.checkpoint(1) / "actor" / "model.safetensors"))
    assert after.keys() <= before.keys() and all(after[k].equal(before[k]) for k in after), "actor moved"
    critic_init = load_file(str(run.models_dir / "critic_init" / "model.safetensors"))
    critic = load_file(str(run.checkpoint(1) / "critic" / "model.safetensors"))
    assert any(not critic[k].equal(critic_init[k]) for k in critic)

    run_guard(cfg, run, 1)
    verdict = read_verdict(run, 1)
    assert math.isfinite(verdict["kl_mean"]) and verdict["kl_mean"] <= verdict["threshold"]  # KL alone would commit
    assert verdict["decision"] == "rollback" and verdict["reason"].startswith("non-finite update")
    event = rollback_iteration(run, 1, policy="retry", attempt=1)
    assert event["reason"].startswith("non-finite update")
    assert run.read_json(run.last_good_path) is None  # nothing committed
    assert "non-finite update" in halt_message(run, 1, "trainer.on_kl_breach=halt")
