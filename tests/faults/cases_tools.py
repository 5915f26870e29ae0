"""Bad arguments and run directories given to tools/generate.py, tools/plot_metrics.py and
tools/build_corpus.py, and the described machine of tools/plan.py and of pretrain.py --dry-run --gpus N (their
main functions, in-process)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from tests.faults.corpus import Case

RUN = ["data.mock=true", "data.seq_len=32", "model.vocab_size=512", "model.hidden_size=32", "model.num_layers=1",
       "model.num_heads=4"]


def run_dir(*overrides: str, config: bytes | None = None) -> Callable[[Path], str]:
    """A run directory with a config.yaml (the given bytes, or a valid config with `overrides`), no checkpoint."""
    def build(tmp: Path) -> str:
        from megalysses.config.io import load_config, save_config
        run = tmp / "run"
        run.mkdir()
        if config is not None:
            (run / "config.yaml").write_bytes(config)
        else:
            save_config(load_config(None, RUN + [o.format(tmp=tmp) for o in overrides]), run / "config.yaml")
        return str(run)
    return build


def generate(*extra: str, run: Callable[[Path], str] = run_dir()) -> Callable[[Path], int]:
    def body(tmp: Path) -> int:
        from megalysses.tools.generate import main
        return main(["--run", run(tmp), *[a.format(tmp=tmp) for a in extra]])
    return body


def metrics(data: bytes | None, *extra: str) -> Callable[[Path], int]:
    """plot_metrics on a run directory whose metrics.jsonl holds `data` (None: no metrics.jsonl)."""
    def body(tmp: Path) -> int:
        from megalysses.tools.plot_metrics import main
        (tmp / "run").mkdir()
        if data is not None:
            (tmp / "run" / "metrics.jsonl").write_bytes(data)
        return main([str(tmp / "run"), *[a.format(tmp=tmp) for a in extra]])
    return body


def build_corpus(output: str, prepare: Callable[[Path], object] = lambda tmp: None) -> Callable[[Path], int]:
    def body(tmp: Path) -> int:
        from megalysses.tools.build_corpus import main
        prepare(tmp)
        main(["--stdlib", "--output", output.format(tmp=tmp)])
        return 0
    return body


def tokenizer_json(vocab: int) -> Callable[[Path], str]:
    """A word-level tokenizer.json with `vocab` ids, EOS </s>."""
    def build(tmp: Path) -> str:
        from tokenizers import Tokenizer, models, pre_tokenizers
        words = {f"w{i}": i for i in range(vocab - 2)}
        words.update({"[UNK]": vocab - 2, "</s>": vocab - 1})
        tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.save(str(tmp / "tokenizer.json"))
        return str(tmp / "tokenizer.json")
    return build


def generate_with_hf(vocab: int) -> Callable[[Path], int]:
    def body(tmp: Path) -> int:
        path = tokenizer_json(vocab)(tmp)
        return generate(run=run_dir("data.tokenizer=huggingface", f"data.tokenizer_model={path}"))(tmp)
    return body


QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml")


def dry_run(*flags: str) -> Callable[[Path], int]:
    """pretrain.py --dry-run --gpus N (given among `flags`) of the quickstart config, mock data."""
    def body(tmp: Path) -> int:
        from megalysses.tools.pretrain import main
        return main(["--config", QUICKSTART, "--set", "data.mock=true", "--set", f"logging.run_dir={tmp}/run",
                     "--dry-run", *flags])
    return body


def plan(*flags: str, config: str = QUICKSTART) -> Callable[[Path], int]:
    def body(tmp: Path) -> int:
        from megalysses.tools.plan import main
        return main(["--config", config, *flags])
    return body


ROW = {"step": 1, "loss": 5.0, "lr": 1e-3, "tokens_per_s": 100.0}
GOOD_METRICS = (json.dumps(ROW) + "\n").encode()

CASES = [
    # generate: arguments
    Case("tools/generate_max_new_tokens_negative", generate("--max-new-tokens", "-5"), "--max-new-tokens"),
    Case("tools/generate_max_new_tokens_zero", generate("--max-new-tokens", "0"), "--max-new-tokens"),
    Case("tools/generate_temperature_nan", generate("--temperature", "nan"), "--temperature"),
    Case("tools/generate_temperature_inf", generate("--temperature", "inf"), "--temperature"),
    Case("tools/generate_temperature_negative", generate("--temperature", "-1"), "--temperature"),
    Case("tools/generate_top_k_negative", generate("--top-k", "-3"), "--top-k"),
    Case("tools/generate_top_p_zero", generate("--top-p", "0"), "--top-p"),
    Case("tools/generate_top_p_above_one", generate("--top-p", "1.5"), "--top-p"),
    Case("tools/generate_prompts_file_missing", generate("--prompts-file", "{tmp}/none.txt"), "--prompts-file"),
    Case("tools/generate_hf_dir_missing", lambda tmp: __import__("megalysses.tools.generate", fromlist=["main"]).main(
        ["--hf", str(tmp / "nope")]), "not a directory"),
    Case("tools/generate_empty_prompt", generate("--prompt", ""), "--prompt"),
    Case("tools/generate_seed_not_a_number", generate("--seed", "abc"), "--seed"),
    # generate: the run directory
    Case("tools/generate_run_missing", generate(run=lambda tmp: str(tmp / "nowhere")), "not a run directory"),
    Case("tools/generate_run_is_a_file", generate(run=lambda tmp: (tmp / "f").write_text("x") and str(tmp / "f")),
         "not a run directory"),
    Case("tools/generate_garbage_config", generate(run=run_dir(config=b"model: [unclosed\n  - {")), "config.yaml"),
    Case("tools/generate_config_not_a_mapping", generate(run=run_dir(config=b"- just\n- a list\n")), "config.yaml"),
    Case("tools/generate_config_not_utf8", generate(run=run_dir(config=b"model:\n  hidden_size: \xff\xfe\n")),
         "config.yaml"),
    Case("tools/generate_config_unknown_key", generate(run=run_dir(config=b"model:\n  hiden_size: 8\n")),
         "hidden_size"),
    Case("tools/generate_run_tokenizer_missing", generate(run=run_dir(
        "data.tokenizer=sentencepiece", "data.tokenizer_model={tmp}/gone.model")), "the run's tokenizer"),
    Case("tools/generate_run_tokenizer_garbage", generate(run=lambda tmp: (
        (tmp / "t.model").write_bytes(b"garbage"),
        run_dir("data.tokenizer=sentencepiece", "data.tokenizer_model={tmp}/t.model")(tmp))[1]),
         "not a sentencepiece model"),
    Case("tools/generate_run_tokenizer_larger_than_model", generate_with_hf(600), "not the tokenizer the run"),
    Case("tools/generate_no_checkpoint", generate(), "no checkpoint"),
    Case("tools/generate_checkpoint_path_missing", generate("--checkpoint", "{tmp}/ckpt"), "no checkpoint"),
    # plot_metrics
    Case("tools/plot_metrics_missing", metrics(None), "does not exist"),
    Case("tools/plot_metrics_path_missing", lambda tmp: __import__("megalysses.tools.plot_metrics", fromlist=["main"])
         .main([str(tmp / "nothing.jsonl")]), "does not exist"),
    Case("tools/plot_metrics_empty", metrics(b""), "no training steps"),
    Case("tools/plot_metrics_garbage_text", metrics(b"this is not json\nnor this\n"), "no training steps"),
    Case("tools/plot_metrics_binary", metrics(bytes(range(256)) * 4), "no training steps"),
    Case("tools/plot_metrics_cut_short", metrics(b'{"step": 1, "loss": 5.0, "l'), "no training steps"),
    Case("tools/plot_metrics_rows_without_step", metrics(b'{"loss": 5.0}\n{"loss": 4.0}\n'), "no training steps"),
    Case("tools/plot_metrics_only_validation", metrics(b'{"step": 2, "val_loss": 5.0}\n'), "no training steps"),
    Case("tools/plot_metrics_loss_not_a_number", metrics(b'{"step": 1, "loss": "high"}\n'), "no training steps"),
    Case("tools/plot_metrics_json_list_rows", metrics(b"[1, 2]\n[3, 4]\n"), "no training steps"),
    Case("tools/plot_output_in_missing_directory", metrics(GOOD_METRICS, "--output", "{tmp}/no/dir/plot.png"),
         "does not exist"),
    Case("tools/plot_output_is_a_directory", lambda tmp: (
        (tmp / "plots.png").mkdir(), metrics(GOOD_METRICS, "--output", "{tmp}/plots.png")(tmp))[1], "is a directory"),
    Case("tools/plot_output_unknown_type", metrics(GOOD_METRICS, "--output", "{tmp}/plot.xyz"),
         "unsupported image type"),
    Case("tools/plot_output_without_suffix", metrics(GOOD_METRICS, "--output", "{tmp}/plot"),
         "unsupported image type"),
    # build_corpus
    Case("tools/build_corpus_output_is_directory", build_corpus("{tmp}"), "is a directory"),
    Case("tools/build_corpus_output_below_a_file", build_corpus("{tmp}/f/corpus.jsonl",
                                                                lambda tmp: (tmp / "f").write_text("x")), "is a file"),
    # the described machine: one check for the planner and the dry run; the fit judged alike
    Case("tools/dry_run_gpu_memory_negative", dry_run("--gpus", "2", "--gpu-memory-gib", "-80"), "--gpu-memory-gib"),
    Case("tools/dry_run_gpu_memory_below_the_reserve", dry_run("--gpus", "2", "--gpu-memory-gib", "1"),
         "leaves nothing usable"),
    Case("tools/dry_run_packages_unknown", dry_run("--gpus", "2", "--packages", "flash-attn"), "--packages unknown"),
    Case("tools/dry_run_gpu_unknown", dry_run("--gpus", "2", "--gpu", "MI300X"), "--gpu-memory-gib"),
    Case("tools/dry_run_gpus_without_dry_run", lambda tmp: __import__("megalysses.tools.pretrain", fromlist=["m"])
         .main(["--config", QUICKSTART, "--set", "data.mock=true", "--gpus", "2"]), "add --dry-run"),
    Case("tools/dry_run_machine_without_gpus", dry_run("--gpu-memory-gib", "40"), "add --gpus"),
    Case("tools/dry_run_does_not_fit", dry_run("--gpus", "4", "--gpu-memory-gib", "1.68"), "does not fit (peak"),
    Case("tools/dry_run_traced_peak_does_not_fit", dry_run("--gpus", "4", "--gpu-memory-gib", "1.68", "--trace-memory"),
         "> usable"),
    Case("tools/plan_gpu_memory_negative", plan("--gpus", "2", "--gpu-memory-gib", "-80"), "--gpu-memory-gib"),
    Case("tools/plan_gpus_beyond_any_layout", plan("--gpus", "1000000"), "is more than this config can use: at most"),
    Case("tools/plan_seq_len_beyond_the_curriculum", plan("--gpus", "8", "--seq-len", "1024", "--set",
                                                         "data.seq_len_schedule=[[0, 128], [10, 256]]"),
         "data.seq_len_schedule ends at seq_len 256"),
    Case("tools/build_corpus_without_source", lambda tmp: __import__("megalysses.tools.build_corpus", fromlist=["m"])
         .main(["--output", str(tmp / "c.jsonl")]), "--stdlib"),
]
