"""The deployment definitions and the parameter checks at the UI boundary, without a server: what
the worker's flow-run process does with the parameters the Run form sends, before any training."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from prefect.exceptions import ParameterTypeError

from flows.pipeline import PipelineParams, rlhf_pipeline
from flows.retrain import RetrainParams, prepare_retrain_task, rlhf_retrain
from flows.stage import StageParams, rlhf_stage
from rlhf_core.config import ConfigError

REPO = Path(__file__).resolve().parents[2]
PREFECT_YAML = REPO / "deployments" / "prefect.yaml"


@pytest.fixture(scope="module")
def spec() -> dict:
    return yaml.safe_load(PREFECT_YAML.read_text())


def test_deployments_share_one_pool_and_only_retrain_is_scheduled(spec):
    deployments = {d["name"]: d for d in spec["deployments"]}
    assert set(deployments) == {"rlhf-train", "rlhf-retrain"}
    assert "definitions" in spec
    pool = spec["definitions"]["work_pools"]["local"]
    assert all(d["work_pool"] == pool for d in deployments.values())
    assert not deployments["rlhf-train"].get("schedules")
    (schedule,) = deployments["rlhf-retrain"]["schedules"]
    assert schedule["cron"] and schedule["active"] is True
    assert all(d["enforce_parameter_schema"] for d in deployments.values())


def test_default_parameters_are_valid_for_their_flows(spec):
    flows = {"flows/pipeline.py:rlhf_pipeline": rlhf_pipeline, "flows/retrain.py:rlhf_retrain": rlhf_retrain}
    for deployment in spec["deployments"]:
        flow = flows[deployment["entrypoint"]]
        validated = flow.validate_parameters(deployment["parameters"])
        assert set(validated) == {"params"}
    retrain = RetrainParams(**next(d for d in spec["deployments"] if d["name"] == "rlhf-retrain")["parameters"]["params"])
    assert retrain.base_model == "last-exported" and retrain.iterations


def test_malformed_override_fails_parameter_validation_with_the_fix():
    # what the flow-run process does first with the Run form's parameters
    with pytest.raises(ParameterTypeError, match=r"override 'lr' must look like dotted.key=value"):
        rlhf_pipeline.validate_parameters({"params": {"overrides": ["lr"]}})
    with pytest.raises(ParameterTypeError, match=r"override '=1' must look like dotted.key=value"):
        rlhf_retrain.validate_parameters({"params": {"overrides": ["=1"]}})
    with pytest.raises(ParameterTypeError, match="iterations"):
        rlhf_retrain.validate_parameters({"params": {"iterations": 0}})
    # the single-stage flow's form checks its overrides the same way (it did not before: one home now)
    with pytest.raises(ParameterTypeError, match=r"override 'lr' must look like dotted.key=value"):
        rlhf_stage.validate_parameters({"params": {"stage": "gae", "run_dir": "RUN", "iteration": 1,
                                                   "overrides": ["lr"]}})


def test_every_flow_form_refuses_an_unknown_field_and_masks_secrets_it_records():
    secret = "custom_reward_function.reward_kwargs.api_key=sk-abcdefghijklmnopqrstuvwx"
    for params in (PipelineParams(overrides=[secret]), RetrainParams(overrides=[secret]),
                   StageParams(stage="gae", run_dir="RUN", iteration=1, overrides=[secret])):
        recorded = params.model_dump(mode="json")["overrides"]
        assert recorded != [secret] and "sk-abcdefghijklmnopqrstuvwx" not in recorded[0], recorded
        assert params.overrides == [secret]  # the flow itself gets what was given
        with pytest.raises(ValueError, match="extra"):
            type(params)(**{**params.model_dump(), "iteratons": 2})


def test_unknown_override_key_fails_before_any_run_directory(tmp_path):
    runs = tmp_path / "runs"
    bad = [f"trainer.runs_root={runs}", "actor.optim.lr=0.1"]
    # the loader names the first unknown part of the dotted key and the section it likely meant
    with pytest.raises(ConfigError, match=r"unknown config key 'actor(\.optim\.lr)?'.*actor_rollout_ref\.actor"):
        rlhf_pipeline.fn(PipelineParams(config="configs/demo.yaml", overrides=bad, run_name="never"))
    with pytest.raises(ConfigError, match=r"unknown config key 'actor(\.optim\.lr)?'"):
        prepare_retrain_task.fn(RetrainParams(config="configs/demo.yaml", overrides=bad, base_model="tiny"))
    assert not runs.exists()


def test_missing_data_or_base_model_fails_before_copying(tmp_path):
    runs = tmp_path / "runs"
    common = dict(config="configs/demo.yaml", overrides=[f"trainer.runs_root={runs}"])
    with pytest.raises(ConfigError, match=r"data.train_files: .*nowhere.jsonl not found"):
        prepare_retrain_task.fn(RetrainParams(**common, data_files=[str(tmp_path / "nowhere.jsonl")], base_model="tiny"))
    with pytest.raises(ConfigError, match="no exported model under .*Run rlhf-train first"):
        prepare_retrain_task.fn(RetrainParams(**common))
    assert not runs.exists()


def test_retrain_starts_from_the_newest_export_on_its_own_snapshot(tmp_path, tiny_model_dir):
    runs = tmp_path / "runs"
    for name, when in (("older", 1.0), ("newer", 2.0)):
        actor = runs / name / "export" / "actor"
        shutil.copytree(tiny_model_dir, actor)  # a usable model folder: the retrain checks its base model
        (actor / "export.json").write_text(json.dumps({"iteration": 1, "time": when}))
    data = tmp_path / "prompts.jsonl"
    data.write_text((REPO / "data" / "arith" / "train.jsonl").read_text().splitlines()[0] + "\n")
    params = RetrainParams(config="configs/demo.yaml", data_files=[str(data)], overrides=[f"trainer.runs_root={runs}"])
    first = prepare_retrain_task.fn(params, "aaaaaaaa-1111-2222-3333-444444444444")
    second = prepare_retrain_task.fn(params, "bbbbbbbb-1111-2222-3333-444444444444")
    assert first["base_model"] == str(runs / "newer" / "export" / "actor")
    assert first["run_name"].startswith("retrain-") and first["run_name"].endswith("-aaaaaaaa")
    assert first["run_dir"] != second["run_dir"] and first["snapshot"]["dir"] != second["snapshot"]["dir"]
    (snap,) = first["snapshot"]["train"]
    assert Path(snap["path"]).read_bytes() == data.read_bytes() and snap["source"] == str(data)
    assert f'data.train_files={json.dumps([snap["path"]])}' in first["overrides"]
    assert f'actor_rollout_ref.model.path={json.dumps(first["base_model"])}' in first["overrides"]
    assert json.loads((Path(first["snapshot"]["dir"]) / "retrain.json").read_text())["run_name"] == first["run_name"]
    assert not Path(first["run_dir"]).exists()  # the pipeline creates it
