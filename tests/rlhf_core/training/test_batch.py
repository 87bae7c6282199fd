"""Mini-batches, micro-batch plans, packed tensors and the grad-enabled forward (no DeepSpeed)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlhf_core.errors import DataError
from rlhf_core.training.batch import (
    MicroBatchPlan,
    build_micro_batch,
    global_counts,
    mini_batches,
    read_advantages,
    split_mini_batch,
)
from rlhf_core.run.session import RunSession

DISK = RunSession()  # nothing held in memory: every model is read from its directory


def test_read_advantages_names_the_row_and_column_that_disagree_with_response_length(advantages_table, tmp_path):
    bad = advantages_table.to_pylist()
    bad[5]["returns"] = bad[5]["returns"][:-1]
    path = tmp_path / "adv.parquet"
    pq.write_table(pa.Table.from_pylist(bad, schema=advantages_table.schema), path)
    with pytest.raises(DataError, match=r"row 5: column returns has"):
        read_advantages(path)
    with pytest.raises(DataError, match="run the gae stage"):
        read_advantages(tmp_path / "missing.parquet")


def test_mini_batches_cover_every_row_once_and_reshuffle_per_epoch():
    a, b = (mini_batches(range(50), 16, shuffle=True, seed="1:3", epoch=e) for e in (0, 1))
    assert [len(m) for m in a] == [16, 16, 16, 2]
    assert sorted(sum(a, [])) == list(range(50)) and a != b
    assert a == mini_batches(range(50), 16, shuffle=True, seed="1:3", epoch=0)
    assert mini_batches(range(5), 2, shuffle=False, seed=0, epoch=0) == [[0, 1], [2, 3], [4]]


def test_without_shuffle_a_prompts_responses_share_one_mini_batch(ppo_data):
    """ppo_mini_batch_size counts prompts: 2 prompts × n=3 responses per step, even when the table
    interleaves the prompts' rows (an offline rollout may)."""
    import dataclasses

    from rlhf_core.config import load_config, resolve

    groups = [f"p{i % 4}" for i in range(12)]  # rows 0, 4, 8 are p0's responses, ...
    data = dataclasses.replace(ppo_data, groups=groups)
    cfg = load_config(None, ["actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=3",
                             "critic.ppo_mini_batch_size=1"])
    size = resolve.mini_batch_sequences(cfg, "actor")
    batches = mini_batches(data.grouped_order(), size, shuffle=False, seed=0, epoch=0)
    assert batches == [[0, 4, 8, 1, 5, 9], [2, 6, 10, 3, 7, 11]]
    assert all(len({groups[i] for i in b}) == 2 for b in batches)
    critic = mini_batches(data.grouped_order(), resolve.mini_batch_sequences(cfg, "critic"), shuffle=False,
                          seed=0, epoch=0)
    assert [len(b) for b in critic] == [3] * 4 and all(len({groups[i] for i in b}) == 1 for b in critic)
    assert dataclasses.replace(ppo_data, groups=None).grouped_order() == list(range(12))


def test_each_role_plans_its_micro_batches_from_its_own_keys():
    from rlhf_core.config import load_config
    from rlhf_core.training.rank_update import micro_batch_plan

    cfg = load_config(None, ["actor_rollout_ref.actor.use_dynamic_bsz=true",
                             "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2000", "critic.use_dynamic_bsz=false",
                             "critic.ppo_micro_batch_size_per_gpu=3", "critic.model.use_remove_padding=false"])
    actor, critic = micro_batch_plan(cfg, "actor"), micro_batch_plan(cfg, "critic")
    assert (actor.use_dynamic_bsz, actor.token_budget, actor.pack_rows) == (True, 2000, True)
    assert (critic.use_dynamic_bsz, critic.micro_batch_size, critic.pack_rows) == (False, 3, False)
    assert critic.budget_key == "critic.ppo_max_token_len_per_gpu"
    # verl's deprecated global micro-batch size is divided over the ranks
    old = load_config(None, ["actor_rollout_ref.actor.ppo_micro_batch_size=8"])
    assert micro_batch_plan(old, "actor", world_size=4).micro_batch_size == 2
    assert micro_batch_plan(old, "critic", world_size=4).micro_batch_size == 8  # resolve's default, not the actor's


@pytest.mark.parametrize("plan", [
    MicroBatchPlan(use_dynamic_bsz=True, token_budget=40, micro_batch_size=1),
    MicroBatchPlan(use_dynamic_bsz=False, token_budget=0, micro_batch_size=2),
    MicroBatchPlan(use_dynamic_bsz=False, token_budget=0, micro_batch_size=3, pack_rows=False),
])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_ranks_split_a_mini_batch_exactly_with_equal_micro_batch_counts(ppo_data, plan, world):
    rows = [1, 2, 4, 5, 7, 8, 10]
    per_rank = [split_mini_batch(ppo_data.lengths, rows, plan, world, r) for r in range(world)]
    assert len({len(p) for p in per_rank}) == 1  # collectives stay in step
    seen = [i for p in per_rank for mb in p for row in mb for i in row]
    assert sorted(seen) == sorted(rows)
    for p in per_rank:
        for mb in p:
            if plan.use_dynamic_bsz:
                assert sum(ppo_data.lengths[i] for row in mb for i in row) <= plan.token_budget
            else:
                assert sum(len(row) for row in mb) <= plan.micro_batch_size
            if not plan.pack_rows:
                assert all(len(row) == 1 for row in mb)


def test_micro_batch_tensors_line_up_with_the_table(ppo_data):
    layout = [[3, 0], [7]]
    mb = build_micro_batch(ppo_data, layout, pad_id=0)
    assert mb.order == [3, 0, 7] and mb.weight == 1.0
    for b, i in enumerate(mb.order):
        n = len(ppo_data.response_ids[i])
        assert mb.response_mask[b].sum() == n
        np.testing.assert_array_equal(mb.tensors["advantages"][b, :n].numpy(), ppo_data.per_token["advantages"][i])
        assert float(mb.tensors["advantages"][b, n:].abs().sum()) == 0.0
    assert mb.num_tokens == sum(ppo_data.lengths[i] for i in mb.order)
    filler = build_micro_batch(ppo_data, [], pad_id=0, filler_row=4)
    assert filler.weight == 0.0 and filler.order == [4]
    assert global_counts(ppo_data, [0, 3]) == (len(ppo_data.response_ids[0]) + len(ppo_data.response_ids[3]), 2)


def test_packed_grad_forward_matches_scoring_log_probs_entropy_and_values(ppo_data, tiny_model_dir, critic_init_dir):
    """The training forward (packed rows, chunked custom-autograd gather) gives the scoring stage's
    numbers, so the first PPO ratio is 1; the entropy matches a direct softmax."""
    from rlhf_core.scoring.logprobs import compute_token_logprobs, compute_token_values
    from rlhf_core.scoring.models import load_causal_lm, load_critic
    from rlhf_core.training.forward import actor_forward, critic_forward

    actor = load_causal_lm(tiny_model_dir, torch.device("cpu"), torch.float32, session=DISK).requires_grad_()  # trained here: loads come frozen
    critic = load_critic(critic_init_dir, torch.device("cpu"), torch.float32, session=DISK)
    rows = [[0, 1, 2], [3], [4, 5]]
    mb = build_micro_batch(ppo_data, rows, pad_id=0)
    seqs = [ppo_data.sequence(i) for i in mb.order]
    plen = [len(ppo_data.prompt_ids[i]) for i in mb.order]
    log_prob, entropy = actor_forward(actor, mb, temperature=0.7, entropy_grad=True)
    log_prob.sum().backward()  # differentiable end to end
    assert actor.model.embed_tokens.weight.grad is not None
    want = compute_token_logprobs(actor, seqs, plen, budget=10_000, temperature=0.7, progress=False)
    values = critic_forward(critic, mb)
    want_v = compute_token_values(critic, seqs, plen, budget=10_000, progress=False)
    for b, i in enumerate(mb.order):
        n = len(ppo_data.response_ids[i])
        torch.testing.assert_close(log_prob[b, :n].detach(), want[b], atol=1e-5, rtol=0)
        torch.testing.assert_close(values[b, :n].detach(), want_v[b], atol=1e-5, rtol=0)
        with torch.no_grad():
            logits = actor(input_ids=torch.tensor([seqs[b]])).logits[0, plen[b] - 1:plen[b] - 1 + n] / 0.7
            p = torch.softmax(logits, -1)
            torch.testing.assert_close(entropy[b, :n].detach(), -(p * p.log()).sum(-1), atol=1e-4, rtol=0)
        assert float(log_prob[b, n:].detach().abs().sum()) == 0.0


def test_a_sequence_longer_than_the_token_budget_is_refused_naming_its_row(ppo_data):
    from rlhf_core.training.batch import check_budget

    longest = max(ppo_data.lengths)
    row = ppo_data.lengths.index(longest)
    check_budget(ppo_data, MicroBatchPlan(True, longest, 1), "adv.parquet")
    with pytest.raises(DataError, match=rf"adv.parquet row {row}: .* at least {longest}"):
        check_budget(ppo_data, MicroBatchPlan(True, longest - 1, 1), "adv.parquet")
    with pytest.raises(DataError, match=r"raise critic.ppo_max_token_len_per_gpu"):
        check_budget(ppo_data, MicroBatchPlan(True, longest - 1, 1, budget_key="critic.ppo_max_token_len_per_gpu"),
                     "adv.parquet")
    check_budget(ppo_data, MicroBatchPlan(False, 1, 4), "adv.parquet")  # fixed-size micro-batches: no budget
