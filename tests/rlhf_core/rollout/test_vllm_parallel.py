"""vLLM rollout on several processes (torchrun + vLLM's external launcher), through the rollout stage:
trainer.stage_processes=2 makes two engines of one rank (data parallel) or, with
rollout.tensor_model_parallel_size=2, one engine of two ranks (tensor parallel). The prompts are
dealt by token load and each is seeded by its place in the one-engine call, so the rollout table is
the one-engine table. Skips without vLLM (the default suite); `make test-vllm` runs it."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from rlhf_core.config import load_config, to_yaml
from rlhf_core.rollout.vllm_engine import vllm_unavailable_reason
from rlhf_core.run.layout import RunDir, write_config
from rlhf_core.stages.pack import run_pack
from rlhf_core.stages.preprocess import run_preprocess
from rlhf_core.stages.rollout import run_rollout

REASON = vllm_unavailable_reason()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=f"needs vLLM: {REASON}")]


def vllm_config(raw_file, model_dir, *extra):
    """12 prompts, 2 slots of 6, n=2 greedy responses of up to 12 tokens, the vllm engine."""
    return load_config(None, [
        f"data.train_files=[{raw_file}]", "data.val_fraction=0.0", "data.data_source=arith",
        "data.train_batch_size=6", "data.max_response_length=12", "data.max_prompt_length=128",
        f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=6", "trainer.device=cpu",
        *extra])


def one_engine_table(raw, model_dir, run, *extra):
    """The rollout table of one engine in this process (the reference)."""
    run_rollout(vllm_config(raw, model_dir, *extra), run, 1, force=True)
    return pq.read_table(run.rollout(1))


def test_data_and_tensor_parallel_engines_write_the_one_engine_table(tmp_path, repo_root, vllm_model_dir):
    """Two engines of one rank (data parallel) sample what one engine samples; one engine of two ranks
    (tensor parallel) decodes greedily what one engine decodes. (Both hold for the other sampling
    too; one torchrun launch each keeps the test short.)"""
    raw = tmp_path / "arith.jsonl"
    raw.write_text("".join((repo_root / "data/arith/train.jsonl").read_text().splitlines(True)[:12]))
    greedy = ["actor_rollout_ref.rollout.do_sample=false"]
    run = RunDir(tmp_path / "run")
    first = vllm_config(raw, vllm_model_dir)
    write_config(run, to_yaml(first))
    run_preprocess(first, run)
    run_pack(first, run)
    for sampling, layout in (([], ["trainer.stage_processes=2"]),
                             (greedy, ["trainer.stage_processes=2",
                                       "actor_rollout_ref.rollout.tensor_model_parallel_size=2"])):
        expected = one_engine_table(raw, vllm_model_dir, run, *sampling)
        assert set(expected.column("engine").to_pylist()) == {"vllm"} and expected.num_rows == 12
        result = run_rollout(vllm_config(raw, vllm_model_dir, *sampling, *layout), run, 1, force=True)
        assert not result.skipped and result.rows["responses"] == 12
        table = pq.read_table(run.rollout(1))
        assert table.drop(["rollout_log_probs"]).equals(expected.drop(["rollout_log_probs"])), layout
        for got, want in zip(table.column("rollout_log_probs").to_pylist(),
                             expected.column("rollout_log_probs").to_pylist()):
            assert got == pytest.approx(want, abs=1e-4)  # another split of the matmuls, the same weights
        assert not run.stage_ranks_dir(1, "rollout").exists()
