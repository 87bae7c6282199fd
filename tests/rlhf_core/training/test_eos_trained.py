"""The end-of-turn token is trained on, as verl trains it (issue 48 item 7).

verl's response mask covers every generated token up to and including the EOS, so the PPO update's
policy and value losses count the ``<|im_end|>`` that closes a response like any other token. Here
the update's own pieces (``training.batch``: the micro-batch and its mask; ``training.forward``: the
log-probs and values it trains; ``training.ppo``: the losses) run on chat sequences whose prompts
hold earlier turns' ``<|im_end|>`` and whose responses end with it, packed several to a row, once
with pad != EOS and once with pad == EOS (SmolLM2's case):

    the mask is the response lengths' (EOS in, padding out), never the ids compared with the pad id
    the update's log-probs and values at every response token, EOS included, are scoring's
    an advantage on the EOS alone still moves the weights (the EOS is inside the loss)
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from rlhf_core.data.schemas import ADVANTAGES
from rlhf_core.io.atomic import atomic_write_parquet
from rlhf_core.models.packed import packing_attention_mode
from rlhf_core.training.batch import MicroBatchPlan, build_micro_batch, global_counts, read_advantages, split_mini_batch
from rlhf_core.training.engines import load_actor_model, load_critic_model
from rlhf_core.training.forward import actor_forward, critic_forward
from rlhf_core.training.ppo import ActorLoss, CriticLoss
from rlhf_core.training.synthetic import synthetic_advantages

CONVERSATIONS = [
    [{"role": "user", "content": "What is 3 + 4?"}],
    [{"role": "system", "content": "You are a careful math tutor."},
     {"role": "user", "content": "Tom has 5 apples and eats 1. How many are left?"}],
    [{"role": "user", "content": "What is 1 + 2?"}, {"role": "assistant", "content": "#### 3"},
     {"role": "user", "content": "And 2 + 2?"}, {"role": "assistant", "content": "He eats one apple, so #### 4"},
     {"role": "user", "content": "And 12 - 7?"}, {"role": "assistant", "content": "#### 5"},
     {"role": "user", "content": "And 3 + 3?"}],
    [{"role": "user", "content": "What is 2 + 2?"}],
]
RESPONSES = ["#### 7", "He eats one apple, so #### 4", "", "He eats"]
"""The last one was cut at the length limit (no EOS); the others stopped."""
LAYOUTS = {"packed": True, "padded": False}


def chat_pairs(model_dir) -> tuple[list[tuple[list[int], list[int]]], int]:
    """(prompt ids, response ids) per conversation in the model's template, and the EOS id."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    pairs = []
    for k, (messages, text) in enumerate(zip(CONVERSATIONS, RESPONSES)):
        prompt = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)["input_ids"]
        pairs.append((prompt, tok(text, add_special_tokens=False)["input_ids"] + ([eos] if k < 3 else [])))
    return pairs, eos


@pytest.fixture(scope="module")
def chat_update_data(chat_models, tmp_path_factory):
    """variant → (PPOData read back from an advantages table of its chat pairs, EOS id); old and ref
    log-probs scored by the variant's model, advantages and returns seeded noise."""
    out = {}
    for name, model_dir in chat_models.items():
        pairs, eos = chat_pairs(model_dir)
        path = tmp_path_factory.mktemp("adv") / f"{name}.parquet"
        atomic_write_parquet(path, synthetic_advantages(model_dir, pairs=pairs, seed=1), ADVANTAGES)
        out[name] = (read_advantages(path), eos)
    return out


def one_micro_batch(data, model, packed: bool):
    """The mini-batch of every row as ``train_step`` cuts it (one micro-batch by token budget, rows
    packed to the longest sequence), built with the model's pad id and packing mode."""
    plan = MicroBatchPlan(use_dynamic_bsz=True, token_budget=4096, micro_batch_size=1, pack_rows=packed)
    rows = list(range(len(data)))
    (layout,) = split_mini_batch(data.lengths, rows, plan)
    assert not packed or any(len(row) > 1 for row in layout)  # packed: sequences share a row, pad-filled
    mb = build_micro_batch(data, layout, int(model.config.pad_token_id), mode=packing_attention_mode(model))
    return mb, global_counts(data, rows)


def response_length(data, mb, b: int) -> int:
    return len(data.response_ids[mb.order[b]])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_update_mask_is_the_response_lengths_eos_included(chat_model, chat_update_data, layout):
    name, model_dir = chat_model
    data, eos = chat_update_data[name]
    actor = load_actor_model(model_dir, torch.float32)
    mb, _ = one_micro_batch(data, actor, LAYOUTS[layout])
    assert (int(actor.config.pad_token_id) == eos) == (name != "tiny")
    for b in range(len(mb.order)):
        n, response = response_length(data, mb, b), data.response_ids[mb.order[b]]
        assert mb.response_mask[b].tolist() == [True] * n + [False] * (mb.response_mask.shape[1] - n)
        assert eos in data.prompt_ids[mb.order[b]]  # turn ends in the prompt: real tokens, never masked
        if response[-1:] == [eos]:
            assert mb.tensors["advantages"][b, n - 1] == float(data.per_token["advantages"][mb.order[b]][-1])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_updates_log_probs_and_values_are_scorings_at_every_token(chat_model, chat_update_data, chat_critics,
                                                                    layout):
    """The update's forward over packed rows filled with the pad id gives, at each response token and
    the EOS, the old log-probs scoring recorded (the PPO ratio starts at 1 there) and the values of
    the same critic over each sequence alone."""
    name, model_dir = chat_model
    data, _ = chat_update_data[name]
    actor = load_actor_model(model_dir, torch.float32)
    critic = load_critic_model(chat_critics[name], torch.float32)
    mb, _ = one_micro_batch(data, actor, LAYOUTS[layout])
    with torch.no_grad():
        log_prob, _ = actor_forward(actor, mb)
        values = critic_forward(critic, mb)
    for b, i in enumerate(mb.order):
        n, sequence, p = response_length(data, mb, b), data.sequence(i), len(data.prompt_ids[i])
        torch.testing.assert_close(log_prob[b, :n], torch.from_numpy(data.per_token["old_log_probs"][i]),
                                   atol=1e-5, rtol=0)
        with torch.no_grad():
            alone = critic(input_ids=torch.tensor([sequence])).logits[0, p - 1:-1, 0]
        torch.testing.assert_close(values[b, :n], alone, atol=1e-5, rtol=0)
        assert not log_prob[b, n:].any() and not values[b, n:].any()


def test_an_advantage_on_the_eos_alone_moves_the_policy_and_the_critic(chat_model, chat_update_data, chat_critics):
    """Advantages and returns are zero everywhere but at each stopped response's EOS: the losses'
    gradients are non-zero exactly at the EOS positions, and a backward through the model moves it.
    (With the EOS outside the mask both would be exactly zero.)"""
    name, model_dir = chat_model
    data, eos = chat_update_data[name]
    at_eos = [data.response_ids[i][-1:] == [eos] for i in range(len(data))]
    only_eos = [np.where(np.arange(len(a)) == len(a) - 1, float(stopped), 0.0).astype(np.float32)
                for a, stopped in zip(data.per_token["advantages"], at_eos)]
    data = replace(data, per_token={**data.per_token, "advantages": only_eos})
    actor = load_actor_model(model_dir, torch.float32)
    mb, (n_tok, n_seq) = one_micro_batch(data, actor, packed=True)
    old = mb.tensors["old_log_probs"]
    log_prob = (old + 0.05 * mb.response_mask).requires_grad_(True)  # a moved policy, inside the clip range
    loss, _ = ActorLoss().policy_loss(log_prob=log_prob, tensors=mb.tensors, mask=mb.response_mask,
                                      n_tok=n_tok, n_seq=n_seq)
    (grad,) = torch.autograd.grad(loss, log_prob)
    eos_positions = torch.zeros_like(mb.response_mask)
    for b, i in enumerate(mb.order):
        eos_positions[b, len(data.response_ids[i]) - 1] = at_eos[i]
    assert eos_positions.sum() == 3
    assert (grad[eos_positions] < 0).all() and not grad[~eos_positions].any()  # ascent on the EOS's log-prob only
    vpreds = (mb.tensors["values"] + 0.1 * mb.response_mask).requires_grad_(True)
    returns = torch.where(eos_positions, 1.0, mb.tensors["values"])
    vf_loss, _ = CriticLoss(cliprange_value=10.0).value_loss(vpreds=vpreds, tensors={**mb.tensors, "returns": returns},
                                                             mask=mb.response_mask, n_tok=n_tok, n_seq=n_seq)
    (vgrad,) = torch.autograd.grad(vf_loss, vpreds)
    assert vgrad[eos_positions].abs().min() > 0 and not vgrad[~mb.response_mask].any()
    loss = _micro_batch_loss(ActorLoss(), actor, mb, n_tok, n_seq)  # the whole micro-batch loss, through the model
    loss.backward()
    assert sum(float(p.grad.abs().sum()) for p in actor.parameters() if p.grad is not None) > 0


def _micro_batch_loss(loss_fn, engine, mb, n_tok: int, n_seq: int):
    """The micro-batch's loss as ``ppo.train_step`` makes it: forward, the registered objective, the total."""
    fwd = loss_fn.forward(engine, mb)
    objective, inputs = loss_fn.objective(fwd, n_tok, n_seq)
    return loss_fn.total(*objective(**inputs), fwd, n_tok, n_seq)[0]


def test_the_pad_id_changes_no_gradient(chat_models, chat_update_data):
    """Same weights, same sequences, pad <|endoftext|> against pad == EOS: the update's gradient
    should be the same (the masks come from lengths)."""
    grads = {}
    for name in ("tiny", "tiny_pad_eos"):
        data, _ = chat_update_data[name]
        actor = load_actor_model(chat_models[name], torch.float32)
        mb, (n_tok, n_seq) = one_micro_batch(data, actor, packed=True)
        loss = _micro_batch_loss(ActorLoss(), actor, mb, n_tok, n_seq)
        loss.backward()
        grads[name] = {k: p.grad.clone() for k, p in actor.named_parameters() if p.grad is not None}
    assert grads["tiny"].keys() == grads["tiny_pad_eos"].keys()
    for key, g in grads["tiny"].items():
        torch.testing.assert_close(g, grads["tiny_pad_eos"][key], atol=1e-6, rtol=0, msg=key)
