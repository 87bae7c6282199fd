"""`rlhf export` keeps the chat model a chat model (issue 48 item 7): the exported directory's
tokenizer has the source's chat template and renders every conversation to the same text and ids
(SmolLM2's default system message included), keeps its EOS / pad tokens, and its generation config
stops on the end-of-turn token, so the exported model answers and stops as the trained one did.
(The export of a checkpoint the real trainer wrote: tests/rlhf_core/stages/test_end_of_turn_iteration.py.)
"""

from __future__ import annotations

import shutil

import pyarrow as pa
import pyarrow.parquet as pq

from rlhf_core.config import load_config
from rlhf_core.control.export import export_actor
from rlhf_core.io.atomic import atomic_write_json
from rlhf_core.io.checksums import write_checksums
from rlhf_core.run.layout import RunDir
from rlhf_core.run.manifest import hash_paths, record_stage
from rlhf_core.training.checkpoint import save_tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "What is 3 + 4?"}],
    [{"role": "system", "content": "You are a careful math tutor."}, {"role": "user", "content": "What is 12 - 7?"}],
    [{"role": "user", "content": "What is 1 + 2?"}, {"role": "assistant", "content": "#### 3"},
     {"role": "user", "content": "And 4 + 3?"}],
]


def rendered(tokenizer, messages) -> tuple[str, list[int]]:
    """(text, ids) of ``messages`` with the generation prompt opened, as preprocess renders them."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return text, list(out["input_ids"] if hasattr(out, "keys") else out)


def assert_same_chat_tokenizer(exported, source) -> None:
    assert exported.chat_template == source.chat_template
    assert (exported.eos_token, exported.eos_token_id) == (source.eos_token, source.eos_token_id)
    assert (exported.pad_token, exported.pad_token_id) == (source.pad_token, source.pad_token_id)
    for messages in CONVERSATIONS:
        assert rendered(exported, messages) == rendered(source, messages)


def committed_run(tmp_path, model_dir) -> RunDir:
    """A run whose iteration 1 is committed and validated, its checkpoint's actor written as the
    trainer writes it: the model's files, then the run's tokenizer (``checkpoint.save_tokenizer``)."""
    from transformers import AutoModelForCausalLM

    run = RunDir(tmp_path / "run")
    actor = run.checkpoint(1) / "actor"
    AutoModelForCausalLM.from_pretrained(model_dir).save_pretrained(actor, safe_serialization=True)
    save_tokenizer(model_dir, actor)
    write_checksums(run.checkpoint(1))
    pq.write_table(pa.table({"correct": [True, False]}), run.validation(1))
    record_stage(run, 1, "validate", status="done", outputs=hash_paths(run, [run.validation(1)]))
    atomic_write_json(run.last_good_path, {"iteration": 1, "checkpoint": "iter_1/checkpoint", "committed": [1]})
    return run


def test_the_export_keeps_the_chat_template_and_stops_on_the_end_of_turn(tmp_path, chat_model):
    from transformers import AutoTokenizer, GenerationConfig

    from rlhf_core.rollout.base import FINISH_STOP, SamplingParams
    from rlhf_core.rollout.hf import HFEngine

    name, model_dir = chat_model
    out = export_actor(load_config(None, ["trainer.export_min_val_score=0.5"]), committed_run(tmp_path, model_dir))
    source = AutoTokenizer.from_pretrained(model_dir)
    assert_same_chat_tokenizer(AutoTokenizer.from_pretrained(out), source)
    end_of_turn = source.convert_tokens_to_ids("<|im_end|>")
    ends = GenerationConfig.from_pretrained(out).eos_token_id
    assert end_of_turn in (ends if isinstance(ends, list) else [ends])
    engine = HFEngine(out, device="cpu")  # the exported model answers and stops as the trained one
    try:
        (sample,) = engine.generate([rendered(source, CONVERSATIONS[0])[1]], SamplingParams(greedy=True,
                                                                                            max_new_tokens=24))
    finally:
        engine.close()
    assert sample.finish_reason == FINISH_STOP and sample.token_ids[-1] == end_of_turn


def test_smollm2s_tokenizer_survives_the_checkpoint_and_the_export(tmp_path, smollm2_dir):
    """The real SmolLM2 tokenizer through the two writes a run makes of it (the checkpoint's copy,
    then the export's): its template, its default system message and its <|im_end|> EOS = pad."""
    from transformers import AutoTokenizer, GenerationConfig

    source = AutoTokenizer.from_pretrained(smollm2_dir)
    save_tokenizer(smollm2_dir, tmp_path / "actor")  # what a checkpoint holds
    AutoTokenizer.from_pretrained(tmp_path / "actor").save_pretrained(tmp_path / "export")  # what export writes
    exported = AutoTokenizer.from_pretrained(tmp_path / "export")
    assert_same_chat_tokenizer(exported, source)
    assert rendered(exported, CONVERSATIONS[0])[0].startswith("<|im_start|>system\nYou are a helpful AI assistant")
    end_of_turn = source.convert_tokens_to_ids("<|im_end|>")
    assert exported.eos_token_id == exported.pad_token_id == end_of_turn
    shutil.copy(smollm2_dir / "generation_config.json", tmp_path / "export")
    ends = GenerationConfig.from_pretrained(tmp_path / "export").eos_token_id
    assert end_of_turn in (ends if isinstance(ends, list) else [ends])
