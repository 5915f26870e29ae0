"""Damaged Hugging Face models and output paths that cannot be written, given to tools/convert_checkpoint.py
(megalysses.tools.convert_checkpoint.main) in both directions; config.json fields that do not describe the weights,
or that a run refuses, and --set overrides a run refuses (nothing written); checkpoint.init_from of a Hugging Face
folder whose config.json does not describe its weights (nothing trained)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Optional

from tests.faults.corpus import Case


def hf_model(damage: Optional[Callable[[Path], None]] = None, shards: bool = False) -> Callable[[Path], str]:
    """A tiny Llama saved by transformers (one file, or several shards and their index); damage(folder) last."""
    def build(tmp: Path) -> str:
        import torch
        import transformers
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
        folder = tmp / "hf"
        transformers.LlamaForCausalLM(cfg).save_pretrained(folder, max_shard_size="10KB" if shards else "1GB")
        if damage is not None:
            damage(folder)
        return str(folder)
    return build


def cut(name: str, keep: float) -> Callable[[Path], None]:
    def go(folder: Path) -> None:
        path = sorted(folder.glob(name))[-1]
        path.write_bytes(path.read_bytes()[:int(path.stat().st_size * keep)])
    return go


def garbage(name: str) -> Callable[[Path], None]:
    return lambda folder: sorted(folder.glob(name))[0].write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")


def read_only(tmp: Path) -> Path:
    """A directory this process cannot write in: a read-only one, or for root (whom permissions do not stop)
    a place in /sys, where nothing can be created."""
    if os.geteuid() != 0:
        (tmp / "ro").mkdir()
        (tmp / "ro").chmod(0o555)
        return tmp / "ro"
    return Path("/sys/megalysses-read-only")


def qwen3_model(**config_json) -> Callable[[Path], str]:
    """A tiny Qwen3 saved by transformers (heads of 24 at hidden 64, its context 512), then config.json's fields
    changed to `config_json`."""
    def build(tmp: Path) -> str:
        import torch
        import transformers
        torch.manual_seed(0)
        cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                       max_position_embeddings=512)
        folder = tmp / "hf"
        transformers.Qwen3ForCausalLM(cfg).save_pretrained(folder)
        data = json.loads((folder / "config.json").read_text())
        data.update(config_json)
        (folder / "config.json").write_text(json.dumps(data))
        return str(folder)
    return build


def from_hf(source: Callable[[Path], str] = hf_model(), to: Callable[[Path], Path] = lambda tmp: tmp / "run",
            *overrides: str) -> Callable[[Path], int]:
    """--from-hf from source(tmp) into to(tmp), with --set overrides; a refusal that leaves a file behind fails."""
    def run(tmp: Path) -> int:
        from megalysses.tools.convert_checkpoint import main
        folder = source(tmp)
        status = main(["--from-hf", folder, "--to", str(to(tmp))] + [a for o in overrides for a in ("--set", o)])
        if status != 0 and to(tmp).is_dir() and any(to(tmp).iterdir()):
            raise AssertionError(f"refused, yet {to(tmp)} was written")
        return status
    return run


def init_from(source: Callable[[Path], str]) -> Callable[[Path], int]:
    """pretrain (a world of one) with checkpoint.init_from the Hugging Face folder source(tmp), the model section
    read from its config.json as the converter reads it; nothing may be trained."""
    def run(tmp: Path) -> int:
        from megalysses.model.hf import model_config_from_hf
        from megalysses.tools.pretrain import main
        folder = source(tmp)
        model = model_config_from_hf(json.loads((Path(folder) / "config.json").read_text()))
        sets = [f"model.{k}={v}" for k, v in vars(model).items() if k in SHAPE_KEYS and v is not None] + [
            "data.mock=true", "data.seq_len=32", "training.global_batch_size=1", "training.train_steps=1",
            f"checkpoint.init_from={folder}", f"logging.run_dir={tmp}/run", "parallel.timeout_seconds=30"]
        status = main([a for o in sets for a in ("--set", o)])
        if (tmp / "run" / "metrics.jsonl").exists() and "loss" in (tmp / "run" / "metrics.jsonl").read_text():
            raise AssertionError("refused, yet a step was trained")
        return status
    return run


SHAPE_KEYS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "ffn_hidden_size",
              "qk_layernorm", "tie_embeddings")
YARN = ("model.rope_scaling.type=yarn", "model.rope_scaling.original_max_position_embeddings=128")


def to_hf(to: Callable[[Path], Path]) -> Callable[[Path], int]:
    """--to-hf from a run imported from the tiny Llama, into to(tmp)."""
    def run(tmp: Path) -> int:
        from megalysses.tools.convert_checkpoint import main
        if from_hf()(tmp) != 0:
            raise RuntimeError("could not import the corpus's model")
        return main(["--from", str(tmp / "run"), "--to-hf", str(to(tmp))])
    return run


def a_file(tmp: Path) -> Path:
    (tmp / "taken").write_text("a file in the way")
    return tmp / "taken"


def a_folder_with_files(tmp: Path) -> Path:
    (tmp / "old").mkdir()
    (tmp / "old" / "model.safetensors").write_bytes(b"an earlier export")
    return tmp / "old"


CASES = [
    Case("convert/from_hf_safetensors_truncated", from_hf(hf_model(cut("*.safetensors", 0.5))),
         "not a readable safetensors file"),
    Case("convert/from_hf_safetensors_header_only", from_hf(hf_model(cut("*.safetensors", 0.01))),
         "not a readable safetensors file"),
    Case("convert/from_hf_safetensors_empty", from_hf(hf_model(cut("*.safetensors", 0))),
         "not a readable safetensors file"),
    Case("convert/from_hf_safetensors_garbage", from_hf(hf_model(garbage("*.safetensors"))),
         "not a readable safetensors file"),
    Case("convert/from_hf_last_shard_truncated", from_hf(hf_model(cut("model-*.safetensors", 0.5), shards=True)),
         "not a readable safetensors file"),
    Case("convert/from_hf_first_shard_garbage", from_hf(hf_model(garbage("model-*.safetensors"), shards=True)),
         "not a readable safetensors file"),
    Case("convert/to_is_a_file", from_hf(to=a_file), "is a file"),
    Case("convert/to_below_a_file", from_hf(to=lambda tmp: a_file(tmp) / "run"), "which is a file"),
    Case("convert/to_read_only", from_hf(to=lambda tmp: read_only(tmp) / "run"), "cannot be written"),
    Case("convert/to_hf_is_a_file", to_hf(a_file), "is a file"),
    Case("convert/to_hf_below_a_file", to_hf(lambda tmp: a_file(tmp) / "hf"), "which is a file"),
    Case("convert/to_hf_holds_files", to_hf(a_folder_with_files), "already holds files"),
    Case("convert/to_hf_read_only", to_hf(lambda tmp: read_only(tmp) / "out" / "hf"), "cannot be written"),
    Case("convert/from_hf_kv_heads_do_not_divide_the_heads", from_hf(qwen3_model(num_key_value_heads=3)),
         "model.num_heads=4 is not divisible by model.num_kv_heads=3"),
    Case("convert/from_hf_head_dim_not_the_weights", from_hf(qwen3_model(head_dim=16)),
         "q_proj.weight has shape (96, 64) where config.json (num_attention_heads 4 x head_dim 16, hidden_size 64) "
         "predicts (64, 64)"),
    Case("convert/from_hf_hidden_size_not_the_weights", from_hf(qwen3_model(hidden_size=32)),
         "embed_tokens.weight has shape (64, 64) where config.json (vocab_size 64, hidden_size 32) predicts (64, 32)"),
    Case("convert/from_hf_intermediate_size_not_the_weights", from_hf(qwen3_model(intermediate_size=128)),
         "gate_proj.weight has shape (96, 64) where config.json (intermediate_size 128, hidden_size 64)"),
    Case("convert/from_hf_yarn_factor_below_1",
         from_hf(qwen3_model(), lambda tmp: tmp / "run", *YARN, "model.rope_scaling.factor=0.5"),
         "model.rope_scaling.factor=0.5 is out of range: it must be >= 1.0"),
    Case("convert/from_hf_yarn_original_context_above_the_model",
         from_hf(qwen3_model(), lambda tmp: tmp / "run", "model.rope_scaling.type=yarn", "model.rope_scaling.factor=4",
                 "model.rope_scaling.original_max_position_embeddings=4096"),
         "original_max_position_embeddings=4096 is above the context of"),
    Case("convert/from_hf_negative_sliding_window",
         from_hf(qwen3_model(), lambda tmp: tmp / "run", "model.sliding_window=-3"),
         "model.sliding_window=-3 is out of range"),
    Case("convert/from_hf_linear_rope_scaling_without_factor",
         from_hf(qwen3_model(rope_scaling={"rope_type": "linear"}, rope_parameters=None)),
         "rope_scaling (rope_type linear) has no factor: add it"),
    Case("convert/from_hf_llama3_rope_scaling_without_high_freq_factor",
         from_hf(qwen3_model(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0},
                             rope_parameters=None)), "has no high_freq_factor"),
    Case("convert/from_hf_yarn_without_any_context",
         from_hf(qwen3_model(rope_scaling={"rope_type": "yarn"}, rope_parameters=None, max_position_embeddings=None)),
         "has no original_max_position_embeddings and config.json no max_position_embeddings"),
    Case("convert/from_hf_yarn_without_factor_or_the_model_context",
         from_hf(qwen3_model(rope_scaling={"rope_type": "yarn", "original_max_position_embeddings": 256},
                             rope_parameters=None, max_position_embeddings=None)),
         "rope_scaling (rope_type yarn) has no factor: add it"),
    Case("convert/init_from_hf_head_dim_not_the_weights", init_from(qwen3_model(head_dim=16)),
         "q_proj.weight has shape (96, 64) where config.json"),
]
