"""Tokenizer kinds and names, Hugging Face special tokens from the files beside tokenizer.json, EOD/BOS
overrides, the true vocabulary size, Megatron's null tokenizer, and the config that names them."""
import json

import pytest

from megalysses.config import ConfigError
from megalysses.config.io import load_config
from megalysses.data.tokenizer import (HFTokenizer, NullTokenizer, SpecialTokens, TokenizerError, build_tokenizer,
                                       canonical_kind, tokenizer_from_config)


def word_tokenizer(path, words, post_bos=None):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if post_bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{post_bos} $A",
                                                           special_tokens=[(post_bos, words.index(post_bos))])
    path.mkdir(exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return path


def test_kinds_and_megatron_names():
    assert canonical_kind("HuggingFaceTokenizer") == canonical_kind("huggingface") == "huggingface"
    for name in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer", "SENTENCEPIECE"):
        assert canonical_kind(name) == "sentencepiece"
    assert canonical_kind("GPT2BPETokenizer") == "gpt2bpe" and canonical_kind("NullTokenizer") == "null"
    with pytest.raises(TokenizerError, match="tiktoken"):
        canonical_kind("TikTokenizer")
    with pytest.raises(TokenizerError, match="unknown tokenizer kind"):
        canonical_kind("wordpiece")


def test_special_tokens_from_the_folder(tmp_path):
    words = ["<unk>", "<s>", "</s>", "<pad>", "<|end_of_text|>", "hello", "world"]
    folder = word_tokenizer(tmp_path / "a", words, post_bos="<s>")
    tok = build_tokenizer("huggingface", str(folder))          # no config files: well-known names
    assert (tok.bos_id, tok.eos_id, tok.eod_id, tok.pad_id, tok.vocab_size) == (1, 4, 4, 4, 7)
    assert tok.encode("hello world") == [1, 5, 6]               # the post-processor's BOS, as AutoTokenizer adds it
    assert build_tokenizer("huggingface", str(folder), add_special_tokens=False).encode("hello") == [5]
    special = {"eos_token": {"content": "</s>"}, "pad_token": "<pad>"}
    (folder / "special_tokens_map.json").write_text(json.dumps(special))
    tok = build_tokenizer("HuggingFaceTokenizer", str(folder / "tokenizer.json"))
    assert (tok.eos_id, tok.eod_id, tok.pad_id) == (2, 2, 3)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end_of_text|>"}))
    assert build_tokenizer("huggingface", str(folder)).eod_id == 4   # tokenizer_config.json comes first
    (folder / "tokenizer_config.json").unlink()
    (folder / "special_tokens_map.json").unlink()
    (folder / "config.json").write_text(json.dumps({"eos_token_id": [6, 5], "bos_token_id": 5}))
    tok = build_tokenizer("huggingface", str(folder))
    assert (tok.eod_id, tok.bos_id) == (6, 5)                    # a list of EOS ids: the first


def test_eod_and_bos_overrides_and_missing_eos(tmp_path):
    folder = word_tokenizer(tmp_path / "b", ["[UNK]", "a", "b", "[SEP]"])
    with pytest.raises(TokenizerError, match="which token ends a document"):
        build_tokenizer("huggingface", str(folder))
    assert build_tokenizer("huggingface", str(folder), need_eod=False).eod_id is None
    tok = build_tokenizer("huggingface", str(folder), special=SpecialTokens(eod="[SEP]", bos="1"))
    assert (tok.eod_id, tok.bos_id, tok.pad_id) == (3, 1, 3)
    assert build_tokenizer("byte", special=SpecialTokens(eod=0)).eod_id == 0
    with pytest.raises(TokenizerError, match="no such token"):
        build_tokenizer("huggingface", str(folder), special=SpecialTokens(eod="<eos>"))
    with pytest.raises(TokenizerError, match="outside"):
        build_tokenizer("byte", special=SpecialTokens(eod="259"))


def test_true_vocab_size_counts_added_tokens(tmp_path):
    from tokenizers import AddedToken
    folder = word_tokenizer(tmp_path / "c", ["[UNK]", "a", "b"])
    tok = HFTokenizer(str(folder), add_special_tokens=True)
    tok.tok.add_special_tokens([AddedToken("<|eot|>", special=True)])
    tok.tok.save(str(folder / "tokenizer.json"))
    tok = build_tokenizer("huggingface", str(folder), special=SpecialTokens(eod="<|eot|>"))
    assert tok.vocab_size == 4 and tok.eod_id == 3 and tok.special_tokens == {"<|eot|>": 3}
    assert tok.encode("a <|eot|> b", parse_special=True) == [1, 3, 2]
    assert tok.encode("a <|eot|> b") == [1, 0, 0, 0, 2]          # text as text: its spelling, never the EOD id
    assert tok.spells_special("a <|eot|> b") and not tok.spells_special("a <|eo b")


def test_null_tokenizer():
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert isinstance(tok, NullTokenizer) and (tok.vocab_size, tok.eod_id, tok.bos_id) == (100, 99, None)
    assert tok.encode("3 14 15\n") == [3, 14, 15] and tok.decode([3, 14]) == "3 14"
    assert tok.encode_batch(["1", ""]) == [[1], []]
    with pytest.raises(TokenizerError, match="outside"):
        tok.encode("100")
    with pytest.raises(TokenizerError, match="vocabulary size"):
        build_tokenizer("NullTokenizer")


def test_config_names_the_tokenizer(tmp_path):
    folder = word_tokenizer(tmp_path / "d", ["<unk>", "</s>", "x"])
    cfg = load_config(None, ["data.mock=true", "data.tokenizer=HuggingFaceTokenizer",
                             f"data.tokenizer_model={folder}", "data.eod=</s>"])
    tok = tokenizer_from_config(cfg.data, cfg.model.vocab_size)
    assert tok.eod_id == 1 and tok.vocab_size == 3
    with pytest.raises(ConfigError, match="needs data.tokenizer_model"):
        load_config(None, ["data.mock=true", "data.tokenizer=huggingface"])
    with pytest.raises(ConfigError, match="data.vocab_file"):
        load_config(None, ["data.mock=true", "data.tokenizer=GPT2BPETokenizer", "data.vocab_file=v.json"])
    with pytest.raises(ConfigError, match="unknown tokenizer kind"):
        load_config(None, ["data.mock=true", "data.tokenizer=gpt3"])
    with pytest.raises(ConfigError, match="data.split"):
        load_config(None, ["data.mock=true", "data.split=-1,2,0"])
