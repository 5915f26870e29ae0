"""Bad datasets given to pretrain (in-process, a world of one): corrupt .idx/.bin pairs, token ids the
model cannot embed, wrong dtypes, splits, blends and the tokenizers of data.tokenizer."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Callable

import numpy as np

from tests.faults.corpus import Case

TINY = ["data.mock=false", "data.seq_len=32", "model.vocab_size=512", "model.hidden_size=32", "model.num_layers=1",
        "model.num_heads=4", "training.global_batch_size=2", "training.micro_batch_size=1", "training.train_steps=1",
        "parallel.timeout_seconds=30", "checkpoint.load=none", "data.split=100,0,0"]
# 3 sequences in 2 documents: the .idx header is 34 bytes, lengths at 34, pointers at 46, documents at 70
HEADER, LENGTHS, POINTERS, DOCS = 34, 34, 46, 70


def write(prefix: Path, documents: list[list[int]], dtype: type = np.uint16) -> str:
    """A dataset of one-sequence documents (token lists), written as preprocessing writes it."""
    from megalysses.data.indexed import IndexedDatasetBuilder
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype)
    for doc in documents:
        builder.add_document(np.asarray(doc))
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def good(tmp: Path, name: str = "ds", top: int = 300) -> str:
    """40 documents of 20 tokens with ids below `top` (under the byte tokenizer's 259 by default)."""
    rng = np.random.default_rng(0)
    return write(tmp / name, [list(rng.integers(0, min(top, 257), size=19)) + [257] for _ in range(40)])


def three(tmp: Path) -> str:
    """The 3-sequence, 2-document pair whose byte offsets are given above (sequences of 30, 20, 10)."""
    from megalysses.data.indexed import IndexedDatasetBuilder
    builder = IndexedDatasetBuilder(tmp / "ds.bin", np.uint16)
    builder.add_document(np.arange(60) % 250, lengths=[30, 20])
    builder.add_document(np.arange(10))
    builder.finalize(tmp / "ds.idx")
    return str(tmp / "ds")


def patched(offset: int, data: bytes, ext: str = "idx") -> Callable[[Path], str]:
    def build(tmp: Path) -> str:
        prefix = three(tmp)
        with open(f"{prefix}.{ext}", "r+b") as f:
            f.seek(offset)
            f.write(data)
        return prefix
    return build


def resized(ext: str, size: int | None = None, extra: bytes = b"") -> Callable[[Path], str]:
    def build(tmp: Path) -> str:
        prefix = three(tmp)
        with open(f"{prefix}.{ext}", "r+b") as f:
            if size is not None:
                f.truncate(size)
            f.seek(0, os.SEEK_END)
            f.write(extra)
        return prefix
    return build


def pretrain_on(build: Callable[[Path], str], *overrides: str) -> Callable[[Path], int]:
    """A case body: pretrain.main on the tiny model with data.paths = build(tmp) (a prefix or a blend list)."""
    def run(tmp: Path) -> int:
        from megalysses.tools.pretrain import main
        sets = TINY + [f"logging.run_dir={tmp}/run", f"data.paths={build(tmp)}"] + list(overrides)
        return main([a for o in sets for a in ("--set", o)])
    return run


def with_ids(ids: list[int], dtype: type = np.uint16) -> Callable[[Path], str]:
    """A good dataset with `ids` placed in its 7th document."""
    def build(tmp: Path) -> str:
        rng = np.random.default_rng(1)
        docs = [list(rng.integers(0, 250, size=20)) for _ in range(40)]
        docs[6][3:3 + len(ids)] = ids
        return write(tmp / "ds", docs, dtype)
    return build


def sp_model(tmp: Path) -> str:
    """A small sentencepiece model of 300 pieces."""
    from megalysses.tools.train_tokenizer import TrainerOptions, train
    corpus = tmp / "corpus.jsonl"
    words = ["alpha", "beta", "gamma", "delta", "token", "stream", "model", "data"]
    corpus.write_text("".join(json.dumps({"text": " ".join(words[(i + k) % 8] for k in range(12)) + f" {i}"}) + "\n"
                              for i in range(60)))
    return train([str(corpus)], str(tmp / "sp"), 300, options=TrainerOptions(byte_fallback=True, num_threads=1))


def blend(*items: str) -> Callable[[Path], str]:
    """A blend list; "{good}" and "{empty}" become datasets built in tmp."""
    def build(tmp: Path) -> str:
        paths = {"{good}": good(tmp, "a"), "{other}": good(tmp, "b"), "{empty}": write(tmp / "e", []),
                 "{missing}": str(tmp / "nowhere")}
        return "[" + ", ".join(paths.get(i, i) for i in items) + "]"
    return build


def tokenizer_file(content: bytes | None, name: str = "tok.model") -> Callable[[Path], str]:
    def build(tmp: Path) -> str:
        path = tmp / name
        if content is None:
            path.mkdir()
        else:
            path.write_bytes(content)
        return str(path)
    return build


def with_tokenizer(kind: str, model: Callable[[Path], str], *overrides: str) -> Callable[[Path], int]:
    def run(tmp: Path) -> int:
        return pretrain_on(good, f"data.tokenizer={kind}", f"data.tokenizer_model={model(tmp)}", *overrides)(tmp)
    return run


def hf_folder(tmp: Path) -> str:
    """A folder with tokenizer_config.json but no tokenizer.json."""
    folder = tmp / "hf"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return str(folder)


def sp_small_model(tmp: Path) -> int:
    return pretrain_on(good, "data.tokenizer=sentencepiece", f"data.tokenizer_model={sp_model(tmp)}",
                       "model.vocab_size=256")(tmp)


def dtype_code(code: int) -> Callable[[Path], str]:
    """A dataset whose .idx declares the given dtype code over a .bin of matching size."""
    def build(tmp: Path) -> str:
        from megalysses.data.indexed import DTYPE_CODES
        return write(tmp / "ds", [[1.0, 2.0, 257.0] * 7 for _ in range(30)], DTYPE_CODES[code])
    return build


CASES = [
    # token ids the model cannot embed
    Case("data/token_id_past_model_vocab", pretrain_on(with_ids([2047]), "model.vocab_size=512",
                                                       "data.tokenizer=NullTokenizer"), "outside the vocabulary"),
    Case("data/token_id_equal_to_vocab_size", pretrain_on(with_ids([512]), "data.tokenizer=NullTokenizer"),
         "outside the vocabulary"),
    Case("data/token_ids_of_a_larger_tokenizer", pretrain_on(with_ids([300, 301])), "not made with this tokenizer"),
    Case("data/negative_token_ids", pretrain_on(with_ids([-5], np.int32), "data.tokenizer=NullTokenizer"),
         "negative token id"),
    Case("data/negative_token_ids_int16", pretrain_on(with_ids([-1], np.int16), "data.tokenizer=NullTokenizer"),
         "negative token id"),
    Case("data/uint8_token_ids_past_vocab", pretrain_on(with_ids([100], np.uint8), "data.tokenizer=NullTokenizer",
                                                        "model.vocab_size=64"), "outside the vocabulary"),
    Case("data/uint8_data_for_a_larger_tokenizer", pretrain_on(with_ids([1], np.uint8)), "another tokenizer"),
    Case("data/float64_token_ids", pretrain_on(dtype_code(6)), "float64"),
    Case("data/float32_token_ids", pretrain_on(dtype_code(7)), "float32"),
    Case("data/tokenizer_larger_than_model", sp_small_model, "raise model.vocab_size"),
    # the .idx / .bin pair
    Case("data/negative_sequence_length", pretrain_on(patched(LENGTHS + 4, struct.pack("<i", -20))),
         "negative length"),
    Case("data/pointer_past_end_of_bin", pretrain_on(patched(POINTERS + 16, struct.pack("<q", 10**9))),
         "points at byte"),
    Case("data/pointer_misaligned", pretrain_on(patched(POINTERS + 8, struct.pack("<q", 61))), "points at byte"),
    Case("data/pointers_all_zero", pretrain_on(patched(POINTERS + 8, bytes(16))), "points at byte"),
    Case("data/document_index_backwards", pretrain_on(patched(DOCS + 8, struct.pack("<q", 4))),
         "corrupt document index"),
    Case("data/document_index_not_from_zero", pretrain_on(patched(DOCS, struct.pack("<q", 1))),
         "corrupt document index"),
    Case("data/document_index_past_sequences", pretrain_on(patched(DOCS + 16, struct.pack("<q", 9))),
         "corrupt document index"),
    Case("data/bad_magic", pretrain_on(patched(0, b"NOTANIDX\x00")), "bad magic"),
    Case("data/idx_of_zeros", pretrain_on(patched(0, bytes(94))), "bad magic"),
    Case("data/bad_version", pretrain_on(patched(9, struct.pack("<Q", 2))), "unsupported index version"),
    Case("data/unknown_dtype_code", pretrain_on(patched(17, bytes([9]))), "unknown dtype code"),
    Case("data/sequence_count_too_large", pretrain_on(patched(18, struct.pack("<Q", 1000))), "truncated index"),
    Case("data/truncated_idx_header", pretrain_on(resized("idx", 20)), "truncated index"),
    Case("data/truncated_idx_arrays", pretrain_on(resized("idx", 80)), "truncated index"),
    Case("data/empty_idx", pretrain_on(resized("idx", 0)), "truncated index"),
    Case("data/idx_extra_bytes", pretrain_on(resized("idx", extra=b"\x00" * 7)), "header does not match"),
    Case("data/truncated_bin", pretrain_on(resized("bin", 100)), "truncated .bin"),
    Case("data/empty_bin", pretrain_on(resized("bin", 0)), "truncated .bin"),
    Case("data/bin_longer_than_idx", pretrain_on(resized("bin", extra=b"\x00\x00")), "belongs to another"),
    Case("data/missing_idx", pretrain_on(lambda tmp: (os.remove(f"{three(tmp)}.idx"), str(tmp / "ds"))[1]),
         "file not found"),
    Case("data/missing_bin", pretrain_on(lambda tmp: (os.remove(f"{three(tmp)}.bin"), str(tmp / "ds"))[1]),
         "file not found"),
    Case("data/prefix_given_with_bin_suffix", pretrain_on(lambda tmp: three(tmp) + ".bin"), "without .bin"),
    Case("data/prefix_given_with_idx_suffix", pretrain_on(lambda tmp: three(tmp) + ".idx"), "without .bin"),
    Case("data/prefix_is_a_directory", pretrain_on(lambda tmp: str(tmp)), "file not found"),
    Case("data/idx_is_a_directory",
         pretrain_on(lambda tmp: (os.mkdir(tmp / "d.idx"), write(tmp / "x", [[1]]),
                                  os.rename(tmp / "x.bin", tmp / "d.bin"), str(tmp / "d"))[3]),
         "file not found"),
    # empty and too small
    Case("data/empty_dataset", pretrain_on(lambda tmp: write(tmp / "ds", [])), "empty"),
    Case("data/only_empty_documents", pretrain_on(lambda tmp: write(tmp / "ds", [[], [], []])), "empty"),
    Case("data/too_few_tokens_for_one_sample", pretrain_on(lambda tmp: write(tmp / "ds", [[1, 2, 3], [4]])),
         "cannot fill one sample"),
    Case("data/no_validation_data_for_eval", pretrain_on(good, "training.eval_interval=1"),
         "no validation data"),
    # splits
    Case("data/split_negative_ratio", pretrain_on(good, "data.split=-1,2,0"), "negative"),
    Case("data/split_no_train_share", pretrain_on(good, "data.split=0,100,0"), "no sequences"),
    Case("data/split_all_zero", pretrain_on(good, "data.split=0,0,0"), "sum to 0"),
    Case("data/split_four_ratios", pretrain_on(good, "data.split=1,1,1,1"), "4 ratios"),
    Case("data/split_not_numbers", pretrain_on(good, "data.split=train,valid"), "not a number"),
    Case("data/split_nan", pretrain_on(good, "data.split=nan,1,1"), "not finite"),
    Case("data/split_inf", pretrain_on(good, "data.split=inf,1,1"), "not finite"),
    Case("data/split_empty", pretrain_on(good, "data.split="), "ratios"),
    Case("data/split_train_rounds_to_zero", pretrain_on(lambda tmp: write(tmp / "ds", [[1] * 40, [2] * 40]),
                                                        "data.split=1,99,0"), "no sequences"),
    # blends
    Case("data/blend_weight_nan", pretrain_on(blend("nan", "{good}", "1", "{other}")), "not a finite"),
    Case("data/blend_weight_inf", pretrain_on(blend("inf", "{good}", "1", "{other}")), "not a finite"),
    Case("data/blend_weight_negative", pretrain_on(blend("-0.5", "{good}", "1", "{other}")), "not a finite"),
    Case("data/blend_weights_all_zero", pretrain_on(blend("0", "{good}", "0", "{other}")), "sum to 0"),
    Case("data/blend_weight_without_path", pretrain_on(blend("0.5", "{good}", "0.5")), "pairs"),
    Case("data/blend_mixes_weights_and_paths", pretrain_on(blend("{good}", "0.5", "{other}")), "mixes"),
    Case("data/blend_member_missing", pretrain_on(blend("0.5", "{good}", "0.5", "{missing}")), "file not found"),
    Case("data/blend_member_empty", pretrain_on(blend("0.5", "{good}", "0.5", "{empty}")), "empty"),
    Case("data/no_paths", pretrain_on(lambda tmp: "[]"), "data.paths"),
    # data.tokenizer
    Case("data/tokenizer_unknown_kind", pretrain_on(good, "data.tokenizer=gpt3"), "unknown tokenizer kind"),
    Case("data/tokenizer_tiktoken", pretrain_on(good, "data.tokenizer=TikTokenizer"), "tiktoken"),
    Case("data/tokenizer_bert", pretrain_on(good, "data.tokenizer=BertWordPieceCase"), "bert"),
    Case("data/sentencepiece_without_model", pretrain_on(good, "data.tokenizer=sentencepiece"), "tokenizer_model"),
    Case("data/gpt2bpe_without_files", pretrain_on(good, "data.tokenizer=GPT2BPETokenizer"), "vocab_file"),
    Case("data/sentencepiece_model_missing", with_tokenizer("sentencepiece", lambda tmp: str(tmp / "none.model")),
         "not found"),
    Case("data/sentencepiece_model_garbage", with_tokenizer("sentencepiece", tokenizer_file(b"garbage" * 9)),
         "not a sentencepiece model"),
    Case("data/sentencepiece_model_empty", with_tokenizer("sentencepiece", tokenizer_file(b"")),
         "not a sentencepiece model"),
    Case("data/sentencepiece_model_is_directory", with_tokenizer("sentencepiece", tokenizer_file(None)),
         "is a directory"),
    Case("data/hf_tokenizer_missing", with_tokenizer("huggingface", lambda tmp: str(tmp / "tokenizer.json")),
         "not found"),
    Case("data/hf_tokenizer_garbage", with_tokenizer("HuggingFaceTokenizer", tokenizer_file(b"{garbage",
                                                                                             "tokenizer.json")),
         "not a hugging face tokenizer.json"),
    Case("data/hf_folder_without_tokenizer_json", with_tokenizer("huggingface", hf_folder), "no tokenizer.json"),
    Case("data/eod_token_not_in_vocabulary", pretrain_on(good, "data.eod=<|nope|>"), "no such token"),
    Case("data/eod_id_outside_vocabulary", pretrain_on(good, "data.eod=100000"), "outside the tokenizer's"),
]


# conversations: a dataset with a loss mask beside it
def chats(tmp: Path, longest: int = 40, shortest: int = 3) -> str:
    from tests.chat_data import write_conversations
    return write_conversations(tmp / "chat_text_document", count=40, longest=longest, shortest=shortest)


def chats_mask_replaced(build: Callable[[Path, str], None]) -> Callable[[Path], str]:
    """Conversations whose loss mask `build(tmp, mask_prefix)` writes instead."""
    def make(tmp: Path) -> str:
        from megalysses.data.indexed import loss_mask_prefix
        prefix = chats(tmp)
        for ext in ("bin", "idx"):
            os.remove(f"{loss_mask_prefix(prefix)}.{ext}")
        build(tmp, loss_mask_prefix(prefix))
        return prefix
    return make


def _other_lengths(tmp: Path, mask: str) -> None:
    write(Path(mask), [[1] * 5 for _ in range(40)], np.uint8)


def _not_uint8(tmp: Path, mask: str) -> None:
    from megalysses.data.indexed import IndexedDataset
    ds = IndexedDataset(str(tmp / "chat_text_document"))
    write(Path(mask), [[1] * len(ds[i]) for i in range(len(ds))], np.uint16)


def _mask_where(keep: Callable[[np.ndarray], np.ndarray]) -> Callable[[Path, str], None]:
    """The conversations' loss mask, 1 where keep(positions) and the answers are (all answers: keep True)."""
    def build(tmp: Path, mask: str) -> None:
        from megalysses.data.indexed import IndexedDataset
        ds = IndexedDataset(str(tmp / "chat_text_document"))
        answers = [np.asarray(ds[i]) % 2 for i in range(len(ds))]        # stands for the answers' tokens
        write(Path(mask), [(a * keep(np.arange(len(a)))).tolist() for a in answers], np.uint8)
    return build


def _index_alone(tmp: Path, mask: str) -> None:
    _not_uint8(tmp, mask)
    os.remove(f"{mask}.bin")


CASES += [
    Case("data/loss_mask_of_another_dataset", pretrain_on(chats_mask_replaced(_other_lengths)), "does not match"),
    Case("data/loss_mask_not_bytes", pretrain_on(chats_mask_replaced(_not_uint8)), "holds uint8"),
    Case("data/loss_mask_without_its_bin", pretrain_on(chats_mask_replaced(_index_alone)), "file not found"),
    Case("data/conversations_too_long_refused", pretrain_on(chats, "data.too_long=error"), "longer than the sequences"),
    Case("data/conversations_packed_without_document_mask", pretrain_on(chats, "data.document_mask=false"),
         "data.document_mask"),
    Case("data/conversations_loss_mask_all_zeros", pretrain_on(chats_mask_replaced(_mask_where(
        lambda at: np.zeros(len(at), bool))), "data.seq_len=64"), "no token of its conversations carries"),
    Case("data/conversations_every_answer_truncated_away", pretrain_on(
        lambda tmp: chats_mask_replaced(_mask_where(lambda at: at >= 33))(tmp), "data.too_long=truncate"),
         "carries the loss in the first 32 tokens"),
    Case("data/conversations_answers_only_in_the_first_token", pretrain_on(chats_mask_replaced(_mask_where(
        lambda at: at == 0)), "data.seq_len=64"), "no token of its conversations carries"),
    Case("data/conversations_all_longer_than_the_sequence", pretrain_on(lambda tmp: chats(tmp, 60, shortest=33)),
         "fill no sample"),
]
