"""Models of a real model's layer shape, cut to a few layers, with random weights: benchmarks measure the
fixed costs (loads, checkpoints, engine setup) that grow with the parameter count, without the hub.

    from benchmarks.shapes import build_shape_model
    model_dir = build_shape_model(".rlhf/models/shapes", "qwen2.5-0.5b", layers=8)   # ~120 M parameters

The tokenizer is the project's tiny byte-level BPE (``rlhf_core.models.tiny.build_tokenizer`` on the
embedded data, 512 tokens, ChatML template): the vocabulary, and so the embedding, is tiny (or as large
as ``vocab`` asks: the real model's, for its LM head's cost), and every other weight has the real
model's shape. Weights are float32 (the fast dtype on these CPUs), drawn from
``seed`` with transformers' own initialisation. Nothing is downloaded.

At 8 layers of Qwen2.5-0.5B: 8 × 14.9 M (attention 1.8 M + MLP 13.1 M) + 0.46 M embedding ≈ 120 M
parameters, 0.48 GB of safetensors.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from benchmarks/ as well as imported from the repo root
    sys.path.insert(0, str(REPO))

from rlhf_core.io.atomic import atomic_dir  # noqa: E402
from rlhf_core.models.tiny import build_tokenizer, default_corpus  # noqa: E402

SHAPES: dict[str, dict] = {
    # Qwen2.5-0.5B's config.json, less the vocabulary and the layer count (given by the caller)
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
                         hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1e6,
                         tie_word_embeddings=True, use_sliding_window=False, attention_dropout=0.0,
                         initializer_range=0.02),
}
TOKENIZER_VOCAB = 512
"""The tiny tokenizer's size (rlhf_core.models.tiny.TinyModelSpec.vocab_size)."""
SPEC_FILE = "shape_spec.json"
"""What a cached directory was built from; a directory is reused only when it matches."""


def shape_spec(shape: str, layers: int, seed: int, vocab: Optional[int] = None) -> dict:
    """The full description of a shape model (the cache key). Raises ValueError for an unknown shape,
    no layer, or a vocabulary smaller than the tokenizer's."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; valid: {', '.join(sorted(SHAPES))}")
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    if vocab is not None and vocab < TOKENIZER_VOCAB:
        raise ValueError(f"vocab must be at least the tokenizer's {TOKENIZER_VOCAB}, got {vocab}")
    return {"shape": shape, "num_hidden_layers": layers, "seed": seed, "tokenizer_vocab": TOKENIZER_VOCAB,
            **SHAPES[shape], **({"vocab_size": vocab} if vocab is not None else {})}


def shape_dir_name(shape: str, layers: int, seed: int, vocab: Optional[int] = None) -> str:
    """``qwen2.5-0.5b-8l-seed0`` (``-v151936`` with a vocabulary of its own): one cached directory per
    (shape, layers, seed, vocabulary)."""
    return f"{shape}-{layers}l-seed{seed}" + (f"-v{vocab}" if vocab is not None else "")


def build_shape_model(out_dir: str | Path, shape: str = "qwen2.5-0.5b", layers: int = 8, seed: int = 0,
                      vocab: Optional[int] = None) -> Path:
    """The HF directory (tokenizer + Qwen2 causal LM) of ``shape`` cut to ``layers`` layers, under the
    cache folder ``out_dir``; built on first use (atomically: complete or absent), reused after.
    ``vocab``: the model's vocabulary (embedding and LM head rows), e.g. Qwen2.5's real 151,936, when
    the LM head's cost matters; the tokenizer still knows its 512 tokens, so ids past them are valid
    model tokens without text (they decode to nothing). Default: the tokenizer's vocabulary.

    Returns ``out_dir / shape_dir_name(shape, layers, seed, vocab)``.
    """
    spec = shape_spec(shape, layers, seed, vocab)
    target = Path(out_dir) / shape_dir_name(shape, layers, seed, vocab)
    spec_path = target / SPEC_FILE
    if spec_path.is_file() and json.loads(spec_path.read_text()) == spec and (target / "config.json").is_file():
        return target
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    tokenizer = build_tokenizer(default_corpus(), TOKENIZER_VOCAB)
    arch = {k: v for k, v in spec.items() if k not in ("shape", "seed", "tokenizer_vocab", "vocab_size")}
    config = Qwen2Config(**arch, vocab_size=vocab or len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None, attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # the tiny model's generation settings: stop at <|im_end|>, pad with <|endoftext|>
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    with atomic_dir(target) as tmp:
        tokenizer.save_pretrained(tmp)
        model.save_pretrained(tmp, safe_serialization=True)
        (tmp / SPEC_FILE).write_text(json.dumps(spec, indent=2))
    return target


def parameter_count(model_dir: str | Path) -> int:
    """Parameters of a shape model, from its config (no weights loaded); tied embedding counted once."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    attention = h * h + h + 2 * (h * kv + kv) + h * h  # q (+bias), k, v (+bias), o
    mlp = 3 * h * inter  # gate, up, down
    per_layer = attention + mlp + 2 * h  # + input and post-attention RMSNorm
    embed = cfg["vocab_size"] * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return layers * per_layer + embed + h  # + final norm


if __name__ == "__main__":
    import argparse

    from arguments import at_least, output_dir, positive_int  # benchmarks/arguments.py: this script's folder is on sys.path

    parser = argparse.ArgumentParser(description="build (or find) a shape model")
    parser.add_argument("--out", type=output_dir, default=REPO / ".rlhf" / "models" / "shapes")
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=positive_int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab", type=at_least(TOKENIZER_VOCAB),
                        help=f"the model's vocabulary (default: the tokenizer's {TOKENIZER_VOCAB})")
    a = parser.parse_args()
    path = build_shape_model(a.out, a.shape, a.layers, a.seed, a.vocab)
    print(f"{path} ({parameter_count(path) / 1e6:.1f} M parameters)")
