"""Train a sentencepiece BPE tokenizer from jsonl (plain or .gz) or plain text files.

    python tools/train_tokenizer.py --input data/stdlib.jsonl --model-prefix data/stdlib_sp \\
        --vocab-size 8192 --byte-fallback
    # -> data/stdlib_sp.model (use with --tokenizer-type sentencepiece) and data/stdlib_sp.vocab

Text is kept verbatim (identity normalisation, whitespace preserved) so code round-trips; documents
are fed to the trainer in chunks of whole lines of about --chunk-chars characters. Piece ids: 0 unk,
1 BOS, 2 EOS (= EOD), 3 PAD, then the --special-tokens, then the learned pieces. With
--byte-fallback, characters outside the vocabulary become byte pieces instead of <unk>.
"""
from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import sys
from pathlib import Path
from typing import Iterator, Optional

import sentencepiece as spm


def read_documents(paths: list[str], json_key: str) -> Iterator[str]:
    """Documents of .jsonl/.json(.gz) files (the json_key field) or whole text files; bad lines skipped."""
    for path in paths:
        opener = gzip.open if path.endswith(".gz") else open
        name = path[:-3] if path.endswith(".gz") else path
        with opener(path, "rt", encoding="utf-8", errors="replace") as f:
            if not name.endswith((".jsonl", ".json")):
                yield f.read()
                continue
            for line in f:
                try:
                    value = json.loads(line).get(json_key)
                except (json.JSONDecodeError, AttributeError):
                    continue
                if isinstance(value, str):
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


def train(inputs: list[str], model_prefix: str, vocab_size: int, json_key: str = "text", byte_fallback: bool = False,
          special_tokens: Optional[list[str]] = None, model_type: str = "bpe", character_coverage: float = 0.9999,
          max_sentences: int = 1_000_000, chunk_chars: int = 2000, num_threads: Optional[int] = None) -> str:
    """Train and write `{model_prefix}.model` / `.vocab`; returns the .model path."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=line_chunks(read_documents(inputs, json_key), chunk_chars), model_writer=model,
        vocab_size=vocab_size, model_type=model_type, byte_fallback=byte_fallback,
        user_defined_symbols=list(special_tokens or []), unk_id=0, bos_id=1, eos_id=2, pad_id=3,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
        allow_whitespace_only_pieces=True, split_digits=True, character_coverage=character_coverage,
        input_sentence_size=max_sentences, shuffle_input_sentence=True, max_sentence_length=8 * chunk_chars,
        num_threads=num_threads or os.cpu_count() or 1, minloglevel=2)
    out = Path(f"{model_prefix}.model")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    tmp.write_bytes(model.getvalue())
    os.replace(tmp, out)
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    vocab = "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i)}\n" for i in range(sp.vocab_size()))
    Path(f"{model_prefix}.vocab").write_text(vocab, encoding="utf-8")
    return str(out)


def main(argv: Optional[list[str]] = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help=".jsonl / .jsonl.gz / text files")
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
    for path in args.input:
        if not os.path.isfile(path):
            raise SystemExit(f"error: --input {path}: no such file")
    path = train(args.input, args.model_prefix, args.vocab_size, args.json_key, args.byte_fallback,
                 args.special_tokens, args.model_type, args.character_coverage, args.max_sentences,
                 num_threads=args.num_threads)
    print(f"wrote {path} and {args.model_prefix}.vocab (vocab size {args.vocab_size})", file=sys.stderr)
    return path


def cli() -> int:
    """Console entry point: exit status 0 once main() has written its output."""
    main()
    return 0


if __name__ == "__main__":
    sys.exit(cli())
