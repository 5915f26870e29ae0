"""The config reference, read from the schema: every key of megalysses/config/__init__.py with its type and choices,
default, meaning (the docstring under the field) and the Megatron-LM flags that set it (config/megatron_names.py).

    print(reference_markdown())      # docs/CONFIG.md, which tools/config_doc.py (`make docs`) writes
    print(annotated_yaml(cfg))       # a resolved config as YAML, each key's meaning as a comment above it

A key added to the schema with its docstring appears here with nothing else to edit.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

import yaml

from megalysses.config import megatron_names
from megalysses.config import Config

REGENERATE = "`make docs` (python tools/config_doc.py --output docs/CONFIG.md)"


@dataclass
class KeyDoc:
    key: str                 # dotted: model.rope_scaling.factor
    type: str                # int, float, bool, str, list[str], ... ("or null" when it may be None)
    choices: tuple[str, ...]
    default: Any
    doc: str                 # the field's docstring, on one line
    flags: list[str]         # Megatron-LM flags that set it


def _docstrings(cls: type) -> dict[str, str]:
    """The string literal under each field of a dataclass, by field name."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    out = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            out[node.target.id] = " ".join(after.value.value.split())
    return out


def _type_name(tp: Any) -> tuple[str, tuple[str, ...]]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [_type_name(a) for a in typing.get_args(tp) if a is not type(None)]
        null = " or null" if type(None) in typing.get_args(tp) else ""
        if len(inner) == 1:
            return inner[0][0] + null, inner[0][1]
        # int | Literal["auto"]: "int or auto"
        return " or ".join(choices and "/".join(choices) or name for name, choices in inner) + null, ()
    if origin is Literal:
        return "str", tuple(str(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list[{_type_name(typing.get_args(tp)[0])[0]}]", ()
    return tp.__name__, ()


def sections() -> list[tuple[str, type]]:
    """(dotted name, dataclass) of every section of the schema, nested ones after their parent's keys."""
    out = []

    def walk(cls: type, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            tp = typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(tp):
                out.append((prefix + f.name, tp))
                walk(tp, f"{prefix}{f.name}.")

    walk(Config, "")
    return out


def key_docs(cls: type, prefix: str) -> list[KeyDoc]:
    """The keys directly under one section (nested sections are listed on their own)."""
    hints, docs, defaults = typing.get_type_hints(cls), _docstrings(cls), cls()
    out = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            continue
        key = f"{prefix}.{f.name}"
        name, choices = _type_name(hints[f.name])
        out.append(KeyDoc(key, name, choices, getattr(defaults, f.name), docs.get(f.name, ""),
                          megatron_names.flags_for_key(key)))
    return out


def _value(v: Any) -> str:
    return yaml.safe_dump(v, default_flow_style=True, width=10**9).strip().removesuffix("\n...").strip()


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def reference_markdown() -> str:
    """docs/CONFIG.md."""
    lines = [("<!-- Generated from megalysses/config/__init__.py and megalysses/config/megatron_names.py by "
             f"tools/config_doc.py: do not edit; regenerate with {REGENERATE}. -->"), "",
             "# Configuration reference", "",
             ("Every key of the config (`pretrain.py --config X.yaml --set section.key=value`), with its type, default "
             "and meaning, and the Megatron-LM `pretrain_gpt.py` flags that set it (`tools/from_megatron.py` converts "
             "a Megatron-LM command line). `pretrain.py --print-config` prints a resolved config with these "
             "meanings as comments."), ""]
    for section, cls in sections():
        lines += [f"## {section}", "", " ".join((cls.__doc__ or "").split()), "",
                  "| key | type | default | meaning | Megatron-LM |", "|---|---|---|---|---|"]
        for k in key_docs(cls, section):
            kind = k.type + (f": {', '.join(k.choices)}" if k.choices else "")
            flags = ", ".join(f"`{f}`" for f in k.flags)
            lines.append(f"| `{k.key}` | {_cell(kind)} | `{_cell(_value(k.default))}` | {_cell(k.doc)} | {flags} |")
        lines.append("")
    lines += ["## Megatron-LM flags that map in part, not at all, or need no key", "",
              ("The converter (`tools/from_megatron.py`) names each of these it meets that it cannot honour; those "
               "make the conversion lossy."), "", "| flag | status | what happens here |", "|---|---|---|"]
    for f in megatron_names.FLAGS.values():
        if f.status in ("partial", "none") or (not f.keys and f.status == "same"):
            status = {"partial": "some values", "none": "no counterpart", "same": "the same, no key"}[f.status]
            lines.append(f"| `{f.flag}` | {status} | {_cell(f.note)} |")
    ignored = sorted(f.flag for f in megatron_names.FLAGS.values() if f.status == "ignored")
    lines += ["", "Accepted and left out, as they change speed, profiling or logging, not what is trained: "
              + ", ".join(f"`{f}`" for f in ignored) + ".", ""]
    return "\n".join(lines)


def annotated_yaml(cfg: Config) -> str:
    """`cfg` as YAML (it loads back to an equal config), each key's meaning as a comment above it."""
    lines: list[str] = []

    def emit(obj: Any, cls: type, prefix: str, indent: str) -> None:
        docs, hints = _docstrings(cls), typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            value = getattr(obj, f.name)
            for row in textwrap.wrap(docs.get(f.name, ""), 110 - len(indent), break_on_hyphens=False):
                lines.append(f"{indent}# {row}")
            if dataclasses.is_dataclass(hints[f.name]):
                lines.append(f"{indent}{f.name}:")
                emit(value, hints[f.name], f"{prefix}{f.name}.", indent + "  ")
            else:
                lines.append(f"{indent}{f.name}: {_value(value)}")

    for section, cls in [(f.name, typing.get_type_hints(Config)[f.name]) for f in dataclasses.fields(Config)]:
        lines += [f"# {section}: {' '.join((cls.__doc__ or '').split())}", f"{section}:"]
        emit(getattr(cfg, section), cls, f"{section}.", "  ")
        lines.append("")
    return "\n".join(lines)
