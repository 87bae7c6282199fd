"""`rlhf node join` is retired for Ray: an old script's line answers with the steps that replace it."""

from __future__ import annotations

import subprocess
import sys


def test_node_join_answers_with_the_ray_steps(tmp_path):
    out = subprocess.run([sys.executable, "-m", "rlhf_cli.main", "node", "join", "--run-dir", str(tmp_path),
                          "--node-rank", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("rlhf: error: `rlhf node join` is retired: the update's nodes are a Ray cluster"), line
    assert "ray start --head" in line and "ray start --address=HEAD_IP:6379" in line and "docs/scaling.md" in line
    assert list(tmp_path.iterdir()) == []
