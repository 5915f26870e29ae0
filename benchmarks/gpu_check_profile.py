"""Stage 6 of benchmarks/gpu_check.py: a profile of one megalysses step at 16K (bench_gpu.py's step, at the
fastest settings the three-way found), its kernels by time in groups (GEMM, attention, copies and casts,
elementwise; communication and the rest apart) and the top kernels: a summary table, not a trace.

    python benchmarks/gpu_check.py --stages profile --out-dir runs/gpu_check
"""
from __future__ import annotations

import json
import time

from benchmarks import bench_gpu
from benchmarks.gpu_check_stages import best_row, failure, worker_cmd, worker_result
from benchmarks.harness import run_bounded


PROFILE_LENGTH, SMOKE_PROFILE_LENGTH = 16384, 64
CATEGORIES = (      # first match wins, on the lower-cased kernel (or, on CPU, aten op) name
    ("communication", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "sdpa", "flex")),
    ("GEMM", ("gemm", "gemv", "cutlass", "cublas", "nvjet", "xmma", "matmul", "aten::mm", "aten::addmm", "aten::bmm",
              "aten::linear")),
    ("copies and casts", ("memcpy", "memset", "copy", "cast", "aten::to", "aten::cat", "aten::clone", "contiguous")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "reduce", "norm", "rope", "swiglu", "silu", "triton",
                     "softmax", "entropy", "adam", "foreach", "aten::")),
)
TOP_KERNELS = 12
MODEL_CATEGORY = {"GEMM": "compute", "attention": "attention", "communication": "communication",
                  "copies and casts": "host copies"}
"""The step-time model's and the traced roofline's category (StepTime.breakdown, roofline.CATEGORIES) that each
profile group answers to; elementwise and the rest have none of their own (the model counts them in compute,
the trace in compute or launches)."""


def category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, words in CATEGORIES if any(w in low for w in words)), "other")


def summarise(kernels: list[tuple[str, float, int]]) -> dict:
    """(name, microseconds, calls) per kernel -> time per category and the top kernels, largest first."""
    total = sum(us for _, us, _ in kernels) or 1.0
    cats: dict[str, float] = {}
    for name, us, _ in kernels:
        cats[category(name)] = cats.get(category(name), 0.0) + us
    top = sorted(kernels, key=lambda k: -k[1])[:TOP_KERNELS]
    return {"total_ms": total / 1e3,
            "categories": [{"category": c, "ms": us / 1e3, "share": us / total}
                           for c, us in sorted(cats.items(), key=lambda kv: -kv[1])],
            "top": [{"name": n[:120], "category": category(n), "ms": us / 1e3, "calls": calls, "share": us / total}
                    for n, us, calls in top]}


def profile_worker(seq: int, opts: dict, smoke: bool) -> dict:
    """In a child: one megalysses step (bench_gpu's, as the three-way runs it) after a warm-up, under the profiler;
    CUDA kernels by self time on a GPU, aten ops by self CPU time without one."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    shape = bench_gpu.SMOKE if smoke else bench_gpu.LLAMA_1B
    cap = bench_gpu.cap_memory(device)
    step = bench_gpu.megalysses_step(shape, seq, opts, device, torch.bfloat16 if cuda else torch.float32)
    tokens = torch.randint(0, shape["vocab"], (1, seq + 1), generator=torch.Generator().manual_seed(1)).to(device)

    def sync():
        if cuda:
            torch.cuda.synchronize()
    step(tokens)                     # warm-up: compiles, the allocator's pools
    sync()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        start = time.perf_counter()
        step(tokens)
        sync()
        wall = time.perf_counter() - start
    kernels = []
    for e in prof.key_averages():
        if cuda and e.device_type == DeviceType.CUDA:
            us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        elif not cuda and e.key.startswith("aten::"):
            us = e.self_cpu_time_total
        else:
            continue
        if us > 0:
            kernels.append((e.key, float(us), int(e.count)))
    return {"seq_len": seq, "options": opts, "settings": step.settings, "step_s": wall,
            "measured": "CUDA kernels, self time" if cuda else "aten ops, self CPU time (no GPU)", **cap,
            **summarise(kernels)}


def profile(check, until: float) -> dict:
    seq = SMOKE_PROFILE_LENGTH if check.smoke else PROFILE_LENGTH
    fastest = best_row(check.latest("three_way").get("rows", []), "megalysses", seq, "speed")
    opts = fastest["options"] if fastest else {}
    done = run_bounded(worker_cmd("profile", check.smoke, "--seq", str(seq), "--opts", json.dumps(opts)),
                       until - time.monotonic())
    out = worker_result(done, f"profile worker {seq}", check)
    if out is None:
        return failure(done)
    # the model's and the trace's seconds of the same config, from the three-way's row of it (judge_three_way)
    same = {k: fastest.get(k) for k in ("predicted_breakdown", "traced_step_breakdown", "predicted_step_s",
                                        "traced_step_s")} if fastest else {}
    return {"status": "ran", **out, **same}


def render_profile(result: dict) -> list[str]:
    if "categories" not in result:
        return []
    opts = ", ".join(k for k, v in result["options"].items() if v) or "-"
    lines = [(f"One megalysses step of {result['seq_len']:,d} tokens ({opts}; {result['settings']}): "
             f"{result['step_s']:.3f} s wall, {result['total_ms']:.1f} ms of {result['measured']}."), "",
             "| group | ms | share |", "|---|---:|---:|"]
    lines += [f"| {c['category']} | {c['ms']:.1f} | {c['share']:.1%} |" for c in result["categories"]]
    lines += beside_models(result)
    lines += ["", "| kernel | group | calls | ms | share |", "|---|---|---:|---:|---:|"]
    lines += [f"| `{k['name']}` | {k['category']} | {k['calls']} | {k['ms']:.2f} | {k['share']:.1%} |"
              for k in result["top"]]
    return lines


def beside_models(result: dict) -> list[str]:
    """The profile's groups beside the step-time model's and the traced roofline's seconds of the same config
    (ms; – where a side has no such category or no figure), then what the two put in categories the profile
    cannot split."""
    model, trace = result.get("predicted_breakdown") or {}, result.get("traced_step_breakdown") or {}
    if not (model or trace):
        return []

    def ms(d: dict, key) -> str:
        return "–" if key is None or d.get(key) is None else f"{d[key] * 1e3:.1f}"
    lines = ["", (f"Beside the step-time model ({ms(result, 'predicted_step_s')} ms a step) and the traced roofline "
                  f"({ms(result, 'traced_step_s')} ms), by category:"), "",
             "| group | measured ms | model: category, ms | trace: ms |", "|---|---:|---|---:|"]
    for c in result["categories"]:
        key = MODEL_CATEGORY.get(c["category"])
        lines.append(f"| {c['category']} | {c['ms']:.1f} | {key or '–'}, {ms(model, key)} | {ms(trace, key)} |")
    for key in sorted((set(model) | set(trace)) - set(MODEL_CATEGORY.values())):
        lines.append(f"| – | – | {key}, {ms(model, key)} | {ms(trace, key)} |")
    return lines
