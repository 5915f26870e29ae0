"""The memory model against a real training step: predicted vs measured peak memory on one GPU.

    python benchmarks/bench_memory.py                      # Llama-3.2-1B shape, 32K and 128K tokens
    python benchmarks/bench_memory.py --config configs/gpt_1b_1m_offload.yaml --lengths 32768 131072 262144 \\
        --set training.activation_offload=false [--implementation fused] [--json benchmarks/results/memory_h100.json]
    python benchmarks/bench_memory.py --smoke              # a tiny shape on CPU: the harness end to end

For each length, one process builds the model and optimizer as pretrain does (tp = sp = pp = 1, a world
of one), runs two optimizer steps on random tokens, and compares torch.cuda.max_memory_allocated over
the second step with megalysses.memory's predicted peak (the precision scheme is read off the built
model: fp32 weights under bf16 compute are today's autocast path). Prints predicted, measured and the
error per length and writes JSON with the commit, the device and the torch / CUDA versions.

On CPU (--smoke) there is no allocator statistic: the measured column is the activation bytes one
forward leaves for the backward (megalysses.memory.measure_retained) against the model's retained
activations, and the full step still runs, so the harness stays tested without a GPU.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megalysses.config import Config, ConfigError, load_config, validate_config  # noqa: E402
from megalysses.grid import ParallelGrid  # noqa: E402
from megalysses.kernels.attention import resolve_backend  # noqa: E402
from megalysses.memory import (GIB, PRECISIONS, estimate, fmt_bytes, layout_of, measure_retained, options_of,  # noqa: E402
                               retained_activation_bytes, workload_of)
from megalysses.training.loop import build_model, build_optimizer, compute_dtype  # noqa: E402
from megalysses.training.step import train_step  # noqa: E402

SMOKE = ["model.vocab_size=256", "model.hidden_size=64", "model.num_layers=2", "model.num_heads=4",
         "model.num_kv_heads=2", "model.ffn_hidden_size=160", "model.attention_backend=sdpa",
         "training.global_batch_size=1", "training.micro_batch_size=1", "training.dtype=float32"]


def scheme(model: torch.nn.Module, dtype: torch.dtype) -> str:
    """The precision scheme of the built model: PRECISIONS' key."""
    weights = next(model.parameters()).dtype
    if dtype == torch.float32:
        return "fp32"
    return "autocast" if weights == torch.float32 else "bf16"


def batch(cfg: Config, device: torch.device, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    B, S = cfg.training.micro_batch_size, cfg.data.seq_len
    tokens = torch.randint(0, cfg.model.vocab_size, (B, S + 1), generator=g).to(device)
    return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "position_ids": torch.arange(S, device=device).expand(B, S)}


def run_length(cfg: Config, device: torch.device, implementation: str) -> dict:
    """One length: build, step twice, measure; returns a result row."""
    cfg = replace(cfg, model=replace(cfg.model, attention_backend=resolve_backend(
        cfg.model.attention_backend, device, compute_dtype(cfg, device), has_docs=False)))
    validate_config(cfg, world_size=1)
    grid = ParallelGrid(world=1, rank=0)
    dtype = compute_dtype(cfg, device)
    model = build_model(cfg, grid, device, mesh=None)
    opt = build_optimizer(cfg, model, grid)
    prec = PRECISIONS[scheme(model, dtype)]
    opts = replace(options_of(cfg, device.type), implementation=implementation)
    layout = layout_of(cfg, 1)
    predicted = estimate(cfg.model, layout, opts, prec, workload_of(cfg, layout))
    step = dict(lr=cfg.optimizer.lr, grad_clip=cfg.optimizer.grad_clip, dtype=dtype)
    row = {"seq_len": cfg.data.seq_len, "precision": prec.name, "attention": opts.attention,
           "predicted_gib": predicted.peak / GIB, "predicted_phase": predicted.phase}
    if device.type == "cuda":
        train_step(model, opt, [batch(cfg, device, 0)], grid, **step)        # optimizer state exists after this
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        train_step(model, opt, [batch(cfg, device, 1)], grid, **step)
        torch.cuda.synchronize(device)
        row["measured_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        row["measured"] = "torch.cuda.max_memory_allocated"
    else:
        mb = batch(cfg, device, 0)
        params = tuple(model.parameters())
        _, kept = measure_retained(lambda: model(mb["input_ids"], mb["position_ids"], labels=mb["labels"]),
                                   exclude=params + (mb["position_ids"],))
        row["predicted_gib"] = retained_activation_bytes(cfg.model, layout, opts, prec, cfg.data.seq_len,
                                                         cfg.training.micro_batch_size) / GIB
        row["predicted_phase"] = "retained activations"
        row["measured_gib"] = kept.bytes / GIB
        row["measured"] = "memory.measure_retained (CPU)"
        row["loss"] = train_step(model, opt, [batch(cfg, device, 1)], grid, **step).loss
    row["error"] = row["predicted_gib"] / row["measured_gib"] - 1
    return row


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs" / "gpt_1b_1m_offload.yaml"))
    p.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--implementation", default="megalysses", help="memory-model kernel table (megalysses or fused)")
    p.add_argument("--smoke", action="store_true", help="tiny shape on CPU, lengths 128 and 256")
    p.add_argument("--json", default=None, help="where to write the results (default benchmarks/results/memory_<device>.json)")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    overrides = ["data.mock=true", "data.document_mask=false", "training.activation_offload=false"] + args.overrides
    lengths = [128, 256] if args.smoke else args.lengths
    if args.smoke:
        overrides += SMOKE
    try:
        base = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if device.type == "cpu" and not args.smoke:
        print("error: no GPU here: this benchmark measures torch.cuda.max_memory_allocated; use --smoke on CPU",
              file=sys.stderr)
        return 1
    rows = []
    print(f"{'seq_len':>9} {'precision':>9} {'attention':>9} {'predicted':>12} {'measured':>12} {'error':>7}  phase")
    for S in lengths:
        row = run_length(replace(base, data=replace(base.data, seq_len=S)), device, args.implementation)
        if device.type == "cuda":
            torch.cuda.empty_cache()                    # the previous length's model and optimizer are gone
        rows.append(row)
        print(f"{S:>9} {row['precision']:>9} {row['attention']:>9} {fmt_bytes(row['predicted_gib'] * GIB):>12} "
              f"{fmt_bytes(row['measured_gib'] * GIB):>12} {row['error']:>+7.1%}  {row['predicted_phase']}")
    name = torch.cuda.get_device_name(device).replace(" ", "_") if device.type == "cuda" else "cpu"
    out = Path(args.json) if args.json else ROOT / "benchmarks" / "results" / f"memory_{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": args.config, "overrides": overrides, "implementation": args.implementation,
                               "device": name, "commit": commit(), "torch": torch.__version__,
                               "cuda": torch.version.cuda, "python": platform.python_version(), "rows": rows},
                              indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
