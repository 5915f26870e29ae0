"""Bad corpora and arguments given to tools/preprocess_data.py (megalysses.tools.preprocess_data.main)."""
from __future__ import annotations

import bz2
import gzip
import json
from pathlib import Path
from typing import Callable

from tests.faults.corpus import Case

LINES = [json.dumps({"text": f"document number {i}: some text", "title": f"t{i}"}) for i in range(20)]
GOOD = "\n".join(LINES) + "\n"


def jsonl(data: str | bytes, name: str = "in.jsonl") -> Callable[[Path], str]:
    def build(tmp: Path) -> str:
        path = tmp / name
        path.write_bytes(data.encode() if isinstance(data, str) else data)
        return str(path)
    return build


def gz(data: str, name: str = "in.jsonl.gz", cut: int = 0) -> Callable[[Path], str]:
    def build(tmp: Path) -> str:
        blob = gzip.compress(data.encode())
        (tmp / name).write_bytes(blob[:len(blob) - cut] if cut else blob)
        return str(tmp / name)
    return build


def folder(files: dict[str, bytes]) -> Callable[[Path], str]:
    def build(tmp: Path) -> str:
        root = tmp / "texts"
        root.mkdir()
        for name, data in files.items():
            (root / name).write_bytes(data)
        return str(root)
    return build


def preprocess(source: Callable[[Path], str], *extra: str, output: str = "{tmp}/out/corpus") -> Callable[[Path], int]:
    """A case body: preprocess_data.main on the input built by source(tmp)."""
    def run(tmp: Path) -> int:
        from megalysses.tools.preprocess_data import main
        args = ["--input", source(tmp), "--output-prefix", output.format(tmp=tmp), "--log-interval", "0"]
        args += [a.format(tmp=tmp) for a in extra]
        main(args)
        return 0
    return run


def made(path: str, data: bytes | None) -> Callable[[Path], str]:
    """Write `data` (None: a directory) at tmp/path and return the path; for tokenizer files."""
    def build(tmp: Path) -> str:
        target = tmp / path
        if data is None:
            target.mkdir()
        else:
            target.write_bytes(data)
        return str(target)
    return build


def with_file(path: str, data: bytes | None, *extra: str, source: Callable[[Path], str] = jsonl(GOOD)):
    """preprocess with an extra file (a tokenizer model, ...) made at tmp/path first."""
    def run(tmp: Path) -> int:
        made(path, data)(tmp)
        return preprocess(source, *extra)(tmp)
    return run


def hf_without_eos(tmp: Path) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp / "tokenizer.json"))
    return str(tmp / "tokenizer.json")


def output_parent_is_file(tmp: Path) -> int:
    (tmp / "afile").write_text("x")
    return preprocess(jsonl(GOOD), output="{tmp}/afile/corpus")(tmp)


def output_is_directory(tmp: Path) -> int:
    (tmp / "out").mkdir()
    return preprocess(jsonl(GOOD), output="{tmp}/out")(tmp)


PRETTY_ARRAY = "[\n" + ",\n".join(f"  {line}" for line in LINES) + "\n]\n"
PRETTY_OBJECT = json.dumps({"text": "one document", "id": 1}, indent=2) + "\n"

CASES = [
    # inputs that would give an empty dataset
    Case("preprocess/empty_input", preprocess(jsonl("")), "empty"),
    Case("preprocess/only_blank_lines", preprocess(jsonl("\n\n  \n")), "blank line"),
    Case("preprocess/every_line_bad_json", preprocess(jsonl("{text: 1}\n{'a': 'b'}\nnot json\n")), "bad JSON"),
    Case("preprocess/key_no_line_has", preprocess(jsonl(GOOD), "--json-keys", "content"), "missing key 'content'"),
    Case("preprocess/one_of_two_keys_missing", preprocess(jsonl(GOOD), "--json-keys", "text", "body"),
         "missing key 'body'"),
    Case("preprocess/latin1_text", preprocess(jsonl('{"text": "caf\xe9 cr\xe8me"}\n'.encode("latin-1"))),
         "not UTF-8"),
    Case("preprocess/utf16_text", preprocess(jsonl("\n".join(LINES[:3]).encode("utf-16"))), "UTF-16"),
    Case("preprocess/non_string_values", preprocess(jsonl('{"text": 17}\n{"text": null}\n{"text": {"a": 1}}\n')),
         "non-string"),
    Case("preprocess/list_of_numbers_value", preprocess(jsonl('{"text": [1, 2, 3]}\n')), "non-string"),
    Case("preprocess/every_document_empty", preprocess(jsonl('{"text": ""}\n{"text": ""}\n')),
         "empty after tokenization"),
    Case("preprocess/second_key_always_empty", preprocess(jsonl('{"text": "abc", "title": ""}\n' * 3), "--json-keys",
                                                          "text", "title"), "for 'title'"),
    Case("preprocess/every_document_an_empty_list", preprocess(jsonl('{"text": []}\n{"text": [""]}\n')),
         "empty after tokenization"),
    Case("preprocess/lines_are_json_arrays", preprocess(jsonl('{"text": "a"}\n'.replace("{", "[{").replace("}", "}]")
                                                              * 3)), "JSON array"),
    Case("preprocess/lines_are_json_strings", preprocess(jsonl('"just a string"\n"another"\n')),
         "not a JSON object"),
    Case("preprocess/binary_file_as_jsonl", preprocess(jsonl(bytes(range(256)) * 8)), "skipped"),
    Case("preprocess/empty_folder", preprocess(folder({})), "holds no files"),
    Case("preprocess/folder_of_binary_files", preprocess(folder({"a.bin": b"\xff\xfe\x00\x81" * 10,
                                                                 "b.bin": b"\xc3\x28\xa0\xa1"})), "not UTF-8"),
    Case("preprocess/folder_of_empty_files", preprocess(folder({"a.txt": b"", "b.txt": b""})),
         "empty after tokenization"),
    Case("preprocess/folder_with_two_keys", preprocess(folder({"a.txt": b"x"}), "--json-keys", "text", "title"),
         "single --json-keys"),
    # inputs that would give wrong output
    Case("preprocess/top_level_json_array", preprocess(jsonl("[" + ", ".join(LINES) + "]\n")), "JSON array"),
    Case("preprocess/pretty_printed_json_array", preprocess(jsonl(PRETTY_ARRAY)), "JSON array"),
    Case("preprocess/pretty_printed_json_object", preprocess(jsonl(PRETTY_OBJECT)), "pretty-printed"),
    Case("preprocess/output_prefix_is_directory", output_is_directory, "is a directory"),
    Case("preprocess/output_prefix_trailing_slash", preprocess(jsonl(GOOD), output="{tmp}/new/"), "is a directory"),
    Case("preprocess/output_prefix_empty", preprocess(jsonl(GOOD), output=""), "is a directory"),
    Case("preprocess/output_below_a_file", output_parent_is_file, "is a file"),
    Case("preprocess/workers_zero", preprocess(jsonl(GOOD), "--workers", "0"), "--workers 0"),
    Case("preprocess/workers_negative", preprocess(jsonl(GOOD), "--workers", "-2"), "--workers -2"),
    Case("preprocess/workers_not_a_number", preprocess(jsonl(GOOD), "--workers", "two"), "--workers"),
    Case("preprocess/partitions_zero", preprocess(jsonl(GOOD), "--partitions", "0"), "--partitions 0"),
    Case("preprocess/log_interval_negative", preprocess(jsonl(GOOD), "--log-interval", "-1"), "--log-interval"),
    Case("preprocess/json_keys_without_names", preprocess(jsonl(GOOD), "--json-keys"), "--json-keys"),
    # compressed and missing inputs
    Case("preprocess/truncated_gz", preprocess(gz(GOOD * 40, cut=300)), "truncated"),
    Case("preprocess/fake_gz", preprocess(jsonl(GOOD, "in.jsonl.gz")), "not gzip data"),
    Case("preprocess/gz_of_nothing_useful", preprocess(gz("garbage\n" * 5)), "bad JSON"),
    Case("preprocess/truncated_bz2", preprocess(jsonl(bz2.compress(GOOD.encode() * 40)[:-200], "in.jsonl.bz2")),
         "truncated"),
    Case("preprocess/zstd_garbage", preprocess(jsonl(b"\x28\xb5\x2f\xfd" + b"\x00" * 40, "in.jsonl.zst")),
         "corrupt or truncated zstd"),
    Case("preprocess/input_missing", preprocess(lambda tmp: str(tmp / "nowhere.jsonl")), "no such file"),
    Case("preprocess/glob_matches_nothing", preprocess(lambda tmp: str(tmp / "shard_*.jsonl")), "no file matches"),
    # Megatron-LM flags that cannot be honoured
    Case("preprocess/split_sentences", preprocess(jsonl(GOOD), "--split-sentences"), "--split-sentences"),
    Case("preprocess/find_optimal_num_workers", preprocess(jsonl(GOOD), "--find-optimal-num-workers"),
         "--workers N"),
    Case("preprocess/trust_remote_code", preprocess(jsonl(GOOD), "--trust-remote-code"), "remote"),
    Case("preprocess/hf_no_use_fast", preprocess(jsonl(GOOD), "--tokenizer-hf-no-use-fast"), "fast"),
    Case("preprocess/tokenizer_special_tokens", preprocess(jsonl(GOOD), "--tokenizer-special-tokens", "<x>"),
         "special tokens"),
    Case("preprocess/dataset_impl_lazy", preprocess(jsonl(GOOD), "--dataset-impl", "lazy"), "--dataset-impl"),
    Case("preprocess/vocab_extra_ids", preprocess(jsonl(GOOD), "--vocab-extra-ids", "100"), "--vocab-extra-ids"),
    # tokenizers
    Case("preprocess/unknown_tokenizer_type", preprocess(jsonl(GOOD), "--tokenizer-type", "GPT3Tokenizer"),
         "unknown tokenizer kind"),
    Case("preprocess/tiktokenizer", preprocess(jsonl(GOOD), "--tokenizer-type", "TikTokenizer"), "tiktoken"),
    Case("preprocess/bert_tokenizer", preprocess(jsonl(GOOD), "--tokenizer-type", "BertWordPieceLowerCase"), "BERT"),
    Case("preprocess/sentencepiece_without_model", preprocess(jsonl(GOOD), "--tokenizer-type", "sentencepiece"),
         "needs a model path"),
    Case("preprocess/sentencepiece_model_missing", preprocess(jsonl(GOOD), "--tokenizer-type",
                                                              "SentencePieceTokenizer", "--tokenizer-model",
                                                              "{tmp}/none.model"), "not found"),
    Case("preprocess/sentencepiece_model_garbage", with_file("tok.model", b"\x08\x01garbage" * 5, "--tokenizer-type",
                                                             "Llama2Tokenizer", "--tokenizer-model", "{tmp}/tok.model"),
         "not a sentencepiece model"),
    Case("preprocess/sentencepiece_model_empty", with_file("tok.model", b"", "--tokenizer-type", "sentencepiece",
                                                           "--tokenizer-model", "{tmp}/tok.model"),
         "not a sentencepiece model"),
    Case("preprocess/sentencepiece_model_is_directory", with_file("tok.model", None, "--tokenizer-type",
                                                                  "GPTSentencePieceTokenizer", "--tokenizer-model",
                                                                  "{tmp}/tok.model"), "is a directory"),
    Case("preprocess/hf_hub_name", preprocess(jsonl(GOOD), "--tokenizer-type", "HuggingFaceTokenizer",
                                              "--tokenizer-model", "meta-llama/Meta-Llama-3-8B"), "download"),
    Case("preprocess/hf_tokenizer_garbage", with_file("tokenizer.json", b'{"version": "1.0", "model": 5}',
                                                      "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                                      "{tmp}/tokenizer.json"), "not a hugging face tokenizer.json"),
    Case("preprocess/hf_folder_with_only_tokenizer_model", with_file("tokenizer.model", b"x", "--tokenizer-type",
                                                                     "huggingface", "--tokenizer-model", "{tmp}"),
         "tokenizer.model"),
    Case("preprocess/hf_tokenizer_config_garbage", lambda tmp: (
        made("tokenizer_config.json", b"{not json")(tmp), hf_without_eos(tmp),
        preprocess(jsonl(GOOD), "--tokenizer-type", "huggingface", "--tokenizer-model", "{tmp}")(tmp))[2],
         "tokenizer_config.json"),
    Case("preprocess/hf_without_eos_and_append_eod", lambda tmp: preprocess(
        jsonl(GOOD), "--tokenizer-type", "huggingface", "--tokenizer-model", hf_without_eos(tmp), "--append-eod")(tmp),
         "which token ends a document"),
    Case("preprocess/gpt2bpe_without_merge_file", with_file("vocab.json", b'{"a": 0}', "--tokenizer-type",
                                                            "GPT2BPETokenizer", "--vocab-file", "{tmp}/vocab.json"),
         "--merge-file"),
    Case("preprocess/gpt2bpe_garbage_files", lambda tmp: (
        made("vocab.json", b"[1, 2]")(tmp), made("merges.txt", b"\x00\x01")(tmp),
        preprocess(jsonl(GOOD), "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "{tmp}/vocab.json",
                   "--merge-file", "{tmp}/merges.txt")(tmp))[2], "not a GPT-2 vocab.json"),
    Case("preprocess/null_tokenizer_without_vocab_size", preprocess(jsonl(GOOD), "--tokenizer-type", "NullTokenizer"),
         "--vocab-size"),
    Case("preprocess/null_tokenizer_text_is_not_ids", preprocess(jsonl(GOOD), "--tokenizer-type", "NullTokenizer",
                                                                 "--vocab-size", "100"), "integer token ids"),
    Case("preprocess/null_tokenizer_id_past_vocab", preprocess(jsonl('{"text": "1 2 300"}\n'), "--tokenizer-type",
                                                               "NullTokenizer", "--vocab-size", "100"),
         "outside [0, 100)"),
    Case("preprocess/eod_not_a_token", preprocess(jsonl(GOOD), "--append-eod", "--eod", "<|eot|>"), "no such token"),
    Case("preprocess/eod_id_past_vocab", preprocess(jsonl(GOOD), "--append-eod", "--eod", "4000"), "outside"),
    Case("preprocess/bos_not_a_token", preprocess(jsonl(GOOD), "--bos", "<s>"), "no such token"),
]


# conversations (--chat)
CHATS = "".join(json.dumps(c) + "\n" for c in ({"messages": [{"role": "user", "content": f"question {i}"},
                                                            {"role": "assistant", "content": f"answer {i}"}]}
                                               for i in range(4)))


def chat(template: str | None = "chatml", *extra: str, source: Callable[[Path], str] = jsonl(CHATS)):
    """preprocess --chat with the tests' ChatML tokenizer (its template replaced by `template`, or none)."""
    def run(tmp: Path) -> int:
        import re

        from tests.chat_data import CHATML, make_tokenizer
        plain = re.sub(r"\{%-? *(end)?generation *-?%\}", "", CHATML)
        texts = {"chatml": CHATML, None: None,
                 "rewrites": plain.replace("{%- if message.content %}", "{%- if message.content and loop.last %}"),
                 "one_block": plain.replace("{%- for message in messages %}", "{% generation %}{%- for message in "
                                            "messages %}").replace("{%- endfor %}\n{%- if add", "{%- endfor %}"
                                                                   "{% endgeneration %}\n{%- if add")}
        folder = make_tokenizer(tmp / "tok", texts.get(template, template) or "")
        if template is None:
            config = json.loads((folder / "tokenizer_config.json").read_text())
            del config["chat_template"]
            (folder / "tokenizer_config.json").write_text(json.dumps(config))
        return preprocess(source, "--chat", "--tokenizer-type", "huggingface", "--tokenizer-model", str(folder),
                          *extra)(tmp)
    return run


TWO_TURNS = json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                     {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}) + "\n"


def parquet_of_text(tmp: Path) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": ["a document"]}), tmp / "in.parquet")
    return str(tmp / "in.parquet")


CASES += [
    Case("preprocess/chat_without_a_template", chat(None), "chat template"),
    Case("preprocess/chat_template_that_does_not_compile", chat("chatml", "--chat-template", "{tmp}/bad.jinja",
                                                                source=lambda tmp: (
                                                                    made("bad.jinja", b"{% for %}")(tmp),
                                                                    jsonl(CHATS)(tmp))[1]), "does not compile"),
    Case("preprocess/chat_template_file_missing", chat("chatml", "--chat-template", "{tmp}/none.jinja"),
         "cannot read the chat template"),
    Case("preprocess/chat_template_json_without_one", chat("chatml", "--chat-template", "{tmp}/tokenizer_config.json",
                                                           source=lambda tmp: (
                                                               made("tokenizer_config.json", b'{"bos_token": "<s>"}')(
                                                                   tmp), jsonl(CHATS)(tmp))[1]),
         "JSON without a 'chat_template' field"),
    Case("preprocess/chat_template_json_file_not_json", chat("chatml", "--chat-template", "{tmp}/template.json",
                                                             source=lambda tmp: (
                                                                 made("template.json", b'{"chat_template": ')(tmp),
                                                                 jsonl(CHATS)(tmp))[1]), "not JSON"),
    Case("preprocess/chat_template_rewrites_earlier_turns", chat("rewrites", source=jsonl(TWO_TURNS)),
         "rewrites earlier turns"),
    Case("preprocess/chat_generation_blocks_not_one_per_turn", chat("one_block", source=jsonl(TWO_TURNS)),
         "not one per assistant turn"),
    Case("preprocess/chat_every_record_bad", chat("chatml", source=jsonl('{"messages": []}\n{"text": "x"}\n')),
         "skipped"),
    Case("preprocess/chat_with_append_eod", chat("chatml", "--append-eod"), "--append-eod does not apply"),
    Case("preprocess/chat_with_json_keys", chat("chatml", "--json-keys", "messages"), "--json-keys does not apply"),
    Case("preprocess/chat_option_without_chat", preprocess(jsonl(GOOD), "--chat-train-on", "last"),
         "only applies with --chat"),
    Case("preprocess/chat_messages_with_byte_tokenizer", preprocess(jsonl(CHATS), "--chat"),
         "need a hugging face tokenizer"),
    Case("preprocess/chat_folder_of_text_files", preprocess(folder({"a.txt": b"x"}), "--chat"),
         "--chat reads conversations"),
    Case("preprocess/chat_parquet_without_conversations", preprocess(parquet_of_text, "--chat"),
         "no 'messages' column"),
]
