"""The commands that answer at once stay light: `rlhf --help`, a RUN that is no run directory and
`rlhf query` load neither torch nor the config schema, and the config package and its schema load
without torch (torch's import alone takes ~1.7 s on a 2-core machine; benchmarks/bench_cli_start.py
measures the commands; the status of a whole run: tests/flows/test_state_integrity_flow.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "prefect", "mlflow", "deepspeed", "rlhf_core.config")


def _loaded_after(code: str) -> list[str]:
    probe = f"import sys, json\n{code}\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("code", [
    "import rlhf_cli.main",
    "import rlhf_cli.querying",
    "from rlhf_cli.main import main\nimport contextlib, io\n"
    "with contextlib.redirect_stderr(io.StringIO()):\n    assert main(['status', '/nonexistent/run']) == 2",
], ids=["entry-point", "query-command", "status-of-no-run"])
def test_the_quick_commands_load_no_heavy_library(code):
    assert _loaded_after(code) == []


def test_a_query_over_a_run_loads_no_heavy_library(tmp_path):
    (tmp_path / "config.yaml").write_text("data: {}\n")
    code = (f"from rlhf_cli.main import main\nassert main(['query', {str(tmp_path)!r}, "
            "'SELECT count(*) AS n FROM metrics']) == 0")
    assert _loaded_after(code) == []


def test_the_config_loads_without_torch_until_a_name_is_looked_up():
    """The schema checks algorithm names against tables that import their torch providers only when
    asked, so a command that reads a config's sections (rlhf status) never imports torch."""
    code = ("from rlhf_core.config import schema, loader\n"
            "from rlhf_core.run.layout import RunDir\nfrom rlhf_cli import run_status")
    assert _loaded_after(code) == ["rlhf_core.config"]
