"""One GPU, three trainers side by side: megalysses, transformers' LlamaForCausalLM, transformers + Liger.

    python benchmarks/bench_gpu.py                      # Llama-3.2-1B shape, 8K/16K/32K/128K, longest length
    python benchmarks/bench_gpu.py --lengths 16384 32768 --no-longest --out-dir runs/bench_gpu
    python benchmarks/bench_gpu.py --record             # into benchmarks/results/three_way_<gpu>.md and .json
    python benchmarks/bench_gpu.py --smoke              # a tiny shape end to end on CPU

Every run is its own process (`--worker`), so one trainer's allocator state or compiled kernels never
help or hurt another. All three train the same shape, batch 1, in bf16 on CUDA (fp32 on CPU), with
AdamW (lr 3e-4, betas 0.9/0.95, weight decay 0.1 on matrices) and gradient clipping at 1.0:
  - megalysses: its train step (bf16 weights, fp32 masters in the ZeRO-1 AdamW over a group of one),
    the fused Triton kernels where Triton runs (model.kernels=triton), attention auto;
  - transformers: fp32 weights under bf16 autocast (what its Trainer's bf16 mode does), SDPA;
  - liger: the same, after liger_kernel's apply_liger_kernel_to_llama (RMSNorm, RoPE, SwiGLU, fused
    linear cross-entropy), when liger-kernel is installed.
At each length each trainer takes the first of its settings that fits (fastest first: nothing, then
activation checkpointing (for megalysses first keeping the attention outputs, then not), then for
megalysses tiled MLP), so every row is that trainer's best.
Then the longest trainable sequence of each is found by doubling, then bisection (one step at the most
memory-saving settings, in multiples of 8K; lengths that trained above are not probed again); a probe
that times out or fails for a reason other than memory ends the search with the interval it has, since
it says nothing about where memory runs out.

tokens/s is the median over timed steps after warm-up; MFU uses one formula for all
(megalysses.training.metrics.flops_per_token: 6 N_matmul + 6 L H D S per token, causal attention
counted in full) against the device's dense bf16 peak; peak GiB is torch.cuda.max_memory_allocated.
Prints the table; with --out-dir (or --record: benchmarks/results/) writes it as three_way_<gpu>.md and .json
(three_way_smoke with --smoke) with the commit and the torch, CUDA and Triton versions. benchmarks/gpu_check.py
runs its workers at 16K and 32K as one stage of a GPU window.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import add_output_args, output_dir, run_bounded, write_text  # noqa: E402

LR, WD, BETAS, EPS, CLIP = 3e-4, 0.1, (0.9, 0.95), 1e-8, 1.0
LLAMA_1B = dict(vocab=128256, hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, tied=True, theta=500000.0)
SMOKE = dict(vocab=512, hidden=64, layers=2, heads=4, kv_heads=2, ffn=160, tied=True, theta=10000.0)
FRAMEWORKS = ("megalysses", "transformers", "liger")
CAP_GPU = "H100"        # a larger GPU (an H200) is capped at its memory: fits and out-of-memory test the H100 budget
# fastest first; a trainer takes the first that fits. keep_attn: checkpointing keeps the attention outputs
# (training.recompute_attention=false), tried only where attention runs on SDPA (settings_of)
SETTINGS = {"megalysses": [{}, {"ckpt": True, "keep_attn": True}, {"ckpt": True}, {"ckpt": True, "tiled_mlp": True}],
            "transformers": [{}, {"ckpt": True}], "liger": [{}, {"ckpt": True}]}


# ----------------------------------------------------------------------------------------------- memory

def cap_fraction(total_bytes: float, cap_gib: float) -> Optional[float]:
    """The share of a device of `total_bytes` that is `cap_gib` (torch.cuda.set_per_process_memory_fraction's
    argument), or None when the device holds no more than that (`cap_gib` is rounded to 0.1 GiB: an H100's
    81,559 MiB is 79.65 GiB, and is not capped)."""
    return cap_gib * 2**30 / total_bytes if total_bytes >= (cap_gib + 0.05) * 2**30 else None


def cap_memory(device) -> dict:
    """On a GPU larger than an H100 (megalysses.plan.machine.DEVICE_MEMORY_GIB), caps this process's caching
    allocator at the H100's memory: {"cap_gib": the figure, "cap_applied": whether it was set}; None each on CPU."""
    import torch

    from megalysses.plan.machine import DEVICE_MEMORY_GIB

    if device.type != "cuda":
        return {"cap_gib": None, "cap_applied": None}
    cap = DEVICE_MEMORY_GIB[CAP_GPU]
    fraction = cap_fraction(torch.cuda.get_device_properties(device).total_memory, cap)
    if fraction is not None:
        torch.cuda.set_per_process_memory_fraction(fraction, device)
    return {"cap_gib": cap, "cap_applied": fraction is not None}


def allocator_figures(device) -> dict:
    """After a step, before any empty_cache: torch.cuda.max_memory_allocated and max_memory_reserved, the device's
    used memory (torch.cuda.mem_get_info's total less free: the CUDA context, cuBLAS workspaces, communicators
    and every process's allocations) and its total, in GiB; None each on CPU, where none of them exists."""
    import torch

    if device.type != "cuda":
        return dict.fromkeys(("max_allocated_gib", "max_reserved_gib", "used_gib", "device_total_gib"))
    free, total = torch.cuda.mem_get_info(device)
    return {"max_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
            "max_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
            "used_gib": (total - free) / 2**30, "device_total_gib": total / 2**30}


# ----------------------------------------------------------------------------------------------- worker

def _model_config(shape: dict):
    from megalysses.config import ModelConfig
    return ModelConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"], num_layers=shape["layers"],
                       num_heads=shape["heads"], num_kv_heads=shape["kv_heads"], ffn_hidden_size=shape["ffn"],
                       tie_embeddings=shape["tied"], rope_theta=shape["theta"])


def settings_of(framework: str, shape: dict, device, dtype) -> list[dict]:
    """SETTINGS[framework], less keeping attention outputs where megalysses' attention is not SDPA."""
    from megalysses.plan import Machine
    from megalysses.plan.run_plan import choose_attention

    head_dim = shape["hidden"] // shape["heads"]
    sdpa = choose_attention("auto", Machine.current(device), str(dtype).removeprefix("torch."), head_dim)[0] == "sdpa"
    return [s for s in SETTINGS[framework] if sdpa or not s.get("keep_attn")]


def megalysses_step(shape: dict, seq: int, opts: dict, device, dtype) -> Callable:
    """One training step of megalysses as a run builds it (the run plan on this machine, the one build path),
    at its fastest kernels here: the Triton kernels where they run, else the torch references."""
    import torch

    from megalysses.config import ConfigError
    from megalysses.config.io import load_config
    from megalysses.grid import ParallelGrid
    from megalysses.plan.memory import estimate_plan
    from megalysses.training.build import build_run
    from megalysses.testing import resolve_run
    from megalysses.training.step import train_step

    sets = [f"model.vocab_size={shape['vocab']}", f"model.hidden_size={shape['hidden']}",
            f"model.num_layers={shape['layers']}", f"model.num_heads={shape['heads']}",
            f"model.num_kv_heads={shape['kv_heads']}", f"model.ffn_hidden_size={shape['ffn']}",
            f"model.tie_embeddings={shape['tied']}", f"model.rope_theta={shape['theta']}", "data.mock=true",
            f"data.seq_len={seq}", "data.document_mask=false", f"training.dtype={str(dtype).removeprefix('torch.')}",
            f"training.activation_checkpointing={bool(opts.get('ckpt'))}",
            f"training.recompute_attention={not opts.get('keep_attn')}",
            f"training.mlp_chunk_tokens={seq // 8 if opts.get('tiled_mlp') else 0}", f"optimizer.lr={LR}",
            f"optimizer.weight_decay={WD}", f"optimizer.beta1={BETAS[0]}", f"optimizer.beta2={BETAS[1]}",
            f"optimizer.eps={EPS}", f"optimizer.grad_clip={CLIP}", "training.global_batch_size=1"]
    grid = ParallelGrid.single()
    for kernels in ("triton", "torch"):
        cfg = load_config(overrides=sets + [f"model.kernels={kernels}"])
        try:
            run = resolve_run(cfg, device, grid)
            break
        except ConfigError:
            if kernels == "torch":
                raise
    built = build_run(cfg, run, grid, device)
    model, opt = built.model, built.opt

    def step(tokens):
        batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:],
                 "position_ids": torch.arange(seq, device=device)[None]}
        return train_step(model, opt, [batch], grid, lr=LR, grad_clip=CLIP, dtype=run.torch_dtype).loss
    step.settings = f"kernels={run.kernels}, attention={run.attention}"
    step.predicted_gib = estimate_plan(cfg, run).peak / 2**30     # the memory model, for what the run resolved
    step.overrides = sets + [f"model.kernels={run.kernels}"]      # the config, for a trace of it
    return step


def transformers_step(shape: dict, seq: int, opts: dict, device, dtype, liger: bool) -> Callable:
    import torch
    import transformers

    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama()
    cfg = transformers.LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                                   intermediate_size=shape["ffn"], num_hidden_layers=shape["layers"],
                                   num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                                   max_position_embeddings=seq, rope_theta=shape["theta"],
                                   tie_word_embeddings=shape["tied"], attn_implementation="sdpa")
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg).train()
    if opts.get("ckpt"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=LR, betas=BETAS, eps=EPS, foreach=True)

    def step(tokens):
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:], shift_labels=tokens[:, 1:]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    step.settings = "sdpa, bf16 autocast" if dtype != torch.float32 else "sdpa"
    return step


def worker(args: argparse.Namespace) -> dict:
    """One trainer at one length and setting: warm-up steps, then timed steps. Returns a result row."""
    import torch

    from megalysses.plan.flops import flops_per_token
    from megalysses.training.metrics import peak_for as peak_tflops

    shape = SMOKE if args.smoke else LLAMA_1B
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    opts = json.loads(args.opts)
    row = {"framework": args.framework, "seq_len": args.seq, "options": opts, **cap_memory(device)}
    try:
        if args.framework == "megalysses":
            step = megalysses_step(shape, args.seq, opts, device, dtype)
        else:
            step = transformers_step(shape, args.seq, opts, device, dtype, liger=args.framework == "liger")
        gen = torch.Generator().manual_seed(1)
        times, loss = [], None
        for i in range(args.warmup + args.steps):
            tokens = torch.randint(0, shape["vocab"], (1, args.seq + 1), generator=gen).to(device)
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            loss = float(step(tokens))
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
    except torch.cuda.OutOfMemoryError:
        return {**row, "fits": False}
    tok_s = args.seq / statistics.median(times)
    peak = peak_tflops(0.0, device, dtype)
    flops = flops_per_token(_model_config(shape), args.seq)
    row.update(fits=True, settings=step.settings, tokens_per_s=tok_s, loss=loss,
               mfu=tok_s * flops / 1e12 / peak if peak else None,
               peak_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
               **allocator_figures(device))
    if args.framework == "megalysses":
        row.update(predicted_gib=step.predicted_gib, overrides=step.overrides)
    return row


# ----------------------------------------------------------------------------------------------- driver

def run_child(framework: str, seq: int, opts: dict, smoke: bool, steps: int, warmup: int, timeout: float,
              log: Optional[Callable[[str, str], None]] = None) -> dict:
    """One trainer at one length and setting in a process of its own (killed, with what it started, at
    `timeout` seconds): its result row; fits False when it ran out of memory, None when it failed or timed out
    (`error` says how). `log(what, output)` receives the output of a child that failed."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--framework", framework, "--seq", str(seq),
           "--opts", json.dumps(opts), "--steps", str(steps), "--warmup", str(warmup)] + (["--smoke"] if smoke else [])
    done = run_bounded(cmd, timeout)
    row = {"framework": framework, "seq_len": seq, "options": opts}
    lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
    if done.returncode == 0 and lines:
        return json.loads(lines[-1])
    if log is not None:
        log(f"bench_gpu worker {framework} {seq} {json.dumps(opts)}", done.stdout + done.stderr)
    if done.timed_out:
        return {**row, "fits": None, "error": "timed out"}
    oom = "out of memory" in (done.stderr + done.stdout).lower()
    return {**row, "fits": False if oom else None, "error": None if oom else done.last_line()[:300]}


def available(framework: str) -> Optional[str]:
    """None when the framework can run here, else why not."""
    import importlib.util

    import torch
    if framework in ("transformers", "liger") and importlib.util.find_spec("transformers") is None:
        return "transformers is not installed"
    if framework == "liger":
        if importlib.util.find_spec("liger_kernel") is None:
            return "liger-kernel is not installed"
        if not torch.cuda.is_available():
            return "liger-kernel needs CUDA"
    return None


def longest_fitting(fits: Callable[[int], Optional[bool]], lo: int, hi: int, step: int,
                    out_of_time: Callable[[], bool] = lambda: False
                    ) -> tuple[Optional[int], Optional[int], Optional[str]]:
    """(good, bad, stopped): the largest multiple of `step` in [lo, hi] for which fits() is True and the
    next one, for which it is False (None: hi fits), assuming fits is monotone (True up to some length,
    False beyond); (None, lo, None) if not even lo fits. From lo the probes double (clamped to hi) until
    one does not fit, then bisect: no probe is longer than twice the answer, and a probe far past the
    limit can run for minutes before it runs out of memory. fits() returns None when it cannot tell (a
    run that timed out or failed for another reason): the search stops there. It also stops when
    out_of_time() turns true. `stopped` says why ("time budget" or "unknown", None when it ran to the
    end); the answer then lies in [good, bad - step] (bad is hi + step when no probe failed), and good
    is None if nothing was learnt (lo unknown, or out of time from the start)."""
    def stop() -> str:
        return "time budget" if out_of_time() else "unknown"
    if out_of_time():
        return None, None, "time budget"
    at_lo = fits(lo)
    if at_lo is None:
        return None, None, stop()
    if not at_lo:
        return None, lo, None
    good, bad = lo // step, None               # fits(good*step); not fits(bad*step)
    while bad is None:
        if good * step >= hi:
            return hi, None, None
        if out_of_time():
            return good * step, hi + step, "time budget"
        nxt = min(2 * good, hi // step)
        at = fits(nxt * step)
        if at is None:
            return good * step, hi + step, stop()
        if at:
            good = nxt
        else:
            bad = nxt
    while bad - good > 1:
        if out_of_time():
            return good * step, bad * step, "time budget"
        mid = (good + bad) // 2
        at_mid = fits(mid * step)
        if at_mid is None:
            return good * step, bad * step, stop()
        if at_mid:
            good = mid
        else:
            bad = mid
    return good * step, bad * step, None


def longest_text(good: Optional[int], bad: Optional[int], step: int, bound: int,
                 stopped: Optional[str] = None) -> str:
    if good is None and bad is None:
        if stopped == "unknown":
            return "not known (the run at the shortest length did not finish within the child timeout or failed)"
        return "not searched (the time budget ended first)"
    if good is None:
        return f"none (not even {bad:,d})"
    if bad is None:
        return f"{good:,d} (the bound, {bound:,d})"
    if bad - good > step:
        why = ("a longer run did not finish within the child timeout or failed" if stopped == "unknown"
               else "the time budget ended the search")
        return f"{good:,d} to {bad - step:,d} ({why})"
    return f"{good:,d}"


def gpu_tag(name: str) -> str:
    """h100, h200, a100, ... from a CUDA device name; else the name's letters and digits."""
    from megalysses.plan.flops import PEAK_TFLOPS
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key in name:
            return key.lower()
    return "".join(c for c in name.lower() if c.isalnum())


def fmt(v, spec: str, missing: str = "–") -> str:
    return missing if v is None else format(v, spec)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="a tiny model on CPU (or GPU): checks the harness")
    p.add_argument("--lengths", type=int, nargs="+", help="sequence lengths (default 8K 16K 32K 128K)")
    p.add_argument("--frameworks", nargs="+", default=list(FRAMEWORKS), choices=FRAMEWORKS)
    p.add_argument("--no-longest", action="store_true", help="skip the longest-sequence bisection")
    p.add_argument("--longest-max", type=int, help="upper bound of the bisection (default 1M tokens)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--child-timeout", type=float, default=300.0)
    p.add_argument("--time-budget", type=float, default=570.0,
                   help="seconds for the whole benchmark (0: none): runs that would start past it are not "
                        "run, and the longest-sequence search stops with the interval it has narrowed to")
    add_output_args(p)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--framework", help=argparse.SUPPRESS)
    p.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    p.add_argument("--opts", default="{}", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    out = output_dir(p, args, args.smoke)
    if args.worker:
        print(json.dumps(worker(args)), flush=True)
        return 0

    import torch
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.smoke:
        print("error: no CUDA device: run on a GPU, or pass --smoke to check the harness on CPU", file=sys.stderr)
        return 2
    lengths = args.lengths or ([64, 128] if args.smoke else [8192, 16384, 32768, 131072])
    quantum = 64 if args.smoke else 8192
    longest_max = args.longest_max or (512 if args.smoke else 1 << 20)
    device = torch.cuda.get_device_name() if on_gpu else "cpu"
    skipped = {f: available(f) for f in args.frameworks}
    settings = {f: settings_of(f, SMOKE if args.smoke else LLAMA_1B, torch.device("cuda" if on_gpu else "cpu"),
                               torch.bfloat16 if on_gpu else torch.float32) for f in args.frameworks}
    rows, longest = [], {}
    start = time.time()
    deadline = start + args.time_budget if args.time_budget else float("inf")
    oom_from: dict = {}     # (framework, settings) -> the shortest length it ran out of memory at

    def child_timeout() -> float:
        return min(args.child_timeout, max(1.0, deadline - time.time()))
    for seq in lengths:
        for fw in args.frameworks:
            if skipped[fw]:
                continue
            for opts in settings[fw]:
                key = (fw, json.dumps(opts))
                if seq >= oom_from.get(key, float("inf")):      # out of memory at a shorter length already
                    continue
                if time.time() >= deadline:
                    r = {"framework": fw, "seq_len": seq, "options": opts, "fits": None,
                         "error": "not run: the time budget ended"}
                else:
                    r = run_child(fw, seq, opts, args.smoke, args.steps, args.warmup, child_timeout())
                print(f"  {fw:<12} {seq:>8} {json.dumps(opts):<40} "
                      f"{'fits' if r.get('fits') else 'out of memory' if r.get('fits') is False else r.get('error')}",
                      flush=True)
                if r.get("fits") or r.get("fits") is None:
                    rows.append(r)
                    break
                oom_from[key] = seq
            else:
                rows.append({"framework": fw, "seq_len": seq, "options": settings[fw][-1], "fits": False})
    if not args.no_longest:
        for fw in args.frameworks:
            if skipped[fw]:
                continue
            opts = settings[fw][-1]
            # a length that trained with lighter settings fits with the most memory-saving ones: no probe
            known = max([r["seq_len"] for r in rows if r["framework"] == fw and r.get("fits")], default=0)

            def fits(s: int, fw: str = fw, opts: dict = opts, known: int = known) -> Optional[bool]:
                if s <= known:
                    return True
                r = run_child(fw, s, opts, args.smoke, 1, 0, child_timeout())
                if r.get("fits") is None:
                    print(f"  longest {fw} at {s}: {r.get('error')}", flush=True)
                return r.get("fits")
            good, bad, stopped = longest_fitting(fits, quantum, longest_max, quantum,
                                                 lambda: time.time() >= deadline)
            longest[fw] = {"good": good, "bad": bad, "stopped": stopped}
            print(f"  longest {fw}: {longest_text(good, bad, quantum, longest_max, stopped)}", flush=True)

    from benchmarks.harness import source_commit

    versions = {"torch": torch.__version__, "cuda": torch.version.cuda, "commit": source_commit(),
                "python": platform.python_version()}
    try:
        import triton
        versions["triton"] = triton.__version__
    except ImportError:
        versions["triton"] = None
    shape = SMOKE if args.smoke else LLAMA_1B
    lines = [f"# One GPU: megalysses vs transformers vs transformers + Liger ({device})", "",
             (f"`python benchmarks/bench_gpu.py{' --smoke' if args.smoke else ''}` at commit {versions['commit']}, "
              f"torch {versions['torch']}, CUDA {versions['cuda']}, Triton {versions['triton']}; "
              f"{time.time() - start:.0f} s in all."),
             (f"Shape: vocab {shape['vocab']}, hidden {shape['hidden']}, {shape['layers']} layers, {shape['heads']} "
              f"heads / {shape['kv_heads']} KV, ffn {shape['ffn']}, tied embeddings; batch 1; AdamW, clip 1.0."), ""]
    lines += ["| seq | framework | settings | tok/s | MFU | peak GiB |", "|---:|---|---|---:|---:|---:|"]
    for r in rows:
        what = ("out of memory" if r.get("fits") is False else r.get("error") or
                ", ".join([k for k, v in r["options"].items() if v] or ["-"]) + f" ({r.get('settings', '')})")
        lines.append(f"| {r['seq_len']} | {r['framework']} | {what} | {fmt(r.get('tokens_per_s'), ',.0f')} | "
                     f"{fmt(r.get('mfu') and 100 * r['mfu'], '.1f')}{'%' if r.get('mfu') else ''} | "
                     f"{fmt(r.get('peak_gib'), '.1f')} |")
    for fw, why in skipped.items():
        if why:
            lines.append(f"| – | {fw} | not run: {why} | – | – | – |")
    if longest:
        lines += ["", "| framework | longest trainable sequence (one step, most memory-saving settings) |",
                  "|---|---:|"]
        lines += [f"| {fw} | {longest_text(n['good'], n['bad'], quantum, longest_max, n['stopped'])} |"
                  for fw, n in longest.items()]
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    if out is not None:
        stem = "three_way_" + ("smoke" if args.smoke else gpu_tag(device))
        write_text(out, f"{stem}.md", text)
        write_text(out, f"{stem}.json", json.dumps({"device": device, "versions": versions, "shape": shape,
                                                    "rows": rows, "longest": longest, "skipped": skipped},
                                                   indent=1) + "\n")
        print(f"wrote {out / stem}.md and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
