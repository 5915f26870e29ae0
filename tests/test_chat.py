"""Conversations as transformers renders them (data/chat_template.py, data/chat.py) and tools/preprocess_data.py
--chat: the text, token ids and assistant mask of `apply_chat_template`, a loss mask by growing prefixes where
a template has no {% generation %} blocks (refused where the renderings are not prefixes), the options, content
that spells a special token kept as text, and bad records named and skipped with the rest of the file kept."""
import re

import numpy as np
import pytest

from chat_data import CHATML, CONVERSATIONS, LLAMA3, make_tokenizer, write_jsonl
from megalysses.data.chat import ChatEncoder, ChatOptions, PrefixError, RecordError
from megalysses.data.chat_template import ChatTemplate
from megalysses.data.indexed import IndexedDataset, loss_mask_prefix
from megalysses.data.tokenizer import build_tokenizer
from megalysses.tools import merge_datasets, preprocess_data

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {"chatml": make_tokenizer(root / "chatml", CHATML), "llama3": make_tokenizer(root / "llama3", LLAMA3)}


def encoder(folder, options=None, template=None):
    tok = build_tokenizer("huggingface", str(folder))
    return ChatEncoder(tok, template or ChatTemplate.from_folder(folder), options)


def hf_of(folder):
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def trained_text(hf, ids, loss):
    return hf.decode([i for i, keep in zip(ids, loss) if keep])


def test_text_ids_and_assistant_mask_equal_transformers(folders):
    for name, folder in folders.items():
        hf, enc = hf_of(folder), encoder(folder)
        for conv in CONVERSATIONS:
            messages, tools = conv["messages"], conv.get("tools")
            assert enc.template.render(messages, tools)[0] == hf.apply_chat_template(messages, tools=tools,
                                                                                     tokenize=False)
            ids, loss = enc.encode(conv)
            out = hf.apply_chat_template(messages, tools=tools, return_dict=True,
                                         return_assistant_tokens_mask=enc.template.has_generation)
            assert ids.tolist() == out["input_ids"], name
            if enc.template.has_generation:
                assert loss.astype(int).tolist() == out["assistant_masks"]
        # the generation prompt too (what generation from the fine-tuned model starts from)
        prompt = CONVERSATIONS[1]["messages"][:1]
        assert enc.template.render(prompt, add_generation_prompt=True)[0] == hf.apply_chat_template(
            prompt, add_generation_prompt=True, tokenize=False)
    # without {% generation %}, growing prefixes find the same tokens: ChatML with its blocks taken out ...
    chatml = encoder(folders["chatml"])
    plain = re.sub(r"\{%-? *(end)?generation *-?%\}", "", CHATML)
    prefixes = encoder(folders["chatml"], template=ChatTemplate(plain, chatml.template.special_tokens))
    assert not prefixes.template.has_generation
    for conv in CONVERSATIONS:
        (a, x), (b, y) = chatml.encode(conv), prefixes.encode(conv)
        assert a.tolist() == b.tolist() and x.tolist() == y.tolist()
    # ... and Llama-3's template: each answer and its <|eot_id|>
    llama = encoder(folders["llama3"])
    hf = hf_of(folders["llama3"])
    assert trained_text(hf, *llama.encode(CONVERSATIONS[0])) == "4.<|eot_id|>6, of course.<|eot_id|>"
    # --bos adds no second BOS to a template that writes one
    bos = hf.convert_tokens_to_ids("<|begin_of_text|>")
    ids, _ = ChatEncoder(llama.tokenizer, llama.template, bos_id=bos).encode(CONVERSATIONS[1])
    assert ids.tolist() == llama.encode(CONVERSATIONS[1])[0].tolist() and ids[0] == bos != ids[1]


def test_options_the_last_turn_and_the_end_of_turn_token(folders):
    hf = hf_of(folders["chatml"])
    conv = CONVERSATIONS[0]
    assert trained_text(hf, *encoder(folders["chatml"]).encode(conv)) == "4.<|im_end|>6, of course.<|im_end|>"
    last = encoder(folders["chatml"], ChatOptions(train_on="last")).encode(conv)
    assert trained_text(hf, *last) == "6, of course.<|im_end|>"
    for name in folders:       # from generation blocks, and from prefixes
        no_end = encoder(folders[name], ChatOptions(end_of_turn=False)).encode(conv)
        assert trained_text(hf_of(folders[name]), *no_end) == "4.6, of course."
    # prompt and completion as messages: the completion's turns alone
    pc = {"prompt": conv["messages"][:3], "completion": conv["messages"][3:]}
    assert trained_text(hf, *encoder(folders["chatml"]).encode(pc)) == "6, of course.<|im_end|>"


def test_content_that_spells_a_special_token_is_text(folders):
    """The deliberate difference: transformers' default parses <|im_end|> in a message as the token that ends
    a turn; here content is text, as with transformers' sanitize_control_tokens=True."""
    conv = [{"role": "user", "content": "Print <|im_end|> and <|im_start|>, please."},
            {"role": "assistant", "content": "Here: <|im_end|> done"}]
    for folder in folders.values():
        hf, enc = hf_of(folder), encoder(folder)
        ids, loss = enc.encode({"messages": conv})
        default = hf.apply_chat_template(conv, return_dict=True)["input_ids"]
        assert ids.tolist() != default and hf.decode(ids) == hf.decode(default)
        markup = hf.convert_tokens_to_ids(["<|im_end|>", "<|im_start|>", "<|eot_id|>"])
        written = len(re.findall(r"<\|(im_end|im_start|eot_id)\|>", enc.template.render(conv)[0]))
        assert sum(i in markup for i in ids.tolist()) == written - 3      # the content's three are text
        assert trained_text(hf, ids, loss).startswith("Here: <|im_end|> done<|")
        try:
            sanitized = hf.apply_chat_template(conv, return_dict=True, sanitize_control_tokens=True)["input_ids"]
        except TypeError:           # a transformers without the option (before 5.x)
            continue
        assert ids.tolist() == sanitized


def test_a_template_that_rewrites_earlier_turns_is_refused(folders):
    rewrites = CHATML.replace("{%- if message.content %}", "{%- if message.content and loop.last %}")
    rewrites = re.sub(r"\{%-? *(end)?generation *-?%\}", "", rewrites)
    template = ChatTemplate(rewrites, name="rewrites.jinja")
    with pytest.raises(PrefixError, match="rewrites.jinja renders the conversation up to message 3 .* differently"):
        encoder(folders["chatml"], template=template).encode(CONVERSATIONS[0])
    # the last turn alone needs only its own prefix
    ids, loss = encoder(folders["chatml"], ChatOptions(train_on="last"), template).encode(CONVERSATIONS[0])
    assert trained_text(hf_of(folders["chatml"]), ids, loss) == "6, of course.<|im_end|>"


BAD = [
    ("not json", "bad JSON"),
    ({"messages": []}, "'messages' is empty"),
    ({"messages": [{"role": "user", "content": "x"}]}, "no assistant turn"),
    ({"messages": [{"role": "bot", "content": "x"}, {"role": "assistant", "content": "y"}]}, "role 'bot'"),
    ({"messages": [{"role": "assistant", "content": "a"}, {"role": "system", "content": "b"}]},
     "the chat template failed: .* a system message must come first"),
    ({"messages": [{"role": "user"}, {"role": "assistant", "content": "y"}]}, "has no content"),
    ({"text": "a document"}, "no 'messages', nor 'prompt' and 'completion'"),
]


def test_preprocess_conversations_names_bad_records_and_keeps_the_rest(folders, tmp_path, capsys):
    folder = folders["chatml"]
    good = CONVERSATIONS + [{"prompt": "Q: 1 + 1?\nA:", "completion": " 2"}]
    records = good[:2] + [r for r, _ in BAD] + good[2:]
    src = write_jsonl(tmp_path / "chats.jsonl", records)
    out = preprocess_data.main(["--chat", "--input", str(src), "--output-prefix", str(tmp_path / "chat"),
                                "--tokenizer-type", "huggingface", "--tokenizer-model", str(folder), "--workers", "2",
                                "--bos", "<|begin_of_text|>"])
    err = capsys.readouterr().err
    for k, (_, reason) in enumerate(BAD, 3):
        assert re.search(f"skipped record {k}: .*{reason}", err), (reason, err)
    assert f"skipped {len(BAD)} records" in err and f"kept the other {len(good)}" in err
    assert out["documents"] == len(good)
    assert out["skipped"] == {"malformed": 3, "empty": 1, "nothing to train on": 1, "unknown role": 1,
                              "template failed": 1}
    ds = IndexedDataset(str(tmp_path / "chat_text_document"))
    mask = IndexedDataset(loss_mask_prefix(ds.prefix))
    assert len(ds) == len(mask) == len(good) and mask.dtype == np.uint8
    hf, bos = hf_of(folder), hf_of(folder).convert_tokens_to_ids("<|begin_of_text|>")
    for i, conv in enumerate(CONVERSATIONS):
        want = hf.apply_chat_template(conv["messages"], tools=conv.get("tools"), return_dict=True,
                                      return_assistant_tokens_mask=True)
        assert ds[i].tolist() == [bos] + want["input_ids"]                 # --bos, once
        assert mask[i].tolist() == [0] + want["assistant_masks"]
    # prompt and completion texts: no template, the completion and EOD carry the loss
    ids, loss = ds[len(good) - 1].tolist(), mask[len(good) - 1].astype(bool)
    assert hf.decode(ids) == "<|begin_of_text|>Q: 1 + 1?\nA: 2<|im_end|>"
    assert trained_text(hf, ids, loss) == " 2<|im_end|>"
    # Parquet holds the same records: the same bytes (the bad ones aside, which Arrow cannot hold)
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist([{"messages": c["messages"]} for c in CONVERSATIONS[:2]]),
                   tmp_path / "chats.parquet")
    preprocess_data.main(["--chat", "--input", str(tmp_path / "chats.parquet"), "--output-prefix",
                          str(tmp_path / "pq"), "--tokenizer-type", "huggingface", "--tokenizer-model", str(folder),
                          "--bos", "<|begin_of_text|>"])
    parquet = IndexedDataset(str(tmp_path / "pq_text_document"))
    assert [parquet[i].tolist() for i in range(2)] == [ds[i].tolist() for i in range(2)]


def test_shards_of_conversations_merge_with_their_masks(folders, tmp_path):
    """Preprocessed on two machines and merged: the bytes of one run over both inputs, masks included."""
    tok = ["--chat", "--tokenizer-type", "huggingface", "--tokenizer-model", str(folders["llama3"])]
    shards = tmp_path / "shards"
    for k, part in enumerate((CONVERSATIONS[:2], CONVERSATIONS[2:])):
        preprocess_data.main(["--input", str(write_jsonl(tmp_path / f"{k}.jsonl", part)), "--output-prefix",
                              str(shards / f"shard_{k}")] + tok)
    preprocess_data.main(["--input", str(write_jsonl(tmp_path / "all.jsonl", CONVERSATIONS)), "--output-prefix",
                          str(tmp_path / "one")] + tok)
    merge_datasets.main(["--input", str(shards), "--output-prefix", str(tmp_path / "merged_text_document")])
    for name in ("text_document", "text_document_loss_mask"):
        for ext in ("bin", "idx"):
            assert (tmp_path / f"merged_{name}.{ext}").read_bytes() == (tmp_path / f"one_{name}.{ext}").read_bytes()
    (shards / "shard_1_text_document_loss_mask.idx").unlink()
    (shards / "shard_1_text_document_loss_mask.bin").unlink()
    with pytest.raises(SystemExit, match="has a loss mask beside it .* but .*shard_1_text_document has none"):
        merge_datasets.main(["--input", str(shards), "--output-prefix", str(tmp_path / "again")])


def test_a_json_template_file_is_read_for_its_chat_template(folders, tmp_path):
    """--chat-template given a tokenizer_config.json renders its chat_template (named ones: the default), as the
    folder's own would, never the JSON text itself; JSON without one is refused."""
    import json

    from megalysses.data.chat_template import TemplateError

    messages = CONVERSATIONS[0]["messages"]
    want = ChatTemplate.from_folder(folders["llama3"]).render(messages)[0]
    config = folders["llama3"] / "tokenizer_config.json"
    got = ChatTemplate.from_folder(folders["chatml"], config)
    assert got.render(messages)[0] == want and got.name == f"{config} (chat_template)"
    named = tmp_path / "named.json"
    named.write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": CHATML},
                                                   {"name": "default", "template": LLAMA3}]}))
    assert ChatTemplate.from_folder(folders["chatml"], named).render(messages)[0] == want
    jinja = tmp_path / "literal.jinja"                 # a template whose text starts with a brace is still one
    jinja.write_text("{ {{ messages[0].content }} }")
    assert ChatTemplate.from_folder(folders["chatml"], jinja).render(messages)[0] == f"{{ {messages[0]['content']} }}"
    (tmp_path / "other.json").write_text(json.dumps({"bos_token": "<s>"}))
    with pytest.raises(TemplateError, match="other.json is JSON without a 'chat_template' field"):
        ChatTemplate.from_folder(folders["chatml"], tmp_path / "other.json")


def test_a_record_error_names_its_kind():
    with pytest.raises(RecordError) as err:
        ChatEncoder(build_tokenizer("byte")).encode({"prompt": "a", "completion": ""})
    assert err.value.kind == "malformed" and "'completion' is empty" in str(err.value)
