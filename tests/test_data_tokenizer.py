"""Tokenizers: byte-level ids and round trips; sentencepiece training on a tiny generated corpus."""
import json
from pathlib import Path

import pytest

from megalysses.data.tokenizer import ByteTokenizer, SentencePieceTokenizer, Tokenizer, build_tokenizer
from megalysses.tools import train_tokenizer

SAMPLES = ["hello world", "", "ünïcødé ✓ 🙂", "def f(x):\n\treturn x  # two spaces\r\n\n", "a" * 1000]


def test_byte_tokenizer():
    tok = build_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer) and isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.eod_id, tok.pad_id) == (259, 256, 257, 257, 258)
    assert tok.encode("Ab") == [65, 98]
    assert tok.encode("é") == [0xC3, 0xA9]
    for text in SAMPLES:
        ids = tok.encode(text)
        assert all(0 <= i < 256 for i in ids)
        assert tok.decode(ids) == text
        assert tok.decode([tok.bos_id] + ids + [tok.eod_id, tok.pad_id]) == text


def test_factory_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown tokenizer kind"):
        build_tokenizer("gpt2")
    with pytest.raises(ValueError, match="needs a model path"):
        build_tokenizer("sentencepiece")
    with pytest.raises(FileNotFoundError, match="nothing.model"):
        build_tokenizer("sentencepiece", str(tmp_path / "nothing.model"))


def _tiny_corpus(path, n_docs=300):
    words = ["alpha", "beta", "gamma", "delta", "token", "stream", "model", "data", "index", "shard"]
    with open(path, "w") as f:
        for i in range(n_docs):
            lines = [" ".join(words[(i * 7 + j * 3 + k) % len(words)] for k in range(6)) for j in range(5)]
            text = f"def fn_{i}(x):\n" + "".join(f"    {line} = {i * j}\n" for j, line in enumerate(lines))
            f.write(json.dumps({"text": text, "id": i}) + "\n")
        f.write("not json\n")


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sp")
    corpus = tmp / "corpus.jsonl"
    _tiny_corpus(corpus)
    tool = train_tokenizer
    path = tool.main(["--input", str(corpus), "--model-prefix", str(tmp / "tiny"), "--vocab-size", "400",
                      "--byte-fallback", "--special-tokens", "<|sep|>", "--num-threads", "1"])
    return path


def test_sentencepiece_training_and_round_trip(sp_model):
    assert Path(sp_model).is_file() and Path(sp_model).with_suffix(".vocab").is_file()
    tok = build_tokenizer("sentencepiece", sp_model)
    assert isinstance(tok, SentencePieceTokenizer) and isinstance(tok, Tokenizer)
    assert tok.vocab_size == 400
    assert (tok.bos_id, tok.eos_id, tok.eod_id, tok.pad_id) == (1, 2, 2, 3)
    for text in SAMPLES + ["    alpha beta = 12\n"]:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text, text
    assert tok.encode_batch(SAMPLES) == [tok.encode(t) for t in SAMPLES]
    assert len(tok.encode("<|sep|>")) == 1
    assert len(tok.encode("    alpha beta gamma")) < len("    alpha beta gamma") / 2  # it learned merges
