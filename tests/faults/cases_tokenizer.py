"""Bad inputs and trainer arguments given to tools/train_tokenizer.py (megalysses.tools.train_tokenizer.main)."""
from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Callable

from tests.faults.corpus import Case

WORDS = ["alpha", "beta", "gamma", "delta", "token", "stream", "model", "data", "index", "shard"]
TEXT = "".join(json.dumps({"text": " ".join(WORDS[(i + k) % 10] for k in range(8)) + f" {i}\n"}) + "\n"
               for i in range(40))


def corpus(data: str | bytes = TEXT, name: str = "corpus.jsonl") -> Callable[[Path], str]:
    def build(tmp: Path) -> str:
        (tmp / name).write_bytes(data.encode() if isinstance(data, str) else data)
        return str(tmp / name)
    return build


def train(source: Callable[[Path], str] = corpus(), *extra: str, prefix: str = "{tmp}/tok") -> Callable[[Path], int]:
    """A case body: train_tokenizer.main on source(tmp), vocab 200 and one thread unless `extra` says otherwise."""
    def run(tmp: Path) -> int:
        from megalysses.tools.train_tokenizer import main
        args = ["--input", source(tmp), "--model-prefix", prefix.format(tmp=tmp), "--vocab-size", "200",
                "--num-threads", "1", *extra]
        main(args)
        return 0
    return run


def prefix_is_directory(tmp: Path) -> int:
    (tmp / "out").mkdir()
    return train(prefix="{tmp}/out")(tmp)


CASES = [
    Case("tokenizer/vocab_size_zero", train(corpus(), "--vocab-size", "0"), "--vocab-size 0"),
    Case("tokenizer/vocab_size_negative", train(corpus(), "--vocab-size", "-100"), "--vocab-size -100"),
    Case("tokenizer/vocab_size_only_special_pieces", train(corpus(), "--vocab-size", "4"), "fixed pieces"),
    Case("tokenizer/vocab_size_below_special_tokens", train(corpus(), "--vocab-size", "6", "--special-tokens",
                                                            "<a>", "<b>", "<c>"), "--special-tokens"),
    Case("tokenizer/vocab_size_too_large", train(corpus(), "--vocab-size", "100000"), "Vocabulary size too high"),
    Case("tokenizer/vocab_size_below_characters", train(corpus(), "--vocab-size", "12", "--character-coverage", "1"),
         "vocab_size"),
    Case("tokenizer/vocab_size_not_a_number", train(corpus(), "--vocab-size", "8k"), "--vocab-size"),
    Case("tokenizer/character_coverage_two", train(corpus(), "--character-coverage", "2"), "--character-coverage"),
    Case("tokenizer/character_coverage_zero", train(corpus(), "--character-coverage", "0"), "--character-coverage"),
    Case("tokenizer/character_coverage_nan", train(corpus(), "--character-coverage", "nan"), "--character-coverage"),
    Case("tokenizer/threads_minus_one", train(corpus(), "--num-threads", "-1"), "--num-threads -1"),
    Case("tokenizer/threads_zero", train(corpus(), "--num-threads", "0"), "--num-threads 0"),
    Case("tokenizer/max_sentences_negative", train(corpus(), "--max-sentences", "-5"), "--max-sentences"),
    Case("tokenizer/model_type_unknown", train(corpus(), "--model-type", "wordpiece"), "--model-type"),
    Case("tokenizer/duplicate_special_tokens", train(corpus(), "--special-tokens", "<s>", "<s>"), "distinct"),
    Case("tokenizer/empty_special_token", train(corpus(), "--special-tokens", ""), "non-empty"),
    Case("tokenizer/empty_input", train(corpus("")), "empty"),
    Case("tokenizer/empty_text_file", train(corpus("", "corpus.txt")), "no text to train on"),
    Case("tokenizer/key_no_line_has", train(corpus(), "--json-key", "content"), "no text to train on"),
    Case("tokenizer/every_line_bad_json", train(corpus("not json\n{'a': 1}\n")), "no text to train on"),
    Case("tokenizer/latin1_jsonl", train(corpus('{"text": "caf\xe9"}\n'.encode("latin-1"))), "no text to train on"),
    Case("tokenizer/binary_text_file", train(corpus(b"\xff\xfe\x00\x81" * 50, "corpus.bin")), "no text to train on"),
    Case("tokenizer/json_array_input", train(corpus(json.dumps([{"text": "a"}, {"text": "b"}]))), "JSON array"),
    Case("tokenizer/input_missing", train(lambda tmp: str(tmp / "none.jsonl")), "no such file"),
    Case("tokenizer/input_empty_folder", train(lambda tmp: str(tmp)), "holds no files"),
    Case("tokenizer/truncated_gz", train(lambda tmp: corpus(gzip.compress(TEXT.encode() * 20)[:-100],
                                                            "corpus.jsonl.gz")(tmp)), "truncated"),
    Case("tokenizer/fake_gz", train(corpus(TEXT, "corpus.jsonl.gz")), "not gzip data"),
    Case("tokenizer/zstd_garbage", train(corpus(b"\x28\xb5\x2f\xfd" + bytes(30), "corpus.jsonl.zst")),
         "corrupt or truncated zstd"),
    Case("tokenizer/model_prefix_is_directory", prefix_is_directory, "is a directory"),
    Case("tokenizer/model_prefix_empty", train(prefix=""), "is a directory"),
]
