"""Train a sentencepiece BPE tokenizer from JSON Lines (plain, gzip, bz2, xz or zstd), Parquet, Arrow, a
Hugging Face `datasets` folder, or plain text files.

    python tools/train_tokenizer.py --input data/stdlib.jsonl --model-prefix data/stdlib_sp \\
        --vocab-size 8192 --byte-fallback
    # -> data/stdlib_sp.model (use with --tokenizer-type sentencepiece) and data/stdlib_sp.vocab

Each --input is a file, a glob or a folder, read as tools/preprocess_data.py reads it (Parquet and
Arrow by their bytes, a `datasets` folder as its Arrow files, a folder of Parquet, Arrow or .jsonl
files as those, another folder as one text document per file), except that a file whose name is not
.jsonl / .json (compressed or not) is a text document. --json-key names the key or column. Reading
is reported as preprocess_data reports it (documents/s, MB/s, ETA); sentencepiece's training that
follows shows no progress of its own.

Text is kept verbatim (identity normalisation, whitespace preserved) so code round-trips; documents
are fed to the trainer in chunks of whole lines of about --chunk-chars characters. Piece ids: 0 unk,
1 BOS, 2 EOS (= EOD), 3 PAD, then the --special-tokens, then the learned pieces. With
--byte-fallback, characters outside the vocabulary become byte pieces instead of <unk>. Lines that
are not UTF-8 JSON objects with a string under --json-key are skipped and counted; arguments the
trainer would reject are checked first, and a trainer error is reported as one line.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import sentencepiece as spm

from megalysses.data.columnar import check_columns, read_records
from megalysses.data.progress import Progress
from megalysses.data.text_input import (InputError, Position, check_jsonl, check_readable, corpus_inputs, read_file,
                                        read_lines)

META_PIECES = 4   # unk, BOS, EOS, PAD


def _is_jsonl(path: str) -> bool:
    name = re.sub(r"\.(gz|bz2|xz|zst)$", "", path.lower())
    return name.endswith((".jsonl", ".json"))


def resolve_inputs(specs: list[str], json_key: str) -> list[tuple[str, str]]:
    """[(file, kind)] of the --input files, globs and folders, each checked readable (InputError if not);
    kind is jsonl, parquet, arrow or text."""
    inputs = []
    for spec in specs:
        files, _ = corpus_inputs(spec)
        inputs += [(f, "text" if kind == "jsonl" and not _is_jsonl(f) else kind) for f, kind in files]
    for path, kind in inputs:
        if kind == "jsonl":
            check_jsonl(path)
        elif kind == "text":
            check_readable(path)
        else:
            check_columns(path, kind, [json_key], "--json-key")
    return inputs


class Documents:
    """The documents of the inputs: the json_key field of .jsonl/.json lines and of Parquet / Arrow rows,
    or whole text files; counts what it skips and reports progress every log_interval documents."""

    def __init__(self, inputs: list[tuple[str, str]], json_key: str, log_interval: int = 0) -> None:
        self.inputs, self.json_key, self.log_interval = inputs, json_key, log_interval
        self.count, self.skipped, self.chars = 0, 0, 0
        self.error: Optional[InputError] = None
        self.position = Position()
        self.progress = Progress(sum(os.path.getsize(f) for f, _ in inputs))

    def __iter__(self) -> Iterator[str]:
        """The documents; an unreadable input ends the iteration and is kept in `error` (the trainer that
        consumes this iterator would otherwise swallow it)."""
        try:
            yield from self._documents()
        except InputError as err:
            self.error = err

    def _documents(self) -> Iterator[str]:
        for text in self._texts():
            self.count += 1
            self.chars += len(text)
            if self.log_interval and self.count % self.log_interval == 0:
                self.progress.report(self.count, self.chars, self.position.done)
            yield text
        self.progress.report(self.count, self.chars, self.position.done, final=True, prefix="read: ")
        print("training the tokenizer on the text read (sentencepiece shows no progress)", file=sys.stderr, flush=True)

    def _texts(self) -> Iterator[str]:
        """The non-empty texts, in input order."""
        for path, kind in self.inputs:
            if kind == "text":
                yield from self._text_file(path)
            elif kind == "jsonl":
                yield from self._jsonl_texts(path)
            else:
                yield from self._record_texts(path, kind)

    def _text_file(self, path: str) -> Iterator[str]:
        """A text file as one document; one that is not UTF-8 is skipped (and counted)."""
        try:
            text = read_file(path, self.position).decode("utf-8")
        except UnicodeDecodeError:
            self.skipped += 1
            return
        if text:
            yield text

    def _jsonl_texts(self, path: str) -> Iterator[str]:
        """The json_key strings of a JSON Lines file; a non-blank line without one is skipped (and counted)."""
        for line in read_lines(path, self.position):
            try:
                value = json.loads(line).get(self.json_key)
            except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):
                value = None
            if isinstance(value, str):
                if value:
                    yield value
            elif line.strip():
                self.skipped += 1

    def _record_texts(self, path: str, kind: str) -> Iterator[str]:
        """The json_key column of a Parquet / Arrow input; a row whose value is not a string is skipped (and
        counted)."""
        for record in read_records(path, kind, [self.json_key], self.position):
            value = record[self.json_key]
            if not isinstance(value, str):
                self.skipped += 1
            elif value:
                yield value


def line_chunks(documents: Iterator[str], chunk_chars: int) -> Iterator[str]:
    """Split documents at line ends into pieces of about chunk_chars (newlines kept)."""
    for text in documents:
        buf: list[str] = []
        size = 0
        for line in text.splitlines(keepends=True):
            if buf and size + len(line) > chunk_chars:
                yield "".join(buf)
                buf, size = [], 0
            buf.append(line[: 4 * chunk_chars])
            size += len(buf[-1])
        if buf:
            yield "".join(buf)


def _trainer_message(err: Exception) -> str:
    """sentencepiece's 'INTERNAL: src/x.cc(12) [check] Message.' -> 'Message.'"""
    text = str(err).strip()
    text = re.sub(r"^[A-Z_]+:\s*", "", text)
    text = re.sub(r"^\S+\.cc\(\d+\)\s*(\[.*?\]\s*)?", "", text)
    return text or str(err).strip() or type(err).__name__


@dataclass(frozen=True)
class TrainerOptions:
    """What sentencepiece's trainer is told besides the vocabulary size (the command line's options)."""

    byte_fallback: bool = False             # characters outside the vocabulary become byte pieces, not <unk>
    special_tokens: tuple[str, ...] = ()    # extra pieces never split, ids 4, 5, ...
    model_type: str = "bpe"                 # or "unigram"
    character_coverage: float = 0.9999
    max_sentences: int = 1_000_000          # chunks sampled for training (0 = all)
    chunk_chars: int = 2000                 # documents are fed in chunks of whole lines of about this many characters
    num_threads: Optional[int] = None       # default: every core


def train(inputs: list[str], model_prefix: str, vocab_size: int, json_key: str = "text",
          options: TrainerOptions = TrainerOptions(), log_interval: int = 0) -> str:
    """Train and write `{model_prefix}.model` / `.vocab`; returns the .model path. `inputs` are files, globs
    or folders. Raises InputError for an input without text and ValueError (the trainer's own words) for
    what sentencepiece refuses."""
    documents = Documents(resolve_inputs(inputs, json_key), json_key, log_interval)
    model = io.BytesIO()
    o = options
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=line_chunks(iter(documents), o.chunk_chars), model_writer=model,
            vocab_size=vocab_size, model_type=o.model_type, byte_fallback=o.byte_fallback,
            user_defined_symbols=list(o.special_tokens), unk_id=0, bos_id=1, eos_id=2, pad_id=3,
            normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
            allow_whitespace_only_pieces=True, split_digits=True, character_coverage=o.character_coverage,
            input_sentence_size=o.max_sentences, shuffle_input_sentence=True, max_sentence_length=8 * o.chunk_chars,
            num_threads=o.num_threads or os.cpu_count() or 1, minloglevel=2)
    except RuntimeError as err:
        if documents.error is not None:
            raise documents.error from None
        if documents.count == 0:
            raise InputError(f"no text to train on: {', '.join(inputs)} gave no documents with a string "
                             f"'{json_key}' ({documents.skipped} documents skipped): check --input and "
                             f"--json-key") from None
        raise ValueError(f"sentencepiece cannot train this tokenizer: {_trainer_message(err)}") from None
    if documents.error is not None:
        raise documents.error
    out = Path(f"{model_prefix}.model")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    tmp.write_bytes(model.getvalue())
    os.replace(tmp, out)
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    vocab = "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i)}\n" for i in range(sp.vocab_size()))
    Path(f"{model_prefix}.vocab").write_text(vocab, encoding="utf-8")
    if documents.skipped:
        print(f"skipped {documents.skipped} lines that are not JSON objects with a string '{json_key}' "
              f"(or not UTF-8)", file=sys.stderr)
    return str(out)


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    floor = META_PIECES + len(args.special_tokens)
    if args.vocab_size <= floor:
        p.error(f"--vocab-size {args.vocab_size}: must be larger than the {floor} fixed pieces (unk, BOS, EOS, PAD"
                f"{' and the --special-tokens' if args.special_tokens else ''}); try 8192")
    if not 0 < args.character_coverage <= 1:
        p.error(f"--character-coverage {args.character_coverage}: must be in (0, 1], e.g. 0.9999")
    if args.num_threads is not None and args.num_threads < 1:
        p.error(f"--num-threads {args.num_threads}: give at least 1 thread")
    if args.max_sentences < 0:
        p.error(f"--max-sentences {args.max_sentences}: give a count >= 0 (0 = all)")
    if len(set(args.special_tokens)) != len(args.special_tokens) or any(not t for t in args.special_tokens):
        p.error(f"--special-tokens {args.special_tokens}: give distinct, non-empty tokens")
    prefix = args.model_prefix
    if not prefix or os.path.isdir(prefix) or prefix.endswith(os.sep):
        p.error(f"--model-prefix {prefix!r} is a directory: give a path prefix inside it, e.g. "
                f"{os.path.join(prefix or '.', 'tokenizer')}")
    if args.log_interval < 0:
        p.error(f"--log-interval {args.log_interval}: give a number of documents >= 0")


def main(argv: Optional[list[str]] = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help=".jsonl (.gz/.bz2/.xz/.zst), Parquet, Arrow or text "
                                                             "files, globs of them, or folders (a `datasets` folder)")
    p.add_argument("--model-prefix", required=True, help="writes {prefix}.model and {prefix}.vocab")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--json-key", default="text", help="jsonl key or Parquet / Arrow column holding the text "
                                                        "(default: text)")
    p.add_argument("--byte-fallback", action="store_true", help="unknown characters become byte pieces")
    p.add_argument("--special-tokens", nargs="*", default=[], help="extra pieces never split, e.g. <|im_start|>")
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    p.add_argument("--character-coverage", type=float, default=0.9999)
    p.add_argument("--max-sentences", type=int, default=1_000_000, help="sample at most this many chunks (0 = all)")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--log-interval", type=int, default=10000, help="documents read between progress lines (0 = none)")
    args = p.parse_args(argv)
    _check_args(p, args)
    try:
        options = TrainerOptions(args.byte_fallback, tuple(args.special_tokens), args.model_type,
                                 args.character_coverage, args.max_sentences, num_threads=args.num_threads)
        path = train(args.input, args.model_prefix, args.vocab_size, args.json_key, options, args.log_interval)
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    print(f"wrote {path} and {args.model_prefix}.vocab (vocab size {args.vocab_size})", file=sys.stderr)
    return path


def cli() -> int:
    """Console entry point: exit status 0 once main() has written its output."""
    main()
    return 0


if __name__ == "__main__":
    sys.exit(cli())
