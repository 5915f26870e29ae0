"""Conversations and prompt/completion records -> token ids and the loss mask of the answers.

    encoder = ChatEncoder(tokenizer, ChatTemplate.from_folder("models/Qwen2.5-0.5B-Instruct"))
    ids, loss = encoder.encode({"messages": [{"role": "user", "content": "Hi"},
                                             {"role": "assistant", "content": "Hello!"}]})
    # ids: what tokenizer.apply_chat_template(messages) gives; loss[i]: token i is an answer token

Records (one per JSON line, Parquet row, ...):
- `{"messages": [{"role", "content"}, ...], "tools": [...]}`: rendered with the chat template; the assistant
  turns carry the loss (all of them, or only the last: `train_on="last"`).
- `{"prompt": [messages], "completion": [messages]}`: the same, the completion's assistant turns alone.
- `{"prompt": "text", "completion": "text"}`: no template: the prompt's tokens (as a document is encoded, with
  what the tokenizer adds, e.g. its BOS), then the completion's as plain text, then EOD; the completion and
  the EOD carry the loss.

Which tokens of a turn carry the loss: where the template has `{% generation %}` blocks, the tokens that
overlap them (transformers' `return_assistant_tokens_mask`); otherwise the tokens between the end of the
conversation rendered up to the turn with the generation prompt and the end of it rendered with the turn,
which needs each rendering to be a prefix of the next (checked; a template that rewrites earlier turns is
refused, PrefixError). Whitespace the template writes after a turn's final special token (ChatML's newline
after <|im_end|>) is not trained then; `end_of_turn=False` leaves that final token out as well.

Message content is text: a special token that content spells (a message holding "<|im_end|>") is encoded
as the text it is, so it cannot end the turn, while the template's own markup is special. transformers'
default (`sanitize_control_tokens=False`) parses it as the special token: there the ids differ on purpose.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from megalysses.data.chat_template import ChatTemplate, TemplateError

# the roles templates are written for; another role must appear in the template's own text
KNOWN_ROLES = ("system", "user", "assistant", "tool", "developer", "ipython", "function")
_OPEN, _CLOSE = "\U000f0000", "\U000f0001"   # private-use marks around a special token that content spells


class RecordError(ValueError):
    """A record that cannot be used (malformed, empty, unknown role, the template fails on it): skipped.
    `kind` says which, in a word or two, for the count of skipped records."""

    def __init__(self, message: str, kind: str = "malformed") -> None:
        super().__init__(message)
        self.kind = kind


class PrefixError(TemplateError):
    """A template whose rendering of a conversation's start is not a prefix of the whole: refused."""


@dataclass(frozen=True)
class ChatOptions:
    train_on: str = "all"        # "all" assistant turns, or the "last" one
    end_of_turn: bool = True     # the turn's final special token (<|im_end|>, <|eot_id|>) carries the loss


def plain_ids(tokenizer: Any, text: str) -> list[int]:
    """`text` as plain text: no special token added, none parsed from it (a Hugging Face tokenizer's special
    tokens in the text are encoded as the characters they are made of)."""
    tok = getattr(tokenizer, "tok", None)
    if tok is None:                      # sentencepiece, bytes, null: nothing is parsed or added
        return list(tokenizer.encode(text))
    before = tok.encode_special_tokens
    tok.encode_special_tokens = True
    try:
        return tok.encode(text, add_special_tokens=False).ids
    finally:
        tok.encode_special_tokens = before


def _messages(value: Any, what: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise RecordError(f"'{what}' is {'empty' if value == [] else 'not a list of messages'}",
                          "empty" if value == [] else "malformed")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RecordError(f"'{what}' message {i + 1} is not an object with a string 'role'")
        content = m.get("content")
        if content is None and not m.get("tool_calls"):
            raise RecordError(f"'{what}' message {i + 1} (role '{m['role']}') has no content")
        if content is not None and not isinstance(content, (str, list)):
            raise RecordError(f"'{what}' message {i + 1} (role '{m['role']}') has content that is neither text "
                              f"nor a list of parts")
    return value


def parse_record(record: Any) -> tuple[list[dict], Optional[list], int] | tuple[str, str]:
    """(messages, tools, index of the first message that may carry the loss), or (prompt, completion) texts."""
    if not isinstance(record, dict):
        raise RecordError("not a JSON object")
    if "messages" in record:
        tools = record.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise RecordError("'tools' is not a list")
        return _messages(record["messages"], "messages"), tools, 0
    if "prompt" in record and "completion" in record:
        prompt, completion = record["prompt"], record["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            if not completion:
                raise RecordError("'completion' is empty")
            return prompt, completion
        tools = record.get("tools")
        prompt, completion = _messages(prompt, "prompt"), _messages(completion, "completion")
        return prompt + completion, tools if isinstance(tools, list) else None, len(prompt)
    raise RecordError("no 'messages', nor 'prompt' and 'completion'")


class ChatEncoder:
    """Records -> (token ids, loss mask) with one tokenizer, its chat template and the ChatOptions.
    `bos_id`: a BOS to start every record with unless it already starts with it (`--bos`)."""

    def __init__(self, tokenizer: Any, template: Optional[ChatTemplate] = None,
                 options: Optional[ChatOptions] = None, bos_id: Optional[int] = None) -> None:
        options = options or ChatOptions()
        if options.train_on not in ("all", "last"):
            raise ValueError(f"train_on={options.train_on!r}: expected 'all' or 'last'")
        self.tokenizer, self.template, self.options, self.bos_id = tokenizer, template, options, bos_id
        tok = getattr(tokenizer, "tok", None)
        self._tok = None
        if tok is not None:              # a copy of our own: its settings are not the document encoder's
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_str(tok.to_str())
            self._tok.encode_special_tokens = False
            added = self._tok.get_added_tokens_decoder()
            self.special = sorted({t.content for t in added.values() if t.special}, key=len, reverse=True)
            self.special_ids = {i for i, t in added.items() if t.special}
            pattern = "|".join(map(re.escape, self.special)) or "(?!)"
            self._special_re = re.compile(pattern)
            self._marks_re = re.compile(f"{_OPEN}({pattern}){_CLOSE}|[{_OPEN}{_CLOSE}]")

    def encode(self, record: Any) -> tuple[np.ndarray, np.ndarray]:
        """(ids int64, loss bool) of one record; RecordError when it cannot be used."""
        parsed = parse_record(record)
        if len(parsed) == 2:
            ids, loss = self._prompt_completion(*parsed)
        else:
            ids, loss = self._conversation(*parsed)
        if not loss.any():
            raise RecordError("no token carries the loss (no assistant turn to train on)", "nothing to train on")
        if self.bos_id is not None and (not len(ids) or ids[0] != self.bos_id):
            ids, loss = np.concatenate([[self.bos_id], ids]), np.concatenate([[False], loss])
        return ids.astype(np.int64), loss

    def _prompt_completion(self, prompt: str, completion: str) -> tuple[np.ndarray, np.ndarray]:
        tok = self.tokenizer
        first = list(tok.encode(prompt)) if prompt else []
        answer = plain_ids(tok, completion) + [tok.eod_id]
        return np.asarray(first + answer), np.asarray([False] * len(first) + [True] * len(answer))

    def _conversation(self, messages: list[dict], tools: Optional[list],
                      first_trained: int) -> tuple[np.ndarray, np.ndarray]:
        if self._tok is None or self.template is None:
            raise TemplateError("conversations ('messages', or prompt and completion as messages) need a Hugging "
                                "Face tokenizer with a chat template: --tokenizer-type huggingface --tokenizer-model "
                                "DIR (and --chat-template FILE when DIR has none)")
        for m in messages:
            if not self._knows(m["role"]):
                raise RecordError(f"role '{m['role']}' is not one the chat template knows", "unknown role")
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= first_trained]
        if not turns:
            raise RecordError("no assistant turn to train on", "nothing to train on")
        assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        turns = turns[-1:] if self.options.train_on == "last" else turns
        marked, tools = self._mark(messages), self._mark(tools)
        text, generation = self._render(marked, tools)
        if self.template.has_generation:
            if len(generation) != len(assistant):
                raise PrefixError(f"{self.template.name}: its {{% generation %}} blocks ({len(generation)}) are not "
                                  f"one per assistant turn ({len(assistant)}), so they cannot tell the turns apart")
            spans = [generation[assistant.index(i)] for i in turns]
        else:
            spans = [self._turn_span(marked, tools, text, i) for i in turns]
        ids, starts, ends, special = self._tokenize(text)
        loss = np.zeros(len(ids), dtype=bool)
        for a, b in spans:
            inside = np.flatnonzero((ends > a) & (starts < b))
            if not len(inside):
                continue
            keep = self._end_of_turn(text, inside, starts, ends, special, trim=not self.template.has_generation)
            loss[inside[:keep]] = True
        return ids, loss

    def _knows(self, role: str) -> bool:
        """A role templates are written for, or one the template's own text names (as a word)."""
        word = re.compile(rf"(?<![\w-]){re.escape(role)}(?![\w-])")
        return role in KNOWN_ROLES or any(word.search(text) for text in self.template.literals)

    def _render(self, messages: list[dict], tools: Optional[list],
                add_generation_prompt: bool = False) -> tuple[str, list[tuple[int, int]]]:
        try:
            return self.template.render(messages, tools, add_generation_prompt)
        except TemplateError as err:
            raise RecordError(f"the chat template failed: {err}", "template failed") from None

    def _turn_span(self, messages: list[dict], tools: Optional[list], full: str, i: int) -> tuple[int, int]:
        """The characters of assistant turn i: between the conversation up to it with the generation prompt
        and the conversation up to and with it, each rendering checked to be a prefix of the next."""
        try:
            before = self._render(messages[:i], tools, add_generation_prompt=True)[0]
        except RecordError:
            if i:
                raise
            before = ""            # a template that needs a message before the generation prompt
        upto = self._render(messages[:i + 1], tools)[0]
        if not (upto.startswith(before) and full.startswith(upto)):
            raise PrefixError(
                f"{self.template.name} renders the conversation up to message {i + 1} (an assistant turn) "
                f"differently once {'that turn' if not upto.startswith(before) else 'later turns'} follow (it "
                f"rewrites earlier turns), "
                f"so the turn's tokens cannot be found by rendering growing prefixes: give a template with "
                f"{{% generation %}} blocks around the assistant turns (--chat-template FILE), or train on the "
                f"last turn only (--chat-train-on last)")
        return len(before), len(upto)

    def _end_of_turn(self, text: str, inside: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                     special: np.ndarray, trim: bool) -> int:
        """How many of a turn's tokens carry the loss: up to its final special token when only whitespace
        follows it (what a template writes between turns; `trim`), without that token unless end_of_turn."""
        k = len(inside) - 1
        while trim and k >= 0 and not special[inside[k]] and text[starts[inside[k]]:ends[inside[k]]].isspace():
            k -= 1
        if k < 0 or not special[inside[k]]:
            return len(inside)
        return k + 1 if self.options.end_of_turn else k

    def _mark(self, value: Any) -> Any:
        """Strings of the record with each special token they spell put between private-use marks."""
        if isinstance(value, str):
            value = value.replace(_OPEN, "").replace(_CLOSE, "")
            return self._special_re.sub(lambda m: f"{_OPEN}{m.group(0)}{_CLOSE}", value)
        if isinstance(value, dict):
            return {k: self._mark(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self._mark(v) for v in value]
        return value

    def _tokenize(self, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """ids, each token's [start, end) characters of `text`, and whether it is one of the template's special
        tokens. A marked special token is encoded as plain text, and breaks the text around it as the special
        token would; other text is encoded as the tokenizer encodes it, special tokens parsed."""
        pieces = self._marks_re.split(text)
        ids: list[int] = []
        starts: list[int] = []
        ends: list[int] = []
        special: list[bool] = []
        at = 0
        for k, piece in enumerate(pieces):
            marked = k % 2 == 1
            if piece is None:                      # a lone mark: only a break in the text
                at += 1
                continue
            width = len(piece) + (2 if marked else 0)
            if piece:
                got, offsets = self._encode_piece(piece, plain=marked, first=k == 0)
                ids += got
                for a, b in offsets:
                    starts.append(at if marked else at + a)
                    ends.append(at + width if marked else at + b)
                special += [not marked and i in self.special_ids for i in got]
            at += width
        return np.asarray(ids, dtype=np.int64), np.asarray(starts), np.asarray(ends), np.asarray(special, dtype=bool)

    def _encode_piece(self, piece: str, plain: bool, first: bool) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and character offsets of one piece of the rendered text. A piece after the first is encoded after
        a newline that is then dropped, so a tokenizer that marks the start of a text (sentencepiece's prefix
        space) does not mark the middle of the conversation."""
        tok = self._tok
        tok.encode_special_tokens = plain
        try:
            if first:
                e = tok.encode(piece, add_special_tokens=False)
                return e.ids, e.offsets
            newline = tok.encode("\n", add_special_tokens=False).ids
            e = tok.encode("\n" + piece, add_special_tokens=False)
            if e.ids[:len(newline)] == newline:
                n = len(newline)
                return e.ids[n:], [(max(a - 1, 0), max(b - 1, 0)) for a, b in e.offsets[n:]]
            e = tok.encode(piece, add_special_tokens=False)
            return e.ids, e.offsets
        finally:
            tok.encode_special_tokens = False
