"""Model FLOPs of a stage's passes against torch's own FLOP counter on the tiny model, and the floor
they make at a rate (``training.flops``)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from rlhf_core.models.packed import pack_rows, packed_forward, response_positions
from rlhf_core.training import flops
from rlhf_core.training.memory import ModelShape
from rlhf_core.models.live import LiveModels


@pytest.fixture(scope="module")
def eager_model(tiny_model_dir):
    """The tiny model with eager attention: its QKᵀ and AV are matmuls torch's counter sees (over the
    whole square, where the causal model only needs half of it)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def _shape(model) -> ModelShape:
    return ModelShape.from_dict(model.config.to_dict())


def _counted(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        with torch.no_grad():
            fn()
    return counter.get_total_flops()


def test_a_forward_counts_the_matmuls_torch_counts_with_half_the_attention_square(eager_model):
    shape = _shape(eager_model)
    seq, prompt = list(range(3, 43)), 25
    packed = pack_rows([[0]], [seq], pad_id=0)
    rows, cols, _ = response_positions(packed, [prompt])
    counted = _counted(lambda: packed_forward(eager_model, packed, positions=(rows, cols)))
    ours = flops.forward_flops(shape, [len(seq)], head_positions=len(seq) - prompt)
    # eager attention multiplies the whole square (QK and AV: 4 s² d h per layer), the causal count is half
    square = 2 * shape.num_hidden_layers * shape.num_attention_heads * shape.dim_per_head * len(seq) ** 2
    assert counted == ours + square


def test_generation_counts_the_prefill_and_one_position_per_new_token(eager_model):
    shape = _shape(eager_model)
    prompt, new = list(range(3, 23)), 9
    ids = torch.tensor([prompt])

    def generate():
        eager_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                             min_new_tokens=new, pad_token_id=0)

    counted = _counted(generate)
    ours = flops.generation_flops(shape, [len(prompt)], [new])
    square = 2 * shape.num_hidden_layers * shape.num_attention_heads * shape.dim_per_head * len(prompt) ** 2
    assert counted == ours + square  # the prefill's attention counted whole by eager, half by us


def test_training_is_three_forwards_per_epoch_and_the_floor_is_flops_over_the_rate(monkeypatch):
    shape = ModelShape(hidden_size=896, num_hidden_layers=4, num_attention_heads=14, num_key_value_heads=2,
                       intermediate_size=4864, vocab_size=512)
    lengths = [118] * 8
    forward = flops.forward_flops(shape, lengths, 256)
    assert flops.training_flops(shape, lengths, 256, epochs=2) == 6 * forward
    # the dense weights of Qwen2.5-0.5B's layer, 4 layers: 59.6 M multiply-adds per token
    assert flops.dense_parameters(shape) == 4 * (896 * (2 * 14 * 64 + 2 * 2 * 64) + 3 * 896 * 4864)
    monkeypatch.setattr(flops, "device_rate", lambda device, dtype: 1e11)
    m = flops.floor_metrics("score", 5e11, "cpu", "fp32", devices=2)
    assert m == {"perf/stage_flops/score": 5e11, "perf/stage_floor_seconds/score": 2.5,
                 "perf/device_matmul_flops_per_s": 1e11}


def test_verls_promised_flops_follow_its_table():
    assert flops.verl_promised_flops("cpu") == 448e9
    assert flops.verl_promised_flops("cuda", "NVIDIA H200") == 989e12
    assert flops.verl_promised_flops("cuda", "NVIDIA L40S") == 362.05e12  # not L40's
    assert flops.verl_promised_flops("cuda", "Tesla T4") == float("inf")  # unknown: verl's mfu reads 0


def test_a_models_shape_is_read_from_its_config_or_the_module_the_trainer_holds(tiny_model_dir, tmp_path):
    shape = flops.model_shape(tiny_model_dir, LiveModels())
    assert shape is not None and shape.hidden_size > 0 and shape.num_hidden_layers > 0
    assert flops.model_shape(tmp_path / "absent", LiveModels()) is None
