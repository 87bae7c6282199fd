"""The locally built tiny model: real HF format, deterministic, a working tokenizer and chat template."""

from __future__ import annotations

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf_core.models.tiny import TinyModelSpec, build_tiny_model


def test_loads_with_auto_classes_and_generates(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert model.config.eos_token_id == tok.eos_token_id
    text = tok.apply_chat_template([{"role": "user", "content": "Ava has 3 pens. How many?"}],
                                   add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
    ids = tok(text, return_tensors="pt").input_ids
    torch.manual_seed(0)
    out = model.generate(ids, max_new_tokens=5, do_sample=True)
    assert out.shape[1] <= ids.shape[1] + 5


def test_tokenizer_round_trips_any_utf8(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for text in ["12 + 7 = 19\n#### 19", "Zoë paid €3.50 — 東京", "a\tb  c"]:
        assert tok.decode(tok(text).input_ids) == text


def test_build_is_deterministic(tmp_path):
    spec = TinyModelSpec(hidden_size=32, num_hidden_layers=1, vocab_size=300)
    a = build_tiny_model(tmp_path / "a", spec, corpus=["1 + 2 = 3", "#### 3"] * 20)
    b = build_tiny_model(tmp_path / "b", spec, corpus=["1 + 2 = 3", "#### 3"] * 20)
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
