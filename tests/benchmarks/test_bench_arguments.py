"""Every benchmark script refuses a bad command-line value before any work: exit status 2, no
traceback, the refusal on stderr naming the option (argparse's usage line and its ``error:`` line, or one
line of the script's own), and nothing written — not minutes later, after a model build, as a traceback.
A value that follows from the others is derived instead (bench_h200's mini-batch from --batch)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"

MISSING = "no-such-dir/out.json"
"""An output file in a directory that does not exist (relative to the test's scratch directory)."""

# (script, bad arguments, what the last line of stderr must name). "{tmp}" is the test's scratch directory.
BAD = [
    ("bench_frozen.py", ["--layers", "0"], "argument --layers: must be a whole number >= 1, got 0"),
    ("bench_frozen.py", ["--repeats", "-1"], "argument --repeats"),
    ("bench_gae.py", ["--quick", "--shape", "4"], "unrecognized arguments: --shape 4"),
    ("bench_memory.py", ["--shapes", "60x2"], "argument --shapes: '60x2': the hidden size must be a multiple of 8"),
    ("bench_memory.py", ["--zero", "4"], "argument --zero: must be a DeepSpeed ZeRO stage (0, 1, 2 or 3), got 4"),
    ("bench_memory.py", ["--sequences", "0"], "argument --sequences"),
    ("bench_overhead.py", ["--iterations", "0"], "argument --iterations"),
    ("bench_overhead.py", ["--save-freq", "10", "0"], "argument --save-freq: must be >= 1 (save every N iterations) "
                                                      "or -1"),
    ("bench_overhead.py", ["--json", "{tmp}/" + MISSING], "argument --json"),
    ("bench_overhead.py", ["trainer.save_freq"], "is not KEY=VALUE"),
    ("bench_packing.py", ["--data", "{tmp}/none.jsonl"], "pass --data PATH"),
    ("bench_real_model.py", ["run", "--budget-gb", "0"], "argument --budget-gb: must be a number > 0, got 0"),
    ("bench_real_model.py", ["run", "--out", "{tmp}/" + MISSING], "argument --out"),
    ("bench_real_model.py", ["logits", "--sequences", "0"], "argument --sequences"),
    ("bench_real_model.py", ["logits", "--model", "{tmp}"], "--model"),
    ("bench_real_shape.py", ["--layers", "4", "0"], "argument --layers"),
    ("bench_real_shape.py", ["--ours-override", "trainer.seed"], "argument --ours-override"),
    ("bench_real_shape.py", ["--trl-threads", "-1"], "argument --trl-threads"),
    ("bench_reward_process.py", ["--rows", "64", "0"], "argument --rows"),
    ("bench_reward_process.py", ["--repeats", "0"], "argument --repeats"),
    ("bench_save.py", ["--stages", "2", "5"], "argument --stages"),
    ("bench_save.py", ["--methods", "gathered"], "argument --methods: invalid choice"),
    ("bench_save.py", ["--json", "{tmp}/" + MISSING], "argument --json"),
    ("bench_scoring.py", ["--prompts", "0"], "argument --prompts"),
    ("bench_scoring.py", ["--budget", "abc"], "argument --budget: 'abc' is not a whole number"),
    ("bench_snapshot.py", ["--scratch", "{tmp}/no-such-dir"], "argument --scratch"),
    ("bench_snapshot.py", ["--nproc", "0"], "argument --nproc"),
    ("bench_snapshot.py", ["--model-cache", "{tmp}/a-file"], "argument --model-cache"),
    ("bench_update.py", ["--stages", "0", "4"], "argument --stages"),
    ("bench_update.py", ["--epochs", "0"], "argument --epochs"),
    ("bench_vllm.py", ["--new-tokens", "0"], "argument --new-tokens"),
    ("bench_vllm.py", ["--out", "{tmp}/" + MISSING], "argument --out"),
    ("bench_vs_trl.py", ["--batch", "64", "--mini-batch", "24"], "--mini-batch 24 must divide --batch 64"),
    ("bench_vs_trl.py", ["--hidden", "60"], "argument --hidden"),
    ("bench_vs_trl.py", ["--repeats", "0"], "argument --repeats"),
    ("soak.py", ["--iterations", "0"], "argument --iterations"),
    ("soak.py", ["--work-dir", "{tmp}/a-file"], "argument --work-dir"),
    ("shapes.py", ["--vocab", "100", "--out", "{tmp}/shapes"], "argument --vocab: must be a whole number >= 512"),
    ("shapes.py", ["--layers", "0", "--out", "{tmp}/shapes"], "argument --layers"),
    ("gpu/bench_h200.py", ["--small", "--device", "cpu", "--batch", "8", "--mini-batch", "16"],
     "--mini-batch 16 must be between 1 and --batch 8"),
    ("gpu/bench_h200.py", ["--small", "--device", "cpu", "--prompt-len", "300", "--token-budget", "256"],
     "--token-budget 256 cannot hold one sequence"),
    ("gpu/bench_h200.py", ["--small", "--device", "tpu"], "argument --device"),
    ("gpu/bench_h200.py", ["--small", "--device", "cpu", "--zero", "9"], "argument --zero"),
    ("gpu/bench_h200.py", ["--small", "--device", "cpu", "--out", "{tmp}/" + MISSING], "argument --out"),
    ("gpu/bench_iteration.py", ["--vocab", "100"], "argument --vocab"),
    ("gpu/bench_iteration.py", ["--prompts", "0"], "argument --prompts"),
    ("gpu/bench_iteration.py", ["--markdown", "{tmp}/no-such-dir/t.md"], "argument --markdown"),
    ("gpu/bench_iteration.py", ["--dry-run", "trainer.seed"], "is not KEY=VALUE"),
    ("gpu/bench_vllm_resident.py", ["--gpu-memory-utilization", "1.5"], "argument --gpu-memory-utilization: must be "
                                                                        "a fraction in (0, 1], got 1.5"),
    ("gpu/bench_vllm_resident.py", ["--max-model-len", "40"], "--max-model-len 40 cannot hold a 32-token prompt"),
    ("gpu/bench_vllm_resident.py", ["--noise", "0"], "argument --noise"),
    ("gpu/wheelhouse.py", ["--dry-run", "--host-packages", "{tmp}/none.txt"], "--host-packages"),
    ("gpu/wheelhouse.py", ["--dry-run", "--out", "{tmp}/a-file"], "--out"),
]


def _run(script: str, args: list[str], tmp: Path, subprocess_env) -> subprocess.CompletedProcess:
    env = subprocess_env(RLHF_HOME=str(tmp / "home"), TMPDIR=str(tmp / "tmp"), HF_HUB_OFFLINE="1")
    args = [a.replace("{tmp}", str(tmp)) for a in args]
    return subprocess.run([sys.executable, str(BENCH / script), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)


def _scratch(tmp_path: Path) -> Path:
    (tmp_path / "tmp").mkdir()
    (tmp_path / "a-file").write_text("not a directory\n")
    return tmp_path


def _written(tmp: Path) -> set[str]:
    """What the run left in the scratch directory beyond what the test put there."""
    return {str(p.relative_to(tmp)) for p in tmp.rglob("*")} - {"tmp", "a-file"}


@pytest.mark.parametrize("script,args,names", BAD, ids=[f"{s}:{' '.join(a)}" for s, a, _ in BAD])
def test_a_bad_argument_is_refused_in_one_line_before_any_work(script, args, names, tmp_path, subprocess_env):
    tmp = _scratch(tmp_path)
    proc = _run(script, args, tmp, subprocess_env)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines and names in lines[-1], proc.stderr
    # the refusal is argparse's (its usage, then one error line) or the script's own single line
    assert lines[0].startswith("usage:") or len(lines) == 1, proc.stderr
    assert not proc.stdout.strip(), proc.stdout  # nothing measured, nothing announced
    assert not _written(tmp), _written(tmp)  # no output file, run directory, model or temporary directory


def test_bench_iteration_without_cuda_says_so_in_one_line(tmp_path, subprocess_env):
    """It was a silent exit 2: the GPU check without a GPU now names the way to run it on the CPU."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    tmp = _scratch(tmp_path)
    proc = _run("gpu/bench_iteration.py", ["--layers", "1"], tmp, subprocess_env)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "bench_iteration: this machine has no CUDA device; pass --allow-cpu to measure on the CPU, or --dry-run"]
    assert not _written(tmp)


def test_bench_h200_refuses_cuda_where_there_is_none(tmp_path, subprocess_env):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    tmp = _scratch(tmp_path)
    proc = _run("gpu/bench_h200.py", ["--small", "--batch", "8"], tmp, subprocess_env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith(
        "--device cuda: this machine has no CUDA device; use --device cpu (or --dry-run)"), proc.stderr
    assert not _written(tmp)


def _bench_h200():
    sys.path.insert(0, str(BENCH / "gpu"))
    try:
        import bench_h200
    finally:
        sys.path.remove(str(BENCH / "gpu"))
    return bench_h200


def test_bench_h200_derives_a_mini_batch_that_fits_a_small_batch(capsys):
    """`--small --device cpu --batch 8` was a ConfigError traceback (ppo_mini_batch_size=64 > 8) after the
    model build: the mini-batch is now cut to the batch, said in one line, and the default kept otherwise.
    (A real run of that shape takes minutes on 2 cores: the argument handling is tested, not the run.)"""
    bench_h200 = _bench_h200()
    args = bench_h200.parse_args(["--small", "--device", "cpu", "--batch", "8"])
    assert (args.batch, args.mini_batch, args.device) == (8, 8, "cpu")
    assert capsys.readouterr().err.splitlines() == [
        "bench_h200: --mini-batch 8: the default 64 is more than --batch 8"]
    args = bench_h200.parse_args(["--small", "--device", "cpu", "--batch", "256"])
    assert args.mini_batch == 64 and not capsys.readouterr().err  # the default, unsaid
    args = bench_h200.parse_args(["--small", "--device", "cpu", "--batch", "8", "--mini-batch", "4"])
    assert args.mini_batch == 4 and not capsys.readouterr().err  # what the user set, kept


def test_bench_h200s_derived_mini_batch_is_a_valid_config():
    """What the update would be given passes the config's own checks (mini-batch <= train batch)."""
    from rlhf_core.config import load_config

    bench_h200 = _bench_h200()
    args = bench_h200.parse_args(["--small", "--device", "cpu", "--batch", "8"])
    cfg = load_config(str(REPO / "configs/demo.yaml"), [
        f"data.train_batch_size={args.batch}", f"actor_rollout_ref.actor.ppo_mini_batch_size={args.mini_batch}",
        f"data.max_prompt_length={args.prompt_len}", f"data.max_response_length={args.new_tokens}",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={args.token_budget}"])
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 8 == cfg.data.train_batch_size
