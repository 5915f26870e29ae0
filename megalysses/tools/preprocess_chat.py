"""preprocess_data.py --chat: conversations and prompt/completion records -> token ids and their loss mask.

    python tools/preprocess_data.py --chat --input chats.jsonl --output-prefix data/chat \\
        --tokenizer-type huggingface --tokenizer-model models/Qwen2.5-0.5B-Instruct --workers 4
    # -> data/chat_text_document.bin/.idx (one document per conversation) and
    #    data/chat_text_document_loss_mask.bin/.idx (1 where a token carries the loss)

What a record looks like and which tokens carry the loss: megalysses/data/chat.py. A record that cannot be
used (not JSON, empty, a message without content, a role the template does not know, a template that fails on
it, nothing to train on) is skipped with one line naming it; a template whose renderings are not prefixes of
each other, where the loss mask needs them to be, stops the run (it would fail on every such conversation).
"""
from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path
from typing import Any

import numpy as np

from megalysses.data.chat import ChatEncoder, ChatOptions, PrefixError, RecordError
from megalysses.data.chat_template import ChatTemplate, NoTemplate
from megalysses.data.indexed import loss_mask_prefix

SHOWN = 20   # bad records named one line each; the rest are counted


def add_arguments(p: argparse.ArgumentParser) -> None:
    c = p.add_argument_group("conversations (--chat)")
    c.add_argument("--chat", action="store_true",
                   help="records are conversations ('messages', optionally 'tools') or 'prompt' and 'completion': "
                        "write the tokens and, beside them, the loss mask of the answers")
    c.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template, or a tokenizer_config.json whose chat_template is used (default: "
                        "the tokenizer folder's chat_template.jinja or tokenizer_config.json's chat_template)")
    c.add_argument("--chat-train-on", choices=("all", "last"), default="all",
                   help="which assistant turns carry the loss: all of them (default) or the last")
    c.add_argument("--chat-end-of-turn", action=argparse.BooleanOptionalAction, default=True,
                   help="the token that ends an assistant turn (<|im_end|>, <|eot_id|>) carries the loss too, so "
                        "the model learns to stop (default: yes)")


def check_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    given = [f for f, v in (("--chat-template", args.chat_template), ("--chat-train-on", args.chat_train_on != "all"),
                            ("--no-chat-end-of-turn", not args.chat_end_of_turn)) if v]
    if not args.chat:
        if given:
            p.error(f"{given[0]} only applies with --chat")
        return
    if args.append_eod:
        p.error("--append-eod does not apply to --chat: a conversation ends as its chat template ends it, and a "
                "prompt/completion text ends with the EOD token already")
    if args.json_keys != ["text"]:
        p.error("--json-keys does not apply to --chat: records hold 'messages', or 'prompt' and 'completion'")


def outputs(output_prefix: str) -> dict[str, str]:
    """The datasets --chat writes: the tokens and, beside them, the loss mask."""
    tokens = f"{output_prefix}_text_document"
    return {"text": tokens, "loss_mask": loss_mask_prefix(tokens)}


def encoder(args: dict[str, Any], tokenizer: Any) -> ChatEncoder:
    """The encoder of every worker; the template is read only when the tokenizer is a Hugging Face one, and
    one that has none is only an error for a conversation (plain prompt/completion texts need none)."""
    template = None
    if getattr(tokenizer, "tok", None) is not None:
        try:
            template = ChatTemplate.from_folder(Path(tokenizer.path).parent, args["template"])
        except NoTemplate:
            pass
    options = ChatOptions(train_on=args["train_on"], end_of_turn=args["end_of_turn"])
    return ChatEncoder(tokenizer, template, options, bos_id=tokenizer.bos_id if args["bos"] else None)


def _record(raw: bytes | dict) -> Any:
    if isinstance(raw, dict):
        return raw
    if not raw.strip():
        raise RecordError("blank line")
    try:
        return json.loads(raw)
    except UnicodeDecodeError:
        raise RecordError("not UTF-8") from None
    except json.JSONDecodeError as err:
        raise RecordError(f"bad JSON ({err.msg})") from None


def encode_chat_batch(state: dict[str, Any], batch: tuple[int, list[bytes | dict], int],
                      size: Any) -> dict[str, Any]:
    """Encode one batch of records: per output, the concatenated values, one sequence and one document per
    kept record; the skipped records' reasons, counted, and the first SHOWN named."""
    first, items, position = batch
    enc, dtype = state["chat"], state["dtype"]
    ids, masks, ordinals, examples = [], [], [], []
    skipped: collections.Counter = collections.Counter()
    for i, raw in enumerate(items):
        try:
            tokens, loss = enc.encode(_record(raw))
        except RecordError as err:
            skipped[err.kind] += 1
            if len(examples) < SHOWN:
                examples.append(f"record {first + i + 1}: {err}")
            continue
        except PrefixError as err:
            raise PrefixError(f"record {first + i + 1}: {err}") from None
        ids.append(tokens)
        masks.append(loss)
        ordinals.append(first + i)
    lengths = np.asarray([len(x) for x in ids], dtype=np.int32)
    per_doc = np.ones(len(ids), dtype=np.int64)
    tokens = np.concatenate(ids).astype(dtype) if ids else np.zeros(0, dtype)
    mask = np.concatenate(masks).astype(np.uint8) if masks else np.zeros(0, np.uint8)
    return {"text": (tokens, lengths, per_doc), "loss_mask": (mask, lengths, per_doc), "skipped": skipped,
            "examples": examples, "bytes": sum(map(size, items)), "position": position,
            "ordinals": np.asarray(ordinals, dtype=np.int64), "seen_keys": [], "empty": 0, "empty_example": None,
            "loss_tokens": int(mask.sum(dtype=np.int64))}
