"""Warm start: supervised fine-tuning of the tiny model into a real but weak policy.

PPO only improves a policy that already succeeds sometimes: a randomly initialised model never
writes a correct '#### n', so every reward is 0 and there is nothing to climb. The seed project
starts from an instruct model (Qwen2.5-0.5B-Instruct, ~36 % on GSM8K); the embedded demo cannot
download one, so it makes its own: the tiny model is fine-tuned on the worked answers of the TRAIN
split, and stopped early, while its sampled (temperature 1) accuracy is still low enough for PPO to
have room to climb.

    prompt (chat template, exactly as the preprocess stage builds it)   answer + <|im_end|>
    ─────────────────────────────────────────────────────────────────  ─────────────────────
    labels -100 (no loss)                                              labels = the tokens

Deterministic: the same (model spec, data files, settings, seed) give the same weights, bit for bit
(small models train on one thread; the thread count changes float summation order). Cached: the result lives
in ``<state dir>/models/tiny-sft-<hash>`` keyed on all of those, written atomically, and reused.

Stopping: every ``eval_every`` steps the sampled accuracy is measured on ``dev_size`` TRAIN-split
prompts that the fine-tuning never sees; training stops at the first measurement at or above
``target_accuracy`` (or after ``max_steps``). The pipeline's validation prompts are never touched,
so PPO's validation curve starts from an unselected, honest estimate.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

from rlhf_core.config.schema import DataConfig, ModelConfig
from rlhf_core.data.preprocess import preprocess_files
from rlhf_core.data.outcome import NoPromptsError, no_prompts_problem
from rlhf_core.data.schemas import decode_extra_info
from rlhf_core.errors import DataError
from rlhf_core.io.atomic import atomic_dir
from rlhf_core.models.chat import end_of_turn_id, train_every_token_embedding
from rlhf_core.paths import resolve_model_path, resolve_path
from rlhf_core.rollout.base import SMALL_MODEL_PARAMS
from rlhf_core.run.models import is_complete, warm_start_key, warm_start_path
from rlhf_core.sft.evaluation import sample_responses, score_responses



@dataclass(frozen=True)
class SFTExample:
    """One training sequence: prompt then answer + EOS. ``labels`` is -100 over the prompt."""

    input_ids: list[int]
    labels: list[int]


def make_example(prompt_ids: Sequence[int], answer_ids: Sequence[int], eos_id: int) -> SFTExample:
    """Prompt tokens carry no loss; the answer tokens and the closing EOS do (the policy must learn
    to stop, or every PPO response runs to the token budget)."""
    target = [int(t) for t in answer_ids] + [int(eos_id)]
    return SFTExample(input_ids=[int(t) for t in prompt_ids] + target, labels=[-100] * len(prompt_ids) + target)


def collate(examples: Sequence[SFTExample], pad_id: int) -> dict:
    """Right-padded batch: input_ids, attention_mask, labels, each (B, L); padding has label -100."""
    import torch

    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        labels[i, :n] = torch.tensor(e.labels)
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


FULL_LOGITS_MAX_BYTES = 64 << 20
"""Largest (B, L, V) fp32 logits tensor the loss builds whole. Past it (a real vocabulary: 16 × 100
tokens × 49,152 is 315 MB, and its gradient as much again) the LM head runs on the answer positions
only, ~1/5 of the tokens: the same loss, 15-20 % less time per step. The tiny model's batches stay
under it, so its warm start keeps the arithmetic the shipped demo model was made with, bit for bit."""


def answer_token_loss(model, batch: dict):
    """Mean cross-entropy over the label tokens only (next-token shift: logits[t] predicts ids[t+1]).

    Returns a scalar tensor; prompt and padding positions (label -100) contribute nothing.
    """
    import torch.nn.functional as F

    ids, labels = batch["input_ids"], batch["labels"]
    shifted_labels = labels[:, 1:]  # (B, L-1)
    if ids.numel() * model.config.vocab_size * 4 > FULL_LOGITS_MAX_BYTES:
        hidden = model.get_decoder()(input_ids=ids, attention_mask=batch["attention_mask"]).last_hidden_state
        keep = shifted_labels != -100  # (B, L-1): positions whose next token is an answer token
        logits = model.get_output_embeddings()(hidden[:, :-1][keep])  # (N, V), N answer tokens
        return F.cross_entropy(logits.float(), shifted_labels[keep])
    logits = model(input_ids=ids, attention_mask=batch["attention_mask"]).logits  # (B, L, V)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), shifted_labels.reshape(-1),
                           ignore_index=-100)


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------

PROSE_ENDINGS = ("The answer is {n}.", "Answer: {n}", "So the total is {n}.")
"""Final lines a model might write instead of '#### n'; the strict GSM8K reward scores them 0."""


def restyle_answer(answer: str, rng, endings: Sequence[str] = PROSE_ENDINGS) -> str:
    """Replace the closing '#### n' line with one of ``endings`` (chosen by ``rng``); an answer
    without a '####' line is returned unchanged."""
    head, sep, tail = answer.rpartition("####")
    if not sep or "\n" in tail.strip():
        return answer
    return head + rng.choice(endings).replace("{n}", tail.strip())


@dataclass
class SFTData:
    """Tokenized fine-tuning examples and the dev prompts that measure them."""

    examples: list[SFTExample]
    dev_prompts: list[list[int]]
    dev_truths: list[str]
    prose_answers: int = 0


def build_sft_data(train_rows: Sequence[dict], tokenizer, dev_size: int, prose_fraction: float,
                   seed: int, endings: Optional[Sequence[str]] = None) -> SFTData:
    """Split PROMPTS-schema train rows into fine-tuning examples and ``dev_size`` dev prompts.

    The prompt tokens are the rows' ``prompt_token_ids`` (the preprocess stage's chat template, so
    the policy is tuned on exactly the prompts PPO will sample from); the target is the row's
    worked answer, restyled to a prose ending (one of ``endings``, default ``PROSE_ENDINGS``) for a
    ``prose_fraction`` share, then the token the chat
    template ends an assistant turn with (``models.chat.end_of_turn_id``: ``<|im_end|>`` in ChatML),
    so each example is the assistant turn exactly as the template writes it, cut at its end.
    """
    import random

    rng = random.Random(seed)
    end_of_turn = end_of_turn_id(tokenizer)  # the chat template's, as a generated answer must end
    n = len(train_rows)
    dev_size = min(dev_size, n // 2)
    dev_index = set(rng.sample(range(n), dev_size))
    examples, prose = [], 0
    for i, row in enumerate(train_rows):
        if i in dev_index:
            continue
        answer = decode_extra_info(row["extra_info"])["answer"]
        target = restyle_answer(answer, rng, endings or PROSE_ENDINGS) if rng.random() < prose_fraction else answer
        prose += target != answer
        answer_ids = tokenizer(target, add_special_tokens=False)["input_ids"]
        examples.append(make_example(row["prompt_token_ids"], answer_ids, end_of_turn))
    dev = [train_rows[i] for i in sorted(dev_index)]
    return SFTData(examples=examples, dev_prompts=[list(r["prompt_token_ids"]) for r in dev],
                   dev_truths=[r["reward_model"]["ground_truth"] for r in dev], prose_answers=prose)


def load_train_rows(data: DataConfig, tokenizer) -> list[dict]:
    """The TRAIN split exactly as the preprocess stage makes it (same adapter, template, dedup,
    length filter and hash split), so validation prompts never reach the fine-tuning."""
    result = preprocess_files([resolve_path(p) for p in data.train_files],
                              [resolve_path(p) for p in data.val_files], data, tokenizer, progress=False)
    if result.train.num_rows == 0:  # what is wrong with the data, as the preprocess stage says it
        raise NoPromptsError(no_prompts_problem(result, data), rows=result.rows)
    return result.train.to_pylist()


# ---------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------


def lr_factor(step: int, total: int, warmup: int) -> float:
    """Linear warm-up to 1, then cosine decay to 0.1 at ``total``."""
    import math

    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def batch_order(num_examples: int, steps: int, batch_size: int, seed: int) -> list[list[int]]:
    """Example indices per step: seeded permutations, one per epoch, cut into batches."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    flat: list[int] = []
    while len(flat) < steps * batch_size:
        flat += torch.randperm(num_examples, generator=gen).tolist()
    return [flat[s * batch_size:(s + 1) * batch_size] for s in range(steps)]


def dev_accuracy(model, tokenizer, data: SFTData, max_new_tokens: int, seed: int) -> dict[str, float]:
    """Strict and flexible sampled accuracy (temperature 1) on the dev prompts, same samples."""
    texts, lengths, _ = sample_responses(model, tokenizer, data.dev_prompts, max_new_tokens, seed=seed)
    n = max(1, len(texts))
    strict = score_responses(texts, data.dev_truths, "strict")
    flexible = score_responses(texts, data.dev_truths, "flexible")
    return {"dev_acc_strict": sum(strict) / n, "dev_acc_flexible": sum(flexible) / n,
            "dev_response_tokens": sum(lengths) / n}


def train_sft(model, tokenizer, data: SFTData, settings, max_new_tokens: int,
              progress: bool = True) -> list[dict]:
    """Fine-tune ``model`` in place; returns the measurement history (one dict per evaluation)."""
    import torch
    from tqdm.auto import tqdm

    torch.manual_seed(settings.seed)
    train_every_token_embedding(model)  # pad == EOS: the end-of-turn token's embedding trains too
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, betas=(0.9, 0.98), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, settings.steps, settings.warmup_steps))
    order = batch_order(len(data.examples), settings.steps, settings.batch_size, settings.seed)
    history, window = [], []
    model.train()
    bar = tqdm(order, desc="warm start (SFT)", unit="step", disable=not progress, mininterval=2.0)
    for step, indices in enumerate(bar, start=1):
        loss = answer_token_loss(model, collate([data.examples[i] for i in indices], tokenizer.pad_token_id))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        window = (window + [loss.item()])[-25:]
        last = step == settings.steps
        if last or (settings.eval_every and step % settings.eval_every == 0):
            record = {"step": step, "loss": sum(window) / len(window),
                      **dev_accuracy(model, tokenizer, data, max_new_tokens, seed=settings.seed)}
            history.append(record)
        bar.set_postfix_str(f"loss {sum(window) / len(window):.3f}" + (
            f" acc {history[-1]['dev_acc_strict']:.2f}" if history else ""), refresh=False)
    model.eval()
    return history


# ---------------------------------------------------------------------------------------------
# the cached warm start
# ---------------------------------------------------------------------------------------------

def warm_start(model_cfg: ModelConfig, data_cfg: DataConfig, out_root: Optional[str | Path] = None,
               progress: bool = True) -> Path:
    """Fine-tune ``model_cfg.path`` (actor_rollout_ref.model) per its ``warm_start`` settings on the
    TRAIN split of ``data_cfg`` (the config's data section) and return the directory of the result
    (HF model + tokenizer + ``warm_start.json``), reusing it when the same inputs were already
    trained. Trains on CPU; small models on one thread (bit-identical weights from run to run, see
    ``_single_thread_if_small``)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = warm_start_path(model_cfg, data_cfg, out_root)
    if is_complete(out):
        return out
    settings = model_cfg.warm_start
    base = resolve_model_path(model_cfg.path)
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    data = build_sft_data(load_train_rows(data_cfg, tokenizer), tokenizer, settings.dev_size,
                          settings.prose_answer_fraction, settings.seed, settings.prose_endings)
    _check_data(data, data_cfg)
    with _single_thread_if_small(model):
        threads = torch.get_num_threads()
        history = train_sft(model, tokenizer, data, settings, data_cfg.max_response_length, progress)
    record = {"key": warm_start_key(model_cfg, data_cfg), "history": history, "final": history[-1] if history else {},
              "train_examples": len(data.examples), "prose_answers": data.prose_answers,
              "dev_prompts": len(data.dev_prompts), "torch_threads": threads,
              "seconds": round(time.perf_counter() - started, 1)}
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if (base / "tiny_spec.json").is_file():
            shutil.copy2(base / "tiny_spec.json", tmp / "tiny_spec.json")
        (tmp / "warm_start.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return out


@contextlib.contextmanager
def _single_thread_if_small(model) -> Iterator[None]:
    """One torch thread for models under SMALL_MODEL_PARAMS: their matmuls are too small to gain from
    a second thread on two shared cores, and one thread makes the weights bit-reproducible (the
    cache promises that the same key means the same weights). Larger models keep the caller's setting."""
    import torch

    before = torch.get_num_threads()
    if sum(p.numel() for p in model.parameters()) < SMALL_MODEL_PARAMS:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _check_data(data: SFTData, data_cfg: DataConfig) -> None:
    if not data.examples:
        raise DataError(f"warm start: no training examples left from data.train_files={data_cfg.train_files} "
                        f"(after the validation split and {len(data.dev_prompts)} dev prompts); "
                        f"give more rows or lower actor_rollout_ref.model.warm_start.dev_size")


def read_warm_start_record(path: str | Path) -> dict:
    """The ``warm_start.json`` of a warm-started model directory (history, final dev accuracy, key)."""
    return json.loads((Path(path) / "warm_start.json").read_text())
