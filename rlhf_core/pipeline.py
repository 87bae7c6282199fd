"""In-process pipeline driver used until the Prefect flow (flows/) takes over `rlhf run`.

Runs the setup stages (preprocess → pack) on a run directory and prints their summaries.
"""

from __future__ import annotations

from pathlib import Path

from rlhf_core.config import RLHFConfig, to_yaml
from rlhf_core.io.rundir import RunDir, RunLock, write_config
from rlhf_core.stages import STAGES


def run_pipeline(cfg: RLHFConfig, run_dir: str | Path, resume: bool = False) -> RunDir:
    run = RunDir(run_dir)
    with RunLock(run):
        write_config(run, to_yaml(cfg))
        print(f"run directory: {run.root}")
        for name in ("preprocess", "pack"):
            result = STAGES[name].load()(cfg, run, None)
            status = "skipped (up to date)" if result.skipped else f"done in {result.seconds:.1f}s"
            print(f"[{name}] {status}")
            for line in result.summary:
                print(f"  {line}")
    return run
