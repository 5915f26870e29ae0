"""The stages of benchmarks/gpu_check.py that measure against the memory model: the 1M-token probe (the first
2 of the 16 layers) and full steps at 128K then 256K, each with the memory options the planner picks for this
GPU (megalysses.plan.search), run by benchmarks/bench_memory.py's child (as pretrain builds a run), its measured
peak beside megalysses.memory's prediction for what the run resolved.

    python benchmarks/gpu_check.py --stages probe full_steps --out-dir runs/gpu_check
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Optional

from benchmarks import bench_memory
from benchmarks.gpu_check_stages import CONFIG, GIB, base_overrides, num
from benchmarks.harness import ROOT

PROBE_LENGTH, SMOKE_PROBE_LENGTH = 1 << 20, 1024
PROBE_LAYERS = 2
FULL_LENGTHS, SMOKE_FULL_LENGTHS = (131072, 262144), (256, 512)
STARTUP_S, SMOKE_STARTUP_S = 20.0, 10.0     # a child's start before its first step: imports, build, pinned buffers
MARGIN = 1.2        # a child starts when the time left holds its start and its steps at the planner's time x this
SMOKE_GPU_GIB = 80.0                        # the planner's device on CPU (--smoke): an 80 GB GPU
TARGET_ERROR = 0.10                         # the memory model within 10% of max_memory_allocated


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


def planned(check, seq_len: int):
    """(the planner's best layout of the base config at `seq_len` on this one GPU, or None; layouts considered)."""
    from megalysses.plan.search import plan

    env = check.env or {}
    gpu_gib = env.get("gpu_memory_gib") or SMOKE_GPU_GIB
    fitting, considered = plan(base_config(check), 1, seq_len, gpu_gib, env.get("host_available_gib"), hardware(check),
                               packages())
    return (fitting[0] if fitting else None), considered


def _options(prediction) -> str:
    from megalysses.training.runtime import memory_options
    return ", ".join(memory_options(prediction.cfg, prediction.run))


def _run(check, cfg, seq_len: int, steps: int, until: float, name: str) -> dict:
    from megalysses.config.io import save_config

    path = check.work / f"{name}.yaml"
    save_config(cfg, path)
    return bench_memory.in_subprocess(str(path), [], seq_len, steps, max(1.0, until - time.monotonic()), check.note)


def _fits_in_time(predicted_s: Optional[float], steps: int, check, until: float) -> bool:
    startup = SMOKE_STARTUP_S if check.smoke else STARTUP_S
    return until - time.monotonic() >= startup + MARGIN * steps * (predicted_s or 0.0)


def _status(rows: list[dict]) -> dict:
    """failed when a child broke (not out of memory, not out of time: those are measurements and bounds)."""
    broken = [r for r in rows if "error_text" in r and not r["error_text"].startswith(("out of memory", "did not",
                                                                                     "not run"))]
    return {"status": "failed", "why": broken[0]["error_text"][:300]} if broken else {"status": "ran"}


def probe(check, until: float) -> dict:
    """Forward and backward (one training step) of the first 2 of the 16 layers at 1M tokens, with the options
    the planner picks for the full model: the measured peak beside the prediction for those 2 layers, and the
    prediction for the full step."""
    from megalysses.plan.search import described_machine, predicted_step_seconds

    S = SMOKE_PROBE_LENGTH if check.smoke else PROBE_LENGTH
    best, considered = planned(check, S)
    if best is None:
        return {"status": "ran", "rows": [], "why": f"no layout of the {considered} considered fits {S:,d} tokens on "
                                                    f"this GPU (tools/plan.py): nothing to probe"}
    cfg = replace(best.cfg, model=replace(best.cfg.model, num_layers=PROBE_LAYERS))
    gpu_gib = (check.env or {}).get("gpu_memory_gib") or SMOKE_GPU_GIB
    predicted_s = predicted_step_seconds(cfg, 1, hardware(check),
                                         described_machine(1, gpu_gib, hardware(check), packages()))
    row: dict[str, Any] = {"seq_len": S, "layers": f"{PROBE_LAYERS} of {best.cfg.model.num_layers}",
                           "options": _options(best), "full_predicted_gib": best.estimate.peak / GIB,
                           "full_phase": best.estimate.phase, "full_predicted_step_s": best.step.total,
                           "predicted_step_s": predicted_s}
    if not _fits_in_time(predicted_s, 1, check, until):
        row["error_text"] = (f"not run: {until - time.monotonic():.0f} s left, the step is predicted at "
                             f"{num(predicted_s, '.0f')} s")
    else:
        row.update(_run(check, cfg, S, 1, until, "probe"))
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
        else:
            row["error_text"] = (f"not run: {until - time.monotonic():.0f} s left, a step is predicted at "
                                 f"{best.step.total:.0f} s")
        rows.append(row)
        check.partial({"status": "running", "rows": rows})
    return {**_status(rows), "rows": rows}


def _error(r: dict) -> str:
    if "error" not in r:
        return "–"
    return f"{r['error']:+.1%}" + ("" if abs(r["error"]) <= TARGET_ERROR else " (over 10%)")


def render_probe(result: dict) -> list[str]:
    lines = [("| tokens | layers | options | predicted GiB | measured GiB | error | step s (predicted) | full step: "
             "predicted GiB, phase, s |"), "|---:|---|---|---:|---:|---:|---:|---|"]
    for r in result.get("rows", []):
        measured = num(r.get("measured_gib"), ".2f") if "measured_gib" in r else r.get("error_text", "")
        step = f"{num(r.get('step_s'), '.1f')} ({num(r.get('predicted_step_s'), '.1f')})"
        lines.append(f"| {r['seq_len']:,d} | {r['layers']} | {r['options']} | {num(r.get('predicted_gib'), '.2f')} | "
                     f"{measured} | {_error(r)} | {step} | {r['full_predicted_gib']:.2f}, {r['full_phase']}, "
                     f"{r['full_predicted_step_s']:.0f} |")
    return lines if result.get("rows") else []


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
    return lines if result.get("rows") else []
