"""The score stage: rollout table → scored table (rewards, old/ref log-probs, values), rerun rules, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlhf_core.config import load_config
from rlhf_core.data.schemas import PROMPTS, ROLLOUT, SCORED
from rlhf_core.errors import DataError
from rlhf_core.io.atomic import atomic_write_parquet
from rlhf_core.run.layout import RunDir
from rlhf_core.stages.init_critic import run_init_critic
from rlhf_core.stages.score import run_score
from rlhf_core.run.session import RunSession

DISK = RunSession()  # nothing held in memory: every model is read from its directory

DEMO = Path(__file__).resolve().parents[3] / "configs" / "demo.yaml"

# (response text, expected strict reward): right, wrong, no answer
RESPONSES = [("3 + 4 = 7\n#### {a}", 1.0), ("I think #### {w}", 0.0), ("no idea", 0.0)]


def load_questions(path, n):
    return [json.loads(line) for line in path.read_text().splitlines()[:n]]


def write_run_inputs(run: RunDir, tokenizer, questions, data_source="arith", n_samples=3, iteration=1,
                     reward_source=None):
    """A prompts table and an iteration's rollout table, built directly with the declared schemas.
    Sample j of every prompt gets RESPONSES[j]; returns the expected rewards in row order.
    ``reward_source`` (default: data_source) is what preprocess writes for data.reward_fn_key."""
    reward_source = reward_source or data_source
    prompt_rows, rollout_rows, expected = [], [], []
    for i, q in enumerate(questions):
        messages = [{"role": "user", "content": q["question"]}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        answer = q["answer"].rsplit("####", 1)[1].strip()
        prompt_rows.append(dict(
            prompt_id=f"p{i}", data_source=data_source, reward_source=reward_source, prompt=messages, ability="math",
            reward_model={"style": "rule", "ground_truth": answer},
            extra_info=json.dumps({"split": "train", "index": i, "question": q["question"], "answer": q["answer"]}),
            source_file="test", source_row=i,
            prompt_text=text, prompt_token_ids=ids, prompt_length=len(ids)))
        for j in range(n_samples):
            template, reward = RESPONSES[j % len(RESPONSES)]
            response = template.format(a=answer, w=answer + "1")
            response_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            rollout_rows.append(dict(
                prompt_id=f"p{i}", sample_index=j, iteration=iteration, data_source=data_source,
                ground_truth=answer, prompt_token_ids=ids, response_text=response,
                response_token_ids=response_ids, response_length=len(response_ids), finish_reason="stop",
                engine="offline", sampling_seed=0, reward_source=reward_source,
                extra_info=prompt_rows[-1]["extra_info"], uid=f"{iteration}-{i}"))
            expected.append(reward)
    atomic_write_parquet(run.train_prompts, pa.Table.from_pylist(prompt_rows, schema=PROMPTS), schema=PROMPTS)
    atomic_write_parquet(run.rollout(iteration), pa.Table.from_pylist(rollout_rows, schema=ROLLOUT), schema=ROLLOUT)
    return expected


@pytest.fixture
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def demo_config(tiny_model_dir, *extra):
    return load_config(DEMO, [f"actor_rollout_ref.model.path={tiny_model_dir}", "actor_rollout_ref.model.warm_start.enable=false",
                                             "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=512",
                                             *extra])


def test_score_stage_on_embedded_data(tmp_path, repo_root, tiny_model_dir, tokenizer):
    import duckdb

    from rlhf_core.scoring import compute_token_logprobs, compute_token_values, load_causal_lm, load_critic

    run = RunDir(tmp_path / "run")
    expected = write_run_inputs(run, tokenizer, load_questions(repo_root / "data/arith/train.jsonl", 8))
    cfg = demo_config(tiny_model_dir, "actor_rollout_ref.rollout.temperature=0.7")
    run_init_critic(cfg, run)
    result = run_score(cfg, run, 1)

    table = pq.read_table(run.scored(1))
    assert table.schema.equals(SCORED, check_metadata=False)
    rows = table.to_pylist()
    assert [r["reward"] for r in rows] == expected
    for r in rows:
        for col in ("old_log_probs", "ref_log_probs", "values"):
            assert len(r[col]) == r["response_length"]
        assert r["old_log_probs"] == r["ref_log_probs"]  # iteration 1: reference = initial actor
        assert all(lp <= 0 for lp in r["old_log_probs"]) and r["reward_extra"] == "{}"

    # the stored numbers are the models' (at the rollout temperature), not just the right shapes
    seqs = [r["prompt_token_ids"] + r["response_token_ids"] for r in rows]
    plens = [len(r["prompt_token_ids"]) for r in rows]
    actor = load_causal_lm(tiny_model_dir, torch.device("cpu"), torch.float32, session=DISK)
    direct = compute_token_logprobs(actor, seqs, plens, 4096, temperature=0.7, progress=False)
    critic = load_critic(run.models_dir / "critic_init", torch.device("cpu"), torch.float32, session=DISK)
    values = compute_token_values(critic, seqs, plens, 4096, progress=False)
    for r, lp, v in zip(rows, direct, values):
        torch.testing.assert_close(torch.tensor(r["old_log_probs"]), lp, atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(r["values"]), v, atol=1e-5, rtol=0)

    assert result.metrics["reward/mean"] == pytest.approx(sum(expected) / len(expected))
    assert result.metrics["reward/accuracy"] == pytest.approx(1 / 3)
    assert result.metrics["perf/score_tokens_per_s"] > 0 and result.rows == {"scored": 24}
    assert any("identical weights" in line for line in result.summary)
    mean = duckdb.sql(f"SELECT avg(reward) FROM '{run.scored(1)}'").fetchall()[0][0]
    assert mean == pytest.approx(sum(expected) / len(expected))

    again = run_score(cfg, run, 1)
    assert again.skipped and again.metrics["reward/mean"] == result.metrics["reward/mean"]
    changed = run_score(demo_config(tiny_model_dir, "custom_reward_function.format_score=0.5"), run, 1)
    assert not changed.skipped  # a reward setting changed: rescored
    assert [r["reward"] for r in pq.read_table(run.scored(1)).to_pylist()][:3] == [1.0, 0.5, 0.0]

    # a rollout table without a column of its schema (older ones are completed by run.migrate): one line
    older = pq.read_table(run.rollout(1)).drop(["rollout_log_probs"])
    pq.write_table(older, run.rollout(1))
    with pytest.raises(DataError, match=r"rollout.parquet lacks the columns \['rollout_log_probs'\] .*rerun the rollout"):
        run_score(cfg, run, 1, force=True)


def test_different_reference_and_reward_model(tmp_path, repo_root, tiny_model_dir, tokenizer):
    """A reference with other weights gets its own pass; reward_model.enable scores with the RM."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    ref_dir, rm_dir = tmp_path / "ref", tmp_path / "rm"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)
    model.save_pretrained(ref_dir)
    torch.manual_seed(5)
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    rm.config.pad_token_id = tokenizer.pad_token_id
    rm.save_pretrained(rm_dir)
    tokenizer.save_pretrained(rm_dir)

    run = RunDir(tmp_path / "run")
    write_run_inputs(run, tokenizer, load_questions(repo_root / "data/arith/train.jsonl", 4), n_samples=2)
    cfg = demo_config(tiny_model_dir, f"actor_rollout_ref.ref.model_path={ref_dir}", "reward_model.enable=true",
                      f"reward_model.model.path={rm_dir}", "reward_model.micro_batch_size_per_gpu=3")
    run_init_critic(cfg, run)
    result = run_score(cfg, run, 1)
    rows = pq.read_table(run.scored(1)).to_pylist()
    assert all(r["old_log_probs"] != r["ref_log_probs"] for r in rows)
    assert all(len(r["ref_log_probs"]) == r["response_length"] for r in rows)
    assert all(json.loads(r["reward_extra"])["rm_score"] == pytest.approx(r["reward"]) for r in rows)
    assert len({r["reward"] for r in rows}) > 1 and "reward/accuracy" not in result.metrics
    assert not any("identical weights" in line for line in result.summary)


def test_bypass_mode_takes_the_rollouts_log_probs_without_an_actor_pass(tmp_path, repo_root, tiny_model_dir,
                                                                        tokenizer, monkeypatch):
    """verl's bypass mode: the engine's own log-probs are the old policy, so the actor's pass is not
    run at all (unless the reference has the actor's weights, as in iteration 1: then it is the
    reference's pass)."""
    from rlhf_core.stages import score

    ref_dir = tmp_path / "ref"
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)
    model.save_pretrained(ref_dir)
    run = RunDir(tmp_path / "run")
    write_run_inputs(run, tokenizer, load_questions(repo_root / "data/arith/train.jsonl", 3), n_samples=2)
    table = pq.read_table(run.rollout(1))
    engine_lps = [[-0.25 - 0.01 * t for t in range(n)] for n in table.column("response_length").to_pylist()]
    table = table.set_column(table.schema.get_field_index("rollout_log_probs"), "rollout_log_probs",
                             pa.array(engine_lps, type=ROLLOUT.field("rollout_log_probs").type))
    atomic_write_parquet(run.rollout(1), table, schema=ROLLOUT)
    loads = []
    real = score.load_causal_lm
    monkeypatch.setattr(score, "load_causal_lm", lambda *a, **k: loads.append(k.get("role")) or real(*a, **k))

    cfg = demo_config(tiny_model_dir, f"actor_rollout_ref.ref.model_path={ref_dir}",
                      "algorithm.rollout_correction.bypass_mode=true")
    run_init_critic(cfg, run)
    run_score(cfg, run, 1)
    rows = pq.read_table(run.scored(1)).to_pylist()
    flat = [x for lps in engine_lps for x in lps]
    assert [x for r in rows for x in r["old_log_probs"]] == pytest.approx(flat, abs=1e-6)
    assert all(r["ref_log_probs"] != r["old_log_probs"] for r in rows)
    assert "actor" not in loads  # no actor pass

    same = demo_config(tiny_model_dir, "algorithm.rollout_correction.bypass_mode=true")  # ref = actor
    run_score(same, run, 1, force=True)
    rows = pq.read_table(run.scored(1)).to_pylist()
    assert loads.count("actor") == 1 and [x for r in rows for x in r["old_log_probs"]] == pytest.approx(flat, abs=1e-6)
    assert all(r["ref_log_probs"] != r["old_log_probs"] for r in rows)  # the reference pass, not the engine's


def test_score_from_the_cli_on_gsm8k_prompts(tmp_path, gsm8k_train, tiny_model_dir, tokenizer, capsys):
    from rlhf_cli.main import main

    run = RunDir(tmp_path / "run")
    expected = write_run_inputs(run, tokenizer, load_questions(gsm8k_train, 4), data_source="openai/gsm8k")
    argv = ["stage", "score", "--local", "--run-dir", str(run.root), "--iteration", "1", "-c", str(DEMO),
            f"actor_rollout_ref.model.path={tiny_model_dir}", "custom_reward_function.gsm8k_method=flexible",
            "actor_rollout_ref.model.warm_start.enable=false"]
    assert main(["stage", "init_critic", "--local", *argv[3:5], *argv[7:]]) == 0  # what `rlhf run` runs first
    capsys.readouterr()
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "[score iteration 1] done" in out and "tokens/s" in out and "accuracy" in out
    rewards = [r["reward"] for r in pq.read_table(run.scored(1), columns=["reward"]).to_pylist()]
    # flexible reads the wrong "#### <answer>1" as wrong, and "no idea" has no number: same as strict
    assert rewards == expected
    assert main(argv) == 0 and "skipped (up to date)" in capsys.readouterr().out


def test_missing_rollout_and_mismatched_lengths_are_clear_errors(tmp_path, repo_root, tiny_model_dir, tokenizer):
    run = RunDir(tmp_path / "run")
    cfg = demo_config(tiny_model_dir)
    with pytest.raises(DataError, match="rlhf stage rollout"):
        run_score(cfg, run, 1)
    write_run_inputs(run, tokenizer, load_questions(repo_root / "data/arith/train.jsonl", 1), n_samples=1)
    run_init_critic(cfg, run)
    table = pq.read_table(run.rollout(1))
    bad = table.set_column(table.schema.get_field_index("response_length"), "response_length",
                           pa.array([99], pa.int32()))
    atomic_write_parquet(run.rollout(1), bad, schema=ROLLOUT)
    with pytest.raises(DataError, match="row 0 .*response_length=99"):
        run_score(cfg, run, 1)
    assert not run.scored(1).exists()


def test_unknown_data_source_names_the_row(tmp_path, repo_root, tiny_model_dir, tokenizer):
    run = RunDir(tmp_path / "run")
    write_run_inputs(run, tokenizer, load_questions(repo_root / "data/arith/train.jsonl", 1), n_samples=1,
                     data_source="my/data")
    run_init_critic(demo_config(tiny_model_dir), run)
    with pytest.raises(DataError, match=r"row 0 \(prompt_id='p0'.*no reward function for data_source 'my/data'"):
        run_score(demo_config(tiny_model_dir), run, 1)


def test_verl_score_metrics_and_routing_by_reward_fn_key_with_extra_info(tmp_path, repo_root, tiny_model_dir,
                                                                         tokenizer):
    """The reward routes on reward_source (preprocess's value of data.reward_fn_key's column); the
    function gets verl's keywords and the row's extra_info as a dict."""
    reward = tmp_path / "reward.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': float(data_source == 'math') + extra_info['index'], 'index': extra_info['index'],\n"
        "            'num_turns': extra_info['num_turns']}\n")
    run = RunDir(tmp_path / "run")
    questions = load_questions(repo_root / "data/arith/train.jsonl", 3)
    # data_source 'arith', but reward_source 'math' (as preprocess writes it for data.reward_fn_key=ability)
    write_run_inputs(run, tokenizer, questions, n_samples=2, reward_source="math")
    cfg = demo_config(tiny_model_dir, "data.reward_fn_key=ability", f"custom_reward_function.path={reward}")
    run_init_critic(cfg, run)
    result = run_score(cfg, run, 1)
    rows = pq.read_table(run.scored(1)).to_pylist()
    assert [r["reward"] for r in rows] == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]  # routed on 'math', + index
    assert json.loads(rows[2]["reward_extra"]) == {"index": 1, "num_turns": None}
    m = result.metrics
    assert (m["critic/score/mean"], m["critic/score/max"], m["critic/score/min"]) == (2.0, 3.0, 1.0)
    assert m["reward/mean"] == 2.0 and "reward/accuracy" not in m

    # a row with no routing value (reward_source null in the response's row and its prompt's)
    for path, schema in ((run.train_prompts, PROMPTS), (run.rollout(1), ROLLOUT)):
        table = pq.read_table(path)
        table = table.set_column(table.schema.get_field_index("reward_source"), "reward_source",
                                 pa.nulls(table.num_rows, pa.string()))
        atomic_write_parquet(path, table, schema=schema)
    from rlhf_core.config import ConfigError

    with pytest.raises(ConfigError, match=r"data.reward_fn_key='ability': .*rollout.parquet row 0 .* has no value"):
        run_score(cfg, run, 1, force=True)


def test_fixed_micro_batches_and_padded_rows_give_the_same_table(tmp_path, repo_root, tiny_model_dir, tokenizer):
    """use_dynamic_bsz=false: log_prob_micro_batch_size_per_gpu sequences per forward (verl), and
    use_remove_padding=false lays them out padded; neither changes a number."""
    run = RunDir(tmp_path / "run")
    write_run_inputs(run, tokenizer, load_questions(repo_root / "data/arith/train.jsonl", 5), n_samples=2)
    run_init_critic(demo_config(tiny_model_dir), run)
    run_score(demo_config(tiny_model_dir), run, 1)
    packed = pq.read_table(run.scored(1)).to_pylist()
    fixed = demo_config(tiny_model_dir, "actor_rollout_ref.actor.use_dynamic_bsz=false",
                        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
                        "critic.forward_micro_batch_size_per_gpu=3", "actor_rollout_ref.model.use_remove_padding=false")
    result = run_score(fixed, run, 1)
    assert any("actor log-probs (3 micro-batches)" in line and "critic values (4 micro-batches)" in line
               for line in result.summary)  # 10 responses: 4 + 4 + 2, and 3 + 3 + 3 + 1
    for a, b in zip(packed, pq.read_table(run.scored(1)).to_pylist()):
        for col in ("old_log_probs", "ref_log_probs", "values"):
            torch.testing.assert_close(torch.tensor(a[col]), torch.tensor(b[col]), atol=1e-5, rtol=0)


def test_reward_model_with_an_input_tokenizer_rerenders_and_truncates(tmp_path, repo_root, tiny_model_dir, tokenizer):
    """reward_model.model.input_tokenizer set: responses decoded and re-rendered in the RM's chat
    template, cut to reward_model.max_length tokens, micro_batch_size_per_gpu per forward."""
    from transformers import AutoModelForSequenceClassification

    from rlhf_core.rewards.reward_model import load_reward_model, rerendered_ids, score_token_batch

    rm_dir = tmp_path / "rm"
    torch.manual_seed(5)
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    rm.config.pad_token_id = tokenizer.pad_token_id
    rm.save_pretrained(rm_dir)
    tokenizer.save_pretrained(rm_dir)
    run = RunDir(tmp_path / "run")
    write_run_inputs(run, tokenizer, load_questions(repo_root / "data/arith/train.jsonl", 3), n_samples=2)
    cfg = demo_config(tiny_model_dir, "reward_model.enable=true", f"reward_model.model.path={rm_dir}",
                      f"reward_model.model.input_tokenizer={tiny_model_dir}", "reward_model.max_length=40",
                      "reward_model.micro_batch_size_per_gpu=4")
    run_init_critic(cfg, run)
    run_score(cfg, run, 1)
    rows = pq.read_table(run.scored(1)).to_pylist()
    model = load_reward_model(rm_dir)
    prompts = {r["prompt_id"]: r for r in pq.read_table(run.train_prompts).to_pylist()}
    ids = [rerendered_ids(model, prompts[r["prompt_id"]]["prompt"], r["response_token_ids"], tokenizer, 40)
           for r in rows]
    assert all(len(x) == 40 for x in ids)  # every conversation here is longer: truncated
    direct = score_token_batch(model, ids).tolist()
    assert [r["reward"] for r in rows] == pytest.approx(direct, abs=1e-5)


@pytest.mark.deepspeed  # torchrun processes: the slow lane
def test_score_on_two_and_four_processes_equals_one_process(tmp_path, repo_root, tiny_model_dir, tokenizer):
    """trainer.stage_processes=N: each process runs a token-balanced share of every pass's
    micro-batches; the merged table is the one-process table bit for bit (the reference pass
    included: another reference model)."""
    from rlhf_core.scoring.logprobs import own_micro_batches, plan_micro_batches

    run = RunDir(tmp_path / "run")
    write_run_inputs(run, tokenizer, load_questions(repo_root / "data/arith/train.jsonl", 7), n_samples=2)
    other_ref = tmp_path / "ref"
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    ref_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for p in ref_model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    ref_model.save_pretrained(other_ref)
    tokenizer.save_pretrained(other_ref)
    base = [f"actor_rollout_ref.ref.model_path={other_ref}", "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=160",
            "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=160", "critic.forward_max_token_len_per_gpu=160"]
    run_init_critic(demo_config(tiny_model_dir, *base), run)
    run_score(demo_config(tiny_model_dir, *base), run, 1)
    one = pq.read_table(run.scored(1))
    lengths = [len(r["prompt_token_ids"]) + len(r["response_token_ids"]) for r in one.to_pylist()]
    plan = plan_micro_batches(lengths, 160)
    for world in (2, 4):
        shares = [own_micro_batches(plan, lengths, rank, world) for rank in range(world)]
        assert sorted(i for s in shares for rows in s for row in rows for i in row) == list(range(len(lengths)))
        assert all(shares)  # with these budgets every process gets micro-batches
        result = run_score(demo_config(tiny_model_dir, *base, f"trainer.stage_processes={world}"), run, 1, force=True)
        assert not result.skipped and not run.stage_ranks_dir(1, "score").exists()  # scratch removed
        assert pq.read_table(run.scored(1)).equals(one), f"{world} processes changed the scored table"
    assert one.column("ref_log_probs").to_pylist() != one.column("old_log_probs").to_pylist()  # ref pass ran


def _hf_rollout(run: RunDir, tokenizer, repo_root, model_dir) -> list[list[float]]:
    """The run's iteration-1 rollout table with every response sampled by the hf engine from
    ``model_dir`` (engine column 'hf', the engine's own log-probs); returns those log-probs."""
    from rlhf_core.rollout.base import SamplingParams
    from rlhf_core.rollout.hf import HFEngine

    write_run_inputs(run, tokenizer, load_questions(repo_root / "data/arith/train.jsonl", 3), n_samples=1)
    table = pq.read_table(run.rollout(1))
    prompts = table.column("prompt_token_ids").to_pylist()
    samples = HFEngine(model_dir).generate(prompts, SamplingParams(max_new_tokens=12, n=1, seed=3))
    rows = table.to_pylist()
    for row, s in zip(rows, samples):
        row.update(response_token_ids=s.token_ids, response_length=len(s.token_ids), engine="hf",
                   response_text=s.text, rollout_log_probs=s.log_probs)
    atomic_write_parquet(run.rollout(1), pa.Table.from_pylist(rows, schema=ROLLOUT), schema=ROLLOUT)
    return [s.log_probs for s in samples]


@pytest.fixture
def moved_actor_run(tmp_path, repo_root, tiny_model_dir, tokenizer):
    """(run, actor dir, reference dir, the engine's log-probs): an actor that is not the reference (as
    after iteration 1), whose hf-engine samples make iteration 1's rollout."""
    from transformers import AutoModelForCausalLM

    actor = tmp_path / "actor"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.3)
    model.save_pretrained(actor)
    tokenizer.save_pretrained(actor)
    run = RunDir(tmp_path / "run")
    return run, actor, tiny_model_dir, _hf_rollout(run, tokenizer, repo_root, actor)


def _score(run, actor, ref, monkeypatch, *extra):
    from rlhf_core.stages import score

    loads = []
    real = score.load_causal_lm
    monkeypatch.setattr(score, "load_causal_lm", lambda *a, **k: loads.append(k.get("role")) or real(*a, **k))
    cfg = demo_config(actor, f"actor_rollout_ref.ref.model_path={ref}", *extra)
    if not run.critic_init.is_dir():
        run_init_critic(cfg, run)
    result = run_score(cfg, run, 1, force=True)
    old = [r["old_log_probs"] for r in pq.read_table(run.scored(1)).to_pylist()]
    return old, "actor" in loads, result.metrics


def test_old_log_probs_are_the_hf_engines_own_in_fp32_and_no_actor_pass_runs(moved_actor_run, monkeypatch):
    """actor_rollout_ref.rollout.old_log_probs=auto: the hf engine ran the trainer's model in fp32, so its
    log-probs are the trainer's arithmetic (~1e-7 apart) and the actor's pass is skipped; 'recompute'
    (verl's default) runs it, and the two tables' old log-probs agree to rounding."""
    run, actor, ref, engine = moved_actor_run
    reused, actor_pass, metrics = _score(run, actor, ref, monkeypatch)
    assert not actor_pass and metrics["score/old_log_probs_from_rollout"] == 1.0
    assert reused == [pytest.approx(e, abs=0) for e in engine]  # the engine's, as written (float32)
    assert "perf/score_seconds/old_log_prob" not in metrics and "perf/score_seconds/ref" in metrics

    recomputed, actor_pass, metrics = _score(run, actor, ref, monkeypatch,
                                             "actor_rollout_ref.rollout.old_log_probs=recompute")
    assert actor_pass and metrics["score/old_log_probs_from_rollout"] == 0.0
    assert "perf/score_seconds/old_log_prob" in metrics
    gap = max(abs(a - b) for r, e in zip(recomputed, engine) for a, b in zip(r, e))
    assert 0 < gap < 1e-5


@pytest.mark.parametrize("setting", [
    "actor_rollout_ref.rollout.top_k=5",                             # the engine's are of a cut distribution
    "actor_rollout_ref.rollout.top_p=0.9",
    "algorithm.rollout_correction.rollout_is=token",                 # a correction compares the two
    "actor_rollout_ref.actor.deepspeed_config.dtype=bf16",            # bf16 decoding differs by ~3e-3
    "actor_rollout_ref.rollout.hf_decode=static",
])
def test_old_log_probs_are_recomputed_where_the_engines_are_not_the_trainers_arithmetic(moved_actor_run, monkeypatch,
                                                                                       setting):
    run, actor, ref, _ = moved_actor_run
    _, actor_pass, metrics = _score(run, actor, ref, monkeypatch, setting)
    assert actor_pass and metrics["score/old_log_probs_from_rollout"] == 0.0


def test_old_log_probs_from_another_engine_are_recomputed(moved_actor_run, monkeypatch):
    run, actor, ref, _ = moved_actor_run
    table = pq.read_table(run.rollout(1))
    table = table.set_column(table.schema.get_field_index("engine"), "engine", pa.array(["vllm"] * table.num_rows))
    atomic_write_parquet(run.rollout(1), table, schema=ROLLOUT)
    _, actor_pass, metrics = _score(run, actor, ref, monkeypatch)
    assert actor_pass and metrics["score/old_log_probs_from_rollout"] == 0.0
