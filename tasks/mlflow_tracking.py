"""MLflow tracking for runs and stage reruns.

Where: ``MLFLOW_TRACKING_URI`` when set; else an embedded SQLite store inside the project's state
directory (``$RLHF_HOME/mlflow/mlflow.db``, artifacts under ``$RLHF_HOME/mlflow/artifacts``), so no
server is needed. Browse it with

    mlflow ui --host 127.0.0.1 --workers 1 --backend-store-uri sqlite:///$RLHF_HOME/mlflow/mlflow.db

One MLflow run per pipeline flow run, named after the run directory and recorded in
``RUN/tracking.json``; a resumed run continues the same MLflow run, and ``rlhf stage`` reruns attach
to it as nested runs. Parameters are the flattened config. Metrics are logged with one ``log_batch``
per call (one SQLite transaction; separate ``log_metric`` calls cost ~20 ms each).

Experiments are created as classic ML training experiments (the experiment tag
``mlflow.experimentKind=custom_model_development``). MLflow 3.17's UI reads that tag no more: it
opens every experiment in the view of a workflow type chosen in its side bar, GenAI (traces) until
a user switches, and a link's ``workflowType`` parameter overrides it. The addresses printed here
carry ``TRAINING_VIEW`` so they open the runs table and the metric charts (``ui_path``).

Tracking is a view, never the record: a failing MLflow call (a store replaced or wiped mid-run, a
server gone) is one warning line, and tracking is off for the rest of that MLflow run
(``best_effort``); the run trains, exports and reports its result as without it, and
`rlhf run --resume RUN` logs every committed iteration again into the store it then finds.

Nothing this module writes or prints carries a secret: the tracking URI's password
(``http://user:PASSWORD@host``) is masked in ``RUN/tracking.json``, the logged address and the run
URL (``display_uri``), tags go through ``rlhf_core.security`` like the parameters, and MLflow's own
"View run at" line (printed at the end of a run on an HTTP store, password included) is switched
off (``MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT``): the CLI prints the masked URL instead.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import time
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

from rlhf_core.config import RLHFConfig, flatten
from rlhf_core.io.atomic import atomic_write_json
from rlhf_core.run.layout import RunDir
from rlhf_core.io.timing import timed
from rlhf_core.paths import state_dir
from rlhf_core.security import redact, redact_text, redact_value
from tasks import prefect_artifacts

MLFLOW = "mlflow"
"""``io.timing`` kind of the per-iteration MLflow calls (the orchestration-overhead benchmark sums it)."""
MAX_PARAMS_PER_BATCH = 100  # MLflow's log_batch limit
MAX_PARAM_LENGTH = 6000
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}
"""MLflow 3's experiment type: a model-training experiment (runs, parameters, metric charts)."""
TRAINING_VIEW = "workflowType=machine_learning"
"""The MLflow UI's query parameter for its model-training view (3.17: the GenAI view otherwise)."""


def tracking_uri() -> str:
    """MLFLOW_TRACKING_URI when set, else the embedded SQLite store under the state directory."""
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    path = state_dir() / "mlflow" / "mlflow.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def display_uri() -> str:
    """The tracking URI as it may be shown or stored: its password, if any, masked."""
    return redact_text(tracking_uri())


def artifact_root() -> Optional[str]:
    """Explicit artifact location for the embedded store (None: the tracking server decides)."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return None
    path = state_dir() / "mlflow" / "artifacts"
    path.mkdir(parents=True, exist_ok=True)
    return path.as_uri()


_CLIENTS: dict[str, Any] = {}

# ---------------------------------------------------------------------------------------------
# failures: one line, then tracking off for that MLflow run
# ---------------------------------------------------------------------------------------------

_FAILED: dict[Optional[str], str] = {}
"""MLflow run id (None: a run that could not be opened) → the failure that turned its tracking off."""
T = TypeVar("T")


def failure(run_id: Optional[str]) -> Optional[str]:
    """Why tracking of ``run_id`` is off (its first MLflow failure in this process), else None."""
    return _FAILED.get(run_id)


def _one_line(exc: BaseException) -> str:
    """The root cause of ``exc`` (MLflow wraps the database's error in two layers of its own) as
    'Type: first line of its message'."""
    for _ in range(10):
        inner = exc.__cause__ or exc.__context__
        if inner is None:
            break
        exc = inner
    lines = str(exc).strip().splitlines() or [""]
    text = lines[0][:200] + ("…" if len(lines[0]) > 200 else "")
    return f"{type(exc).__name__}: {text}"


def _tracking_failed(run_id: Optional[str], doing: str, exc: Exception) -> None:
    _FAILED[run_id] = f"{doing}: {_one_line(exc)}"
    what = f"MLflow run {run_id}" if run_id else "this run"
    prefect_artifacts.logger().warning(
        "MLflow tracking failed (%s, %s) at %s; %s is not tracked from here on: the run goes on and the run "
        "directory keeps every metric (`rlhf run --resume RUN` logs them into the store it then finds)",
        doing, _one_line(exc), display_uri(), what)


def best_effort(default: T) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """For a call whose first argument is an MLflow run id: once a call for that run failed (or
    when it is None), later ones return ``default`` at once; a call that fails says so in one line
    (``_tracking_failed``) and returns ``default``. The run's result never depends on MLflow."""
    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(fn)
        def call(run_id: Optional[str], *args: Any, **kwargs: Any) -> T:
            if run_id is None or run_id in _FAILED:
                return default
            try:
                return fn(run_id, *args, **kwargs)
            except Exception as exc:
                _tracking_failed(run_id, fn.__name__, exc)
                return default
        return call
    return wrap


def _quiet_mlflow_store() -> None:
    """MLflow's SQL store logs every database error with its traceback before raising it, and two
    INFO lines whenever it creates a store: the failure reaches the console once, as our line."""
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)


HTTP_LIMITS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "5", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
               "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
"""How long a tracking server may keep the run waiting, unless the user's environment says otherwise:
MLflow's own defaults (120 s reads, 7 retries with backoff) held a run for minutes in start-tracking
before anything trained when a server accepted connections and never answered (a closed port: ~4
min). With these a dead or mute server costs about 10 s once, then one warning line and tracking off
for the run (``best_effort``)."""


def client():
    """One MlflowClient per tracking URI (the SQLite engine is created once)."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    for key, value in HTTP_LIMITS.items():
        os.environ.setdefault(key, value)
    # forced, not defaulted: MLflow's line shows the tracking URI's password; the CLI prints a masked URL
    os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
    _quiet_mlflow_store()
    from mlflow.tracking import MlflowClient

    uri = tracking_uri()
    if uri not in _CLIENTS:
        _CLIENTS[uri] = MlflowClient(tracking_uri=uri)
    return _CLIENTS[uri]


def experiment_id(name: str) -> str:
    """The id of experiment ``name`` (its name as redacted), created as a training experiment
    (``EXPERIMENT_KIND``) when absent; one created earlier without a kind gets it."""
    c = client()
    name = redact_text(name)
    exp = c.get_experiment_by_name(name)
    if exp is None:
        try:
            return c.create_experiment(name, artifact_location=artifact_root(), tags=EXPERIMENT_KIND)
        except Exception:  # created meanwhile by another process
            exp = c.get_experiment_by_name(name)
            if exp is None:
                raise
    for key, value in EXPERIMENT_KIND.items():
        if key not in exp.tags:  # an experiment of an older version; a kind someone chose is kept
            c.set_experiment_tag(exp.experiment_id, key, value)
    return exp.experiment_id


def _record_path(run: RunDir) -> Path:
    return run.root / "tracking.json"


def read_record(run: RunDir) -> Optional[dict]:
    """{"tracking_uri", "experiment_id", "run_id"} of the run's MLflow run, when it has one in the
    current tracking store."""
    record = run.read_json(_record_path(run))
    # compared masked: records written before the masking hold the URI as it was
    if not record or redact_text(str(record.get("tracking_uri"))) != display_uri():
        return None
    try:
        client().get_run(record["run_id"])
    except Exception:  # deleted, or a store that was wiped
        return None
    return record


def start_pipeline_run(run: RunDir, cfg: RLHFConfig, flow_run_id: Optional[str] = None) -> Optional[str]:
    """The MLflow run of this run directory: reopened when it exists (resume), else created with the
    flattened config as parameters. Returns its run id; None (one warning line) when MLflow fails:
    the run goes on untracked."""
    try:
        return _start_pipeline_run(run, cfg, flow_run_id)
    except Exception as exc:
        _tracking_failed(None, "start_pipeline_run", exc)
        return None


def _start_pipeline_run(run: RunDir, cfg: RLHFConfig, flow_run_id: Optional[str]) -> str:
    from mlflow.entities import RunStatus

    c = client()
    record = read_record(run)
    if record:
        run_id = record["run_id"]
        c.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
        log_config(run_id, cfg)
    else:
        exp = experiment_id(cfg.trainer.experiment_name)
        mlrun = c.create_run(exp, run_name=redact_text(run.root.name),
                             tags=_safe_tags({"rlhf.run_dir": str(run.root), "rlhf.project": cfg.trainer.project_name}))
        run_id = mlrun.info.run_id
        log_config(run_id, cfg)
        atomic_write_json(_record_path(run), {"tracking_uri": display_uri(), "experiment_id": exp, "run_id": run_id})
    if flow_run_id:
        set_tags(run_id, {"prefect.flow_run_id": flow_run_id})
    return run_id


def start_stage_run(run: RunDir, cfg: RLHFConfig, stage: str, iteration: Optional[int],
                    flow_run_id: Optional[str] = None) -> Optional[str]:
    """A nested MLflow run for one `rlhf stage` rerun, under the run directory's pipeline run (a
    top-level run when the directory has none yet); None (one warning line) when MLflow fails."""
    try:
        return _start_stage_run(run, cfg, stage, iteration, flow_run_id)
    except Exception as exc:
        _tracking_failed(None, "start_stage_run", exc)
        return None


def _start_stage_run(run: RunDir, cfg: RLHFConfig, stage: str, iteration: Optional[int],
                     flow_run_id: Optional[str]) -> str:
    record = read_record(run)
    name = f"{stage}" + (f"-iter{iteration}" if iteration is not None else "")
    tags = {"rlhf.run_dir": str(run.root), "rlhf.stage": stage, "rlhf.rerun": "true"}
    if record:
        tags["mlflow.parentRunId"] = record["run_id"]
        exp = record["experiment_id"]
    else:
        exp = experiment_id(cfg.trainer.experiment_name)
    if flow_run_id:
        tags["prefect.flow_run_id"] = flow_run_id
    run_id = client().create_run(exp, run_name=name, tags=_safe_tags(tags)).info.run_id
    log_config(run_id, cfg)
    return run_id


def _safe_tags(tags: dict[str, Any]) -> dict[str, str]:
    """Tag values as MLflow stores them: text, secrets masked, at most 5000 characters."""
    return {key: str(redact_value(value))[:5000] for key, value in tags.items()}


def log_config(run_id: str, cfg: RLHFConfig) -> None:
    """Parameters = the flattened config. MLflow parameters cannot change, so a value that differs
    from the logged one (a resume with overrides, a retry's smaller learning rate) becomes a
    ``config_change/<key>`` tag instead."""
    from mlflow.entities import Param, RunTag

    c = client()
    logged = c.get_run(run_id).data.params
    new, changed = [], []
    for key, value in redact(flatten(cfg)).items():  # never a token or password in MLflow params
        text = str(value)[:MAX_PARAM_LENGTH]
        if key not in logged:
            new.append(Param(key, text))
        elif logged[key] != text:
            changed.append(RunTag(f"config_change/{key}", f"{logged[key]} -> {text}"))
    for i in range(0, len(new), MAX_PARAMS_PER_BATCH):
        c.log_batch(run_id, params=new[i:i + MAX_PARAMS_PER_BATCH])
    if changed:
        c.log_batch(run_id, tags=changed)


_NOT_IN_MLFLOW_NAMES = re.compile(r"[^/\w.\- :]")


def mlflow_key(name: str) -> str:
    """A metric name as MLflow accepts it, spelled as verl's MLflow logger spells it: '@' → '_at_'
    (val-core/openai/gsm8k/reward/mean@1 → .../mean_at_1), repeated slashes → one, any other
    character MLflow refuses → '_'. The run directory keeps the original names."""
    return _NOT_IN_MLFLOW_NAMES.sub("_", re.sub(r"/+", "/", name.replace("@", "_at_")))


@best_effort(0)
@timed(MLFLOW)
def log_metrics(run_id: str, metrics: dict[str, float], step: Optional[int]) -> int:
    """One log_batch of every finite numeric metric at ``step`` (names: ``mlflow_key``). Returns
    how many were logged."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    batch = [Metric(mlflow_key(key), float(v), now, step or 0) for key, v in sorted(metrics.items())
             if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))]
    for i in range(0, len(batch), 1000):  # log_batch takes up to 1000 metrics
        client().log_batch(run_id, metrics=batch[i:i + 1000])
    return len(batch)


@best_effort(None)
@timed(MLFLOW)
def set_tags(run_id: str, tags: dict[str, Any]) -> None:
    from mlflow.entities import RunTag

    client().log_batch(run_id, tags=[RunTag(k, v) for k, v in _safe_tags(tags).items()])


@best_effort(None)
@timed(MLFLOW)
def log_artifact(run_id: str, path: Path, artifact_path: Optional[str] = None) -> None:
    client().log_artifact(run_id, str(path), artifact_path)


@best_effort(None)
@timed(MLFLOW)
def finish(run_id: str, status: str = "FINISHED") -> None:
    """status: FINISHED | FAILED | KILLED."""
    client().set_terminated(run_id, status=status)


@best_effort(())
def metric_history(run_id: str, key: str) -> list[tuple[int, float]]:
    """[(step, value)] of one metric, for tests and reports."""
    return [(m.step, m.value) for m in client().get_metric_history(run_id, mlflow_key(key))]


@best_effort(None)
@timed(MLFLOW)
def run_url(run_id: str) -> Optional[str]:
    """A browsable address when the tracking store is a server (its password masked: the browser
    asks for it)."""
    uri = display_uri()
    if uri.startswith("http"):
        return f"{uri.rstrip('/')}/{ui_path(run_id)}"
    return None


@best_effort(None)
def ui_path(run_id: str) -> str:
    """The MLflow UI's address of a run, after the server's: its page in the training view."""
    return f"#/experiments/{client().get_run(run_id).info.experiment_id}/runs/{run_id}?{TRAINING_VIEW}"


def params_of(run_id: str) -> dict[str, str]:
    return dict(client().get_run(run_id).data.params)


def tags_of(run_id: str) -> dict[str, str]:
    return dict(client().get_run(run_id).data.tags)


def child_runs(run_id: str) -> list[Any]:
    c = client()
    parent = c.get_run(run_id)
    return list(c.search_runs([parent.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{run_id}'"))

