"""Does the model use its context? Passkey retrieval, needle in a haystack and loss by position, forward only on
the training layout.

    python tools/eval_long.py --run runs/passkey                     # its latest checkpoint, one process
    python tools/eval_long.py --run runs/passkey --step 1000 --lengths 512,1024 --depths 0,0.5,1 --samples 20
    torchrun --nproc-per-node 8 tools/eval_long.py --run-dir runs/llama1m --lengths 1048576 --set parallel.sp=8
    python tools/eval_long.py --from-hf models/Llama-3.2-1B --haystack data/essays_text_document --out out/eval

--run (--run-dir under torchrun, whose own --run-path takes --run) reads <run>/config.yaml and a checkpoint
(the latest, or --step N) and evaluates on the run's layout where the world size allows it (a multiple of
tp x sp x pp ranks: the rest is data parallelism), else on all the ranks as one sequence-parallel group
(Ulysses as far as the heads allow, ring attention for the rest); --set section.key=value changes the layout
(or any setting) as pretrain.py's --set does. --from-hf evaluates a Hugging Face model folder (Llama, Qwen2/2.5,
Qwen3 or Mistral: its config.json, safetensors and tokenizer.json), the rest of the settings from --config
(default: the schema's).
The forward is the training one (tp, sp = ulysses x ring, pp and virtual stages, FSDP, head chunks, activation
offload), so a length evaluates wherever a training step of that length runs.

Tasks (--tasks, default all): passkey (a 5-digit key in repeated filler sentences, Mohtashami & Jaggi 2023),
niah and niah-multikey (a 7-digit number for a key, alone or among three other keys' numbers, in real text:
RULER's variants), position-loss (the loss by position within the document, log-spaced buckets). The real
text is the run's validation data or --haystack. An answer is correct when each of its tokens is the argmax
given the correct prefix, which is what greedy decoding would write: one forward, and only the answer
positions reach the LM head. Lengths past the one the model trained at are allowed and marked as
extrapolation (with the model's RoPE and its scaling). --tasks, --lengths, --depths, --samples and --seed
default to the run's long_eval section (lengths: the trained length and its half and quarter, those that hold
every task's prompt).

It prints what it will run (tasks, lengths, depths, samples; default lengths left out, and why) before the
weights are read, then a line each time cells (a task at a length and depth) are done, with the time left.

Writes long_eval.json (results: one entry per task, length and depth, or position bucket; settings, layout
and seconds beside them), long_eval.md (the tables, also printed) and PNG pictures (a depth x length heatmap per
needle task, passkey accuracy against length, loss against position; needs matplotlib, the `plot` extra) into
the run directory or --out, which is checked writable before anything runs.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch

from megalysses.checkpoint.dcp_io import CheckpointError, read_meta
from megalysses.checkpoint.initial import find_initial_checkpoint
from megalysses.checkpoint.manifest import checkpoints_in, step_of
from megalysses.config import Config, ConfigError
from megalysses.config.checks import validate_config
from megalysses.config.io import load_config, read_yaml, with_overrides
from megalysses.data import DatasetError
from megalysses.data.tokenizer import SpecialTokens, TokenizerError, build_tokenizer, tokenizer_from_config
from megalysses.distributed import destroy_distributed, init_distributed, is_rank0, print0
from megalysses.evaluation.haystack import DocumentStream, HaystackError
from megalysses.evaluation.report import MARKDOWN_NAME, draw, markdown, write_results
from megalysses.evaluation.tasks import TASKS, PromptError, Prompts, minimum_length
from megalysses.grid import LayoutError, ParallelGrid
from megalysses.kernels.attention import reserve_compiles
from megalysses.model.hf import model_config_from_hf
from megalysses.model.hf_io import HFFormatError, open_hf_dir
from megalysses.plan import Machine, resolve
from megalysses.plan.machine import local_device
from megalysses.training.long_eval import (EvalProgress, LongEval, LongEvalError, LongEvalSettings, cell_count,
                                           check_settings, sample_items, text_only)
from megalysses.training.build import Parts, build_run
from megalysses.training.runtime import flex_compile_budget, startup_line

ERRORS = (ConfigError, LayoutError, CheckpointError, DatasetError, TokenizerError, PromptError, LongEvalError,
          HaystackError, HFFormatError, FileNotFoundError)


def _numbers(text: str, kind: type, flag: str) -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{flag} {text!r}: give comma-separated numbers") from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", "--run-dir", dest="run",
                        help="a run directory (config.yaml and checkpoints/); under torchrun spell it --run-dir "
                             "(torchrun reads --run as its own --run-path)")
    source.add_argument("--from-hf", metavar="HF_DIR",
                        help="a Hugging Face model folder: Llama, Qwen2/2.5, Qwen3 or Mistral (config.json, "
                             "safetensors, tokenizer.json)")
    p.add_argument("--step", type=int, help="--run: the checkpoint of this step (default: the latest)")
    p.add_argument("--config", help="--from-hf: a megalysses YAML for everything but the model (layout, data)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one setting (the layout: parallel.sp=8, ...); repeatable")
    p.add_argument("--tasks", type=lambda t: [x.strip() for x in t.split(",") if x.strip()],
                   help=f"comma-separated, of {', '.join(TASKS)} (default: long_eval.tasks, all)")
    p.add_argument("--lengths", type=lambda t: _numbers(t, int, "--lengths"), help="comma-separated token counts")
    p.add_argument("--depths", type=lambda t: _numbers(t, float, "--depths"),
                   help="comma-separated needle depths in [0, 1] (default: long_eval.depths, 0,0.25,0.5,0.75,1)")
    p.add_argument("--samples", type=int, help="samples per task, length and depth (default: long_eval.samples)")
    p.add_argument("--seed", type=int, help="seed of the prompts (default: long_eval.seed)")
    p.add_argument("--haystack", nargs="+", metavar="PREFIX",
                   help="datasets (.bin/.idx prefixes) whose documents are the real text (default: long_eval.haystack "
                        "or the run's validation data)")
    p.add_argument("--out", help="where the results go (default: the run directory; needed with --from-hf)")
    return p


def _run_config(args: argparse.Namespace) -> tuple[Config, Any]:
    """(config, tokenizer) of --run."""
    run = Path(args.run)
    if not (run / "config.yaml").is_file():
        raise ConfigError(f"{run} is not a run directory (no config.yaml): pass the logging.run_dir of a run")
    cfg = load_config(run / "config.yaml")
    tok = tokenizer_from_config(cfg.data, cfg.model.vocab_size)
    if tok.vocab_size > cfg.model.vocab_size:
        raise TokenizerError(f"the run's tokenizer has {tok.vocab_size} ids but model.vocab_size="
                             f"{cfg.model.vocab_size}: this is not the tokenizer the run trained with; fix "
                             f"data.tokenizer in {run / 'config.yaml'}")
    return cfg, tok


def _run_checkpoint(args: argparse.Namespace, cfg: Config) -> tuple[Path, int]:
    """(the checkpoint of --step, or the latest, verified; the longest length it trained at) of --run."""
    ckpt_dir = Path(cfg.checkpoint.dir or Path(args.run) / "checkpoints")
    saved = checkpoints_in(ckpt_dir)
    if args.step is not None:
        found = [c for c in saved if step_of(c) == args.step]
        if not found:
            steps = ", ".join(str(step_of(c)) for c in saved) or "none"
            raise CheckpointError(f"{ckpt_dir} holds no checkpoint of step {args.step} (saved steps: {steps}): pass "
                                  f"one of them, or leave --step out for the latest")
        path = find_initial_checkpoint(found[0])
    elif saved or (ckpt_dir / "latest").exists():
        path = find_initial_checkpoint(ckpt_dir)
    else:
        raise CheckpointError(f"no checkpoint under {ckpt_dir}: train the run first (checkpoint.save_interval, or "
                              f"the end of training, saves one)")
    step = read_meta(path)["step"]
    return path, cfg.data.seq_len_at(max(step - 1, 0))


def _hf_config(args: argparse.Namespace) -> tuple[Config, Any]:
    """(config, tokenizer) of --from-hf: the model section from its config.json."""
    folder = Path(args.from_hf)
    hf, _ = open_hf_dir(folder)
    try:
        model = model_config_from_hf(hf)
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"--from-hf {folder}: {e}") from None
    data = read_yaml(Path(args.config)).get("data") if args.config else None
    mock = [] if isinstance(data, dict) and data.get("paths") else ["data.mock=true"]    # no data: --haystack
    cfg = load_config(args.config, mock + ["data.tokenizer=huggingface", f"data.tokenizer_model={folder}"])
    cfg.model = dataclasses.replace(model, attention_backend=cfg.model.attention_backend, kernels=cfg.model.kernels)
    tok = build_tokenizer("huggingface", str(folder), special=SpecialTokens(cfg.data.eod, cfg.data.bos))
    return cfg, tok


def _fit_layout(cfg: Config, world: int, overrides: list[str]) -> tuple[Config, Optional[str]]:
    """The run's layout where `world` holds whole copies of it, else sp over every rank (and a line saying so);
    then --set; the batch settings made to fit the world and no checkpoint saves planned (neither applies to an
    evaluation)."""
    p = cfg.parallel
    layout, note = [], None
    if world % (p.tp * p.sp * p.pp):
        layout = ["parallel.tp=1", "parallel.pp=1", "parallel.virtual_stages=1", f"parallel.sp={world}",
                  "parallel.sp_ring=0", "parallel.tp_sequence_parallel=false"]
        note = f"the run's layout (tp {p.tp} x sp {p.sp} x pp {p.pp}) does not divide {world} ranks: sp={world}"
    cfg = with_overrides(cfg, layout + overrides)
    par, t = cfg.parallel, cfg.training
    dp = max(world // (par.tp * par.sp * par.pp), 1)
    t.rampup_batch_size, t.batch_size_schedule = [], []
    t.global_batch_size = t.micro_batch_size * dp * (par.pp if par.virtual_stages > 1 else 1)
    cfg.checkpoint.async_save = False
    validate_config(cfg, world_size=world)
    return cfg, note


def _settings(cfg: Config, args: argparse.Namespace, prompts: Any,
              trained: Optional[int]) -> tuple[LongEvalSettings, list[str]]:
    """--tasks, --lengths, --depths, --samples, --seed over the config's long_eval section; default lengths: the
    trained length, its half and its quarter, those that hold every task's prompt; and a line for each default
    length left out, saying why."""
    e = cfg.long_eval
    tasks = tuple(args.tasks if args.tasks is not None else e.tasks)
    lengths = args.lengths if args.lengths is not None else e.lengths
    dropped: list[str] = []
    if not lengths and trained:
        lengths, dropped = _default_lengths(trained, prompts, [t for t in tasks if t in TASKS])
    return LongEvalSettings(tasks=tasks, lengths=tuple(lengths or ()),
                            depths=tuple(args.depths if args.depths is not None else e.depths),
                            samples=args.samples if args.samples is not None else e.samples,
                            seed=args.seed if args.seed is not None else e.seed), dropped


def _default_lengths(trained: int, prompts: Any, tasks: list[str]) -> tuple[list[int], list[str]]:
    """The trained length, its half and its quarter, those that hold every task's prompt (the trained length
    alone when none does); a line for each left out."""
    need = {t: minimum_length(prompts, t) for t in tasks}
    kept, dropped = [], []
    for n, what in ((trained // 4, "a quarter of "), (trained // 2, "half "), (trained, "")):
        short = [t for t in tasks if n < need[t]]
        if short:
            dropped.append(f"length {n} ({what}the trained {trained}) left out: it cannot hold the {short[0]} "
                           f"prompt, which needs {need[short[0]]} tokens with this tokenizer")
        else:
            kept.append(n)
    return kept or [trained], dropped


def plan_lines(settings: LongEvalSettings, trained: Optional[int], dropped: list[str]) -> list[str]:
    """What the evaluation will run, in words: tasks, lengths (past the trained one marked), needle depths and
    samples, and the cells, samples and tokens that makes; then the default lengths left out."""
    lengths = sorted(set(settings.lengths))
    marked = [f"{n} (extrapolation)" if trained is not None and n > trained else str(n) for n in lengths]
    per_length = len(sample_items(settings))
    depths = (f"; depths {', '.join(f'{d:g}' for d in settings.depths)}"
              if any(t != "position-loss" for t in settings.tasks) else "")
    line = (f"long_eval: tasks {', '.join(settings.tasks)}; lengths {', '.join(marked)}"
            f"{f' (trained at {trained})' if trained else ''}{depths}; {settings.samples} samples each: "
            f"{cell_count(settings) * len(lengths)} cells, {per_length * len(lengths)} samples, "
            f"{per_length * sum(lengths):,} tokens")
    return [line] + [f"long_eval: {d}" for d in dropped]


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def progress_line(done: EvalProgress, elapsed: float) -> str:
    """One line of progress: the cells done, the last of them, the time so far and an estimate of the time left
    (the seconds per sample token so far, times the tokens left)."""
    left = elapsed * (done.tokens - done.tokens_done) / max(done.tokens_done, 1)
    return (f"long_eval: {done.cells_done} of {done.cells} cells done ({done.last}), {_clock(elapsed)} elapsed, "
            f"about {_clock(left)} left")


def check_output(out: Path, what: str) -> None:
    """ConfigError unless files can be written in `out`, or in the folder it would be made in, tried by writing
    one (and removing it: nothing is left behind, not even `out`)."""
    existing = next((q for q in (out, *out.parents) if q.exists()), Path("."))
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".long_eval-write-test-"):
            pass
    except OSError as e:
        raise ConfigError(f"{what} {out}: cannot write there ({existing}: {e.strerror or e}): give a directory "
                          f"this user can write to") from None


def _haystack(cfg: Config, args: argparse.Namespace, settings: LongEvalSettings) -> Optional[DocumentStream]:
    """The real text: --haystack, long_eval.haystack, or the run's validation data (None: there is none, or no
    task reads it)."""
    if all(t == "passkey" for t in settings.tasks):
        return None
    paths = args.haystack or cfg.long_eval.haystack
    if paths:
        return DocumentStream.whole(paths)
    return None if cfg.data.mock else DocumentStream.validation(cfg.data)


def evaluate(args: argparse.Namespace) -> int:
    """Load, lay out, check, evaluate and (rank 0) write the results. What can be checked without the weights
    is checked before they are read."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    out = Path(args.out or args.run)
    if is_rank0() and args.out:       # before any work: the results must have somewhere to go
        check_output(out, "--out")
    cfg, tok = _run_config(args) if args.run else _hf_config(args)
    if is_rank0() and not args.out:
        check_output(out, "the run directory")
    cfg, note = _fit_layout(cfg, world, args.overrides)
    prompts = Prompts(tok, cfg.data.bos)
    settings, dropped = _settings(cfg, args, prompts, None)
    haystack = _haystack(cfg, args, settings)
    check_settings(settings, prompts, haystack, text_only(tok))
    if args.run:
        weights, trained = _run_checkpoint(args, cfg)
    else:
        weights, trained = Path(args.from_hf), open_hf_dir(args.from_hf)[0].get("max_position_embeddings")
    if not settings.lengths:
        settings, dropped = _settings(cfg, args, prompts, trained)
        if not settings.lengths:
            raise LongEvalError(f"{args.from_hf}'s config.json gives no max_position_embeddings: give --lengths")
        check_settings(settings, prompts, haystack, text_only(tok))
    cfg.long_eval.lengths = list(settings.lengths)          # phases of the plan (compiled attention's shapes)
    run = resolve(cfg, Machine.current(local_device(cfg.parallel.backend)), world)
    device = init_distributed(run.collective, cfg.parallel.timeout_seconds)
    if run.attention == "flex" and device.type == "cuda":
        reserve_compiles(flex_compile_budget(run))
    grid = ParallelGrid.for_plan(run, cfg.parallel.timeout_seconds)
    if note:
        print0(note)
    print0(startup_line(cfg, grid, run))
    for line in plan_lines(settings, trained, dropped):
        print0(line)
    model = build_run(cfg, run, grid, device, Parts(optimizer=False, initial=weights)).model
    evaluator = LongEval(cfg, grid, device, run, tok, haystack)
    where: list[str] = ["starting"]
    start = time.perf_counter()
    try:
        report = evaluator.run(model, settings, trained, where.append,
                               lambda done: print0(progress_line(done, time.perf_counter() - start)))
    except (torch.OutOfMemoryError, MemoryError):
        raise LongEvalError(f"out of memory while {where[-1]}: this layout cannot hold that length; evaluate shorter "
                            f"--lengths, or spread the sequence over more ranks (--set parallel.sp=N) or into "
                            f"smaller pieces (training.attention_head_chunks, training.mlp_chunk_tokens)") from None
    if is_rank0():
        _write(out, report, settings, weights, {
            "world": world, "tp": grid.tp_size, "sp": grid.sp_size, "ulysses": grid.ulysses_size,
            "ring": grid.ring_size, "pp": grid.pp_size, "dp": grid.dp_size, "attention": run.attention,
            "dtype": run.dtype, "startup": startup_line(cfg, grid, run)})
    return 0


def _write(out: Path, report: Any, settings: LongEvalSettings, weights: Path, layout: dict) -> None:
    """long_eval.json, long_eval.md (printed first, so that a failing write loses nothing) and the pictures, in
    `out`; ConfigError when they cannot be written there."""
    trained = report.trained_length
    table = markdown(report.results, trained)
    print(table, end="", flush=True)
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_results(out, report.results, trained, {
            "source": str(weights), "settings": dataclasses.asdict(settings), "layout": layout,
            "seconds": {str(n): round(t, 3) for n, t in report.seconds.items()}})
        (out / MARKDOWN_NAME).write_text(table)
        pictures = draw(report.results, out, trained)
    except ImportError:
        print("warning: no pictures: they need matplotlib (pip install 'megalysses[plot]')", file=sys.stderr)
        pictures = []
    except OSError as e:
        raise ConfigError(f"cannot write the results into {out} ({e.strerror or e}; the tables are printed above): "
                          f"give --out a directory this user can write to") from None
    print(f"wrote {out / 'long_eval.json'}, {out / MARKDOWN_NAME}" + "".join(f", {p}" for p in pictures))


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.from_hf and not args.out:
        p.error("--from-hf needs --out: the folder the results go to")
    if args.step is not None and not args.run:
        p.error("--step goes with --run: it picks a checkpoint of the run")
    for flag, values in (("--lengths", args.lengths), ("--depths", args.depths)):
        if values is not None and not values:
            p.error(f"{flag} is empty: give comma-separated numbers")
    if args.samples is not None and args.samples < 1:
        p.error(f"--samples {args.samples}: give at least 1")
    if args.out is not None:
        blocker = next((q for q in (Path(args.out), *Path(args.out).parents) if q.exists()), Path("."))
        if not blocker.is_dir():
            p.error(f"--out {args.out}: {blocker} is a file: give a directory")
    rank0 = os.environ.get("RANK", "0") == "0"
    import torch.distributed as dist

    owned = not dist.is_initialized()
    try:
        return evaluate(args)
    except ERRORS as e:
        if rank0:
            print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    finally:
        if owned:
            destroy_distributed()


def cli() -> int:
    return main()


if __name__ == "__main__":
    sys.exit(cli())
