"""A config's inputs checked before any work: one error listing every missing file, directory or model.

Used by every entry point that starts work (`rlhf run`, the pipeline flow, the retrain flow), so a
typo or a model missing from the local Hugging Face cache fails before a run directory, a Prefect
server or an MLflow run exists. Nothing here builds, downloads or writes.
"""

from __future__ import annotations

from rlhf_core.config import ConfigError, RLHFConfig
from rlhf_core.data.readers import data_file_problem
from rlhf_core.paths import model_problem, resolve_path


def model_keys(cfg: RLHFConfig) -> list[tuple[str, str]]:
    """(key, value) of every model or tokenizer name the config sets (unset ones are left out)."""
    arr = cfg.actor_rollout_ref
    keys = [("actor_rollout_ref.model.path", arr.model.path),
            ("actor_rollout_ref.model.tokenizer_path", arr.model.tokenizer_path),
            ("actor_rollout_ref.ref.model_path", arr.ref.model_path),
            ("critic.model.path", cfg.critic.model.path),
            ("critic.model.tokenizer_path", cfg.critic.model.tokenizer_path)]
    if cfg.reward_model.enable:
        keys += [("reward_model.model.path", cfg.reward_model.model.path),
                 ("reward_model.model.input_tokenizer", cfg.reward_model.model.input_tokenizer)]
    return [(key, value) for key, value in keys if value]


def check_inputs(cfg: RLHFConfig) -> None:
    """Fail before any work when an input the config names is missing: data.train_files,
    data.val_files, every model / tokenizer (a local directory, a hub id in the local Hugging Face
    cache, or 'tiny') and an offline rollout file. One ConfigError lists every problem with its key."""
    problems = []
    for key, files in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)):
        problems += [f"{key}: {problem}" for problem in filter(None, (data_file_problem(resolve_path(f)) for f in files))]
    for key, value in model_keys(cfg):
        problem = model_problem(value)
        if problem:
            problems.append(f"{key}: {problem}")
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.name == "offline" and rollout.offline_path and not resolve_path(rollout.offline_path).is_file():
        problems.append(f"actor_rollout_ref.rollout.offline_path: file {rollout.offline_path!r} not found")
    if problems:
        raise ConfigError("; ".join(problems) + ". Fix the path(s) in the preset or the run's overrides "
                          "(paths are absolute, or relative to the current directory or the project root)")
