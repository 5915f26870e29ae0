"""The memory model against the memory trace at the real shapes: every shipped config at its GPU count, and the
long-sequence cases at the layout the planner ranks first (Llama-3.1-8B at 1M tokens on one H100, 6M on eight
and 24M on 32, with 1,769 GiB of host memory per node; Llama-3.2-1B at 1M on one H100 with 120 GiB; Triton
kernels, global batch 1; the one-GPU 1B shape at 16K and 32K; the packed documents data.documents_per_million
states, 1,000 a million, and the worst case the corpus tools allow, one every 2 tokens, at 1M on one GPU for the
8B and at 16K and 32K for the 1B), each one training step traced on fake tensors
(megalysses/training/trace.py: rank 0 of its first and last pipeline stage, the run's own code at the real
shape, no GPU needed), and its traced roofline (training/roofline.py) against the step-time model: a second
table of seconds per optimizer step by category, traced / modelled, with the kernel launches, host syncs
and mask evaluations.

    python benchmarks/bench_trace.py                         # every case (the 24M one takes longest)
    python benchmarks/bench_trace.py --cases gpt_1b_32k 8b-1m-1 [--out-dir DIR | --record] [--name memory_trace]
    python benchmarks/bench_trace.py --cases 8b-6m-8 8b-24m-32 --masks per-pair --out-dir DIR --name before

A row: the traced peak per GPU, its moment and the memory model's name for it; the model's peak and part,
and its bytes at the traced moment; host memory per node traced (all of it, and the pinned part) and modelled;
the usable budget of the layout (an H100 80GB as exposed, less the reserve and the fragmentation allowance of
at least the traced largest allocation) and whether the traced peak fits it; the activation bytes per token
(what the step adds to the weights and optimizer state at its peak, per token of the rank); the trace's time.
With --masks per-pair a ring layout's FlexAttention block masks are built as before kernels/block_mask.py
(benchmarks/per_pair_masks.py: create_block_mask's mask_mod on every pair, at every use), the step traced
again for the comparison; a third table gives its mask builds (and today's) per optimizer step, and the
memory model (today's masks, kept) is not held to these rows.
A long case whose length no layout fits is a row saying so. Prints a markdown table; with --out-dir (or
--record: benchmarks/results/) writes <name>.json and <name>.md. Exits non-zero when the model is more than 3%
from a trace, or at another moment.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import add_output_args, output_dir, write_text  # noqa: E402
from benchmarks.per_pair_masks import Builds, per_pair_forms  # noqa: E402
from megalysses.config.io import load_config  # noqa: E402
from megalysses.memory import GIB  # noqa: E402
from megalysses.plan.machine import device_memory_gib  # noqa: E402
from megalysses.plan.search import Prediction, evaluate, plan  # noqa: E402
from megalysses.plan.step_time import Hardware  # noqa: E402
from megalysses.training.trace import (model_part, roofline_fields, trace_run, traced_micro_batches,  # noqa: E402
                                       traced_peak)

SHIPPED = {"quickstart": 4, "gpt_1b_32k": 8, "gpt_1b_8gpu": 8, "gpt_1b_1m_offload": 1, "llama3_8b_128k": 32,
           "llama3_8b_1m": 64, "llama3_8b_chat_128k": 8}
WORST = 500_000     # documents a million tokens: a one-token text and its EOD each (tools/preprocess_data.py
                    # --append-eod), the most the corpus tools write; the other cases at data.documents_per_million's
                    # default, 1,000
LONG = {   # name: (config, GPUs, tokens, host GiB per node[, documents a million tokens])
    "8b-1m-1": ("llama3_8b_1m", 1, 1 << 20, 1769), "8b-6m-8": ("llama3_8b_1m", 8, 6 << 20, 1769),
    "8b-24m-32": ("llama3_8b_1m", 32, 24 << 20, 1769), "1b-1m-1": ("gpt_1b_1m_offload", 1, 1 << 20, 120),
    "1b-16k-1": ("gpt_1b_1m_offload", 1, 16 << 10, 120), "1b-32k-1": ("gpt_1b_1m_offload", 1, 32 << 10, 120),
    "8b-1m-1-worst": ("llama3_8b_1m", 1, 1 << 20, 1769, WORST),
    "1b-16k-1-worst": ("gpt_1b_1m_offload", 1, 16 << 10, 120, WORST),
    "1b-32k-1-worst": ("gpt_1b_1m_offload", 1, 32 << 10, 120, WORST)}
TOLERANCE = 0.03


def long_config(name: str):
    config, *_ = LONG[name]
    over = ["data.mock=true", "data.paths=[]", "training.global_batch_size=1", "model.kernels=triton"]
    if len(LONG[name]) > 4:
        over.append(f"data.documents_per_million={LONG[name][4]}")
    if config.startswith("llama3_8b"):
        over += ["parallel.pp=1", "parallel.virtual_stages=1"]
    return load_config(ROOT / "configs" / f"{config}.yaml", over)


def prediction(name: str, hw: Hardware, memory: float):
    """(the config, GPUs, host GiB per node, the planner's Prediction: the shipped config's own, or the long
    case's top-ranked layout; None when no layout fits)."""
    if name in SHIPPED:
        cfg = load_config(ROOT / "configs" / f"{name}.yaml", ["data.mock=true", "data.paths=[]"])
        return cfg, SHIPPED[name], None, evaluate(cfg, SHIPPED[name], memory, None, hw)
    _, gpus, tokens, host, *_ = LONG[name]
    fitting, _ = plan(long_config(name), gpus, tokens, memory, host_memory_gib=host, hw=hw)
    return None, gpus, host, (fitting[0] if fitting else None)


def measure(name: str, hw: Hardware, memory: float, masks: str = "kept") -> dict:
    start = time.perf_counter()
    cfg, gpus, host_budget, p = prediction(name, hw, memory)
    row = {"case": name, "gpus": gpus}
    if p is None:
        tokens = LONG[name][2]
        return {**row, "seq_len": tokens, "fits": False, "why": "no layout fits (the memory model's planner)"}
    cfg = p.cfg
    builds = Builds()
    if masks == "per-pair" and (p.plan.degrees.ring < 2 or p.plan.attention != "flex"):
        sys.exit(f"error: --masks per-pair reinstates the old masks of a ring's FlexAttention blocks, and {name} "
                 f"is planned as {layout_text(p)}, {p.plan.attention}; give ring cases with flex")
    traces = trace_run(cfg, p.plan.machine, gpus, hw=hw, forms=per_pair_forms(builds) if masks == "per-pair" else None)
    if masks == "per-pair":      # per optimizer step, as the roofline scales its micro-batches
        scale = p.plan.micro_batches / traced_micro_batches(p.plan.micro_batches, p.plan)
        row.update(masks="per-pair", mask_builds={"kept": builds.kept * scale, "per_pair": builds.per_pair * scale,
                                                  "per_pair_evaluations": builds.evaluations * scale})
    top = traced_peak(traces)
    part = model_part(top.device.moment)
    per_node = min(gpus, hw.gpus_per_node)
    tokens = cfg.training.micro_batch_size * p.plan.padded_seq_len / p.plan.degrees.sp
    usable = hw.usable_bytes(memory, max(t.largest_allocation for t in traces))
    return {**row, "seq_len": p.plan.padded_seq_len, "layout": layout_text(p), "attention": p.plan.attention,
            "kernels": p.plan.kernels, "traced_gib": top.device.bytes / GIB, "traced_stage": top.stage,
            "traced_part": part, "traced_moment": str(top.device.moment),
            **model_columns(p, top.stage, part, top.device.bytes),
            "host_traced_gib_per_node": max(t.host.bytes for t in traces) * per_node / GIB,
            "pinned_traced_gib_per_node": max(t.pinned.bytes for t in traces) * per_node / GIB,
            "host_budget_gib_per_node": host_budget,
            "largest_allocation_gib": max(t.largest_allocation for t in traces) / GIB,
            "usable_gib": usable / GIB, "fits": top.device.bytes <= usable,
            "activation_bytes_per_token": (top.device.bytes - top.before) / tokens,
            "trace_seconds": sum(t.seconds for t in traces), "seconds": time.perf_counter() - start,
            **roofline_fields(traces), "model_step_s": p.step.total, "step_breakdown": p.step.breakdown(hw),
            "traced_by_op_s": dict(sorted(max(traces, key=lambda t: t.roofline.total).roofline.by_op.items(),
                                          key=lambda kv: -kv[1])[:12]),
            "largest_tensors": [{"gib": a.bytes / GIB, "shape": list(a.shape), "dtype": a.dtype, "made": a.made}
                                for a in top.device.largest[:8]]}


def layout_text(p) -> str:
    """The layout of a Prediction, in a table's words."""
    r = p.row()
    return (f"tp{r['tp']} sp{r['sp']} ring{r['ring']} pp{r['pp']} dp{r['dp']}"
            + "".join(f" {k}" for k, v in (("fsdp", r["fsdp"]), ("ckpt", r["activation_checkpointing"]),
                                           ("act-offload", r["activation_offload"]),
                                           ("opt-offload", r["optimizer_offload"]),
                                           ("param-offload", r["param_offload"])) if v)
            + (f" chunks{r['attention_head_chunks']}" if r["attention_head_chunks"] > 1 else "")
            + (f" mlp-tile{r['mlp_chunk_tokens']}" if r["mlp_chunk_tokens"] else ""))


def remodel(row: dict, hw: Hardware, memory: float) -> dict:
    """A recorded row with the models' columns computed again for the traced layout (the traced ones as they
    were): the step-time model's and the memory model's (its peak, part and bytes at the traced moment), and the
    layout the planner ranks first now (`top_layout`); unchanged, marked, when the traced layout no longer fits."""
    if "traced_step_s" not in row:
        return row
    name = row["case"]
    if name in SHIPPED:
        fitting = [prediction(name, hw, memory)[3]]
    else:
        _, gpus, tokens, host, *_ = LONG[name]
        fitting, _ = plan(long_config(name), gpus, tokens, memory, host_memory_gib=host, hw=hw)
    same = [p for p in fitting if layout_text(p) == row["layout"]]
    if not same:
        return {**row, "remodelled": False}
    return {**row, "model_step_s": same[0].step.total, "step_breakdown": same[0].step.breakdown(hw),
            **model_columns(same[0], row["traced_stage"], row["traced_part"], row["traced_gib"] * GIB),
            "remodelled": True, "top_layout": layout_text(fitting[0])}


def model_columns(p: Prediction, stage: int, part: str, traced_bytes: float) -> dict:
    """A row's memory-model columns for the prediction `p` of the traced layout: its peak, stage and part, its
    bytes at the traced moment (pipeline stage `stage`, part `part`), its error against the traced peak's
    `traced_bytes`, and its host memory per node."""
    est = p.estimate
    at_moment = est.parts.get((stage, part))
    return {"model_gib": est.peak / GIB, "model_stage": est.stage, "model_part": est.part,
            "model_at_traced_moment_gib": (at_moment or 0.0) / GIB, "error": est.peak / traced_bytes - 1,
            "host_model_gib_per_node": p.host_per_node / GIB}


def same_moment(row: dict) -> bool:
    """The model's part is the traced one, or its bytes at the traced moment are the traced peak's (ties)."""
    return row["model_part"] == row["traced_part"] or \
        abs(row["model_at_traced_moment_gib"] / row["traced_gib"] - 1) <= TOLERANCE


def table(rows: list[dict]) -> str:
    lines = [("| case | GPUs | tokens | layout | traced GiB | at | model GiB | at | diff | host GiB/node traced "
              "(pinned) / model | usable GiB | fits | act. KB/token | trace s |"),
             "|---|---:|---:|---|---:|---|---:|---|---:|---|---:|---|---:|---:|"]
    for r in rows:
        if "traced_gib" not in r:
            lines.append(f"| {r['case']} | {r['gpus']} | {r['seq_len']} | {r['why']} | | | | | | | | no | | |")
            continue
        lines.append(f"| {r['case']} | {r['gpus']} | {r['seq_len']} | {r['layout']}, {r['attention']} | "
                     f"{r['traced_gib']:.2f} | {r['traced_part']} | {r['model_gib']:.2f} | {r['model_part']} | "
                     f"{r['error']:+.1%} | {r['host_traced_gib_per_node']:.0f} "
                     f"({r['pinned_traced_gib_per_node']:.0f}) / "
                     f"{r['host_model_gib_per_node']:.0f} | {r['usable_gib']:.1f} | {'yes' if r['fits'] else 'no'} | "
                     f"{r['activation_bytes_per_token'] / 1024:.1f} | {r['trace_seconds']:.0f} |")
    return "\n".join(lines)


STEP_COLUMNS = ("compute", "attention", "masks", "communication", "host copies", "optimizer", "launches")


def step_table(rows: list[dict]) -> str:
    """The traced step time against the step-time model's, per optimizer step, by category (seconds traced /
    modelled), with the traced counts."""
    lines = ["| case | traced step s | model step s | " + " | ".join(STEP_COLUMNS) +
             " | kernels | host syncs | mask evaluations |",
             "|---|---:|---:|" + "---:|" * (len(STEP_COLUMNS) + 3)]
    for r in rows:
        if "traced_step_s" not in r:
            continue
        cells = [f"{r['traced_step_breakdown'][k]:.3g} / {r['step_breakdown'].get(k, 0.0):.3g}" for k in STEP_COLUMNS]
        lines.append(f"| {r['case']} | {r['traced_step_s']:.4g} | {r['model_step_s']:.4g} | " + " | ".join(cells) +
                     f" | {r['traced_launches']:,} | {r['traced_host_syncs']} | {r['traced_mask_evaluations']:.3g} |")
    return "\n".join(lines)


def builds_table(rows: list[dict]) -> str:
    """The block masks' builds per optimizer step of the rows traced with --masks per-pair: the old path's (one per
    use, mask_mod on every pair) and today's (one per ring block and step, kept), with the traced seconds."""
    lines = [("| case | layout | traced step s | masks s | mask evaluations | builds per pair (before) | "
              "builds kept (today's) | kernels |"), "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "mask_builds" not in r:
            continue
        b = r["mask_builds"]
        lines.append(f"| {r['case']} | {r['layout']}, {r['attention']} | {r['traced_step_s']:.5g} | "
                     f"{r['traced_step_breakdown']['masks']:.4g} | {r['traced_mask_evaluations']:.4g} | "
                     f"{b['per_pair']:,.0f} | {b['kept']:,.0f} | {r['traced_launches']:,} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", default=list(SHIPPED) + list(LONG), choices=list(SHIPPED) + list(LONG),
                   metavar="CASE", help=f"shipped configs ({', '.join(SHIPPED)}) and long cases ({', '.join(LONG)})")
    p.add_argument("--remodel", nargs="+", metavar="JSON", type=Path,
                   help="rows of earlier runs (their JSON): the step-time model's columns computed again, the "
                        "traces not run again (a row whose layout the planner no longer ranks first is kept, "
                        "marked remodelled: false)")
    p.add_argument("--masks", choices=("kept", "per-pair"), default="kept",
                   help="per-pair: a ring's block masks built as before kernels/block_mask.py, at every use "
                        "(benchmarks/per_pair_masks.py), for the before-and-after comparison")
    add_output_args(p, "memory_trace")
    args = p.parse_args(argv)
    folder = output_dir(p, args)
    hw, memory = Hardware(), device_memory_gib("H100")
    rows = []
    if args.remodel:
        for path in args.remodel:
            try:
                rows += [remodel(r, hw, memory) for r in json.loads(path.read_text())["rows"]]
            except (OSError, ValueError, KeyError) as e:
                p.error(f"--remodel {path}: not a bench_trace JSON ({e})")
    for name in [] if args.remodel else args.cases:
        rows.append(measure(name, hw, memory, args.masks))
        print(f"{name}: done in {rows[-1].get('seconds', 0):.0f} s", flush=True)
    text = (table(rows) + "\n\nStep time per optimizer step, traced / modelled, seconds by category:\n\n"
            + step_table(rows))
    if args.masks == "per-pair":
        text += ("\n\nBlock masks built per pair at every use (the old path), per optimizer step:\n\n"
                 + builds_table(rows))
    print("\n" + text)
    bad = [r["case"] for r in rows if "traced_gib" in r and "mask_builds" not in r      # today's model, kept masks
           and (abs(r["error"]) > TOLERANCE or not same_moment(r))]
    if folder is not None:
        name = args.name or "memory_trace"
        record = {"rows": rows, "machine": platform.platform(), "torch": torch.__version__,
                  "tolerance": TOLERANCE, "outside_tolerance": bad}
        write_text(folder, f"{name}.json", json.dumps(record, indent=1) + "\n")
        out = write_text(folder, f"{name}.md", f"# The memory model against the memory trace\n\nProduced by "
                         f"`python benchmarks/bench_trace.py{' --record' if args.record else ''}"
                         f"{' --masks per-pair' if args.masks == 'per-pair' else ''}` on "
                         f"{platform.platform()} (torch {torch.__version__}); H100 80GB as exposed "
                         f"({memory:g} GiB). JSON beside this file.\n\n{text}\n")
        print(f"\nwrote {out}")
    if bad:
        print(f"error: the memory model is more than {TOLERANCE:.0%} from the trace, or at another moment: "
              f"{', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

