"""The long-context tasks as token sequences: passkey retrieval, needle in a haystack (one needle, or several
with different keys as RULER's multi-key variant) and loss by position.

    prompts = Prompts(tokenizer, bos=cfg.data.bos)
    rng = np.random.default_rng(0)
    sample = compose(prompts, passkey_prompt(prompts, depth=0.5, rng=rng), 4096, repeated_filler(prompts), rng)
    sample.tokens      # (4097,) int64: the model reads tokens[:-1] and is scored on the labels tokens[1:]
    sample.buckets     # (4096,) int64: per label, the bucket it counts in (0: an answer token), -1 if not scored

Passkey (Mohtashami & Jaggi, 2023): an intro, the filler sentences repeated, the key sentence at `depth`
(0: right after the intro, 1: right before the question), the question and the key. Needle in a haystack
(RULER, Hsieh et al., 2024): real text from a document stream (haystack.py), a "special magic number"
sentence for a random key at `depth`; the multi-key variant adds distractor needles for other keys at
random depths and asks for one. Every sample is exactly `length` + 1 tokens, the answer its last tokens:
a model answers correctly exactly when each answer token is the argmax given the correct prefix (teacher
forcing), which is what greedy decoding would produce, so one forward scores it. Pieces are tokenized
separately, each after a space, and concatenated; a needle goes in at the sentence boundary nearest to its
depth. The filler of the passkey task and of the synthetic retrieval corpus (tools/build_corpus.py
--passkey) holds no digit, so the key is the only number before the question.

Loss by position: windows of `length` + 1 tokens of packed documents, each starting at a document's
start; a label counts in the bucket of its input's position within its document: 0, 1, 2-3, 4-7, ...
(bucket_bounds).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np

TASKS = ("passkey", "niah", "niah-multikey", "position-loss")
"""Every task, in the order results list them."""
ACCURACY_TASKS = ("passkey", "niah", "niah-multikey")
"""The tasks scored by exact match of the answer (the others by loss)."""
NIAH_KEYS = 4
"""Needles in a niah-multikey sample: the one asked for and three distractors."""

PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                 "I will quiz you about the important information there.")
PASSKEY_FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
                  "There and back again.")
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "What is the pass key? The pass key is"
NIAH_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
              "I will quiz you about the numbers afterwards.")
NIAH_NEEDLE = "One of the special magic numbers for {key} is: {value}."
NIAH_QUESTION = ("What is the special magic number for {key} mentioned in the provided text? The special magic "
                 "number for {key} mentioned in the provided text is")
_ADJECTIVES = ("ancient", "bitter", "brave", "calm", "clever", "crooked", "curious", "damp", "eager", "elegant",
               "faint", "fierce", "gentle", "glossy", "grumpy", "hollow", "humble", "icy", "jolly", "lazy", "loud",
               "lucky", "mellow", "misty", "noisy", "odd", "pale", "proud", "quiet", "rapid", "rusty", "shy",
               "silent", "sleepy", "smooth", "sour", "steep", "sticky", "swift", "tame", "tender", "tidy", "tiny",
               "vivid", "wary", "wicked", "witty", "young", "zealous", "zesty")
_NOUNS = ("anchor", "badge", "barrel", "beacon", "blanket", "bottle", "bridge", "candle", "canyon", "castle",
          "cellar", "compass", "cottage", "crystal", "dragon", "engine", "falcon", "feather", "fountain", "garden",
          "glacier", "hammer", "harbor", "helmet", "island", "jacket", "kettle", "ladder", "lantern", "meadow",
          "mirror", "needle", "orchard", "paddle", "parrot", "pillow", "pocket", "puzzle", "quarry", "ribbon",
          "saddle", "shovel", "spider", "statue", "tunnel", "velvet", "violin", "wagon", "walnut", "window")


class PromptError(ValueError):
    """The tokenizer cannot write a task's prompts, or a length cannot hold them; the message says which."""


@dataclass
class Sample:
    """One sequence to score: tokens (length + 1,) and, per label (length,), its bucket (-1: not scored)."""

    tokens: np.ndarray
    buckets: np.ndarray


class Prompts:
    """A tokenizer's view of the task texts: each piece encoded once, after a space and without the special tokens
    a tokenizer adds on its own (a Hugging Face post-processor's BOS); `start`: the tokens every training document
    began with (that BOS, and data.bos). PromptError when the tokenizer cannot write the texts."""

    def __init__(self, tokenizer: Any, bos: Optional[str] = None) -> None:
        self.tok = tokenizer
        self.pieces: dict[str, list[int]] = {}
        self.sentence_ends: dict[int, bool] = {}
        self._check(" ".join([PASSKEY_INTRO, PASSKEY_NEEDLE.format(key="12345"), PASSKEY_QUESTION,
                              NIAH_NEEDLE.format(key="quiet-lantern", value="1234567"),
                              NIAH_QUESTION.format(key="quiet-lantern")]))
        full, bare = list(tokenizer.encode("x")), self.plain("x")
        lead = full[:len(full) - len(bare)] if bare and full[len(full) - len(bare):] == bare else []
        if bos is not None and tokenizer.bos_id is not None and lead[:1] != [tokenizer.bos_id]:
            lead = [tokenizer.bos_id] + lead
        self.start = lead

    def plain(self, text: str) -> list[int]:
        """`text` encoded without the special tokens the tokenizer would add."""
        on = getattr(self.tok, "add_special_tokens", None)
        if on is None:
            return list(self.tok.encode(text))
        self.tok.add_special_tokens = False
        try:
            return list(self.tok.encode(text))
        finally:
            self.tok.add_special_tokens = on

    def _check(self, text: str) -> None:
        """PromptError unless the tokenizer writes `text` and reads it back (words, digits, punctuation)."""
        try:
            back = self.tok.decode(self.plain(text))
        except Exception as e:  # noqa: BLE001 - a tokenizer that cannot encode text (null) raises its own errors
            raise PromptError(f"the tokenizer cannot write the prompts ({' '.join(str(e).split())[:120]}): "
                              f"evaluate with a tokenizer that encodes text (byte, sentencepiece, huggingface, "
                              f"gpt2bpe)") from None
        if " ".join(back.split()) != " ".join(text.split()):
            raise PromptError(f"the tokenizer cannot write the prompts: {text[:40]!r}... reads back as "
                              f"{back[:40]!r}...: evaluate with a tokenizer that encodes text (byte, sentencepiece, "
                              f"huggingface, gpt2bpe)")

    def encode(self, text: str) -> list[int]:
        """`text` as the tokenizer writes it mid-document (after a space)."""
        if text not in self.pieces:
            self.pieces[text] = self.plain(" " + text)
        return self.pieces[text]

    def ends_sentence(self, ids: np.ndarray) -> np.ndarray:
        """Per token, whether its text ends a sentence or a line (a needle may follow it)."""
        unique, inverse = np.unique(ids, return_inverse=True)
        for t in unique.tolist():
            if t not in self.sentence_ends:
                self.sentence_ends[t] = self.tok.decode([t]).rstrip(" ").endswith((".", "!", "?", "\n"))
        return np.array([self.sentence_ends[t] for t in unique.tolist()], dtype=bool)[inverse]


Filler = Callable[[int, np.random.Generator], np.ndarray]
"""filler(n, rng): n tokens of text without any document boundary."""


def repeated_filler(prompts: Prompts, sentences: Sequence[str] = PASSKEY_FILLER) -> Filler:
    """The passkey filler: the sentences in a row, again and again (from the first)."""
    unit = np.array([t for s in sentences for t in prompts.encode(s)], dtype=np.int64)

    def filler(n: int, rng: np.random.Generator) -> np.ndarray:
        return np.tile(unit, -(-n // len(unit)))[:n] if n else np.zeros(0, dtype=np.int64)

    return filler


def _insert(prompts: Prompts, filler: np.ndarray, needles: list[tuple[float, list[int]]]) -> list[int]:
    """The filler with each (depth, needle) inserted at the sentence boundary nearest to depth * len(filler)
    (depth 0 and 1: its very start and end), needles at the same point in the order given."""
    n = len(filler)
    bounds = np.concatenate([[0], np.flatnonzero(prompts.ends_sentence(filler)) + 1, [n]])
    at = []
    for depth, _ in needles:
        target = round(depth * n)
        at.append(target if depth in (0.0, 1.0) else int(bounds[np.abs(bounds - target).argmin()]))
    out, prev = [], 0
    for i in sorted(range(len(needles)), key=lambda i: (at[i], i)):
        out += filler[prev:at[i]].tolist() + needles[i][1]
        prev = at[i]
    return out + filler[prev:].tolist()


@dataclass
class Prompt:
    """A sample's text without its filler: what comes before it, the needles with their depths, the question and
    the answer."""

    task: str
    head: list[int]
    needles: list[tuple[float, list[int]]]
    question: list[int]
    answer: list[int]

    def tokens(self, prompts: Prompts) -> int:
        return (len(prompts.start) + len(self.head) + sum(len(t) for _, t in self.needles) + len(self.question)
                + len(self.answer))


def compose(prompts: Prompts, prompt: Prompt, length: int, filler: Filler, rng: np.random.Generator) -> Sample:
    """The prompt filled to exactly `length` + 1 tokens; its answer's labels in bucket 0."""
    n = length + 1 - prompt.tokens(prompts)
    if n < 0:
        raise PromptError(f"length {length} cannot hold the {prompt.task} prompt: it needs at least "
                          f"{prompt.tokens(prompts) - 1} tokens with this tokenizer; give longer lengths")
    tokens = (prompts.start + prompt.head + _insert(prompts, filler(n, rng), prompt.needles) + prompt.question
              + prompt.answer)
    buckets = np.full(length, -1, dtype=np.int64)
    buckets[length - len(prompt.answer):] = 0
    return Sample(np.asarray(tokens, dtype=np.int64), buckets)


def passkey_prompt(prompts: Prompts, depth: float, rng: np.random.Generator) -> Prompt:
    """The passkey task: a random 5-digit key at `depth`, asked for at the end."""
    key = str(int(rng.integers(10_000, 100_000)))
    return Prompt("passkey", prompts.encode(PASSKEY_INTRO), [(depth, prompts.encode(PASSKEY_NEEDLE.format(key=key)))],
                  prompts.encode(PASSKEY_QUESTION), prompts.encode(key))


def niah_prompt(prompts: Prompts, depth: float, rng: np.random.Generator, keys: int = 1) -> Prompt:
    """A needle in a haystack: a 7-digit number for a random key at `depth`; with keys > 1, keys - 1 more needles
    for other keys at random depths (RULER's multi-key variant), the first key asked for."""
    names: list[str] = []
    while len(names) < keys:
        name = f"{_ADJECTIVES[rng.integers(len(_ADJECTIVES))]}-{_NOUNS[rng.integers(len(_NOUNS))]}"
        if name not in names:
            names.append(name)
    values = [str(int(rng.integers(1_000_000, 10_000_000))) for _ in names]
    depths = [depth] + [float(rng.random()) for _ in names[1:]]
    needles = [(d, prompts.encode(NIAH_NEEDLE.format(key=k, value=v))) for d, k, v in zip(depths, names, values)]
    return Prompt("niah" if keys == 1 else "niah-multikey", prompts.encode(NIAH_INTRO), needles,
                  prompts.encode(NIAH_QUESTION.format(key=names[0])), prompts.encode(values[0]))


def task_prompt(prompts: Prompts, task: str, depth: float, rng: np.random.Generator) -> Prompt:
    """The prompt of an accuracy task (ACCURACY_TASKS) at `depth`."""
    if task == "passkey":
        return passkey_prompt(prompts, depth, rng)
    return niah_prompt(prompts, depth, rng, NIAH_KEYS if task == "niah-multikey" else 1)


def minimum_length(prompts: Prompts, task: str) -> int:
    """The shortest length that holds `task`'s prompt with some filler (keys and values vary in their token count:
    the longest of a few draws, and 16 tokens more)."""
    if task == "position-loss":
        return 2
    rng = np.random.default_rng(0)
    return max(task_prompt(prompts, task, 0.5, rng).tokens(prompts) for _ in range(8)) + 16


def bucket_of(positions: np.ndarray) -> np.ndarray:
    """Bucket of each position within its document: 0 for position 0, b for positions [2^(b-1), 2^b)."""
    return np.frexp(np.maximum(positions, 0).astype(np.float64))[1].astype(np.int64)


def bucket_bounds(bucket: int, length: int) -> tuple[int, int]:
    """Positions [lo, hi) of a bucket, hi at most `length`."""
    return (0, 1) if bucket == 0 else (1 << (bucket - 1), min(1 << bucket, length))


def document_positions(inputs: np.ndarray, eod: int) -> np.ndarray:
    """Each input's position within its document (a document starts after each EOD), as the loader counts them."""
    idx = np.arange(len(inputs))
    starts = np.zeros(len(inputs), dtype=np.int64)
    starts[1:] = np.where(inputs[:-1] == eod, idx[1:], 0)
    return idx - np.maximum.accumulate(starts)


def position_sample(tokens: np.ndarray, eod: int) -> Sample:
    """Loss by position on `tokens` (length + 1 tokens of packed documents, from a document's start): every label
    in the bucket of its input's position within its document."""
    return Sample(np.asarray(tokens, dtype=np.int64), bucket_of(document_positions(tokens[:-1], eod)))
