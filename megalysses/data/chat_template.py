"""A Hugging Face chat template, rendered with jinja2 alone as transformers' `apply_chat_template` renders it.

    template = ChatTemplate.from_folder("models/Qwen2.5-0.5B-Instruct")   # chat_template.jinja or tokenizer_config.json
    text, spans = template.render(messages, tools=None, add_generation_prompt=False)
    text[a:b] for (a, b) in spans        # what the template's {% generation %} blocks wrote (assistant turns)

The environment is transformers': a sandbox with trim_blocks and lstrip_blocks, jinja's loop controls, the
`{% generation %}` tag (the character span of each block is recorded, as `return_assistant_tokens_mask`
records it), `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text and takes indent,
separators and sort_keys, and `dict` / `namespace` that refuse private names. The messages are passed as
transformers passes them: keys whose value is None dropped, a message's reasoning under `reasoning_content`
and `thinking` whichever name it came under, and the tokenizer's named special tokens (`bos_token`,
`eos_token`, ...) beside `messages`, `tools`, `documents` and `add_generation_prompt`. tests/test_chat.py
checks the text and spans against transformers. Needs jinja2 (the `chat` extra).
"""
from __future__ import annotations

import json
from contextvars import ContextVar
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

from megalysses.data.tokenizer import read_json, special_token_strings

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")   # the first is the one templates read
# the (start, end) spans of the generation blocks of the render in progress
_SPANS: ContextVar[Optional[tuple[list[str], list[tuple[int, int]]]]] = ContextVar("chat_spans", default=None)


class TemplateError(ValueError):
    """A chat template that is missing, cannot be read or compiled, or fails on a conversation."""


class NoTemplate(TemplateError):
    """A tokenizer folder without a chat template."""


def _environment() -> Any:
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise TemplateError("rendering chat templates needs jinja2: pip install 'megalysses[chat]'") from None

    class Generation(jinja2.ext.Extension):
        """{% generation %}...{% endgeneration %}: the block's text, its character span recorded."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_record"), [], [], body).set_lineno(lineno)

        def _record(self, caller: Any) -> str:
            text = caller()
            tracking = _SPANS.get()
            if tracking is not None:
                blocks, spans = tracking
                start = sum(map(len, blocks))
                spans.append((start, start + len(text)))
            return text

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class SafeDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class SafeNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                SafeNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            SafeNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template cannot set the private name {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=SafeDict(), namespace=SafeNamespace)
    return env


def template_messages(messages: list[dict]) -> list[dict]:
    """The messages as transformers hands them to a template: None values dropped, reasoning under both names."""
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


class ChatTemplate:
    """One compiled chat template and the special tokens it is rendered with."""

    def __init__(self, source: str, special_tokens: Optional[dict[str, str]] = None, name: str = "chat template",
                 tool_source: Optional[str] = None) -> None:
        import jinja2

        self.name, self.source = name, source
        self.special_tokens = dict(special_tokens or {})
        env = _environment()
        try:
            self._compiled = env.from_string(source)
            self._tool_compiled = env.from_string(tool_source) if tool_source else None
        except jinja2.TemplateError as err:
            raise TemplateError(f"{name}: the chat template does not compile ({err})") from None
        self.literals = self._literals(env, source)
        self.has_generation = "generation" in _tag_names(env, source)

    @staticmethod
    def _literals(env: Any, source: str) -> set[str]:
        """Every piece of text and string constant the template holds."""
        import jinja2.nodes

        ast = env.parse(source)
        found = {n.data for n in ast.find_all(jinja2.nodes.TemplateData)}
        return found | {n.value for n in ast.find_all(jinja2.nodes.Const) if isinstance(n.value, str)}

    @classmethod
    def from_folder(cls, folder: str | Path, template_file: Optional[str | Path] = None) -> "ChatTemplate":
        """The template of a Hugging Face tokenizer folder (chat_template.jinja, else tokenizer_config.json's
        chat_template), or `template_file`; the special tokens from tokenizer_config.json / special_tokens_map.json."""
        folder = Path(folder)
        if folder.is_file():
            folder = folder.parent
        special = _special_tokens(folder)
        if template_file is not None:
            return cls._from_file(Path(template_file), special)
        jinja = folder / "chat_template.jinja"
        if jinja.is_file():
            return cls(jinja.read_text(encoding="utf-8"), special, str(jinja))
        config = folder / "tokenizer_config.json"
        value = read_json(config, TemplateError).get("chat_template") if config.is_file() else None
        if value is None:
            raise NoTemplate(f"{folder}: no chat template (neither chat_template.jinja nor a chat_template in "
                             f"tokenizer_config.json): pass one with --chat-template FILE")
        return cls._from_field(value, special, config)

    @classmethod
    def _from_file(cls, path: Path, special: dict[str, str]) -> "ChatTemplate":
        """--chat-template FILE: a Jinja template, or a JSON object (a tokenizer_config.json) read for its
        chat_template field; a JSON file without one is refused, never rendered as a template."""
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise TemplateError(f"{path}: cannot read the chat template ({err})") from None
        start = text.lstrip()[:2]
        if path.suffix != ".json" and (start[:1] != "{" or start in ("{%", "{{", "{#")):
            return cls(text, special, str(path))            # Jinja: text, or a tag first
        try:
            record = json.loads(text)
        except json.JSONDecodeError as err:
            if path.suffix != ".json":
                return cls(text, special, str(path))        # a template that starts with a literal "{"
            raise TemplateError(f"{path}: a .json chat template file that is not JSON ({err.msg}, line {err.lineno}): "
                                f"pass a Jinja template, or a tokenizer_config.json holding a chat_template") from None
        value = record.get("chat_template") if isinstance(record, dict) else None
        if value is None:
            raise TemplateError(f"{path} is JSON without a 'chat_template' field, not a chat template: pass a Jinja "
                                f"template file, or a tokenizer_config.json that holds one")
        return cls._from_field(value, special, path)

    @classmethod
    def _from_field(cls, value: Any, special: dict[str, str], config: Path) -> "ChatTemplate":
        """The template of a tokenizer_config.json's chat_template: a string, or named templates (the default,
        and the one for tools if there is one)."""
        if isinstance(value, list):
            named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
            if not isinstance(named.get("default"), str):
                raise TemplateError(f"{config}: the chat templates {sorted(map(str, named))} have no 'default': "
                                    f"pass one with --chat-template FILE")
            return cls(named["default"], special, f"{config} (default)", named.get("tool_use"))
        if isinstance(value, str):
            return cls(value, special, f"{config} (chat_template)")
        raise TemplateError(f"{config}: its chat_template is {type(value).__name__}, not a template (a string, or "
                            f"a list of named ones): pass one with --chat-template FILE")

    def render(self, messages: list[dict], tools: Optional[list] = None, add_generation_prompt: bool = False,
               documents: Optional[list] = None) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character spans of its {% generation %} blocks. Raises TemplateError with
        the template's own message when it fails (raise_exception, an undefined name, a type error)."""
        import jinja2

        compiled = self._tool_compiled if tools and self._tool_compiled is not None else self._compiled
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        token = _SPANS.set((blocks, spans))
        try:
            for block in compiled.generate(messages=template_messages(messages), tools=tools, documents=documents,
                                           add_generation_prompt=add_generation_prompt, **self.special_tokens):
                blocks.append(block)
        except jinja2.TemplateError as err:
            raise TemplateError(f"{self.name}: {err}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as err:
            raise TemplateError(f"{self.name}: the template failed ({type(err).__name__}: {err})") from None
        finally:
            _SPANS.reset(token)
        return "".join(blocks), spans


def _tag_names(env: Any, source: str) -> set[str]:
    """The names that open a {% ... %} tag in the template."""
    names, after_open = set(), False
    for _, kind, value in env.lex(source):
        if kind == "block_begin":
            after_open = True
        elif after_open and kind == "name":
            names.add(value)
            after_open = False
        elif kind != "whitespace":
            after_open = False
    return names


def _special_tokens(folder: Path) -> dict[str, str]:
    """bos_token, eos_token, ... as strings, from tokenizer_config.json, then special_tokens_map.json."""
    return special_token_strings(folder, SPECIAL_TOKEN_NAMES, TemplateError)
