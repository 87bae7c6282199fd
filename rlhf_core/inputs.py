"""A config's paths checked before any work: one error listing every missing file or directory.

Used by every entry point that starts work (`rlhf run`, the pipeline flow, the retrain flow), so a
typo fails before a run directory, a Prefect server or an MLflow run exists.
"""

from __future__ import annotations

from rlhf_core.config import ConfigError, RLHFConfig
from rlhf_core.paths import resolve_path


def check_inputs(cfg: RLHFConfig) -> None:
    """Fail before any work when a path the config names is missing: data.train_files,
    data.val_files, the actor / tokenizer / reference / critic / reward-model directories and an
    offline rollout file. One ConfigError lists every problem with its key."""
    problems = []
    for key, files in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)):
        missing = [f for f in files if not resolve_path(f).is_file()]
        if missing:
            problems.append(f"{key}: file(s) not found: {', '.join(missing)}")
    arr = cfg.actor_rollout_ref
    directories = [("actor_rollout_ref.model.path", arr.model.path),
                   ("actor_rollout_ref.model.tokenizer_path", arr.model.tokenizer_path),
                   ("actor_rollout_ref.ref.model_path", arr.ref.model_path),
                   ("critic.model.path", cfg.critic.model.path)]
    if cfg.reward_model.enable:
        directories.append(("reward_model.model_path", cfg.reward_model.model_path))
    for key, value in directories:
        if value and value != "tiny" and not resolve_path(value).is_dir():
            problems.append(f"{key}: model directory {value!r} not found (local Hugging Face directories only, "
                            "or 'tiny')")
    offline = arr.rollout.offline_path
    if arr.rollout.name == "offline" and offline and not resolve_path(offline).is_file():
        problems.append(f"actor_rollout_ref.rollout.offline_path: file {offline!r} not found")
    if problems:
        raise ConfigError("; ".join(problems) + ". Fix the path(s) in the preset or the run's overrides "
                          "(paths are absolute, or relative to the current directory or the project root)")
