"""Peak host memory and time of a checkpoint save at 2 gloo ranks: the gathered save before issue 15
(every rank gathers the full optimizer state, rank 0 writes one file per role, then every file is
read back to hash it) against the sharded one (each rank writes its own partition, hashed while
written), measured against the size of the training state.

    python benchmarks/bench_save.py [--layers 4] [--stages 2 3] [--model-cache DIR] [--json FILE]

Model: benchmarks/shapes.py's Qwen2.5-0.5B layer shape (hidden 896, 14 heads, 2 KV heads,
intermediate 4864, tiny vocabulary) cut to ``--layers`` layers, random weights, fp32; the actor is the
causal LM, the critic the same backbone with a one-output head. Both get their AdamW state with one
lr=0 step (the moments exist, as after any update), then one save is measured per process: each
(stage, method) is a fresh ``torch.distributed.run --nproc_per_node=2`` launch, so no allocation
of one measurement is still held in the next. glibc's mmap threshold is pinned
(MALLOC_MMAP_THRESHOLD_=65536) so freed tensors leave the resident set and the peak is the save's.

Per rank: peak RSS (VmHWM, reset with /proc/self/clear_refs just before the save) minus the RSS
before it = what the save itself needed; "state" = params + both Adam moments (+ fp32 master in
bf16) of actor and critic, full model (what the gathered save holds per rank) and this rank's
shard (what the sharded one writes). In the sharded launch also: seconds of a ``capture`` (host
copy of this rank's state), of one into the buffers of the previous capture (``reuse``), of a save from that capture, and of writing this rank's shard with
hashing while writing against ``safetensors.torch.save_file`` then ``sha256_file``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.arguments import output_dir, output_file, positive_int, zero_stage  # noqa: E402

GB = 1e9
METHODS = ("legacy", "sharded")


def rss_gb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / GB
    return float("nan")


def hwm_gb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / GB
    return float("nan")


def reset_hwm() -> None:
    Path("/proc/self/clear_refs").write_text("5")


@contextlib.contextmanager
def peak(report: dict, key: str):
    """report[key] = {"seconds", "peak_over_base_gb", "base_gb"} of the block on this rank."""
    import gc

    gc.collect()
    base = rss_gb()
    reset_hwm()
    t0 = time.perf_counter()
    yield
    report[key] = {"seconds": time.perf_counter() - t0, "peak_over_base_gb": hwm_gb() - base, "base_gb": base}


# ---------------------------------------------------------------------------------------------
# the save before issue 15 (kept here, verbatim in effect, as the baseline)
# ---------------------------------------------------------------------------------------------


def legacy_save(directory: Path, actor, critic, tokenizer_path: Path, dist) -> None:
    from safetensors.torch import save_file

    from rlhf_core.io.atomic import atomic_dir
    from rlhf_core.io.checksums import write_checksums
    from rlhf_core.training.checkpoint import full_state_dict, rng_state, save_tokenizer
    from rlhf_core.training.distributed import barrier
    from rlhf_core.training.optim_state import counters, gather_optimizer_state

    gathered = {te.role: (full_state_dict(te, dist), gather_optimizer_state(te), counters(te)) for te in (actor, critic)}
    if dist.is_main:
        with atomic_dir(directory) as tmp:
            for te in (actor, critic):
                weights, optim, meta = gathered[te.role]
                te.module.save_pretrained(tmp / te.role, state_dict=weights, safe_serialization=True)
                save_tokenizer(tokenizer_path, tmp / te.role)
                (tmp / "deepspeed").mkdir(exist_ok=True)
                save_file({k: v.contiguous() for k, v in optim.items()}, str(tmp / "deepspeed" / f"{te.role}_optim.safetensors"))
                (tmp / "deepspeed" / f"{te.role}_state.json").write_text(json.dumps(meta))
            rng_tensors, rng_json = rng_state()
            save_file(rng_tensors, str(tmp / "rng.safetensors"))
            (tmp / "trainer_state.json").write_text(json.dumps({"rng": rng_json}))
            write_checksums(tmp)
    del gathered
    barrier()


# ---------------------------------------------------------------------------------------------
# one launch (every rank)
# ---------------------------------------------------------------------------------------------


def state_bytes(te) -> int:
    """Params + moments (+ fp32 master when not fp32) of the full model, in bytes."""
    n = sum(getattr(p, "ds_numel", p.numel()) for p in te.module.parameters())
    per = 4 * 2 + (4 if te.dtype != "fp32" else 0)
    return n * ({"fp32": 4, "bf16": 2, "fp16": 2}[te.dtype] + per)


def worker(args) -> None:
    import torch

    from rlhf_core.config import load_config
    from rlhf_core.io.hashing import sha256_file
    from rlhf_core.io.safetensors_stream import write_safetensors
    from rlhf_core.training.checkpoint import save_checkpoint
    from rlhf_core.training.distributed import barrier, init_distributed, shutdown_distributed
    from rlhf_core.training.optim_state import prime_optimizer
    from rlhf_core.config.reads import build
    from rlhf_core.training.rank_update import UpdateSources, _zero_loss, build_engines
    from rlhf_core.training.settings import engine_settings
    from rlhf_core.training.train_state import capture

    torch.set_num_threads(1)
    dist = init_distributed("cpu")
    model, critic_dir = Path(args.model), Path(args.critic)
    cfg = load_config(None, [f"actor_rollout_ref.model.path={model}", f"critic.model.path={critic_dir}",
                             f"actor_rollout_ref.actor.deepspeed_config.zero_stage={args.stage}",
                             f"critic.deepspeed_config.zero_stage={args.stage}"])
    actor, critic = build_engines(build(engine_settings, cfg, device="cpu", world_size=dist.world_size),
                                  UpdateSources(model, None, critic_dir, model, None))
    for te in (actor, critic):
        prime_optimizer(te, _zero_loss(te, 0))
    report: dict = {"rank": dist.rank, "state_full_gb": sum(state_bytes(te) for te in (actor, critic)) / GB}
    out = Path(args.scratch) / f"ckpt_{args.method}_{args.stage}"
    barrier()
    if args.method == "legacy":
        with peak(report, "save"):
            legacy_save(out, actor, critic, model, dist)
    else:
        with peak(report, "save"):
            save_checkpoint(out, actor=actor, critic=critic, tokenizer_path=model, trainer_state={}, dist=dist)
        barrier()
        t0 = time.perf_counter()
        state = capture([actor, critic])
        report["capture_seconds"] = time.perf_counter() - t0
        report["shard_gb"] = state.nbytes() / GB
        barrier()
        with peak(report, "save_from_capture"):
            save_checkpoint(out, actor=actor, critic=critic, tokenizer_path=model, trainer_state={}, dist=dist,
                            state=state)
        t0 = time.perf_counter()
        capture([actor, critic], reuse=state)
        report["capture_reuse_seconds"] = time.perf_counter() - t0
        report.update(hash_comparison(state, Path(args.scratch) / f"hash_rank{dist.rank}", write_safetensors,
                                      sha256_file))
    if dist.is_main:
        Path(args.out).write_text(json.dumps(report))
    else:
        Path(args.out + f".rank{dist.rank}").write_text(json.dumps(report))
    shutdown_distributed()


def hash_comparison(state, where: Path, write_safetensors, sha256_file) -> dict:
    """This rank's optimizer shards written twice: hashed while written vs save_file + read back."""
    from safetensors.torch import save_file

    where.mkdir(parents=True, exist_ok=True)
    tensors = {f"{role}/{k}": v for role, s in state.roles.items() for k, v in s.optim.items()}
    t0 = time.perf_counter()
    write_safetensors(where / "streamed.safetensors", tensors)
    streamed = time.perf_counter() - t0
    t0 = time.perf_counter()
    save_file(tensors, str(where / "plain.safetensors"))
    written = time.perf_counter() - t0
    sha256_file(where / "plain.safetensors")
    plain = time.perf_counter() - t0
    return {"hash_while_writing_seconds": streamed, "write_then_hash_seconds": plain,
            "write_only_seconds": written, "hashed_gb": sum(v.numel() * v.element_size() for v in tensors.values()) / GB}


# ---------------------------------------------------------------------------------------------
# the driver
# ---------------------------------------------------------------------------------------------


def build_models(cache: Path, layers: int) -> tuple[Path, Path]:
    import torch
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    from benchmarks.shapes import build_shape_model

    model = build_shape_model(cache, "qwen2.5-0.5b", layers=layers)
    critic = cache / f"{model.name}-critic"
    if not (critic / "model.safetensors").is_file():
        torch.manual_seed(0)
        AutoModelForTokenClassification.from_pretrained(model, num_labels=1).save_pretrained(critic)
        AutoTokenizer.from_pretrained(model).save_pretrained(critic)
    return model, critic


def launch(method: str, stage: int, model: Path, critic: Path, scratch: Path) -> list[dict]:
    out = scratch / f"report_{method}_{stage}.json"
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                                                           "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536", DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc_per_node=2",
           __file__, "--worker", "--method", method, "--stage", str(stage), "--model", str(model),
           "--critic", str(critic), "--scratch", str(scratch), "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{method} ZeRO-{stage} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [json.loads(out.read_text()), json.loads(Path(str(out) + ".rank1").read_text())]


def table(results: dict) -> str:
    rows = ["| ZeRO | save | full state GB | shard GB/rank | peak over base GB (max rank) | peak / full state | "
            "save s | capture s (into reused buffers) | save-from-capture s | its peak GB | hash-while-write s | "
            "write-then-hash s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (stage, method), ranks in sorted(results.items()):
        full = ranks[0]["state_full_gb"]
        peak_gb = max(r["save"]["peak_over_base_gb"] for r in ranks)
        secs = max(r["save"]["seconds"] for r in ranks)
        extra = ["", "", "", "", "", ""]
        if method == "sharded":
            cap = max(r["save_from_capture"]["peak_over_base_gb"] for r in ranks)
            extra = [f"{max(r['shard_gb'] for r in ranks):.2f}", f"{max(r['capture_seconds'] for r in ranks):.2f} "
                     f"({max(r['capture_reuse_seconds'] for r in ranks):.2f})",
                     f"{max(r['save_from_capture']['seconds'] for r in ranks):.2f}", f"{cap:.2f}",
                     f"{max(r['hash_while_writing_seconds'] for r in ranks):.2f}",
                     f"{max(r['write_then_hash_seconds'] for r in ranks):.2f}"]
        rows.append(f"| {stage} | {method} | {full:.2f} | {extra[0]} | {peak_gb:.2f} | {peak_gb / full:.2f} | "
                    f"{secs:.2f} | {extra[1]} | {extra[2]} | {extra[3]} | {extra[4]} | {extra[5]} |")
    for stage in sorted({s for s, _ in results}):
        if (stage, "legacy") in results and (stage, "sharded") in results:
            a = max(r["save"]["peak_over_base_gb"] for r in results[(stage, "legacy")])
            b = max(r["save"]["peak_over_base_gb"] for r in results[(stage, "sharded")])
            ta = max(r["save"]["seconds"] for r in results[(stage, "legacy")])
            tb = max(r["save"]["seconds"] for r in results[(stage, "sharded")])
            rows.append(f"\nZeRO-{stage}: peak memory of the save legacy/sharded = {a / max(b, 1e-3):.1f}x, "
                        f"time legacy/sharded = {ta / tb:.2f}x")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=positive_int, default=4)
    ap.add_argument("--stages", type=zero_stage, nargs="+", default=[2, 3])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--model-cache", type=output_dir, default=str(REPO / ".rlhf" / "models" / "shapes"))
    ap.add_argument("--json", type=output_file)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for a in ("--method", "--model", "--critic", "--scratch", "--out"):
        ap.add_argument(a, help=argparse.SUPPRESS)
    ap.add_argument("--stage", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    model, critic = build_models(Path(args.model_cache), args.layers)
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_save_") as scratch:
        for stage in args.stages:
            for method in args.methods:
                results[(stage, method)] = launch(method, stage, model, critic, Path(scratch))
                print(f"done: ZeRO-{stage} {method}", file=sys.stderr, flush=True)
    print(f"Qwen2.5-0.5B shape, {args.layers} layers, fp32, actor + critic, 2 gloo ranks\n")
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps({f"{s}:{m}": v for (s, m), v in results.items()}, indent=2))


if __name__ == "__main__":
    main()
