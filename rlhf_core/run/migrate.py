"""The run directory's format: one version number (``format.json``) and the one function that
upgrades an older directory, which every command that writes a run calls under its lock (a resume,
a stage, an export) before it reads anything else. Nothing else in the code knows an old layout.

    1  (no format.json) the KL controller's state in ``kl_ctrl.json`` at the run's root, rewritten
       by every gae, and ``iter_k/kl_ctrl_before.json``, the state iteration k started from (a
       retry multiplied both); a commit log may lack its "committed" list (the guard records said)
    2  the KL controller's state is an output of each iteration's gae, ``iter_k/kl_ctrl.json``
       {"used", "scale", "next"}, read by the next iteration from its committed predecessor
       (``stages.gae``); a retry raises trainer.kl_coef_scale in config.yaml instead

Upgrading 1 → 2 writes each gae's KL state from what it recorded (the coefficient it used and the
next one, in its manifest record's metrics; the controller's type and settings from its snapshot),
adds the file to the gae record's outputs and the predecessor's to its inputs, so integrity checks
and reruns treat it as any other output, then removes the old files. Idempotent: a kill part-way
is finished by the next command.
"""

from __future__ import annotations

from typing import Optional

from rlhf_core.algos import make_kl_controller
from rlhf_core.config import RLHFConfig
from rlhf_core.errors import RLHFError
from rlhf_core.io.atomic import atomic_write_json
from rlhf_core.io.hashing import sha256_tree
from rlhf_core.run.layout import RunDir, StateFileError
from rlhf_core.run.manifest import read_manifest, record_key, write_manifest

RUN_FORMAT = 2
"""The format this code writes (see the module docstring)."""


def run_format(run: RunDir) -> int:
    """The directory's format: format.json's, else 1 for a run written before it (it has a
    config.yaml), else the current one (a new directory)."""
    record = run.read_json(run.format_path)
    if isinstance(record, dict) and isinstance(record.get("format"), int):
        return record["format"]
    if record is not None:
        raise StateFileError(f"{run.format_path} holds {record!r}, not {{\"format\": N}}; write "
                             f"{{\"format\": 1}} there to have it upgraded")
    return 1 if run.config_path.is_file() else RUN_FORMAT


def stamp(run: RunDir) -> None:
    """Mark a new run directory with the current format."""
    if not run.format_path.is_file():
        atomic_write_json(run.format_path, {"format": RUN_FORMAT})


def outdated(run: RunDir) -> Optional[str]:
    """Why the directory needs upgrading before this code reads it (for `rlhf status`), else None (also
    for an older one that holds nothing the upgrade would change)."""
    version = run_format(run)
    if version == RUN_FORMAT or (version == 1 and not _holds_format_1_state(run)):
        return None
    return (f"{run.root} is in run-directory format {version}; any command that writes it (`rlhf run --resume "
            f"{run.root}`, a stage) upgrades it to format {RUN_FORMAT} first")


def _holds_format_1_state(run: RunDir) -> bool:
    if run.legacy_kl_ctrl_path.is_file() or any(run.legacy_kl_snapshot(k).is_file() for k in run.iterations()):
        return True
    try:
        record = run.read_json(run.last_good_path)
    except StateFileError:
        return False  # `rlhf status` names the damaged commit log
    return isinstance(record, dict) and "committed" not in record


def migrate(run: RunDir, cfg: RLHFConfig) -> Optional[str]:
    """Upgrade ``run`` to ``RUN_FORMAT`` (``cfg``: its saved config, for the KL controller settings
    a format-1 snapshot did not keep). Returns one line saying what was done, or None."""
    version = run_format(run)
    if version == RUN_FORMAT:
        return None
    if version > RUN_FORMAT:
        raise RLHFError(f"{run.root} is in run-directory format {version}, newer than this rlhf-dag reads "
                        f"({RUN_FORMAT}); use the version that wrote it")
    moved = _kl_states_from_1(run, cfg)
    _full_commit_log(run)
    run.legacy_kl_ctrl_path.unlink(missing_ok=True)
    for k in run.iterations():
        run.legacy_kl_snapshot(k).unlink(missing_ok=True)
    atomic_write_json(run.format_path, {"format": RUN_FORMAT})
    message = (f"upgraded {run.root} to run-directory format {RUN_FORMAT}: " +
               (f"the KL controller state of iterations {moved} is now each gae's output" if moved else
                "nothing to move"))
    run.append_event("migrated", None, to=RUN_FORMAT, message=message)
    return message


def _kl_states_from_1(run: RunDir, cfg: RLHFConfig) -> list[int]:
    """Write iter_k/kl_ctrl.json for every gae that ran with the KL in the reward and finished."""
    moved, previous = [], None
    for k in (k for k in run.iterations() if k >= 1):
        manifest = read_manifest(run, k)
        record = manifest.get("gae")
        snapshot_key = record_key(run, run.legacy_kl_snapshot(k))
        if not record or snapshot_key not in (record.get("inputs") or {}):
            continue  # no gae, or one without the KL in the reward: no controller state
        metrics = record.get("metrics") or {}
        if record.get("status") != "done" or "kl/coef_next" not in metrics:
            record["status"] = "stale" if record.get("status") == "done" else record.get("status")
            write_manifest(run, k, manifest)  # reruns, from the migrated predecessor's state
            continue
        used = _used_state(run, k, cfg, float(metrics["kl/coef"]))
        state = {"iteration": k, "used": used, "scale": 1.0, "next": {**used, "value": float(metrics["kl/coef_next"])}}
        atomic_write_json(run.kl_state(k), state)
        inputs = {key: v for key, v in record["inputs"].items() if key != snapshot_key}
        if previous is not None:
            inputs[record_key(run, run.kl_state(previous))] = sha256_tree(run.kl_state(previous))
        record["inputs"] = inputs
        record["outputs"] = {**record.get("outputs", {}), record_key(run, run.kl_state(k)): sha256_tree(run.kl_state(k))}
        record["outputs_paths"] = {**record.get("outputs_paths", {}), "kl_ctrl": str(run.kl_state(k))}
        write_manifest(run, k, manifest)
        moved.append(k)
        previous = k
    return moved


def _used_state(run: RunDir, k: int, cfg: RLHFConfig, coef: float) -> dict:
    """The controller state gae of ``k`` started from, at the coefficient it recorded using: the
    snapshot's type and settings, else (a fresh controller) the config's."""
    snapshot = (run.read_json(run.legacy_kl_snapshot(k)) or {}).get("state")
    if not isinstance(snapshot, dict):
        ctrl = cfg.algorithm.kl_ctrl
        snapshot = make_kl_controller(ctrl.type, coef, ctrl.target_kl, ctrl.horizon).state_dict()
    return {**snapshot, "value": coef}


def _full_commit_log(run: RunDir) -> None:
    """A commit log from before the "committed" list gets it (its guard records said which)."""
    record = run.read_json(run.last_good_path)
    if not isinstance(record, dict) or "committed" in record or not isinstance(record.get("iteration"), int):
        return
    last = record["iteration"]
    committed = [k for k in run.iterations() if 1 <= k < last
                 and read_manifest(run, k).get("guard", {}).get("committed")] + [last]
    atomic_write_json(run.last_good_path, {**record, "committed": committed})
