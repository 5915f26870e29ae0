"""The stages of benchmarks/gpu_check.py that measure against the memory model: the 1M-token probe (the first
2 of the 16 layers) and full steps at 128K then 256K, each with the memory options the planner picks for this
GPU (megalysses.plan.search), run by benchmarks/bench_memory.py's child (as pretrain builds a run), its measured
peak beside megalysses.memory's prediction for what the run resolved.

    python benchmarks/gpu_check.py --stages probe full_steps --out-dir runs/gpu_check

Each row records, after its step and before any empty_cache (bench_gpu.allocator_figures), max_memory_allocated,
max_memory_reserved and the device's used memory (mem_get_info's total less free), beside the memory model, the
traced peak (megalysses.training.trace, of the same config) and what the plan's budget assumes (plan_figures):
used - reserved is what Hardware.reserve_gib guesses (the CUDA context, cuBLAS workspaces, a one-rank
communicator; one GPU has no peers, so NCCL's per-peer buffers stay the stated plan/communicators.py figure),
reserved - allocated what the fragmentation allowance guesses. The checks (verdicts): the model and the trace
within 5% of max_memory_allocated, and a run the plan says fits at least 1 GiB short of the device's total (the
H100's where a larger GPU is capped to it); a row that fails one fails its stage, with the numbers.

The trace runs after the row's step, in a child of its own bounded by TRACE_CAP_S and the time left: a fake-tensor
step on the CPU costs seconds whatever the length (about 4 s at 1M tokens through 2 layers, and at 128K through
all 16), so every measured row is traced in the GPU window rather than precomputed for configs the GPU's own
`auto` resolution could change. Step times sit beside the step-time model's (StepTime.breakdown, by category) and
the traced roofline's.
"""
from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Any, Optional

from benchmarks import bench_gpu, bench_memory
from benchmarks.gpu_check_stages import CONFIG, GIB, base_overrides, failure, num, worker_cmd, worker_result
from benchmarks.harness import ROOT, run_bounded

PROBE_LENGTH, SMOKE_PROBE_LENGTH = 1 << 20, 1024
PROBE_LAYERS = 2
FULL_LENGTHS, SMOKE_FULL_LENGTHS = (131072, 262144), (256, 512)
STARTUP_S, SMOKE_STARTUP_S = 20.0, 10.0     # a child's start before its first step: imports, build, pinned buffers
MARGIN = 1.2        # a child starts when the time left holds its start and its steps at the planner's time x this
SMOKE_GPU_GIB = 80.0                        # the planner's device on CPU (--smoke): an 80 GB GPU
TARGET_ERROR = 0.05                         # the memory model and the trace within 5% of max_memory_allocated
HEADROOM_GIB = 1.0                          # a run the plan says fits leaves this much of the device unused
TRACE_CAP_S = 60.0                          # a trace's child (seconds of CPU: a few at 1M tokens, 2 layers)


def base_config(check):
    """The 1B config (gpt_1b_1m_offload.yaml; a tiny shape with --smoke) with what stage 1 saw auto resolve to
    (attention backend, dtype, kernels), so the planner and the memory model are asked about what runs."""
    from megalysses.config.io import load_config

    overrides = base_overrides(check.smoke)
    resolved = check.resolved()
    if resolved:
        overrides += [f"model.attention_backend={resolved['attention']}", f"training.dtype={resolved['dtype']}",
                      f"model.kernels={resolved['kernels']}"]
    return load_config(ROOT / CONFIG, overrides)


def hardware(check):
    """The planner's hardware: its defaults (an H100 SXM) with this GPU's bf16 peak where stage 1 knew it."""
    from megalysses.plan.step_time import Hardware

    peak = (check.env or {}).get("peak_tflops")
    return Hardware(peak_tflops=peak) if peak else Hardware()


def packages() -> tuple[str, ...]:
    """The optional packages that import here: the planner plans for this machine's (megalysses.plan)."""
    from megalysses.plan.machine import installed_packages

    return tuple(sorted(p for p in installed_packages() if p != "flex"))


def gpu_gib(check) -> float:
    """The device memory the planner plans for: this GPU's, capped at the H100's (a larger GPU runs capped to it,
    bench_gpu.cap_memory); an 80 GB GPU on CPU (--smoke)."""
    from megalysses.plan.machine import DEVICE_MEMORY_GIB

    found = (check.env or {}).get("gpu_memory_gib")
    return min(found, DEVICE_MEMORY_GIB[bench_gpu.CAP_GPU]) if found else SMOKE_GPU_GIB


def planned(check, seq_len: int):
    """(the planner's best layout of the base config at `seq_len` on this one GPU, or None; layouts considered)."""
    from megalysses.plan.search import plan

    fitting, considered = plan(base_config(check), 1, seq_len, gpu_gib(check),
                               (check.env or {}).get("host_available_gib"), hardware(check), packages())
    return (fitting[0] if fitting else None), considered


# ------------------------------------------------------------------------------------------ what the budget assumes

def plan_figures(prediction, gpu_memory_gib: float) -> dict:
    """What the plan's budget assumes for `prediction` (megalysses.plan.search.Prediction) on a GPU of
    `gpu_memory_gib`: whether it fits, its usable budget, the reserve, its communicators (the stated
    per-communicator figures), the fragmentation allowance, and its step time by category."""
    from megalysses.plan.communicators import P2P_PEER_MIB, communicator_bytes

    hw = prediction.hw
    return {"plan_fits": prediction.fits, "usable_gib": prediction.usable / GIB, "reserve_guess_gib": hw.reserve_gib,
            "communicators_gib": communicator_bytes(prediction.plan) / GIB, "nccl_per_peer_mib": P2P_PEER_MIB,
            "allowance_guess_gib": hw.allowance_bytes(gpu_memory_gib, prediction.estimate.largest.bytes) / GIB,
            "predicted_breakdown": prediction.step.breakdown(hw)}


def _less(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None else a - b


def overheads(row: dict) -> dict:
    """The measured figures the plan's guesses stand for: used - reserved (the CUDA context, cuBLAS workspaces, a
    one-rank communicator: Hardware.reserve_gib's guess) and reserved - allocated (the fragmentation allowance's
    guess), in GiB; None each where a figure is absent (on CPU)."""
    return {"context_gib": _less(row.get("used_gib"), row.get("max_reserved_gib")),
            "fragmentation_gib": _less(row.get("max_reserved_gib"), row.get("max_allocated_gib"))}


def budget_total_gib(row: dict) -> Optional[float]:
    """The device's total a verdict measures against: the cap where one was applied, else the device's."""
    return row.get("cap_gib") if row.get("cap_applied") else row.get("device_total_gib")


def verdicts(row: dict) -> list[str]:
    """The memory checks a measured row fails, each with its numbers: the memory model and the trace within
    TARGET_ERROR of max_memory_allocated; a run the plan says fits out of memory, or within HEADROOM_GIB of the
    device's total. Nothing to check without the CUDA figures (on CPU)."""
    allocated, fails = row.get("max_allocated_gib"), []
    if row.get("plan_fits") and str(row.get("error_text", "")).startswith("out of memory"):
        fails.append(f"the plan says it fits, yet it ran out of memory ({row['error_text'][:120]})")
    if allocated is None:
        return fails
    for name, key in (("memory model", "predicted_gib"), ("trace", "traced_peak_gib")):
        if row.get(key) is not None and abs(row[key] / allocated - 1) > TARGET_ERROR:
            fails.append(f"{name} {row[key]:.2f} GiB against max_memory_allocated {allocated:.2f} GiB: "
                         f"{row[key] / allocated - 1:+.1%}, over {TARGET_ERROR:.0%}")
    total, used = budget_total_gib(row), row.get("used_gib")
    if row.get("plan_fits") and total is not None and used is not None and total - used < HEADROOM_GIB:
        fails.append(f"the plan says it fits (usable {num(row.get('usable_gib'), '.2f')} GiB), yet {used:.2f} GiB of "
                     f"the device's {total:.2f} GiB is used: within {HEADROOM_GIB:g} GiB")
    return fails


def trace_worker(config: str, opts: dict) -> dict:
    """In a child: the traced peak and roofline (megalysses.training.trace) of the config at `config` on one GPU
    of opts["gpu_gib"] at opts["peak_tflops"] (None: the planner's default) with opts["packages"]."""
    from megalysses.config.io import load_config
    from megalysses.plan.search import described_machine
    from megalysses.plan.step_time import Hardware
    from megalysses.training.trace import trace_fields, trace_run

    hw = Hardware(peak_tflops=opts["peak_tflops"]) if opts.get("peak_tflops") else Hardware()
    machine = described_machine(1, opts["gpu_gib"], hw, tuple(opts["packages"]))
    fields = trace_fields(trace_run(load_config(config), machine, 1, hw=hw), 1)
    return {k: fields[k] for k in ("traced_peak_gib", "traced_part", "traced_step_s", "traced_step_breakdown")}


def traced(check, cfg, until: float, name: str) -> dict:
    """The trace of `cfg` in a child bounded by TRACE_CAP_S and the time left: its fields, or traced_error."""
    from megalysses.config.io import save_config

    left = min(TRACE_CAP_S, until - time.monotonic())
    if left < 1:
        return {"traced_error": "not traced: the stage's time bound ended"}
    path = check.work / f"{name}_trace.yaml"
    save_config(cfg, path)
    opts = {"gpu_gib": gpu_gib(check), "peak_tflops": (check.env or {}).get("peak_tflops"), "packages": packages()}
    done = run_bounded(worker_cmd("trace", check.smoke, "--config", str(path), "--opts", json.dumps(opts)), left)
    out = worker_result(done, f"trace worker {name}", check)
    return out if out is not None else {"traced_error": failure(done)["why"]}


def judged(check, row: dict, prediction, cfg, until: float, name: str) -> dict:
    """`row` with the plan's figures, the trace, the measured overheads and the verdicts."""
    row.update(plan_figures(prediction, gpu_gib(check)))
    if "measured_gib" in row or "tokens_per_s" in row:
        row.update(traced(check, cfg, until, name))
    row.update(overheads(row))
    row["verdicts"] = verdicts(row)
    return row


def _options(prediction) -> str:
    from megalysses.training.runtime import memory_options
    return ", ".join(memory_options(prediction.cfg, prediction.plan))


def _run(check, cfg, seq_len: int, steps: int, until: float, name: str) -> dict:
    from megalysses.config.io import save_config

    path = check.work / f"{name}.yaml"
    save_config(cfg, path)
    return bench_memory.in_subprocess(str(path), [], seq_len, steps, max(1.0, until - time.monotonic()), check.note)


def _fits_in_time(predicted_s: Optional[float], steps: int, check, until: float) -> bool:
    startup = SMOKE_STARTUP_S if check.smoke else STARTUP_S
    return until - time.monotonic() >= startup + MARGIN * steps * (predicted_s or 0.0)


def judge_three_way(check, rows: list[dict], until: float) -> None:
    """The three-way's megalysses rows that ran, each judged as the memory stages' rows are (judged): their config
    (bench_gpu's overrides) evaluated by the planner on this GPU, traced while the time left holds."""
    from megalysses.config.io import load_config
    from megalysses.plan.search import evaluate

    for r in rows:
        if r["framework"] != "megalysses" or not r.get("fits") or "overrides" not in r or "verdicts" in r:
            continue
        try:
            cfg = load_config(overrides=r["overrides"])
            prediction = evaluate(cfg, 1, gpu_gib(check), (check.env or {}).get("host_available_gib"),
                                  hardware(check), packages())
        except Exception as e:  # noqa: BLE001 - the planner's refusal is this row's note; the measured rows stay
            r["plan_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            continue
        r.update(predicted_step_s=prediction.step.total, step_s=r["seq_len"] / r["tokens_per_s"])
        judged(check, r, prediction, cfg, until, f"three_way_{r['seq_len']}_{rows.index(r)}")


def _status(rows: list[dict]) -> dict:
    """failed when a child broke (not out of memory, not out of time: those are measurements and bounds), or
    when a row fails a memory check (verdicts)."""
    broken = [r for r in rows if "error_text" in r and not r["error_text"].startswith(("out of memory", "did not",
                                                                                     "not run"))]
    if broken:
        return {"status": "failed", "why": broken[0]["error_text"][:300]}
    failed = [f"{r['seq_len']:,d} tokens: {v}" for r in rows for v in r.get("verdicts", [])]
    return {"status": "failed", "why": "; ".join(failed)[:600]} if failed else {"status": "ran"}


def probe(check, until: float) -> dict:
    """Forward and backward (one training step) of the first 2 of the 16 layers at 1M tokens, with the options
    the planner picks for the full model: the measured peak beside the prediction for those 2 layers, and the
    prediction for the full step."""
    from megalysses.plan.search import evaluate

    S = SMOKE_PROBE_LENGTH if check.smoke else PROBE_LENGTH
    best, considered = planned(check, S)
    if best is None:
        return {"status": "ran", "rows": [], "why": f"no layout of the {considered} considered fits {S:,d} tokens on "
                                                    f"this GPU (tools/plan.py): nothing to probe"}
    cfg = replace(best.cfg, model=replace(best.cfg.model, num_layers=PROBE_LAYERS))
    prediction = evaluate(cfg, 1, gpu_gib(check), (check.env or {}).get("host_available_gib"), hardware(check),
                          packages())
    row: dict[str, Any] = {"seq_len": S, "layers": f"{PROBE_LAYERS} of {best.cfg.model.num_layers}",
                           "options": _options(best), "full_predicted_gib": best.estimate.peak / GIB,
                           "full_part": best.estimate.part, "full_predicted_step_s": best.step.total,
                           "predicted_step_s": prediction.step.total}
    if not _fits_in_time(prediction.step.total, 1, check, until):
        row["error_text"] = (f"not run: {until - time.monotonic():.0f} s left, the step is predicted at "
                             f"{prediction.step.total:.0f} s")
    else:
        row.update(_run(check, cfg, S, 1, until, "probe"))
        judged(check, row, prediction, cfg, until, "probe")
    return {**_status([row]), "rows": [row]}


def full_steps(check, until: float) -> dict:
    """megalysses alone at 128K, then 256K, each with the planner's options, while the time left holds the
    planner's step time (two steps, the second measured; one when only one fits)."""
    rows: list[dict] = []
    for S in SMOKE_FULL_LENGTHS if check.smoke else FULL_LENGTHS:
        best, considered = planned(check, S)
        if best is None:
            rows.append({"seq_len": S, "error_text": f"not run: no layout of {considered} fits (tools/plan.py)"})
            continue
        row = {"seq_len": S, "options": _options(best), "predicted_step_s": best.step.total}
        steps = next((n for n in (2, 1) if _fits_in_time(best.step.total, n, check, until)), 0)
        if steps:
            row.update(_run(check, best.cfg, S, steps, until, f"full_{S}"))
            judged(check, row, best, best.cfg, until, f"full_{S}")
        else:
            row["error_text"] = (f"not run: {until - time.monotonic():.0f} s left, a step is predicted at "
                                 f"{best.step.total:.0f} s")
        rows.append(row)
        check.partial({"status": "running", "rows": rows})
    return {**_status(rows), "rows": rows}


def _error(r: dict) -> str:
    if "error" not in r:
        return "–"
    return f"{r['error']:+.1%}" + ("" if abs(r["error"]) <= TARGET_ERROR else f" (over {TARGET_ERROR:.0%})")


def _split(seconds: Optional[dict]) -> str:
    return ", ".join(f"{k} {v:.3g}" for k, v in seconds.items() if v) if seconds else "–"


def render_budget(rows: list[dict]) -> list[str]:
    """The memory the budget assumes, measured (GiB; – where absent, as on CPU), and the checks' verdicts."""
    ran = [r for r in rows if "verdicts" in r]
    if not ran:
        return []
    lines = ["", ("| tokens | model | trace | max allocated | max reserved | used of total (cap) | used - reserved "
                  "(reserve + communicators guessed) | reserved - allocated (allowance guessed) | usable (plan fits) "
                  "| checks |"), "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in ran:
        cap = f" (cap {r['cap_gib']:.1f})" if r.get("cap_applied") else ""
        checks = "; ".join(r.get("verdicts", [])) or ("passed" if r.get("max_allocated_gib") is not None
                                                      else "no CUDA figures")
        lines.append(
            f"| {r['seq_len']:,d} | {num(r.get('predicted_gib'), '.2f')} | "
            f"{num(r.get('traced_peak_gib'), '.2f') if 'traced_error' not in r else r['traced_error'][:80]} | "
            f"{num(r.get('max_allocated_gib'), '.2f')} | {num(r.get('max_reserved_gib'), '.2f')} | "
            f"{num(r.get('used_gib'), '.2f')} of {num(r.get('device_total_gib'), '.2f')}{cap} | "
            f"{num(r.get('context_gib'), '.2f')} ({num(r.get('reserve_guess_gib'), '.2f')} + "
            f"{num(r.get('communicators_gib'), '.3f')}; NCCL {r.get('nccl_per_peer_mib', '–')} MiB per peer, stated) | "
            f"{num(r.get('fragmentation_gib'), '.2f')} ({num(r.get('allowance_guess_gib'), '.2f')}) | "
            f"{num(r.get('usable_gib'), '.2f')} ({r.get('plan_fits', '–')}) | {checks} |")
    lines += ["", "| tokens | step s | model s | model by category | traced s | traced by category |",
              "|---:|---:|---:|---|---:|---|"]
    for r in ran:
        lines.append(f"| {r['seq_len']:,d} | {num(r.get('step_s'), '.2f')} | {num(r.get('predicted_step_s'), '.2f')} | "
                     f"{_split(r.get('predicted_breakdown'))} | {num(r.get('traced_step_s'), '.2f')} | "
                     f"{_split(r.get('traced_step_breakdown'))} |")
    return lines


def render_probe(result: dict) -> list[str]:
    lines = [("| tokens | layers | options | predicted GiB | measured GiB | error | step s (predicted) | full step: "
             "predicted GiB, part, s |"), "|---:|---|---|---:|---:|---:|---:|---|"]
    for r in result.get("rows", []):
        measured = num(r.get("measured_gib"), ".2f") if "measured_gib" in r else r.get("error_text", "")
        step = f"{num(r.get('step_s'), '.1f')} ({num(r.get('predicted_step_s'), '.1f')})"
        lines.append(f"| {r['seq_len']:,d} | {r['layers']} | {r['options']} | {num(r.get('predicted_gib'), '.2f')} | "
                     f"{measured} | {_error(r)} | {step} | {r['full_predicted_gib']:.2f}, {r['full_part']}, "
                     f"{r['full_predicted_step_s']:.0f} |")
    return lines + render_budget(result.get("rows", [])) if result.get("rows") else []


def render_full_steps(result: dict) -> list[str]:
    lines = ["| tokens | options | predicted GiB | measured GiB | error | steps | step s (predicted) | tok/s | MFU |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result.get("rows", []):
        if "measured_gib" not in r:
            lines.append(f"| {r['seq_len']:,d} | {r.get('options', '–')} | {num(r.get('predicted_gib'), '.2f')} | "
                         f"{r.get('error_text', '')} | – | – | – ({num(r.get('predicted_step_s'), '.1f')}) | – | – |")
            continue
        lines.append(f"| {r['seq_len']:,d} | {r['options']} | {r['predicted_gib']:.2f} | {r['measured_gib']:.2f} | "
                     f"{_error(r)} | {r['steps']} | {r['step_s']:.2f} ({num(r.get('predicted_step_s'), '.2f')}) | "
                     f"{r['tokens_per_s']:,.0f} | {num(r.get('mfu'), '.1f', 100, '%')} |")
    return lines + render_budget(result.get("rows", [])) if result.get("rows") else []
