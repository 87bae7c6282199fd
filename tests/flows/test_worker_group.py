"""An update on several processes keeps its models in a worker group for the whole flow run
(``training.group_trainer.GroupTrainer``): two gloo ranks on CPU (actor at ZeRO-3, critic at ZeRO-0),
started once, train, roll back from
their in-memory snapshots, serve the stages' model passes and save only at save points — and
every table and weight (optimizer shards included) equals the design that starts torchrun ranks
for every update and checkpoints every iteration. A kill between save points resumes bit for bit,
and a CLI rerun rebuilds a state that was never written on as many ranks as trained it."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from rlhf_core.run.layout import RunDir
from rlhf_core.run.lifecycle import committed_iterations, read_last_good
from rlhf_core.run.manifest import read_manifest

pytestmark = [pytest.mark.prefect, pytest.mark.slow, pytest.mark.deepspeed]

TWO_RANKS = ("trainer.nproc=2", "trainer.test_freq=-1", "trainer.save_freq=2",
             "actor_rollout_ref.actor.deepspeed_config.zero_stage=3")
"""The actor partitioned (ZeRO-3: the stages borrow a whole copy), the critic not (ZeRO-0: its own module)."""
DEMO_LR = 1e-5
TOO_HIGH = 10_000
BREACH_THEN_RETRY = (f"actor_rollout_ref.actor.optim.lr={DEMO_LR * TOO_HIGH}", "trainer.on_kl_breach=retry",
                     f"trainer.retry_lr_divisor={TOO_HIGH}", "trainer.max_rollbacks=1")
"""Iteration 1's first update breaches the KL guard and is rolled back; the retry (at the demo's lr)
commits, and the run goes on at that lr."""


def optimizer_shards(checkpoint) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted((checkpoint / "deepspeed").glob("*.safetensors")):
        out.update({f"{f.name}/{k}": v for k, v in load_file(str(f)).items()})
    return out


def no_orphans(before: set[int], runs: Path) -> list[str]:
    """Processes of a worker group (or its torchrun) of a run under ``runs`` started since ``before``
    and still alive (another test worker's groups, at the same time, are none of this test's)."""
    alive = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if proc.info["pid"] not in before and "rlhf_core.stages.group_entry" in cmd and str(runs) in cmd:
            alive.append(cmd)
    return alive


@pytest.fixture(scope="module")
def group_run(prefect_server, flow_run, tmp_path_factory) -> RunDir:
    """Two iterations on a worker group of two ranks, the first with a rollback and a retry."""
    runs = tmp_path_factory.mktemp("group")
    before = {p.pid for p in psutil.process_iter()}
    run = RunDir(flow_run(runs, "grp", *TWO_RANKS, *BREACH_THEN_RETRY,
                          iterations=2)["run_dir"])
    assert no_orphans(before, runs) == []  # the group left with the flow run
    return run


def test_the_group_trains_and_rolls_back_exactly_as_fresh_ranks_each_iteration(
        group_run, prefect_server, flow_run, same_tables, same_weights, tmp_path):
    fresh = RunDir(flow_run(tmp_path / "runs", "fresh", *TWO_RANKS, *BREACH_THEN_RETRY,
                            "trainer.resident_models=false", iterations=2)["run_dir"])
    for run in (group_run, fresh):
        assert committed_iterations(run) == [1, 2]
        kinds = [e["kind"] for e in run.events() if e.get("iteration") in (1, 2)]
        assert kinds.count("rollback") == 1 and kinds.count("commit") == 2
    same_tables(group_run, fresh, (1, 2))
    same_weights(group_run.checkpoint(2), fresh.checkpoint(2))
    mine, theirs = optimizer_shards(group_run.checkpoint(2)), optimizer_shards(fresh.checkpoint(2))
    assert sorted(mine) == sorted(theirs) and any("rank1-of-2" in k for k in mine)
    assert [k for k in mine if not torch.equal(mine[k], theirs[k])] == []
    # durable state at the save point and the end only; the stages borrowed the ranks' modules
    assert not group_run.checkpoint(1).exists() and group_run.checkpoint(2).is_dir()
    for k in (1, 2):
        manifest = read_manifest(group_run, k)
        assert manifest["update"]["metrics"]["perf/resident"] == 1.0
        assert manifest["update"]["metrics"]["perf/world_size"] == 2.0
        assert "process_launch" not in (manifest["update"].get("io") or {})
    assert not list(group_run.root.glob("iter_*/.published*"))  # no published copy outlives the group


def test_a_kill_between_save_points_resumes_on_a_new_group_to_the_same_bits(
        group_run, killed_run, flow_run, same_tables, same_weights, tmp_path):
    runs = tmp_path / "runs"
    before = {p.pid for p in psutil.process_iter()}
    run = killed_run(runs, "grp", *TWO_RANKS, *BREACH_THEN_RETRY, iterations=2, at="iter_2/guard.json")
    assert read_last_good(run)["iteration"] == 1
    assert not any(run.checkpoint(k).exists() for k in (1, 2))  # only in the ranks' memory
    assert _eventually_gone(before, runs)  # the ranks saw their coordinator die and left

    done = flow_run(runs, "grp", iterations=2, resume=run.root)
    assert done["last_good"]["iteration"] == 2
    same_tables(run, group_run, (1, 2))
    same_weights(run.checkpoint(2), group_run.checkpoint(2))


def test_a_cli_rerun_rebuilds_a_state_never_written_on_two_ranks(group_run, score_rerun_rebuilds):
    score_rerun_rebuilds(group_run)  # on two ranks, as it trained: one would not reproduce it


def _eventually_gone(before: set[int], runs: Path, seconds: float = 60.0) -> bool:
    deadline = time.monotonic() + seconds
    while no_orphans(before, runs):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


@pytest.mark.ray
def test_two_ray_nodes_keep_one_group_for_the_run_and_train_the_same_bits(group_run, flow_run, same_tables,
                                                                          same_weights, ray_cluster, tmp_path):
    """Two nodes of a real Ray cluster on this machine, one rank each, for a whole flow run (a breach,
    its retry, a save point): the same tables and bits as one node of two ranks under torchrun."""
    run = RunDir(flow_run(tmp_path / "runs", "nodes", *TWO_RANKS, *BREACH_THEN_RETRY, "trainer.nnodes=2",
                          f"trainer.ray_address={ray_cluster.address}", iterations=2)["run_dir"])
    log = (run.root / "logs" / "worker-group.log").read_text()
    assert log.count("--- ") == 1, log[-3000:]  # one launch for the whole run
    same_tables(run, group_run, (1, 2))  # two nodes of one rank = one node of two ranks
    same_weights(run.checkpoint(2), group_run.checkpoint(2))
    mine, theirs = optimizer_shards(run.checkpoint(2)), optimizer_shards(group_run.checkpoint(2))
    assert [k for k in mine if not torch.equal(mine[k], theirs[k])] == [] and sorted(mine) == sorted(theirs)


@pytest.mark.ray
def test_a_run_that_lost_a_ray_node_resumes_to_the_same_bits(group_run, flow_run, same_tables, same_weights,
                                                             ray_cluster, tmp_path):
    """A node leaves the cluster once iteration 1 is committed: iteration 2 fails naming it and the
    resume command; with a node back, `rlhf run --resume` continues exactly — the same tables and bits
    as one node of two ranks that never lost anything."""
    runs = tmp_path / "runs"
    run = RunDir(runs / "lost")
    (worker,) = [node for node in ray_cluster.list_all_nodes() if node is not ray_cluster.head_node]

    def remove_once_committed() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                if read_last_good(run)["iteration"] == 1:
                    break
            time.sleep(0.2)
        ray_cluster.remove_node(worker)

    remover = threading.Thread(target=remove_once_committed)
    remover.start()
    with pytest.raises(Exception) as lost:
        flow_run(runs, "lost", *TWO_RANKS, *BREACH_THEN_RETRY, "trainer.nnodes=2",
                 f"trainer.ray_address={ray_cluster.address}", iterations=2)
    remover.join()
    assert "lost Ray node" in str(lost.value) and "rlhf run --resume RUN" in str(lost.value), str(lost.value)
    assert committed_iterations(run) == [1]
    ray_cluster.add_node(num_cpus=2)
    ray_cluster.wait_for_nodes()
    flow_run(runs, "lost", iterations=2, resume=run.root)
    assert committed_iterations(run) == [1, 2]
    same_tables(run, group_run, (1, 2))
    same_weights(run.checkpoint(2), group_run.checkpoint(2))
