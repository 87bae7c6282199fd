"""Model names: 'tiny', a local directory, or a hub id resolved offline from the Hugging Face cache."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf_core.config import ConfigError, load_config
from rlhf_core.run.inputs import check_inputs
from rlhf_core.run.layout import RunDir
from rlhf_core.stages.warm_start import run_warm_start
from rlhf_core.paths import (
    ModelNotFoundError, cached_snapshot, hf_hub_cache, is_hub_id, locate_model, resolve_model_path,
)

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO_ID = "Qwen/Qwen2.5-0.5B-Instruct"


def _place_in_cache(hub: Path, repo_id: str, model_dir: Path) -> Path:
    """Lay ``model_dir`` out as huggingface_hub's cache does: refs/main → snapshots/<commit>/."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(model_dir, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)  # huggingface_hub writes it without a newline
    return snapshot


@pytest.fixture
def hf_home(tmp_path, monkeypatch) -> Path:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    return tmp_path / "hf"


def test_cache_directory_follows_huggingface_hub_order(tmp_path, monkeypatch):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    assert hf_hub_cache() == Path("~/.cache/huggingface/hub").expanduser()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hf_hub_cache() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hf_hub_cache() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "explicit"))
    assert hf_hub_cache() == tmp_path / "explicit"


def test_hub_id_shape():
    assert is_hub_id(REPO_ID) and is_hub_id("org/name.v2_x")
    assert not is_hub_id("tiny") and not is_hub_id("/abs/dir") and not is_hub_id("a/b/c") and not is_hub_id("../x")


def test_hub_id_loads_offline_from_the_cache(hf_home, tiny_model_dir):
    snapshot = _place_in_cache(hf_home / "hub", REPO_ID, tiny_model_dir)
    resolved = resolve_model_path(REPO_ID)
    assert resolved == snapshot == cached_snapshot(REPO_ID)
    model = AutoModelForCausalLM.from_pretrained(resolved)
    tokenizer = AutoTokenizer.from_pretrained(resolved)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = tokenizer("12 + 30 = 42", return_tensors="pt")["input_ids"]
    assert ids.shape[1] > 1
    assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)
    check_inputs(load_config(None, [f"actor_rollout_ref.model.path={REPO_ID}", f"critic.model.path={REPO_ID}"]))


def test_hub_cache_from_hf_hub_cache_variable(tmp_path, monkeypatch, tiny_model_dir):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "unused"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    snapshot = _place_in_cache(tmp_path / "cache", REPO_ID, tiny_model_dir)
    assert locate_model(REPO_ID) == snapshot


def test_a_local_directory_wins_over_the_cache(hf_home, tiny_model_dir, tmp_path, monkeypatch):
    _place_in_cache(hf_home / "hub", REPO_ID, tiny_model_dir)
    local = tmp_path / "work" / REPO_ID
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "work")
    assert locate_model(REPO_ID) == local.resolve()


def test_missing_hub_id_is_one_line_naming_the_cache(hf_home):
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model_path("NoOrg/no-such-model")
    message = str(info.value)
    assert "\n" not in message
    assert str(hf_home / "hub") in message and "huggingface-cli download NoOrg/no-such-model" in message
    assert "local model directory" in message


def test_refs_main_pointing_at_a_missing_snapshot_is_missing(hf_home):
    repo = hf_home / "hub" / "models--Org--Name"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    assert cached_snapshot("Org/Name") is None
    with pytest.raises(ModelNotFoundError):
        locate_model("Org/Name")


def test_tiny_is_only_looked_up_until_the_warm_start_stage_builds_it(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_HOME", str(tmp_path / "fresh-home"))  # no linked tiny model here
    where = locate_model("tiny")
    with pytest.raises(ModelNotFoundError, match=f"rlhf model build-tiny --out {where}"):
        resolve_model_path("tiny")
    assert not where.exists()  # a lookup builds nothing
    run_warm_start(load_config(None), RunDir(tmp_path / "run"))
    assert resolve_model_path("tiny") == where and (where / "config.json").is_file()


def test_check_inputs_names_each_missing_model_key_before_any_work(hf_home, tmp_path):
    cfg = load_config(None, ["actor_rollout_ref.model.path=NoOrg/actor", "critic.model.path=NoOrg/critic",
                             "reward_model.enable=true", "reward_model.model.path=NoOrg/rm",
                             f"actor_rollout_ref.ref.model_path={tmp_path}/not-here"])
    with pytest.raises(ConfigError) as info:
        check_inputs(cfg)
    message = str(info.value)
    for key, name in [("actor_rollout_ref.model.path", "NoOrg/actor"), ("critic.model.path", "NoOrg/critic"),
                      ("reward_model.model.path", "NoOrg/rm"), ("actor_rollout_ref.ref.model_path", "not-here")]:
        assert f"{key}: model " in message and name in message
    assert str(hf_home / "hub") in message
    assert not (tmp_path / "runs").exists()


def test_a_missing_model_a_command_makes_names_that_command(tmp_path, monkeypatch):
    """The presets' imported models (data/models/smollm2-135m-instruct) are made by `make smollm2`: a
    checkout that has not run it is told so, not to fetch a hub id."""
    from rlhf_core import paths
    from rlhf_core.paths import IMPORTED_MODELS, model_problem

    monkeypatch.chdir(tmp_path)  # a checkout without the imported model (this machine's may have it)
    monkeypatch.setattr(paths, "project_root", lambda: tmp_path)
    for name, command in IMPORTED_MODELS.items():
        for spelled in (name, f"./{name}", f"{name}/"):
            problem = model_problem(spelled)
            assert problem is not None and f"run `{command.split('`')[0]}`" in problem, problem
