"""One GPU window, one command: the GPU tier's fast subset, megalysses against transformers and transformers +
Liger, the memory model against a 1M-token probe and full steps, and a profile, all within a time budget.

    make gpu-check                                                   # the next line, with the GPU machine's python
    python benchmarks/gpu_check.py --budget 420 --out-dir runs/gpu_check
    python benchmarks/gpu_check.py --smoke --out-dir /tmp/gpu_check  # every stage at a tiny shape on CPU (the suite)
    python benchmarks/gpu_check.py --stages full_steps profile --budget 200 --out-dir runs/gpu_check   # some again

The stages, in this order, each within a time bound (its own cap and what is left of --budget, cold Triton and
Inductor compiles included); one that fails or runs out of time is recorded so and the next one runs:
  1. env         the GPU and its memory, the driver, torch, CUDA, cuDNN and Triton versions, which of liger-kernel,
                 flash-attn and apex import, and what `auto` resolves to at the 1B shape (always runs)
  2. tests       the GPU tier's fast subset (gpu_check_stages.SUBSET), test by test
  3. three_way   megalysses, transformers + Liger and transformers at 16K and 32K (bench_gpu.py's workers, a
                 process each): each at its fastest settings (speed), then all three with activation
                 checkpointing (memory); a trainer that fails is a row and the others go on
  4. probe       1M tokens through the first 2 of the 16 layers with the planner's options: the measured peak
                 beside the memory model's prediction, and its prediction for the full step
  5. full_steps  megalysses alone at 128K, then 256K, while the time left holds a step
  6. profile     one 16K step: the kernels by time, grouped as GEMM, attention, copies and casts, elementwise
                 (and communication, other)
Every measured length of stages 3 to 5 also records max_memory_allocated, max_memory_reserved and the device's
used memory beside the memory model, the traced peak and roofline (a trace child of a few CPU seconds, after the
step, within the stage's bound) and the plan's budget, and fails its stage when the model or the trace is over
5% off or a run the plan says fits comes within 1 GiB of the device's total (gpu_check_memory.py). A GPU larger
than an H100 is capped at the H100's memory in every child, so fits and out of memory test the H100 budget.
The risky parts run as child processes, killed with what they started at their bound: a hang or a CUDA crash
ends that child, never this harness.

Results, rewritten after every stage (and every row of the long ones), so a run cut short keeps what it measured:
  gpu_<gpu>.md    this run's tables on top of the earlier runs, read from the --out-dir's own file when an earlier
                  run wrote there, else from benchmarks/results/gpu_<gpu>.md: copied back, it records the history
  gpu_<gpu>.json  the runs as data, newest first, gathered the same way
  gpu_<gpu>.log   the output of pytest and of each child that failed (diagnosis, not a result)
--record writes them into benchmarks/results/ itself; with neither option the tables are only printed.

liger-kernel is optional. When it does not import and .whl/ holds a liger_kernel-*.whl (README, "On a GPU"), the
wheel is unpacked into a temporary folder on the path of this run's processes; nothing is installed.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import json
import os
import signal
import sys
import tempfile
import time
import traceback
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import gpu_check_memory as memory  # noqa: E402
from benchmarks import gpu_check_profile as profile  # noqa: E402
from benchmarks import gpu_check_stages as stages  # noqa: E402
from benchmarks.bench_gpu import gpu_tag  # noqa: E402
from benchmarks.harness import RESULTS, add_output_args, output_dir, write_text  # noqa: E402

BUDGET_S, SMOKE_BUDGET_S = 420.0, 180.0
MIN_STAGE_S = 3.0                   # a stage is not started with less than this left
WHEELS = ROOT / ".whl"
MARKER = "<!-- gpu_check.py: runs below, newest first -->"
LOG_LINES = 200                     # of a failed child's output, kept in the log


@dataclass(frozen=True)
class Stage:
    name: str
    title: str
    cap_s: Optional[float]          # at most this long on a GPU (None: what is left)
    smoke_cap_s: Optional[float]
    run: Callable                   # (check, until) -> result dict with "status"
    render: Callable                # result -> markdown lines


STAGES = (
    Stage("env", "Environment", 45, 30, stages.environment, stages.render_environment),
    Stage("tests", "The GPU tier's fast subset", 90, 30, stages.tests, stages.render_tests),
    Stage("three_way", "megalysses vs transformers + Liger vs transformers, Llama-3.2-1B shape", 170, 90,
          stages.three_way, stages.render_three_way),
    Stage("probe", "1M-token probe: the first 2 of 16 layers against the memory model", None, 30, memory.probe,
          memory.render_probe),
    Stage("full_steps", "Full steps, megalysses alone", None, None, memory.full_steps, memory.render_full_steps),
    Stage("profile", "Profile of one 16K step", 60, 30, profile.profile, profile.render_profile),
)


@dataclass
class Check:
    """One run: its options, its clock, what each stage returned, and where it writes."""

    smoke: bool
    budget_s: float
    out: Optional[Path]
    work: Path
    command: str
    liger_source: Optional[str] = None
    start: float = field(default_factory=time.monotonic)
    date: str = field(default_factory=lambda: f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    results: dict = field(default_factory=dict)
    current: str = ""
    log: list = field(default_factory=list)
    earlier: dict = field(default_factory=dict)      # file stem -> (markdown, runs, log) before this run
    stages: tuple = STAGES

    @property
    def env(self) -> Optional[dict]:
        return self.results.get("env", {}).get("info")

    @property
    def has_gpu(self) -> bool:
        if self.env is not None:
            return bool(self.env.get("gpu"))
        import torch
        return torch.cuda.is_available()

    def resolved(self) -> Optional[dict]:
        """What stage 1 saw auto resolve to at the 1B shape without documents (what the stages train on)."""
        auto = (self.env or {}).get("auto", {}).get("no documents")
        return auto if auto and "error" not in auto else None

    @property
    def stem(self) -> str:
        if self.smoke:
            return "gpu_smoke"
        return "gpu_" + (gpu_tag(self.env["gpu"]) if self.env and self.env.get("gpu") else "unknown")

    def latest(self, name: str) -> dict:
        """Stage `name`'s result in this run, else in the newest earlier run that has it (when a run with --stages
        repeats the later stages, the profile takes the fastest settings the three-way found before)."""
        if name in self.results or self.out is None:
            return self.results.get(name, {})
        return next((run["stages"][name] for run in earlier(self)[1] if name in run.get("stages", {})), {})

    def deadline(self) -> float:
        return self.start + self.budget_s

    def note(self, what: str, output: str) -> None:
        lines = output.strip().splitlines()
        self.log.append(f"== {self.current}: {what} ({len(lines)} lines, the last {min(len(lines), LOG_LINES)})\n"
                        + "\n".join(lines[-LOG_LINES:]))

    def partial(self, result: dict) -> None:
        """A stage's rows so far, written now: a run stopped from outside keeps them."""
        self.results[self.current] = result
        self.save()

    def save(self) -> None:
        if self.out is not None:
            write_results(self)


def run_stages(check: Check, names: Optional[set] = None) -> None:
    """Each of check.stages (those in `names`; all by default) in turn, within min(its cap, the budget left); its
    failure or its timing out is its result, and the next one runs."""
    for number, stage in enumerate(check.stages, 1):
        if names is not None and stage.name not in names:
            continue
        check.current = stage.name
        left = check.deadline() - time.monotonic()
        cap = stage.smoke_cap_s if check.smoke else stage.cap_s
        bound = min(cap if cap is not None else left, left)
        if left < MIN_STAGE_S:
            result = {"status": "not run", "why": f"the budget ended ({max(left, 0):.0f} s left)"}
            bound = max(bound, 0)
        else:
            began = time.monotonic()
            try:
                result = stage.run(check, began + bound)
            except Exception as e:  # noqa: BLE001 - a stage's failure is its result; the next stage runs
                check.note("the stage raised", traceback.format_exc())
                result = {"status": "failed", "why": f"{type(e).__name__}: {str(e)[:300]}"}
            except BaseException as e:      # Ctrl-C, SIGTERM: the rows so far are kept, marked as stopped
                so_far = check.results.get(stage.name, {})
                check.results[stage.name] = {**so_far, "status": "stopped", "why": f"{type(e).__name__}: {e}",
                                             "seconds": round(time.monotonic() - began, 1), "bound_s": round(bound, 1)}
                check.save()
                raise
            result["seconds"] = round(time.monotonic() - began, 1)
        result["bound_s"] = round(bound, 1)
        check.results[stage.name] = result
        check.save()
        print(f"\n### {number}. {stage.title}: {result['status']}" + (f" ({result['why']})" if result.get("why")
                                                                         else ""), flush=True)
        print("\n".join(rendered(stage, result)), flush=True)


def rendered(stage: Stage, result: dict) -> list[str]:
    """A stage's tables; a result its renderer cannot read is said so (the JSON has it), never a crash."""
    try:
        return stage.render(result)
    except Exception as e:  # noqa: BLE001 - the results must be written whatever a stage returned
        return [f"(this result could not be rendered, {type(e).__name__}: {e}; the JSON has it)"]


# ----------------------------------------------------------------------------------------------- results

def earlier(check: Check) -> tuple[str, list, str]:
    """What came before this run, read once: the markdown below the marker, the JSON runs, the log. From the
    --out-dir's own files when an earlier run wrote there, else from benchmarks/results/ (not the log)."""
    if check.stem not in check.earlier:
        md, runs, log = "", [], ""
        for folder in dict.fromkeys([check.out, RESULTS]):
            md_path, json_path, log_path = (folder / f"{check.stem}.{ext}" for ext in ("md", "json", "log"))
            if not (md_path.exists() or json_path.exists()):
                continue
            if md_path.exists():
                text = md_path.read_text()
                md = text.split(MARKER, 1)[1].lstrip("\n") if MARKER in text else text
            try:
                runs = json.loads(json_path.read_text()).get("runs", [])
            except (OSError, ValueError, AttributeError):
                runs = []
            if folder == check.out and log_path.exists():
                log = log_path.read_text()
            break
        check.earlier[check.stem] = (md, runs, log)
    return check.earlier[check.stem]


def run_record(check: Check) -> dict:
    env = check.env or {}
    return {"date": check.date, "commit": _commit(), "gpu": env.get("gpu"), "smoke": check.smoke,
            "command": check.command, "budget_s": check.budget_s,
            "seconds": round(time.monotonic() - check.start, 1), "stages": check.results}


def section(check: Check) -> list[str]:
    """This run as markdown: a heading with the date, commit and versions, the stages' statuses, a table each."""
    env = check.env or {}
    versions = ", ".join(f"{k} {env[v]}" for k, v in (("torch", "torch"), ("CUDA", "cuda"), ("cuDNN", "cudnn"),
                                                        ("Triton", "triton"), ("driver", "driver"),
                                                        ("Python", "python")) if env.get(v))
    lines = [f"## {check.date} · commit {_commit() or 'unknown'} · {env.get('gpu') or 'no GPU'}"
             + (" · smoke (tiny shape)" if check.smoke else ""), "",
             (f"{versions or 'versions unknown (stage 1 did not finish)'}. `{check.command}`: "
             f"{time.monotonic() - check.start:.0f} s of a {check.budget_s:.0f} s budget."), "",
             "| stage | status | seconds (bound) | note |", "|---|---|---:|---|"]
    for number, stage in enumerate(check.stages, 1):
        r = check.results.get(stage.name)
        if r is not None:
            lines.append(f"| {number}. {stage.name} | {r['status']} | {r.get('seconds', 0):.0f} "
                         f"({r.get('bound_s', 0):.0f}) | {r.get('why', '')} |")
    for number, stage in enumerate(check.stages, 1):
        body = rendered(stage, check.results[stage.name]) if stage.name in check.results else []
        if body:
            lines += ["", f"### {number}. {stage.title}", ""] + body
    return lines


def write_results(check: Check) -> None:
    md, runs, log = earlier(check)
    gpu = (check.env or {}).get("gpu") or ("CPU (--smoke)" if check.smoke else "unknown")
    head = [f"# GPU check: {gpu}", "",
            ("`make gpu-check` (benchmarks/gpu_check.py): the GPU tier's fast subset, megalysses against transformers "
            "and transformers + Liger, the memory model against measured peaks, and a profile, in one time budget. "
            f"Newest run first; each run's numbers are in {check.stem}.json."), "", MARKER, ""]
    write_text(check.out, f"{check.stem}.md", "\n".join(head + section(check)) + "\n" + ("\n" + md if md else ""))
    write_text(check.out, f"{check.stem}.json",
               json.dumps({"runs": [run_record(check)] + runs}, indent=1, default=str) + "\n")
    header = f"######## {check.date}: {check.command}\n"
    write_text(check.out, f"{check.stem}.log", log + header + "\n\n".join(check.log) + "\n")


def _commit() -> Optional[str]:
    from benchmarks.harness import source_commit
    return source_commit()


# ----------------------------------------------------------------------------------------------- liger wheel

def liger_from_wheel(wheels: Path, work: Path) -> Optional[str]:
    """When liger_kernel does not import and `wheels` holds a liger_kernel-*.whl (the newest, when several), unpack
    it into `work` and put that first on this process's path and its children's PYTHONPATH: '.whl/<file>'. A
    wheel is a zip of the installed files; nothing is installed into the environment."""
    if importlib.util.find_spec("liger_kernel") is not None:
        return None
    found = sorted(wheels.glob("liger_kernel-*.whl"), key=lambda p: p.stat().st_mtime) if wheels.is_dir() else []
    if not found:
        return None
    target = work / "wheels"
    with zipfile.ZipFile(found[-1]) as z:
        z.extractall(target)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(target), os.environ.get("PYTHONPATH", "")) if p)
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    return f"{wheels.name}/{found[-1].name}"


def _stop(signum: int, frame) -> None:
    raise SystemExit(f"stopped by {signal.Signals(signum).name}")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds for everything, cold compiles included (default {BUDGET_S:.0f}; "
                        f"{SMOKE_BUDGET_S:.0f} with --smoke)")
    p.add_argument("--smoke", action="store_true", help="every stage at a tiny shape (on CPU without a GPU)")
    p.add_argument("--stages", nargs="+", choices=[s.name for s in STAGES[1:]], default=None,
                   help="run only these (in the usual order; env always runs)")
    add_output_args(p)
    p.add_argument("--worker", choices=("env", "profile", "trace"), help=argparse.SUPPRESS)
    p.add_argument("--config", default=None, help=argparse.SUPPRESS)
    p.add_argument("--seq", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--opts", default="{}", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker == "env":
        print(stages.RESULT + json.dumps(stages.environment_worker(args.smoke)), flush=True)
        return 0
    if args.worker == "trace":
        print(stages.RESULT + json.dumps(memory.trace_worker(args.config, json.loads(args.opts))), flush=True)
        return 0
    if args.worker == "profile":
        result = profile.profile_worker(args.seq, json.loads(args.opts), args.smoke)
        print(stages.RESULT + json.dumps(result), flush=True)
        return 0
    out = output_dir(p, args, args.smoke)
    budget = args.budget if args.budget is not None else (SMOKE_BUDGET_S if args.smoke else BUDGET_S)
    if budget <= 0:
        p.error(f"--budget {budget:g}: give the seconds the check may take (default {BUDGET_S:.0f})")
    command = "python benchmarks/gpu_check.py " + " ".join(argv if argv is not None else sys.argv[1:])
    for sig in (signal.SIGTERM, signal.SIGHUP):     # a timeout's SIGTERM: children killed, rows so far kept
        signal.signal(sig, _stop)
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        check = Check(smoke=args.smoke, budget_s=budget, out=out, work=Path(tmp), command=command.strip())
        check.liger_source = liger_from_wheel(WHEELS, Path(tmp))
        run_stages(check, None if args.stages is None else {"env", *args.stages})
    if out is not None:
        print(f"\nwrote {out / check.stem}.md, .json and .log", flush=True)
    failed = [name for name, r in check.results.items() if r["status"] == "failed"]
    if failed:
        print(f"failed: {', '.join(failed)} (the tables say why; the log has the output)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
