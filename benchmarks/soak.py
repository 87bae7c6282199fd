"""Soak: the tiny pipeline for N iterations with faults injected at random, each recovered from.

    python benchmarks/soak.py --iterations 20 --seed 0 [--work-dir DIR] [--keep]

A seeded schedule gives every iteration one fault (or none):

    kill_point   the worker process dies (os._exit(137), like SIGKILL) at a named fault point of the
                 iteration (a before_rename of one of its outputs, its manifest, its KL controller
                 state or last_good.json); recovery: resume.
    kill_time    SIGKILL of the worker at a random time while it runs the iteration; recovery: resume.
    corrupt      after the iteration commits, one file of its checkpoint gets a flipped byte or is cut
                 in half; recovery: resume, which must detect it and rebuild the checkpoint by replaying
                 the iteration's update from its record (or, failing that, fall back and rerun it).
    nan          the iteration's advantages table gets NaN rows after gae; the update must skip the
                 step and the guard roll back ("non-finite update"); recovery: the retry commits.

Each worker is a separate process (``--worker``) that resumes the run as ``rlhf run --resume`` does
(``plan_run`` + ``open_run`` under the run lock: temporaries cleaned, the committed lineage
verified and repaired) and runs
the flow's iteration loop in-process without Prefect. At the end every iteration must be committed
with its rollbacks recorded with reasons, every table and JSON file readable, every rollout complete,
last-good verified, no temporary left: the table printed counts faults injected, recovered and data
lost (must be 0).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from arguments import positive_int  # benchmarks/arguments.py: sys.path[0] is this script's folder

REPO = Path(__file__).resolve().parents[1]
KINDS = ("kill_point", "kill_time", "corrupt", "nan")
SHARE = {"kill_point": 0.3, "kill_time": 0.15, "corrupt": 0.15, "nan": 0.15}
"""Fraction of iterations given each fault (the rest run clean)."""
FAULT_POINTS = ("before_rename:rollout.parquet", "before_rename:scored.parquet", "before_rename:advantages.parquet",
                "before_rename:kl_ctrl.json", "before_rename:checkpoint", "before_rename:metrics.json",
                "before_rename:guard.json", "before_rename:last_good.json", "before_rename:manifest.json")


def overrides(model_dir: Path, work: Path, iterations: int) -> list[str]:
    return [f"actor_rollout_ref.model.path={model_dir}", f"trainer.runs_root={work}",
            "actor_rollout_ref.model.warm_start.enable=false", "data.train_batch_size=4", "data.max_val_samples=4",
            "data.max_response_length=12", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1024",
            "actor_rollout_ref.rollout.generation_batch_tokens=2048", "trainer.device=cpu",
            "trainer.kl_guard_val_prompts=0", "trainer.save_freq=1", "trainer.max_ckpt_to_keep=2",
            f"trainer.total_iterations={iterations}"]


# ---------------------------------------------------------------------------------------------
# worker: resume the run and carry it to iteration ``until`` (what `rlhf run --resume` does)
# ---------------------------------------------------------------------------------------------


def poison_advantages(run, k: int) -> None:
    import math

    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlhf_core.data.schemas import ADVANTAGES
    from rlhf_core.io.atomic import atomic_write_parquet

    table = pq.read_table(run.advantages(k))
    adv = [[math.nan] * len(a) if i % 2 == 0 else a for i, a in enumerate(table.column("advantages").to_pylist())]
    table = table.set_column(table.schema.get_field_index("advantages"), "advantages",
                             pa.array(adv, type=pa.list_(pa.float32())))
    atomic_write_parquet(run.advantages(k), table, schema=ADVANTAGES)


def run_iteration(cfg, run, k: int, fault: dict) -> None:
    from rlhf_core.run.lifecycle import commit_iteration, discard_checkpoint, read_verdict
    from rlhf_core.run.lifecycle import rollback_iteration
    from rlhf_core.stages.guard import run_guard
    from rlhf_core.run.lifecycle import prune_checkpoints
    from rlhf_core.run.stage_order import get_stage

    if fault.get("point"):  # armed only now, so earlier iterations of this worker are not hit
        os.environ["RLHF_FAULT"] = fault["point"]
    for attempt in itertools.count(1):
        for stage in ("rollout", "score", "gae"):
            get_stage(stage).load()(cfg, run, k)
        if fault.get("nan") and attempt == 1:
            poison_advantages(run, k)
        get_stage("update").load()(cfg, run, k)
        run_guard(cfg, run, k)
        if read_verdict(run, k)["decision"] == "commit":
            commit_iteration(run, k)
            prune_checkpoints(cfg.trainer, run)
            return
        discard_checkpoint(run, k)
        rollback_iteration(run, k, policy="retry", attempt=attempt)
        if attempt >= 3:
            raise RuntimeError(f"iteration {k} rolled back {attempt} times")


def worker(run_dir: Path, until: int, fault: dict) -> None:
    from rlhf_core.run.lock import RunLock
    from rlhf_core.control.opening import open_run
    from rlhf_core.control.plan import plan_run
    from rlhf_core.run.stage_order import get_stage

    plan = plan_run(resume=run_dir)
    with RunLock(plan.run):
        open_run(plan)
        for stage in ("init_critic", "preprocess", "pack"):
            get_stage(stage).load()(plan.cfg, plan.run, None)
        for k in range(plan.first_iteration, until + 1):
            if k == until:  # the driver's random-time kill counts from here
                (run_dir.parent / "started").touch()
            run_iteration(plan.cfg, plan.run, k, fault if k == until else {})


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------


def launch(run_dir: Path, until: int, fault: dict, kill_after: float | None = None) -> int:
    """Run a worker; with ``kill_after`` SIGKILL it that many seconds after it starts iteration
    ``until`` (told by its marker file). Returns the exit code (-9: killed by us)."""
    marker = run_dir.parent / "started"
    marker.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--worker", str(run_dir), "--until", str(until), "--fault", json.dumps(fault)]
    env = {k: v for k, v in os.environ.items() if k != "RLHF_FAULT"}
    log = open(run_dir.parent / "worker.log", "a")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    if kill_after is not None:
        while proc.poll() is None and not marker.exists():
            time.sleep(0.01)
        time.sleep(kill_after)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
    return proc.wait()


def corrupt_checkpoint(run, k: int, rng: random.Random) -> str:
    files = sorted(p for p in run.checkpoint(k).rglob("*") if p.is_file() and p.name != "manifest.json")
    victim = rng.choice(files)
    data = bytearray(victim.read_bytes())
    if rng.random() < 0.5 and len(data) > 1:
        victim.write_bytes(bytes(data[: len(data) // 2]))
        how = "truncated"
    else:
        data[rng.randrange(len(data))] ^= 0xFF
        victim.write_bytes(bytes(data))
        how = "flipped byte"
    return f"{victim.relative_to(run.root)} ({how})"


def iteration_seconds(run, k: int, default: float = 2.0) -> float:
    """Seconds iteration ``k``'s stage bodies took (the sum of their manifest ``seconds``: a kill and
    its recovery in between do not count), or ``default`` before the first iteration."""
    from rlhf_core.run.manifest import read_manifest

    seconds = [float(r["seconds"]) for r in read_manifest(run, k).values() if r.get("seconds")] if k > 0 else []
    return sum(seconds) if seconds else default


def schedule(iterations: int, rng: random.Random) -> list[str]:
    kinds = [kind for kind in KINDS for _ in range(max(1, round(SHARE[kind] * iterations)))]
    kinds = kinds[:iterations] + ["none"] * max(0, iterations - len(kinds))
    rng.shuffle(kinds)
    return kinds


def soak(iterations: int, seed: int, work: Path) -> dict:
    from rlhf_core.config import load_config, to_yaml
    from rlhf_core.run.layout import RunDir, write_config
    from rlhf_core.paths import resolve_model_path

    rng = random.Random(seed)
    run = RunDir(work / "run")
    run.root.mkdir(parents=True)
    cfg = load_config(str(REPO / "configs" / "demo.yaml"), overrides(resolve_model_path("tiny"), work, iterations))
    write_config(run, to_yaml(cfg))
    plan = schedule(iterations, rng)
    injected, recovered, missed, notes = Counter(), Counter(), Counter(), []
    done = 0
    for k, kind in enumerate(plan, start=1):
        if kind in ("kill_point", "kill_time") and done < k - 1:  # reach k-1 cleanly, so the kill lands in k
            _require(launch(run.root, k - 1, {}) == 0, f"clean run to {k - 1} failed")
            done = k - 1
        if kind == "kill_point":
            point = rng.choice(FAULT_POINTS)
            rc = launch(run.root, k, {"point": point})
            if rc == 137:
                injected[kind] += 1
                notes.append(f"iteration {k}: killed at {point}")
            else:
                missed[kind] += 1
                notes.append(f"iteration {k}: fault point {point} never reached (exit {rc})")
            recovered[kind] += _recover(run, k, rc == 137)
        elif kind == "kill_time":
            # within the iteration: a fixed window would mostly land after a fast iteration has finished
            after = rng.uniform(0.02, 1.0) * iteration_seconds(run, k - 1)
            rc = launch(run.root, k, {}, kill_after=after)
            if rc == -signal.SIGKILL:
                injected[kind] += 1
                notes.append(f"iteration {k}: SIGKILL {after:.2f} s in")
            else:
                missed[kind] += 1
                notes.append(f"iteration {k}: SIGKILL {after:.2f} s in came after the iteration ended")
            recovered[kind] += _recover(run, k, rc == -signal.SIGKILL)
        elif kind == "nan":
            _require(launch(run.root, k, {"nan": True}) == 0, f"iteration {k} with NaN advantages did not finish")
            reasons = [e.get("reason", "") for e in run.events() if e["kind"] == "rollback" and e["iteration"] == k]
            injected[kind] += 1
            recovered[kind] += int(any(r.startswith("non-finite update") for r in reasons) and _committed(run, k))
            notes.append(f"iteration {k}: NaN advantages → {reasons[:1]}")
        else:
            if kind == "corrupt" or k == iterations:
                _require(launch(run.root, k, {}) == 0, f"run to iteration {k} failed")
            if kind == "corrupt":
                what = corrupt_checkpoint(run, k, rng)
                injected[kind] += 1
                notes.append(f"iteration {k}: corrupted {what}")
                before = sum(e["kind"] in ("repaired", "fallback") for e in run.events())
                _require(launch(run.root, k, {}) == 0, f"resume after corrupting iteration {k} failed")
                noticed = sum(e["kind"] in ("repaired", "fallback") for e in run.events()) > before
                recovered[kind] += int(noticed and _committed(run, k))
        done = k if kind != "none" or k == iterations else done
    if done < iterations:
        _require(launch(run.root, iterations, {}) == 0, "final run failed")
    return {"injected": injected, "recovered": recovered, "missed": missed, "lost": data_lost(run, cfg, iterations),
            "notes": notes}


def _recover(run, k: int, was_killed: bool) -> int:
    rc = launch(run.root, k, {})
    return int(was_killed and rc == 0 and _committed(run, k))


def _committed(run, k: int) -> bool:
    from rlhf_core.run.lifecycle import read_last_good

    record = read_last_good(run)
    return bool(record and record["iteration"] >= k)


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise SystemExit(f"soak: {what} (see worker.log)")


def data_lost(run, cfg, iterations: int) -> dict[str, list[str]]:
    """What a recovery failed to keep: uncommitted iterations, unreadable files, short rollouts,
    rollbacks without a reason, temporaries left over, a last-good checkpoint that does not verify."""
    import pyarrow.parquet as pq

    from rlhf_core.io.atomic import TMP_MARK
    from rlhf_core.run.lifecycle import committed_iterations, read_last_good
    from rlhf_core.io.checksums import verify_checkpoint

    lost: dict[str, list[str]] = {"iterations": [], "unreadable": [], "rows": [], "reasons": [], "temporaries": [],
                                  "last_good": []}
    committed = committed_iterations(run)
    for k in range(1, iterations + 1):
        if k not in committed:
            lost["iterations"].append(str(k))
        if pq.ParquetFile(run.rollout(k)).metadata.num_rows != cfg.data.train_batch_size:
            lost["rows"].append(f"iter_{k}/rollout.parquet")
    for p in run.root.rglob("*"):
        if TMP_MARK in p.name:
            lost["temporaries"].append(str(p.relative_to(run.root)))
        elif p.is_file() and p.suffix in (".parquet", ".json"):
            try:
                pq.read_table(p) if p.suffix == ".parquet" else json.loads(p.read_text())
            except Exception as exc:  # noqa: BLE001 - any failure to read is data lost
                lost["unreadable"].append(f"{p.relative_to(run.root)}: {exc}")
    lost["reasons"] = [str(e["iteration"]) for e in run.events() if e["kind"] == "rollback" and not e.get("reason")]
    record = read_last_good(run)
    try:
        assert record and record["iteration"] == iterations, f"last_good is {record}"
        verify_checkpoint(run.root / record["checkpoint"])
    except Exception as exc:  # noqa: BLE001
        lost["last_good"].append(str(exc))
    return {k: v for k, v in lost.items() if v}


def print_table(result: dict, iterations: int, seed: int, seconds: float) -> None:
    injected, recovered, missed = result["injected"], result["recovered"], result["missed"]
    print(f"soak: {iterations} iterations, seed {seed}, {seconds:.0f} s")
    print(f"{'fault':<12} {'injected':>8} {'recovered':>9} {'missed':>7}")
    for kind in KINDS:
        print(f"{kind:<12} {injected[kind]:>8} {recovered[kind]:>9} {missed[kind]:>7}")
    print(f"{'total':<12} {sum(injected.values()):>8} {sum(recovered.values()):>9} {sum(missed.values()):>7}")
    print("(missed: drawn but never fired — the fault point was not reached, or the SIGKILL came after the "
          "iteration had finished; the run still had to carry on)")
    for note in result["notes"]:
        if "never reached" in note or "came after" in note:
            print(f"  {note}")
    lost = result["lost"]
    print(f"data lost: {sum(len(v) for v in lost.values())}" + (f"  {lost}" if lost else ""))


def fresh_dir(text: str) -> Path:
    """--work-dir: the soak starts a new run in DIR/run, so an earlier soak's run there would be refused
    only after the model is built."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file; give a directory")
    if (path / "run").exists():
        raise argparse.ArgumentTypeError(f"{text} already holds a soak run ({path / 'run'}); give a new directory")
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=positive_int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", type=fresh_dir, help="where the run goes, a directory without a run in it "
                   "(default: a temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the temporary work directory")
    p.add_argument("--verbose", action="store_true", help="list each fault")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--until", type=int, help=argparse.SUPPRESS)
    p.add_argument("--fault", default="{}", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, args.until, json.loads(args.fault))
        return 0
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="rlhf-soak-"))
    os.environ.setdefault("RLHF_HOME", str(work / ".rlhf"))
    started = time.perf_counter()
    result = soak(args.iterations, args.seed, work)
    if args.verbose:
        print("\n".join(result["notes"]))
    print_table(result, args.iterations, args.seed, time.perf_counter() - started)
    if not (args.keep or args.work_dir):
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 0 if not result["lost"] and result["injected"] == result["recovered"] else 1


if __name__ == "__main__":
    sys.exit(main())
