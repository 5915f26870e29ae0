"""The memory model and activation offload against real training steps: predicted vs measured peak memory,
and tokens/s and MFU by sequence length, on one GPU.

    python benchmarks/bench_memory.py              # gpt_1b_1m_offload: Llama-3.2-1B shape, 32K..1M tokens
    python benchmarks/bench_memory.py --lengths 32768 131072 --set training.activation_offload=false \\
        --set model.kernels=torch [--out-dir runs/memory | --record]
    python benchmarks/bench_memory.py --smoke      # a tiny shape on CPU: the harness end to end (the suite runs it)
    python benchmarks/bench_memory.py --lengths 1048576 --steps 1 --time-budget 0 --record   # no time limit

Each length runs in its own process, built as pretrain builds it (tp = sp = pp = 1, a world of one):
two optimizer steps on random tokens; the second is measured. With --steps 1 (for lengths whose step
takes minutes) the optimizer state is created first, as a resumed run has it, and the one step is
measured; its time then includes first-call work. Columns: the predicted peak (megalysses.memory, asked
about the attention backend the run resolved) and the measured one (torch.cuda.max_memory_allocated over
the second step) with their error, the host memory offload used, the step time, tokens/s and MFU (the 6N +
6LHDS FLOPs per token of training/metrics.py against the GPU's bf16 peak). A length that runs out of memory is a row
saying so. Then the issue's targets: the longest length that trained, the MFU at 512K within 15% of the
MFU at 128K (offload hidden behind compute), and every error within 10%. Prints the table; with --out-dir
(or --record: benchmarks/results/) writes memory_<device>.json with the commit, the device and the torch /
CUDA versions, rewritten after every length, so a run cut short keeps the rows done so far; rows that an
earlier run of the same config, overrides, device and commit wrote to the same file for other lengths are
kept, so lengths run as separate commands (a 1M-token step takes minutes) add up to one record and one
check of the targets. --time-budget (seconds, default 570, 0: none) bounds
the whole run: a length still running when it ends is stopped and is a row saying so, and the lengths
after it are rows saying they were not run.

On CPU (--smoke) there is no allocator statistic: the measured column is the peak of live tensor bytes
(megalysses.measure.measure_peak, host copies of offload excluded), so the same comparison runs without
a GPU.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megalysses.config import Config, ConfigError  # noqa: E402
from megalysses.config.checks import validate_config  # noqa: E402
from megalysses.config.io import load_config  # noqa: E402
from megalysses.memory import GIB, fmt_bytes  # noqa: E402
from megalysses.plan.memory import estimate_plan  # noqa: E402
from benchmarks.harness import source_commit  # noqa: E402

from benchmarks.harness import add_output_args, output_dir, run_bounded, write_text  # noqa: E402
from benchmarks.bench_gpu import allocator_figures, cap_memory  # noqa: E402

SMOKE = ["model.vocab_size=256", "model.hidden_size=64", "model.num_layers=4", "model.num_heads=4",
         "model.num_kv_heads=2", "model.ffn_hidden_size=160", "model.attention_backend=sdpa", "model.kernels=torch",
         "training.global_batch_size=1", "training.micro_batch_size=1", "training.dtype=bfloat16",
         "training.mlp_chunk_tokens=64", "training.loss_chunk_tokens=64",
         # a gradient bucket smaller than a layer, as at the real shape (32M elements against 61M a block)
         "parallel.grad_bucket_elements=16384"]
TARGET_LENGTHS = (131072, 524288)           # the MFU at the second within 15% of the first


def batch(cfg: Config, device: torch.device, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    B, S = cfg.training.micro_batch_size, cfg.data.seq_len
    tokens = torch.randint(0, cfg.model.vocab_size, (B, S + 1), generator=g).to(device)
    return [{"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
             "position_ids": torch.arange(S, device=device).expand(B, S)}]


def run_length(cfg: Config, device: torch.device, steps: int = 2) -> dict:
    """One length in this process: build, step `steps` times (1 or 2), measure the last step."""
    import torch.distributed as dist

    from megalysses.grid import ParallelGrid
    from megalysses.measure import host_resident, measure_peak
    from megalysses.model.policies import activation_offload
    from megalysses.training.build import build_run
    from megalysses.plan.flops import flops_per_token
    from megalysses.training.metrics import peak_for
    from megalysses.testing import resolve_run
    from megalysses.training.step import train_step

    validate_config(cfg, world_size=1)
    if cfg.parallel.fsdp and not dist.is_initialized():    # FSDP2 shards over a device mesh: a group of one
        store = Path(tempfile.mkdtemp()) / "store"
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store}",
                                rank=0, world_size=1)
    grid = ParallelGrid.single()
    runtime = resolve_run(cfg, device, grid)
    built = build_run(cfg, runtime, grid, device)
    model, opt = built.model, built.opt
    predicted = estimate_plan(cfg, runtime)            # for the backend and kernels the run resolved
    step = dict(lr=cfg.optimizer.lr, grad_clip=cfg.optimizer.grad_clip, dtype=runtime.torch_dtype)
    S = cfg.data.seq_len
    row = {"seq_len": S, "dtype": runtime.dtype, "attention": runtime.attention, "kernels": runtime.kernels,
           "activation_offload": cfg.training.activation_offload, "optimizer_offload": cfg.training.optimizer_offload,
           "predicted_gib": predicted.peak / GIB, "predicted_part": predicted.part,
           "predicted_host_gib": predicted.host / GIB, "steps": steps}
    if steps == 2:
        train_step(model, opt, batch(cfg, device, 0), grid, **step)      # the optimizer state exists after this
    else:
        for _ in opt.checkpoint_slots():                                 # creates it, as a resume does
            pass
    second = batch(cfg, device, 1)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        result = train_step(model, opt, second, grid, **step)
        torch.cuda.synchronize(device)
        row["step_s"] = time.perf_counter() - start
        row["measured_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        row["measured"] = "torch.cuda.max_memory_allocated"
        row.update(allocator_figures(device))       # before any empty_cache
    else:
        state = [t for st in opt.optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
        masters = [s.master for s in getattr(opt, "slots", []) if s.master is not None]
        before = list(model.parameters()) + state + masters + [t for mb in second for t in mb.values()]
        start = time.perf_counter()
        result, peak = measure_peak(lambda: train_step(model, opt, second, grid, **step), before,
                                    host=host_resident(model, opt, runtime))    # what a GPU keeps in host memory
        row["step_s"] = time.perf_counter() - start
        row["measured_gib"] = peak.bytes / GIB
        row["measured"] = "megalysses.measure.measure_peak (CPU)"
        row.update(allocator_figures(device))       # None each: no allocator on CPU
    offload = activation_offload(model)
    if offload is not None:
        row["host_gib"] = sum(t.numel() * t.element_size() for t in offload.host_buffers()) / GIB
        row["prefetched"], row["on_demand"] = offload.stats.prefetched, offload.stats.on_demand
    row["loss"] = result.loss
    row["error"] = row["predicted_gib"] / row["measured_gib"] - 1
    row["tokens_per_s"] = S * cfg.training.global_batch_size / row["step_s"]
    peak_flops = peak_for(cfg.logging.peak_tflops, device, runtime.torch_dtype)
    row["mfu"] = flops_per_token(cfg.model, S) * row["tokens_per_s"] / (peak_flops * 1e12) if peak_flops else None
    return row


def child(args: argparse.Namespace, overrides: list[str]) -> int:
    """--child: one length on the GPU (on the CPU where there is none), one JSON line on stdout (out of memory
    is a row too)."""
    cfg = load_config(args.config, overrides + [f"data.seq_len={args.child}"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cap = cap_memory(device)
    try:
        row = {**run_length(cfg, device, args.steps), **cap}
    except torch.cuda.OutOfMemoryError as e:
        from megalysses.testing import resolve_run

        row = {"seq_len": args.child, "error_text": f"out of memory: {str(e).splitlines()[0]}",
               "predicted_gib": estimate_plan(cfg, resolve_run(cfg, device)).peak / GIB, **cap}
    print("ROW " + json.dumps(row), flush=True)
    return 0


def in_subprocess(config: str, overrides: list[str], length: int, steps: int, timeout: float | None,
                  log=None) -> dict:
    """One length of `config` (+ overrides) in a process of its own, killed with what it started at `timeout`
    seconds (None: no limit): its row. `log(what, output)` receives the output of a child that failed."""
    cmd = [sys.executable, __file__, "--config", config, "--child", str(length), "--steps", str(steps)]
    cmd += [a for o in overrides for a in ("--set", o)]
    done = run_bounded(cmd, timeout)
    rows = [json.loads(line[4:]) for line in done.stdout.splitlines() if line.startswith("ROW ")]
    if rows:
        return rows[0]
    if log is not None:
        log(f"bench_memory child {length} tokens ({config})", done.stdout + done.stderr)
    if done.timed_out:
        return {"seq_len": length, "error_text": "did not finish within the time budget"}
    return {"seq_len": length, "error_text": f"exit {done.returncode}: {done.last_line()}"}


def targets(rows: list[dict]) -> dict:
    ran = [r for r in rows if "measured_gib" in r]
    out = {"longest_trained": max((r["seq_len"] for r in ran), default=0),
           "max_abs_error": max((abs(r["error"]) for r in ran), default=None)}
    mfu = {r["seq_len"]: r.get("mfu") for r in ran}
    short, long_ = TARGET_LENGTHS
    if mfu.get(short) and mfu.get(long_):
        out["mfu_ratio_512k_to_128k"] = mfu[long_] / mfu[short]
    return out


def earlier_rows(out: Path, record: dict, lengths: list[int]) -> list[dict]:
    """The rows an earlier run of the same benchmark (config, overrides, device, commit) wrote to `out` for
    lengths other than `lengths`."""
    try:
        old = json.loads(out.read_text())
    except (OSError, ValueError):
        return []
    if any(old.get(k) != record[k] for k in ("config", "overrides", "device", "commit")):
        return []
    return [r for r in old.get("rows", []) if r.get("seq_len") not in lengths]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs" / "gpt_1b_1m_offload.yaml"))
    p.add_argument("--lengths", type=int, nargs="+", default=None,
                   help="sequence lengths (default 32768 131072 524288 1048576; with --smoke 256 1024)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--smoke", action="store_true", help="tiny shape on CPU, lengths 256 and 1024, in this process")
    add_output_args(p)
    p.add_argument("--steps", type=int, default=2, choices=(1, 2),
                   help="steps per length; the last is measured (1: for lengths whose step takes minutes)")
    p.add_argument("--time-budget", type=float, default=570.0,
                   help="seconds for the whole benchmark (0: none): a length still running when it ends is "
                        "stopped, and the lengths after it are not run (both are rows saying so)")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    folder = output_dir(p, args, args.smoke)
    start = time.monotonic()
    if args.time_budget < 0:
        print(f"error: --time-budget {args.time_budget:g} is negative: give seconds, or 0 for no budget",
              file=sys.stderr)
        return 1
    overrides = ["data.mock=true", "data.document_mask=false"] + (SMOKE if args.smoke else []) + args.overrides
    if args.child is not None:
        return child(args, overrides)
    try:
        base = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not args.smoke and not torch.cuda.is_available():
        print("error: no GPU here: this benchmark measures torch.cuda.max_memory_allocated; use --smoke on CPU",
              file=sys.stderr)
        return 1
    lengths = args.lengths or ([256, 1024] if args.smoke else [32768, 131072, 524288, 1048576])
    deadline = start + args.time_budget if args.time_budget else float("inf")
    name = torch.cuda.get_device_name().replace(" ", "_") if not args.smoke else "cpu"
    out = folder / f"memory_{name}.json" if folder is not None else None
    record = {"config": args.config, "overrides": overrides, "device": name, "commit": source_commit() or "unknown",
              "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
    print(f"{'seq_len':>9} {'predicted':>11} {'measured':>11} {'error':>7} {'host':>10} {'step s':>8} {'tok/s':>9} "
          f"{'MFU':>6}  part", flush=True)
    kept = earlier_rows(out, record, lengths) if out is not None else []
    if kept:
        print(f"kept from an earlier run in {out}: the rows of {', '.join(str(r['seq_len']) for r in kept)}",
              flush=True)
    rows = []
    for S in lengths:
        if time.monotonic() >= deadline:
            row = {"seq_len": S, "error_text": "not run: the time budget ended"}
        elif args.smoke:
            row = run_length(replace(base, data=replace(base.data, seq_len=S)), torch.device("cpu"), args.steps)
        else:
            row = in_subprocess(args.config, args.overrides, S, args.steps,
                                max(1.0, deadline - time.monotonic()) if args.time_budget else None)
        rows.append(row)
        every = sorted(kept + rows, key=lambda r: r["seq_len"])
        if out is not None:
            write_text(out.parent, out.name, json.dumps({**record, "rows": every, "targets": targets(every)}, indent=1))
        if "measured_gib" not in row:
            predicted = fmt_bytes(row["predicted_gib"] * GIB) if "predicted_gib" in row else "-"
            print(f"{S:>9} {predicted:>11}  {row['error_text']}", flush=True)
            continue
        mfu = f"{row['mfu']:.1%}" if row["mfu"] else "-"
        print(f"{S:>9} {fmt_bytes(row['predicted_gib'] * GIB):>11} {fmt_bytes(row['measured_gib'] * GIB):>11} "
              f"{row['error']:>+7.1%} {fmt_bytes(row.get('host_gib', 0) * GIB):>10} {row['step_s']:>8.2f} "
              f"{row['tokens_per_s']:>9.0f} {mfu:>6}  {row['predicted_part']}", flush=True)
    summary = targets(every)                                            # this run's rows and the kept ones
    print("targets: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()),
          flush=True)
    if out is not None:
        print(f"wrote {out}", flush=True)                               # after every length, above
    return 0


if __name__ == "__main__":
    sys.exit(main())
