"""The Docker and Kubernetes work pools (deployments/pools/*.json) and their deployments
(deployments/prefect-cluster.yaml), checked by Prefect's own code, without a server or a cluster:

- each template passes the server's base-job-template check (``WorkPoolCreate``, what `prefect
  work-pool create --base-job-template` sends) and its defaults pass the server's job-variable check;
- each deployment's job variables pass the server's deployment check against its pool, and a job
  variable the template does not declare, or of the wrong type, is refused by that same check;
- the worker (prefect-docker / prefect-kubernetes) renders template + job variables into the
  container it would create: docker-py's own host config for Docker (GPU device request, shared
  memory, the run-directory bind mount), a manifest the Kubernetes client's models read back
  unchanged for Kubernetes (nvidia.com/gpu limit, the run-directory claim, a memory /dev/shm).

Docker and Kubernetes themselves are not installed here: nothing is run in a container."""

from __future__ import annotations

import asyncio
import inspect
import json
import uuid
from pathlib import Path

import docker.models.containers
import pytest
import yaml
from fastapi import HTTPException
from kubernetes_asyncio.client import ApiClient
from prefect.cli.deploy._models import PrefectYamlModel
from prefect.client.orchestration import PrefectClient
from prefect.client.schemas.objects import FlowRun
from prefect.deployments.steps.core import _get_function_for_step
from prefect.server.api.validation import (validate_job_variable_defaults_for_work_pool,
                                           validate_job_variables_for_deployment)
from prefect.server.schemas.actions import DeploymentCreate, WorkPoolCreate
from prefect.server.schemas.core import WorkPool
from prefect_docker.worker import DockerWorker, DockerWorkerJobConfiguration
from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration
from pydantic import ValidationError

REPO = Path(__file__).resolve().parents[2]
POOLS = {"rlhf-docker-gpu": ("docker", REPO / "deployments" / "pools" / "docker-gpu.json"),
         "rlhf-k8s-gpu": ("kubernetes", REPO / "deployments" / "pools" / "kubernetes-gpu.json")}
CLUSTER_YAML = REPO / "deployments" / "prefect-cluster.yaml"
DOCKER_API_VERSION = "1.44"  # the Engine API docker-py builds the create request for (GPU requests: >= 1.40)
# The Kubernetes worker requires these two keys in the pod spec (its own default template has them);
# they are not PodSpec fields, so the Kubernetes models drop them.
WORKER_ONLY_POD_KEYS = {"/spec/template/spec/completions", "/spec/template/spec/parallelism"}


def _template(pool: str) -> dict:
    return json.loads(POOLS[pool][1].read_text())


def _work_pool(pool: str, template: dict | None = None) -> WorkPool:
    kind, _ = POOLS[pool]
    created = WorkPoolCreate(name=pool, type=kind, base_job_template=template or _template(pool))
    return WorkPool(**created.model_dump())


def _check_deployment(pool: WorkPool, job_variables: dict) -> None:
    """What the server does with a deployment's job variables when `prefect deploy` creates it
    (the database session is only used for block references, which these templates have none of)."""
    action = DeploymentCreate(name="d", flow_id=uuid.uuid4(), work_pool_name=pool.name, job_variables=job_variables)
    asyncio.run(validate_job_variables_for_deployment(None, pool, action))


@pytest.fixture(scope="module")
def cluster() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def _offline_client() -> PrefectClient:
    """A client the worker's template rendering may be handed; it is never used (the templates hold
    no block or variable references), and would fail loudly if it were (nothing listens there)."""
    return PrefectClient(api="http://127.0.0.1:9/api")


def _render(config_class, pool: str, job_variables: dict):
    """The worker's job configuration for one flow run, as the worker prepares it."""
    async def render():
        config = await config_class.from_template_and_values(_template(pool), job_variables, client=_offline_client())
        config.prepare_for_flow_run(FlowRun(id=uuid.uuid4(), name="brave-otter", flow_id=uuid.uuid4()))
        return config
    return asyncio.run(render())


def _job_variables(cluster: dict, name: str) -> dict:
    (deployment,) = [d for d in cluster["deployments"] if d["name"] == name]
    return deployment["work_pool"]["job_variables"]


@pytest.mark.parametrize("pool", sorted(POOLS))
def test_templates_pass_the_servers_work_pool_checks(pool):
    work_pool = _work_pool(pool)
    asyncio.run(validate_job_variable_defaults_for_work_pool(None, pool, work_pool.base_job_template))
    assert work_pool.base_job_template["variables"]["additionalProperties"] is False


def test_a_broken_template_is_refused_by_the_server_check():
    broken = _template("rlhf-docker-gpu")
    del broken["variables"]["properties"]["gpu_count"]  # still used by the device request
    with pytest.raises(ValidationError, match="undeclared variable.*gpu_count"):
        WorkPoolCreate(name="broken", type="docker", base_job_template=broken)
    bad_default = _template("rlhf-k8s-gpu")
    bad_default["variables"]["properties"]["gpu_count"]["default"] = "one"
    with pytest.raises(HTTPException) as err:
        asyncio.run(validate_job_variable_defaults_for_work_pool(None, "bad", bad_default))
    assert "gpu_count" in str(err.value.detail)


def test_cluster_deployments_parse_and_name_only_declared_job_variables(cluster):
    model = PrefectYamlModel.model_validate(cluster)  # what `prefect deploy` reads the file into
    assert {d.name for d in model.deployments} == {"rlhf-train-docker", "rlhf-train-k8s", "rlhf-retrain-k8s"}
    for deployment in model.deployments:
        assert deployment.work_pool.name in POOLS, deployment.name
        _check_deployment(_work_pool(deployment.work_pool.name), deployment.work_pool.job_variables)
    (step,) = model.pull
    (fqn, inputs), = step.items()
    inspect.signature(_get_function_for_step(fqn)).bind(**inputs)  # the step exists and takes these inputs


def test_undeclared_or_mistyped_job_variables_are_refused(cluster):
    k8s = _work_pool("rlhf-k8s-gpu")
    good = _job_variables(cluster, "rlhf-train-k8s")
    for bad, word in (({**good, "gpus": 2}, "gpus"), ({**good, "gpu_count": "2"}, "gpu_count"),
                      ({**good, "volumes": ["/a:/a"]}, "volumes")):  # a Docker variable on the Kubernetes pool
        with pytest.raises(HTTPException) as err:
            _check_deployment(k8s, bad)
        assert err.value.status_code == 422 and word in str(err.value.detail)
    with pytest.raises(HTTPException, match="shm"):
        _check_deployment(_work_pool("rlhf-docker-gpu"), {**_job_variables(cluster, "rlhf-train-docker"), "shm": "1g"})


def test_docker_worker_builds_a_gpu_container_with_the_shared_run_directory(cluster):
    job_variables = {**_job_variables(cluster, "rlhf-train-docker"), "gpu_count": 2}
    job_variables["env"] = {**job_variables["env"], "PREFECT_API_URL": "http://prefect.rlhf.internal:4200/api"}
    config = _render(DockerWorkerJobConfiguration, "rlhf-docker-gpu", job_variables)
    settings = DockerWorker(work_pool_name="rlhf-docker-gpu")._build_container_settings(None, config)
    create = docker.models.containers._create_container_args({**settings, "version": DOCKER_API_VERSION})
    host = create["host_config"]
    assert host["DeviceRequests"] == [{"Driver": "nvidia", "Count": 2, "DeviceIDs": [], "Capabilities": [["gpu"]],
                                       "Options": {}}]
    assert host["ShmSize"] == 16 * 2**30 and host["Binds"] == ["/shared/rlhf:/shared/rlhf"]
    assert create["working_dir"] == "/opt/rlhf-dag" and create["image"] == "rlhf-dag:cuda"
    env = create["environment"]
    assert env["MLFLOW_TRACKING_URI"] == cluster["definitions"]["shared_env"]["MLFLOW_TRACKING_URI"]
    assert env["RLHF_HOME"] == "/shared/rlhf/home" and env["PREFECT__FLOW_RUN_ID"]
    assert create["command"] == "prefect flow-run execute"


def _dropped(sent, read_back, path: str = "") -> list[str]:
    """Paths of ``sent`` that ``read_back`` lacks or holds another value at (quantities compare as
    strings: Kubernetes reads 2 and "2" alike)."""
    if isinstance(sent, dict):
        return [p for k, v in sent.items()
                for p in ([f"{path}/{k}"] if not isinstance(read_back, dict) or k not in read_back
                          else _dropped(v, read_back[k], f"{path}/{k}"))]
    if isinstance(sent, list):
        if not isinstance(read_back, list) or len(sent) != len(read_back):
            return [path]
        return [p for i, (a, b) in enumerate(zip(sent, read_back)) for p in _dropped(a, b, f"{path}/{i}")]
    return [] if str(sent) == str(read_back) else [f"{path}: {sent!r} != {read_back!r}"]


def test_kubernetes_worker_builds_a_gpu_job_the_kubernetes_models_accept(cluster):
    job_variables = {**_job_variables(cluster, "rlhf-train-k8s"), "gpu_count": 4}
    manifest = _render(KubernetesWorkerJobConfiguration, "rlhf-k8s-gpu", job_variables).job_manifest

    async def read_back() -> dict:
        api = ApiClient()
        try:
            return api.sanitize_for_serialization(api._ApiClient__deserialize(manifest, "V1Job"))
        finally:
            await api.close()
    assert set(_dropped(manifest, asyncio.run(read_back()))) == WORKER_ONLY_POD_KEYS, \
        "a key the Kubernetes Job schema does not know (misspelt) or a value it cannot hold"

    pod = manifest["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert set(mounts) == set(volumes), "every mount names a volume of the pod"
    assert volumes["runs"]["persistentVolumeClaim"]["claimName"] == "rlhf-shared" and mounts["runs"] == "/shared/rlhf"
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"} and mounts["dshm"] == "/dev/shm"
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["RLHF_RUN_LEASE_S"] == "30" and env["RLHF_HOME"] == "/shared/rlhf/home"
    assert container["args"] == ["prefect", "flow-run", "execute"] and container["workingDir"] == "/opt/rlhf-dag"
