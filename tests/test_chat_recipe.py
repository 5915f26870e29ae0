"""The README's fine-tuning recipe end to end at a tiny size, on CPU: a Hugging Face Llama (random weights) with
a ChatML tokenizer and chat template, conversations preprocessed with --chat, converted with
configs/llama3_8b_chat_128k.yaml, trained packed with its curriculum, exported back with --to-hf and loaded by
transformers with its chat template and generation config. The first step's loss, on all the conversations
packed two sequences to a sample, is transformers' loss on them one by one with -100 outside the assistant
mask (summed, then divided by the same token count)."""
import json
from pathlib import Path

import pytest
import torch

from chat_data import CHATML, CONVERSATIONS, make_tokenizer, write_jsonl
from megalysses.data.indexed import IndexedDataset, loss_mask_prefix
from megalysses.tools import convert_checkpoint, preprocess_data, pretrain
from tests.fixtures import step_rows

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parent.parent
TINY = ["parallel.sp=1", "parallel.timeout_seconds=60", "data.seq_len=512",
        "data.seq_len_schedule=[[0, 256], [1, 512]]", "training.global_batch_size=1", "training.train_steps=2",
        "training.dtype=float32", "logging.log_interval=1", "optimizer.warmup_steps=1", "optimizer.lr=1e-3",
        "model.attention_backend=sdpa"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama saved as transformers saves one, its tokenizer and chat template (chat_template.jinja) beside."""
    folder = make_tokenizer(tmp_path_factory.mktemp("hf") / "tiny-chat", CHATML)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "chat_template.jinja").write_text(config.pop("chat_template"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    end = transformers.AutoTokenizer.from_pretrained(str(folder)).convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                   eos_token_id=end, bos_token_id=None, pad_token_id=0)
    model = transformers.LlamaForCausalLM(cfg)
    model.generation_config.eos_token_id = end
    model.save_pretrained(folder)
    return folder


def hf_loss(model, tokenizer, conversations) -> float:
    """Each conversation alone: the summed loss of its assistant tokens, over all of them, divided by their count."""
    total, count = 0.0, 0
    for conv in conversations:
        out = tokenizer.apply_chat_template(conv["messages"], tools=conv.get("tools"), return_dict=True,
                                            return_assistant_tokens_mask=True, return_tensors="pt")
        ids, mask = out["input_ids"], out["assistant_masks"]
        labels = torch.where(mask.bool(), ids, -100)[:, 1:]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, :-1].float()
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum").item()
        count += int((labels != -100).sum())
    return total / count


def test_the_recipe_from_a_hugging_face_model_and_back(model_dir, tmp_path):
    data, run, out = tmp_path / "data", tmp_path / "runs" / "chat", tmp_path / "out" / "chat"
    write_jsonl(tmp_path / "chats.jsonl", CONVERSATIONS)
    preprocess_data.main(["--chat", "--input", str(tmp_path / "chats.jsonl"), "--output-prefix", str(data / "chats"),
                          "--tokenizer-type", "huggingface", "--tokenizer-model", str(model_dir)])
    assert convert_checkpoint.main(["--from-hf", str(model_dir), "--to", str(run), "--config",
                                    str(ROOT / "configs" / "llama3_8b_chat_128k.yaml")]) == 0
    tokens = IndexedDataset(str(data / "chats_text_document"))
    assert IndexedDataset(loss_mask_prefix(tokens.prefix)).dtype.name == "uint8"
    sets = TINY + [f"data.paths=[{data / 'chats_text_document'}]"]
    assert pretrain.main(["--config", str(run / "config.yaml")] + [a for s in sets for a in ("--set", s)]) == 0

    # step 1 trains at 256 tokens: the 4 conversations (52, 18, 252 and 34 tokens) in 2 sequences of 1 sample
    assert sorted(tokens.sequence_lengths.tolist()) == [18, 34, 52, 252]
    first = step_rows(run)[0]
    assert first["seq_len"] == 256
    hf, tok = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval(), \
        transformers.AutoTokenizer.from_pretrained(str(model_dir))
    want = hf_loss(hf, tok, CONVERSATIONS)
    assert abs(first["loss"] - want) <= 1e-5 * want, (first["loss"], want)

    assert convert_checkpoint.main(["--from", str(run), "--to-hf", str(out), "--dtype", "float32"]) == 0
    assert (out / "chat_template.jinja").read_text() == (model_dir / "chat_template.jinja").read_text()
    tuned, tuned_tok = transformers.AutoModelForCausalLM.from_pretrained(out).eval(), \
        transformers.AutoTokenizer.from_pretrained(str(out))
    prompt = CONVERSATIONS[1]["messages"][:1]
    ids = tuned_tok.apply_chat_template(prompt, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert ids["input_ids"].tolist() == tok.apply_chat_template(prompt, add_generation_prompt=True, return_dict=True,
                                                                return_tensors="pt")["input_ids"].tolist()
    assert tuned.generation_config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    new = tuned.generate(**ids, max_new_tokens=4, do_sample=False)
    assert new.shape[1] > ids["input_ids"].shape[1]
    assert (hf_loss(tuned, tuned_tok, CONVERSATIONS) - want) ** 2 > 1e-8      # it trained
