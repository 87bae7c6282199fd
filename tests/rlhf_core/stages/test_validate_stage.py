"""Validation: verl's val-core / val-aux statistics against plain loops, and the validate stage on
the real tiny model decoding as actor_rollout_ref.rollout.val_kwargs says (greedy by default)."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from rlhf_core.stages import validate
from rlhf_core.config import load_config
from rlhf_core.run.layout import RunDir


def test_one_response_per_prompt_gives_mean_at_1_per_data_source():
    metrics = validate.validation_metrics(["a", "a", "b"], ["p1", "p2", "p3"], {"reward": [1.0, 0.0, 0.5]})
    assert metrics == {"val-core/a/reward/mean@1": 0.5, "val-core/b/reward/mean@1": 0.5}


def test_n_responses_split_core_and_aux_as_verl_does():
    rng = np.random.default_rng(0)
    n, prompts = 4, 50
    scores = rng.integers(0, 2, size=(prompts, n)).astype(float)  # (prompts, n) 0/1 rewards
    ids = [f"p{i}" for i in range(prompts) for _ in range(n)]
    metrics = validate.validation_metrics(["s"] * len(ids), ids, {"reward": scores.ravel().tolist()})
    core = {k for k in metrics if k.startswith("val-core/")}
    assert core == {"val-core/s/reward/mean@4", "val-core/s/reward/best@4/mean", "val-core/s/reward/best@4/std"}
    assert {"val-aux/s/reward/std@4", "val-aux/s/reward/best@2/mean", "val-aux/s/reward/worst@4/mean",
            "val-aux/s/reward/worst@2/std"} <= set(metrics)
    # mean@n / std@n: each prompt's statistic, then the mean over prompts (plain loop)
    assert metrics["val-core/s/reward/mean@4"] == pytest.approx(sum(row.mean() for row in scores) / prompts)
    assert metrics["val-aux/s/reward/std@4"] == pytest.approx(sum(row.std() for row in scores) / prompts)
    # best@k of k draws with replacement from a prompt with share p correct: 1 - (1 - p)^k in expectation
    p = scores.mean(axis=1)
    for k in (2, 4):
        assert metrics[f"val-aux/s/reward/best@{k}/mean" if k == 2 else "val-core/s/reward/best@4/mean"] == \
            pytest.approx(np.mean(1 - (1 - p) ** k), abs=0.02)
        assert metrics[f"val-aux/s/reward/worst@{k}/mean"] == pytest.approx(np.mean(p ** k), abs=0.02)


def test_acc_is_the_core_variable_when_the_reward_function_returns_it():
    variables = validate.score_variables([1.0, 0.0], [{"acc": True, "pred": "7"}, {"acc": False, "pred": "3"}])
    assert set(variables) == {"reward", "acc"}  # 'pred' is a string: not a score variable
    metrics = validate.validation_metrics(["s", "s"], ["p", "q"], variables)
    assert metrics["val-core/s/acc/mean@1"] == 0.5 and metrics["val-aux/s/reward/mean@1"] == 0.5


QUESTIONS = {"What is 3 + 4?": "7", "What is 12 - 7?": "5", "Tom has 5 apples and eats 2. How many are left?": "3",
             "What is 2 + 2?": "4"}


@pytest.fixture(scope="module")
def val_run(tmp_path_factory, tiny_model_dir):
    """A run directory holding only prompts/val.parquet (what the validate stage reads), tokenized
    with the tiny model's chat template as preprocess does."""
    import pyarrow as pa
    from transformers import AutoTokenizer

    from rlhf_core.data.schemas import PROMPTS
    from rlhf_core.io.atomic import atomic_write_parquet

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = []
    for i, (question, answer) in enumerate(QUESTIONS.items()):
        messages = [{"role": "user", "content": question}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        rows.append({"prompt_id": f"q{i}", "data_source": "openai/gsm8k", "reward_source": "openai/gsm8k",
                     "prompt": messages, "ability": "math",
                     "reward_model": {"style": "rule", "ground_truth": answer}, "extra_info": None,
                     "prompt_text": text, "prompt_token_ids": ids, "prompt_length": len(ids)})
    run = RunDir(tmp_path_factory.mktemp("val") / "run")
    atomic_write_parquet(run.val_prompts, pa.Table.from_pylist(rows, schema=PROMPTS), schema=PROMPTS)
    overrides = [f"actor_rollout_ref.model.path={tiny_model_dir}", "data.max_response_length=8", "trainer.device=cpu"]
    return run, overrides


def _validate(run: RunDir, overrides: list[str], k: int, *extra: str):
    cfg = load_config(None, [*overrides, *extra])
    result = validate.run_validate(cfg, run, k)
    return result, pq.read_table(run.validation(k)).to_pylist()


def test_validation_is_greedy_by_default_with_n_identical_responses(val_run):
    run, overrides = val_run
    result, rows = _validate(run, overrides, 0, "actor_rollout_ref.rollout.val_kwargs.n=2")
    assert len(rows) == 8 and [r["sample_index"] for r in rows[:2]] == [0, 1]
    assert all(a["response_text"] == b["response_text"] for a, b in zip(rows[::2], rows[1::2]))
    m = result.metrics
    assert m["val/num_prompts"] == 4 and m["val/num_responses"] == 8
    assert m["val-core/openai/gsm8k/reward/mean@2"] == pytest.approx(m["val/reward_mean"])
    # a different seed changes nothing when greedy
    _, again = _validate(run, overrides, 1, "actor_rollout_ref.rollout.val_kwargs.n=2",
                         "actor_rollout_ref.rollout.seed=123")
    assert [r["response_text"] for r in again] == [r["response_text"] for r in rows]


def test_sampled_validation_follows_val_kwargs(val_run):
    run, overrides = val_run
    sampled = ["actor_rollout_ref.rollout.val_kwargs.do_sample=true", "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
               "actor_rollout_ref.rollout.val_kwargs.n=3"]
    _, rows = _validate(run, overrides, 2, *sampled)
    texts = [r["response_text"] for r in rows]
    assert len(rows) == 12 and len(set(texts)) > 4  # 3 draws per prompt at temperature 1 differ


@pytest.mark.deepspeed  # torchrun processes: the slow lane
def test_validation_on_two_processes_equals_one_process(val_run):
    """trainer.stage_processes=2: the generation batches are dealt to two processes, each seeded
    as in one process: the same validation table (sampled, so a seed mix-up would show)."""
    run, overrides = val_run
    sampled = ["actor_rollout_ref.rollout.val_kwargs.do_sample=true", "actor_rollout_ref.rollout.val_kwargs.n=3",
               "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
               "actor_rollout_ref.rollout.generation_batch_tokens=150"]  # several batches of the 4 prompts
    from rlhf_core.rollout.generate import generation_plan, validation_sampling
    from rlhf_core.stages.settings import generation
    from rlhf_core.config.reads import build

    cfg = load_config(None, [*overrides, *sampled])
    assert len(generation_plan(cfg.actor_rollout_ref.rollout, pq.read_table(run.val_prompts).to_pylist(),
                               validation_sampling(build(generation, cfg), seed=0))) >= 2
    one_result, one = _validate(run, overrides, 3, *sampled)
    two_result = validate.run_validate(load_config(None, [*overrides, *sampled, "trainer.stage_processes=2"]), run, 3,
                                       force=True)  # the process count is not in the config hash: same outputs
    two = pq.read_table(run.validation(3)).to_pylist()
    assert not two_result.skipped and two == one and len(one) == 12
    assert two_result.metrics == one_result.metrics
    assert not run.stage_ranks_dir(3, "validate").exists()


def test_rewards_are_routed_by_the_reward_fn_key_column(val_run, tmp_path):
    """As in the score stage (verl's reward manager): compute_score gets the data.reward_fn_key
    column's value, which preprocess records as reward_source."""
    import pyarrow as pa

    from rlhf_core.config import ConfigError
    from rlhf_core.data.schemas import PROMPTS
    from rlhf_core.io.atomic import atomic_write_parquet

    run, overrides = val_run
    routed = RunDir(tmp_path / "routed")
    prompts = pq.read_table(run.val_prompts)
    column = prompts.schema.get_field_index("reward_source")
    atomic_write_parquet(routed.val_prompts, prompts.set_column(column, "reward_source", prompts.column("ability")),
                         schema=PROMPTS)  # as preprocess writes it for data.reward_fn_key=ability
    seen = tmp_path / "seen.txt"
    fn = tmp_path / "my_reward.py"
    fn.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                  f"    open({str(seen)!r}, 'a').write(str(data_source) + '\\n')\n    return 1.0\n")
    result, _ = _validate(routed, overrides, 3, "data.reward_fn_key=ability", f"custom_reward_function.path={fn}")
    assert set(seen.read_text().split()) == {"math"} and result.metrics["val/accuracy"] == 1.0
    atomic_write_parquet(routed.val_prompts, prompts.set_column(column, "reward_source", pa.nulls(len(prompts), pa.string())),
                         schema=PROMPTS)
    with pytest.raises(ConfigError, match="data.reward_fn_key='nope'"):
        _validate(routed, overrides, 4, "data.reward_fn_key=nope")


@pytest.mark.parametrize("correct, n, low, high", [(0, 256, 0.0, 0.0148), (128, 256, 0.4392, 0.5608),
                                                   (256, 256, 0.9852, 1.0), (3, 10, 0.1078, 0.6032)])
def test_the_accuracy_interval_is_wilsons(correct, n, low, high):
    """The 95 % Wilson score interval (tabulated values): inside [0, 1], not empty at 0 or n successes."""
    assert validate.wilson_interval(correct, n) == pytest.approx((low, high), abs=1e-4)


def test_no_responses_give_the_whole_interval():
    assert validate.wilson_interval(0, 0) == (0.0, 1.0)


def _warm_started(cfg, source) -> None:
    """Put ``source`` where the config's warm start is looked up, as a finished warm start (its record
    file), so iteration 0's actor is that model and model.path stays the base."""
    import shutil

    from rlhf_core.run.models import warm_start_path

    target = warm_start_path(cfg.actor_rollout_ref.model, cfg.data)
    shutil.copytree(source, target)
    (target / "warm_start.json").write_text("{}")


def test_with_the_warm_start_on_the_base_model_is_validated_beside_the_initial_policy(val_run, chat_models):
    """k = 0: the warm-started policy as always, and model.path (the model before the SFT) into
    iter_0/validation_base.parquet under val_base/*, each with its interval; the base model's
    responses are the ones a plain validation of model.path gives."""
    run, overrides = val_run
    on = [*overrides, "actor_rollout_ref.model.warm_start.enable=true"]
    cfg = load_config(None, on)
    _warm_started(cfg, chat_models["tiny"])  # the "fine-tuned" policy: the tiny model taught to answer and stop
    result = validate.run_validate(cfg, run, 0, force=True)
    base_rows = pq.read_table(run.base_validation()).to_pylist()
    policy_rows = pq.read_table(run.validation(0)).to_pylist()
    m = result.metrics
    assert {"val_base/accuracy", "val_base/accuracy_ci_low", "val_base/accuracy_ci_high",
            "val/accuracy_ci_low"} <= set(m)
    assert m["val_base/accuracy_ci_low"] <= m["val_base/accuracy"] <= m["val_base/accuracy_ci_high"]
    assert not any(k.startswith("val_base/") and "val-core" in k for k in m)  # verl's names stay the policy's
    assert [r["response_text"] for r in base_rows] != [r["response_text"] for r in policy_rows]
    _, plain = _validate(run, overrides, 0, "trainer.val_base_model=true")  # warm start off: model.path itself
    assert [r["response_text"] for r in base_rows] == [r["response_text"] for r in plain]
    assert any("before the warm start" in line for line in result.summary)


def test_the_base_model_is_validated_only_at_step_0_and_when_asked(val_run):
    run, overrides = val_run
    cfg = load_config(None, [*overrides, "actor_rollout_ref.model.warm_start.enable=true"])
    model, trainer = cfg.actor_rollout_ref.model, cfg.trainer
    assert validate.base_model_validated(model, trainer, 0) is not None
    assert validate.base_model_validated(model, trainer, 1) is None
    off = load_config(None, [*overrides, "actor_rollout_ref.model.warm_start.enable=true", "trainer.val_base_model=false"])
    assert validate.base_model_validated(off.actor_rollout_ref.model, off.trainer, 0) is None
    plain = load_config(None, overrides)
    assert validate.base_model_validated(plain.actor_rollout_ref.model, plain.trainer, 0) is None
