"""The rollback snapshot (issue 40): our host-memory ``train_state.capture`` / ``restore`` against the
libraries that could take its place — DeepSpeed's public ``engine.save_checkpoint`` /
``load_checkpoint`` and ``torch.distributed.checkpoint`` (DCP) ``save`` / ``load``, both into a
RAM-backed directory (/dev/shm) — for time, host memory and exactness.

    python benchmarks/bench_snapshot.py [--layers 4] [--stages 0 2 3] [--nproc 1] [--json FILE]

Model: benchmarks/shapes.py's Qwen2.5-0.5B layer shape cut to ``--layers`` layers, random weights,
fp32; the actor is the causal LM, the critic the same backbone with a one-output head, built with the
project's ``build_engines`` as ``bench_save.py`` does. Both get their AdamW state with one lr=0 step
(``prime_optimizer``) and then one real step (lr 1e-4), so the moments are not zero. ZeRO stage 0 is
the CPU default (``deepspeed_config.zero_stage``); 2 and 3 are the ones several ranks use. Each stage
is one process (``--nproc 2``: a ``torch.distributed.run`` launch of two gloo ranks), in which the
methods run one after another on the same engines; glibc's mmap threshold is pinned
(MALLOC_MMAP_THRESHOLD_=65536) so freed tensors leave the resident set.

Per method and rank, from a state S (weights, fp32 master, Adam moments and step, engine counters,
our lr-schedule position, all compared with ``torch.equal`` / ``==``):

    take      the snapshot of S: seconds, peak RSS over the RSS before it (VmHWM, reset through
              /proc/self/clear_refs), and what it holds after (RSS growth + its files in /dev/shm,
              which are host memory too but in no process's RSS)
    step      one training step with lr > 0 moves the weights to N (checked: they differ from S)
    restore   the snapshot put back: seconds, peak RSS over the RSS before it
    exact     the engines equal S again, part by part (params, master, moments, Adam step, counters)
    next      one more identical step from the restored state equals N (what a rollback needs)

Methods: ``ours`` = ``capture`` into fresh host tensors, ``ours-reuse`` = ``capture(reuse=...)`` into
the previous capture's buffers (what the resident trainer does each iteration), ``deepspeed`` =
``save_checkpoint`` / ``load_checkpoint(load_optimizer_states=True, load_lr_scheduler_states=True)``
(our lr-schedule position, which DeepSpeed does not know, travels in its ``client_state``), ``dcp`` =
``get_state_dict(module, optimizer)`` -> ``dcp.save`` / ``dcp.load`` -> ``set_state_dict`` (the engine
counters in the same state dict). A method that raises is recorded with its exception as the finding.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.arguments import existing_dir, output_dir, output_file, positive_int, zero_stage  # noqa: E402
from benchmarks.bench_save import GB, build_models, hwm_gb, reset_hwm, rss_gb  # noqa: E402  (after the path)
METHODS = ("ours", "ours-reuse", "deepspeed", "dcp")
LR = 1e-4


@contextlib.contextmanager
def peak(report: dict, key: str):
    """report[key] = {"seconds", "peak_over_base_gb", "rss_growth_gb"} of the block on this rank."""
    import gc

    gc.collect()
    base = rss_gb()
    reset_hwm()
    t0 = time.perf_counter()
    yield
    seconds = time.perf_counter() - t0
    report[key] = {"seconds": seconds, "peak_over_base_gb": hwm_gb() - base, "rss_growth_gb": rss_gb() - base}


def dir_gb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / GB if path.exists() else 0.0


# ---------------------------------------------------------------------------------------------
# the state, read straight from DeepSpeed and torch (not through train_state: it is under test)
# ---------------------------------------------------------------------------------------------


def fingerprint(engines) -> dict:
    """Clones of everything a rollback must put back, by part: ``params`` (the module's parameters and
    buffers; ZeRO-3: this rank's ds_tensor partitions), ``master`` (the tensors the AdamW steps: the fp32
    flat partitions under ZeRO, the parameters themselves at stage 0), ``moments`` (exp_avg,
    exp_avg_sq), ``adam_step`` (AdamW's per-tensor step), ``counters`` (engine counters, our
    lr-schedule position, every group's lr)."""
    parts: dict[str, dict] = {"params": {}, "master": {}, "moments": {}, "adam_step": {}, "counters": {}}
    for te in engines:
        r = te.role
        for name, p in te.module.named_parameters():
            parts["params"][f"{r}/{name}"] = (p.ds_tensor if hasattr(p, "ds_tensor") else p).detach().clone()
        for name, b in te.module.named_buffers():
            parts["params"][f"{r}/{name}"] = b.detach().clone()
        base = te.base_optimizer
        for gi, group in enumerate(base.param_groups):
            parts["counters"][f"{r}/lr{gi}"] = group["lr"]
        for i, p in enumerate(stepped(te)):
            parts["master"][f"{r}/{i}"] = p.detach().clone()
            for key, v in base.state.get(p, {}).items():
                part = "adam_step" if key == "step" else "moments"
                parts[part][f"{r}/{i}/{key}"] = v.detach().clone() if hasattr(v, "detach") else v
        e = te.engine
        for key in ("global_steps", "global_samples", "skipped_steps", "micro_steps"):
            parts["counters"][f"{r}/{key}"] = int(getattr(e, key))
        parts["counters"][f"{r}/lr_schedule_step"] = te.lr_schedule_step
    return parts


def stepped(te) -> list:
    """The tensors the AdamW steps (its state's keys): ZeRO-3's fp32 flat partitions (DeepSpeed puts
    each in its param group only for the step), ZeRO-1/2's, else the group's parameters."""
    opt = te.engine.optimizer
    for attr in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups"):
        if getattr(opt, attr, None) is not None:
            return list(getattr(opt, attr))
    return [p for group in te.base_optimizer.param_groups for p in group["params"]]


def differing(a: dict, b: dict, names: list | None = None) -> dict[str, int]:
    """Per part: how many entries of ``a`` are missing from ``b`` or not bit-identical (torch.equal);
    ``names`` gets the first few of them (with the values, for counters)."""
    import torch

    out = {}
    for part, entries in a.items():
        bad = [key for key in set(b[part]) - set(entries)]
        for key, v in entries.items():
            w = b[part].get(key)
            if torch.is_tensor(v):
                same = torch.is_tensor(w) and v.dtype == w.dtype and torch.equal(v, w)
            else:
                same = v == w
            if not same:
                bad.append(key if torch.is_tensor(v) else f"{key} {v!r} -> {w!r}")
        out[part] = len(bad)
        if names is not None:
            names += bad[:3]
    return out


# ---------------------------------------------------------------------------------------------
# the methods: take(engines, where) -> handle, put_back(engines, handle)
# ---------------------------------------------------------------------------------------------


class Ours:
    reuse = False

    def __init__(self):
        self.previous = None

    def take(self, engines, where):
        from rlhf_core.training.train_state import capture

        state = capture(engines, reuse=self.previous if self.reuse else None)
        self.previous = state
        return state

    def put_back(self, engines, state):
        from rlhf_core.training.train_state import restore

        restore(engines, state)


class OursReuse(Ours):
    reuse = True


class DeepSpeedCheckpoint:
    def take(self, engines, where):
        for te in engines:
            te.engine.save_checkpoint(str(where / te.role), tag="snapshot",
                                      client_state={"lr_schedule_step": te.lr_schedule_step})
        return where

    def put_back(self, engines, where):
        for te in engines:
            path, client = te.engine.load_checkpoint(str(where / te.role), tag="snapshot", load_optimizer_states=True,
                                                     load_lr_scheduler_states=True)
            if path is None:
                raise RuntimeError(f"{te.role}: load_checkpoint found no checkpoint in {where / te.role}")
            te.lr_schedule_step = int(client["lr_schedule_step"])  # the groups' lr came back with the optimizer


class DistributedCheckpoint:
    @staticmethod
    def state_dict(te) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(te.module, te.base_optimizer)
        e = te.engine
        return {"model": model, "optim": optim,
                "counters": {"global_steps": int(e.global_steps), "global_samples": int(e.global_samples),
                             "skipped_steps": int(e.skipped_steps), "micro_steps": int(e.micro_steps),
                             "lr_schedule_step": te.lr_schedule_step}}

    def take(self, engines, where):
        import torch.distributed.checkpoint as dcp

        for te in engines:
            dcp.save(self.state_dict(te), checkpoint_id=str(where / te.role))
        return where

    def put_back(self, engines, where):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        for te in engines:
            sd = self.state_dict(te)
            dcp.load(sd, checkpoint_id=str(where / te.role))
            set_state_dict(te.module, te.base_optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            c = sd["counters"]
            e = te.engine
            e.global_steps, e.global_samples = int(c["global_steps"]), int(c["global_samples"])
            e.skipped_steps, e.micro_steps = int(c["skipped_steps"]), int(c["micro_steps"])
            te.lr_schedule_step = int(c["lr_schedule_step"])


# ---------------------------------------------------------------------------------------------
# one process (every rank)
# ---------------------------------------------------------------------------------------------


def train_step(engines, ids) -> None:
    """One optimizer step of every engine on fixed tokens (no dropout: deterministic on a CPU)."""
    for te in engines:
        te.engine.set_gradient_accumulation_boundary(True)
        logits = te.engine(input_ids=ids).logits
        te.backward(logits.float().pow(2).mean())
        te.engine.step()
        te.finish_training_step()


def measure(method: str, impl, engines, ids, where: Path) -> dict:
    import torch

    report: dict = {"method": method}
    start = fingerprint(engines)
    rng = torch.get_rng_state()
    try:
        with peak(report, "take"):
            handle = impl.take(engines, where)
        report["files_gb"] = dir_gb(where)
        report["held_gb"] = (handle.nbytes() / GB if hasattr(handle, "nbytes")
                             else report["files_gb"] + max(0.0, report["take"]["rss_growth_gb"]))
        torch.rand(1)  # the RNG moves too
        train_step(engines, ids)
        moved = fingerprint(engines)
        report["step_moved"] = {k: v for k, v in differing(start, moved).items() if k != "counters"}
        with peak(report, "restore"):
            impl.put_back(engines, handle)
    except Exception as exc:  # the finding: the library cannot take or restore this engine's state
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        where_ = frame.filename.split("site-packages/")[-1]
        report["error"] = f"{type(exc).__name__}: {exc} (in {where_} {frame.name}: {frame.line})".strip()[:2000]
        report["traceback"] = traceback.format_exc()[-4000:]
        return report
    report["exact_differs"] = []
    report["exact"] = differing(start, fingerprint(engines), report["exact_differs"])
    report["rng_restored"] = bool(torch.equal(rng, torch.get_rng_state()))
    train_step(engines, ids)
    report["next_step_differs"] = []
    report["next_step"] = differing(moved, fingerprint(engines), report["next_step_differs"])
    return report


def worker(args) -> None:
    import torch

    from rlhf_core.config import load_config
    from rlhf_core.training.distributed import barrier, init_distributed, shutdown_distributed
    from rlhf_core.training.optim_state import prime_optimizer
    from rlhf_core.config.reads import build
    from rlhf_core.training.rank_update import UpdateSources, _zero_loss, build_engines
    from rlhf_core.training.settings import engine_settings

    torch.set_num_threads(1)
    dist = init_distributed("cpu")
    model, critic_dir = Path(args.model), Path(args.critic)
    overrides = [f"actor_rollout_ref.model.path={model}", f"critic.model.path={critic_dir}"]
    for role in ("actor_rollout_ref.actor", "critic"):
        overrides += [f"{role}.deepspeed_config.zero_stage={args.stage}", f"{role}.deepspeed_config.dtype=fp32",
                      f"{role}.optim.lr={LR}"]
    cfg = load_config(None, overrides)
    actor, critic = build_engines(build(engine_settings, cfg, device="cpu", world_size=dist.world_size),
                                  UpdateSources(model, None, critic_dir, model, None))
    engines = [actor, critic]
    for te in engines:
        prime_optimizer(te, _zero_loss(te, 0))
    ids = torch.randint(0, 512, (2, args.tokens), generator=torch.Generator().manual_seed(1))
    train_step(engines, ids)  # moments that are not zero
    params = sum(getattr(p, "ds_numel", p.numel()) for te in engines for p in te.module.parameters())
    report: dict = {"rank": dist.rank, "world_size": dist.world_size, "stage": args.stage, "parameters": params,
                    "state_gb": params * 4 * 3 / GB, "methods": {}}
    impls = {"ours": Ours(), "ours-reuse": OursReuse(), "deepspeed": DeepSpeedCheckpoint(),
             "dcp": DistributedCheckpoint()}
    if "ours-reuse" in args.methods:  # its buffers: a capture taken before, kept (as the resident trainer's)
        impls["ours-reuse"].previous = impls["ours"].take(engines, None)
        impls["ours"].previous = None
    rounds: dict[str, list] = {m: [] for m in args.methods}
    for i in range(args.repeat):
        # each round in another order: the first measurement of a process pays for pages no other one faulted in
        order = args.methods[i % len(args.methods):] + args.methods[:i % len(args.methods)]
        for method in order:
            impl = impls[method]
            where = Path(args.scratch) / f"{method}_zero{args.stage}_{i}"
            barrier()
            rounds[method].append(measure(method, impl, engines, ids, where))
            if method == "ours":
                impl.previous = None  # a fresh capture each round
            barrier()
            if dist.is_main:
                shutil.rmtree(where, ignore_errors=True)
            print(f"rank {dist.rank} ZeRO-{args.stage} round {i + 1} {method}: done", file=sys.stderr, flush=True)
    report["methods"] = {m: rounds[m] for m in args.methods}
    Path(f"{args.out}.rank{dist.rank}").write_text(json.dumps(report))
    shutdown_distributed()


# ---------------------------------------------------------------------------------------------
# the driver
# ---------------------------------------------------------------------------------------------


def launch(stage: int, args, model: Path, critic: Path, scratch: Path) -> list[dict]:
    out = scratch / f"report_zero{stage}.json"
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                                                           "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536", DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    head = [sys.executable]
    if args.nproc > 1:
        env["MASTER_ADDR"] = "127.0.0.1"
        head += ["-m", "torch.distributed.run", "--standalone", "--nnodes=1", f"--nproc_per_node={args.nproc}"]
    cmd = [*head, __file__, "--worker", "--stage", str(stage), "--model", str(model), "--critic", str(critic),
           "--scratch", str(scratch), "--out", str(out), "--tokens", str(args.tokens), "--repeat", str(args.repeat), "--methods", *args.methods]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"ZeRO-{stage} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(args.nproc)]


def _exact(parts: dict) -> str:
    bad = {k: v for k, v in parts.items() if v}
    return "yes" if not bad else "NO (" + ", ".join(f"{k}: {v}" for k, v in bad.items()) + ")"


def node_held(ms: list[dict]) -> float:
    """What one round's snapshot holds on the machine: every rank's own (RSS) part, and the files,
    which all ranks write into one directory, once."""
    return sum(m["held_gb"] - m["files_gb"] for m in ms) + max(m["files_gb"] for m in ms)


def summary(ranks: list[dict], method: str) -> dict:
    """A method's numbers over rounds and ranks: the median round of the slowest (largest) rank;
    exactness as the worst of all."""
    from statistics import median

    runs = [r["methods"][method] for r in ranks]  # [rank][round]
    errors = [m["error"] for rank in runs for m in rank if "error" in m]
    if errors:
        return {"error": errors[0]}

    def med(fn):
        return median(max(fn(rank[i]) for rank in runs) for i in range(len(runs[0])))

    def worst(key):
        return {part: max(m[key][part] for rank in runs for m in rank) for part in runs[0][0][key]}

    return {"take_s": med(lambda m: m["take"]["seconds"]), "restore_s": med(lambda m: m["restore"]["seconds"]),
            "take_peak_gb": med(lambda m: m["take"]["peak_over_base_gb"] + m["files_gb"]),
            "held_gb": median(node_held([rank[i] for rank in runs]) for i in range(len(runs[0]))),
            "restore_peak_gb": med(lambda m: m["restore"]["peak_over_base_gb"]),
            "exact": worst("exact"), "next_step": worst("next_step"),
            "rng_restored": all(m["rng_restored"] for rank in runs for m in rank),
            "differs": sorted({d for rank in runs for m in rank for d in m["exact_differs"]})[:4]}


def table(results: dict[int, list[dict]]) -> str:
    """One row per (stage, method): seconds of the slowest rank, peaks of the largest, held memory of all
    ranks together (median rounds)."""
    rows = ["| ZeRO | method | take s | restore s | take, restore vs ours | take peak GB | held GB (all ranks) | held vs ours | "
            "restore peak GB | exact after restore (differing: params, master, moments, Adam step, counters) | "
            "next step identical | RNG back |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for stage, ranks in sorted(results.items()):
        sums = {m: summary(ranks, m) for m in ranks[0]["methods"]}
        ours = sums.get("ours", {"error": "not measured"})
        for method, s in sums.items():
            if "error" in s:
                rows.append(f"| {stage} | {method} | fails | | | | | | | {s['error'][:120]} | | |")
                notes.append(f"ZeRO-{stage} {method}: {s['error']}")
                continue
            ratio = held = ""
            if "error" not in ours:
                ratio = f"{s['take_s'] / ours['take_s']:.2f}x, {s['restore_s'] / ours['restore_s']:.2f}x"
                held = f"{s['held_gb'] / ours['held_gb']:.2f}x"
            rows.append(f"| {stage} | {method} | {s['take_s']:.3f} | {s['restore_s']:.3f} | {ratio} | "
                        f"{s['take_peak_gb']:.2f} | {s['held_gb']:.2f} | {held} | {s['restore_peak_gb']:.2f} | "
                        f"{_exact(s['exact'])} | {_exact(s['next_step'])} | {'yes' if s['rng_restored'] else 'no'} |")
            if s["differs"]:
                notes.append(f"ZeRO-{stage} {method} differs after restore: {'; '.join(s['differs'])}")
    return "\n".join(rows + ([""] + notes if notes else []))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=positive_int, default=4)
    ap.add_argument("--stages", type=zero_stage, nargs="+", default=[0, 2, 3])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--nproc", type=positive_int, default=1, help="gloo ranks (1: one process, no launcher)")
    ap.add_argument("--repeat", type=positive_int, default=3, help="rounds of every method (the table: medians)")
    ap.add_argument("--tokens", type=positive_int, default=64, help="tokens per sequence of the training steps (2 sequences)")
    ap.add_argument("--scratch", type=existing_dir, default="/dev/shm", help="where the libraries write (RAM-backed)")
    ap.add_argument("--model-cache", type=output_dir, default=str(REPO / ".rlhf" / "models" / "shapes"))
    ap.add_argument("--json", type=output_file)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for a in ("--model", "--critic", "--out"):
        ap.add_argument(a, help=argparse.SUPPRESS)
    ap.add_argument("--stage", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    model, critic = build_models(Path(args.model_cache), args.layers)
    results = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_snapshot_", dir=args.scratch) as scratch:
        for stage in args.stages:
            results[stage] = launch(stage, args, model, critic, Path(scratch))
            print(f"done: ZeRO-{stage} ({time.perf_counter() - t0:.0f} s)\n{table({stage: results[stage]})}",
                  file=sys.stderr, flush=True)
    first = results[args.stages[0]][0]
    print(f"Qwen2.5-0.5B shape, {args.layers} layers ({first['parameters'] / 1e6:.1f} M parameters, actor + critic), "
          f"fp32, state (params + 2 moments) {first['state_gb']:.2f} GB, {args.nproc} gloo rank(s), "
          f"files in {args.scratch}\n")
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps({"layers": args.layers, "nproc": args.nproc,
                                               "stages": {str(s): v for s, v in results.items()}}, indent=2))


if __name__ == "__main__":
    main()
