"""The deployments end to end, on real servers bound to 127.0.0.1 (free ports, a temporary state
directory): `services.up` starts a Prefect server, the process pool, the deployments, a worker and
the MLflow UI; the test presses Run as the UI does (``POST /api/deployments/{id}/create_flow_run``)
for rlhf-train, a malformed rlhf-train and rlhf-retrain, waits for their final states, checks the run
directories and MLflow runs, the queueing (pool concurrency 1), rlhf-retrain's schedule, and that
`services.down` leaves no process behind.

    python -m pytest -m server tests/deployments        (alone)
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace

import httpx
import psutil
import pytest
import yaml

from deployments import services

pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.deepspeed]

REPO = Path(__file__).resolve().parents[2]
TERMINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
WAIT_SECONDS = 900  # a generous ceiling for three queued flow runs on two busy cores, not a speed check


def _preset(tmp: Path, model_dir: Path) -> Path:
    """configs/demo.yaml shrunk to one iteration of 4 prompts and 12-token responses."""
    lines = (REPO / "data" / "arith" / "train.jsonl").read_text().splitlines()
    (tmp / "prompts-a.jsonl").write_text("\n".join(lines[:200]) + "\n")
    (tmp / "prompts-b.jsonl").write_text("\n".join(lines[200:400]) + "\n")
    preset = {
        "data": {"train_files": [str(tmp / "prompts-a.jsonl")], "adapter": "gsm8k", "data_source": "arith",
                 "max_prompt_length": 128, "max_response_length": 12, "train_batch_size": 4, "max_val_samples": 4},
        "actor_rollout_ref": {"model": {"path": str(model_dir)},
                              "actor": {"ppo_mini_batch_size": 4, "ppo_max_token_len_per_gpu": 1024,
                                        "ppo_micro_batch_size_per_gpu": 4},
                              "rollout": {"name": "hf", "generation_batch_tokens": 2048}},
        "trainer": {"experiment_name": "deploy-test", "runs_root": str(tmp / "runs"), "total_iterations": 1,
                    "test_freq": 1, "device": "cpu", "export_min_val_score": 0.0},
    }
    path = tmp / "tiny.yaml"
    path.write_text(yaml.safe_dump(preset))
    return path


def _tree_pids(state) -> list[int]:
    pids = []
    for svc in state.services.values():
        proc = services.process_of(svc)
        if proc is not None:
            pids += [proc.pid] + [c.pid for c in proc.children(recursive=True)]
    return pids


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("deploy")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLHF_HOME", str(tmp / "home"))
        for key in ("PREFECT_HOME", "PREFECT_API_URL", "MLFLOW_TRACKING_URI"):
            mp.delenv(key, raising=False)
        mp.setenv("PREFECT_WORKER_QUERY_SECONDS", "1")  # pick runs up promptly (default 10 s)
        state = services.up(prefect_port=0, mlflow_port=0, concurrency=1, timeout=300)
        pids = _tree_pids(state)
        try:
            yield SimpleNamespace(state=state, api=state.api_url, tmp=tmp, preset=_preset(tmp, tiny_model_dir),
                                  runs=tmp / "runs", home=tmp / "home")
        finally:
            report = services.down(state=state)
            gone, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=10)
            assert not alive, f"processes left after down: {alive}\n{report}"
            assert not (tmp / "home" / "services" / "services.json").exists()
            with pytest.raises(httpx.TransportError):
                httpx.get(f"{state.api_url}/health", timeout=5)


def _deployments(api: str) -> dict[str, dict]:
    return {d["name"]: d for d in services.api_call("POST", f"{api}/deployments/filter", json={}).json()}


def _run_button(api: str, deployment_id: str, params: dict, start_in: float = 0.0) -> str:
    """What the UI's Run button sends; ``start_in`` > 0 is the form's "start at" (keeps queue order)."""
    body: dict = {"parameters": {"params": params}}
    if start_in:
        when = datetime.now(timezone.utc) + timedelta(seconds=start_in)
        body["state"] = {"type": "SCHEDULED", "state_details": {"scheduled_time": when.isoformat()}}
    resp = services.api_call("POST", f"{api}/deployments/{deployment_id}/create_flow_run", json=body)
    assert resp.status_code == 201, resp.text
    return resp.json()["id"]


def _flow_run(api: str, run_id: str) -> dict:
    return services.api_call("GET", f"{api}/flow_runs/{run_id}").json()


def _logs(stack, run_id: str) -> str:
    query = {"logs": {"flow_run_id": {"any_": [run_id]}}, "sort": "TIMESTAMP_ASC", "limit": 200}
    records = services.api_call("POST", f"{stack.api}/logs/filter", json=query).json()
    worker = services.log_tail(stack.state.services["worker"], 40)
    return "\n".join(r["message"] for r in records) + f"\n--- worker log ---\n{worker}"


def _wait(stack, run_ids: list[str]) -> dict[str, dict]:
    import time

    deadline = time.monotonic() + WAIT_SECONDS
    while time.monotonic() < deadline:
        runs = {rid: _flow_run(stack.api, rid) for rid in run_ids}
        if all(r["state"]["type"] in TERMINAL for r in runs.values()):
            return runs
        time.sleep(2)
    pending = {rid: r["state"]["name"] for rid, r in runs.items() if r["state"]["type"] not in TERMINAL}
    pytest.fail(f"flow runs not finished after {WAIT_SECONDS} s: {pending}\n{_logs(stack, next(iter(pending)))}")


@pytest.fixture(scope="module")
def pressed(stack):
    """rlhf-train (valid), rlhf-train (malformed override) and rlhf-retrain, queued in that order."""
    deps = _deployments(stack.api)
    train = _run_button(stack.api, deps["rlhf-train"]["id"], {
        "config": str(stack.preset), "iterations": 1, "run_name": "ui-run",
        "overrides": ["algorithm.kl_ctrl.kl_coef=0.002"]})
    bad = _run_button(stack.api, deps["rlhf-train"]["id"], {
        "config": str(stack.preset), "run_name": "bad-run", "overrides": ["actor.optim.lr=0.1"]}, start_in=2)
    retrain = _run_button(stack.api, deps["rlhf-retrain"]["id"], {
        "config": str(stack.preset), "data_files": [str(stack.tmp / "prompts-b.jsonl")],
        "base_model": "last-exported", "iterations": 1}, start_in=4)
    runs = _wait(stack, [train, bad, retrain])
    for rid in (train, retrain):
        assert runs[rid]["state"]["type"] == "COMPLETED", f"{runs[rid]['state']}\n{_logs(stack, rid)}"
    return SimpleNamespace(train=runs[train], bad=runs[bad], retrain=runs[retrain], deployments=deps)


def _mlflow_run_id(run_dir: Path) -> str:
    return json.loads((run_dir / "tracking.json").read_text())["run_id"]


def test_run_button_trains_into_a_run_directory_tracked_in_mlflow(stack, pressed):
    run_dir = stack.runs / "ui-run"
    for rel in ("config.yaml", "last_good.json", "iter_1/rollout.parquet", "iter_1/advantages.parquet",
                "export/actor/config.json", "export/actor/export.json"):
        assert (run_dir / rel).is_file(), rel
    assert json.loads((run_dir / "last_good.json").read_text())["iteration"] == 1

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{stack.home / 'mlflow' / 'mlflow.db'}")
    run_id = _mlflow_run_id(run_dir)
    mlrun = client.get_run(run_id)
    assert mlrun.info.status == "FINISHED" and mlrun.info.run_name == "ui-run"
    assert mlrun.data.params["algorithm.kl_ctrl.kl_coef"] == "0.002"
    assert mlrun.data.tags["prefect.flow_run_id"] == pressed.train["id"]
    for key in ("reward/mean", "kl/mean", "actor/pg_loss", "critic/vf_loss"):
        assert [m.step for m in client.get_metric_history(run_id, key)] == [1], key
    # validation also scores the initial policy, at step 0
    assert [m.step for m in client.get_metric_history(run_id, "val/accuracy")] == [0, 1]

    # the MLflow UI serves the same store
    ui = httpx.get(f"{stack.state.mlflow_url}/api/2.0/mlflow/runs/get", params={"run_id": run_id}, timeout=30)
    assert {m["key"] for m in ui.json()["run"]["data"]["metrics"]} >= {"reward/mean", "kl/mean", "val/accuracy"}


def test_uis_are_served_on_loopback_and_the_browser_talks_to_this_server(stack):
    html = {"Accept": "text/html"}
    for url in (f"{stack.state.prefect_url}/deployments", f"{stack.state.mlflow_url}/"):
        resp = httpx.get(url, headers=html, timeout=30, follow_redirects=True)
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/html"), url
    assert httpx.get(f"{stack.state.prefect_url}/ui-settings", timeout=30).json()["api_url"] == stack.api
    listening = {c.laddr for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    for url in (stack.state.prefect_url, stack.state.mlflow_url):
        port = int(url.rsplit(":", 1)[1])
        assert {addr.ip for addr in listening if addr.port == port} == {"127.0.0.1"}, url


def test_bad_override_fails_at_once_saying_what_to_fix(stack, pressed):
    state = pressed.bad["state"]
    assert state["type"] == "FAILED"
    assert "unknown config key 'actor" in state["message"] and "actor_rollout_ref.actor" in state["message"]
    assert not (stack.runs / "bad-run").exists()


def test_retrain_starts_from_the_export_on_a_fresh_snapshot_in_a_new_directory(stack, pressed):
    (run_dir,) = [p for p in stack.runs.glob("retrain-*") if p.is_dir()]
    assert run_dir.name.endswith(pressed.retrain["id"].replace("-", "")[:8])
    record = json.loads((run_dir / "retrain.json").read_text())
    export = stack.runs / "ui-run" / "export" / "actor"
    assert record["base_model"] == str(export) and record["export"]["run_dir"] == str(stack.runs / "ui-run")
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["actor_rollout_ref"]["model"]["path"] == str(export)
    (snap,) = record["snapshot"]["train"]
    assert snap["source"] == str(stack.tmp / "prompts-b.jsonl") and config["data"]["train_files"] == [snap["path"]]
    assert Path(snap["path"]).read_bytes() == (stack.tmp / "prompts-b.jsonl").read_bytes()
    assert json.loads((run_dir / "last_good.json").read_text())["iteration"] == 1

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{stack.home / 'mlflow' / 'mlflow.db'}")
    mlrun = client.get_run(_mlflow_run_id(run_dir))
    assert mlrun.info.status == "FINISHED" and mlrun.data.tags["rlhf.retrain.base_model"] == str(export)
    assert mlrun.data.tags["rlhf.retrain.train_sha256"] == snap["sha256"][:12]


def test_pool_limit_keeps_runs_from_overlapping(stack, pressed):
    pool = services.api_call("GET", f"{stack.api}/work_pools/{stack.state.pool}").json()
    assert pool["type"] == "process" and pool["concurrency_limit"] == 1
    spans = sorted((datetime.fromisoformat(r["start_time"]), datetime.fromisoformat(r["end_time"]), r["name"])
                   for r in (pressed.train, pressed.bad, pressed.retrain))
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        assert end <= start, f"{first} and {second} ran at the same time"


def test_retrain_has_a_weekly_schedule_with_upcoming_runs(stack, pressed):
    import time

    dep = services.api_call("GET", f"{stack.api}/deployments/{pressed.deployments['rlhf-retrain']['id']}").json()
    (schedule,) = dep["schedules"]
    assert schedule["active"] and schedule["schedule"]["cron"] == "0 3 * * 1"
    assert dep["parameters"]["params"]["base_model"] == "last-exported"
    assert not pressed.deployments["rlhf-train"]["schedules"]
    query = {"deployments": {"id": {"any_": [dep["id"]]}},
             "flow_runs": {"state": {"type": {"any_": ["SCHEDULED"]}},
                           "expected_start_time": {"after_": datetime.now(timezone.utc).isoformat()}}}
    deadline = time.monotonic() + 120  # the server's scheduler loop creates them
    while not (upcoming := services.api_call("POST", f"{stack.api}/flow_runs/filter", json=query).json()):
        assert time.monotonic() < deadline, "no upcoming scheduled runs of rlhf-retrain"
        time.sleep(2)
    for run in upcoming:
        when = datetime.fromisoformat(run["expected_start_time"]).astimezone(timezone.utc)
        assert run["auto_scheduled"] and (when.weekday(), when.hour, when.minute) == (0, 3, 0)
