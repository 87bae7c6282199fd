"""The streaming safetensors writer: same content as safetensors.torch.save_file, and the sha256
it records while writing is the file's."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from rlhf_core.io.safetensors_stream import LazyTensor, write_hashed_json, write_safetensors


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w.fp32": torch.randn(7, 5, generator=g),
        "w.bf16": torch.randn(3, 9, generator=g).to(torch.bfloat16),
        "w.fp16": torch.randn(4, generator=g).to(torch.float16),
        "ids": torch.arange(11, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "strided": torch.randn(6, 4, generator=g).t(),  # not contiguous: written as its values
        "bytes": torch.randint(0, 255, (13,), dtype=torch.uint8, generator=g),
    }


def test_same_content_as_save_file_and_recorded_hash_is_the_files(tmp_path):
    src = tensors()
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    digest = write_safetensors(ours, src, metadata={"format": "pt"})
    save_file({k: v.contiguous() for k, v in src.items()}, str(theirs), metadata={"format": "pt"})

    a, b = load_file(str(ours)), load_file(str(theirs))
    assert a.keys() == b.keys() == src.keys()
    for k in src:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k
    with safe_open(str(ours), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    raw = ours.read_bytes()
    assert digest == {"sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw)}
    header_len = int.from_bytes(raw[:8], "little")
    assert (8 + header_len) % 8 == 0  # tensor data 8-byte aligned, as safetensors writes it


def test_lazy_tensors_are_produced_in_order_one_at_a_time(tmp_path):
    produced = []

    def make(i):
        def produce():
            produced.append(i)
            return torch.full((2, 3), float(i))
        return produce

    src = {f"t{i}": LazyTensor(torch.float32, (2, 3), make(i)) for i in range(3)}
    write_safetensors(tmp_path / "lazy.safetensors", src)
    assert produced == [0, 1, 2]
    got = load_file(str(tmp_path / "lazy.safetensors"))
    assert all(torch.equal(got[f"t{i}"], torch.full((2, 3), float(i))) for i in range(3))


def test_a_lazy_tensor_that_breaks_its_promise_is_refused(tmp_path):
    src = {"t": LazyTensor(torch.float32, (2, 3), lambda: torch.zeros(3, 2))}
    with pytest.raises(ValueError, match="announced as"):
        write_safetensors(tmp_path / "bad.safetensors", src)


def test_hashed_json(tmp_path):
    digest = write_hashed_json(tmp_path / "x.json", {"b": 1, "a": [1, 2]})
    raw = (tmp_path / "x.json").read_bytes()
    assert json.loads(raw) == {"a": [1, 2], "b": 1}
    assert digest == {"sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw)}
