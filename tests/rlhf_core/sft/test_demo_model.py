"""The demo's shipped starting point, data/models/demo (``rlhf_core.sft.demo_model``): its files are
the ones its build.json lists, configs/demo.yaml starts from it without a warm start, and on the
reference machine its recipe (`rlhf model build-demo`) makes the same bytes again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_core.config.loader import load_config
from rlhf_core.paths import resolve_model_path
from rlhf_core.sft.demo_model import (
    BUILD_RECORD, DEMO_MODEL, build_demo_model, changed_files, fingerprint_difference, machine_fingerprint,
    read_build_record,
)


@pytest.fixture(scope="module")
def shipped(repo_root) -> Path:
    return repo_root / DEMO_MODEL


def test_the_shipped_files_are_the_ones_build_json_lists(shipped):
    record = read_build_record(shipped)
    assert set(record["files"]) >= {"model.safetensors", "config.json", "tokenizer.json", "warm_start.json"}
    assert changed_files(shipped) == []
    assert sum(f.stat().st_size for f in shipped.iterdir()) < 4 << 20  # a few MB at most in the repository


def test_a_changed_shipped_file_is_named(shipped, tmp_path):
    import shutil

    copy = tmp_path / "demo"
    shutil.copytree(shipped, copy)
    (copy / "config.json").write_text((copy / "config.json").read_text() + " ")
    assert changed_files(copy) == ["config.json"]


def test_the_demo_preset_starts_from_the_shipped_model_without_a_warm_start(repo_root, shipped):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = load_config(repo_root / "configs" / "demo.yaml")
    assert not cfg.actor_rollout_ref.model.warm_start.enable
    assert resolve_model_path(cfg.actor_rollout_ref.model.path) == shipped.resolve()
    tokenizer = AutoTokenizer.from_pretrained(str(shipped))
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    model = AutoModelForCausalLM.from_pretrained(str(shipped))
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    final = json.loads((shipped / "warm_start.json").read_text())["final"]
    assert 0.1 < final["dev_acc_strict"] < 0.5  # weak but real, as the warm start promises


def _reference_or_skip(shipped: Path) -> None:
    reference = read_build_record(shipped)["reference_machine"]
    differences = fingerprint_difference(reference, machine_fingerprint())
    if differences:
        pytest.skip("the shipped demo model was built on " + ", ".join(f"{k} {v}" for k, v in reference.items())
                    + "; a rebuild reproduces its bytes only there (here " + "; ".join(differences) + ")")


@pytest.mark.slow
def test_the_recipe_rebuilds_the_shipped_bytes_on_the_reference_machine(shipped, tmp_path):
    """~1,000 supervised steps on one thread: 2-4 minutes on the 2-core reference machine."""
    _reference_or_skip(shipped)
    rebuilt = build_demo_model(tmp_path / "demo", progress=False)
    names = sorted(p.name for p in shipped.iterdir() if p.is_file())
    assert names == sorted(p.name for p in rebuilt.iterdir() if p.is_file())
    different = [n for n in names if n != BUILD_RECORD and (shipped / n).read_bytes() != (rebuilt / n).read_bytes()]
    assert not different, f"the recipe made other bytes than data/models/demo ships: {different}"
    ours, theirs = read_build_record(shipped), read_build_record(rebuilt)
    assert {k: v for k, v in ours.items() if k != "seconds"} == {k: v for k, v in theirs.items() if k != "seconds"}
