"""runconfig.py: the run's config from a file (TOML, YAML or JSON) and the command line.

`CoordinatorConfig` (config.py) is the one typed config. Here: loading a file, `--set
FIELD=VALUE` overrides parsed by the field's type, type checks that name the field, the
type wanted and the value given, and the resolved view `gyre config show` prints (each
field with where its value came from: default, file or flag). Not the defaults
themselves: those live on the dataclass.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from gyre.coordinator.config import CoordinatorConfig
from gyre.coordinator.rundir import absolute
from gyre.workerd.wire import GyreError


class ConfigError(GyreError):
    """A config file or value that cannot be used; the message names the field."""


def _hints() -> dict[str, Any]:
    return typing.get_type_hints(CoordinatorConfig)


def field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(CoordinatorConfig)]


def did_you_mean(name: str, known: list[str] | tuple[str, ...], otherwise: str) -> str:
    """ "did you mean 'X'?" for the known name closest to `name`, else `otherwise`."""
    close = difflib.get_close_matches(name, known, n=1)
    return f"did you mean '{close[0]}'?" if close else otherwise


def unknown_field(name: str) -> str:
    """One line for a name that is no field of the run config (the list is `gyre config show`'s)."""
    return f"unknown field '{name}': " + did_you_mean(name, field_names(), "`gyre config show` lists the fields")


def load_config_file(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            data = json.loads(text)
    except Exception as e:  # noqa: BLE001 - any parser's error, reported with the file
        raise ConfigError(f"{path}: {type(e).__name__}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a table of fields, got {type(data).__name__}")
    unknown = sorted(set(data) - set(field_names()))
    if unknown:
        raise ConfigError(f"{path}: " + "; ".join(unknown_field(name) for name in unknown))
    return data


def parse_sets(items: list[str]) -> dict[str, Any]:
    """`FIELD=VALUE` strings -> values of the field's type (JSON for lists and tables)."""
    hints = _hints()
    out: dict[str, Any] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected FIELD=VALUE")
        if name not in hints:
            raise ConfigError(unknown_field(name))
        out[name] = _parse_value(name, hints[name], raw.strip())
    return out


def _parse_value(name: str, hint: Any, raw: str) -> Any:
    kinds = _kinds(hint)
    if raw.lower() in ("none", "null") and type(None) in kinds:
        return None
    for kind in kinds:
        try:
            if kind is bool:
                if raw.lower() in ("true", "1", "yes", "on"):
                    return True
                if raw.lower() in ("false", "0", "no", "off"):
                    return False
                continue
            if kind in (int, float):
                return kind(raw)
            if kind in (str, Path):
                if str in kinds and raw.startswith("[") and tuple in kinds:
                    continue  # `harness=[...]` is a command list, not a name
                return kind(raw)
            if kind in (tuple, list, dict):
                value = json.loads(raw)
                if isinstance(value, (list, dict)):
                    return value
        except ValueError:
            continue
    raise ConfigError(f"--set {name}={raw}: not a {_type_name(hint)}")


def _kinds(hint: Any) -> list[type]:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return [k for arg in typing.get_args(hint) for k in _kinds(arg)]
    origin = typing.get_origin(hint)
    return [origin or hint]


def _type_name(hint: Any) -> str:
    return " or ".join("none" if k is type(None) else "path" if k is Path else k.__name__ for k in _kinds(hint))


def _check_types(values: dict[str, Any]) -> dict[str, Any]:
    """Coerce what is unambiguous (paths, lists to tuples, ints to floats); name the rest."""
    hints = _hints()
    out = {}
    for name, value in values.items():
        kinds = _kinds(hints[name])
        if value is None and type(None) in kinds:
            out[name] = None
        elif Path in kinds and isinstance(value, (str, Path)):
            out[name] = Path(value)
        elif tuple in kinds and isinstance(value, (list, tuple)) and not (str in kinds and isinstance(value, str)):
            out[name] = tuple(value)
        elif isinstance(value, bool) and bool not in kinds:
            raise ConfigError(f"field {name}: expected {_type_name(hints[name])}, got {value!r}")
        elif float in kinds and isinstance(value, int):
            out[name] = float(value)
        elif any(isinstance(value, k) for k in kinds if k is not type(None)):
            out[name] = value
        else:
            raise ConfigError(f"field {name}: expected {_type_name(hints[name])}, got {value!r}")
    return out


REAL_MODEL_LR = 1e-6  # SmolLM2-135M collapsed in one update at 3e-3 and learned stably at 1e-6 (MODEL-NOTES)


def model_defaults(model_dir: Path, *, lr: float | None, default_max_tokens: int | None,
                   max_tokens_cap: int | None, max_context: int | None) -> dict[str, Any]:
    """The per-model values of the fields left unset (None): the model directory's gyre.json
    where it names them (the tiny model's does), else real-model defaults: lr 1e-6, output
    limits up to the remaining context, the context the model was trained for. A
    max_context above the model's own is clamped to it, with a warning."""
    import logging

    from gyre.workerd.modelconfig import gyre_defaults, load_config

    limit = load_config(model_dir).max_position_embeddings
    own = gyre_defaults(model_dir)
    if max_context is not None and max_context > limit:
        logging.getLogger("gyre.coordinator").warning(
            "max_context %d is above the model's max_position_embeddings %d: clamped to %d", max_context, limit, limit)
        max_context = limit
    return {"lr": own.get("lr", REAL_MODEL_LR) if lr is None else lr,
            "default_max_tokens": own.get("default_max_tokens") if default_max_tokens is None else default_max_tokens,
            "max_tokens_cap": own.get("max_tokens_cap") if max_tokens_cap is None else max_tokens_cap,
            "max_context": limit if max_context is None else max_context}


def with_model_defaults(config: CoordinatorConfig) -> CoordinatorConfig:
    """`config` with its per-model fields resolved against its model directory (idempotent)."""
    values = model_defaults(config.model_dir, lr=config.lr, default_max_tokens=config.default_max_tokens,
                            max_tokens_cap=config.max_tokens_cap, max_context=config.max_context)
    changed = {k: v for k, v in values.items() if getattr(config, k) != v}
    return dataclasses.replace(config, **changed) if changed else config


def build_config(file_values: dict[str, Any], overrides: dict[str, Any]) -> CoordinatorConfig:
    """`overrides` holds only what was given (a None there clears a field, as `--set F=none`)."""
    values = _check_types({**file_values, **overrides})
    for name, kind in _hints().items():  # paths against the working directory, stored absolute
        if Path in _kinds(kind) and isinstance(values.get(name), Path):
            values[name] = absolute(values[name])
    try:
        return CoordinatorConfig(**values)
    except (TypeError, ValueError) as e:  # HarnessError included
        raise ConfigError(str(e)) from None


def resolved(config: CoordinatorConfig, file_values: dict[str, Any], overrides: dict[str, Any]) -> list[dict]:
    """Every field: its value and where it came from (flag > file > default)."""
    data = config.to_json()
    rows = []
    for name in field_names():
        source = "flag" if name in overrides else "file" if name in file_values else "default"
        rows.append({"field": name, "value": data[name], "source": source,
                     "type": _type_name(_hints()[name])})
    return rows


def show_text(rows: list[dict]) -> str:
    """The resolved config as TOML-like lines, each with its source; a row with a meaning
    (`gyre config show --explain`) has it above, as comment lines."""
    import textwrap

    width = max(len(r["field"]) for r in rows)
    lines = []
    for r in rows:
        if r.get("meaning"):
            lines += ["", *textwrap.wrap(r["meaning"], 96, initial_indent="# ", subsequent_indent="# ")]
        lines.append(f"{r['field']:<{width}} = {json.dumps(r['value'])}  # {r['source']}, {r['type']}")
    return "\n".join(lines)
