"""A training world over several nodes (trainer.nnodes > 1) on torchrun's static rendezvous: two
"nodes" on 127.0.0.1 — node 0 through the update stage's launcher, node 1 through the real
`rlhf node join` — train bit-identically to one node with two processes; a node that never joins
fails node 0 within its join timeout, naming the node and the command to run there; and the
config's rules for several nodes."""

from __future__ import annotations

import json
import os
import signal
import threading
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhf_core.config import config_hash, load_config, to_yaml
from rlhf_core.config.errors import ConfigError
from rlhf_core.notes import said
from rlhf_core.config.resolve import update_nodes, update_rendezvous, update_world_size
from rlhf_core.data.schemas import ADVANTAGES
from rlhf_core.errors import RLHFError
from rlhf_core.io.atomic import atomic_write_json, atomic_write_parquet
from rlhf_core.run.layout import RunDir, write_config
from rlhf_core.run.lifecycle import commit_iteration
from rlhf_core.stages.init_critic import run_init_critic
from rlhf_core.stages.update import config_sections, run_update
from rlhf_core.training.distributed import free_port
from rlhf_core.training import nodes
from rlhf_core.training.nodes import LaunchResult, NodeWatch, group_request, launch_failure
from rlhf_core.training.resident import resident_possible, update_once
from rlhf_core.training.synthetic import synthetic_advantages

CRITIC_FREE = "algorithm.adv_estimator=grpo"
RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


@pytest.fixture
def no_world(monkeypatch):
    """No rendezvous variables from an earlier in-process update (a world of one) in this test."""
    for key in RENDEZVOUS:
        monkeypatch.delenv(key, raising=False)


def _config(model_dir, *overrides):
    return load_config(None, [f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.actor.ppo_mini_batch_size=6",
                              "actor_rollout_ref.actor.use_dynamic_bsz=true", "data.max_prompt_length=20",
                              "data.max_response_length=20", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=40",
                              "actor_rollout_ref.actor.optim.lr=1e-4", "actor_rollout_ref.actor.use_kl_loss=true",
                              "trainer.resident_models=false", *overrides])


def _two_nodes(port: int, *more: str) -> tuple[str, ...]:
    return ("trainer.nnodes=2", "trainer.master_addr=127.0.0.1", f"trainer.master_port={port}", *more)


def _prepare(run: RunDir, cfg, model_dir) -> None:
    atomic_write_parquet(run.advantages(1), synthetic_advantages(model_dir, 12, seed=0), ADVANTAGES)
    write_config(run, to_yaml(cfg))
    run_init_critic(cfg, run)  # seeded by trainer.seed: the same critic in every run


def _tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file of a checkpoint (weights, optimizer shards of each rank)."""
    out = {}
    for f in sorted(checkpoint.rglob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            out[f"{f.relative_to(checkpoint)}:{name}"] = t
    return out


def _joiner(run: RunDir, node_rank: int, env: dict[str, str], from_a_terminal) -> subprocess.Popen:
    command = [sys.executable, "-m", "rlhf_cli.main", "node", "join", "--run-dir", str(run.root),
               "--node-rank", str(node_rank)]
    return subprocess.Popen(from_a_terminal(command), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
@pytest.mark.deepspeed
def test_two_nodes_train_bit_identically_to_one_node_with_two_processes(tiny_model_dir, tmp_path, subprocess_env,
                                                                        no_world, from_a_terminal):
    one, two = RunDir(tmp_path / "one_node"), RunDir(tmp_path / "two_nodes")
    # critic-free (the critic is one more engine on the same collectives): half the engines to build
    cfg_one = _config(tiny_model_dir, "trainer.nproc=2", CRITIC_FREE)
    cfg_two = _config(tiny_model_dir, *_two_nodes(free_port(), "trainer.node_join_timeout_s=120"), CRITIC_FREE)
    assert update_nodes(cfg_two.trainer, 0) == (2, 1)
    _prepare(one, cfg_one, tiny_model_dir)
    _prepare(two, cfg_two, tiny_model_dir)
    joiner = _joiner(two, 1, subprocess_env(), from_a_terminal)  # started first: its start-up overlaps the reference update
    try:
        run_update(cfg_one, one, 1)
        result = run_update(cfg_two, two, 1)  # node 0: torchrun --node_rank 0, waits for node 1
        assert "2 process(es)" in result.summary[0]
        assert not two.update_request.exists()  # withdrawn once the launch ended
        # the run's last iteration committed: the joiner sees the run finished and leaves by itself
        write_config(two, to_yaml(_config(tiny_model_dir, *_two_nodes(1), "trainer.total_iterations=1", CRITIC_FREE)))
        commit_iteration(two, 1)
        try:
            out, _ = joiner.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the joiner ignored Ctrl-C for 30 s (this process's SIGINT handler: "
                        f"{signal.getsignal(signal.SIGINT)!r}, blocked: {signal.pthread_sigmask(signal.SIG_BLOCK, [])})")
    finally:
        if joiner.poll() is None:
            joiner.kill()
    assert joiner.returncode == 0, out[-3000:]
    assert "node 1: joining launch" in out and "the run is finished (iteration 1 of 1 is committed)" in out
    (record,) = two.nodes_dir.glob("*.node1.json")
    assert json.loads(record.read_text())["exit"] == 0

    a, b = _tensors(one.checkpoint(1)), _tensors(two.checkpoint(1))
    assert set(a) == set(b) and any("rank1-of-2" in k for k in b)  # node 1's rank wrote its shards here
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different[:5]
    before = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    assert any(not torch.equal(before[k.split(":", 1)[1]], t) for k, t in b.items() if k.startswith("actor/model"))


@pytest.mark.deepspeed
def test_a_node_that_never_joins_fails_node_0_naming_it_and_the_command(tiny_model_dir, tmp_path, no_world):
    run = RunDir(tmp_path / "run")
    cfg = _config(tiny_model_dir, *_two_nodes(free_port(), "trainer.node_join_timeout_s=1"))
    run.iter_dir(1).mkdir(parents=True)
    started = time.monotonic()
    with pytest.raises(RLHFError) as err:
        update_once(cfg, run, 1)
    assert time.monotonic() - started < 30
    message = str(err.value)
    assert "update of iteration 1 on 2 nodes" in message
    assert "node(s) 1 did not join within trainer.node_join_timeout_s=1s" in message
    assert f"rlhf node join --run-dir {run.root} --node-rank 1" in message and "every node sees" in message
    assert not run.update_request.exists()


def test_the_joiner_leaves_on_ctrl_c(tmp_path, subprocess_env, from_a_terminal):
    run = RunDir(tmp_path / "run")
    joiner = _joiner(run, 1, subprocess_env(), from_a_terminal)
    try:
        line = joiner.stdout.readline()  # "waiting for updates": the loop runs
        assert "node 1: waiting for updates" in line
        joiner.send_signal(signal.SIGINT)
        try:
            out, _ = joiner.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the joiner ignored Ctrl-C for 30 s (this process's SIGINT handler: "
                        f"{signal.getsignal(signal.SIGINT)!r}, blocked: {signal.pthread_sigmask(signal.SIG_BLOCK, [])})")
    finally:
        if joiner.poll() is None:
            joiner.kill()
    assert joiner.returncode == 130 and "interrupted" in out


# config ---------------------------------------------------------------------------------------
def test_several_nodes_need_node_0s_address(tiny_model_dir, no_world):
    with pytest.raises(ConfigError, match=r"trainer.nnodes=2: .*trainer.master_addr=HOST .*MASTER_ADDR"):
        _config(tiny_model_dir, "trainer.nnodes=2")


def test_the_address_defaults_to_master_addr_and_port_in_the_environment(tiny_model_dir, monkeypatch, no_world):
    monkeypatch.setenv("MASTER_ADDR", "node0.cluster")
    monkeypatch.setenv("MASTER_PORT", "29611")
    cfg = _config(tiny_model_dir, "trainer.nnodes=2")
    assert update_rendezvous(cfg.trainer, os.environ) == ("node0.cluster", 29611)
    assert update_rendezvous(cfg.trainer, {}) == (None, 29500)  # torchrun's default port
    # inside a launcher's world the variables are that world's, not the next one's
    assert update_rendezvous(cfg.trainer, {"MASTER_ADDR": "x", "MASTER_PORT": "1", "WORLD_SIZE": "1"}) == (None, 29500)
    keys = _config(tiny_model_dir, *_two_nodes(4000))
    assert update_rendezvous(keys.trainer, os.environ) == ("127.0.0.1", 4000)  # the keys win
    with pytest.raises(ConfigError, match="MASTER_PORT='http' .*trainer.master_port"):
        update_rendezvous(cfg.trainer, {"MASTER_PORT": "http"})


def test_world_is_nnodes_times_processes_per_node(tiny_model_dir):
    two = _two_nodes(4000)
    assert update_nodes(_config(tiny_model_dir, *two).trainer, 0) == (2, 1)  # CPU: one process per node
    assert update_nodes(_config(tiny_model_dir, *two, "trainer.nproc=4").trainer, 0) == (2, 2)
    assert update_nodes(_config(tiny_model_dir, *two, "trainer.n_gpus_per_node=8").trainer, 8) == (2, 8)  # verl's world
    assert update_world_size(_config(tiny_model_dir, *two, "trainer.n_gpus_per_node=8").trainer, 8) == 16
    assert update_nodes(_config(tiny_model_dir).trainer, 0) == (1, 1)  # one machine: as before
    with pytest.raises(ConfigError, match=r"trainer.nproc=3: must be a multiple of trainer.nnodes=2"):
        _config(tiny_model_dir, *two, "trainer.nproc=3")
    with pytest.raises(ConfigError, match=r"trainer.master_port=70000: must be a TCP port"):
        _config(tiny_model_dir, "trainer.master_port=70000")
    with pytest.raises(ConfigError, match=r"trainer.nnodes=0: must be >= 1"):
        _config(tiny_model_dir, "trainer.nnodes=0")


def test_several_nodes_keep_their_ranks_as_one_worker_group_saying_so(tiny_model_dir):
    cfg = _config(tiny_model_dir, *_two_nodes(4000), "trainer.resident_models=true")
    assert resident_possible(cfg) is None
    assert any("trainer.nnodes=2: the update's ranks on every node are one worker group" in line for line in said())


def test_the_rendezvous_keys_do_not_change_the_updates_config_hash(tiny_model_dir):
    base = _config(tiny_model_dir, *_two_nodes(4000))
    moved = _config(tiny_model_dir, "trainer.nnodes=2", "trainer.master_addr=10.0.0.7", "trainer.master_port=4100",
                    "trainer.node_join_timeout_s=30")
    assert config_hash(base, config_sections(base)) == config_hash(moved, config_sections(moved))
    other_world = _config(tiny_model_dir, *_two_nodes(4000), "trainer.nproc=4")
    assert config_hash(other_world, config_sections(other_world)) != config_hash(base, config_sections(base))


def _request(iteration: int, nnodes: int = 2, master_addr: str = "127.0.0.1"):
    """A launch of the group for ``iteration``'s update alone (its store never listened on)."""
    return group_request(nnodes, 1, master_addr, 4000, join_timeout_s=60, store=f"{master_addr}:4001", device="cpu",
                         iteration=iteration)


def test_a_node_whose_ranks_failed_is_named_in_node_0s_error(tmp_path):
    run = RunDir(tmp_path / "run")
    request = _request(3, nnodes=3, master_addr="10.0.0.1")
    atomic_write_json(run.node_record(request.launch_id, 1), {"status": "exited", "exit": 0})
    atomic_write_json(run.node_record(request.launch_id, 2), {"status": "exited", "exit": 1})
    message = str(launch_failure(run, request, LaunchResult(1, ["..."], [])))
    assert "update of iteration 3 on 3 nodes" in message and "node 2 (exit 1) failed" in message
    assert "node 1 " not in message


def test_node_0_stops_when_a_joined_node_stops_beating(tmp_path, monkeypatch):
    """A node whose machine dies leaves no exit record; its heartbeat stops. Node 0 (here a
    stand-in torchrun that would wait a minute) is stopped, and the error names the node."""
    monkeypatch.setattr(nodes, "FAILED_NODE_GRACE_S", 0.0)
    monkeypatch.setattr(nodes, "HEARTBEAT_S", 0.1)
    run = RunDir(tmp_path / "run")
    request = _request(1, nnodes=3)
    done = threading.Event()
    beating = threading.Thread(target=nodes._beat, args=(run, request, 1, done))  # node 1 keeps beating
    beating.start()
    atomic_write_json(run.node_record(request.launch_id, 2), {"status": "joined", "beat": 0})  # node 2 died
    node_0 = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    started = time.monotonic()
    try:
        watch = NodeWatch(run, request, dead_after_s=1.0)
        watch(node_0)  # returns once it has stopped node 0
    finally:
        done.set()
        beating.join()
        node_0.kill()
    assert node_0.wait() != 0 and time.monotonic() - started < 15
    assert watch.silent == [2]
    message = str(launch_failure(run, request, LaunchResult(node_0.returncode, [], []), watch))
    assert "node(s) 2 stopped answering (no heartbeat in 1s" in message


def _wait_for(lines: list[str], text: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(text in line for line in lines):
        assert time.monotonic() < deadline, (text, lines)
        time.sleep(0.05)


def test_the_joiner_never_takes_a_launch_twice_nor_a_stale_one_and_leaves_on_a_halt(tiny_model_dir, tmp_path):
    run = RunDir(tmp_path / "run")
    write_config(run, to_yaml(_config(tiny_model_dir, *_two_nodes(4000))))
    taken = _request(1)
    atomic_write_json(run.node_record(taken.launch_id, 1), {"status": "exited", "exit": 0})  # a joiner before a restart
    atomic_write_json(run.update_request, asdict(taken))
    said_lines: list[str] = []
    joiner = threading.Thread(target=nodes.join, args=(run, 1, said_lines.append), daemon=True)
    joiner.start()
    _wait_for(said_lines, f"launch {taken.launch_id} (iteration 1) was already joined by this node")
    stale = _request(2)
    atomic_write_json(run.update_request, {**asdict(stale), "created_at": time.time() - 61})
    _wait_for(said_lines, f"skipping launch {stale.launch_id} (iteration 2): older than its join timeout")
    run.append_event("halt", 2, reason="KL above the threshold")
    joiner.join(timeout=10)
    assert not joiner.is_alive()
    assert "the run is finished (halted at iteration 2: KL above the threshold)" in said_lines[-1]
    assert not run.node_record(stale.launch_id, 1).exists()  # nothing ran for it
