"""A synthetic retrieval corpus: passkey documents whose filler is real text, each exactly one training sample
long for the byte tokenizer, so that packing never separates a key from its question.

    docs = passkey_documents(texts, seq_len=512, count=20000, seed=0)    # strings of seq_len - 1 bytes
    records = passkey_records(docs, loss_on="answer")    # {"prompt": ..., "completion": " 12345"}

Each document is the passkey prompt of tasks.py (intro, filler, the key sentence at a uniformly random depth,
filler, the question and the key) with the filler a passage of `texts` repeated, as the passkey filler repeats
its sentences (a different passage of 48 to 256 characters in each document), the text made plain: ASCII only,
digits removed (the key is the only number before its question, as in the evaluation), whitespace runs as one
space. With the
EOD that tools/preprocess_data.py --append-eod adds, a document is seq_len tokens: with data.seq_len = seq_len
the samples of a GPT dataset are exactly its documents (each sample's last label, the token after the EOD,
is the next document's first).

Which tokens carry the loss (passkey_records): every token ("all", records {"text": ...}: the model learns the
text as well as the retrieval, and the answer is 5 of its labels), or the answer's alone ("answer", records
{"prompt": ..., "completion": " 12345"} that tools/preprocess_data.py --chat writes with their loss mask: the
answer and the EOD after it are the only labels, so every label asks for the look-up).
"""
from __future__ import annotations

import re
from typing import Iterable, Iterator

import numpy as np

from megalysses.data.tokenizer import ByteTokenizer
from megalysses.evaluation.tasks import Filler, Prompts, compose, passkey_prompt

_NOT_PLAIN = re.compile(r"[^ -~]|[0-9]")
LOSS_ON = ("all", "answer")
"""What carries the loss in a passkey corpus: every token, or the answer alone."""
KEY_DIGITS = 5
"""Digits of every passkey (tasks.passkey_prompt), the answer " 12345" one token more with its space."""


def plain_text(text: str) -> str:
    """ASCII text without digits, every whitespace run one space."""
    return " ".join(_NOT_PLAIN.sub(" ", text).split())


def text_filler(pool: np.ndarray, starts: np.ndarray, passage: tuple[int, int] = (48, 256)) -> Filler:
    """Filler cut from a pool of tokens: a passage of real text, from a random one of `starts` (word starts) to the
    first of them at least `passage` (a random size in that range) tokens on, repeated as the passkey filler
    repeats its sentences."""
    def filler(n: int, rng: np.random.Generator) -> np.ndarray:
        i = int(rng.integers(len(starts)))
        size = int(rng.integers(*passage))
        end = starts[np.searchsorted(starts, starts[i] + size)] if starts[-1] >= starts[i] + size else len(pool)
        return np.resize(pool[starts[i]:end], n)
    return filler


def passkey_documents(texts: Iterable[str], seq_len: int, count: int, seed: int) -> Iterator[str]:
    """`count` passkey documents of seq_len - 1 bytes each (filler from `texts`, keys at uniformly random depths);
    ValueError, before any text is read, when seq_len cannot hold the prompt."""
    prompts = Prompts(ByteTokenizer())
    need = passkey_prompt(prompts, 0.5, np.random.default_rng(0)).tokens(prompts) + 1     # every key has 5 digits
    if need > seq_len:
        raise ValueError(f"a document of {seq_len} tokens cannot hold the passkey prompt ({need - 1} bytes and the "
                         f"EOD): give a --seq-len of at least {need}")
    return _documents(prompts, texts, seq_len, count, seed)


def _documents(prompts: Prompts, texts: Iterable[str], seq_len: int, count: int, seed: int) -> Iterator[str]:
    pool = np.frombuffer((" " + " ".join(t for t in map(plain_text, texts) if t)).encode("ascii"), dtype=np.uint8)
    if len(pool) < 2:
        raise ValueError("the texts hold no plain text for the filler")
    filler = text_filler(pool.astype(np.int64), np.flatnonzero(pool == ord(" ")))     # from a word's start
    rng = np.random.default_rng(seed)
    for _ in range(count):
        sample = compose(prompts, passkey_prompt(prompts, float(rng.random()), rng), seq_len - 2, filler, rng)
        yield bytes(sample.tokens.astype(np.uint8)).decode("ascii")


def passkey_records(documents: Iterable[str], loss_on: str) -> Iterator[dict[str, str]]:
    """The JSON records of passkey documents: {"text": document} when every token carries the loss ("all"), or
    {"prompt": the document to its question, "completion": the answer} when the answer alone does ("answer")."""
    if loss_on not in LOSS_ON:
        raise ValueError(f"loss on {loss_on!r}: give one of {', '.join(LOSS_ON)}")
    for doc in documents:
        yield {"text": doc} if loss_on == "all" else {"prompt": doc[:-KEY_DIGITS - 1],
                                                      "completion": doc[-KEY_DIGITS - 1:]}
