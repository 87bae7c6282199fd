"""KL guard stage: exact per-token KL, the verdict it writes and what settling it does (the lifecycle
itself: tests/rlhf_core/run/test_lifecycle.py)."""

from __future__ import annotations

import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlhf_core.run import lifecycle
from rlhf_core.stages import guard
from rlhf_core.scoring import policy_kl
from rlhf_core.config import load_config
from rlhf_core.config.reads import build
from rlhf_core.run.manifest import read_manifest, record_stage
from rlhf_core.run.lifecycle import read_last_good
from rlhf_core.run.layout import RunDir
from rlhf_core.run.session import RunSession


def _cfg(model_dir, *extra):
    return load_config(None, [f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.rollout.temperature=1.0",
                              *extra])


def _measure_kl(cfg, run):
    """Iteration 1's KL, measured with the settings the guard builds from ``cfg``."""
    session = RunSession()  # a CLI rerun's: the actor read from iter_1/checkpoint
    return guard.measure_kl(guard.guard_settings(cfg, run, 1, session), session, run, 1)


def _sequences(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs, plens = [], []
    for i in range(n):
        p = int(torch.randint(3, 9, (1,), generator=g))
        r = int(torch.randint(1, 7, (1,), generator=g))
        seqs.append(torch.randint(3, 500, (p + r,), generator=g).tolist())
        plens.append(p)
    return seqs, plens


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()


def _perturbed_copy(src, dst, scale):
    """A copy of the tiny model with every weight nudged by seeded noise of relative size ``scale``."""
    model = _load(src)
    g = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * (p.abs().mean() + 1e-3))
    model.save_pretrained(dst, safe_serialization=True)
    for f in src.glob("*token*"):
        shutil.copy(f, dst / f.name)
    return dst


# ---------------------------------------------------------------------------------------------
# measurement
# ---------------------------------------------------------------------------------------------


def test_response_kl_is_a_per_token_mean_over_all_responses():
    out = policy_kl.response_kl([[0.1, 0.3], [], [0.2]], sampled_k1=[[1.0, -1.0], [], [0.5]])
    assert out["kl_mean"] == pytest.approx(0.6 / 3)
    assert out["kl_seq_mean"] == pytest.approx((0.2 + 0.2) / 2)  # the empty response is not a row
    assert out["kl_max"] == pytest.approx(0.3)
    assert out["num_tokens"] == 3 and out["num_responses"] == 2
    assert out["kl_k1_sampled"] == pytest.approx(0.5 / 3)


def test_token_kl_is_zero_for_identical_models(tiny_model_dir):
    model = _load(tiny_model_dir)
    seqs, plens = _sequences()
    kls, _ = policy_kl.token_kl(model, model, seqs, plens, budget=64, temperature=1.0)
    assert all(t.shape == (len(s) - p,) for t, s, p in zip(kls, seqs, plens))
    assert max(float(t.abs().max()) for t in kls) == 0.0


@pytest.mark.parametrize("block_bytes", [None, 5 * 512 * 4])  # one head call each; blocks of 5 rows
def test_token_kl_matches_an_unpacked_loop(tiny_model_dir, tmp_path, monkeypatch, block_bytes):
    """Also with the heads run on row blocks (HEAD_CHUNK_BYTES: a real vocabulary's two (N, V) logits,
    their log-softmaxes and the product would be six full copies)."""
    from rlhf_core.models import packed as packed_module

    if block_bytes is not None:
        monkeypatch.setattr(packed_module, "HEAD_CHUNK_BYTES", block_bytes)
    actor = _load(_perturbed_copy(tiny_model_dir, tmp_path / "actor", scale=0.5))
    ref = _load(tiny_model_dir)
    seqs, plens = _sequences(seed=1)
    temperature = 0.7
    kls, sampled = policy_kl.token_kl(actor, ref, seqs, plens, budget=40, temperature=temperature)
    for seq, p, kl, lp in zip(seqs, plens, kls, sampled):
        ids = torch.tensor([seq])
        with torch.no_grad():
            la = torch.log_softmax(actor(ids).logits[0, p - 1:-1] / temperature, -1)
            lr = torch.log_softmax(ref(ids).logits[0, p - 1:-1] / temperature, -1)
        expected = (la.exp() * (la - lr)).sum(-1)
        torch.testing.assert_close(kl, expected.clamp_min(0), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(lp, la.gather(-1, ids[0, p:, None]).squeeze(-1), atol=1e-5, rtol=1e-4)
    assert min(float(t.min()) for t in kls) >= 0.0
    assert sum(float(t.sum()) for t in kls) > 0.0


# ---------------------------------------------------------------------------------------------
# a run directory with one scored iteration and a trained actor
# ---------------------------------------------------------------------------------------------


def _scored_run(tmp_path, tiny_model_dir, actor_scale):
    """iter_1 with scored.parquet (ref log-probs from the tiny model) and a checkpoint whose actor is
    the tiny model perturbed by ``actor_scale`` (0 = identical)."""
    run = RunDir(tmp_path / "run")
    seqs, plens = _sequences(n=8, seed=2)
    ref = _load(tiny_model_dir)
    from rlhf_core.scoring import compute_token_logprobs

    ref_lp = compute_token_logprobs(ref, seqs, plens, budget=64, temperature=1.0)
    table = pa.table({
        "prompt_token_ids": [s[:p] for s, p in zip(seqs, plens)],
        "response_token_ids": [s[p:] for s, p in zip(seqs, plens)],
        "ref_log_probs": [t.tolist() for t in ref_lp],
    })
    run.iter_dir(1).mkdir(parents=True)
    pq.write_table(table, run.scored(1))
    return _trained(run, tiny_model_dir, actor_scale)


def _trained(run, tiny_model_dir, actor_scale):
    """iter_1's checkpoint: the tiny model perturbed by ``actor_scale`` (0 = identical), with gae and
    update recorded as done."""
    actor_dir = run.checkpoint(1) / "actor"
    actor_dir.parent.mkdir(parents=True)
    if actor_scale:
        _perturbed_copy(tiny_model_dir, actor_dir, actor_scale)
    else:
        shutil.copytree(tiny_model_dir, actor_dir)
    (run.checkpoint(1) / "trainer_state.json").write_text("{}")
    for stage in ("gae", "update"):
        record_stage(run, 1, stage, status="done", inputs={}, outputs={}, config_hash="x", metrics={})
    return run


def test_guard_commits_an_unchanged_actor(tmp_path, tiny_model_dir):
    run = _scored_run(tmp_path, tiny_model_dir, actor_scale=0.0)
    cfg = _cfg(tiny_model_dir)
    result = guard.run_guard(cfg, run, 1)
    verdict = lifecycle.read_verdict(run, 1)
    assert verdict["decision"] == "commit" and verdict["kl_mean"] == 0.0
    assert result.metrics["guard/kl_mean"] == 0.0 and result.metrics["guard/breach"] == 0.0
    lifecycle.commit_iteration(run, 1)
    assert read_last_good(run)["iteration"] == 1
    assert lifecycle.committed_iterations(run) == [1]
    assert "committed" not in read_manifest(run, 1)["guard"]  # the commit log is the only record of it
    assert [e["kind"] for e in run.events()] == ["commit"]
    lifecycle.commit_iteration(run, 1)  # idempotent: no second event
    assert [e["kind"] for e in run.events()] == ["commit"]
    assert guard.run_guard(cfg, run, 1).skipped  # same inputs and config


def test_guard_rolls_back_a_drifted_actor(tmp_path, tiny_model_dir):
    run = _scored_run(tmp_path, tiny_model_dir, actor_scale=2.0)
    cfg = _cfg(tiny_model_dir, "trainer.kl_rollback_threshold=0.01")
    guard.run_guard(cfg, run, 1)
    verdict = lifecycle.read_verdict(run, 1)
    assert verdict["kl_mean"] > 0.01 and verdict["decision"] == "rollback"

    assert lifecycle.discard_checkpoint(run, 1) is True
    event = lifecycle.rollback_iteration(run, 1, policy="halt", attempt=1)
    assert not run.checkpoint(1).exists()
    assert not list(run.iter_dir(1).glob("checkpoint*"))  # no leftover of the rename either
    statuses = {s: r["status"] for s, r in read_manifest(run, 1).items()}
    assert statuses == {"gae": "rolled_back", "update": "rolled_back", "guard": "rolled_back"}
    assert event["kind"] == "rollback" and event["kl"] == pytest.approx(verdict["kl_mean"])
    assert lifecycle.rollback_count(run, 1) == 1
    assert "rlhf run --resume" in lifecycle.halt_message(run, 1, "trainer.on_kl_breach=halt")
    assert lifecycle.discard_checkpoint(run, 1) is False  # idempotent


@pytest.mark.deepspeed  # torchrun processes: the slow lane
def test_guard_on_two_processes_measures_the_one_process_kl(tmp_path, tiny_model_dir):
    """trainer.stage_processes=2: each process measures its micro-batches of the one-process plan;
    the KL metrics are the one-process metrics bit for bit."""
    run = _scored_run(tmp_path, tiny_model_dir, actor_scale=0.5)
    budget = ["actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=32"]  # several micro-batches
    one = _measure_kl(_cfg(tiny_model_dir, *budget), run)
    two = _measure_kl(_cfg(tiny_model_dir, *budget, "trainer.stage_processes=2"), run)
    assert one["kl_mean"] > 0 and two == one
    assert not run.stage_ranks_dir(1, "guard").exists()


def _val_prompts(run, tokenizer_dir, n=3):
    from transformers import AutoTokenizer

    from rlhf_core.data import schemas
    from rlhf_core.io.atomic import atomic_write_parquet

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    rows = []
    for i in range(n):
        text = tok.apply_chat_template([{"role": "user", "content": f"What is {i} + {i}?"}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok(text)["input_ids"]
        rows.append({"prompt_id": f"v{i}", "data_source": "arith", "prompt": [{"role": "user", "content": text}],
                     "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
                     "extra_info": None, "prompt_text": text, "prompt_token_ids": ids, "prompt_length": len(ids)})
    atomic_write_parquet(run.val_prompts, pa.Table.from_pylist(rows, schema=schemas.PROMPTS), schema=schemas.PROMPTS)


def test_guard_on_validation_prompts_samples_from_the_new_actor(tmp_path, tiny_model_dir):
    run = _scored_run(tmp_path, tiny_model_dir, actor_scale=2.0)
    _val_prompts(run, tiny_model_dir)
    session = RunSession()
    off = guard.guard_settings(_cfg(tiny_model_dir, "data.max_response_length=8"), run, 1, session)
    assert off.validation is None  # trainer.kl_guard_val_prompts=0: no generation
    assert guard.measure_val_kl(off, session, run, 1) == {}
    checked = ("data.max_response_length=8", "trainer.kl_guard_val_prompts=2", "trainer.kl_rollback_threshold=1000",
               "trainer.device=cpu")
    cfg = _cfg(tiny_model_dir, *checked)
    val = guard.measure_val_kl(guard.guard_settings(cfg, run, 1, session), session, run, 1)
    assert val["val_kl_mean"] > 0 and 2 <= val["val_kl_tokens"] <= 16
    guard.run_guard(cfg, run, 1)
    verdict = lifecycle.read_verdict(run, 1)
    assert verdict["val_kl_mean"] == pytest.approx(val["val_kl_mean"]) and verdict["decision"] == "commit"
    # the check samples at the rollout's settings: changing them reruns the guard; without it they are not hashed
    resampled = _cfg(tiny_model_dir, *checked, "actor_rollout_ref.rollout.top_k=3")
    assert not guard.run_guard(resampled, run, 1).skipped
    assert guard.run_guard(resampled, run, 1).skipped
    assert "actor_rollout_ref.rollout." not in guard.config_sections(_cfg(tiny_model_dir, "data.max_response_length=8"))


@pytest.mark.parametrize("verdict, shown", [
    ({"kl_mean": 0.00031, "threshold": 0.0003}, "KL(actor‖ref) = 0.00031 > trainer.kl_rollback_threshold = 0.0003 ("),
    ({"kl_mean": 0.0000123401, "threshold": 0.00001234}, "= 1.23401e-05 > trainer.kl_rollback_threshold = 1.234e-05 ("),
    ({"kl_mean": 0.01, "val_kl_mean": 0.0503, "threshold": 0.05},
     "KL(actor‖ref) on validation prompts = 0.0503 > trainer.kl_rollback_threshold = 0.05 ("),
])
def test_the_halt_line_never_rounds_the_kl_onto_the_threshold(tmp_path, verdict, shown):
    """Issue 29: the halt line read "KL = 0.0003 > threshold = 0.0003"; it shows as many digits as
    tell the two apart, and the KL that breached (the validation prompts' when theirs did)."""
    from rlhf_core.io.atomic import atomic_write_json

    run = RunDir(tmp_path / "run")
    atomic_write_json(run.verdict(1), {"iteration": 1, "decision": "rollback", **verdict})
    assert shown in lifecycle.halt_message(run, 1, "trainer.on_kl_breach=halt")


# ---------------------------------------------------------------------------------------------
# the sampled estimator (trainer.kl_guard_estimator=sampled): one actor pass
# ---------------------------------------------------------------------------------------------

def test_importance_weighted_kl_averages_to_the_exact_kl_over_the_old_policys_draws():
    """Weighting each possible token by p_old gives exactly Σ_v p_new (log p_new − log p_ref)."""
    g = torch.Generator().manual_seed(0)
    p_old, p_new, p_ref = (torch.log_softmax(torch.randn(50, generator=g, dtype=torch.float64), 0) for _ in range(3))
    every_token = policy_kl.importance_weighted_kl([p_new], [p_old], [p_ref])[0]  # one "draw" per vocab entry
    assert (every_token >= 0).all()
    expected = float((p_new.exp() * (p_new - p_ref)).sum())
    assert float((p_old.exp() * every_token).sum()) == pytest.approx(expected, rel=1e-12)


def _sampled_run(tmp_path, tiny_model_dir, actor_scale, n=48, new_tokens=12):
    """iter_1 with responses really sampled from the tiny model (the old policy and the reference),
    their old and reference log-probs stored as the score stage stores them, and a perturbed actor."""
    from rlhf_core.rollout.base import SamplingParams
    from rlhf_core.rollout.hf import HFEngine
    from rlhf_core.scoring import compute_token_logprobs

    run = RunDir(tmp_path / "run")
    prompts = [[5 + i % 7, 9 + i % 5, 20 + i % 11, 31] for i in range(n)]
    samples = HFEngine(tiny_model_dir).generate(prompts, SamplingParams(max_new_tokens=new_tokens, n=1, seed=4))
    seqs = [p + s.token_ids for p, s in zip(prompts, samples)]
    plens = [len(p) for p in prompts]
    ref_lp = compute_token_logprobs(_load(tiny_model_dir), seqs, plens, budget=4096, temperature=1.0)
    pq.write_table(pa.table({"prompt_token_ids": prompts, "response_token_ids": [s.token_ids for s in samples],
                             "ref_log_probs": [t.tolist() for t in ref_lp],
                             "old_log_probs": [t.tolist() for t in ref_lp]}),
                   (run.iter_dir(1).mkdir(parents=True), run.scored(1))[1])
    return _trained(run, tiny_model_dir, actor_scale)


def test_the_sampled_guard_estimates_the_exact_kl_and_still_rolls_back(tmp_path, tiny_model_dir):
    run = _sampled_run(tmp_path, tiny_model_dir, actor_scale=1.0)
    exact = _measure_kl(_cfg(tiny_model_dir), run)
    sampled = _measure_kl(_cfg(tiny_model_dir, "trainer.kl_guard_estimator=sampled"), run)
    assert sampled["estimator"] == "sampled" and sampled["num_tokens"] == exact["num_tokens"]
    assert exact["kl_mean"] > 0.01
    assert sampled["kl_mean"] == pytest.approx(exact["kl_mean"], rel=0.25)  # one draw per position, 500+ tokens
    assert sampled["kl_k1_sampled"] == pytest.approx(exact["kl_k1_sampled"], rel=1e-5)  # the same actor log-probs

    cfg = _cfg(tiny_model_dir, "trainer.kl_guard_estimator=sampled",
               f"trainer.kl_rollback_threshold={sampled['kl_mean'] / 2}")
    result = guard.run_guard(cfg, run, 1)
    assert lifecycle.read_verdict(run, 1)["decision"] == "rollback" and result.metrics["guard/breach"] == 1.0
    assert "(sampled estimate)" in result.summary[0]


def test_the_sampled_guard_measures_zero_for_an_unchanged_actor(tmp_path, tiny_model_dir):
    run = _sampled_run(tmp_path, tiny_model_dir, actor_scale=0.0, n=6)
    kl = _measure_kl(_cfg(tiny_model_dir, "trainer.kl_guard_estimator=sampled"), run)
    assert kl["kl_mean"] == pytest.approx(0.0, abs=1e-6) and kl["kl_max"] == pytest.approx(0.0, abs=1e-6)


def test_the_exact_guard_runs_only_the_references_lm_head_on_the_states_scoring_kept(tmp_path, tiny_model_dir):
    """After the score stage's reference pass in this session (``scoring.ref_states``) the guard measures
    the same exact KL with the reference's LM head alone; its floor counts that head, not a forward."""
    from rlhf_core.scoring import compute_token_logprobs, ref_states

    run = _scored_run(tmp_path, tiny_model_dir, actor_scale=0.5)
    cfg = _cfg(tiny_model_dir, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=64")
    scored = pq.read_table(run.scored(1)).to_pylist()
    seqs = [r["prompt_token_ids"] + r["response_token_ids"] for r in scored]
    plens = [len(r["prompt_token_ids"]) for r in scored]
    settings = build(guard.kl_pass, cfg)
    session = RunSession()
    forward = guard.run_guard(cfg, run, 1, force=True, session=session).metrics
    assert forward["perf/guard_reference_states_kept"] == 0.0
    with session.ref_states.recording(tiny_model_dir, settings.dtype, settings.attention) as record:  # as scoring does
        states = {}
        compute_token_logprobs(_load(tiny_model_dir), seqs, plens, budget=settings.ref_budget, head_inputs=states)
        ref_states.keep(record, seqs, plens, states)
    kept = guard.run_guard(cfg, run, 1, force=True, session=session).metrics
    assert kept["perf/guard_reference_states_kept"] == 1.0
    assert guard.run_guard(cfg, run, 1, force=True).metrics["perf/guard_reference_states_kept"] == 0.0  # another session
    assert kept["guard/kl_mean"] == forward["guard/kl_mean"] > 1e-3  # the same reference arithmetic, bit for bit
    assert kept["perf/stage_flops/guard"] < forward["perf/stage_flops/guard"]
    assert kept["perf/stage_floor_seconds/guard"] > 0
