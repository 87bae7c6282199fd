"""The benchmarks' pure helpers: the shape model is the shape it claims, and the overhead columns add up."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_overhead  # noqa: E402
import shapes  # noqa: E402


def test_unknown_shape_lists_the_valid_ones():
    with pytest.raises(ValueError, match="qwen2.5-0.5b"):
        shapes.shape_spec("qwen9-1t", layers=8, seed=0)


def test_shape_model_has_the_layer_shape_and_is_reused(tmp_path):
    from transformers import AutoModelForCausalLM

    path = shapes.build_shape_model(tmp_path, "qwen2.5-0.5b", layers=1, seed=0)
    cfg = json.loads((path / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"],
            cfg["num_hidden_layers"], cfg["rope_parameters"]["rope_theta"], cfg["rms_norm_eps"]) == \
        (896, 14, 2, 4864, 1, 1e6, 1e-6)
    assert cfg["vocab_size"] == shapes.TOKENIZER_VOCAB  # the tiny tokenizer's vocabulary
    model = AutoModelForCausalLM.from_pretrained(path)
    assert sum(p.numel() for p in model.parameters()) == shapes.parameter_count(path)
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert shapes.build_shape_model(tmp_path, "qwen2.5-0.5b", layers=1, seed=0) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp  # cached, not rebuilt
    assert shapes.build_shape_model(tmp_path, "qwen2.5-0.5b", layers=1, seed=1) != path  # seed is in the key


def test_overhead_columns_add_up_to_wall_minus_compute():
    sources = {f"stage bodies: {label}": 0.1 * (i + 1) for i, (_, label) in enumerate(bench_overhead.BODY_IO)}
    sources["Prefect task-run wrapper"] = 0.05
    row = {"sources": sources, "overhead": sum(sources.values()) + 0.02}  # + overlap counted twice
    columns = bench_overhead.io_by_column(row)
    assert sum(columns.values()) == pytest.approx(row["overhead"])
    assert columns["ckpt writes"] == pytest.approx(0.2)  # checkpoint_write is BODY_IO's second kind
    assert columns["orchestration"] == pytest.approx(0.07)


def test_real_shape_table_leaves_out_the_warm_up_and_divides_trls_wall_by_ours():
    import bench_real_shape

    def run(walls, **phase):
        return {"iterations": [{"wall": w, "width": 32, **phase} for w in walls]}

    ours = [run([30.0, 5.0, 6.0, 7.0], rollout=1.0, score=1.0, gae=0.0, update=2.0, guard=0.5,
                **{"around the stages": 0.1})]
    trl = [{**run([40.0, 9.0, 9.0, 12.0], generation=2.0, scoring=2.0, update=4.0, rest=0.2),
            "trl_version": "1.12.0", "threads": 2}]
    spec = {"batch": 8, "prompt_tokens": 86.0, "response_length": 32, "dtype": "bf16", "bypass": True,
            "sampled_guard": True, "ours_overrides": []}
    text = bench_real_shape.table(4, 60.0, ours, trl, spec)
    assert "**9.00 s** | **6.00 s**" in text and "**1.50x**" in text  # medians of iterations 2+
    assert "sampled KL guard" in text and "bypass mode" in text and "bf16" in text
    defaults = bench_real_shape.table(4, 60.0, ours, trl, {**spec, "dtype": "auto", "bypass": False,
                                                           "sampled_guard": False})
    assert "exact KL guard" in defaults and "dtype auto" in defaults and "against TRL fp32" in defaults


def test_real_shape_settings_are_valid_config():
    import bench_real_shape
    from rlhf_core.config import load_config

    cfg = load_config(str(BENCH.parent / "configs/demo.yaml"), [
        *bench_real_shape.BYPASS, *bench_real_shape.SAMPLED_GUARD, *bench_real_shape.BF16])
    assert cfg.algorithm.rollout_correction.bypass_mode and cfg.trainer.kl_guard_estimator == "sampled"
    assert cfg.critic.deepspeed_config.dtype == "bf16" == cfg.actor_rollout_ref.actor.deepspeed_config.dtype
