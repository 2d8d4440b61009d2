"""Config trees in and out of text, for any pydantic model: `dotted.key=value` overrides parsed
against the model's annotations, validation errors as one readable `ConfigError` that names the
full dotted key (with a did-you-mean for a misspelt one), and TOML that reads back to an equal
config. The schema itself, presets and loading are kiln/config.py's.
"""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Sequence
from typing import Any, get_args, get_origin

from pydantic import BaseModel, ValidationError

from kiln.tomlw import toml_key, toml_value


class ConfigError(ValueError):
    """A config file, preset or override that cannot be used; the message says what to fix."""


def apply_override(data: dict[str, Any], item: str, root: type[BaseModel]) -> None:
    """Set `dotted.key=value` in a raw dict of `root`; the value is parsed as a TOML value if it can be."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"bad override '{item}': expected dotted.key=value, e.g. sandbox.memory_mb=512")
    parts = key.split(".")
    node = data
    for i, part in enumerate(parts[:-1]):
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            where = ".".join(parts[: i + 1])
            raise ConfigError(f"bad override '{item}': '{where}' is a value, not a section")
    node[parts[-1]] = _parse_value(raw.strip(), _field_type(root, parts))


def _parse_value(raw: str, target: Any) -> Any:
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw  # a bare word: run.name=demo
    # A string field keeps the text as typed, so run.name=2024 stays "2024".
    return raw if target is str and not isinstance(value, str) else value


def _field_type(root: type[BaseModel], parts: Sequence[str]) -> Any:
    """The annotation at a dotted path in `root`'s tree, or None when the path is not a field."""
    t: Any = root
    for part in parts:
        if get_origin(t) is dict:  # sandbox.env.NAME=... targets the dict's value type
            t = get_args(t)[1]
            continue
        field = t.model_fields.get(part) if _is_model(t) else None
        if field is None:
            return None
        t = field.annotation
    return t


def _is_model(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, BaseModel)


# ------------------------------------------------------------------------------------- validation


def validate_config(data: dict[str, Any], model: type[BaseModel]) -> Any:
    """Validate a raw dict into `model`, turning pydantic's errors into one readable ConfigError."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError("\n".join(_describe(err, model) for err in e.errors())) from None


def _describe(err: dict[str, Any], model: type[BaseModel]) -> str:
    loc = [str(p) for p in err["loc"]]
    key = ".".join(loc)
    if err["type"] == "extra_forbidden":
        allowed = list(_model_at(model, loc[:-1]).model_fields)
        prefix = ".".join(loc[:-1] + [""])
        close = difflib.get_close_matches(loc[-1], allowed, n=1)
        hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
        return f"unknown config key '{key}'{hint} allowed: {', '.join(allowed)}"
    got = repr(err["input"])
    got = got if len(got) <= 80 else got[:77] + "..."
    return f"{key or '<root>'}: {err['msg']} (got {got})"


def _model_at(model: type[BaseModel], loc: Sequence[str]) -> type[BaseModel]:
    for part in loc:
        nxt = model.model_fields[part].annotation if part in model.model_fields else None
        if not _is_model(nxt):
            break  # inside a list or dict: report the nearest enclosing model
        model = nxt
    return model


# -------------------------------------------------------------------------------------- TOML out


def config_to_toml(cfg: BaseModel) -> str:
    """Render a config as TOML that kiln.config's `load_config` reads back to an equal config."""
    return "\n".join(_table(cfg, [])).strip() + "\n"


def _table(model: BaseModel, path: list[str]) -> list[str]:
    lines = [f"[{'.'.join(path)}]"] if path else []
    subtables = []
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            subtables.append((name, value))
        elif value is not None:  # TOML has no null: a missing key means the default
            if isinstance(value, list) and value and isinstance(value[0], BaseModel):  # [[phases]] as inline tables
                value = [v.model_dump(exclude_none=True) for v in value]
            lines.append(f"{toml_key(name)} = {toml_value(value)}")
    for name, sub in subtables:  # scalars must come before sub-tables in TOML
        lines += ["", *_table(sub, path + [name])]
    return lines
