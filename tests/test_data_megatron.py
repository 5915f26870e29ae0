"""Megatron-LM's tools/preprocess_data.py command lines run unchanged and write the bytes Megatron-LM
writes. The reference is independent of our code: token ids from transformers / sentencepiece as
Megatron's tokenizer wrappers produce them, and the .bin/.idx packed field by field with struct
following Megatron's encode + IndexedDatasetBuilder rules (empty sentences dropped, EOD appended to
non-empty documents only, an empty document is a document boundary with no sequence, partitions
dealt round-robin or in blocks and merged in partition order)."""
import json
import math
import os
import shlex
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megalysses.tools import preprocess_data, train_tokenizer

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["alpha", "beta", "gamma", "def", "return", "héllo", "wörld", "✓", "  ", "\n", "x=1;", "data"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("megatron")
    rng = np.random.default_rng(0)
    rows = []
    for i in range(37):
        text = " ".join(WORDS[j] for j in rng.integers(0, len(WORDS), size=rng.integers(0, 25)))
        rows.append({"text": "" if i % 6 == 0 else text, "title": f"title {i}"})
    rows[4]["text"] = ["first sentence.", "", "second sentence"]   # a pre-split document
    path = tmp / "corpus.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    numbers = tmp / "numbers.jsonl"
    numbers.write_text("".join(json.dumps({"text": " ".join(str((7 * i + k) % 90) for k in range(i % 5 + 1))}) + "\n"
                               for i in range(23)))
    return {"dir": tmp, "jsonl": str(path), "rows": rows, "numbers": str(numbers)}


@pytest.fixture(scope="module")
def tokenizers_dir(corpus):
    """A Llama-3-like tokenizer.json folder (BOS added by the post-processor), GPT-2 vocab.json +
    merges.txt, and a sentencepiece model, all trained on the corpus."""
    from tokenizers import ByteLevelBPETokenizer, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tmp, texts = corpus["dir"], [" ".join(WORDS) * 3] * 20
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=320, special_tokens=[
        "<|begin_of_text|>", "<|end_of_text|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", hf.token_to_id("<|begin_of_text|>"))])
    (tmp / "llama").mkdir()
    hf.save(str(tmp / "llama" / "tokenizer.json"))
    (tmp / "llama" / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>"}))
    gpt2 = ByteLevelBPETokenizer()
    gpt2.train_from_iterator(texts, vocab_size=300, special_tokens=["<|endoftext|>"])
    (tmp / "gpt2").mkdir()
    gpt2.save_model(str(tmp / "gpt2"))
    sp = train_tokenizer.main(["--input", corpus["jsonl"], "--model-prefix", str(tmp / "sp"), "--vocab-size", "330",
                               "--byte-fallback", "--num-threads", "1"])
    return {"llama": str(tmp / "llama"), "vocab": str(tmp / "gpt2" / "vocab.json"),
            "merges": str(tmp / "gpt2" / "merges.txt"), "sp": sp}


def megatron_bytes(docs, encode, eod, vocab_size, partitions=1, sequential=False):
    """The .bin and .idx Megatron-LM writes for `docs` (each a str or a list of sentences)."""
    dtype = np.uint16 if vocab_size < 65500 else np.int32
    encoded = []
    for text in docs:
        ids, lens = [], []
        for sentence in (text if isinstance(text, list) else [text]):
            sentence_ids = encode(sentence)
            if sentence_ids:
                ids += sentence_ids
                lens.append(len(sentence_ids))
        if ids and eod is not None:
            ids.append(eod)
            lens[-1] += 1
        encoded.append((ids, lens))
    if partitions > 1:
        size = math.ceil(len(docs) / partitions)
        part = [i // size if sequential else i % partitions for i in range(len(docs))]
        encoded = [e for p in range(partitions) for e, q in zip(encoded, part) if q == p]
    tokens = [t for ids, _ in encoded for t in ids]
    lengths = [n for _, lens in encoded for n in lens]
    doc_index = [0]
    for _, lens in encoded:
        doc_index.append(doc_index[-1] + len(lens))
    pointers = [0]
    for n in lengths[:-1]:
        pointers.append(pointers[-1] + n * np.dtype(dtype).itemsize)
    code = {np.uint16: 8, np.int32: 4}[dtype]
    idx = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
    idx += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_index))
    idx += struct.pack(f"<{len(lengths)}i", *lengths) + struct.pack(f"<{len(pointers)}q", *pointers[:len(lengths)])
    idx += struct.pack(f"<{len(doc_index)}q", *doc_index)
    return np.asarray(tokens, dtype=dtype).tobytes(), idx


def run_cmd(cmd: str, tmp: Path, subprocess_run: bool = False) -> None:
    argv = shlex.split(cmd)
    assert argv[:2] == ["python", "tools/preprocess_data.py"]
    if subprocess_run:
        subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, check=True, capture_output=True, timeout=120)
    else:
        preprocess_data.main(argv[2:])


def check(out: str, key: str, expected) -> None:
    assert Path(f"{out}_{key}_document.bin").read_bytes() == expected[0]
    assert Path(f"{out}_{key}_document.idx").read_bytes() == expected[1]


def test_huggingface_tokenizer_command_line(corpus, tokenizers_dir, tmp_path):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(tokenizers_dir["llama"])   # what Megatron's HuggingFaceTokenizer wraps
    out = tmp_path / "hf"
    run_cmd(f"python tools/preprocess_data.py --input {corpus['jsonl']} --output-prefix {out} "
            f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {tokenizers_dir['llama']} "
            f"--json-keys text title --append-eod --workers 2 --log-interval 1000", tmp_path, subprocess_run=True)
    for key in ("text", "title"):
        check(out, key, megatron_bytes([r[key] for r in corpus["rows"]], lambda t: ref(t).input_ids,
                                       ref.eos_token_id, len(ref)))
    out = tmp_path / "hf_plain"
    run_cmd(f"python tools/preprocess_data.py --input {corpus['jsonl']} --output-prefix {out} "
            f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {tokenizers_dir['llama']} --append-eod "
            f"--workers 1 --tokenizer-hf-no-include-special-tokens", tmp_path)
    check(out, "text", megatron_bytes([r["text"] for r in corpus["rows"]],
                                      lambda t: ref(t, add_special_tokens=False).input_ids, ref.eos_token_id, len(ref)))


def test_gpt2_bpe_command_line(corpus, tokenizers_dir, tmp_path, capsys):
    """Megatron-LM's GPT-2 command line writes Megatron's bytes, and the run it names trains as given."""
    from transformers import GPT2Tokenizer

    ref = GPT2Tokenizer(tokenizers_dir["vocab"], tokenizers_dir["merges"])   # the pure-Python GPT-2 BPE
    out = tmp_path / "gpt2"
    run_cmd(f"python tools/preprocess_data.py --input {corpus['jsonl']} --output-prefix {out} --vocab-file "
            f"{tokenizers_dir['vocab']} --merge-file {tokenizers_dir['merges']} --tokenizer-type GPT2BPETokenizer "
            f"--append-eod --workers 1 --dataset-impl mmap", tmp_path)
    check(out, "text", megatron_bytes([r["text"] for r in corpus["rows"]], lambda t: ref(t).input_ids,
                                      ref.convert_tokens_to_ids("<|endoftext|>"), len(ref)))
    said = capsys.readouterr().err
    hint = shlex.split(said.split("train with pretrain.py ", 1)[1].split(" (model.vocab_size may be larger)")[0])
    tiny = ["data.seq_len=16", "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2",
            "training.global_batch_size=1", "training.micro_batch_size=1", "training.train_steps=1",
            "data.split=1,0,0", f"logging.run_dir={tmp_path / 'run'}"]
    r = subprocess.run([sys.executable, str(ROOT / "pretrain.py"), *hint] + [a for t in tiny for a in ("--set", t)],
                       cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "done: step 1" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("kind,partitions,sequential", [("SentencePieceTokenizer", 1, False),
                                                        ("Llama2Tokenizer", 2, False),
                                                        ("GPTSentencePieceTokenizer", 3, True)])
def test_sentencepiece_command_lines(corpus, tokenizers_dir, tmp_path, kind, partitions, sequential):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=tokenizers_dir["sp"])
    out = tmp_path / "sp"
    run_cmd(f"python tools/preprocess_data.py --input {corpus['jsonl']} --output-prefix {out} --tokenizer-type "
            f"{kind} --tokenizer-model {tokenizers_dir['sp']} --append-eod --workers {partitions} --partitions "
            f"{partitions} {'--keep-sequential-samples' if sequential else ''} --keep-newlines --lang english",
            tmp_path)
    check(out, "text", megatron_bytes([r["text"] for r in corpus["rows"]], sp.encode_as_ids, sp.eos_id(),
                                      sp.get_piece_size(), partitions, sequential))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sp_text_document.bin", "sp_text_document.idx",
                                                         "sp_text_document.tokenizer.json"]   # its tokenizer
    assert json.loads((tmp_path / "sp_text_document.tokenizer.json").read_text())["type"] == "sentencepiece"


def test_null_tokenizer_command_line(corpus, tmp_path):
    out = tmp_path / "null"
    run_cmd(f"python tools/preprocess_data.py --input {corpus['numbers']} --output-prefix {out} --tokenizer-type "
            f"NullTokenizer --vocab-size 90 --append-eod --workers 1", tmp_path)
    texts = [json.loads(line)["text"] for line in open(corpus["numbers"])]
    check(out, "text", megatron_bytes(texts, lambda t: [int(x) for x in t.split(" ")], 89, 90))


def test_empty_documents_are_written_as_megatron_writes_them(corpus, tmp_path, capsys):
    out = tmp_path / "bytes"
    result = preprocess_data.main(["--input", corpus["jsonl"], "--output-prefix", str(out), "--append-eod"])
    texts = ["".join(r["text"]) if isinstance(r["text"], list) else r["text"] for r in corpus["rows"]]
    empty = sum(not t for t in texts)
    assert empty >= 7 and result["empty"] == empty
    assert f"warning: {empty} documents are empty after tokenization" in capsys.readouterr().err
    from megalysses.data.indexed import IndexedDataset
    ds = IndexedDataset(f"{out}_text_document")
    assert ds.num_documents == len(texts) and len(ds) == len(texts) - empty + 1  # + 1: the 2-sentence document
    assert np.all(ds.sequence_lengths > 0) and ds.num_tokens == sum(len(t.encode()) + 1 for t in texts if t)
    assert ds.document_indices[1] == ds.document_indices[0]          # document 0 is empty: no sequence


def gpt2_bpe(vocab_file: str, merge_file: str):
    """GPT-2's byte-level BPE as OpenAI's encoder computes it (Megatron-LM's GPT2BPETokenizer wraps that code), in
    plain Python and independent of the tokenizers library: the text split by GPT-2's pattern, each piece's bytes
    mapped to characters and merged by rank. It knows no special tokens: their spellings are text."""
    import regex

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    byte_char = {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}
    vocab = json.loads(Path(vocab_file).read_text(encoding="utf-8"))
    merges = [tuple(line.split()) for line in Path(merge_file).read_text(encoding="utf-8").split("\n")[1:] if line]
    ranks = {pair: r for r, pair in enumerate(merges)}
    pattern = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

    def bpe(word: tuple) -> tuple:
        while len(word) > 1:
            pair = min(zip(word, word[1:]), key=lambda p: ranks.get(p, math.inf))
            if pair not in ranks:
                break
            merged, i = [], 0
            while i < len(word):
                if word[i:i + 2] == pair:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = tuple(merged)
        return word

    def encode(text: str) -> list[int]:
        return [vocab[t] for piece in pattern.findall(text)
                for t in bpe(tuple(byte_char[b] for b in piece.encode("utf-8")))]
    return encode


def test_special_tokens_spelled_in_text(corpus, tokenizers_dir, tmp_path, capsys):
    """Documents that spell special tokens (a source file holding '<|endoftext|>', a page quoting Llama-3's markup):
    by default their text is text for every tokenizer, and GPT2BPETokenizer writes Megatron-LM's bytes; the summary
    counts them; --parse-special-tokens makes them the tokens, Megatron-LM's HuggingFaceTokenizer's bytes."""
    from transformers import AutoTokenizer

    docs = ['print("<|endoftext|>")  # the end', "plain text", "<|end_of_text|> at the start",
            "x<|endoftext|>y <|begin_of_text|>", "", "no special here: <|endoftext| >", "ends with <|endoftext|>"]
    path = tmp_path / "specials.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    out = tmp_path / "gpt2"
    run_cmd(f"python tools/preprocess_data.py --input {path} --output-prefix {out} --vocab-file "
            f"{tokenizers_dir['vocab']} --merge-file {tokenizers_dir['merges']} --tokenizer-type GPT2BPETokenizer "
            f"--append-eod --workers 2", tmp_path)
    eod = json.loads(Path(tokenizers_dir["vocab"]).read_text())["<|endoftext|>"]
    check(out, "text", megatron_bytes(docs, gpt2_bpe(tokenizers_dir["vocab"], tokenizers_dir["merges"]), eod, 300))
    assert ("3 documents spell a special token of the tokenizer in their text (first: document 1): tokenized as "
            "text") in capsys.readouterr().err
    ref = AutoTokenizer.from_pretrained(tokenizers_dir["llama"])
    for flag, encode in (("", lambda t: ref(t, split_special_tokens=True).input_ids),
                         ("--parse-special-tokens", lambda t: ref(t).input_ids)):
        out = tmp_path / f"hf{flag}"
        result = preprocess_data.main(["--input", str(path), "--output-prefix", str(out), "--tokenizer-type",
                                       "HuggingFaceTokenizer", "--tokenizer-model", tokenizers_dir["llama"],
                                       "--append-eod", *([flag] if flag else [])])
        check(out, "text", megatron_bytes(docs, encode, ref.eos_token_id, len(ref)))
        assert result["special_spelled"] == 2                # the Llama-3 markup: documents 3 and 4
    assert "written as the special tokens (--parse-special-tokens)" in capsys.readouterr().err
    assert encode(docs[2]).count(ref.eos_token_id) == 1      # parsed: Megatron-LM's HuggingFaceTokenizer's EOS
    # sentencepiece: its control pieces spelled in text are text (as sentencepiece encodes them), parsed on request
    from megalysses.data.tokenizer import build_tokenizer
    sp = build_tokenizer("sentencepiece", tokenizers_dir["sp"])
    text = "alpha </s> beta"
    assert sp.spells_special(text) and sp.eod_id not in sp.encode(text)
    assert sp.encode(text, parse_special=True) == sp.encode("alpha ") + [sp.eod_id] + sp.encode(" beta")
