"""The gae stage: scored table → advantages table and the KL controller state it hands on (one step
per iteration, however often the stage reruns; the next iteration starts from its committed
predecessor's), what a rollback and a retry do to it, the CLI."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf_core.run import lifecycle
from rlhf_core.config import ConfigError, apply_overrides, load_config, to_yaml
from rlhf_core.data.schemas import ADVANTAGES, PROMPTS, ROLLOUT, SCORED
from rlhf_core.errors import DataError
from rlhf_core.io.atomic import atomic_write_json, atomic_write_parquet
from rlhf_core.run.manifest import read_manifest, set_status
from rlhf_core.run.layout import RunDir, StateFileError
from rlhf_core.stages.gae import run_gae

DEMO = Path(__file__).resolve().parents[3] / "configs" / "demo.yaml"
ADAPTIVE = ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.kl_coef=0.1", "algorithm.kl_ctrl.target_kl=0.05",
            "algorithm.kl_ctrl.horizon=40"]


def write_scored(run: RunDir, k: int, lengths=(4, 7, 1, 0, 5), seed=0, kl_shift=0.3) -> list[dict]:
    """A hand-made scored table for iteration k: old log-probs sit ``kl_shift`` above ref on average."""
    rng = random.Random(seed)
    rows = []
    for i, n in enumerate(lengths):
        ref = [rng.uniform(-3, -0.5) for _ in range(n)]
        rows.append(dict(prompt_id=f"p{i}", sample_index=i % 2, iteration=k, data_source="arith", ground_truth="7",
                         prompt_token_ids=[1, 2, 3], response_text="r" * n, response_token_ids=list(range(n)),
                         response_length=n, finish_reason="stop", engine="offline", sampling_seed=0,
                         reward=float(i % 2), reward_extra="{}",
                         old_log_probs=[x + kl_shift + rng.uniform(-0.1, 0.1) for x in ref], ref_log_probs=ref,
                         values=[rng.uniform(-1, 1) for _ in range(n)], uid=f"{k}-p{i}"))
    atomic_write_parquet(run.scored(k), pa.Table.from_pylist(rows, schema=SCORED), schema=SCORED)
    return rows


def config(*overrides):
    return load_config(None, list(overrides))


def commit(run: RunDir, *iterations: int) -> None:
    """The commit log only (what gae asks: which committed iteration a later one starts from)."""
    atomic_write_json(run.last_good_path, {"iteration": iterations[-1], "time": 0.0, "committed": list(iterations),
                                           "checkpoint": str(run.checkpoint(iterations[-1]).relative_to(run.root))})


def kl_state(run: RunDir, k: int) -> dict:
    return json.loads(run.kl_state(k).read_text())


def advantages(run: RunDir, k: int) -> list[dict]:
    return pq.read_table(run.advantages(k)).to_pylist()


def test_schema_lengths_and_hand_computed_advantages_without_kl(tmp_path):
    run = RunDir(tmp_path / "run")
    scored = write_scored(run, 1)
    result = run_gae(config("algorithm.use_kl_in_reward=false", "algorithm.norm_adv=false"), run, 1)
    table = pq.read_table(run.advantages(1))
    assert table.schema.names == ADVANTAGES.names and table.schema.equals(ADVANTAGES, check_metadata=False)
    stored = pq.read_table(run.scored(1)).to_pylist()
    for row, src, kept in zip(table.to_pylist(), scored, stored):
        n = src["response_length"]
        assert {k: row[k] for k in SCORED.names} == kept  # every scored column passes through unchanged
        assert len(row["token_level_rewards"]) == len(row["advantages"]) == len(row["returns"]) == n
        if n:  # score on the last token only; gamma = lam = 1: return R everywhere, A_t = R - V_t
            assert row["token_level_rewards"] == [0.0] * (n - 1) + [src["reward"]]
            assert row["returns"] == pytest.approx([src["reward"]] * n, abs=1e-6)
            assert row["advantages"] == pytest.approx([src["reward"] - v for v in src["values"]], abs=1e-6)
    assert not run.kl_state(1).exists()  # no controller: nothing to hand on
    assert result.metrics["kl/coef"] == 0.0 and "kl/coef_next" not in result.metrics
    assert "actor/reward_kl_penalty" not in result.metrics  # verl logs it only with the KL in the reward
    sums = [src["reward"] for src in scored if src["response_length"]]  # token rewards = score: sums = scores
    assert result.metrics["critic/rewards/mean"] == pytest.approx(np.mean(sums))
    assert (result.metrics["critic/rewards/max"], result.metrics["critic/rewards/min"]) == (max(sums), min(sums))
    assert result.rows == {"advantages": 5, "tokens": 17}
    assert any("KL not in the reward" in line for line in result.summary)
    assert read_manifest(run, 1)["gae"]["status"] == "done"


def test_adaptive_controller_steps_once_per_iteration_and_reruns_are_identical(tmp_path):
    run = RunDir(tmp_path / "run")
    scored = write_scored(run, 1)
    cfg = config(*ADAPTIVE, "algorithm.norm_adv=false")
    first = run_gae(cfg, run, 1)
    rows = advantages(run, 1)
    for row, src in zip(rows, scored):  # kind "kl": r_t = -beta (old - ref), plus the score on the last token
        expected = [-0.1 * (o - r) for o, r in zip(src["old_log_probs"], src["ref_log_probs"])]
        if expected:
            expected[-1] += src["reward"]
        assert row["token_level_rewards"] == pytest.approx(expected, abs=1e-6)
    # measured KL ~ 0.3 per token on the 4 non-empty responses, the empty one counting 0 as in verl's
    # batch mean; > target 0.05: the error clips at +0.2, and 5 responses of a 40-sample horizon
    kl = first.metrics["kl/in_reward_mean"]
    assert kl == pytest.approx(0.3 * 4 / 5, abs=0.04)
    state = kl_state(run, 1)
    assert state["used"] == {"type": "adaptive", "value": 0.1, "target_kl": 0.05, "horizon": 40.0}
    assert state["next"] == {"type": "adaptive", "value": pytest.approx(0.1 * (1 + 0.2 * 5 / 40)), "target_kl": 0.05,
                             "horizon": 40.0}
    assert state["retry_scale"] == 1.0 and state["iteration"] == 1
    assert first.metrics["kl/coef"] == 0.1 and first.metrics["kl/coef_next"] == pytest.approx(state["next"]["value"])
    assert first.metrics["actor/reward_kl_penalty"] == kl and first.metrics["actor/reward_kl_penalty_coeff"] == 0.1
    assert read_manifest(run, 1)["gae"]["outputs"]["iter_1/kl_ctrl.json"]  # an output like the table

    assert run_gae(cfg, run, 1).skipped  # unchanged inputs: nothing reruns, nothing steps
    again = run_gae(cfg, run, 1, force=True)
    assert advantages(run, 1) == rows and kl_state(run, 1) == state
    assert again.metrics == first.metrics

    commit(run, 1)
    write_scored(run, 2, seed=1, kl_shift=0.0)  # KL ~ 0 < target: the coefficient goes down
    second = run_gae(cfg, run, 2)
    assert second.metrics["kl/coef"] == state["next"]["value"]  # from the committed predecessor's output
    assert "iter_1/kl_ctrl.json" in read_manifest(run, 2)["gae"]["inputs"]
    after_two = kl_state(run, 2)
    assert after_two["next"]["value"] == pytest.approx(state["next"]["value"] * (1 - 0.2 * 5 / 40))
    # rerunning iteration 1 now reproduces its table and its state: iteration 2 stays up to date
    old = run_gae(cfg, run, 1, force=True)
    assert advantages(run, 1) == rows and kl_state(run, 1) == state
    assert any("nothing downstream is stale" in line for line in old.summary)
    assert run_gae(cfg, run, 2).skipped and kl_state(run, 2) == after_two


def test_fixed_controller_never_moves(tmp_path):
    run = RunDir(tmp_path / "run")
    cfg = config("algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=fixed", "algorithm.kl_ctrl.kl_coef=0.02")
    for k in (1, 2):
        write_scored(run, k, seed=k)
        result = run_gae(cfg, run, k)
        assert result.metrics["kl/coef"] == result.metrics["kl/coef_next"] == 0.02
        commit(run, *range(1, k + 1))
    assert kl_state(run, 2)["next"] == {"type": "fixed", "value": 0.02}


def test_whitened_advantages_have_zero_mean_unit_std_over_valid_tokens(tmp_path):
    run = RunDir(tmp_path / "run")
    write_scored(run, 1, lengths=(9, 3, 0, 14, 6, 2))
    result = run_gae(config("algorithm.norm_adv=true", "algorithm.gamma=0.99", "algorithm.lam=0.95"), run, 1)
    rows = advantages(run, 1)
    flat = np.concatenate([np.array(r["advantages"]) for r in rows])
    assert len(flat) == 34 and flat.mean() == pytest.approx(0.0, abs=1e-5)
    assert flat.std(ddof=1) == pytest.approx(1.0, abs=1e-4)
    assert result.metrics["advantages/min"] == pytest.approx(flat.min(), abs=1e-6)
    # returns stay un-whitened: the critic's targets
    run_gae(config("algorithm.norm_adv=false", "algorithm.gamma=0.99", "algorithm.lam=0.95"), run, 1)
    assert [r["returns"] for r in advantages(run, 1)] == [r["returns"] for r in rows]


def retry(cfg, run: RunDir, k: int, attempt: int = 1) -> None:
    """What a KL-breach retry of iteration k does to its gae: the rollback marks the record, the
    retry records its decision in iter_k/retry.json (tasks.breach), its config changes go elsewhere."""
    set_status(run, k, "gae", "rolled_back")  # what lifecycle.rollback_iteration does to the record
    _, changes = lifecycle.retry_overrides(cfg)
    lifecycle.record_retry(run, k, attempt, changes, cfg.trainer.retry_kl_coef_multiplier)


def test_a_rollback_needs_nothing_and_a_retry_scales_the_coefficient(tmp_path):
    """The retry of iteration 2 starts again from committed iteration 1's state; its raised
    coefficient is that state times the retry's scale (iter_2/retry.json, an input of the gae), the
    controller steps from the raised value, and no β scale is config: config.yaml holds none."""
    run = RunDir(tmp_path / "run")
    cfg = config(*ADAPTIVE, "trainer.retry_kl_coef_multiplier=2.0", "trainer.retry_lr_divisor=1")
    write_scored(run, 1)
    run_gae(cfg, run, 1)
    commit(run, 1)
    start = kl_state(run, 1)["next"]
    write_scored(run, 2)
    assert run_gae(cfg, run, 2).metrics["kl/coef"] == start["value"]
    first_try = kl_state(run, 2)

    overrides, changes = lifecycle.retry_overrides(cfg)
    assert overrides == [] and changes == {}  # the reward's coefficient is no config change
    assert "kl_coef_scale" not in to_yaml(apply_overrides(cfg, overrides))
    retry(cfg, run, 2)
    assert json.loads(run.retry_record(2).read_text())["kl_coef_scale"] == 2.0
    retried = run_gae(cfg, run, 2)
    assert not retried.skipped and retried.metrics["kl/coef"] == 2 * start["value"]
    assert retried.metrics["actor/reward_kl_penalty_coeff"] == 2 * start["value"]
    assert "iter_2/retry.json" in read_manifest(run, 2)["gae"]["inputs"]  # a retry makes gae rerun
    assert any("× retry scale 2" in line for line in retried.summary)
    state = kl_state(run, 2)
    assert state["used"] == start and state["retry_scale"] == 2.0
    assert state["next"] == {**first_try["next"], "value": 2 * first_try["next"]["value"]}  # stored as is
    assert retried.metrics["kl/coef_next"] == state["next"]["value"]
    assert run_gae(cfg, run, 2).skipped  # the same retry record: up to date


def test_after_a_retry_the_next_iteration_starts_from_the_raised_state_and_retries_compound(tmp_path):
    """Two retries of iteration 2 multiply its coefficient by the multiplier twice; once 2 commits,
    iteration 3 starts from 2's "next" as it is (the raise carried by the controller's state), with no
    scale of its own."""
    run = RunDir(tmp_path / "run")
    cfg = config(*ADAPTIVE, "trainer.retry_kl_coef_multiplier=3.0")
    write_scored(run, 1)
    run_gae(cfg, run, 1)
    commit(run, 1)
    start = kl_state(run, 1)["next"]["value"]
    write_scored(run, 2)
    run_gae(cfg, run, 2)
    retry(cfg, run, 2, attempt=1)
    assert run_gae(cfg, run, 2).metrics["kl/coef"] == pytest.approx(3 * start, rel=1e-15)
    retry(cfg, run, 2, attempt=2)
    twice = run_gae(cfg, run, 2)
    assert twice.metrics["kl/coef"] == pytest.approx(9 * start, rel=1e-15)
    assert kl_state(run, 2)["retry_scale"] == 9.0
    assert json.loads(run.retry_record(2).read_text())["attempt"] == 2
    commit(run, 1, 2)
    write_scored(run, 3, seed=3)
    third = run_gae(cfg, run, 3)
    assert third.metrics["kl/coef"] == kl_state(run, 2)["next"]["value"] == twice.metrics["kl/coef_next"]
    assert kl_state(run, 3)["retry_scale"] == 1.0 and kl_state(run, 3)["used"] == kl_state(run, 2)["next"]
    assert "iter_3/retry.json" not in read_manifest(run, 3)["gae"]["inputs"]


@pytest.mark.parametrize("kind", ["adaptive", "fixed"])
@pytest.mark.parametrize("scale", [2.0, 3.0, 0.7])
def test_scaling_before_the_step_equals_scaling_after_it(kind, scale):
    """Format 4 stepped the controller at its own value and scaled the coefficient after; format 5
    scales before the step. The step is proportional to the value, so the numbers are the same."""
    from rlhf_core.algos.controllers import make_kl_controller

    for value, kl, n in ((0.1, 0.3, 5), (0.02, 0.001, 64), (0.5, 0.05, 1)):
        before, after = (make_kl_controller(kind, v, 0.05, 40.0) for v in (value * scale, value))
        before.update(current_kl=kl, n_steps=n)
        after.update(current_kl=kl, n_steps=n)
        assert before.value == pytest.approx(after.value * scale, rel=1e-14)


def test_clear_errors(tmp_path):
    run = RunDir(tmp_path / "run")
    with pytest.raises(DataError, match="rlhf stage score"):
        run_gae(config(), run, 1)
    write_scored(run, 1)
    run_gae(config("algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=fixed"), run, 1)
    commit(run, 1)
    write_scored(run, 2)
    with pytest.raises(ConfigError, match="algorithm.kl_ctrl.type=fixed"):
        run_gae(config("algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive"), run, 2)
    assert not run.advantages(2).exists()
    run.kl_state(1).unlink()  # never a silent restart at algorithm.kl_ctrl.kl_coef
    with pytest.raises(StateFileError, match=r"iter_1/kl_ctrl.json is missing.*rlhf run --resume"):
        run_gae(config("algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=fixed"), run, 2)
    run.kl_state(1).write_text("{not json")
    with pytest.raises(StateFileError, match=r"kl_ctrl.json is damaged.*rlhf run --resume"):
        run_gae(config("algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=fixed"), run, 2)


def test_gae_from_the_cli(tmp_path, capsys):
    from rlhf_cli.main import main

    run = RunDir(tmp_path / "run")
    write_scored(run, 1)
    argv = ["stage", "gae", "--local", "--run-dir", str(run.root), "--iteration", "1", "-c", str(DEMO),
            "algorithm.kl_ctrl.type=fixed", "algorithm.kl_ctrl.kl_coef=0.05"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "[gae iteration 1] done" in out and "KL in reward: kl estimator, coefficient 0.05 (fixed)" in out
    assert len(advantages(run, 1)) == 5
    assert main(argv) == 0 and "skipped (up to date)" in capsys.readouterr().out


def test_score_then_gae_on_the_tiny_model(tmp_path, repo_root, tiny_model_dir):
    """The real score stage's table feeds gae: iteration 1's reference is the actor, so the in-reward
    KL is exactly 0, the token rewards are the scores alone, and the adaptive coefficient goes down."""
    from transformers import AutoTokenizer

    from rlhf_core.stages.init_critic import run_init_critic
    from rlhf_core.stages.score import run_score

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    run = RunDir(tmp_path / "run")
    questions = [json.loads(line) for line in (repo_root / "data/arith/train.jsonl").read_text().splitlines()[:3]]
    write_prompts_and_rollout(run, tokenizer, questions)
    cfg = load_config(DEMO, [f"actor_rollout_ref.model.path={tiny_model_dir}", "actor_rollout_ref.model.warm_start.enable=false", *ADAPTIVE])
    run_init_critic(cfg, run)
    run_score(cfg, run, 1)
    result = run_gae(cfg, run, 1)
    scored = pq.read_table(run.scored(1)).to_pylist()
    for row, src in zip(advantages(run, 1), scored):
        n = src["response_length"]
        assert row["token_level_rewards"] == [0.0] * (n - 1) + [src["reward"]]
        assert row["values"] == src["values"] and len(row["advantages"]) == n
    assert result.metrics["kl/in_reward_mean"] == 0.0
    assert result.metrics["kl/coef_next"] == pytest.approx(0.1 * (1 - 0.2 * 6 / 40))
    assert {r["reward"] for r in scored} == {0.0, 1.0}


def write_prompts_and_rollout(run: RunDir, tokenizer, questions) -> None:
    """Prompts and an iteration-1 rollout with two responses per question: the right answer, a wrong one."""
    prompts, rollout = [], []
    for i, q in enumerate(questions):
        messages = [{"role": "user", "content": q["question"]}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        answer = q["answer"].rsplit("####", 1)[1].strip()
        prompts.append(dict(prompt_id=f"p{i}", data_source="arith", reward_source="arith", prompt=messages, ability="math",
                            reward_model={"style": "rule", "ground_truth": answer},
                            extra_info=json.dumps({"split": "train", "index": i, "question": q["question"],
                                                   "answer": q["answer"]}), source_file="test", source_row=i,
                            prompt_text=text, prompt_token_ids=ids, prompt_length=len(ids)))
        for j, response in enumerate([f"so #### {answer}", f"#### {answer}9"]):
            response_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            rollout.append(dict(prompt_id=f"p{i}", sample_index=j, iteration=1, data_source="arith",
                                ground_truth=answer, prompt_token_ids=ids, response_text=response,
                                response_token_ids=response_ids, response_length=len(response_ids),
                                finish_reason="stop", engine="offline", sampling_seed=0, reward_source="arith",
                                extra_info=prompts[-1]["extra_info"], uid=f"1-p{i}"))
    atomic_write_parquet(run.train_prompts, pa.Table.from_pylist(prompts, schema=PROMPTS), schema=PROMPTS)
    atomic_write_parquet(run.rollout(1), pa.Table.from_pylist(rollout, schema=ROLLOUT), schema=ROLLOUT)


# ---------------------------------------------------------------------------------------------
# rollout rejection, then a group estimator: each response keeps the score verl gives it
# ---------------------------------------------------------------------------------------------

# (uid, reward, length, rejected token positions), groups interleaved: a0's correct answer loses its
# last token (the one its score sits on), b1 loses every token, c0 is alone in its group
REJECTION_ROWS = [("a", 1.0, 3, {2}), ("b", 0.5, 3, set()), ("c", 1.0, 2, set()), ("a", 0.0, 3, set()),
                  ("b", 1.0, 3, {0, 1, 2}), ("a", 0.0, 3, set())]


def write_scored_with_rejections(run: RunDir, k: int) -> None:
    """The rollout engine's log-probs equal the trainer's except at the rejected positions, where
    they sit 1 nat lower (token_k2 = 0.5, over the 0.1 threshold)."""
    rows = []
    for i, (uid, reward, n, rejected) in enumerate(REJECTION_ROWS):
        old = [-0.5 - 0.1 * t for t in range(n)]
        rows.append(dict(prompt_id=f"p{uid}", sample_index=i, iteration=k, data_source="arith", ground_truth="7",
                         prompt_token_ids=[1, 2, 3], response_text="r" * n, response_token_ids=list(range(n)),
                         response_length=n, finish_reason="stop", engine="hf", sampling_seed=0, reward=reward,
                         reward_extra=json.dumps({"acc": reward}), old_log_probs=old, ref_log_probs=old,
                         values=[0.0] * n, rollout_log_probs=[x - (t in rejected) for t, x in enumerate(old)],
                         uid=f"{k}-{uid}"))
    atomic_write_parquet(run.scored(k), pa.Table.from_pylist(rows, schema=SCORED), schema=SCORED)


def _verl_advantages(name: str) -> list[float]:
    """Each row's advantage on its kept tokens, from verl's definitions on the whole-row scores
    (a0 scores 1 and b1 scores 1 although rejection masked their score's token)."""
    uids = [u for u, *_ in REJECTION_ROWS]
    s = np.array([r for _, r, *_ in REJECTION_ROWS])
    kept = np.array([n - len(rej) for _, _, n, rej in REJECTION_ROWS])
    group = {u: np.flatnonzero(np.array(uids) == u) for u in uids}
    size = np.array([len(group[u]) for u in uids])
    mean = np.array([s[group[u]].mean() for u in uids])
    std = np.array([s[group[u]].std(ddof=1) if len(group[u]) > 1 else 1.0 for u in uids])
    centred = np.where(size > 1, s - mean, s)
    if name in ("grpo", "grpo_vectorized", "gdpo"):
        per_row = centred / (std + 1e-6)
    elif name == "rloo":
        per_row = np.where(size > 1, (s - mean) * size / np.maximum(size - 1, 1), s)
    elif name == "rloo_vectorized":
        per_row = np.where(size > 1, (s - mean) * size / np.maximum(size - 1, 1), 0.0)
    elif name == "gpg":
        per_row = len(s) / np.count_nonzero(s) * centred
    elif name == "opo":
        base = {u: (kept[group[u]] * s[group[u]]).sum() / kept[group[u]].sum() for u in uids}
        per_row = np.where(size > 1, s - np.array([base[u] for u in uids]), s)
    else:
        per_row = centred
    if name in ("reinforce_plus_plus_baseline", "gdpo"):  # whitened over the kept tokens
        tokens = np.repeat(per_row, kept)
        per_row = (per_row - tokens.mean()) / np.sqrt(tokens.var(ddof=1) + 1e-8)
    return list(per_row)


@pytest.mark.parametrize("name", ["grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "gpg", "opo",
                                  "reinforce_plus_plus_baseline", "gdpo"])
def test_rejected_tokens_keep_their_score_in_the_group_estimators(tmp_path, name):
    """verl's rejection changes only response_mask; its group estimators take each response's score
    from the whole token_level_rewards row, so a response whose scored token was rejected keeps its
    score, for its own kept tokens and in its group's statistics."""
    run = RunDir(tmp_path / "run")
    write_scored_with_rejections(run, 1)
    keys = ["algorithm.gdpo_reward_keys=[acc]"] if name == "gdpo" else []
    run_gae(config(f"algorithm.adv_estimator={name}", "algorithm.use_kl_in_reward=false",
                   "algorithm.rollout_correction.rollout_rs=token_k2",
                   "algorithm.rollout_correction.rollout_rs_threshold=0.1", *keys), run, 1)
    rows = advantages(run, 1)
    assert [r["response_mask"] for r in rows] == [[t not in rej for t in range(n)] for _, _, n, rej in REJECTION_ROWS]
    for i, (row, expected) in enumerate(zip(rows, _verl_advantages(name))):
        want = [expected if keep else 0.0 for keep in row["response_mask"]]
        assert row["advantages"] == pytest.approx(want, abs=1e-5), f"{name} row {i}"
    if name == "grpo":  # the numbers: [1, 0, 0] with the correct answer's last token rejected
        assert rows[0]["advantages"][:2] == pytest.approx([1.1547] * 2, abs=1e-4)
        assert rows[3]["advantages"] == pytest.approx([-0.5774] * 3, abs=1e-4)


def test_a_retry_scale_beyond_any_sensible_coefficient_is_one_line_naming_its_file(tmp_path):
    """Issue 49: a retry scale of 1e308 in iter_k/retry.json ended in an AssertionError in the
    advantages' metrics, at the run and at every resume. Now gae refuses in one line naming the file
    to delete; nothing is written."""
    run = RunDir(tmp_path / "run")
    cfg = config(*ADAPTIVE)
    write_scored(run, 1)
    retry(cfg, run, 1)
    record = json.loads(run.retry_record(1).read_text())
    run.retry_record(1).write_text(json.dumps({**record, "kl_coef_scale": 1e308}))
    with pytest.raises(DataError, match=rf"iteration 1's reward KL coefficient would be 0.1 \(algorithm.kl_ctrl.kl_coef\) "
                                        rf"× 1e\+308 \(the retry scale in {run.retry_record(1)}\) = 1e\+307, beyond 1e\+06: "
                                        rf".*delete {run.retry_record(1)} to run iteration 1 with the controller's own"):
        run_gae(cfg, run, 1)
    assert not run.advantages(1).exists()
    run.retry_record(1).unlink()
    assert run_gae(cfg, run, 1).metrics["kl/coef"] == 0.1


def test_a_retry_multiplier_whose_last_retry_leaves_any_sensible_range_is_refused_at_load():
    """trainer.retry_kl_coef_multiplier=1e200 was legal and overflowed the rewards at the first retry.
    (A huge retry_lr_divisor only stops learning: the guard's halt says so.)"""
    key = "trainer.retry_kl_coef_multiplier"
    with pytest.raises(ConfigError, match=rf"^{key}=1e\+200: its power trainer.max_rollbacks=2 .* would be "
                                          rf"10\^400, beyond 10\^6"):
        config(f"{key}=1e200")
    assert config(f"{key}=1000", "trainer.max_rollbacks=2").trainer.retry_kl_coef_multiplier == 1000
    config(f"{key}=1e200", "trainer.max_rollbacks=0")  # never applied


GAE_DEPTH_AT_MOST = 4
"""Frames from the gae stage's Prefect task to ``compute_gae`` (``call_path``): a ceiling that only comes
down (docs/architecture.md; the goal was 4)."""


def test_the_gae_task_reaches_compute_gae_within_its_ceiling(tmp_path, call_path):
    from rlhf_core.algos.advantage import compute_gae
    from tasks.stages import STAGE_TASKS

    run = RunDir(tmp_path / "run")
    write_scored(run, 1)
    path = call_path(compute_gae.__code__, lambda: STAGE_TASKS["gae"].fn(config(), str(run.root), 1, report=False))
    print(f"{len(path)} frames: " + " → ".join(path))
    assert len(path) <= GAE_DEPTH_AT_MOST, " → ".join(path)
