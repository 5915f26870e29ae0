"""Reading and writing configs: YAML files, `--set section.key=value` overrides and nested dicts,
parsed strictly against the schema of megalysses/config/__init__.py.

    cfg = load_config("configs/quickstart.yaml", overrides=["optimizer.lr=3e-4", "parallel.tp=2"])
    save_config(cfg, "runs/x/config.yaml")   # loads back to an equal object, with its paths absolute

Unknown keys fail with the key, its path and the nearest valid name, or, for a Megatron-LM name (its flags with
underscores, e.g. context_parallel_size, or parallel.cp), the key it is here (megalysses/config/megatron_names.py);
Megatron-LM's spellings of choice values (RMSNorm, WSD) read as megalysses' own. Values are parsed by the
field's type; load_config then checks the cross-field rules (megalysses/config/checks.py).
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from megalysses.config import megatron_names
from megalysses.config import PATH_KEYS, Config, ConfigError
from megalysses.config.checks import validate_config


# keys users bring from other frameworks that are derived here, not set
DERIVED = {"parallel.dp": ": data parallelism is what the processes leave over, world size / (tp * sp * pp); "
                          "launch more or fewer processes (torchrun --nproc-per-node, --nnodes) to change it"}


def _nearest(name: str, choices: list[str], where: str = "", value: Any = None) -> str:
    if where in DERIVED:
        return DERIVED[where]
    answer = megatron_names.answer_for(where, value)
    if answer is not None:
        return f": {answer}"
    match = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
    return f" (did you mean '{match[0]}'?)" if match else f" (valid: {', '.join(choices)})"


def _expected(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " or ".join(map(str, typing.get_args(tp)))
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string"}.get(tp, str(tp))


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Convert a YAML / override value to the field type `tp`, or raise ConfigError naming `path`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        nullable = len(args) < len(typing.get_args(tp))
        if nullable and (value is None or (isinstance(value, str) and value.lower() in ("none", "null", "~"))):
            return None
        if len(args) == 1:
            return _coerce(value, args[0], path)
        for arg in args:                     # the first type that takes the value (int | Literal["auto"])
            try:
                return _coerce(value, arg, path)
            except ConfigError:
                pass
        raise ConfigError(f"{path}: expected {' or '.join(_expected(a) for a in args)}, got {value!r}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        value = megatron_names.canonical_value(path, value)
        if value not in allowed:
            raise ConfigError(f"{path}: {value!r} is not one of {', '.join(map(str, allowed))}")
        return value
    if origin is list:
        (inner,) = typing.get_args(tp)
        if isinstance(value, str):
            text = value.strip()
            value = _load_yaml(text) if text.startswith("[") else [v for v in text.split(",") if v]
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        return [_coerce(v, inner, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ConfigError(f"{path}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{path}: expected a number, got {value!r}") from None
        if not math.isfinite(number):
            raise ConfigError(f"{path}: {value!r} is not a finite number: give a real value")
        return number
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return str(value)
    raise ConfigError(f"{path}: unsupported field type {tp}")


def _build(cls: type, data: Any, path: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping of keys, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in list(data.items()):
        for implied, implied_value in megatron_names.implied_keys(f"{path}.{key}" if path else str(key), value).items():
            data = {implied: implied_value, **data}      # what Megatron-LM's spelling implies, unless given
    for key, value in data.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in names:
            raise ConfigError(f"unknown config key '{where}'{_nearest(str(key), names, where, value)}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, where)
        else:
            kwargs[key] = _coerce(value, tp, where)
    return cls(**kwargs)


def config_from_dict(data: dict) -> Config:
    """Build a Config from a nested dict, strictly (unknown keys and bad types raise ConfigError)."""
    return _build(Config, data, "")


def config_to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def apply_override(data: dict, override: str) -> None:
    """Apply one `section.key=value` override to a nested dict (checked against the schema)."""
    if "=" not in override:
        raise ConfigError(f"override '{override}': expected section.key=value (e.g. optimizer.lr=3e-4)")
    dotted, raw = override.split("=", 1)
    parts = dotted.strip().split(".")
    cls: Any = Config
    node = data
    for i, part in enumerate(parts):
        where = ".".join(parts[: i + 1])
        names = [f.name for f in dataclasses.fields(cls)]
        if part not in names:
            raw = raw.strip() if i == len(parts) - 1 else None
            raise ConfigError(f"override '{override}': unknown config key '{where}'{_nearest(part, names, where, raw)}")
        tp = typing.get_type_hints(cls)[part]
        last = i == len(parts) - 1
        if dataclasses.is_dataclass(tp):
            if last:
                raise ConfigError(f"override '{override}': '{where}' is a section; set one of its keys")
            if part not in node or node[part] is None:
                node[part] = {}
            elif not isinstance(node[part], dict):
                raise ConfigError(f"{where}: expected a mapping of keys, got {node[part]!r}")
            node = node[part]
            cls = tp
        else:
            if not last:
                raise ConfigError(f"override '{override}': '{where}' is a value, not a section")
            value = _load_yaml(raw) if raw.strip() else ""
            node[part] = _coerce(value if value is not None else None, tp, where)
            for implied, implied_value in megatron_names.implied_keys(where, value).items():
                node.setdefault(implied, implied_value)     # what Megatron-LM's spelling implies, unless given


def with_overrides(cfg: Config, overrides: list[str]) -> Config:
    """`cfg` with `section.key=value` overrides applied (keys and types checked, as load_config checks them)."""
    data = config_to_dict(cfg)
    for ov in overrides:
        apply_override(data, ov)
    return config_from_dict(data)


def load_config(path: Optional[str | Path] = None, overrides: Optional[list[str]] = None,
                validate: bool = True) -> Config:
    """Read YAML (if given), apply `--set` overrides, build the Config (keys and types checked) and, unless
    `validate` is false, check its cross-field rules (config.checks.validate_config)."""
    data: dict = {}
    if path is not None:
        data = read_yaml(Path(path))
    for ov in overrides or []:
        apply_override(data, ov)
    cfg = config_from_dict(data)
    if validate:
        validate_config(cfg)
    return cfg


class _StrictLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (YAML would keep the last silently), and reads
    colon-separated digits (`98:2:0`, `1:30`) as text, not as YAML 1.1's base-60 numbers (352920, 90)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":      # `<<: *anchor`: merged keys may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise ConfigError(f"the key '{key}' appears twice (lines {seen[key]} and "
                                  f"{key_node.start_mark.line + 1}): keep one")
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if not tag.endswith((":int", ":float"))]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_FLOAT = (r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9_]+(?:[eE][-+][0-9]+)?"
          r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")
for _tag, _pattern in (("int", r"^[-+]?(?:0b[0-1_]+|0[0-7_]+|(?:0|[1-9][0-9_]*)|0x[0-9a-fA-F_]+)$"), ("float", _FLOAT)):
    _StrictLoader.add_implicit_resolver(f"tag:yaml.org,2002:{_tag}", re.compile(_pattern), list("-+0123456789."))


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader


def read_yaml(p: Path) -> dict:
    """The config file as a dict: UTF-8 text, valid YAML, no duplicate keys, a mapping at the top."""
    if p.is_dir():
        raise ConfigError(f"config file '{p}' is a directory: give the path of a YAML file")
    if not p.is_file():
        raise ConfigError(f"config file '{p}' does not exist")
    try:
        text = p.read_bytes().decode("utf-8")
    except OSError as e:
        raise ConfigError(f"config file '{p}' cannot be read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file '{p}' is not UTF-8 text (byte {e.start}): save it as UTF-8 YAML") from None
    if "\x00" in text:
        raise ConfigError(f"config file '{p}' is binary, not YAML text (it holds NUL bytes): give the path of a YAML "
                          f"config, e.g. configs/quickstart.yaml")
    loader = None
    try:
        loader = _StrictLoader(text)     # reading starts here: it refuses characters YAML does not allow
        loader.name = str(p)             # YAML errors then point at the file, not "<unicode string>"
        data = loader.get_single_data()
    except ConfigError as e:
        raise ConfigError(f"config file '{p}': {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file '{p}' is not valid YAML: {' '.join(str(e).split())}") from None
    finally:
        if loader is not None:
            loader.dispose()
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{p}': the top level must be a mapping of sections")
    return data


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


def absolute_paths(cfg: Config) -> Config:
    """cfg with every file and folder it names (config.PATH_KEYS) absolute, resolved against the working
    directory: a run's config.yaml then reads the same from anywhere (generate, the converter, a resume)."""
    def absolute(value: Optional[str]) -> Optional[str]:
        return value if value is None else os.path.abspath(value)

    def blend(values: list[str]) -> list[str]:      # a weighted blend: [w, path, w, path]
        from megalysses.config.values import is_weighted

        weighted = is_weighted(values)
        return [v if weighted and i % 2 == 0 else absolute(v) for i, v in enumerate(values)]

    out = copy.deepcopy(cfg)
    for section, key in PATH_KEYS:
        part = getattr(out, section)
        value = getattr(part, key)
        if isinstance(value, list):
            setattr(part, key, blend(value))
        elif not (section, key, value) == ("checkpoint", "load", "auto"):
            setattr(part, key, absolute(value))
    return out


def save_config(cfg: Config, path: str | Path) -> None:
    """Write a run's config.yaml, with the files and folders it names absolute (absolute_paths)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(dump_config(absolute_paths(cfg)))
