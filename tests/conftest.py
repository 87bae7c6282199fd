"""Shared fixtures: offline environment, the locally built tiny model, the GSM8K file from ../shared."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

for key, value in {
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
    "DO_NOT_TRACK": "1", "MLFLOW_DISABLE_TELEMETRY": "true", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90", "DS_ACCELERATOR": "cpu",
}.items():
    os.environ.setdefault(key, value)

REPO_ROOT = Path(__file__).resolve().parent.parent
GSM8K_TRAIN = REPO_ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def gsm8k_train() -> Path:
    """The real GSM8K train split; a user's clone has no ../shared, so tests skip there."""
    if not GSM8K_TRAIN.is_file():
        pytest.skip(f"GSM8K train split not found at {GSM8K_TRAIN} (it lives in ../shared beside the checkout)")
    return GSM8K_TRAIN


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The project's tiny Qwen2-style causal LM + BPE tokenizer, built once per test session."""
    from rlhf_core.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(autouse=True)
def _isolated_state(tmp_path, monkeypatch):
    """Each test gets its own RLHF_HOME so built models, MLflow stores and Prefect homes never leak."""
    monkeypatch.setenv("RLHF_HOME", str(tmp_path / ".rlhf"))
