"""A resume keeps the dtype its checkpoints recorded: ``auto`` resolves to it again (on a CPU through
RLHF_CPU_BF16, which every process of the run inherits), or the resume refuses in one line."""

from __future__ import annotations

import json

import pytest

from rlhf_core.config import ConfigError, load_config
from rlhf_core.io.atomic import atomic_write_json
from rlhf_core.run.layout import RunDir
from rlhf_core.training import hardware
from rlhf_core.training.ds_config import resolve_dtype
from rlhf_core.training.run_dtype import keep_recorded_dtype, recorded_dtypes

# a model whose largest matrix (49,152 x 576) is not small: auto picks bf16 wherever bf16 pays
LARGE = {"hidden_size": 576, "vocab_size": 49152, "intermediate_size": 1536, "num_attention_heads": 9}


@pytest.fixture
def run_with(tmp_path):
    """``run_with(actor=dtype, critic=dtype)``: a run whose iteration 2 is committed with a
    checkpoint recording those dtypes, and a large model's config.json."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LARGE))

    def make(**dtypes: str) -> tuple[RunDir, list[str]]:
        run = RunDir(tmp_path / "run")
        for role, dtype in dtypes.items():
            path = run.checkpoint(2) / "deepspeed" / f"{role}_state.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"dtype": dtype, "adam_step": 4}))
        atomic_write_json(run.last_good_path, {"iteration": 2, "checkpoint": str(run.checkpoint(2)),
                                               "committed": [1, 2]})
        return run, [f"actor_rollout_ref.model.path={model}", "trainer.device=cpu"]

    return make


@pytest.mark.parametrize("recorded,said", [("bf16", "0"), ("fp32", "1")])
def test_auto_resolves_to_the_recorded_dtype_whatever_the_environment_says(run_with, monkeypatch, capsys,
                                                                           recorded, said):
    """Issue 49, 1: a bf16 run resumed with RLHF_CPU_BF16=0 retrained in fp32 from bf16 weights; an
    fp32 run resumed with RLHF_CPU_BF16=1 ended in tracebacks. Both now keep the run's dtype."""
    run, overrides = run_with(actor=recorded, critic=recorded)
    monkeypatch.setenv(hardware.CPU_BF16_ENV, said)
    cfg = load_config(None, overrides)
    now = resolve_dtype("auto", "cpu", 49152 * 576)
    keep_recorded_dtype(cfg, run)
    assert resolve_dtype("auto", "cpu", 49152 * 576) == recorded != now
    err = capsys.readouterr().err
    assert err.count("rlhf: warning:") == 1, err  # once, for the actor and the critic together
    assert (f"rlhf: warning: actor_rollout_ref.actor.deepspeed_config.dtype=auto would choose {now} here "
            f"(RLHF_CPU_BF16={said}), but this run trained in {recorded} (recorded with iter_2/checkpoint): kept "
            f"{recorded}") in err


def test_nothing_is_said_or_set_when_the_choice_agrees_or_nothing_is_recorded(run_with, monkeypatch, capsys):
    run, overrides = run_with(actor="fp32")
    monkeypatch.setenv(hardware.CPU_BF16_ENV, "0")
    keep_recorded_dtype(load_config(None, overrides), run)
    assert capsys.readouterr().err == ""
    run.last_good_path.unlink()
    assert recorded_dtypes(run) == (None, {})
    monkeypatch.setenv(hardware.CPU_BF16_ENV, "1")
    keep_recorded_dtype(load_config(None, overrides), run)
    assert capsys.readouterr().err == "" and hardware.cpu_bf16_pays()


def test_a_configured_dtype_other_than_the_recorded_one_is_refused(run_with):
    run, overrides = run_with(actor="fp32", critic="fp32")
    with pytest.raises(ConfigError, match=r"^critic.deepspeed_config.dtype=bf16, but this run trained in fp32 "
                                          r"\(recorded with iter_2/checkpoint\): resuming would mix dtypes"):
        keep_recorded_dtype(load_config(None, [*overrides, "critic.deepspeed_config.dtype=bf16"]), run)
