"""The README's context extension, run as it is written: the commands of its marked block, read from README.md and
run in order at a tiny size (tests/test_first_hour.py's reader and runner): a Hugging Face Qwen2 folder (random
weights, a word-level tokenizer) converted with YaRN x4, trained through its length curriculum on one gloo rank,
exported with its scaling, and the next run at the longer length planned. SIZES are the only edits to the block,
each found in it once; the training run also gets EXTRA's overrides (the layout and batch of one CPU process)."""
import json
from pathlib import Path

import pytest
import torch

from tests.fixtures import step_rows
from tests.test_first_hour import ROOT, readme_block, run, scaled_commands

transformers = pytest.importorskip("transformers")
MARKER = "<!-- context-extension"
SIZES = {"--nproc-per-node 8": "--nproc-per-node 1", "--set data.seq_len=131072": "--set data.seq_len=64",
         "[[0,32768],[200,65536],[400,131072]]": "[[0,16],[1,32],[2,64]]",
         "--set training.train_steps=1000": "--set training.train_steps=3", "--gpus 64": "--gpus 4",
         "--set data.seq_len=1048576": "--set data.seq_len=256", "[[0,131072],[200,1048576]]": "[[0,64],[1,256]]"}
EXTRA = ["parallel.sp=1", "training.global_batch_size=2", "training.micro_batch_size=1", "logging.log_interval=1",
         "optimizer.warmup_steps=1", "parallel.timeout_seconds=60"]
WORDS = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, 96)]


def qwen_folder(folder: Path) -> None:
    """A tiny Qwen2 with Qwen2.5's 32K positions, a word-level tokenizer.json beside it (EOS </s>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=32768, eos_token_id=2, bos_token_id=1,
                                      tie_word_embeddings=False)
    transformers.Qwen2ForCausalLM(config).save_pretrained(folder)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))


def test_the_context_extension_runs_as_written(tmp_path, monkeypatch, capsys):
    from megalysses.tools import preprocess_data

    steps = scaled_commands(readme_block(MARKER), SIZES, EXTRA, "the context extension")
    qwen_folder(tmp_path / "models" / "Qwen2.5-7B")
    rng = torch.Generator().manual_seed(0)
    lines = [" ".join(WORDS[3 + i] for i in torch.randint(0, len(WORDS) - 3, (90,), generator=rng).tolist())
             for _ in range(40)]
    (tmp_path / "long.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    preprocess_data.main(["--input", str(tmp_path / "long.jsonl"), "--output-prefix", str(tmp_path / "data" / "long"),
                          "--json-keys", "text", "--append-eod", "--workers", "1", "--tokenizer-type", "huggingface",
                          "--tokenizer-model", str(tmp_path / "models" / "Qwen2.5-7B")])
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    for argv, stdin in steps:
        run(argv, stdin, tmp_path)
    printed = capsys.readouterr().out

    rows = step_rows(tmp_path / "runs" / "qwen-128k")
    assert [r["seq_len"] for r in rows] == [16, 32, 64]                     # the curriculum, to 128K's stand-in
    exported = json.loads((tmp_path / "out" / "qwen-128k" / "config.json").read_text())
    scaling = exported.get("rope_scaling") or exported.get("rope_parameters")
    assert (scaling["rope_type"], scaling["factor"], scaling["original_max_position_embeddings"]) == (
        "yarn", 4.0, 32768)
    plan_line = next(line for line in printed.splitlines() if "layouts fit" in line)
    assert plan_line.startswith("runs/qwen-128k/config.yaml: 256 tokens on 4 x ") and not plan_line.split(
        "; ", 1)[1].startswith("0 of"), plan_line
