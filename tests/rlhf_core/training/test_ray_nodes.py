"""A training world over several nodes (trainer.nnodes > 1) placed by a real Ray cluster: two
raylets on this machine (``ray.cluster_utils.Cluster``), each a node with its own resources. Four
ranks, two per node, train bit-identically to the same four ranks under torchrun on one node; a
cluster with too few nodes is refused within the placement timeout, naming what is missing, with
nothing left on the cluster; a node lost while its ranks work fails the group naming that node,
and its ranks do not outlive it. Needs the ray extra (`make test-ray`)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from rlhf_core.config import load_config, to_yaml
from rlhf_core.data.schemas import ADVANTAGES
from rlhf_core.errors import RLHFError
from rlhf_core.io.atomic import atomic_write_parquet
from rlhf_core.run.layout import RunDir, write_config
from rlhf_core.stages.init_critic import run_init_critic
from rlhf_core.stages.update import run_update
from rlhf_core.training.synthetic import synthetic_advantages
from rlhf_core.training.worker_group import RayPlacement, WorkerGroup

ray = pytest.importorskip("ray", reason="needs the ray extra: pip install -e '.[ray]' (make test-ray)")
cluster_utils = pytest.importorskip("ray.cluster_utils")

pytestmark = [pytest.mark.ray]
CRITIC_FREE = "algorithm.adv_estimator=grpo"
RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
SLEEPER = Path(__file__).with_name("ray_sleeper_entry.py")


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    """(the cluster, its second node)."""
    (worker,) = [node for node in ray_cluster.list_all_nodes() if node is not ray_cluster.head_node]
    return ray_cluster, worker


@pytest.fixture
def no_world(monkeypatch):
    for key in RENDEZVOUS:
        monkeypatch.delenv(key, raising=False)


def _config(model_dir, cluster_address: str, *overrides):
    return load_config(None, [f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.actor.ppo_mini_batch_size=12",
                              "actor_rollout_ref.actor.use_dynamic_bsz=true", "data.max_prompt_length=20",
                              "data.max_response_length=20", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=40",
                              "actor_rollout_ref.actor.optim.lr=1e-4", "actor_rollout_ref.actor.use_kl_loss=true",
                              "trainer.resident_models=false", f"trainer.ray_address={cluster_address}",
                              CRITIC_FREE, *overrides])


def _prepare(run: RunDir, cfg, model_dir) -> None:
    atomic_write_parquet(run.advantages(1), synthetic_advantages(model_dir, 12, seed=0), ADVANTAGES)
    write_config(run, to_yaml(cfg))
    run_init_critic(cfg, run)


def _tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(checkpoint.rglob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            out[f"{f.relative_to(checkpoint)}:{name}"] = t
    return out


def _nothing_left() -> None:
    """No placement group of ours holds anything and every CPU of the cluster is free again (each
    rank's actor held one)."""
    groups = ray.util.placement_group_table()
    assert all(g["state"] == "REMOVED" for g in groups.values()), groups
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources().get("CPU", 0):
        assert time.monotonic() < deadline, (ray.available_resources(), ray.cluster_resources())
        time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.deepspeed
def test_four_ranks_on_two_nodes_train_as_four_on_one(cluster, tiny_model_dir, tmp_path, no_world):
    one, two = RunDir(tmp_path / "one_node"), RunDir(tmp_path / "two_nodes")
    address = cluster[0].address
    cfg_one = _config(tiny_model_dir, address, "trainer.nproc=4")
    cfg_two = _config(tiny_model_dir, address, "trainer.nnodes=2", "trainer.nproc=4")
    _prepare(one, cfg_one, tiny_model_dir)
    _prepare(two, cfg_two, tiny_model_dir)
    run_update(cfg_one, one, 1)
    result = run_update(cfg_two, two, 1)
    assert "4 process(es)" in result.summary[0]
    a, b = _tensors(one.checkpoint(1)), _tensors(two.checkpoint(1))
    assert set(a) == set(b) and any("rank3-of-4" in k for k in b)  # the second node's ranks wrote their shards here
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different[:5]
    log = (two.root / "logs").glob("update-iter_1*")
    assert any(log), list((two.root / "logs").iterdir())
    _nothing_left()


def test_a_cluster_with_too_few_nodes_is_refused_naming_what_it_lacks(cluster, tiny_model_dir, tmp_path, no_world):
    run = RunDir(tmp_path / "run")
    cfg = _config(tiny_model_dir, cluster[0].address, "trainer.nnodes=3", "trainer.ray_placement_timeout_s=2")
    _prepare(run, cfg, tiny_model_dir)
    started = time.monotonic()
    with pytest.raises(RLHFError) as err:
        run_update(cfg, run, 1)
    assert time.monotonic() - started < 60
    message = str(err.value)
    assert "cannot place the update's 3 ranks within 2 s (trainer.ray_placement_timeout_s)" in message, message
    assert "it needs 3 nodes with 1 CPU free each" in message and "has 2 node(s)" in message, message
    assert "ray start --address=HEAD_IP:6379" in message
    _nothing_left()


def test_a_lost_node_fails_the_group_naming_it_and_leaves_no_rank(cluster, tmp_path, no_world):
    c, worker = cluster
    placement = RayPlacement(nnodes=2, nproc_per_node=1, device="cpu", address=c.address, timeout_s=30)
    group = WorkerGroup(str(SLEEPER), 2, [str(tmp_path)], what="test group", placement=placement,
                        log=tmp_path / "group.log")
    pids = [int(p.read_text()) for p in sorted(tmp_path.glob("rank*.pid"))]
    assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
    lost_ip = group._ranks.nodes[1][0]
    outcome: dict = {}

    def call() -> None:
        try:
            group.call("sleep", seconds=120)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            outcome["error"] = exc

    caller = threading.Thread(target=call)
    caller.start()
    time.sleep(2)
    c.remove_node(worker)  # its raylet and workers die: the rank on it must go with them
    caller.join(timeout=90)
    assert not caller.is_alive(), "the group did not notice its lost node within 90 s"
    message = str(outcome.get("error"))
    assert isinstance(outcome.get("error"), RLHFError), message
    assert f"lost Ray node {lost_ip}" in message, message
    deadline = time.monotonic() + 30
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline, [p for p in pids if psutil.pid_exists(p)]
        time.sleep(0.5)
    c.add_node(num_cpus=2)  # the next test's cluster is whole again
    c.wait_for_nodes()


def test_no_cluster_at_the_address_is_one_line_at_once():
    """In a process of its own: this one is already a driver of the test cluster."""
    from rlhf_core.training.distributed import free_port

    address = f"127.0.0.1:{free_port()}"
    code = (f"from rlhf_core.training.ray_ranks import connect\nconnect({address!r})")
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert time.monotonic() - started < 30  # ray.init alone retries a dead address for minutes
    assert f"RLHFError: trainer.nnodes > 1 runs the update's ranks on a Ray cluster, and nothing answers at " \
           f"'{address}'" in out.stderr and "`ray start --head`" in out.stderr, out.stderr[-2000:]
