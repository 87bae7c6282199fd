"""Warm start (rlhf_core.sft.warm_start) and the sampled-accuracy helper (rlhf_core.sft.evaluation).

Real tiny model, real preprocess split, a few optimizer steps: determinism is checked bit for bit on
one thread, the cache by the warm start not training a second time.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch

from rlhf_core.sft import warm_start
from rlhf_core.config.loader import load_config
from rlhf_core.sft.evaluation import accuracy_by_group, sampled_accuracy, score_responses
from rlhf_core.rewards.gsm8k import compute_score


@pytest.fixture
def one_thread():
    """Bit-identical float sums need one thread (thread count changes reduction order)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def arith_file(tmp_path) -> Path:
    """48 one-step addition problems in the GSM8K format of data/arith."""
    rng = random.Random(3)
    rows = []
    for i in range(48):
        a, k = rng.randint(2, 20), rng.randint(1, 20)
        rows.append({"question": f"Ava has {a} pens, then gets {k} more pens. How many pens does Ava have now?",
                     "answer": f"{a} + {k} = {a + k}\n#### {a + k}", "level": 1, "id": f"t-{i}"})
    path = tmp_path / "arith.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def cfg(repo_root, tiny_model_dir, arith_file):
    ws = "actor_rollout_ref.model.warm_start."
    return load_config(repo_root / "configs" / "demo.yaml", [
        f"data.train_files=[{arith_file}]", f"actor_rollout_ref.model.path={tiny_model_dir}",
        "data.max_response_length=16", f"{ws}enable=true", f"{ws}steps=3", f"{ws}batch_size=4",
        f"{ws}dev_size=4", f"{ws}eval_every=0", f"{ws}warmup_steps=2",
    ])


def _tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


# ---------------------------------------------------------------------------------------------
# masking and loss
# ---------------------------------------------------------------------------------------------


def test_example_puts_loss_on_answer_and_eos_only():
    ex = warm_start.make_example([5, 6, 7], [11, 12], eos_id=2)
    assert ex.input_ids == [5, 6, 7, 11, 12, 2]
    assert ex.labels == [-100, -100, -100, 11, 12, 2]


def test_collate_pads_right_without_loss_on_padding():
    batch = warm_start.collate([warm_start.make_example([5], [9], 2), warm_start.make_example([5, 6, 7], [9, 9], 2)], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 9, 2, 0, 0, 0], [5, 6, 7, 9, 9, 2]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]]
    assert batch["labels"].tolist() == [[-100, 9, 2, -100, -100, -100], [-100, -100, -100, 9, 9, 2]]


def test_loss_is_cross_entropy_over_answer_tokens_only(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).eval()
    examples = [warm_start.make_example([3, 4, 5, 6], [40, 41], 2), warm_start.make_example([7, 8], [50, 51, 52], 2)]
    batch = warm_start.collate(examples, pad_id=0)
    with torch.no_grad():
        loss = warm_start.answer_token_loss(model, batch)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    terms = []
    for row, ex in enumerate(examples):
        for t, label in enumerate(ex.labels):
            if label != -100:  # the token at t is predicted from position t - 1
                terms.append(-torch.log_softmax(logits[row, t - 1], -1)[label])
    assert len(terms) == 3 + 4  # answers + EOS; no prompt or padding position counted
    torch.testing.assert_close(loss, torch.stack(terms).mean())


def test_prose_endings_fail_strict_but_state_the_answer():
    rng = random.Random(0)
    answer = "12 + 7 = 19\n#### 19"
    endings = {warm_start.restyle_answer(answer, rng) for _ in range(30)}
    assert len(endings) == len(warm_start.PROSE_ENDINGS)
    for text in endings:
        assert text.startswith("12 + 7 = 19\n") and "####" not in text
        assert compute_score(text, "19", method="strict") == 0.0
        assert re.findall(r"\d+", text)[-1] == "19"  # the answer is stated, only not in GSM8K's format
    assert warm_start.restyle_answer("no marker here", rng) == "no marker here"


def test_prose_endings_can_be_one_chosen_line():
    rng = random.Random(0)
    texts = {warm_start.restyle_answer("12 + 7 = 19\n#### 19", rng, ["So Kai has {n} {n}s."]) for _ in range(5)}
    assert texts == {"12 + 7 = 19\nSo Kai has 19 19s."}


def test_sft_data_comes_from_the_train_split_and_holds_out_dev(cfg, tiny_model_dir):
    from rlhf_core.data.preprocess import preprocess_files

    tok = _tokenizer(tiny_model_dir)
    rows = warm_start.load_train_rows(cfg.data, tok)
    val = preprocess_files(cfg.data.train_files, [], cfg.data, tok, progress=False).val.to_pylist()
    data = warm_start.build_sft_data(rows, tok, dev_size=4, prose_fraction=0.5, seed=0)
    assert len(data.examples) + len(data.dev_prompts) == len(rows) and len(data.dev_prompts) == 4
    trained = {tuple(e.input_ids[:e.labels.count(-100)]) for e in data.examples}
    assert not trained & {tuple(r["prompt_token_ids"]) for r in val}
    assert not trained & {tuple(p) for p in data.dev_prompts}
    # prompts are the preprocess stage's chat-templated token ids, targets end with EOS
    assert all(e.labels[-1] == tok.eos_token_id for e in data.examples)
    assert trained <= {tuple(r["prompt_token_ids"]) for r in rows}
    assert 0 < data.prose_answers < len(data.examples)
    again = warm_start.build_sft_data(rows, tok, dev_size=4, prose_fraction=0.5, seed=0)
    assert again.examples == data.examples


# ---------------------------------------------------------------------------------------------
# the cached warm start
# ---------------------------------------------------------------------------------------------


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_warm_start_is_deterministic_and_changes_the_weights(cfg, tiny_model_dir, tmp_path, one_thread):
    first = warm_start.warm_start(cfg.actor_rollout_ref.model, cfg.data, out_root=tmp_path / "a", progress=False)
    torch.set_num_threads(2)  # the warm start pins a small model to one thread itself, then restores
    second = warm_start.warm_start(cfg.actor_rollout_ref.model, cfg.data, out_root=tmp_path / "b", progress=False)
    assert torch.get_num_threads() == 2
    a, b, base = _weights(first), _weights(second), _weights(tiny_model_dir)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], base[k]) for k in a)
    record = warm_start.read_warm_start_record(first)
    assert record["final"]["step"] == 3 and 0.0 <= record["final"]["dev_acc_strict"] <= 1.0
    assert record["torch_threads"] == 1 and record["train_examples"] > 0
    assert (first / "tokenizer_config.json").is_file() and (first / "tiny_spec.json").is_file()


def test_warm_start_reuses_the_cache(cfg, tmp_path, monkeypatch, one_thread):
    root = tmp_path / "models"
    path = warm_start.warm_start(cfg.actor_rollout_ref.model, cfg.data, out_root=root, progress=False)
    stamp = (path / "warm_start.json").stat().st_mtime_ns

    def must_not_train(*args, **kwargs):
        raise AssertionError("the cached warm start was retrained")

    monkeypatch.setattr(warm_start, "train_sft", must_not_train)
    assert warm_start.warm_start(cfg.actor_rollout_ref.model, cfg.data, out_root=root, progress=False) == path
    assert (path / "warm_start.json").stat().st_mtime_ns == stamp
    assert [p.name for p in root.iterdir()] == [path.name]  # nothing half-written left behind


def test_cache_key_follows_settings_and_data(cfg, arith_file, tmp_path):
    from rlhf_core.config.loader import apply_overrides

    def where(c):
        return warm_start.warm_start_path(c.actor_rollout_ref.model, c.data, tmp_path)

    path = where(cfg)
    assert path.name.startswith(Path(cfg.actor_rollout_ref.model.path).name + "-sft-")
    assert where(apply_overrides(cfg, ["actor_rollout_ref.model.warm_start.steps=4"])) != path
    assert where(apply_overrides(cfg, ["data.instruction=Answer."])) != path
    endings = ["actor_rollout_ref.model.warm_start.prose_endings=[\"The answer is {n}.\"]"]
    assert where(apply_overrides(cfg, endings)) != path
    # a setting added later keeps the keys made before it while it is left at its default
    assert "prose_endings" not in warm_start.warm_start_key(cfg.actor_rollout_ref.model, cfg.data)["sft"]
    arith_file.write_text(arith_file.read_text() + json.dumps(
        {"question": "Bo has 2 pens. How many?", "answer": "#### 2", "id": "extra"}) + "\n")
    assert where(cfg) != path


def test_invalid_warm_start_settings_are_rejected(repo_root):
    from rlhf_core.config.loader import ConfigError

    with pytest.raises(ConfigError, match="prose_answer_fraction"):
        load_config(repo_root / "configs" / "demo.yaml", ["actor_rollout_ref.model.warm_start.prose_answer_fraction=2"])
    with pytest.raises(ConfigError, match="prose_endings"):
        load_config(repo_root / "configs" / "demo.yaml", ["actor_rollout_ref.model.warm_start.prose_endings=[\"no number\"]"])


# ---------------------------------------------------------------------------------------------
# accuracy helper
# ---------------------------------------------------------------------------------------------


def test_score_responses_hand_made_cases():
    responses = ["3 + 4 = 7\n#### 7", "3 + 4 = 8\n#### 8", "The answer is 7.", "#### 1,234", ""]
    truths = ["7", "7", "7", "1234", "7"]
    assert score_responses(responses, truths) == [1.0, 0.0, 0.0, 1.0, 0.0]
    # verl's flexible rule compares strings as found: "7." (the prose's full stop) is not "7", and
    # "1,234" keeps its comma (only the strict rule removes commas)
    assert score_responses(responses, truths, method="flexible") == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert accuracy_by_group([1.0, 0.0, 1.0, 1.0], [2, 1, 1, 2]) == {1: 0.5, 2: 1.0}
    with pytest.raises(ValueError, match="2 responses but 1"):
        score_responses(["a", "b"], ["1"])


def test_sampled_accuracy_is_seeded_and_stops_at_the_budget(tiny_model_dir, one_thread):
    from transformers import AutoModelForCausalLM

    tok = _tokenizer(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                       tokenize=False) for q in ("Ava has 3 pens.", "Ben has 12 coins, then gets 4 more.")]
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    a = sampled_accuracy(model, tok, ids, ["3", "16"], max_new_tokens=6, seed=5)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's random stream is untouched
    assert a.responses == sampled_accuracy(model, tok, ids, ["3", "16"], max_new_tokens=6, seed=5).responses
    assert len(a.responses) == 2 and a.mean_response_tokens <= 6 and set(a.scores) <= {0.0, 1.0}
    assert a.accuracy == sum(a.scores) / 2


def test_data_without_a_prompt_is_refused_as_preprocess_refuses_it(cfg, tmp_path):
    """With the warm start on it reads the data first: an empty file gets preprocess's line (the file,
    the problem, the fix), not the warm start's 'no training examples left ... dev_size'."""
    from rlhf_core.config import apply_overrides
    from rlhf_core.data.outcome import NoPromptsError

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    bad = apply_overrides(cfg, [f"data.train_files=[{empty}]"])
    with pytest.raises(NoPromptsError, match=rf"{empty}: no rows to read \(empty\); give data.train_files rows"):
        warm_start.warm_start(bad.actor_rollout_ref.model, bad.data, out_root=tmp_path / "out", progress=False)
