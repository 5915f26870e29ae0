"""The README's fine-tuning recipe ("Fine-tuning on conversations"), run as it is written: the commands of its
marked block, read from README.md and run in order by test_first_hour's reader and runner, at a tiny size: a tiny
Llama with a ChatML chat template (test_chat_recipe's) stands in for Llama-3.1-8B-Instruct, four conversations for
data/chats.jsonl. SIZES are the only edits to the block, each found in it; the training run also gets TINY's
overrides (configs/llama3_8b_chat_128k.yaml's lengths, batch and steps made tiny, a checkpoint every step with
checkpoint.keep_last=1). `pip install` is not run: the extra it names must be one pyproject.toml declares.

Its first loss is the converted model's (transformers' on the same conversations, test_chat_recipe.hf_loss), the
converted step-0 weights outlive pruning, and the export generates from the chat prompt."""
import re
import shutil
import tomllib

import pytest

from chat_data import CONVERSATIONS, write_jsonl
from test_chat_recipe import hf_loss, model_dir  # noqa: F401 - model_dir is a fixture used here
from tests.fixtures import step_rows
from tests.test_first_hour import ROOT, readme_block, run, scaled_commands

transformers = pytest.importorskip("transformers")
MARKER = "<!-- fine-tuning"
SIZES = {"--workers 16": "--workers 1", "--nproc-per-node 8": "--nproc-per-node 2",
         "max_new_tokens=200": "max_new_tokens=4"}
TINY = ["parallel.sp=2", "parallel.timeout_seconds=60", "data.seq_len=512",
        "data.seq_len_schedule=[[0, 256], [1, 512]]", "training.global_batch_size=1", "training.train_steps=2",
        "training.dtype=float32", "logging.log_interval=1", "optimizer.warmup_steps=1", "model.attention_backend=sdpa",
        "checkpoint.save_interval=1", "checkpoint.keep_last=1"]


def test_the_fine_tuning_recipe_runs_as_written(model_dir, tmp_path, monkeypatch, capsys):  # noqa: F811
    steps = scaled_commands(readme_block(MARKER), SIZES, TINY, "the fine-tuning recipe")
    shutil.copytree(model_dir, tmp_path / "models" / "Llama-3.1-8B-Instruct")
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "chats.jsonl", CONVERSATIONS)
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    monkeypatch.chdir(tmp_path)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    printed = []
    for argv, stdin in steps:
        if argv[:2] == ["pip", "install"]:
            extra = re.fullmatch(r"-e \.\[(\w+)\]", " ".join(argv[2:]))
            assert extra is not None and extra.group(1) in extras, argv
            continue
        printed.append(run(argv, stdin, tmp_path))

    run_dir = tmp_path / "runs" / "llama3_8b_chat"
    first = step_rows(run_dir)[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    want = hf_loss(hf, transformers.AutoTokenizer.from_pretrained(str(model_dir)), CONVERSATIONS)
    assert first["seq_len"] == 256 and abs(first["loss"] - want) <= 1e-5 * want, (first["loss"], want)
    kept = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert kept == ["step_0000000", "step_0000002"], kept          # keep_last=1, and the converted weights
    assert printed[-1].startswith("<|im_start|>user\nSummarise the report.<|im_end|>\n<|im_start|>assistant\n")
