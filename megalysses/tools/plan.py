"""Plan a layout: which (tp, sp = ulysses x ring, pp, dp, virtual stages) and memory options fit a model at a
sequence length on N GPUs, ranked by predicted throughput.

    python tools/plan.py --config configs/llama3_8b_1m.yaml --gpus 64 --seq-len 1048576
    python tools/plan.py --config configs/gpt_1b_1m_offload.yaml --gpus 1 --seq-len 1048576 \\
        --host-memory-gib 256 --explain
    python tools/plan.py --config C --gpus 8 --seq-len 131072 --json   # {"best": ... | null}
    python tools/plan.py --config C --gpus 8 --seq-len 131072 --json --trace    # best gains traced_peak_gib, ...

The model, batch (training.global_batch_size and micro_batch_size), dtype, kernels (model.kernels, or
--kernels) and attention backend come from the config, resolved as a run on the described machine
resolves them (megalysses.plan.resolve: H100 nodes of --gpus-per-node with the optional --packages, by
default those of a plain CUDA torch install, so `auto` attention is SDPA or varlen (documents), not
flash-attn); the layout (sp split into ulysses x ring every way the heads allow: a row's `ring` is its
parallel.sp_ring, to set as well, since sp_ring=0 takes the largest Ulysses degree) and memory options
(checkpointing, the MLP untiled or in `auto` tiles, the LM head + loss in `auto` tiles
(megalysses/plan/tiles.py), attention head chunks, TP sequence sharding, FSDP vs ZeRO-1, and activation,
optimizer and parameter offload when --host-memory-gib is given) are enumerated under the config's own
layout rules (config.checks.validate_config). The config's own layout is evaluated too: where it ranks
among those that fit, and by which terms of the step time it trails the first.

The table names each row's options (ckpt, act-offload, mlp-tile=16K, ...: the line under it gives the config
key of each); the search's progress goes to stderr from its first candidate (the candidates are enumerated as
they are searched, layout by layout), so --json's stdout stays one JSON object. The search wants the --top
fastest layouts and every one at least as fast as the config's own (to rank it): a candidate whose step cannot
be that quick (a floor from the step-time model, before its tiles and offloaded bytes are known) is not weighed,
so `fitting` (in --json, and the first line's count) counts those found, "at least" where --top of them fit,
and `evaluated` those weighed; the rows are those a search weighing every candidate lists first
(benchmarks/bench_search.py compares them).

Memory is megalysses.memory's prediction. A layout fits when its peak is at most the usable device memory
(--gpu-memory-gib, by default what an H100 80GB exposes, 79.6 GiB; less --reserve-gib for the CUDA context and
cuBLAS, the layout's NCCL communicators at a stated figure each by the collectives they run
(megalysses/plan/communicators.py; `communicators` and `communicators_gib` in --json), and a fragmentation
allowance of --fragmentation of the device or the layout's largest single block, whichever is more:
`usable_gib` in --json) and, with activation offload, the --host-memory-gib of a node holds what its ranks
offload. With --trace, one step of the top layout runs at the real shape on fake tensors
(megalysses/training/trace.py: rank 0 of its first and last pipeline stage, the run's own code, every tensor
it allocates counted): the layout gains traced_peak_gib (per GPU),
traced_moment and traced_part (where it peaked, and the memory model's name for that moment),
traced_host_gib (host memory per node at its high-water mark) and traced_pinned_gib (its pinned part), and
the step's traced roofline (megalysses/training/roofline.py, per optimizer step): traced_step_s,
traced_step_breakdown beside the model's step_breakdown (seconds by category), traced_mfu,
traced_host_syncs, traced_launches and traced_mask_evaluations.
Step time is megalysses.plan.step_time's model at the stated figures (defaults: H100 SXM nodes of 8;
each is checked: efficiencies in (0, 1], the peak and bandwidths positive, at least one GPU per node), at
the config's global batch.
The machine's flags are checked as pretrain.py --dry-run --gpus N checks them (megalysses/plan/described.py),
and a --gpus above the most any layout of the config can use (search.most_gpus) or a --seq-len the config
cannot run at (a data.seq_len_schedule ending at another length, say) is one error line before any search.
This command line is a front end: the models and the search live in megalysses.plan.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass, replace
from typing import Optional

from megalysses.config import ConfigError
from megalysses.config.checks import validate_config
from megalysses.config.io import load_config
from megalysses.memory import GIB, KERNELS, fmt_bytes
from megalysses.plan.communicators import run_communicators
from megalysses.plan.described import MachineFigures, flag_lines, machine_problems
from megalysses.plan.machine import OPTIONAL_PACKAGES, PLAIN_TORCH, Machine, device_memory_gib
from megalysses.plan.search import Prediction, Search, evaluate, most_gpus, plan
from megalysses.plan.step_time import Hardware


# ----------------------------------------------------------------------------- output

# the options column's names, in the order they are listed, and the config key each one stands for
OPTION_NAMES = (("ckpt", "training.activation_checkpointing"), ("keep-attn", "training.recompute_attention=false"),
                ("ckpt-stride", "training.checkpoint_stride"), ("act-offload", "training.activation_offload"),
                ("opt-offload", "training.optimizer_offload"), ("param-offload", "training.param_offload"),
                ("tp-seq", "parallel.tp_sequence_parallel"), ("fsdp", "parallel.fsdp"),
                ("mlp-tile", "training.mlp_chunk_tokens"), ("loss-tile", "training.loss_chunk_tokens"),
                ("head-chunks", "training.attention_head_chunks"))


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _flags(r: dict) -> str:
    """A row's memory options, by the names of OPTION_NAMES (tiles in tokens)."""
    on = {"ckpt": r["activation_checkpointing"],
          "keep-attn": r["activation_checkpointing"] and not r["recompute_attention"],
          "ckpt-stride": r["checkpoint_stride"] if r["checkpoint_stride"] > 1 else None,
          "act-offload": r["activation_offload"], "opt-offload": r["optimizer_offload"],
          "param-offload": r["param_offload"], "tp-seq": r["tp_sequence_parallel"], "fsdp": r["fsdp"],
          "mlp-tile": _tokens(r["mlp_chunk_tokens"]) if r["mlp_chunk_tokens"] else None,
          "loss-tile": _tokens(r["loss_chunk_tokens"]) if r["loss_chunk_tokens"] else None,
          "head-chunks": r["attention_head_chunks"] if r["attention_head_chunks"] > 1 else None}
    parts = [name if value is True else f"{name}={value}" for name, _ in OPTION_NAMES
             for value in (on[name],) if value]
    return ",".join(parts) or "-"


def legend(rows: list[dict]) -> str:
    """What the option names of `rows` stand for."""
    shown = {part.split("=")[0] for r in rows for part in _flags(r).split(",")}
    return "options: " + ", ".join(f"{name} = {key}" for name, key in OPTION_NAMES if name in shown)


def table(rows: list[dict]) -> str:
    width = max([len("options")] + [len(_flags(r)) for r in rows])
    head = (f"{'#':>3} {'tp':>3} {'sp':>3} {'ring':>4} {'pp':>3} {'v':>2} {'dp':>4} {'options':<{width}} "
            f"{'peak GiB':>8} {'host/node':>9} {'a2a GB':>8} {'ring GB':>8} {'allred GB':>9} {'step s':>8} "
            f"{'tok/s':>10} {'MFU':>6}")
    lines = [head]
    for i, r in enumerate(rows, 1):
        lines.append(f"{i:>3} {r['tp']:>3} {r['sp']:>3} {r['ring']:>4} {r['pp']:>3} {r['virtual_stages']:>2} "
                     f"{r['dp']:>4} {_flags(r):<{width}} {r['peak_gib']:>8.1f} {r['host_gib_per_node']:>9.0f} "
                     f"{r['all_to_all_gb']:>8.1f} {r['ring_p2p_gb']:>8.1f} {r['all_reduce_gb']:>9.1f} "
                     f"{r['step_s']:>8.3f} {r['tokens_per_s']:>10.0f} {r['mfu']:>6.1%}")
    return "\n".join(lines)


def behind(own: Prediction, best: Prediction) -> dict[str, float]:
    """Seconds of step time by which `own` trails `best`, per term of the step-time model, largest first
    (negative where it is quicker)."""
    a, b = own.step.terms(), best.step.terms()
    terms = {k: a.get(k, 0.0) - b.get(k, 0.0) for k in {**a, **b}}
    return dict(sorted(((k, round(v, 6)) for k, v in terms.items() if abs(v) > 1e-9), key=lambda kv: -kv[1]))


def ranking(own: Prediction, fitting: list[Prediction]) -> tuple[int, str]:
    """Where the config's own layout ranks among the fitting ones (1 = fastest), and why, in words."""
    rank = 1 + sum((p.step.total, p.estimate.peak) < (own.step.total, own.estimate.peak) for p in fitting)
    if rank == 1 or not fitting:
        return rank, "as fast as any layout that fits"
    best, gap = fitting[0], own.step.total - fitting[0].step.total
    if gap <= 1e-3 * own.step.total:
        return rank, (f"it ranks #{rank} of those that fit: as fast as #1 ({layout_words(best.row())}), which peaks "
                      f"lower ({best.row()['peak_gib']:.1f} GiB against {own.row()['peak_gib']:.1f})")
    terms = [f"{'+' if v > 0 else ''}{v:.3g} s {k}" for k, v in behind(own, best).items()
             if abs(v) >= 0.1 * abs(gap)][:3]
    return rank, (f"it ranks #{rank} of those that fit: its step takes {own.step.total:.3g} s, {gap:.3g} s more than "
                  f"#1's ({layout_words(best.row())}), by " + ", ".join(terms))


def layout_words(r: dict) -> str:
    """A row's layout and options in words."""
    v = f" x {r['virtual_stages']} virtual" if r["virtual_stages"] > 1 else ""
    return f"tp {r['tp']}, sp {r['sp']} (ring {r['ring']}), pp {r['pp']}{v}, dp {r['dp']}; {_flags(r)}"


def explain(p: Prediction, hw: Hardware, gpu_memory_gib: float) -> str:
    e, s, c = p.estimate, p.step, p.cfg
    lines = [f"memory at the peak (stage {e.stage}, {e.part}):"]
    for t in e.terms:
        where = "host" if t.host else "    "
        lines.append(f"  {where} {fmt_bytes(t.bytes):>12}  {t.name:<62} {t.formula}")
    allowance = hw.allowance_bytes(gpu_memory_gib, e.largest.bytes)
    comms = run_communicators(p.plan)
    lines.append(f"  peak {fmt_bytes(e.peak)} <= usable {fmt_bytes(p.usable)} ({gpu_memory_gib:g} GiB - "
                 f"{hw.reserve_gib:g} GiB reserve - {fmt_bytes(sum(c.bytes for c in comms))} for {len(comms)} "
                 f"communicators - {fmt_bytes(allowance)} fragmentation allowance: the larger of "
                 f"{hw.fragmentation:g} of the device and the {e.largest.name}, {fmt_bytes(e.largest.bytes)})")
    mm, at = s.flops["matmul"], s.flops["attention"]
    lines.append("step time (one rank):")
    lines.append(f"  compute    {s.compute:10.4f} s = {mm:.4g} matmul FLOPs / ({hw.peak_tflops:g} TFLOP/s x "
                 f"{hw.matmul_efficiency:g}) + {at:.4g} attention FLOPs / ({hw.peak_tflops:g} x "
                 f"{hw.attention_efficiency:g}) + {s.bytes['memory'] / 1e9:.4g} GB of memory-bound kernels / "
                 f"{hw.hbm_gbs:g} GB/s")
    for kind, sec in s.exposed.items():
        lines.append(f"  {kind:<40} {sec:10.4f} s exposed")
    lines.append(f"  pipeline bubble {s.bubble:10.4f} s = (pp - 1) / v x one micro-batch")
    lines.append(f"  optimizer  {s.optimizer:10.4f} s")
    lines.append(f"  launches   {s.launches:10.4f} s = {s.kernels} kernels x {hw.launch_us:g} us")
    lines.append("  bytes per step: " + ", ".join(f"{k} {v / 1e9:.3g} GB" for k, v in s.bytes.items()))
    r = p.row()
    lines.append(f"  step {s.total:.4f} s -> {r['tokens_per_s']:.0f} tokens/s = {c.training.global_batch_size} x "
                 f"{c.data.seq_len} tokens / step; MFU {r['mfu']:.1%}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    """The command line: the config, the machine, what to print, and the step-time model's hardware figures."""
    d = Hardware()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML config: model, batch, dtype, attention backend")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value, as pretrain.py's --set; repeatable")
    p.add_argument("--gpus", type=int, required=True, help="GPUs in all")
    p.add_argument("--gpu-memory-gib", type=float, default=None,
                   help=f"memory one GPU exposes (default: an H100 80GB's, {device_memory_gib('H100'):g})")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the config's data.seq_len)")
    p.add_argument("--host-memory-gib", type=float, default=None,
                   help="host memory per node; activation and optimizer offload are considered only when given")
    p.add_argument("--json", action="store_true", help="print one JSON object: best (or null), layouts, config_layout")
    p.add_argument("--explain", action="store_true", help="show the arithmetic of the top layout")
    p.add_argument("--top", type=int, default=10, help="layouts to list")
    p.add_argument("--trace", action="store_true",
                   help="also trace one step of the top layout at the real shape on fake tensors (its first and last "
                        "stage: the traced peak per GPU and host memory per node; minutes at million-token lengths)")
    p.add_argument("--no-search", action="store_true",
                   help="the config's own layout alone, no other layout searched (its fit, peak and plan in seconds)")
    p.add_argument("--kernels", choices=sorted(KERNELS), default=None,
                   help="model.kernels to plan for (what the norms, RoPE and SwiGLU keep); default: the config's")
    p.add_argument("--packages", default=",".join(PLAIN_TORCH),
                   help=f"optional packages the GPU machines have, comma-separated, from "
                        f"{', '.join(OPTIONAL_PACKAGES)} (default: a plain CUDA torch install: "
                        f"{','.join(PLAIN_TORCH)})")
    for f in dataclasses.fields(Hardware):
        p.add_argument("--" + f.name.replace("_", "-"), type=type(getattr(d, f.name)), default=getattr(d, f.name),
                       help=f"default {getattr(d, f.name)}")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.trace and args.no_search:
        p.error("--trace traces the top layout of the search: leave out --no-search")
    bad = _flag_problems(args)
    for line in flag_lines(bad):           # one line per bad flag
        print(line, file=sys.stderr)
    if bad:
        return 1
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    args.seq_len = args.seq_len or cfg.data.seq_len
    args.gpu_memory_gib = args.gpu_memory_gib or device_memory_gib("H100")
    if args.kernels is not None:
        cfg = replace(cfg, model=replace(cfg.model, kernels=args.kernels))
    hw = Hardware(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Hardware)})
    packages = _packages(args)
    problem = _config_problem(cfg, args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    mine, own_row = own_layout(replace(cfg, data=replace(cfg.data, seq_len=args.seq_len)), args.gpus, hw,
                               Described(args.gpu_memory_gib, args.host_memory_gib, packages))
    # the top layouts, and every one at least as fast as the config's own (to rank it): the rest is not weighed
    search = Search(progress=Progress(), top=args.top, within=mine.step.total if mine is not None and mine.fits else 0)
    fitting, considered = ([], 0) if args.no_search else plan(
        cfg, args.gpus, args.seq_len, args.gpu_memory_gib, args.host_memory_gib, hw, packages, search)
    if mine is not None and mine.fits and not args.no_search:
        own_row["rank"], why = ranking(mine, fitting)
        own_row["behind_best_s"] = behind(mine, fitting[0]) if fitting else {}
    rows = [f.row() for f in fitting[:args.top]]
    if args.trace and fitting:
        from megalysses.training.trace import trace_fields, trace_run

        best = fitting[0]
        try:
            rows[0].update(trace_fields(trace_run(best.cfg, best.plan.machine, args.gpus, hw=hw),
                                        min(args.gpus, hw.gpus_per_node)))
            rows[0]["traced_mfu"] = round(rows[0]["mfu"] * best.step.total / rows[0]["traced_step_s"], 4)
            rows[0]["step_breakdown"] = {k: round(v, 6) for k, v in best.step.breakdown(hw).items()}
        except (ConfigError, ValueError) as e:
            print(f"error: the trace of the top layout: {e}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps({"config": args.config, "gpus": args.gpus, "seq_len": args.seq_len,
                          "kernels": cfg.model.kernels, "packages": list(packages),
                          "gpu_memory_gib": args.gpu_memory_gib, "host_memory_gib": args.host_memory_gib,
                          "hardware": dataclasses.asdict(hw), "considered": considered, "evaluated": search.evaluated,
                          "fitting": len(fitting),
                          "best": rows[0] if rows else None, "layouts": rows, "config_layout": own_row}, indent=1))
        return 0
    if args.no_search:
        print(f"{args.config}: {args.seq_len} tokens on {args.gpus} x {args.gpu_memory_gib:g} GiB: "
              f"{own_verdict(mine, own_row)}")
        return 0
    print(f"{args.config}: {args.seq_len} tokens on {args.gpus} x {args.gpu_memory_gib:g} GiB; "
          f"{len(fitting)} of {considered} layouts fit{' at least' if len(fitting) >= args.top else ''} "
          f"({search.evaluated} weighed, the others unable to fit or to rank in the top {args.top}; "
          f"usable at most {hw.usable_bytes(args.gpu_memory_gib) / GIB:.1f} "
          f"GiB, less each layout's largest block beyond {hw.fragmentation:g} of the device; "
          f"{hw.peak_tflops:g} TFLOP/s x {hw.matmul_efficiency:g} matmul, x {hw.attention_efficiency:g} attention; "
          f"{hw.intra_node_gbs:g} GB/s in a node of {hw.gpus_per_node}, {hw.inter_node_gbs:g} GB/s across)")
    if rows:
        print(table(rows))
        print(legend(rows))
    else:
        print("no layout fits: more GPUs, a shorter sequence, or --host-memory-gib for activation, optimizer and "
              "parameter offload")
    if rows and "traced_peak_gib" in rows[0]:
        print(_traced_line(rows[0]))
    print(own_verdict(mine, own_row) + (f": {why}" if mine is not None and mine.fits else ""))
    if args.explain and fitting:
        print(explain(fitting[0], hw, args.gpu_memory_gib))
    return 0


def _packages(args: argparse.Namespace) -> tuple[str, ...]:
    return tuple(x for x in args.packages.split(",") if x)


def _flag_problems(args: argparse.Namespace) -> dict[str, str]:
    """flag -> what is wrong with its value: the described machine's figures (plan/described.py, as
    pretrain.py --dry-run --gpus checks them), and the sizes of the plan that must be positive."""
    figures = MachineFigures(gpus=args.gpus, gpu_memory_gib=args.gpu_memory_gib,
                             host_memory_gib=args.host_memory_gib, packages=_packages(args))
    bad = machine_problems(figures, {f.name: getattr(args, f.name) for f in dataclasses.fields(Hardware)})
    bad.update({name: f"must be positive, got {getattr(args, name)}" for name in ("seq_len", "top")
                if getattr(args, name) is not None and not getattr(args, name) > 0})
    return bad


def _traced_line(r: dict) -> str:
    """The traced peak of the top layout (row `r`, with --trace) beside the memory model's."""
    return (f"traced (layout 1, one step on fake tensors, {r['traced_seconds']:.0f} s): peak "
            f"{r['traced_peak_gib']:.2f} GiB per GPU at {r['traced_moment']} (the model: {r['peak_gib']:.2f} GiB "
            f"at {r['peak_part']}); "
            f"host {r['traced_host_gib']:.0f} GiB per node, {r['traced_pinned_gib']:.0f} of them pinned (the "
            f"model: {r['host_gib_per_node']:.0f}); step {r['traced_step_s']:.4g} s, MFU {r['traced_mfu']:.1%} "
            f"(the model: {r['step_s']:.4g} s), {r['traced_launches']:,} kernel launches, {r['traced_host_syncs']} "
            f"host syncs, {r['traced_mask_evaluations']:.3g} mask evaluations per step; seconds traced / modelled: "
            + ", ".join(f"{k} {v:.3g} / {r['step_breakdown'].get(k, 0.0):.3g}"
                        for k, v in r["traced_step_breakdown"].items()))


def _config_problem(cfg, args: argparse.Namespace) -> str:
    """What stops any plan of `cfg` for this command line before a search, in words (empty: nothing): a config
    that cannot run at --seq-len (its curriculum ending at another length, say), or more --gpus than any layout of
    it can use (search.most_gpus)."""
    at_length = replace(cfg, data=replace(cfg.data, seq_len=args.seq_len))
    try:
        validate_config(at_length)
    except ConfigError as e:
        return f"--seq-len {args.seq_len}: this config cannot run at that length: {e}"
    most, factors = most_gpus(at_length)
    if args.gpus > most:
        return (f"--gpus {args.gpus} is more than this config can use: at most {most} GPUs = "
                + " x ".join(f"{name} {n} ({why})" for name, (n, why) in factors.items()))
    return ""


def own_verdict(mine: Optional[Prediction], own_row: dict) -> str:
    """Whether the config's own layout fits, with its peak and speed where it does (own_layout's answer)."""
    if mine is not None and mine.fits:
        return (f"the config's own layout ({layout_words(own_row)}) fits, peak {own_row['peak_gib']:.1f} GiB, "
                f"{own_row['tokens_per_s']:.0f} tok/s")
    return f"the config's own layout does not fit ({own_row['why_not']})"


@dataclass(frozen=True)
class Described:
    """The described machine's memory and packages a config's own layout is judged on (`machine`: the one it
    resolves on, default the planner's H100 nodes of these)."""

    gpu_memory_gib: Optional[float]
    host_memory_gib: Optional[float]
    packages: tuple[str, ...]
    machine: Optional[Machine] = None


def own_layout(own, gpus: int, hw: Hardware, on: Described) -> tuple[Optional[Prediction], dict]:
    """The config's own layout and options on the described machine: its prediction (None where the run would
    refuse it) and its row. tools/plan.py and pretrain.py --dry-run --gpus N judge a config's fit with it."""
    try:
        validate_config(own, world_size=gpus)
        mine = evaluate(own, gpus, on.gpu_memory_gib, on.host_memory_gib, hw, on.packages, machine=on.machine)
    except (ConfigError, ValueError) as e:
        return None, {"fits": False, "why_not": str(e)}
    return mine, {**mine.row(), "why_not": mine.why_not, "plan": mine.plan.record()}


class Progress:
    """The search's progress on stderr (stdout stays the table, or --json's one object): a line from its first
    candidate, rewritten in place on a terminal, every 10 seconds otherwise, and the total at the end."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.last: Optional[float] = None
        self.tty = sys.stderr.isatty()

    def __call__(self, searched: int, layouts_searched: int, layouts: int, fitting: int) -> None:
        now = time.monotonic()
        done = layouts_searched == layouts
        if not done and self.last is not None and now - self.last < (0.5 if self.tty else 10.0):
            return
        self.last = now
        line = (f"planning: {searched:,} candidate layouts and options searched ({layouts_searched:,} of {layouts:,} "
                f"layouts), {fitting} fit so far, {now - self.start:.0f} s")
        print(("\r" + line) if self.tty else line, end="\n" if done or not self.tty else "", file=sys.stderr,
              flush=True)


def cli() -> int:
    return main()


if __name__ == "__main__":
    sys.exit(cli())
