"""The Qwen2.5-7B PPO preset loads and validates through `rlhf config show`, as a user runs it, on a
machine without GPUs and without the weights: the model's config.json, a tokenizer file and a weights
file holding only its safetensors header in the local Hugging Face cache (what the preset's model
lookups, the model-folder check and the memory estimate read)."""

from __future__ import annotations

import json
from pathlib import Path

from rlhf_cli.main import main

REPO = Path(__file__).resolve().parents[2]
PRESET = REPO / "configs" / "qwen2.5-7b_gsm8k_ppo_8gpu.yaml"
QWEN25_7B = {"model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
             "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064,
             "tie_word_embeddings": False}


def _safetensors_header_only(path: Path, shapes: dict[str, list[int]]) -> None:
    """A safetensors file whose header names ``shapes`` (bf16) and which holds no tensor data: the
    model-folder check reads headers alone, and a 7B embedding would be a gigabyte."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 2 * shape[0] * shape[1]
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text)


def _hub_with_headers_only(root: Path) -> Path:
    repo = root / "models--Qwen--Qwen2.5-7B-Instruct"
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snapshot.name)
    (snapshot / "config.json").write_text(json.dumps(QWEN25_7B))
    (snapshot / "tokenizer.json").write_text("{}")
    (snapshot / "tokenizer_config.json").write_text("{}")
    _safetensors_header_only(snapshot / "model.safetensors",
                             {"model.embed_tokens.weight": [QWEN25_7B["vocab_size"], QWEN25_7B["hidden_size"]]})
    return root


def test_config_show_validates_the_7b_preset(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_CACHE", str(_hub_with_headers_only(tmp_path / "hub")))
    train = tmp_path / "gsm8k_train.jsonl"  # the preset's GSM8K path is outside the checkout in CI
    train.write_text(json.dumps({"question": "1 + 1?", "answer": "#### 2"}) + "\n")
    code = main(["config", "show", "--flat", "-c", str(PRESET), f"data.train_files=[{train}]"])
    out, err = capsys.readouterr()
    assert code == 0, err
    flat = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    assert flat["actor_rollout_ref.model.path"] == "Qwen/Qwen2.5-7B-Instruct"
    for key in ("actor_rollout_ref.actor.deepspeed_config.zero_stage", "critic.deepspeed_config.zero_stage"):
        assert flat[key] == "3", key
    assert flat["actor_rollout_ref.model.enable_gradient_checkpointing"] == "True"
    assert flat["critic.model.enable_gradient_checkpointing"] == "True"
    assert flat["trainer.n_gpus_per_node"] == "8"

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))  # the check can fail: no model, no show
    assert main(["config", "show", "-c", str(PRESET), f"data.train_files=[{train}]"]) == 2
    assert "Qwen/Qwen2.5-7B-Instruct" in capsys.readouterr().err
