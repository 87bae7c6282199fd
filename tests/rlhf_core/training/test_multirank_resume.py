"""Exact resume on 2 data-parallel ranks (torchrun, gloo): the optimizer state saved by parameter
name is scattered back into each rank's ZeRO partition, padding included."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.deepspeed


def test_two_rank_resume_reproduces_the_next_step_exactly(tiny_model_dir, critic_init_dir, advantages_table,
                                                          tmp_path):
    from rlhf_core.data.schemas import ADVANTAGES
    from rlhf_core.io.atomic import atomic_write_parquet

    adv = tmp_path / "adv.parquet"
    atomic_write_parquet(adv, advantages_table, ADVANTAGES)
    out = tmp_path / "report.json"
    worker = Path(__file__).with_name("dp_resume_worker.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
                           "--nproc_per_node=2", str(worker), str(tiny_model_dir), str(critic_init_dir), str(adv),
                           str(out), "1", "2", "3"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report == {s: {"actor": 0.0, "critic": 0.0} for s in ("1", "2", "3")}
