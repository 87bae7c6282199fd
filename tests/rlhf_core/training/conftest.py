"""Fixtures for the update's tests: a seeded initial critic, a synthetic advantages batch scored by
the tiny model, and a factory for real DeepSpeed actor/critic engines on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The update runs the tiny model on one thread (see training.rank_update.cpu_threads); the tests that
    drive engines directly do the same, or OpenMP spin-waits dominate on a busy 2-core machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def critic_init_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny backbone with a seeded one-output value head, saved like ensure_initial_critic does."""
    import torch
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    out = tmp_path_factory.mktemp("critic") / "critic_init"
    torch.manual_seed(0)
    model = AutoModelForTokenClassification.from_pretrained(tiny_model_dir, num_labels=1, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def advantages_table(tiny_model_dir):
    """12 responses of 1-16 tokens after 4-12 prompt tokens; old/ref log-probs from the tiny model."""
    from rlhf_core.training.synthetic import synthetic_advantages

    return synthetic_advantages(tiny_model_dir, 12, seed=0)


@pytest.fixture(scope="session")
def ppo_data(advantages_table, tmp_path_factory):
    from rlhf_core.data.schemas import ADVANTAGES
    from rlhf_core.io.atomic import atomic_write_parquet
    from rlhf_core.training.batch import read_advantages

    path = tmp_path_factory.mktemp("adv") / "advantages.parquet"
    atomic_write_parquet(path, advantages_table, ADVANTAGES)
    return read_advantages(path)


@pytest.fixture(scope="session")
def dist():
    from rlhf_core.training.distributed import init_distributed

    return init_distributed("cpu")


def _config(model_dir: Path, stage: int, overrides: list[str]):
    from rlhf_core.config import load_config

    return load_config(None, [
        f"actor_rollout_ref.model.path={model_dir}",
        f"actor_rollout_ref.actor.deepspeed_config.zero_stage={stage}",
        f"critic.deepspeed_config.zero_stage={stage}",
        *overrides,
    ])


@pytest.fixture
def make_engines(tiny_model_dir, critic_init_dir, dist):
    """``make_engines(stage, *overrides, actor_dir=None, critic_dir=None) -> (cfg, actor, critic)``."""
    from rlhf_core.config.reads import build
    from rlhf_core.training.rank_update import UpdateSources, build_engines
    from rlhf_core.training.settings import engine_settings

    def make(stage: int, *overrides: str, actor_dir: Path | None = None, critic_dir: Path | None = None):
        actor_dir = actor_dir or tiny_model_dir
        cfg = _config(actor_dir, stage, list(overrides))
        sources = UpdateSources(actor=actor_dir, adapter=None, critic=critic_dir or critic_init_dir,
                                tokenizer=actor_dir, resume=None)
        actor, critic = build_engines(build(engine_settings, cfg, device="cpu", world_size=dist.world_size), sources)
        return cfg, actor, critic

    return make


@pytest.fixture
def full_params():
    """``full_params(te) -> {name: tensor}``: complete parameters (gathered under ZeRO-3)."""
    import contextlib

    import deepspeed

    def get(te):
        params = list(te.module.named_parameters())
        ctx = (deepspeed.zero.GatheredParameters([p for _, p in params]) if te.zero_stage == 3
               else contextlib.nullcontext())
        with ctx:
            return {n: p.detach().clone() for n, p in params}

    return get
