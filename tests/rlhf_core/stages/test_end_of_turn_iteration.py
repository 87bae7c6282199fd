"""One iteration on a chat model, stage by stage, as verl runs it (issue 48 item 7): verl's GSM8K
Parquet (``prompt`` = a list of messages) → preprocess → pack → rollout → init_critic → score → gae
(→ update → validate → export, in the DeepSpeed lane), on the tiny model taught to end its answers
with ``<|im_end|>``: pad != EOS, pad == EOS, and SmolLM2's template (a default system message).

    rollout   each response ends with <|im_end|> (finish_reason "stop"), nothing after it
    score     the EOS's old / ref log-prob and value are scored: those of an unpadded forward
    gae       the sequence reward sits on the last response token, the EOS (verl's reward manager)
    update    the trainer's first log-probs are the old ones at every token, EOS included
    validate  the validation prompts go to the engine as the template rendered them
    export    the exported tokenizer keeps the template; generation_config stops on <|im_end|>
"""

from __future__ import annotations

import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

from rlhf_core.config import load_config, to_yaml
from rlhf_core.rollout.base import FINISH_STOP, SamplingParams
from rlhf_core.rollout.hf import HFEngine
from rlhf_core.run.layout import RunDir, write_config
from rlhf_core.stages.gae import run_gae
from rlhf_core.stages.init_critic import run_init_critic
from rlhf_core.stages.pack import run_pack
from rlhf_core.stages.preprocess import run_preprocess
from rlhf_core.stages.rollout import run_rollout
from rlhf_core.stages.score import run_score
from rlhf_core.stages.validate import run_validate

TRAIN = [
    ([{"role": "user", "content": "What is 3 + 4?"}], "7"),
    ([{"role": "user", "content": "Tom has 5 apples and eats 1. How many are left?"}], "4"),
    ([{"role": "system", "content": "You are a careful math tutor."}, {"role": "user", "content": "What is 12 - 7?"}],
     "5"),
    ([{"role": "user", "content": "What is 1 + 2?"}, {"role": "assistant", "content": "#### 3"},
      {"role": "user", "content": "Tom has 4 apples and eats 1. How many are left?"}], "3"),
]
VAL = [
    ([{"role": "user", "content": "What is 2 + 5?"}], "7"),
    ([{"role": "user", "content": "What is 1 + 2?"}, {"role": "assistant", "content": "#### 3"},
      {"role": "user", "content": "And 4 + 3?"}], "7"),
    ([{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Tom has 3 apples and eats 1."}],
     "2"),
]
MAX_RESPONSE = 24
VARIANTS = ("tiny", "tiny_pad_eos", "smol_like")


def write_verl_parquet(path, examples) -> str:
    """verl's GSM8K layout (examples/data_preprocess/gsm8k.py), messages in ``prompt``."""
    pd.DataFrame([{"data_source": "openai/gsm8k", "prompt": messages, "ability": "math",
                   "reward_model": {"style": "rule", "ground_truth": truth},
                   "extra_info": {"split": path.stem, "index": i}}
                  for i, (messages, truth) in enumerate(examples)]).to_parquet(path, engine="pyarrow")
    return str(path)


def template_ids(tokenizer, messages) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.fixture(scope="module", params=VARIANTS)
def chat_run(request, chat_models, tmp_path_factory):
    """(variant, config, run, tokenizer, EOS id) after preprocess → pack → rollout → init_critic →
    score → gae of iteration 1 (greedy rollout; the GSM8K rule with a format score, so every
    response that holds a number gets a non-zero reward)."""
    from transformers import AutoTokenizer

    model_dir = chat_models[request.param]
    root = tmp_path_factory.mktemp(f"chat_run_{request.param}")
    cfg = load_config(None, [
        f"data.train_files=[{write_verl_parquet(root / 'train.parquet', TRAIN)}]",
        f"data.val_files=[{write_verl_parquet(root / 'val.parquet', VAL)}]",
        "data.train_batch_size=4", "data.max_prompt_length=256", f"data.max_response_length={MAX_RESPONSE}",
        f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.rollout.do_sample=false",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2048", "critic.ppo_max_token_len_per_gpu=2048",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=2048",
        "custom_reward_function.gsm8k_method=flexible", "custom_reward_function.format_score=0.5",
        "trainer.device=cpu", "trainer.export_min_val_score=0.0"])
    run = RunDir(root / "run")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLHF_HOME", str(root / "rlhf-home"))
        write_config(run, to_yaml(cfg))
        for stage in (run_preprocess, run_pack):
            stage(cfg, run)
        run_rollout(cfg, run, 1)
        run_init_critic(cfg, run)
        run_score(cfg, run, 1)
        run_gae(cfg, run, 1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return request.param, cfg, run, tokenizer, tokenizer.convert_tokens_to_ids("<|im_end|>")


def unpadded(model, sequence: list[int], prompt_length: int) -> torch.Tensor:
    """(T, ·) outputs at the positions that score response tokens 0..T-1, the sequence alone."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([sequence])).logits[0, prompt_length - 1:-1].float()


def test_rollout_responses_end_with_the_end_of_turn_token(chat_run):
    name, _, run, tokenizer, eos = chat_run
    prompts = {r["prompt_id"]: r for r in pq.read_table(run.train_prompts).to_pylist()}
    rows = pq.read_table(run.rollout(1)).to_pylist()
    assert len(rows) == len(TRAIN)
    stopped = [r for r in rows if r["finish_reason"] == FINISH_STOP]
    assert len(stopped) >= 3  # the taught model stops by itself
    for r in rows:
        assert r["prompt_token_ids"] == template_ids(tokenizer, prompts[r["prompt_id"]]["prompt"])
        ids = r["response_token_ids"]
        assert r["response_length"] == len(ids) and len(r["rollout_log_probs"]) == len(ids)
        if r["finish_reason"] == FINISH_STOP:
            assert ids[-1] == eos and ids.count(eos) == 1 and "<|im_end|>" not in r["response_text"]
        else:
            assert len(ids) == MAX_RESPONSE and eos not in ids


def test_score_scores_the_end_of_turn_token(chat_run, chat_models):
    """old / ref log-probs and values hold one entry per response token, the last one the EOS's,
    each equal to an unpadded forward of that sequence (the prompt's own <|im_end|> seen)."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    name, _, run, _, eos = chat_run
    actor = AutoModelForCausalLM.from_pretrained(chat_models[name], dtype=torch.float32).eval()
    critic = AutoModelForTokenClassification.from_pretrained(run.critic_init, num_labels=1, dtype=torch.float32).eval()
    for r in pq.read_table(run.scored(1)).to_pylist():
        prompt, response = r["prompt_token_ids"], r["response_token_ids"]
        sequence, n = prompt + response, len(response)
        assert len(r["old_log_probs"]) == len(r["ref_log_probs"]) == len(r["values"]) == n
        expected = torch.log_softmax(unpadded(actor, sequence, len(prompt)), -1)[torch.arange(n), response]
        torch.testing.assert_close(torch.tensor(r["old_log_probs"]), expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(r["ref_log_probs"]), expected, atol=1e-5, rtol=0)  # ref = actor at k=1
        torch.testing.assert_close(torch.tensor(r["values"]), unpadded(critic, sequence, len(prompt))[:, 0],
                                   atol=1e-5, rtol=0)
        assert r["rollout_log_probs"][-1] == pytest.approx(r["old_log_probs"][-1], abs=1e-4)


def test_gae_puts_the_sequence_reward_on_the_end_of_turn_token(chat_run):
    _, _, run, _, eos = chat_run
    rows = pq.read_table(run.advantages(1)).to_pylist()
    assert any(r["reward"] != 0 for r in rows if r["response_token_ids"][-1:] == [eos])
    for r in rows:
        n = r["response_length"]
        assert r["token_level_rewards"] == [0.0] * (n - 1) + [r["reward"]]
        assert len(r["advantages"]) == len(r["returns"]) == n
        # gamma = lam = 1, no KL at iteration 1: every token's return is the score the EOS carries
        assert r["returns"] == pytest.approx([r["reward"]] * n, abs=1e-6)


def test_validation_decodes_the_template_rendered_prompts(chat_run, chat_models, monkeypatch):
    """The validate stage sends the engine the validation prompts as the chat template renders them
    (default system message included), and its table's responses are those prompts' greedy answers."""
    name, cfg, run, tokenizer, eos = chat_run
    sent: list[list[int]] = []
    generate = HFEngine.generate

    def recording(self, prompt_token_ids, sampling):
        sent.extend(list(p) for p in prompt_token_ids)
        return generate(self, prompt_token_ids, sampling)

    monkeypatch.setattr(HFEngine, "generate", recording)
    run_validate(cfg, run, 0)
    val_prompts = pq.read_table(run.val_prompts).to_pylist()
    expected = [template_ids(tokenizer, r["prompt"]) for r in val_prompts]
    assert sorted(sent) == sorted(expected) and len(sent) == len(VAL)
    monkeypatch.setattr(HFEngine, "generate", generate)
    engine = HFEngine(chat_models[name], device="cpu")
    try:
        answers = engine.generate(expected, SamplingParams(greedy=True, max_new_tokens=MAX_RESPONSE))
    finally:
        engine.close()
    by_id = {r["prompt_id"]: r for r in pq.read_table(run.validation(0)).to_pylist()}
    for prompt, answer in zip(val_prompts, answers):
        row = by_id[prompt["prompt_id"]]
        assert (row["response_text"], row["finish_reason"], row["response_length"]) == \
            (answer.text, answer.finish_reason, len(answer.token_ids))
    assert sum(r["finish_reason"] == FINISH_STOP for r in by_id.values()) >= 2


@pytest.mark.deepspeed  # real DeepSpeed engines on CPU
def test_the_update_trains_on_scorings_log_probs_and_the_export_keeps_the_template(chat_run, chat_models):
    """update: its first step's log-probs equal the old log-probs at every response token, EOS
    included, on rows packed with the pad id (actor/old_log_prob_diff_max). Then the committed
    checkpoint validates from the same template prompts and exports with the source's chat template
    and an EOS generation config."""
    from transformers import AutoTokenizer, GenerationConfig

    from rlhf_core.control.export import export_actor
    from rlhf_core.io.atomic import atomic_write_json
    from rlhf_core.stages.update import run_update

    name, cfg, run, tokenizer, eos = chat_run
    result = run_update(cfg, run, 1)
    assert result.metrics["actor/old_log_prob_diff_max"] < 1e-4
    atomic_write_json(run.last_good_path, {"iteration": 1, "checkpoint": "iter_1/checkpoint", "committed": [1]})
    run_validate(cfg, run, 1)
    assert pq.read_table(run.validation(1)).num_rows == len(VAL)
    out = export_actor(cfg, run)
    exported = AutoTokenizer.from_pretrained(out)
    assert exported.chat_template == tokenizer.chat_template
    assert (exported.eos_token_id, exported.pad_token_id) == (tokenizer.eos_token_id, tokenizer.pad_token_id)
    for messages, _ in TRAIN + VAL:
        assert exported.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
            tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert template_ids(exported, messages) == template_ids(tokenizer, messages)
    ends = GenerationConfig.from_pretrained(out).eos_token_id
    assert eos in (ends if isinstance(ends, list) else [ends])
