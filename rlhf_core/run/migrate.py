"""The run directory's format: one version number (``format.json``) and the one function that
upgrades an older directory, which every command that writes a run calls under its lock (a resume,
a stage, an export) before it reads anything else. Nothing else in the code knows an old layout.

    1  (no format.json) the KL controller's state in ``kl_ctrl.json`` at the run's root, rewritten
       by every gae, and ``iter_k/kl_ctrl_before.json``, the state iteration k started from (a
       retry multiplied both); a commit log may lack its "committed" list (the guard records said)
    2  the KL controller's state is an output of each iteration's gae, ``iter_k/kl_ctrl.json``
       {"used", "scale", "next"}, read by the next iteration from its committed predecessor
       (``stages.gae``); a retry raised trainer.kl_coef_scale in config.yaml instead (until 5).
       Tables may lack columns added since: the prompts ``reward_source``; the rollout, greedy-baseline and
       scored tables ``uid`` (or hold nulls there), ``rollout_log_probs``, ``reward_source``,
       ``extra_info``
    3  every prompts, rollout and scored table has every column of its schema (``data.schemas``)
    4  config.yaml starts with a seal line, a hash of the rest (``run.layout.write_config``): a change
       made outside rlhf is found, and a command continues with the recorded config (``run.saved_config``)
    5  the reward's KL coefficient β has one source: ``iter_k/kl_ctrl.json`` = {"iteration", "used",
       "retry_scale", "next"}, where "next" already holds a retry's raise; a retry records its scale
       for the iteration in ``iter_k/retry.json``. trainer.kl_coef_scale is gone from the config

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

Upgrading 4 → 5 keeps every coefficient: with c = config.yaml's trainer.kl_coef_scale and f the
"scale" of the last committed iteration's kl_ctrl.json (1 without one), a retry decided c after that
iteration, so the next iteration to run gets ``iter_k/retry.json`` with s = c / f (none when s = 1);
then config.yaml loses the key and is sealed again; then each gae record's config hash is the one
without the key (when it was that config's: nothing reruns for the removal alone); then each
kl_ctrl.json {"used", "scale", "next"} becomes {"used": used with value × scale, "retry_scale": 1,
"next": next with value × scale}, its new sha256 put in every manifest record that named the old one
before the file is replaced (so a kill in between leaves records that the rerun's identical rewrite
matches). Idempotent, in that order: a kill part-way is finished by the next command. A saved config
tree of an older format (config.yaml before the upgrade, the config a state record kept) is read
without the keys removed since (``current_config_tree``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from rlhf_core.algos.controllers import make_kl_controller
from rlhf_core.config.loader import flatten_tree
from rlhf_core.config.schema import KLCtrlConfig
from rlhf_core.data.schemas import PROMPTS, ROLLOUT, SCORED
from rlhf_core.errors import RLHFError
from rlhf_core.io.atomic import atomic_write_json, atomic_write_parquet
from rlhf_core.io.hashing import sha256_tree
from rlhf_core.run.layout import CONFIG_SEAL, RunDir, StateFileError, read_config_text, write_config
from rlhf_core.run.lifecycle import RETRY_SCALE, committed_iterations
from rlhf_core.run.manifest import read_manifest, record_key, write_manifest

RUN_FORMAT = 5
"""The format this code writes (see the module docstring)."""

SEALED_FORMAT = 4
"""The first format whose config.yaml carries a seal line."""

SCALE_KEY = ("trainer", "kl_coef_scale")
"""Format 4's config key that scaled the reward's KL coefficient (format 5: ``iter_k/retry.json``)."""

GAE_SECTIONS = ("algorithm.", "critic.enable")
"""The config gae's record hashes (the keys of ``stages.gae.gae_settings``) less format 4's scale key."""


def current_config_tree(tree: Any) -> Any:
    """A saved config tree (config.yaml as read, the config a state record kept) without the keys
    an older format held and this code no longer has: format 4's trainer.kl_coef_scale."""
    section, key = SCALE_KEY
    if isinstance(tree, dict) and isinstance(tree.get(section), dict) and key in tree[section]:
        return {**tree, section: {k: v for k, v in tree[section].items() if k != key}}
    return tree


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
    if _holds_format_4_state(run):
        return 4
    return RUN_FORMAT


def _restamp_advice(run: RunDir) -> str:
    n = contents_format(run)
    held = {1: "it holds format-1 KL controller state", 2: "some of its tables lack columns added in format 3",
            3: "its config.yaml has no seal line",
            4: "its config.yaml or a kl_ctrl.json holds the KL coefficient scale format 5 moved to retry.json"}
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
    if version > RUN_FORMAT:
        return newer_format(run, version)
    if version < RUN_FORMAT and run.format_journal.is_file():
        # killed part-way: tables already rewritten no longer match their records until the upgrade
        # finishes, which is not damage (a resume finishes it and nothing reruns)
        return (f"{run.root}: an upgrade to run-directory format {RUN_FORMAT} was interrupted part-way; any command "
                f"that writes it (`rlhf run --resume {run.root}`, a stage) finishes it first")
    holds_old = ((version == 1 and _holds_format_1_state(run)) or (version < 3 and bool(_old_tables(run)))
                 or (version < SEALED_FORMAT and _unsealed_config(run)) or (version < 5 and _holds_format_4_state(run)))
    if version == RUN_FORMAT or not holds_old:
        return None
    return (f"{run.root} is in run-directory format {version}; any command that writes it (`rlhf run --resume "
            f"{run.root}`, a stage) upgrades it to format {RUN_FORMAT} first")


def newer_format(run: RunDir, version: int) -> str:
    """What a directory of a format newer than this code's is (every command refuses it)."""
    return (f"{run.root} is in run-directory format {version}, newer than this rlhf-dag reads ({RUN_FORMAT}); "
            "use the version that wrote it")


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
        raise RLHFError(newer_format(run, version))
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
    if version < 5:
        done.append(_upgrade_from_4(run))
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


# ---------------------------------------------------------------------------------------------
# 4 → 5: β has one source (the controller's state and the iteration's retry.json)
# ---------------------------------------------------------------------------------------------


def _holds_format_4_state(run: RunDir) -> bool:
    """Whether config.yaml holds trainer.kl_coef_scale or a kl_ctrl.json its "scale"."""
    if _config_scale(run) is not None:
        return True
    return any(_old_kl_state(run, k) is not None for k in run.iterations())


def _config_tree(run: RunDir) -> Optional[dict]:
    """config.yaml as a tree when its seal verifies (a damaged one is left as it is: commands
    continue with the recorded config, read without the removed keys), else None."""
    if not run.config_path.is_file():
        return None
    text, problem = read_config_text(run)
    if problem is not None:
        return None
    try:
        tree = yaml.safe_load(text)
    except yaml.YAMLError:
        return None
    return tree if isinstance(tree, dict) else None


def _config_scale(run: RunDir) -> Optional[float]:
    """config.yaml's trainer.kl_coef_scale, None when it holds none."""
    section, key = SCALE_KEY
    trainer = (_config_tree(run) or {}).get(section)
    value = trainer.get(key) if isinstance(trainer, dict) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _old_kl_state(run: RunDir, k: int) -> Optional[dict]:
    """Iteration ``k``'s kl_ctrl.json when it is format 4's {"used", "scale", "next"}, else None
    (absent, already format 5, or damaged: its gae reruns, in the current format)."""
    try:
        record = run.read_json(run.kl_state(k))
    except StateFileError:
        return None
    if not record or "scale" not in record:
        return None
    numbers = [record.get("scale"), (record.get("used") or {}).get("value"), (record.get("next") or {}).get("value")]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers):
        return None
    return record


def _upgrade_from_4(run: RunDir) -> str:
    done = []
    retry = _scale_to_retry_record(run)
    if retry is not None:
        done.append(f"the KL coefficient scale {retry[1]:g} a retry saved in config.yaml is now "
                    f"iter_{retry[0]}/retry.json's")
    rehashed = _gae_config_hashes(run)
    if _drop_config_scale(run):
        done.append("config.yaml sealed without trainer.kl_coef_scale")
    states = [k for k in run.iterations() if _kl_state_from_4(run, k)]
    done.append(f"the KL controller states of iterations {states} hold their coefficients as used" if states else
                "no KL controller state to rewrite")
    if rehashed:
        done.append(f"{rehashed} gae record(s) hashed without the removed key")
    atomic_write_json(run.format_path, {"format": 5})
    return "; ".join(done)


def _scale_to_retry_record(run: RunDir) -> Optional[tuple[int, float]]:
    """A retry decided config.yaml's scale c after the last committed iteration, which ran with its
    kl_ctrl.json's scale f: the next iteration gets retry.json with s = c / f (None: s = 1, or no
    scale in config.yaml). Written before config.yaml loses the key: a kill in between writes the
    same file again."""
    config_scale = _config_scale(run)
    if config_scale is None:
        return None
    committed = committed_iterations(run)
    file_scale = next((float(record["scale"]) for record in (_old_kl_state(run, j) for j in reversed(committed))
                       if record is not None), 1.0)
    scale = config_scale / file_scale
    if scale == 1.0:
        return None
    k = (committed[-1] if committed else 0) + 1
    atomic_write_json(run.retry_record(k), {"iteration": k, RETRY_SCALE: scale, "changes": {},
                                            "migrated": f"trainer.kl_coef_scale {config_scale:g} of config.yaml / "
                                                        f"{file_scale:g} of the last committed kl_ctrl.json"})
    return k, scale


_SCALE_LINE = re.compile(r"^  kl_coef_scale: .*\n", re.MULTILINE)


def _drop_config_scale(run: RunDir) -> bool:
    """config.yaml without trainer.kl_coef_scale, sealed again; whether it held the key."""
    if _config_scale(run) is None:
        return False
    tree = _config_tree(run)
    text = read_config_text(run)[0]
    start = re.search(r"^trainer:\n", text, re.MULTILINE)
    end = re.search(r"^\S", text[start.end():], re.MULTILINE) if start else None
    stop = start.end() + end.start() if end else len(text)
    body = text[:start.end()] + _SCALE_LINE.sub("", text[start.end():stop], count=1) + text[stop:] if start else text
    if yaml.safe_load(body) != current_config_tree(tree):  # a layout other than to_yaml's: dump it again
        body = yaml.safe_dump(current_config_tree(tree), sort_keys=False, default_flow_style=False)
    write_config(run, body)
    return True


def _section_hash(flat: dict[str, Any]) -> str:
    """``config.config_hash`` of a flattened config section."""
    return hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()


def _gae_config_hashes(run: RunDir) -> int:
    """Each gae record whose config hash is that of config.yaml's gae sections with the scale it ran
    with (its kl_ctrl.json's, config.yaml's, or 1) gets the hash of the same sections without the key;
    a record of another config is left alone (it reruns, as it would have). How many were rehashed."""
    tree = _config_tree(run)
    if tree is None:
        return 0
    flat = {key: v for key, v in flatten_tree(current_config_tree(tree)).items() if key.startswith(GAE_SECTIONS)}
    new = _section_hash(flat)
    scales = {1.0} | ({_config_scale(run)} - {None})
    changed = 0
    for k in (k for k in run.iterations() if k >= 1):
        manifest = read_manifest(run, k)
        record = manifest.get("gae")
        if not isinstance(record, dict) or record.get("config_hash") in (None, new):
            continue
        own = _old_kl_state(run, k)
        candidates = scales | ({float(own["scale"])} if own else set())
        if any(record["config_hash"] == _section_hash({**flat, "trainer.kl_coef_scale": c}) for c in candidates):
            record["config_hash"] = new
            write_manifest(run, k, manifest)
            changed += 1
    return changed


def _kl_state_from_4(run: RunDir, k: int) -> bool:
    """Rewrite iteration ``k``'s format-4 kl_ctrl.json with its coefficients as used (see the module
    docstring): staged beside it, its sha256 put in the manifests, then put in place."""
    old = _old_kl_state(run, k)
    if old is None:
        return False
    scale = float(old["scale"])
    new = {"iteration": old.get("iteration", k), "used": {**old["used"], "value": old["used"]["value"] * scale},
           "retry_scale": 1.0, "next": {**old["next"], "value": old["next"]["value"] * scale}}
    path = run.kl_state(k)
    staged = path.with_name(path.name + ".format5")
    atomic_write_json(staged, new)
    _replace_digests(run, {record_key(run, path): {"from": sha256_tree(path), "to": sha256_tree(staged)}})
    os.replace(staged, path)
    return True
