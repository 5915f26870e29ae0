"""What a Hugging Face export declares: max_position_embeddings at the context the checkpoint trained at (a
curriculum's length at its step) or the imported model's own, whichever is longer, and the EOS/BOS ids and
generation_config.json that transformers and serving stacks read."""
import json
import os
import stat
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megalysses.tools import convert_checkpoint, pretrain  # noqa: E402
from test_convert import hf_dir  # noqa: E402,F401 - the fixture: a tiny Llama with 256 positions

TINY = ["data.mock=true", "model.vocab_size=128", "model.hidden_size=32", "model.num_layers=1", "model.num_heads=4",
        "training.global_batch_size=1", "training.micro_batch_size=1", "optimizer.warmup_steps=1",
        "checkpoint.save_interval=1", "logging.log_interval=1", "model.attention_backend=sdpa"]


def train(overrides, config=None) -> None:
    argv = ["--config", str(config)] if config else []
    assert pretrain.main(argv + [a for o in overrides for a in ("--set", o)]) == 0


def export(source, out, *extra) -> dict:
    assert convert_checkpoint.main(["--from", str(source), "--to-hf", str(out), *extra]) == 0
    return json.loads((Path(out) / "config.json").read_text())


def test_a_run_trained_past_8k_declares_its_trained_length(tmp_path, capsys):
    """From scratch with a curriculum: step 1 at 4,096 tokens, step 2 at 12,288. Each checkpoint's export
    declares the longest length it trained at, the EOS the data ended documents with and no BOS."""
    run = tmp_path / "run"
    train(TINY + [f"logging.run_dir={run}", "data.seq_len=12288", "data.seq_len_schedule=[[0, 4096], [1, 12288]]",
                  "training.train_steps=2", "data.document_mask=false", "data.reset_position_ids=false"])
    first = export(run / "checkpoints" / "step_0000001", tmp_path / "at_step_1")
    assert first["max_position_embeddings"] == 4096
    out = capsys.readouterr().out
    assert "max_position_embeddings 4096 (the length it trained at by step 1)" in out, out
    old = os.umask(0o027)
    try:
        assert export(run, tmp_path / "at_step_2")["max_position_embeddings"] == 12288
    finally:
        os.umask(old)
    # every file with the mode the umask gives (safetensors alone would leave the weights at 0600)
    assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in (tmp_path / "at_step_2").iterdir()} == \
        {name: 0o640 for name in ("config.json", "generation_config.json", "model.safetensors")}
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "at_step_2")
    assert model.config.max_position_embeddings == 12288
    assert model.generation_config.eos_token_id == model.config.eos_token_id == 127    # mock data's EOD
    assert model.config.bos_token_id is None


def test_an_import_keeps_its_context_until_it_trains_longer(hf_dir, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    assert convert_checkpoint.main(["--from-hf", str(hf_dir), "--to", str(run)]) == 0
    config = export(run, tmp_path / "untrained")                # never trained: the source's 256, not data.seq_len
    assert (config["max_position_embeddings"], config["bos_token_id"], config["eos_token_id"]) == (256, 1, 2)
    assert (tmp_path / "untrained" / "generation_config.json").read_bytes() == \
        (hf_dir / "generation_config.json").read_bytes()
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "untrained")
    assert model.generation_config.eos_token_id == 2 and model.config.max_position_embeddings == 256
    train(["data.mock=true", "data.seq_len=512", "training.global_batch_size=1", "training.micro_batch_size=1",
           "training.train_steps=1", "model.attention_backend=sdpa"], config=run / "config.yaml")
    assert export(run, tmp_path / "trained")["max_position_embeddings"] == 512     # trained past the source's 256


def test_dtype_default_is_explained(capsys):
    with pytest.raises(SystemExit):
        convert_checkpoint.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Default bfloat16, whatever the checkpoint holds (fp32 master weights when it trained)" in text
    assert "float32 keeps the master weights exactly" in text


def test_failed_conversions_leave_nothing_behind(hf_dir, tmp_path, monkeypatch, capsys):  # noqa: F811
    """A damaged shard is found before anything is written; a disk that fills up while the export is written
    leaves no directory (the export is written under a temporary name and renamed when complete)."""
    import shutil

    import safetensors.torch

    damaged = tmp_path / "damaged"
    shutil.copytree(hf_dir, damaged)
    last = sorted(damaged.glob("model-*.safetensors"))[-1]
    last.write_bytes(last.read_bytes()[:100])
    assert convert_checkpoint.main(["--from-hf", str(damaged), "--to", str(tmp_path / "run")]) == 1
    assert f"error: {last} is not a readable safetensors file" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()

    assert convert_checkpoint.main(["--from-hf", str(hf_dir), "--to", str(tmp_path / "run")]) == 0
    save = safetensors.torch.save_file
    calls = []

    def disk_full(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return save(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    out = tmp_path / "exports" / "new" / "hf"
    assert convert_checkpoint.main(["--from", str(tmp_path / "run"), "--to-hf", str(out),
                                    "--max-shard-gib", "0.00005"]) == 1
    assert "cannot be written (No space left on device)" in capsys.readouterr().err
    assert len(calls) == 3 and not (tmp_path / "exports").exists()
