"""A run's tokenizer exported beside its weights: transformers' AutoTokenizer loads the files and encodes text
to the ids the run trained on, for sentencepiece models (ours, without a dummy prefix; Llama-2 style BPE with
one; unigram with sentencepiece's default NFKC normalisation), the byte tokenizer and GPT-2 BPE; a conversion
that would encode otherwise is refused."""
import json

import pytest

transformers = pytest.importorskip("transformers")

import sentencepiece as spm  # noqa: E402

from megalysses.data import hf_tokenizer  # noqa: E402
from megalysses.data.tokenizer import TokenizerError, build_tokenizer  # noqa: E402
from megalysses.tools import train_tokenizer  # noqa: E402

CODE = "".join(f"def fn_{i}(x, y):\n    total = x  *  {i} + y\n\treturn total  # ✓ naïve 日本\n" for i in range(40))
TEXTS = [CODE[:300], "  two leading spaces and <|sep|> inside", "émigré\n\n\ntrailing   ", "🙂 x=1; z", "", " "]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_tok")
    (tmp / "corpus.jsonl").write_text("".join(json.dumps({"text": CODE[i:i + 400]}) + "\n" for i in range(0, 4000, 97)))
    (tmp / "corpus.txt").write_text(CODE)
    return tmp


def _loaded(tok, folder):
    """AutoTokenizer over the exported files of `tok`."""
    folder.mkdir()
    for name, data in hf_tokenizer.hf_tokenizer_files(tok, model_max_length=4096).items():
        (folder / name).write_bytes(data)
    return transformers.AutoTokenizer.from_pretrained(folder)


def _sentencepiece(corpus, name, **options):
    spm.SentencePieceTrainer.train(input=str(corpus / "corpus.txt"), model_prefix=str(corpus / name), unk_id=0,
                                   bos_id=1, eos_id=2, pad_id=3, minloglevel=2, num_threads=1, **options)
    return str(corpus / f"{name}.model")


def test_exported_tokenizers_give_the_runs_ids(corpus):
    ours = train_tokenizer.main(["--input", str(corpus / "corpus.jsonl"), "--model-prefix", str(corpus / "ours"),
                                 "--vocab-size", "300", "--byte-fallback", "--special-tokens", "<|sep|>",
                                 "--num-threads", "1"])
    from tokenizers import ByteLevelBPETokenizer

    gpt2 = ByteLevelBPETokenizer()
    gpt2.train_from_iterator([CODE], vocab_size=300, special_tokens=["<|endoftext|>"])
    gpt2.save_model(str(corpus))
    tokenizers = {
        "ours (no dummy prefix)": build_tokenizer("sentencepiece", ours),
        "llama-2 style": build_tokenizer("sentencepiece", _sentencepiece(
            corpus, "llama2", model_type="bpe", vocab_size=300, byte_fallback=True, add_dummy_prefix=True,
            normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True)),
        "unigram, nfkc": build_tokenizer("sentencepiece", _sentencepiece(corpus, "unigram", model_type="unigram",
                                                                         vocab_size=100, hard_vocab_limit=False)),
        "byte": build_tokenizer("byte"),
        "gpt2bpe": build_tokenizer("gpt2bpe", vocab_file=str(corpus / "vocab.json"),
                                   merge_file=str(corpus / "merges.txt")),
    }
    for i, (what, tok) in enumerate(tokenizers.items()):
        theirs = _loaded(tok, corpus / f"hf{i}")
        for text in TEXTS:
            assert theirs(text)["input_ids"] == tok.encode(text), (what, text)
        assert theirs.eos_token_id == tok.eod_id and theirs.model_max_length == 4096, what
    assert len(tokenizers["ours (no dummy prefix)"].encode("<|sep|>")) == 1


def test_a_conversion_that_would_encode_otherwise_is_refused(corpus, monkeypatch):
    """The dummy prefix read wrongly (say) shows on the probe texts: no tokenizer rather than the wrong ids."""
    model = _sentencepiece(corpus, "prefixed", model_type="bpe", vocab_size=200)
    spec = hf_tokenizer.sentencepiece_spec
    monkeypatch.setattr(hf_tokenizer, "sentencepiece_spec", lambda raw: {**spec(raw), "add_dummy_prefix": False})
    with pytest.raises(TokenizerError, match="encodes .* differently from it"):
        hf_tokenizer.hf_tokenizer_files(build_tokenizer("sentencepiece", model))
