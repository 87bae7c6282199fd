"""One process of test_rng_resume: run the real stages of a tiny run on a run directory.

    python rng_resume_worker.py RUN_DIR FIRST LAST UNTIL PRESET [key=value ...]

Runs the setup stages (skipped when done), then for each iteration FIRST..LAST rollout, score,
gae, update and guard, settling the guard's verdict (commit or roll back) as the pipeline does;
iteration LAST stops after stage UNTIL ("guard": the whole iteration). Stages already done on disk
are skipped by their manifests, as after a resume.
"""

from __future__ import annotations

import sys

from rlhf_core.config import load_config, to_yaml
from rlhf_core.run.layout import RunDir, write_config
from rlhf_core.run.lifecycle import settle
from rlhf_core.control.plan import fill_total_iterations
from rlhf_core.run.stage_order import ITERATION_STAGES, SETUP_STAGES
from rlhf_core.stages.catalog import stage_functions


def main(run_dir: str, first: int, last: int, until: str, preset: str, overrides: list[str]) -> None:
    run = RunDir(run_dir)
    cfg = load_config(preset, overrides)
    write_config(run, to_yaml(cfg))
    for name in SETUP_STAGES:
        stage_functions(name).run(cfg, run, None)
        cfg = fill_total_iterations(cfg, run)
    for k in range(first, last + 1):
        stages = ITERATION_STAGES[:ITERATION_STAGES.index(until) + 1] if k == last else ITERATION_STAGES
        for name in stages:
            result = stage_functions(name).run(cfg, run, k)
            print(f"iteration {k} {name}: {'skipped' if result.skipped else 'ran'}")
        if "guard" in stages:
            print(f"iteration {k}: {settle(run, k, policy='test', attempt=1)}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6:])
