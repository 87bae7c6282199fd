"""Every config key a stage reads is in the config sections it hashes.

A stage is skipped when its inputs and the config keys it declares (its config sections) are
unchanged; a key it reads but does not declare would let a changed config pass as up to date. Here
each stage of a real tiny iteration (setup stages, rollout, score, gae, the DeepSpeed update, the
guard, validation) runs with every read of a config field recorded (the config dataclasses'
attribute access, traced by the object's place in the config tree), and each key read must fall
under one of the stage's sections — or be listed below with why it cannot change the stage's output.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from rlhf_core.config import RLHFConfig, load_config, to_yaml
from rlhf_core.run.layout import RunDir, write_config
from rlhf_core.run.lifecycle import settle
from rlhf_core.run.stage_order import STAGES
from rlhf_core.stages.catalog import CATALOG

REPO = Path(__file__).resolve().parents[3]

NO_EFFECT_ON_OUTPUT = {
    "trainer.device": "resolved once per process; a run keeps its device (the update declares it)",
    "trainer.stage_processes": "how many processes share the model passes: checked equal to one process "
                               "(tests/rlhf_core/stages/test_score_stage.py, test_rollout_stage.py)",
    "trainer.nproc": "as trainer.stage_processes for the model passes (the update declares it)",
    "trainer.nnodes": "as trainer.nproc",
    "trainer.n_gpus_per_node": "as trainer.nproc",
    "trainer.concurrent_critic_actor": "critic and actor side by side or in turn: checked equal "
                                       "(tests/rlhf_core/stages/test_update_stage.py)",
    "trainer.total_iterations": "the step count, which only an lr schedule that needs it reads (the update "
                                "declares it then: training.settings.run_length)",
}
"""Keys a stage may read without declaring them, and why its output does not depend on them."""

NOT_ACTING = {"to_yaml", "flatten", "flatten_tree", "config_hash", "config_overrides", "asdict", "astuple",
              "replace", "_asdict_inner", "deepcopy", "__repr__", "__eq__", "__hash__", "write_state_record",
              "recorded_config", "engine_key", "refuse_what_cannot_fit"}
"""Functions that read fields to copy, hash or record a config, or to refuse one that cannot fit in
memory (``training.memory``: a refusal, never a different output) — not to act on it."""
DECIDING = "config_sections"
"""A key read while a stage computes its own config sections decides which keys it hashes: switching
it changes the key set, so the stage reruns (the rollout's filter and baseline keys, say)."""


class ConfigReads:
    """Records ``<dotted key>`` for every field read of a config dataclass in the tree of ``cfg``."""

    def __init__(self, cfg: RLHFConfig):
        self.paths: dict[int, str] = {}
        """id of each config dataclass in the tree -> its dotted prefix ('' for the root)."""
        self.classes: set[type] = set()
        self.keys: set[str] = set()
        self.deciding: set[str] = set()
        self.on = False
        self._walk(cfg, "")

    def _walk(self, node, prefix: str) -> None:
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            self.paths[id(node)] = prefix
            self.classes.add(type(node))
            for f in dataclasses.fields(node):
                self._walk(object.__getattribute__(node, f.name), f"{prefix}{f.name}.")

    def record(self, obj, name: str) -> None:
        prefix = self.paths.get(id(obj))
        if not self.on or prefix is None or name.startswith("_"):
            return
        if name not in {f.name for f in dataclasses.fields(obj)}:
            return
        if dataclasses.is_dataclass(object.__getattribute__(obj, name)):
            return  # a section: what counts is which of its fields are read
        frame, deciding = sys._getframe(2), False
        while frame is not None:
            if frame.f_code.co_name in NOT_ACTING:
                return
            deciding = deciding or frame.f_code.co_name == DECIDING
            frame = frame.f_back
        (self.deciding if deciding else self.keys).add(prefix + name)


@pytest.fixture
def traced(monkeypatch):
    """``traced(cfg)`` -> a ConfigReads whose ``on`` switches recording for every field read in cfg's tree."""
    def trace(cfg: RLHFConfig) -> ConfigReads:
        reads = ConfigReads(cfg)
        for cls in reads.classes:
            original = cls.__getattribute__

            def getattribute(self, name, _original=original):
                value = _original(self, name)
                reads.record(self, name)
                return value

            monkeypatch.setattr(cls, "__getattribute__", getattribute)
        return reads

    return trace


def _covered(key: str, sections: tuple[str, ...]) -> bool:
    return key.startswith(sections)


def _sections(stage: str, cfg: RLHFConfig) -> tuple[str, ...]:
    """The stage module's ``config_sections(cfg)``: what its manifest's config hash covers."""
    return tuple(sys.modules[CATALOG[stage].run.__module__].config_sections(cfg))


ALWAYS_RUNS = {"warm_start"}
"""Stages never skipped (their outputs are caches keyed by their own inputs), so nothing to declare."""


@pytest.mark.slow
@pytest.mark.deepspeed
def test_every_config_key_a_stage_reads_is_in_its_config_sections(tmp_path, tiny_model_dir, monkeypatch, traced):
    monkeypatch.setenv("RLHF_HOME", str(tmp_path / ".rlhf"))
    cfg = load_config(str(REPO / "configs" / "demo.yaml"), [
        f"actor_rollout_ref.model.path={tiny_model_dir}", f"trainer.runs_root={tmp_path}",
        "actor_rollout_ref.model.warm_start.enable=false", "data.train_batch_size=4", "data.max_val_samples=4",
        "data.max_response_length=12", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1024",
        "actor_rollout_ref.rollout.generation_batch_tokens=2048", "trainer.device=cpu",
        "trainer.resident_models=false", "trainer.total_iterations=1",
        "trainer.kl_guard_val_prompts=2"])  # the guard samples validation prompts too: it reads their generation
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    write_config(run, to_yaml(cfg))
    reads = traced(cfg)
    undeclared = {}
    for stage, spec in STAGES.items():
        iteration = 1 if spec.per_iteration else None
        reads.keys.clear()
        reads.deciding.clear()
        reads.on = True
        try:
            CATALOG[stage].run(cfg, run, iteration)
        finally:
            reads.on = False
        if stage == "guard":
            settle(run, 1, policy=cfg.trainer.on_kl_breach, attempt=1)
        if stage in ALWAYS_RUNS:
            continue
        reads.on = True
        sections = _sections(stage, cfg) + tuple(reads.deciding)
        reads.on = False
        missing = sorted(k for k in reads.keys if not _covered(k, sections) and k not in NO_EFFECT_ON_OUTPUT)
        if missing:
            undeclared[stage] = missing
    assert not undeclared, ("keys read but not in the stage's config sections (a change to them would be "
                            f"skipped as up to date): {undeclared}")
