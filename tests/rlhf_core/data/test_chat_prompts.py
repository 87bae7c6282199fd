"""Prompts are the model's own chat template, rendered as verl renders them (issue 48 item 7).

verl's RLHFDataset turns a row's ``prompt`` messages into ``apply_chat_template(messages,
add_generation_prompt=True)``; the preprocess stage must give exactly those token ids and that text,
whatever the layout (verl's Parquet with a message list, adapter 'verl' or 'auto'; our gsm8k JSONL
with data.instruction and data.system_prompt), including the system message a template inserts on
its own (SmolLM2's) and the ``<|im_end|>`` of every earlier turn — which is the pad id of a model
whose pad token is its EOS, and must stay in the prompt like any other token.

Checked on the tiny ChatML tokenizer (pad != EOS), its pad == EOS copy, a copy with SmolLM2's
template, and the real SmolLM2 tokenizer where `make smollm2` imported it.
"""

from __future__ import annotations

import json

import pandas as pd
import pyarrow.parquet as pq
import pytest

from rlhf_core.config import load_config
from rlhf_core.config.schema import DataConfig
from rlhf_core.data.preprocess import preprocess_files
from rlhf_core.run.layout import RunDir
from rlhf_core.stages.preprocess import run_preprocess

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
QUESTION = "Tom has 5 apples and eats 2. How many are left?"

CONVERSATIONS = {
    "user": [{"role": "user", "content": f"{QUESTION} {INSTRUCTION}"}],
    "system+user": [{"role": "system", "content": "You are a careful math tutor."},
                    {"role": "user", "content": f"What is 3 + 4? {INSTRUCTION}"}],
    # a multi-turn prompt: the assistant's earlier turn ends in <|im_end|> inside the prompt
    "multi-turn": [{"role": "user", "content": "What is 1 + 2?"}, {"role": "assistant", "content": "#### 3"},
                   {"role": "user", "content": f"And 12 - 7? {INSTRUCTION}"}],
}
TOKENIZERS = ("tiny", "tiny_pad_eos", "smol_like", "smollm2")


@pytest.fixture(scope="module", params=TOKENIZERS)
def chat_tokenizer(request, chat_models, smollm2_system):
    """(model directory, tokenizer, the system message its template inserts itself or None)."""
    from transformers import AutoTokenizer

    model_dir = request.getfixturevalue("smollm2_dir") if request.param == "smollm2" else chat_models[request.param]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token_id == end_of_turn
    assert (tokenizer.pad_token_id == end_of_turn) == (request.param != "tiny")  # the layouts under test
    return model_dir, tokenizer, smollm2_system if request.param in ("smol_like", "smollm2") else None


def chatml(messages: list[dict], default_system: str | None) -> str:
    """ChatML written out by hand: [the template's own system turn] + one block per message + the
    opened assistant turn."""
    if default_system is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": default_system}, *messages]
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + "<|im_start|>assistant\n"


def template_ids(tokenizer, messages: list[dict]) -> list[int]:
    """``apply_chat_template(messages, add_generation_prompt=True, tokenize=True)``'s token ids (a
    plain list in transformers 4, a BatchEncoding in 5)."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def verl_rows(conversations: dict[str, list[dict]]) -> list[dict]:
    """verl's GSM8K layout (examples/data_preprocess/gsm8k.py): the messages in ``prompt``."""
    return [{"data_source": "openai/gsm8k", "prompt": messages, "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(7 + i)},
             "extra_info": {"split": "train", "index": i, "name": name}}
            for i, (name, messages) in enumerate(conversations.items())]


def assert_rendered_by_template(row: dict, messages: list[dict], tokenizer, default_system: str | None) -> None:
    """The prompts-table row holds the template's rendering of ``messages``, token for token."""
    assert row["prompt"] == messages
    assert row["prompt_text"] == chatml(messages, default_system)
    assert row["prompt_text"] == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert row["prompt_token_ids"] == template_ids(tokenizer, messages)
    assert row["prompt_length"] == len(row["prompt_token_ids"]) and row["prompt_tokens_cut"] == 0
    # every turn's <|im_end|> (the pad id too, where pad == EOS) is a real prompt token
    turns = len(messages) + (default_system is not None and messages[0]["role"] != "system")
    assert row["prompt_token_ids"].count(tokenizer.convert_tokens_to_ids("<|im_end|>")) == turns
    assert tokenizer.decode(row["prompt_token_ids"], skip_special_tokens=False) == row["prompt_text"]


@pytest.mark.parametrize("adapter", ["verl", "auto"])
def test_verl_message_lists_become_the_templates_prompt(tmp_path, chat_tokenizer, adapter):
    _, tokenizer, default_system = chat_tokenizer
    path = tmp_path / "train.parquet"
    pd.DataFrame(verl_rows(CONVERSATIONS)).to_parquet(path, engine="pyarrow")
    result = preprocess_files([path], [], DataConfig(adapter=adapter, val_fraction=0.0), tokenizer, progress=False)
    assert result.layouts == {str(path): "verl"} and result.rejects.num_rows == 0
    rows = {json.loads(r["extra_info"])["name"]: r for r in result.train.to_pylist()}
    assert set(rows) == set(CONVERSATIONS)
    for name, messages in CONVERSATIONS.items():
        assert_rendered_by_template(rows[name], messages, tokenizer, default_system)
    # a template with a default system message puts it in front of a conversation without one only
    if default_system is not None:
        assert default_system in rows["user"]["prompt_text"] and default_system in rows["multi-turn"]["prompt_text"]
        assert default_system not in rows["system+user"]["prompt_text"]


@pytest.mark.parametrize("system_prompt", [None, "You are a careful math tutor."])
def test_gsm8k_rows_become_system_and_user_turns_in_the_template(tmp_path, chat_tokenizer, system_prompt):
    """gsm8k adapter: user turn = question, a space, data.instruction (verl's script); data.system_prompt
    set: a system turn first (which replaces a template's default one), else none of ours."""
    _, tokenizer, default_system = chat_tokenizer
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"question": QUESTION, "answer": "5 - 2 = 3\n#### 3"}) + "\n")
    data = DataConfig(adapter="gsm8k", instruction=INSTRUCTION, system_prompt=system_prompt, val_fraction=0.0)
    (row,) = preprocess_files([path], [], data, tokenizer, progress=False).train.to_pylist()
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + \
        [{"role": "user", "content": f"{QUESTION} {INSTRUCTION}"}]
    assert_rendered_by_template(row, messages, tokenizer, default_system)
    assert (default_system is not None and system_prompt is None) == \
        row["prompt_text"].startswith(f"<|im_start|>system\n{default_system}<|im_end|>")


def test_the_preprocess_stage_renders_with_the_actors_tokenizer(tmp_path, chat_tokenizer):
    """`rlhf stage preprocess` on verl's Parquet: the tables it writes hold the actor model's template
    rendering (prompts/train.parquet and val.parquet, which validation decodes from)."""
    model_dir, tokenizer, default_system = chat_tokenizer
    rows = verl_rows(CONVERSATIONS)
    rows += [dict(r, extra_info={**r["extra_info"], "name": f"{r['extra_info']['name']} again"},
                  prompt=[*r["prompt"][:-1], {"role": "user", "content": r["prompt"][-1]["content"] + " Again."}])
             for r in verl_rows(CONVERSATIONS)]
    path = tmp_path / "gsm8k_train.parquet"
    pd.DataFrame(rows).to_parquet(path, engine="pyarrow")
    cfg = load_config(None, [f"data.train_files=[{path}]", "data.val_fraction=0.5", "data.train_batch_size=2",
                             "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                             f"actor_rollout_ref.model.path={model_dir}"])
    run = RunDir(tmp_path / "run")
    run_preprocess(cfg, run)
    written = pq.read_table(run.train_prompts).to_pylist() + pq.read_table(run.val_prompts).to_pylist()
    assert len(written) == len(rows) and pq.read_table(run.val_prompts).num_rows > 0
    for row in written:
        assert_rendered_by_template(row, row["prompt"], tokenizer, default_system)


def test_the_smollm2_like_template_is_smollm2s_own(smollm2_dir, smollm2_template):
    """The copy the tiny tests use stands for the real template, character for character."""
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(smollm2_dir).chat_template == smollm2_template
