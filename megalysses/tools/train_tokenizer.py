"""Train a sentencepiece BPE tokenizer from JSON Lines (plain, gzip, bz2 or xz) or plain text files.

    python tools/train_tokenizer.py --input data/stdlib.jsonl --model-prefix data/stdlib_sp \\
        --vocab-size 8192 --byte-fallback
    # -> data/stdlib_sp.model (use with --tokenizer-type sentencepiece) and data/stdlib_sp.vocab

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
from pathlib import Path
from typing import Iterator, Optional

import sentencepiece as spm

from megalysses.data.text_input import InputError, check_jsonl, check_readable, read_file, read_lines

META_PIECES = 4   # unk, BOS, EOS, PAD


def _is_jsonl(path: str) -> bool:
    name = re.sub(r"\.(gz|bz2|xz|zst)$", "", path.lower())
    return name.endswith((".jsonl", ".json"))


class Documents:
    """The documents of .jsonl/.json files (the json_key field) or whole text files; counts what it skips."""

    def __init__(self, paths: list[str], json_key: str) -> None:
        self.paths, self.json_key = paths, json_key
        self.count, self.skipped = 0, 0
        self.error: Optional[InputError] = None

    def __iter__(self) -> Iterator[str]:
        """The documents; an unreadable input ends the iteration and is kept in `error` (the trainer that
        consumes this iterator would otherwise swallow it)."""
        try:
            yield from self._documents()
        except InputError as err:
            self.error = err

    def _documents(self) -> Iterator[str]:
        for path in self.paths:
            if not _is_jsonl(path):
                try:
                    text = read_file(path).decode("utf-8")
                except UnicodeDecodeError:
                    self.skipped += 1
                    continue
                if text:
                    self.count += 1
                    yield text
                continue
            for line in read_lines(path):
                try:
                    value = json.loads(line).get(self.json_key)
                except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):
                    value = None
                if isinstance(value, str):
                    if value:
                        self.count += 1
                        yield value
                elif line.strip():
                    self.skipped += 1


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


def train(inputs: list[str], model_prefix: str, vocab_size: int, json_key: str = "text", byte_fallback: bool = False,
          special_tokens: Optional[list[str]] = None, model_type: str = "bpe", character_coverage: float = 0.9999,
          max_sentences: int = 1_000_000, chunk_chars: int = 2000, num_threads: Optional[int] = None) -> str:
    """Train and write `{model_prefix}.model` / `.vocab`; returns the .model path. Raises InputError for an
    input without text and ValueError (the trainer's own words) for what sentencepiece refuses."""
    documents = Documents(inputs, json_key)
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=line_chunks(iter(documents), chunk_chars), model_writer=model,
            vocab_size=vocab_size, model_type=model_type, byte_fallback=byte_fallback,
            user_defined_symbols=list(special_tokens or []), unk_id=0, bos_id=1, eos_id=2, pad_id=3,
            normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
            allow_whitespace_only_pieces=True, split_digits=True, character_coverage=character_coverage,
            input_sentence_size=max_sentences, shuffle_input_sentence=True, max_sentence_length=8 * chunk_chars,
            num_threads=num_threads or os.cpu_count() or 1, minloglevel=2)
    except RuntimeError as err:
        if documents.error is not None:
            raise documents.error from None
        if documents.count == 0:
            raise InputError(f"no text to train on: {', '.join(inputs)} gave no documents with a string "
                             f"'{json_key}' ({documents.skipped} lines skipped): check --input and "
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
    for path in args.input:
        if os.path.isdir(path):
            p.error(f"--input {path}: is a directory; pass the files (e.g. {path}/*.jsonl)")
        if not os.path.isfile(path):
            p.error(f"--input {path}: no such file")


def main(argv: Optional[list[str]] = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help=".jsonl (.gz/.bz2/.xz) or text files")
    p.add_argument("--model-prefix", required=True, help="writes {prefix}.model and {prefix}.vocab")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--json-key", default="text", help="jsonl field holding the text (default: text)")
    p.add_argument("--byte-fallback", action="store_true", help="unknown characters become byte pieces")
    p.add_argument("--special-tokens", nargs="*", default=[], help="extra pieces never split, e.g. <|im_start|>")
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    p.add_argument("--character-coverage", type=float, default=0.9999)
    p.add_argument("--max-sentences", type=int, default=1_000_000, help="sample at most this many chunks (0 = all)")
    p.add_argument("--num-threads", type=int, default=None)
    args = p.parse_args(argv)
    _check_args(p, args)
    try:
        for path in args.input:
            (check_jsonl if _is_jsonl(path) else check_readable)(path)
        path = train(args.input, args.model_prefix, args.vocab_size, args.json_key, args.byte_fallback,
                     args.special_tokens, args.model_type, args.character_coverage, args.max_sentences,
                     num_threads=args.num_threads)
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
