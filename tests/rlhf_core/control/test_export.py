"""Export: gated on the latest validation accuracy; a LoRA actor is merged into a plain HF model."""

from __future__ import annotations

import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlhf_core.config import load_config
from rlhf_core.errors import CheckpointError
from rlhf_core.io.checksums import write_checksums
from rlhf_core.control.export import ExportRefused, export_actor, latest_val_score
from rlhf_core.io.atomic import atomic_write_json
from rlhf_core.run.layout import RunDir
from rlhf_core.run.manifest import hash_paths, record_stage


def _run(tmp_path, val_scores, responses: int = 20):
    """Committed iterations 1..N, iteration k validated (its table and its stage's record) at
    ``val_scores[k - 1]`` (None: not validated)."""
    run = RunDir(tmp_path / "run")
    for k, score in enumerate(val_scores, start=1):
        run.iter_dir(k).mkdir(parents=True)
        atomic_write_json(run.iter_dir(k) / "iteration_metrics.json", {"reward/mean": 0.1})
        if score is not None:
            correct = [i < round(score * responses) for i in range(responses)]
            pq.write_table(pa.table({"correct": correct}), run.validation(k))
            record_stage(run, k, "validate", status="done", outputs=hash_paths(run, [run.validation(k)]))
    last = len(val_scores)  # the commit log as the guard's commits leave it
    atomic_write_json(run.last_good_path, {"iteration": last, "checkpoint": f"iter_{last}/checkpoint",
                                           "committed": list(range(1, last + 1))})
    return run


def test_the_latest_validation_score_decides(tmp_path, tiny_model_dir):
    cfg = load_config(None, ["trainer.export_min_val_score=0.5"])
    run = _run(tmp_path, [0.9, 0.25, None])  # iteration 3 did not validate: iteration 2's score counts
    assert latest_val_score(run) == (2, 0.25)
    with pytest.raises(ExportRefused, match=r"0\.2500 \(iteration 2\) is below trainer.export_min_val_score=0.5"):
        export_actor(cfg, run)
    with pytest.raises(ExportRefused, match="no validation score yet"):
        export_actor(cfg, _run(tmp_path / "b", [None]))


def test_the_gate_reads_the_verified_validation_table_not_the_report(tmp_path):
    """iteration_metrics.json is a report anyone may edit: raising its val/accuracy exports nothing
    the validation itself did not score, and a validation table that no longer matches its record
    is refused, naming it."""
    run = _run(tmp_path, [0.0])
    atomic_write_json(run.iteration_metrics(1), {"val/accuracy": 0.99})
    assert latest_val_score(run) == (1, 0.0)
    pq.write_table(pa.table({"correct": [True] * 20}), run.validation(1))
    with pytest.raises(CheckpointError, match=r"iter_1/validation.parquet no longer matches the sha256"):
        latest_val_score(run)


def test_full_actor_export(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    run = _run(tmp_path, [0.5])
    shutil.copytree(tiny_model_dir, run.checkpoint(1) / "actor")
    write_checksums(run.checkpoint(1))
    out = export_actor(load_config(None, ["trainer.export_min_val_score=0.5"]), run)
    assert out == run.root / "export" / "actor"
    model = AutoModelForCausalLM.from_pretrained(out)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))
    assert run.read_json(out / "export.json")["merged_lora"] is False
    assert (out / "tokenizer_config.json").is_file()


def test_a_checkpoint_that_does_not_verify_is_never_exported(tmp_path, tiny_model_dir):
    run = _run(tmp_path, [0.5])
    shutil.copytree(tiny_model_dir, run.checkpoint(1) / "actor")
    write_checksums(run.checkpoint(1))
    weights = run.checkpoint(1) / "actor" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"refusing to export .*model.safetensors is corrupt"):
        export_actor(load_config(None, ["trainer.export_min_val_score=0.5"]), run)
    assert not run.exported_actor.exists()


def test_lora_adapter_is_merged(tmp_path, tiny_model_dir):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    run = _run(tmp_path, [1.0])
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    adapter_dir = run.checkpoint(1) / "actor"
    peft.save_pretrained(adapter_dir)
    shutil.copy(tiny_model_dir / "tokenizer.json", adapter_dir)
    shutil.copy(tiny_model_dir / "tokenizer_config.json", adapter_dir)
    write_checksums(run.checkpoint(1))
    out = export_actor(load_config(None), run, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), adapter_dir).eval()
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, reference(ids).logits, atol=1e-4, rtol=1e-4)
        assert not torch.allclose(merged(ids).logits, AutoModelForCausalLM.from_pretrained(tiny_model_dir)(ids).logits)
    assert not (out / "adapter_config.json").exists()
    assert run.read_json(out / "export.json")["merged_lora"] is True


def test_a_lora_runs_checkpoint_is_exported_as_merged(tmp_path, tiny_model_dir):
    """Issue 29: a LoRA run's checkpoint actor/ holds the adapters merged in (the adapter is saved
    beside it), and export.json said "merged_lora": false for it."""
    run = _run(tmp_path, [1.0])
    shutil.copytree(tiny_model_dir, run.checkpoint(1) / "actor")  # what a LoRA update writes as actor/
    write_checksums(run.checkpoint(1))
    out = export_actor(load_config(None, ["actor_rollout_ref.model.lora_rank=4"]), run)
    assert run.read_json(out / "export.json")["merged_lora"] is True
