"""Checkpoint saves: the training stall per save, synchronous (checkpoint.async_save=false) against background
(checkpoint.async_save=true), the same state on the same ranks.

    OMP_NUM_THREADS=1 python benchmarks/bench_checkpoint.py [--hidden 1024 --layers 12 --ffn 2816 --vocab 32000]
                                                            [--steps 12 --interval 4] [--out-dir DIR | --record]

Two gloo ranks on CPU (dp=2, ZeRO-1, fp32) train a Llama-shaped model (about 200M parameters by default: a 1B
model's state does not fit a 23 GiB machine twice) on mock data, saving every --interval steps, once with each
mode into a checkpoint directory under the system's temporary folder. Timed on rank 0:

- stall: the time the training loop spends in its save (TrainingLoop.save: synchronous, the whole save; in the
  background, waiting for the previous save (if it is still being written), staging the state into the pinned
  arena and starting the write);
- staging / waiting: the background save's two parts of it;
- step: the median training step with no save in flight, and while a background write is in flight (the two CPU
  ranks and the writer share the machine's cores, so the write slows training there; a GPU's steps do not share
  the host's cores with it);
- end: the save at the end of training, until it is complete (both modes wait for it there: it is not counted
  in the stall).
 Prints a markdown table;
with --out-dir (or --record: benchmarks/results/) writes it as checkpoint.md.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import add_output_args, output_dir, write_text  # noqa: E402
from megalysses.testing import run_distributed  # noqa: E402


def _worker(rank: int, world: int, overrides: list[str], run_dir: str) -> dict:
    """One run of training with saves on this rank; its timings."""
    import torch

    from megalysses.config.io import load_config
    from megalysses.training import loop
    from megalysses.testing import plan_and_grid

    times: dict = {"save": [], "staging": [], "waiting": [], "steps": [], "end": 0.0, "params": 0}
    real_save, real_finish, real_step = loop.TrainingLoop.save, loop.TrainingLoop.finish_saves, loop.train_step
    current: list = [None]

    def writing() -> bool:
        saver = current[0].saver if current[0] is not None else None
        return saver is not None and saver.pending is not None and not saver.pending.done()

    def save(self) -> None:
        current[0] = self
        t0 = time.perf_counter()
        if self.saver is not None:
            self.saver.wait()
        t1 = time.perf_counter()
        real_save(self)
        t2 = time.perf_counter()
        if self.progress.step < self.cfg.training.train_steps:     # not the save at the end of training
            times["save"].append(t2 - t0)
            times["waiting"].append(t1 - t0)
            times["staging"].append(t2 - t1)
        else:
            times["end"] = t2 - t0
        times["params"] = sum(p.numel() for p in self.model.parameters())

    def finish(self, quiet: bool = False) -> None:
        t0 = time.perf_counter()
        real_finish(self, quiet)
        if not quiet:
            times["end"] += time.perf_counter() - t0

    def step(model, opt, *args, **kwargs):
        busy = writing()
        t0 = time.perf_counter()
        out = real_step(model, opt, *args, **kwargs)
        times["steps"].append((busy, time.perf_counter() - t0))
        return out

    loop.TrainingLoop.save, loop.TrainingLoop.finish_saves, loop.train_step = save, finish, step
    cfg = load_config(overrides=overrides + [f"logging.run_dir={run_dir}"])
    run, grid = plan_and_grid(cfg, torch.device("cpu"))
    loop.train(cfg, run, grid, torch.device("cpu"))
    return times


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--interval", type=int, default=4)
    add_output_args(p)
    args = p.parse_args()
    folder = output_dir(p, args)
    base = ["data.mock=true", f"data.seq_len={args.seq_len}", f"model.vocab_size={args.vocab}",
            f"model.hidden_size={args.hidden}", f"model.num_layers={args.layers}", f"model.num_heads={args.heads}",
            f"model.ffn_hidden_size={args.ffn}", "training.global_batch_size=2", "training.micro_batch_size=1",
            f"training.train_steps={args.steps}", f"checkpoint.save_interval={args.interval}",
            "checkpoint.keep_last=1", "training.eval_interval=0", "logging.log_interval=1000",
            "parallel.timeout_seconds=600", "optimizer.warmup_steps=1"]
    rows = {}
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
        for mode in ("false", "true"):
            t0 = time.perf_counter()
            rows[mode] = run_distributed(_worker, 2, tmp, args=(base + [f"checkpoint.async_save={mode}"],
                                                                 str(Path(tmp) / mode)), timeout=3600,
                                         pg_timeout=600)[0]
            print(f"async_save={mode}: {time.perf_counter() - t0:.0f} s", flush=True)
    sync, bg = rows["false"], rows["true"]
    stall_sync, stall_bg = _median(sync["save"]), _median(bg["save"])
    idle = _median([t for busy, t in bg["steps"] if not busy] + [t for _, t in sync["steps"]][1:])
    writing = _median([t for busy, t in bg["steps"] if busy])
    lines = [
        (f"Two gloo ranks on CPU (dp=2, ZeRO-1, fp32), {bg['params'] / 1e6:.0f}M parameters (hidden {args.hidden}, "
         f"{args.layers} layers, ffn {args.ffn}, vocab {args.vocab}), a save every {args.interval} steps of "
         f"{args.steps}; medians over the {len(bg['save'])} saves before the last, rank 0."),
        "",
        "| | synchronous | background | ratio |",
        "|---|---:|---:|---:|",
        f"| training stall per save (s) | {stall_sync:.2f} | {stall_bg:.2f} | {stall_sync / stall_bg:.1f}x |",
        f"| of which staging into the arena (s) | - | {_median(bg['staging']):.2f} | |",
        f"| of which waiting for the previous save (s) | - | {_median(bg['waiting']):.2f} | |",
        f"| training step, no write in flight (s) | {idle:.2f} | | |",
        f"| training step, a background write in flight (s) | | {writing:.2f} | {writing / idle:.2f}x |",
        f"| the save at the end of training, until complete (s) | {sync['end']:.2f} | {bg['end']:.2f} | |",
        "",
        (f"Each save's stall (s): synchronous {', '.join(f'{t:.2f}' for t in sync['save'])}; background "
         f"{', '.join(f'{t:.2f}' for t in bg['save'])}."),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if folder is not None:
        write_text(folder, "checkpoint.md", "# Checkpoint saves: synchronous against background\n\n"
                   "`OMP_NUM_THREADS=1 python benchmarks/bench_checkpoint.py --record`\n\n" + text)


if __name__ == "__main__":
    main()
