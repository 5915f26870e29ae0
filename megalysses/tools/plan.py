"""Plan a layout: which (tp, sp = ulysses x ring, pp, dp, virtual stages) and memory options fit a model at a
sequence length on N GPUs, ranked by predicted throughput.

    python tools/plan.py --config configs/llama3_8b_1m.yaml --gpus 64 --gpu-memory-gib 80 --seq-len 1048576
    python tools/plan.py --config configs/gpt_1b_1m_offload.yaml --gpus 1 --gpu-memory-gib 80 \\
        --seq-len 1048576 --host-memory-gib 256 --explain
    python tools/plan.py --config C --gpus 8 --gpu-memory-gib 80 --seq-len 131072 --json   # {"best": ... | null}

The model, batch (training.global_batch_size and micro_batch_size), dtype, kernels (model.kernels, or
--kernels) and attention backend come from the config; the layout and memory options (checkpointing,
tiled MLP, TP sequence sharding, FSDP vs ZeRO-1, and activation and optimizer offload when
--host-memory-gib is given) are enumerated under the config's own layout rules
(config_checks.validate_config). The config's own layout is evaluated too.

Memory is megalysses.memory's prediction. A layout fits when its peak is at most the usable device
memory (--gpu-memory-gib less --fragmentation of it and --reserve-gib for the CUDA context, NCCL and
cuBLAS) and, with activation offload, the --host-memory-gib of a node holds what its ranks offload.
Step time = the compute at stated sustained FLOP/s + the communication megalysses does not overlap
(tp collectives, Ulysses all-to-alls, pipeline p2p, ZeRO-1's parameter all-gather; the ring's K/V and
dK/dV hops beyond the attention they travel under; the gradient reduce-scatter beyond the last
backward; FSDP beyond its micro-batch) at stated bandwidths + the
pipeline bubble + activation-offload copies beyond the compute + the optimizer step (on the host's cores
with optimizer offload). Defaults: H100 SXM nodes of 8.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from dataclasses import dataclass, replace
from typing import Iterator, Optional

from megalysses.config import Config, ConfigError, ModelConfig
from megalysses.config_checks import check_heads, check_kept_attention, validate_config
from megalysses.config_io import load_config
from megalysses.memory import (GIB, KERNELS, Estimate, Layout, Options, Precision, Workload, attention_for, estimate,
                               fmt_bytes, kv_replication, layer_params, layout_of, options_of, precision_for,
                               stage_layers, stage_params, tiled, workload_of)
from megalysses.training.metrics import flops_per_token


@dataclass(frozen=True)
class Hardware:
    """Stated figures (H100 SXM defaults); each is a command-line flag."""

    peak_tflops: float = 989.0            # dense bf16 peak of one H100 SXM (datasheet)
    matmul_efficiency: float = 0.6        # sustained fraction of the peak over a training step's matmuls,
                                          # with the memory-bound kernels between them (one value that
                                          # reproduces Megatron-Core's nine published H100 MFU points)
    attention_efficiency: float = 0.35    # FlashAttention-2 class kernels, forward + backward
    intra_node_gbs: float = 360.0         # NVLink bus bandwidth per GPU (80% of 450 GB/s per direction)
    inter_node_gbs: float = 40.0          # network per GPU (80% of 400 Gb/s)
    host_gbs: float = 50.0                # host <-> device copies per GPU (PCIe Gen5 x16)
    host_adam_gparams: float = 0.25       # billions of parameters per second that one GPU's share of the
                                          # host's cores updates with torch's foreach AdamW (optimizer offload)
    hbm_gbs: float = 2680.0               # device memory bandwidth (80% of 3.35 TB/s): the optimizer step
    gpus_per_node: int = 8
    reserve_gib: float = 1.5              # CUDA context, NCCL buffers, cuBLAS workspaces
    fragmentation: float = 0.05           # share of the device the caching allocator cannot hand out

    def usable_bytes(self, gpu_memory_gib: float) -> float:
        return (gpu_memory_gib * (1 - self.fragmentation) - self.reserve_gib) * GIB

    def link(self, span: int) -> float:
        """Bandwidth (bytes/s) of a group whose ranks span `span` consecutive world ranks."""
        return (self.intra_node_gbs if span <= self.gpus_per_node else self.inter_node_gbs) * 1e9


@dataclass(frozen=True)
class Overlap:
    """Which communication hides behind compute (megalysses: only the gradient reduction)."""

    tp: bool = False
    ulysses: bool = False
    p2p: bool = False
    grad_reduce: bool = True
    param_gather: bool = False


@dataclass
class StepTime:
    compute: float            # seconds of compute per step on one rank (micro-batches x stage)
    exposed: dict[str, float]  # seconds of communication / copies that compute does not hide, by kind
    bubble: float
    optimizer: float
    bytes: dict[str, float]   # bytes per step per rank: all_to_all, all_reduce (tp + gradients), p2p, host
    flops: dict[str, float]   # FLOPs per step per rank: matmul, attention (recompute included)

    @property
    def total(self) -> float:
        return self.compute + sum(self.exposed.values()) + self.bubble + self.optimizer


def step_time(m: ModelConfig, layout: Layout, opts: Options, prec: Precision, work: Workload, hw: Hardware,
              overlap: Overlap = Overlap(), retained: float = 0.0) -> StepTime:
    """Predicted seconds per optimizer step on the busiest rank. `retained`: activation bytes per step
    that activation offload copies out and back."""
    t, P, v, M = layout.tp, layout.sp, layout.virtual_stages, work.micro_batches
    u, ring = layout.ulysses, layout.ring
    tokens = work.micro_batch_size * work.seq_len / P                 # per micro-batch per rank
    L = stage_layers(m, layout)
    dense = layer_params(m, t) - 2 * m.hidden_size
    mlp = (3 if m.mlp == "swiglu" else 2) * m.hidden_size * m.ffn_size / t
    q, kv = m.num_heads * m.head_dim / t, m.kv_heads / t * kv_replication(m.kv_heads // t, u) * m.head_dim
    fwd_mm = L * 2 * dense * tokens
    fwd_attn = L * 2 * work.micro_batch_size * work.seq_len ** 2 * q / P        # causal: half of 4 S^2 q
    head = 2 * m.padded_vocab_size(t) / t * m.hidden_size * tokens
    redo_mm = (fwd_mm if opts.activation_checkpointing else 0.0)
    if tiled(opts.mlp_chunk_tokens, layout, opts, work.seq_len):
        redo_mm += L * 2 * mlp * tokens * (2 if opts.activation_checkpointing else 1)
    mm = M * (3 * (fwd_mm + head) + redo_mm)
    # forward, backward (twice the forward), and under checkpointing the recomputation, unless its output is kept
    attn = M * fwd_attn * (4 if opts.activation_checkpointing and not opts.keep_attention else 3)
    compute = (mm / (hw.peak_tflops * 1e12 * hw.matmul_efficiency)
               + attn / (hw.peak_tflops * 1e12 * hw.attention_efficiency))
    passes = 3 if opts.activation_checkpointing else 2                   # forward, backward (+ recompute)
    a = prec.act
    span_tp, span_sp, span_grad = t, t * P, t * P * layout.dp
    nbytes: dict[str, float] = {"all_to_all": 0.0, "all_reduce": 0.0, "p2p": 0.0, "ring_p2p": 0.0, "host": 0.0}
    exposed: dict[str, float] = {}
    if u > 1:
        a2a = (u - 1) / u * tokens * (2 * q + 2 * kv) * a * L * passes * M
        nbytes["all_to_all"] = a2a
        exposed["Ulysses all-to-all"] = 0.0 if overlap.ulysses else a2a / hw.link(t * u)
    if ring > 1:
        # K/V blocks go around the ring in each forward (and the recomputation) and again in the backward,
        # r - 1 hops each; the fp32 dK/dV accumulators r hops (parallel/ring.py). Each hop is posted before
        # the block's attention, so only what the attention does not cover shows
        block = tokens * 2 * kv                                            # elements of one K/V block
        nbytes["ring_p2p"] = ((ring - 1) * passes * block * a + ring * block * 4) * L * M
        attention = attn / (hw.peak_tflops * 1e12 * hw.attention_efficiency)
        exposed["ring p2p"] = max(0.0, nbytes["ring_p2p"] / hw.link(span_sp) - attention)
    if t > 1:
        per = (t - 1) / t * tokens * m.hidden_size * a
        if opts.tp_sequence_parallel:
            tp = per * (2 + 2) * L * passes * M                            # QKV, gate-up gathers; 2 reduce-scatters
        else:
            tp = 2 * per * 2 * L * passes * M                              # 2 all-reduces, ring 2(t-1)/t
        nbytes["all_reduce"] += tp
        exposed["tensor-parallel collectives"] = 0.0 if overlap.tp else tp / hw.link(span_tp)
    if layout.pp > 1:
        r = t if opts.tp_sequence_parallel else 1
        p2p = 2 * tokens / r * m.hidden_size * 4 * M * v
        nbytes["p2p"] = p2p
        exposed["pipeline p2p"] = 0.0 if overlap.p2p else p2p / hw.link(layout.world)
    n = max(sum(stage_params(m, layout, s == 0, s == layout.pp - 1)) for s in (0, layout.pp - 1))
    G = layout.dp * P
    per_mb = compute / M
    if G > 1:
        share = (G - 1) / G * n
        if opts.fsdp:
            fsdp = M * share * (2 * a + 4)                                # gathers forward + backward, fp32 reduce
            nbytes["all_reduce"] += fsdp
            exposed["FSDP gathers and reduce-scatters"] = max(0.0, fsdp / hw.link(span_grad) - compute)
        else:
            reduce, gather = share * 4, share * prec.weight
            nbytes["all_reduce"] += reduce + gather
            rs = reduce / hw.link(span_grad)
            exposed["gradient reduce-scatter"] = max(0.0, rs - 2 / 3 * per_mb) if overlap.grad_reduce else rs
            exposed["parameter all-gather"] = 0.0 if overlap.param_gather else gather / hw.link(span_grad)
    if opts.activation_offload:
        nbytes["host"] = 2 * retained
        exposed["activation offload copies"] = max(0.0, 2 * retained / (hw.host_gbs * 1e9) - compute)
    comm_mb = sum(exposed.get(k, 0.0) for k in ("Ulysses all-to-all", "ring p2p", "tensor-parallel collectives",
                                                 "pipeline p2p")) / M
    bubble = (layout.pp - 1) / v * (per_mb + comm_mb)
    if opts.optimizer_offload:       # gradients down, weights back up, the update on the host's cores
        moved = n / G * 4 + n * prec.weight / G
        nbytes["host"] += moved
        optimizer = moved / (hw.host_gbs * 1e9) + n / G / (hw.host_adam_gparams * 1e9)
    else:
        optimizer = n / G * (prec.master + prec.moments + 4) * 3 / (hw.hbm_gbs * 1e9)
    return StepTime(compute=compute, exposed=exposed, bubble=bubble, optimizer=optimizer, bytes=nbytes,
                    flops={"matmul": mm, "attention": attn})


# ----------------------------------------------------------------------------- candidates

def heads_allow(m: ModelConfig, tp: int, sp: int) -> bool:
    """The head rule of a (tp, sp) layout: the one function to swap when the layout rules change."""
    try:
        check_heads(m.num_heads, m.kv_heads, tp, sp)
    except ConfigError:
        return False
    return True


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_configs(cfg: Config, gpus: int, offload: bool, gpus_per_node: int = 8) -> Iterator[Config]:
    """Every layout and memory-option combination of `cfg` on `gpus` ranks that its rules allow: tp, sp
    (split into ulysses x ring automatically: the largest Ulysses degree the heads allow, inside a node
    when one is, the rest a ring),
    pp, virtual stages, checkpointing (with attention outputs kept or recomputed), MLP tiles (the config's
    size, else 8192 tokens), TP sequence sharding, FSDP or ZeRO-1, and with host memory (`offload`)
    activation and optimizer offload. The LM head + loss keeps the config's tile."""
    m, t = cfg.model, cfg.training
    mlp_tile = t.mlp_chunk_tokens or 8192
    S = cfg.data.seq_len
    # checkpointing, activation offload, attention outputs kept
    activations = ((False, False, False), (True, False, False), (True, False, True)) + \
        (((True, True, False),) if offload else ())
    states = ((False, False), (True, False)) + (((False, True),) if offload else ())        # FSDP, optimizer offload
    for tp in divisors(gpus):
        if tp > gpus_per_node:
            continue
        for sp in divisors(gpus // tp):
            if not heads_allow(m, tp, sp):
                continue
            for pp in divisors(gpus // (tp * sp)):
                options = itertools.product([1] + [x for x in (2, 4) if pp > 1], activations,
                                            sorted({0, mlp_tile if mlp_tile < S // sp else 0}),
                                            (False, True) if tp > 1 else (False,), states)
                for v, (ckpt, offl, keep), tile, tsp, (fsdp, opt_off) in options:
                    yield replace(
                        cfg,
                        parallel=replace(cfg.parallel, tp=tp, sp=sp, sp_ring=0, pp=pp, virtual_stages=v,
                                         tp_sequence_parallel=tsp, fsdp=fsdp),
                        training=replace(t, activation_checkpointing=ckpt, activation_offload=offl,
                                         recompute_attention=not keep, optimizer_offload=opt_off,
                                         mlp_chunk_tokens=tile))


@dataclass
class Plan:
    cfg: Config
    estimate: Estimate
    step: StepTime
    fits: bool
    host_per_node: float
    hw: Hardware
    why_not: str = ""

    def row(self) -> dict:
        c, layout, s = self.cfg, self.estimate.layout, self.step
        tok_s = c.training.global_batch_size * c.data.seq_len / s.total
        mfu = flops_per_token(c.model, c.data.seq_len) * tok_s / (layout.world * self.hw.peak_tflops * 1e12)
        return {"tp": layout.tp, "sp": layout.sp, "ring": layout.ring, "pp": layout.pp, "dp": layout.dp,
                "virtual_stages": layout.virtual_stages, "micro_batches": workload_of(c, layout).micro_batches,
                "activation_checkpointing": c.training.activation_checkpointing,
                "recompute_attention": c.training.recompute_attention,
                "activation_offload": c.training.activation_offload, "optimizer_offload": c.training.optimizer_offload,
                "mlp_chunk_tokens": c.training.mlp_chunk_tokens, "loss_chunk_tokens": c.training.loss_chunk_tokens,
                "tp_sequence_parallel": c.parallel.tp_sequence_parallel, "fsdp": c.parallel.fsdp,
                "peak_gib": round(self.estimate.peak / GIB, 2), "peak_phase": self.estimate.phase,
                "host_gib_per_node": round(self.host_per_node / GIB, 1),
                "all_to_all_gb": round(s.bytes["all_to_all"] / 1e9, 2),
                "all_reduce_gb": round(s.bytes["all_reduce"] / 1e9, 2),
                "p2p_gb": round(s.bytes["p2p"] / 1e9, 2), "ring_p2p_gb": round(s.bytes["ring_p2p"] / 1e9, 2),
                "step_s": round(s.total, 4), "tokens_per_s": round(tok_s, 1),
                "mfu": round(mfu, 4), "fits": self.fits}


def evaluate(cfg: Config, gpus: int, gpu_memory_gib: float, host_memory_gib: Optional[float], hw: Hardware) -> Plan:
    """Memory, fit and step time of `cfg` at its own layout, options and kernels on `gpus` GPUs. ConfigError
    for what the run itself would refuse at that layout (kept attention outputs without SDPA, say)."""
    layout = layout_of(cfg, gpus, min(gpus, hw.gpus_per_node))      # sp split as the run splits it on these nodes
    if not cfg.training.recompute_attention:
        check_kept_attention(cfg, attention_for(cfg, "cuda", layout.ring)[0], layout.ulysses, layout.ring)
    est = estimate(cfg.model, layout, options_of(cfg, "cuda", layout.ring), precision_for(cfg),
                   workload_of(cfg, layout))
    offloaded = sum(t.bytes for t in est.terms if t.host and t.name.startswith("offloaded"))
    step = step_time(cfg.model, layout, est.options, precision_for(cfg), workload_of(cfg, layout), hw,
                     Overlap(grad_reduce=cfg.parallel.overlap_grad_reduce), retained=offloaded)
    per_node = est.host * min(gpus, hw.gpus_per_node)
    why = []
    if est.peak > hw.usable_bytes(gpu_memory_gib):
        why.append(f"peak {est.peak / GIB:.1f} GiB > usable {hw.usable_bytes(gpu_memory_gib) / GIB:.1f} GiB")
    if per_node > 0 and (host_memory_gib is None or per_node > host_memory_gib * GIB):
        why.append(f"host {per_node / GIB:.0f} GiB per node > --host-memory-gib {host_memory_gib}")
    return Plan(cfg, est, step, not why, per_node, hw, "; ".join(why))


def predicted_step_seconds(cfg: Config, gpus: int, hw: Hardware) -> Optional[float]:
    """The step time of `cfg` at its own layout and options on `gpus` GPUs (at data.seq_len, the longest
    length of a curriculum), or None for a config the model does not cover."""
    try:
        return evaluate(cfg, gpus, 80.0, None, hw).step.total
    except (ConfigError, ValueError):
        return None


def plan(cfg: Config, gpus: int, seq_len: int, gpu_memory_gib: float, host_memory_gib: Optional[float] = None,
         hw: Hardware = Hardware()) -> tuple[list[Plan], int]:
    """(the layouts that fit, best first; how many were considered)."""
    cfg = replace(cfg, data=replace(cfg.data, seq_len=seq_len))
    fitting, considered = [], 0
    for cand in candidate_configs(cfg, gpus, host_memory_gib is not None, hw.gpus_per_node):
        try:
            validate_config(cand, world_size=gpus)
        except ConfigError:
            continue
        considered += 1
        try:
            p = evaluate(cand, gpus, gpu_memory_gib, host_memory_gib, hw)
        except ValueError:        # one the memory model does not cover, or the run refuses (it says which): not planned
            continue
        if p.fits:
            fitting.append(p)
    fitting.sort(key=lambda p: (p.step.total, p.estimate.peak))
    return fitting, considered


# ----------------------------------------------------------------------------- output

def _flags(r: dict) -> str:
    parts = [name for key, name in (("activation_checkpointing", "ckpt"), ("activation_offload", "act-offload"),
                                    ("optimizer_offload", "opt-offload"), ("tp_sequence_parallel", "tp-seq"),
                                    ("fsdp", "fsdp")) if r[key]]
    if r["activation_checkpointing"] and not r["recompute_attention"]:
        parts.insert(1, "keep-attn")
    parts += [f"{name}{r[key] // 1024}k" if r[key] >= 1024 else f"{name}{r[key]}"
              for key, name in (("mlp_chunk_tokens", "mlp-tile"), ("loss_chunk_tokens", "loss-tile")) if r[key]]
    return ",".join(parts) or "-"


def table(rows: list[dict]) -> str:
    head = (f"{'#':>3} {'tp':>3} {'sp':>3} {'ring':>4} {'pp':>3} {'v':>2} {'dp':>4} {'options':<38} {'peak GiB':>8} "
            f"{'host/node':>9} {'a2a GB':>8} {'ring GB':>8} {'allred GB':>9} {'step s':>8} {'tok/s':>10} {'MFU':>6}")
    lines = [head]
    for i, r in enumerate(rows, 1):
        lines.append(f"{i:>3} {r['tp']:>3} {r['sp']:>3} {r['ring']:>4} {r['pp']:>3} {r['virtual_stages']:>2} "
                     f"{r['dp']:>4} {_flags(r):<38} {r['peak_gib']:>8.1f} {r['host_gib_per_node']:>9.0f} "
                     f"{r['all_to_all_gb']:>8.1f} {r['ring_p2p_gb']:>8.1f} {r['all_reduce_gb']:>9.1f} "
                     f"{r['step_s']:>8.3f} {r['tokens_per_s']:>10.0f} {r['mfu']:>6.1%}")
    return "\n".join(lines)


def explain(p: Plan, hw: Hardware, gpu_memory_gib: float) -> str:
    e, s, c = p.estimate, p.step, p.cfg
    lines = [f"memory at the peak (stage {e.stage}, {e.phase}):"]
    for t in e.terms:
        where = "host" if t.host else "    "
        lines.append(f"  {where} {fmt_bytes(t.bytes):>12}  {t.name:<62} {t.formula}")
    lines.append(f"  peak {fmt_bytes(e.peak)} <= usable {fmt_bytes(hw.usable_bytes(gpu_memory_gib))} "
                 f"({gpu_memory_gib:g} GiB x {1 - hw.fragmentation:g} - {hw.reserve_gib:g} GiB reserve)")
    mm, at = s.flops["matmul"], s.flops["attention"]
    lines.append("step time (one rank):")
    lines.append(f"  compute    {s.compute:10.4f} s = {mm:.4g} matmul FLOPs / ({hw.peak_tflops:g} TFLOP/s x "
                 f"{hw.matmul_efficiency:g}) + {at:.4g} attention FLOPs / ({hw.peak_tflops:g} x "
                 f"{hw.attention_efficiency:g})")
    for kind, sec in s.exposed.items():
        lines.append(f"  {kind:<40} {sec:10.4f} s exposed")
    lines.append(f"  pipeline bubble {s.bubble:10.4f} s = (pp - 1) / v x one micro-batch")
    lines.append(f"  optimizer  {s.optimizer:10.4f} s")
    lines.append("  bytes per step: " + ", ".join(f"{k} {v / 1e9:.3g} GB" for k, v in s.bytes.items()))
    r = p.row()
    lines.append(f"  step {s.total:.4f} s -> {r['tokens_per_s']:.0f} tokens/s = {c.training.global_batch_size} x "
                 f"{c.data.seq_len} tokens / step; MFU {r['mfu']:.1%}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    d = Hardware()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML config: model, batch, dtype, attention backend")
    p.add_argument("--gpus", type=int, required=True, help="GPUs in all")
    p.add_argument("--gpu-memory-gib", type=float, required=True, help="memory of one GPU (80 for an H100 80GB)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the config's data.seq_len)")
    p.add_argument("--host-memory-gib", type=float, default=None,
                   help="host memory per node; activation and optimizer offload are considered only when given")
    p.add_argument("--json", action="store_true", help="print one JSON object: best (or null), layouts, config_layout")
    p.add_argument("--explain", action="store_true", help="show the arithmetic of the top layout")
    p.add_argument("--top", type=int, default=10, help="layouts to list")
    p.add_argument("--kernels", choices=sorted(KERNELS), default=None,
                   help="model.kernels to plan for (what the norms, RoPE and SwiGLU keep); default: the config's")
    for f in dataclasses.fields(Hardware):
        p.add_argument("--" + f.name.replace("_", "-"), type=type(getattr(d, f.name)), default=getattr(d, f.name),
                       help=f"default {getattr(d, f.name)}")
    args = p.parse_args(argv)
    for name in ("gpus", "seq_len", "gpu_memory_gib", "top"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            print(f"error: --{name.replace('_', '-')} must be positive, got {getattr(args, name)}", file=sys.stderr)
            return 1
    if args.host_memory_gib is not None and args.host_memory_gib <= 0:
        print(f"error: --host-memory-gib must be positive, got {args.host_memory_gib}", file=sys.stderr)
        return 1
    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    args.seq_len = args.seq_len or cfg.data.seq_len
    if args.kernels is not None:
        cfg = replace(cfg, model=replace(cfg.model, kernels=args.kernels))
    hw = Hardware(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Hardware)})
    if hw.usable_bytes(args.gpu_memory_gib) <= 0:
        print(f"error: --gpu-memory-gib {args.gpu_memory_gib:g} leaves nothing usable after --reserve-gib "
              f"{hw.reserve_gib:g} and --fragmentation {hw.fragmentation:g}: give the memory of one GPU (80 for an "
              f"H100 80GB)", file=sys.stderr)
        return 1
    fitting, considered = plan(cfg, args.gpus, args.seq_len, args.gpu_memory_gib, args.host_memory_gib, hw)
    own = replace(cfg, data=replace(cfg.data, seq_len=args.seq_len))
    try:
        validate_config(own, world_size=args.gpus)
        mine = evaluate(own, args.gpus, args.gpu_memory_gib, args.host_memory_gib, hw)
        own_row = {**mine.row(), "why_not": mine.why_not}
    except (ConfigError, ValueError) as e:
        own_row = {"fits": False, "why_not": str(e)}
    rows = [f.row() for f in fitting[:args.top]]
    if args.json:
        print(json.dumps({"config": args.config, "gpus": args.gpus, "seq_len": args.seq_len,
                          "kernels": cfg.model.kernels,
                          "gpu_memory_gib": args.gpu_memory_gib, "host_memory_gib": args.host_memory_gib,
                          "hardware": dataclasses.asdict(hw), "considered": considered, "fitting": len(fitting),
                          "best": rows[0] if rows else None, "layouts": rows, "config_layout": own_row}, indent=1))
        return 0
    print(f"{args.config}: {args.seq_len} tokens on {args.gpus} x {args.gpu_memory_gib:g} GiB; "
          f"{len(fitting)} of {considered} layouts fit (usable {hw.usable_bytes(args.gpu_memory_gib) / GIB:.1f} GiB; "
          f"{hw.peak_tflops:g} TFLOP/s x {hw.matmul_efficiency:g} matmul, x {hw.attention_efficiency:g} attention; "
          f"{hw.intra_node_gbs:g} GB/s in a node of {hw.gpus_per_node}, {hw.inter_node_gbs:g} GB/s across)")
    if rows:
        print(table(rows))
    else:
        print("no layout fits: more GPUs, a shorter sequence, or --host-memory-gib for activation and optimizer "
              "offload")
    verdict = "fits" if own_row["fits"] else f"does not fit ({own_row['why_not']})"
    extra = (f", peak {own_row['peak_gib']:.1f} GiB, {own_row['tokens_per_s']:.0f} tok/s"
             if "peak_gib" in own_row else "")
    print(f"the config's own layout {verdict}{extra}")
    if args.explain and fitting:
        print(explain(fitting[0], hw, args.gpu_memory_gib))
    return 0


def cli() -> int:
    return main()


if __name__ == "__main__":
    sys.exit(cli())
