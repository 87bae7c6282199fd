"""Build a tiny Qwen2-style causal LM and a real BPE tokenizer locally (no hub access needed).

The tokenizer is a byte-level BPE trained with ``tokenizers`` on the project's embedded data (so any
UTF-8 text still encodes: unseen characters fall back to bytes), with a ChatML chat template and
``<|im_end|>`` as EOS, the way Qwen2 models end a turn. The model is randomly initialised from a
seed. Both save in Hugging Face format and load with ``AutoTokenizer`` / ``AutoModelForCausalLM``.

    rlhf model build-tiny --out .rlhf/models/tiny
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Optional

from rlhf_core.io.atomic import atomic_dir

# the checkout holding data/ (the tiny model's tokenizer is trained on the embedded data)
PROJECT_ROOT = Path(__file__).resolve().parents[2]

PAD, EOS, IM_START, IM_END = "<|endoftext|>", "<|im_end|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END]

# ChatML, as Qwen2 uses it; `add_generation_prompt` opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass
class TinyModelSpec:
    """Shape of the tiny model. Defaults: ~0.5 M parameters, fast enough for CI on 2 cores."""

    vocab_size: int = 512
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 176
    max_position_embeddings: int = 1024
    seed: int = 0


def default_corpus() -> list[str]:
    """Texts the tokenizer learns merges from: the embedded arithmetic problems."""
    path = PROJECT_ROOT / "data" / "arith" / "train.jsonl"
    texts = []
    if path.is_file():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            texts.extend([row["question"], row["answer"]])
    texts.append("Let's think step by step and output the final answer after \"####\".")
    texts += ["system", "user", "assistant"] * 50  # chat roles as single tokens
    return texts


def build_tokenizer(corpus: Iterable[str], vocab_size: int = 512):
    """Train a byte-level BPE tokenizer and wrap it as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(list(corpus), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD,
                                   padding_side="left", model_max_length=4096)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(out_dir: str | Path, spec: Optional[TinyModelSpec] = None,
                     corpus: Optional[Iterable[str]] = None) -> Path:
    """Write tokenizer + randomly initialised Qwen2 causal LM to ``out_dir``; returns the path.

    Deterministic: the same spec and corpus give the same tokenizer and the same weights.
    """
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    spec = spec or TinyModelSpec()
    tokenizer = build_tokenizer(corpus if corpus is not None else default_corpus(), spec.vocab_size)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
        intermediate_size=spec.intermediate_size, max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None, attn_implementation="sdpa",
    )
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    with atomic_dir(out_dir) as tmp:
        tokenizer.save_pretrained(tmp)
        model.save_pretrained(tmp, safe_serialization=True)
        (tmp / "tiny_spec.json").write_text(json.dumps(asdict(spec), indent=2))
    return Path(out_dir)


def ensure_tiny_model(out_dir: str | Path, spec: Optional[TinyModelSpec] = None) -> Path:
    """Build once, reuse after: the directory is complete or absent (atomic build)."""
    out_dir = Path(out_dir)
    if (out_dir / "config.json").is_file() and (out_dir / "tiny_spec.json").is_file():
        return out_dir
    return build_tiny_model(out_dir, spec)
