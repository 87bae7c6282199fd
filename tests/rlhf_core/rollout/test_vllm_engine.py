"""The vllm engine on a real vLLM: the CPU build (`make test-vllm`) or CUDA. Generation (samples,
seeds, finish reasons, the log-probs it sampled with, the trainer's dtype, progress bars that follow
the run's setting), and the resident engine's weights in place: checked name by name before a byte
moves, exact afterwards (log-probs equal the trainer's), pause and resume. Without vLLM the module
skips, saying why (the default suite has no vLLM); the one test that measures GPU memory skips on CPU."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.errors import RLHFError
from rlhf_core.rollout.base import FINISH_LENGTH, FINISH_STOP, SamplingParams
from rlhf_core.rollout.vllm_engine import VLLMEngine, vllm_unavailable_reason
from rlhf_core.rollout.weight_sync import probe_tokens, trainer_log_probs

REASON = vllm_unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"needs vLLM: {REASON}")

QUESTIONS = ["What is 3 + 4?", "Tom has 5 apples and eats 2. How many are left?", "What is 12 - 7?"]


@pytest.fixture(scope="module")
def engine(vllm_model_dir):
    eng = VLLMEngine(vllm_model_dir, dtype="fp32", max_model_len=512, seed=0)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def resident(vllm_model_dir):
    eng = VLLMEngine(vllm_model_dir, dtype="fp32", max_model_len=512, seed=0, resident=True)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def prompts(engine):
    texts = engine.tokenizer.apply_chat_template([[{"role": "user", "content": q}] for q in QUESTIONS],
                                                 tokenize=False, add_generation_prompt=True)
    return engine.tokenizer(texts, add_special_tokens=False)["input_ids"]


def trainer(model_dir, scale: float = 0.0, seed: int = 0):
    """The model as a trainer holds it (fp32 module), its weights moved by ``scale`` × noise."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * p.float().std() * torch.randn(p.shape, generator=g))
    return model


def draws(eng, prompts) -> list[list[int]]:
    """Seeded samples: the same weights give the same tokens, other weights others (the random tiny
    model's greedy output is one token repeated, which a small change of weights leaves as it is)."""
    return [s.token_ids for s in eng.generate(prompts, SamplingParams(max_new_tokens=16, n=2, seed=11))]


# --- generation ------------------------------------------------------------------------------------

@pytest.mark.parametrize("sampling", [
    SamplingParams(max_new_tokens=16, n=3, seed=5),
    SamplingParams(max_new_tokens=16, n=2, seed=5, temperature=0.7, top_k=20, top_p=0.9),
    SamplingParams(max_new_tokens=16, greedy=True),
], ids=["plain", "temperature-top_k-top_p", "greedy"])
def test_samples_in_order_with_finish_reasons_and_the_log_probs_they_were_drawn_with(
        engine, prompts, vllm_model_dir, processed_log_probs, sampling):
    samples = engine.generate(prompts, sampling)
    n = sampling.n
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(p, j) for p in range(3) for j in range(n)]
    for s in samples:
        assert 1 <= len(s.token_ids) <= 16 and s.finish_reason in (FINISH_STOP, FINISH_LENGTH)
        if s.finish_reason == FINISH_STOP:
            assert s.token_ids[-1] in engine.eos_ids
        else:
            assert len(s.token_ids) == 16 and not set(engine.eos_ids) & set(s.token_ids)
        assert s.text == engine.tokenizer.decode(s.token_ids, skip_special_tokens=True)
        # vLLM's processed log-probs (temperature, top-k, top-p applied) are transformers' at fp32
        expected = processed_log_probs(vllm_model_dir, prompts[s.prompt_index], s.token_ids, sampling)
        torch.testing.assert_close(torch.tensor(s.log_probs), expected, atol=1e-4, rtol=0)
    if not sampling.greedy:
        assert len({tuple(s.token_ids) for s in samples if s.prompt_index == 0}) > 1


def test_same_seed_same_responses_and_a_share_samples_what_the_whole_would(engine, prompts):
    sampling = SamplingParams(max_new_tokens=16, n=2, seed=7)
    first = engine.generate(prompts, sampling)
    engine.generate(prompts, SamplingParams(max_new_tokens=16, n=2, seed=8))
    again = engine.generate(prompts, sampling)
    assert [s.token_ids for s in first] == [s.token_ids for s in again]
    other = engine.generate(prompts, SamplingParams(max_new_tokens=16, n=2, seed=9))
    assert [s.token_ids for s in first] != [s.token_ids for s in other]
    # prompts 2 and 0 alone, seeded by their places in the whole: the whole's samples for them
    share = engine.generate([prompts[2], prompts[0]], sampling, seed_indices=[2, 0])
    assert [s.token_ids for s in share] == [s.token_ids for s in first if s.prompt_index == 2] + \
        [s.token_ids for s in first if s.prompt_index == 0]


def test_greedy_and_top_k_1_agree(engine, prompts):
    top1 = engine.generate(prompts, SamplingParams(max_new_tokens=12, top_k=1, seed=3))
    argmax = engine.generate(prompts, SamplingParams(max_new_tokens=12, greedy=True))
    assert [s.token_ids for s in top1] == [s.token_ids for s in argmax]


def test_the_engine_runs_at_the_trainers_dtype(engine, vllm_model_dir):
    """vLLM's dtype="auto" would run this fp32 checkpoint at bf16 on these CPUs; the engine is told
    the trainer's dtype, and its log-probs are the fp32 trainer's to float precision."""
    assert engine.llm.llm_engine.model_config.dtype == torch.float32
    probe = probe_tokens(512)
    gap = (torch.tensor(engine.prompt_log_probs(probe)) - trainer_log_probs(trainer(vllm_model_dir), probe)).abs()
    assert gap.max() < 1e-5
    with pytest.raises(RLHFError, match="dtype must be one of fp32, bf16, fp16"):
        VLLMEngine(vllm_model_dir, dtype="auto")


def test_progress_bars_follow_the_runs_setting(engine, prompts, monkeypatch, capsys):
    """`rlhf run` sets TQDM_DISABLE=1 (before tqdm is imported, where tqdm itself honours it): vLLM's
    bar, forced on, then divided by the disabled bar's elapsed time (ZeroDivisionError on the first
    generate; tests/flows/test_vllm_flow.py runs that case). The engine asks for a bar only when the
    console is not quiet."""
    monkeypatch.setenv("TQDM_DISABLE", "1")
    assert len(engine.generate(prompts, SamplingParams(max_new_tokens=4, seed=1))) == 3
    assert "Processed prompts" not in capsys.readouterr().err
    monkeypatch.delenv("TQDM_DISABLE")
    assert len(engine.generate(prompts, SamplingParams(max_new_tokens=4, seed=1))) == 3
    assert "Processed prompts" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="vLLM's CPU attention kernels")
def test_the_head_sizes_config_load_checks_are_this_vllms(tiny_model_dir):
    """Config load keeps vLLM's CPU head-size list (importing vLLM to ask takes seconds); the engine
    asks this vLLM, and refuses the default tiny model (head size 16) before it starts, in one line."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from rlhf_core.config.machine import VLLM_CPU_HEAD_SIZES

    assert list(VLLM_CPU_HEAD_SIZES) == CPUAttentionBackend.get_supported_head_sizes()
    with pytest.raises(RLHFError, match=r"attention head size 16 \(hidden_size 64 / 4 heads\).* takes 32, 64, 80"):
        VLLMEngine(tiny_model_dir, dtype="fp32")


def test_vllm_rejects_temperatures_it_cannot_take(engine, prompts):
    with pytest.raises(RLHFError, match="actor_rollout_ref.rollout.temperature"):
        engine.generate(prompts, SamplingParams(temperature=3.0))


def test_a_plain_engine_refuses_resident_calls(engine):
    with pytest.raises(RLHFError, match="resident=True"):
        engine.sleep()
    with pytest.raises(RLHFError, match="resident=True"):
        engine.load_weights([("model.norm.weight", torch.ones(64))])


def test_torch_threads_stay_this_process_s_after_an_engine_started(engine):
    """A CPU worker replaces torch.set_num_threads with a no-op and drops the process to one thread;
    the trainer that shares the process must keep its own setting."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


# --- the resident engine: weights in place ----------------------------------------------------------

def test_sync_from_the_trainer_is_exact_and_moves_what_it_samples(resident, prompts, vllm_model_dir,
                                                                processed_log_probs, tmp_path):
    base = draws(resident, prompts)
    moved = trainer(vllm_model_dir, scale=0.5)
    metrics = resident.sync_from(moved)  # tied embeddings: the LM head's packed copy is rebuilt too
    assert metrics["rollout/weight_sync_logprob_max_diff"] < 1e-5 and metrics["perf/rollout_weight_sync_seconds"] > 0
    assert draws(resident, prompts) != base
    sampling = SamplingParams(max_new_tokens=12, n=2, seed=4, temperature=0.8)
    moved.save_pretrained(tmp_path / "moved")
    for s in resident.generate(prompts, sampling):  # sampled from the new weights, and says so
        expected = processed_log_probs(tmp_path / "moved", prompts[s.prompt_index], s.token_ids, sampling)
        torch.testing.assert_close(torch.tensor(s.log_probs), expected, atol=1e-4, rtol=0)
    resident.sync_from(trainer(vllm_model_dir))  # the original weights back: the first output exactly
    assert draws(resident, prompts) == base


def test_a_mismatch_is_refused_before_a_byte_moves_and_the_engine_keeps_its_weights(resident, prompts,
                                                                                   vllm_model_dir):
    """vLLM's reload raises halfway through on a name its model lacks and leaves a broken engine;
    here every name and shape is checked first."""
    base = draws(resident, prompts)
    moved = list(trainer(vllm_model_dir, scale=0.5).named_parameters())  # would change the output if written
    with pytest.raises(RLHFError, match=r"nothing written.*1 name\(s\) it does not have \(v_head.weight\)"):
        resident.load_weights(moved + [("v_head.weight", torch.ones(1, 64))])
    assert draws(resident, prompts) == base
    cut = [(n, p[:, :32] if n == "model.embed_tokens.weight" else p) for n, p in moved]
    with pytest.raises(RLHFError, match=r"1 shape\(s\) that differ \(model.embed_tokens.weight"):
        resident.load_weights(cut)
    assert draws(resident, prompts) == base


def test_pause_resume_and_a_checkpoint_from_disk(resident, prompts, vllm_model_dir, tmp_path):
    base = draws(resident, prompts)
    freed = resident.sleep()
    assert resident.asleep and (freed is None) == resident.cpu  # CPU: paused, nothing to free
    with pytest.raises(RLHFError, match="asleep: call wake_up"):
        resident.generate(prompts, SamplingParams(greedy=True))
    resident.sleep()  # idempotent
    resident.wake_up()
    assert not resident.asleep and draws(resident, prompts) == base
    moved = trainer(vllm_model_dir, scale=0.5, seed=3)
    moved.save_pretrained(tmp_path / "older")
    resident.sleep()
    assert resident.load_model_dir(tmp_path / "older") == 26 and not resident.asleep  # loading wakes it
    probe = probe_tokens(512)
    gap = (torch.tensor(resident.prompt_log_probs(probe)) - trainer_log_probs(moved, probe)).abs().max()
    assert gap < 1e-5
    resident.load_model_dir(vllm_model_dir)
    assert draws(resident, prompts) == base


@pytest.mark.skipif(not torch.cuda.is_available(), reason="measures GPU memory freed by sleep mode (CPU: nothing "
                                                          "is freed, checked in test_pause_resume...)")
def test_sleep_frees_gpu_memory_and_wake_up_generates_the_same(vllm_model_dir, prompts):  # pragma: no cover - GPU
    eng = VLLMEngine(vllm_model_dir, dtype="fp32", gpu_memory_utilization=0.3, max_model_len=512, resident=True)
    try:
        base = draws(eng, prompts)
        freed = eng.sleep()
        assert freed > 0.8 * 0.3 * torch.cuda.mem_get_info()[1]  # weights and the KV cache share
        eng.wake_up()
        assert draws(eng, prompts) == base
    finally:
        eng.close()
