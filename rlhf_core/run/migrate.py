"""The run directory's format: one version number (``format.json``) and the one function that
upgrades an older directory, which every command that writes a run calls under its lock (a resume,
a stage, an export) before it reads anything else. Nothing else in the code knows an old layout.

    1  (no format.json) the KL controller's state in ``kl_ctrl.json`` at the run's root, rewritten
       by every gae, and ``iter_k/kl_ctrl_before.json``, the state iteration k started from (a
       retry multiplied both); a commit log may lack its "committed" list (the guard records said)
    2  the KL controller's state is an output of each iteration's gae, ``iter_k/kl_ctrl.json``
       {"used", "scale", "next"}, read by the next iteration from its committed predecessor
       (``stages.gae``); a retry raises trainer.kl_coef_scale in config.yaml instead. Tables may
       lack columns added since: the prompts ``reward_source``; the rollout, greedy-baseline and
       scored tables ``uid`` (or hold nulls there), ``rollout_log_probs``, ``reward_source``,
       ``extra_info``
    3  every prompts, rollout and scored table has every column of its schema (``data.schemas``)
    4  config.yaml starts with a seal line, a hash of the rest (``run.layout.write_config``): a change
       made outside rlhf is found, and a command continues with the recorded config (``run.saved_config``)

Upgrading 1 → 2 writes each gae's KL state from what it recorded (the coefficient it used and the
next one, in its manifest record's metrics; the controller's type and settings from its snapshot),
adds the file to the gae record's outputs and the predecessor's to its inputs, so integrity checks
and reruns treat it as any other output, then removes the old files. Idempotent: a kill part-way
is finished by the next command.

Upgrading 2 → 3 gives each table the columns it lacks, with what the readers of format 2 made of
their absence: ``reward_source`` = the data.reward_fn_key column (the prompt's, else the row's own);
``uid`` = "<iteration>-<prompt_id>" (grouping by prompt, as before uids); ``rollout_log_probs`` null
(unknown, as for imported responses); ``extra_info`` = the prompt's. Each rewritten table's new
sha256 replaces its old one in every manifest record, so nothing reruns and integrity checks still
hold. A table that no longer matches its recorded hash is left alone: it is damage, and its stage
reruns (in the current format) as for any damage. The rewrites are staged beside the tables and
listed in ``format_upgrade.json`` before any is put in place, so a kill part-way is finished by the
next command.

Upgrading 3 → 4 seals config.yaml as it is (it was the run's config until now).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import pyarrow as pa
import pyarrow.parquet as pq

from rlhf_core.algos import make_kl_controller
from rlhf_core.config.schema import KLCtrlConfig
from rlhf_core.data.schemas import PROMPTS, ROLLOUT, SCORED
from rlhf_core.errors import RLHFError
from rlhf_core.io.atomic import atomic_write_json, atomic_write_parquet
from rlhf_core.io.hashing import sha256_tree
from rlhf_core.run.layout import CONFIG_SEAL, RunDir, StateFileError, read_config_text, write_config
from rlhf_core.run.manifest import read_manifest, record_key, write_manifest

RUN_FORMAT = 4
"""The format this code writes (see the module docstring)."""

SEALED_FORMAT = 4
"""The first format whose config.yaml carries a seal line."""


def run_format(run: RunDir) -> int:
    """The directory's format: format.json's, else 1 for a run written before it (it has a
    config.yaml), else the current one (a new directory)."""
    try:
        record = run.read_json(run.format_path)
    except StateFileError as exc:
        raise StateFileError(f"{exc}; {_restamp_advice(run)}") from None
    if record is None:
        return 1 if run.config_path.is_file() else RUN_FORMAT
    if isinstance(record.get("format"), int) and not isinstance(record["format"], bool):
        return record["format"]
    raise StateFileError(f"{run.format_path} is damaged (it holds {str(record)[:200]}, not {{\"format\": N}}); "
                         f"{_restamp_advice(run)}")


def contents_format(run: RunDir) -> int:
    """The format of what a directory holds, read from its contents alone (what its format.json
    says when intact): the oldest format whose state it still holds, else the current one."""
    if _holds_format_1_state(run):
        return 1
    if _old_tables(run):
        return 2
    if run.config_path.is_file() and not run.config_path.read_bytes().startswith(CONFIG_SEAL.encode()):
        return 3  # no seal line at all (one that no longer matches is damage, not an older format)
    return RUN_FORMAT


def _restamp_advice(run: RunDir) -> str:
    n = contents_format(run)
    held = {1: "it holds format-1 KL controller state", 2: "some of its tables lack columns added in format 3",
            3: "its config.yaml has no seal line"}
    why = held.get(n, "it holds nothing of an older format")
    return (f"its contents are format {n} ({why}): write {{\"format\": {n}}} there "
            f"(`echo '{{\"format\": {n}}}' > {run.format_path}`) and run the command again")


def stamp(run: RunDir) -> None:
    """Mark a new run directory with the current format."""
    if not run.format_path.is_file():
        atomic_write_json(run.format_path, {"format": RUN_FORMAT})


def outdated(run: RunDir) -> Optional[str]:
    """Why the directory needs upgrading before this code reads it (for `rlhf status`), else None (also
    for an older one that holds nothing the upgrade would change)."""
    version = run_format(run)
    if version < RUN_FORMAT and run.format_journal.is_file():
        # killed part-way: tables already rewritten no longer match their records until the upgrade
        # finishes, which is not damage (a resume finishes it and nothing reruns)
        return (f"{run.root}: an upgrade to run-directory format {RUN_FORMAT} was interrupted part-way; any command "
                f"that writes it (`rlhf run --resume {run.root}`, a stage) finishes it first")
    holds_old = ((version == 1 and _holds_format_1_state(run)) or (version < 3 and bool(_old_tables(run)))
                 or (version < SEALED_FORMAT and _unsealed_config(run)))
    if version == RUN_FORMAT or not holds_old:
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


def migrate(run: RunDir, kl_ctrl: KLCtrlConfig, reward_fn_key: str) -> Optional[str]:
    """Upgrade ``run`` to ``RUN_FORMAT``, one format at a time. From the run's saved config:
    ``kl_ctrl`` (algorithm.kl_ctrl), the controller settings a format-1 snapshot did not keep, and
    ``reward_fn_key`` (data.reward_fn_key), the column its tables route rewards by. Returns one line
    saying what was done, or None."""
    version = run_format(run)
    if version == RUN_FORMAT:
        return None
    if version > RUN_FORMAT:
        raise RLHFError(f"{run.root} is in run-directory format {version}, newer than this rlhf-dag reads "
                        f"({RUN_FORMAT}); use the version that wrote it")
    done = []
    if version < 2:
        moved = _upgrade_from_1(run, kl_ctrl)
        done.append(f"the KL controller state of iterations {moved} is now each gae's output" if moved else
                    "no KL controller state to move")
    if version < 3:
        tables = _tables_from_2(run, reward_fn_key)
        done.append(f"{len(tables)} table(s) given the columns they lacked ({', '.join(tables)})" if tables else
                    "every table already had its columns")
    if version < SEALED_FORMAT:
        done.append("config.yaml sealed" if _seal_config(run) else "config.yaml was sealed already")
    message = f"upgraded {run.root} to run-directory format {RUN_FORMAT}: " + "; ".join(done)
    run.append_event("migrated", None, to=RUN_FORMAT, message=message)
    return message


def _upgrade_from_1(run: RunDir, kl_ctrl: KLCtrlConfig) -> list[int]:
    moved = _kl_states_from_1(run, kl_ctrl)
    _full_commit_log(run)
    run.legacy_kl_ctrl_path.unlink(missing_ok=True)
    for k in run.iterations():
        run.legacy_kl_snapshot(k).unlink(missing_ok=True)
    atomic_write_json(run.format_path, {"format": 2})
    return moved


def _kl_states_from_1(run: RunDir, kl_ctrl: KLCtrlConfig) -> list[int]:
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
        used = _used_state(run, k, kl_ctrl, float(metrics["kl/coef"]))
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


def _used_state(run: RunDir, k: int, ctrl: KLCtrlConfig, coef: float) -> dict:
    """The controller state gae of ``k`` started from, at the coefficient it recorded using: the
    snapshot's type and settings, else (a fresh controller) the config's."""
    snapshot = (run.read_json(run.legacy_kl_snapshot(k)) or {}).get("state")
    if not isinstance(snapshot, dict):
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


# ---------------------------------------------------------------------------------------------
# 2 → 3: every table has every column of its schema
# ---------------------------------------------------------------------------------------------


def _table_schemas(run: RunDir) -> list[tuple[Path, pa.Schema]]:
    """The tables format 3 completes, prompts first (the others take columns from them)."""
    tables = [(run.train_prompts, PROMPTS), (run.val_prompts, PROMPTS)]
    for k in (k for k in run.iterations() if k >= 1):
        tables += [(run.rollout(k), ROLLOUT), (run.rollout_baseline(k), ROLLOUT), (run.scored(k), SCORED)]
    return [(path, schema) for path, schema in tables if path.is_file()]


def _lacks(path: Path, schema: pa.Schema) -> bool:
    """Whether the table lacks a column of its schema (or holds a null uid). An unreadable table (cut
    short by a kill while written, damaged) is not upgraded: its stage rewrites it, as any damage."""
    try:
        names = pq.read_schema(path).names
        if any(name not in names for name in schema.names):
            return True
        return "uid" in schema.names and pq.read_table(path, columns=["uid"]).column("uid").null_count > 0
    except (pa.ArrowException, OSError):
        return False


def _old_tables(run: RunDir) -> list[Path]:
    return [path for path, schema in _table_schemas(run) if _lacks(path, schema)]


def _tables_from_2(run: RunDir, reward_fn_key: str) -> list[str]:
    """Complete every table (see the module docstring; ``reward_fn_key``: the run's
    data.reward_fn_key); the relative paths of those rewritten."""
    plan = run.read_json(run.format_journal) or _stage_tables(run, reward_fn_key)
    for rel in plan:
        staged = _staged(run.root / rel)
        if staged.is_file():
            os.replace(staged, run.root / rel)
    _replace_digests(run, plan)
    atomic_write_json(run.format_path, {"format": 3})
    run.format_journal.unlink(missing_ok=True)
    return list(plan)


def _staged(path: Path) -> Path:
    return path.with_name(path.name + ".format3")


def _stage_tables(run: RunDir, reward_fn_key: str) -> dict[str, dict[str, str]]:
    """Write each completed table beside its original and list them, {relative path: {"from": old
    sha256, "to": new sha256}}, in the journal; nothing is put in place yet."""
    recorded = _recorded_outputs(run)
    prompts: dict[str, dict] = {}
    plan = {}
    for path, schema in _table_schemas(run):
        lacks = _lacks(path, schema)
        if path == run.train_prompts:
            prompts = _prompt_lookup(path, reward_fn_key)  # what the response tables take from it
        if not lacks:
            continue
        table = pq.read_table(path)
        rel = record_key(run, path)
        if schema is PROMPTS:
            table = _complete_prompts(table, reward_fn_key)
        old = sha256_tree(path)
        if recorded.get(rel, old) != old:
            continue  # damaged since its stage wrote it: that stage reruns, in the current format
        if schema is not PROMPTS:
            table = _complete_responses(table, prompts, reward_fn_key)
        atomic_write_parquet(_staged(path), _in_schema_order(table, schema))
        plan[rel] = {"from": old, "to": sha256_tree(_staged(path))}
    atomic_write_json(run.format_journal, plan)
    return plan


def _prompt_lookup(path: Path, key: str) -> dict[str, dict]:
    """prompt_id → {"reward_source", "extra_info"} of the train prompts, completed as format 3 has
    them; {} when the table cannot be read."""
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError):
        return {}
    if "reward_source" not in table.column_names:
        table = _complete_prompts(table, key)
    columns = [c for c in ("prompt_id", "reward_source", "extra_info") if c in table.column_names]
    return {r["prompt_id"]: r for r in table.select(columns).to_pylist()}


def _recorded_outputs(run: RunDir) -> dict[str, str]:
    """{relative path: sha256} of every stage output the manifests record."""
    out = {}
    for k in [None, *run.iterations()]:
        for record in read_manifest(run, k).values():
            if isinstance(record, dict):
                out.update(record.get("outputs") or {})
    return out


def _replace_digests(run: RunDir, plan: dict[str, dict[str, str]]) -> None:
    """Every manifest record's input or output naming a rewritten table gets its new sha256."""
    for k in [None, *run.iterations()]:
        manifest, changed = read_manifest(run, k), False
        for record in manifest.values():
            for side in ("inputs", "outputs"):
                digests = record.get(side) if isinstance(record, dict) else None
                for rel, change in plan.items():
                    if digests and digests.get(rel) == change["from"]:
                        digests[rel], changed = change["to"], True
        if changed:
            write_manifest(run, k, manifest)


def _complete_prompts(table: pa.Table, key: str) -> pa.Table:
    """A prompts table with ``reward_source``: its data.reward_fn_key column as text."""
    values = table.column(key).to_pylist() if key in table.column_names else [None] * table.num_rows
    return _set(table, "reward_source", [None if v is None else str(v) for v in values], pa.string())


def _complete_responses(table: pa.Table, prompts: dict[str, dict], key: str) -> pa.Table:
    """A rollout or scored table with ``uid``, ``rollout_log_probs``, ``reward_source`` and ``extra_info``."""
    names, rows = table.column_names, table.num_rows
    ids = table.column("prompt_id").to_pylist()
    prompt_of = [prompts.get(p, {}) for p in ids]
    if "reward_source" not in names:
        own = table.column(key).to_pylist() if key in names else [None] * rows
        table = _set(table, "reward_source", [p.get("reward_source") or (None if v is None else str(v))
                                              for p, v in zip(prompt_of, own)], pa.string())
    if "extra_info" not in names:
        table = _set(table, "extra_info", [p.get("extra_info") or "{}" for p in prompt_of], pa.string())
    if "rollout_log_probs" not in names:
        table = _set(table, "rollout_log_probs", [None] * rows, ROLLOUT.field("rollout_log_probs").type)
    uids = table.column("uid").to_pylist() if "uid" in names else [None] * rows
    grouped = [f"{k}-{p}" for k, p in zip(table.column("iteration").to_pylist(), ids)]
    return _set(table, "uid", [u if u is not None else g for u, g in zip(uids, grouped)], pa.string())


def _set(table: pa.Table, name: str, values: list, type_: pa.DataType) -> pa.Table:
    column = pa.array(values, type_)
    if name in table.column_names:
        return table.set_column(table.column_names.index(name), name, column)
    return table.append_column(name, column)


def _in_schema_order(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """The schema's columns in its order, cast to its types, then any others the table holds."""
    names = [n for n in schema.names if n in table.column_names]
    names += [n for n in table.column_names if n not in schema.names]
    types = [schema.field(n).type if n in schema.names else table.schema.field(n).type for n in names]
    return pa.table([table.column(n).cast(t) for n, t in zip(names, types)], names=names)


def _unsealed_config(run: RunDir) -> bool:
    return run.config_path.is_file() and read_config_text(run)[1] is not None


def _seal_config(run: RunDir) -> bool:
    """Seal config.yaml as it is, then mark the directory format 4; whether it needed sealing."""
    sealed = _unsealed_config(run)
    if sealed:
        write_config(run, read_config_text(run)[0])
    atomic_write_json(run.format_path, {"format": 4})
    return sealed
