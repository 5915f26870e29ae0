"""The first stages of benchmarks/gpu_check.py: the environment, the GPU tier's fast subset and the three-way
benchmark (the memory stages are in gpu_check_memory.py, the profile in gpu_check_profile.py). Each stage is
`stage(check, until) -> result` (until: the time.monotonic() by which it must be done; every child process it
starts is bounded by it), and its result renders as markdown lines with `render_<stage>(result)`.

    python benchmarks/gpu_check.py --smoke --out-dir /tmp/gpu_check     # every stage at a tiny shape on CPU

The risky parts (pytest, each trainer, the probes, the profile) run as child processes of their own, so a hang
or a CUDA crash ends that child, never the harness.
"""
from __future__ import annotations

import importlib.util
import json
import platform
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Optional

from benchmarks import bench_gpu, bench_memory
from benchmarks.harness import ROOT, child_env, run_bounded

CONFIG = "configs/gpt_1b_1m_offload.yaml"        # the Llama-3.2-1B shape on one GPU
BASE_OVERRIDES = ["data.mock=true", "data.document_mask=false"]   # random tokens, as every stage trains on
GIB = 1024 ** 3
OPTIONAL = ("liger_kernel", "flash_attn", "apex")
RESULT = "RESULT "                               # a worker's result line on stdout


def base_overrides(smoke: bool) -> list[str]:
    return BASE_OVERRIDES + (bench_memory.SMOKE if smoke else [])


def worker_result(done, what: str, check) -> Optional[dict]:
    """The RESULT line a gpu_check worker printed, or None (its output goes to the log)."""
    lines = [x for x in done.stdout.splitlines() if x.startswith(RESULT)]
    if done.returncode == 0 and lines:
        return json.loads(lines[-1][len(RESULT):])
    check.note(what, done.stdout + done.stderr)
    return None


def failure(done) -> dict:
    if done.timed_out:
        return {"status": "timed out", "why": f"stopped at its bound after {done.seconds:.0f} s"}
    return {"status": "failed", "why": f"exit {done.returncode}: {done.last_line()[:300]}"}


def worker_cmd(name: str, smoke: bool, *extra: str) -> list[str]:
    return [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--worker", name, *extra] + \
        (["--smoke"] if smoke else [])


# ------------------------------------------------------------------------------------------ 1. environment

def resolve_auto(cfg, device: str) -> dict:
    """What a run of `cfg` on `device` resolves `auto` to: the run's own decision (megalysses.plan.resolve on this
    machine, as training.runtime.resolve_run asks it), asked here and nowhere else in gpu_check; the later stages
    read its answer."""
    import torch

    from megalysses.testing import resolve_run

    run = resolve_run(cfg, torch.device(device))
    return {"dtype": run.dtype, "attention": run.attention, "why": run.attention_reason, "kernels": run.kernels}


def _package(name: str) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    if importlib.util.find_spec(name) is None:
        return {"status": "not installed"}
    try:
        __import__(name)
    except Exception as e:  # noqa: BLE001 - a broken build raises anything (ImportError, OSError, RuntimeError)
        return {"status": "does not import", "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    try:
        return {"status": "imports", "version": version(name.replace("_", "-"))}
    except PackageNotFoundError:
        return {"status": "imports", "version": None}


def environment_worker(smoke: bool) -> dict:
    """In a child: versions, the GPU, the optional packages, and what auto resolves to at the 1B shape."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    from megalysses.config.io import load_config

    def ver(name: str) -> Optional[str]:
        try:
            return version(name)
        except PackageNotFoundError:
            return None
    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
                            "triton": ver("triton"), "transformers": ver("transformers"), "gpu": None}
    if torch.cuda.is_available():
        from megalysses.training.metrics import peak_for

        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=props.total_memory / GIB, capability=f"{props.major}.{props.minor}",
                    peak_tflops=peak_for(0.0, torch.device("cuda", 0), torch.bfloat16))
        smi = run_bounded(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], 20) \
            if shutil.which("nvidia-smi") else None
        info["driver"] = smi.stdout.strip().splitlines()[0] if smi and smi.returncode == 0 and smi.stdout.strip() \
            else None
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
        info["host_memory_gib"] = int(fields["MemTotal"].split()[0]) * 1024 / GIB
        info["host_available_gib"] = int(fields["MemAvailable"].split()[0]) * 1024 / GIB
    info["packages"] = {name: _package(name) for name in OPTIONAL}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    info["auto"] = {}
    for docs in (False, True):
        cfg = load_config(ROOT / CONFIG, base_overrides(smoke) + ["model.attention_backend=auto", "training.dtype=auto",
                                                                  f"data.document_mask={str(docs).lower()}"])
        try:
            info["auto"]["documents" if docs else "no documents"] = resolve_auto(cfg, device)
        except Exception as e:  # noqa: BLE001 - a ConfigError (kernels the device cannot run) is the answer too
            info["auto"]["documents" if docs else "no documents"] = {"error": str(e)}
    return info


def environment(check, until: float) -> dict:
    done = run_bounded(worker_cmd("env", check.smoke), until - time.monotonic())
    info = worker_result(done, "environment worker", check)
    if info is None:
        return failure(done)
    info["liger_source"] = check.liger_source
    return {"status": "ran", "info": info}


def render_environment(result: dict) -> list[str]:
    info = result.get("info")
    if not info:
        return []
    gpu = (f"{info['gpu']}, {info['gpu_memory_gib']:.1f} GiB, compute capability {info['capability']}, driver "
           f"{info.get('driver') or 'unknown'}") if info.get("gpu") else "none (CPU)"
    lines = ["| what | value |", "|---|---|", f"| GPU | {gpu} |",
             (f"| host memory | {info.get('host_memory_gib', 0):.0f} GiB ({info.get('host_available_gib', 0):.0f} "
             f"GiB available) |"),
             (f"| versions | Python {info['python']}, torch {info['torch']}, CUDA {info['cuda']}, cuDNN "
              f"{info['cudnn']}, Triton {info['triton']}, transformers {info['transformers']} |")]
    for name, p in info["packages"].items():
        what = p["status"] + (f" ({p['version']})" if p.get("version") else "") + (f": {p['error']}" if p.get("error")
                                                                                  else "")
        if name == "liger_kernel" and info.get("liger_source"):
            what += f", from {info['liger_source']}"
        lines.append(f"| {name} | {what} |")
    for case, r in info["auto"].items():
        what = r.get("error") or f"attention {r['attention']} ({r['why']}), kernels {r['kernels']}, dtype {r['dtype']}"
        lines.append(f"| auto at the 1B shape, {case} | {what} |")
    return lines


# ------------------------------------------------------------------------------------------ 2. GPU tier subset

# what the fast subset must show: (what, test file, words every test id of it contains; {device}: cuda, or cpu
# in --smoke, which only collects). Run in this order: a bound that ends early cuts the last ones.
SUBSET = (
    ("device placement, the collectives' device checks", "tests/test_gpu.py", ("two_ranks_on_one_gpu",)),
    ("bf16 loss curve over 50 steps against fp32", "tests/test_gpu.py", ("bf16_training_tracks_fp32",)),
    ("each Triton kernel and kernel backend against torch, bf16 and fp32", "tests/test_kernels.py", ()),
    ("attention backends at the 1B head dim (64), grouped-query heads", "tests/test_attention_backends.py",
     ("{device}", "8-2")),
)
PER_TEST_TIMEOUT_S = 120
OUTCOME = re.compile(r"^(tests/\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
SUMMARY = re.compile(r"^(?:FAILED|ERROR) (tests/\S+::\S+?)(?: - (.*))?$")


def subset(device: str) -> list[tuple[str, str, tuple[str, ...]]]:
    return [(what, path, tuple(w.format(device=device) for w in words)) for what, path, words in SUBSET]


def selection(items) -> tuple[list[str], str]:
    """(the test files, the -k expression) that select `items`."""
    files = list(dict.fromkeys(path for _, path, _ in items))
    expr = " or ".join("(" + " and ".join((Path(path).stem,) + words) + ")" for _, path, words in items)
    return files, expr


def tally(stdout: str, items) -> dict:
    """pytest's output (-v -rfE: a line per test; --collect-only -q: a test id per line) counted per item of the
    subset: {"rows": [per item: tests, passed, skipped, collected, failures], "selected", "reported"}."""
    outcomes: dict[str, str] = {}
    for line in stdout.splitlines():
        m = OUTCOME.match(line)
        if m:                            # a test's last line wins: a teardown ERROR after PASSED fails it
            outcomes[m[1]] = m[2]
        elif re.match(r"^tests/\S+::\S+$", line.strip()):
            outcomes[line.strip()] = "collected"
    messages = {m[1]: m[2] or "" for m in map(SUMMARY.match, stdout.splitlines()) if m}
    rows = []
    for what, path, words in items:
        mine = {t: o for t, o in outcomes.items() if t.startswith(path + "::") and all(w in t for w in words)}
        count = {o: sum(1 for x in mine.values() if x == o) for o in ("collected", "PASSED", "SKIPPED")}
        bad = [{"id": t, "outcome": o, "message": messages.get(t, "")[:300]}
               for t, o in mine.items() if o in ("FAILED", "ERROR", "XPASS")]
        rows.append({"what": what, "tests": len(mine), "passed": count["PASSED"], "skipped": count["SKIPPED"],
                     "collected": count["collected"], "failures": bad})
    selected = (re.search(r"(\d+) selected", stdout) or re.search(r"(\d+)/\d+ tests collected", stdout)
                or re.search(r"collected (\d+) item", stdout) or re.search(r"(\d+) tests? collected", stdout))
    return {"rows": rows, "selected": int(selected[1]) if selected else None, "reported": len(outcomes)}


def tests(check, until: float) -> dict:
    """pytest on the subset: on a GPU run test by test (-m gpu); with --smoke collected only, which proves the
    selection still finds tests for every item."""
    items = subset("cpu" if check.smoke else "cuda")
    files, expr = selection(items)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-k", expr, *files]
    if check.smoke:
        cmd += ["--collect-only", "-q"]
    else:
        cmd += ["-v", "-rfE", "-m", "gpu"]
        if importlib.util.find_spec("pytest_timeout") is not None:
            cmd += [f"--timeout={PER_TEST_TIMEOUT_S}"]
    if importlib.util.find_spec("pytest") is None:
        return {"status": "failed", "why": "pytest is not installed: pip install -e '.[test]'"}
    done = run_bounded(cmd, until - time.monotonic(), env=child_env(OMP_NUM_THREADS="1"))
    check.note("pytest " + " ".join(cmd[3:]), "\n".join((done.stdout + done.stderr).splitlines()[-300:]))
    result = {**tally(done.stdout, items), "command": " ".join(["pytest"] + cmd[3:])}
    rows = result["rows"]
    if done.timed_out:
        return {**result, "status": "timed out",
                "why": f"stopped at its bound after {done.seconds:.0f} s with {result['reported']} tests reported"}
    if done.returncode not in (0, 1, 5):
        return {**result, "status": "failed", "why": f"pytest exit {done.returncode}: {done.last_line()[:300]}"}
    stale = [r["what"] for r in rows if not r["tests"]]
    if stale:
        return {**result, "status": "failed",
                "why": "no test selected for: " + "; ".join(stale) + " (gpu_check_stages.SUBSET is stale)"}
    failed = sum(len(r["failures"]) for r in rows)
    return {**result, "status": "failed" if failed else "ran", "why": f"{failed} tests failed" if failed else ""}


def render_tests(result: dict) -> list[str]:
    if "rows" not in result:
        return []
    lines = [f"`{result['command']}`: {result['reported']} of {result['selected']} selected tests reported.", "",
             "| what | tests | passed | skipped | failed |", "|---|---:|---:|---:|---:|"]
    for r in result["rows"]:
        passed = r["passed"] if not r["collected"] else f"{r['collected']} collected"
        lines.append(f"| {r['what']} | {r['tests']} | {passed} | {r['skipped']} | {len(r['failures'])} |")
    for r in result["rows"]:
        lines += [f"- {f['outcome']} `{f['id']}`: {f['message']}" for f in r["failures"]]
    return lines


# ------------------------------------------------------------------------------------------ 3. three-way

LENGTHS, SMOKE_LENGTHS = (16384, 32768), (64,)
FRAMEWORKS = ("megalysses", "liger", "transformers")
CHECKPOINTING = {"ckpt": True}      # the memory comparison: activation checkpointing on for all three
CHILD_CAP_S, SMOKE_CHILD_CAP_S = 150.0, 60.0
MIN_CHILD_S = 5.0
STEPS, WARMUP = 3, 1                # the median of 3 timed steps after one warm-up


def _settings(fw: str, smoke: bool, cuda: bool) -> list[dict]:
    import torch
    return bench_gpu.settings_of(fw, bench_gpu.SMOKE if smoke else bench_gpu.LLAMA_1B,
                                 torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32)


def three_way(check, until: float) -> dict:
    """megalysses, transformers + Liger, transformers at each length, each in a process of its own: first each
    at its fastest settings that fit (speed), then each with activation checkpointing (memory)."""
    lengths = SMOKE_LENGTHS if check.smoke else LENGTHS
    missing = {fw: bench_gpu.available(fw) for fw in FRAMEWORKS}
    result: dict[str, Any] = {"rows": [], "not_available": {fw: why for fw, why in missing.items() if why},
                              "lengths": list(lengths)}
    cap = SMOKE_CHILD_CAP_S if check.smoke else CHILD_CAP_S
    for purpose in ("speed", "memory"):
        for seq in lengths:
            for fw in FRAMEWORKS:
                if missing[fw]:
                    continue
                if purpose == "memory":
                    same = [r for r in result["rows"] if r["framework"] == fw and r["seq_len"] == seq
                            and r.get("options") == CHECKPOINTING and r.get("fits")]
                    if same:                    # its fastest settings were checkpointing: one run shows both
                        same[0]["for"] = "speed, memory"
                        continue
                candidates = _settings(fw, check.smoke, check.has_gpu) if purpose == "speed" else [CHECKPOINTING]
                for opts in candidates:
                    left = until - time.monotonic()
                    if left < MIN_CHILD_S:
                        row = {"framework": fw, "seq_len": seq, "options": opts, "fits": None,
                               "error": "not run: the stage's time bound ended"}
                        break
                    row = bench_gpu.run_child(fw, seq, opts, check.smoke, STEPS, WARMUP, min(cap, left), check.note)
                    if row.get("fits") is not False or purpose == "memory":
                        break                   # out of memory at speed: the next, lighter settings
                row["for"] = purpose
                result["rows"].append(row)
                check.partial({**result, "status": "running"})
    result["comparison"] = compare(result["rows"], lengths)
    from benchmarks import gpu_check_memory     # below this module: it imports this one
    gpu_check_memory.judge_three_way(check, result["rows"], until)
    broken = [r for r in result["rows"] if r["framework"] == "megalysses" and r.get("fits") is None
              and r.get("error") != "timed out" and not str(r.get("error", "")).startswith("not run")]
    if broken:
        why = f"megalysses failed at {broken[0]['seq_len']}: {broken[0]['error']}"
        return {**result, "status": "failed", "why": why}
    failed = [f"megalysses at {r['seq_len']:,d} ({r['for']}): {v}" for r in result["rows"]
              for v in r.get("verdicts", [])]
    if failed:
        return {**result, "status": "failed", "why": "; ".join(failed)[:600]}
    return {**result, "status": "ran"}


def best_row(rows: list[dict], fw: str, seq: int, purpose: str) -> Optional[dict]:
    for r in rows:
        if r["framework"] == fw and r["seq_len"] == seq and purpose in r.get("for", "") and r.get("fits"):
            return r
    return None


def compare(rows: list[dict], lengths) -> list[dict]:
    """Per length: megalysses' tokens/s over each peer's (speed rows) and its peak over each peer's (memory
    rows, checkpointing on all sides); None where a side has no number."""
    out = []
    for seq in lengths:
        row = {"seq_len": seq}
        ours_speed, ours_mem = best_row(rows, "megalysses", seq, "speed"), best_row(rows, "megalysses", seq, "memory")
        for peer in ("liger", "transformers"):
            speed, mem = best_row(rows, peer, seq, "speed"), best_row(rows, peer, seq, "memory")
            row[f"speed_vs_{peer}"] = ours_speed["tokens_per_s"] / speed["tokens_per_s"] if ours_speed and speed \
                else None
            peaks = ours_mem and mem and ours_mem.get("peak_gib") and mem.get("peak_gib")
            row[f"peak_vs_{peer}"] = ours_mem["peak_gib"] / mem["peak_gib"] if peaks else None
        row["mfu"] = ours_speed.get("mfu") if ours_speed else None
        out.append(row)
    return out


def num(v, spec: str, scale: float = 1.0, unit: str = "") -> str:
    return "–" if v is None else format(v * scale, spec) + unit


def render_three_way(result: dict) -> list[str]:
    if "rows" not in result:
        return []
    lines = ["| seq | framework | for | settings | tok/s | MFU | peak GiB |", "|---:|---|---|---|---:|---:|---:|"]
    for r in result["rows"]:
        opts = ", ".join(k for k, v in r.get("options", {}).items() if v) or "-"
        what = (f"{opts} ({r.get('settings', '')})" if r.get("fits") else
                f"{opts}: out of memory" if r.get("fits") is False else f"{opts}: {r.get('error')}")
        lines.append(f"| {r['seq_len']} | {r['framework']} | {r.get('for', '')} | {what} | "
                     f"{num(r.get('tokens_per_s'), ',.0f')} | {num(r.get('mfu'), '.1f', 100, '%')} | "
                     f"{num(r.get('peak_gib'), '.2f')} |")
    for fw, why in result.get("not_available", {}).items():
        lines.append(f"| – | {fw} | – | not available: {why} | – | – | – |")
    from benchmarks import gpu_check_memory
    lines += gpu_check_memory.render_budget([r for r in result["rows"] if r["framework"] == "megalysses"])
    lines += ["", ("Targets: tokens/s at least 1.0x transformers + Liger (stretch 1.3x), peak no higher than Liger's "
              "with checkpointing on both sides, 45% MFU at 32K (stretch)."), "",
              ("| seq | tok/s vs Liger | tok/s vs transformers | peak vs Liger (ckpt) | peak vs transformers (ckpt) "
              "| MFU |"), "|---:|---:|---:|---:|---:|---:|"]
    for c in result.get("comparison", []):
        ratios = " | ".join(num(c[k], ".2f", unit="x") for k in ("speed_vs_liger", "speed_vs_transformers",
                                                                   "peak_vs_liger", "peak_vs_transformers"))
        lines.append(f"| {c['seq_len']} | {ratios} | {num(c['mfu'], '.1f', 100, '%')} |")
    return lines
