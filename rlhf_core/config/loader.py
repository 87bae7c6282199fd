"""YAML presets + dotted overrides → a typed, validated ``RLHFConfig``.

    cfg = load_config("configs/demo.yaml", ["algorithm.kl_ctrl.kl_coef=0.002"])

Errors name the key and say the fix: an unknown key lists the closest valid ones, a value of the
wrong type states the expected type, a value that breaks a rule states the rule (``validate.py``).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import types
import typing
from pathlib import Path
from typing import Any, Iterable, Literal, Union

import yaml

from rlhf_core.config.schema import RLHFConfig
from rlhf_core.errors import RLHFError


class ConfigError(RLHFError, ValueError):
    """A configuration problem; the message names the key and how to fix it."""


# ---------------------------------------------------------------------------------------------
# key discovery
# ---------------------------------------------------------------------------------------------


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def valid_keys(cls: type = RLHFConfig, prefix: str = "") -> list[str]:
    """Every settable dotted key (leaves and sections) of the schema."""
    keys = []
    for name, tp in _field_types(cls).items():
        dotted = f"{prefix}{name}"
        keys.append(dotted)
        if _is_dataclass_type(tp):
            keys.extend(valid_keys(tp, dotted + "."))
    return keys


def _unknown_key_error(dotted: str) -> ConfigError:
    keys = valid_keys()
    close = difflib.get_close_matches(dotted, keys, n=3, cutoff=0.6)
    if not close:  # a right leaf name under the wrong section is the common slip
        leaf = dotted.rsplit(".", 1)[-1]
        close = [k for k in keys if k.rsplit(".", 1)[-1] == leaf][:3]
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    return ConfigError(
        f"unknown config key '{dotted}'.{hint} (`rlhf config show` prints every valid key)"
    )


# ---------------------------------------------------------------------------------------------
# value coercion
# ---------------------------------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string",
            type(None): "null"}.get(tp, str(tp))


def _coerce(value: Any, tp: Any, dotted: str) -> Any:
    origin = typing.get_origin(tp)
    bad = ConfigError(f"{dotted}: expected {_type_name(tp)}, got {value!r}")
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, dotted)
            except ConfigError:
                pass
        raise bad
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise bad
    if origin is list:
        if isinstance(value, str):  # `key=a,b` on the command line
            value = [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise bad
        (inner,) = typing.get_args(tp)
        return [_coerce(v, inner, f"{dotted}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise bad
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-6" as a string
            try:
                return float(value)
            except ValueError:
                raise bad from None
        raise bad
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise bad
    raise ConfigError(f"{dotted}: unsupported schema type {tp!r}")


def _build(cls: type, data: dict, prefix: str = "") -> Any:
    """Construct dataclass ``cls`` from a nested dict, defaults for what is absent."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    types_ = _field_types(cls)
    for key in data:
        if key not in types_:
            raise _unknown_key_error(f"{prefix}{key}")
    kwargs = {}
    for name, tp in types_.items():
        if name not in data:
            continue
        dotted = f"{prefix}{name}"
        if _is_dataclass_type(tp):
            kwargs[name] = _build(tp, data[name] or {}, dotted + ".")
        else:
            kwargs[name] = _coerce(data[name], tp, dotted)
    return cls(**kwargs)


# ---------------------------------------------------------------------------------------------
# presets and overrides
# ---------------------------------------------------------------------------------------------


def parse_override(text: str) -> tuple[str, Any]:
    """``a.b.c=value`` → ("a.b.c", value parsed as YAML, so 0.1 is a float and true a bool)."""
    key, sep, raw = text.partition("=")
    key = key.strip().lstrip("+")  # accept hydra's '+key=value' spelling too
    if not sep or not key:
        raise ConfigError(f"bad override {text!r}: write it as dotted.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    node = tree
    parts = dotted.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(parts[: i + 1])} is a value, not a section: cannot set {dotted}")
        node = child
    node[parts[-1]] = value


def read_preset(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config preset {str(path)!r} not found (presets live in configs/)")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return tree


def load_config(preset: str | Path | None = None, overrides: Iterable[str] = ()) -> RLHFConfig:
    """Defaults ← preset YAML ← dotted overrides, then type-checked and validated."""
    from rlhf_core.config.validate import validate

    tree = read_preset(preset) if preset else {}
    for text in overrides:
        key, value = parse_override(text)
        if key not in valid_keys():
            raise _unknown_key_error(key)
        _set_dotted(tree, key, value)
    cfg = _build(RLHFConfig, tree)
    validate(cfg)
    return cfg


def config_from_dict(tree: dict) -> RLHFConfig:
    """Rebuild a config saved with ``to_dict`` (e.g. a run directory's config.yaml)."""
    from rlhf_core.config.validate import validate

    cfg = _build(RLHFConfig, tree)
    validate(cfg)
    return cfg


def apply_overrides(cfg: RLHFConfig, overrides: Iterable[str]) -> RLHFConfig:
    """A copy of ``cfg`` with dotted overrides applied and validated."""
    tree = to_dict(cfg)
    for text in overrides:
        key, value = parse_override(text)
        if key not in valid_keys():
            raise _unknown_key_error(key)
        _set_dotted(tree, key, value)
    return config_from_dict(tree)


# ---------------------------------------------------------------------------------------------
# views
# ---------------------------------------------------------------------------------------------


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)


def flatten(cfg: Any) -> dict[str, Any]:
    """{"actor_rollout_ref.actor.clip_ratio": 0.2, ...} — for MLflow params and hashes."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                out[f"{prefix}{key}"] = value

    walk(to_dict(cfg), "")
    return out


def config_hash(cfg: Any, sections: Iterable[str] | None = None) -> str:
    """sha256 of the (selected) flattened config: a stage records the keys it depends on, so a
    change elsewhere does not force it to rerun."""
    flat = flatten(cfg)
    if sections is not None:
        prefixes = tuple(sections)
        flat = {k: v for k, v in flat.items() if k.startswith(prefixes)}
    blob = json.dumps(flat, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()
