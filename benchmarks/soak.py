"""Fault soak: kill -9 a training job at random steps and in the middle of checkpoint saves, resume it
every time, and compare every step's loss and gradient norm with an uninterrupted run.

    python benchmarks/soak.py --kills 20                        # torchrun, 2 processes (tp=2)
    python benchmarks/soak.py --kills 3 --nproc 1 --steps 10 --out-dir runs/soak
    python benchmarks/soak.py --kills 20 --record          # into benchmarks/results/soak.json

Each kill takes down the whole job at once, the launcher and every worker (as a node crash would).
Half of the kills wait until the checkpoint of a random step is complete and strike within the next
50 ms (the next step, or the next save: a checkpoint is saved every step); the other half wait until
a checkpoint is being written (its `step_N.tmp` directory exists) and strike a few milliseconds
later. After each kill the checkpoint that `latest` names must verify (every file against its
manifest checksum), and the next launch resumes from it. The killed job's steps appear in
metrics.jsonl again after the resume; the start marks there say which records supersede which.
Prints one row per kill, then the comparison; with --out-dir (or --record: benchmarks/results/) writes the
result as soak.json. Exits 1 unless every checkpoint verified and every loss is identical.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import add_output_args, output_dir, write_text  # noqa: E402
from megalysses.checkpoint.manifest import checkpoints_in, read_latest, step_of, verify_checkpoint  # noqa: E402

MODEL = ["data.mock=true", "data.seq_len=64", "model.vocab_size=256", "model.hidden_size=64", "model.num_layers=2",
         "model.num_heads=4", "training.global_batch_size=4", "training.micro_batch_size=1", "logging.log_interval=1",
         "optimizer.warmup_steps=2", "optimizer.lr=1e-3", "checkpoint.save_interval=1", "checkpoint.keep_last=2",
         "parallel.timeout_seconds=60"]


def launch(run: Path, nproc: int, steps: int, tp: int) -> subprocess.Popen:
    sets = MODEL + [f"training.train_steps={steps}", f"parallel.tp={tp}", f"logging.run_dir={run}"]
    args = [a for o in sets for a in ("--set", o)]
    if nproc == 1:
        cmd = [sys.executable, str(ROOT / "pretrain.py")] + args
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(ROOT / "pretrain.py")] + args
    return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def job_processes(p: subprocess.Popen) -> list[int]:
    """The launcher and its children (torchrun's workers run in sessions of their own)."""
    try:
        children = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()
    except OSError:
        children = []
    return [p.pid] + [int(c) for c in children]


def records(run: Path, skip: int = 0) -> list[dict]:
    """metrics.jsonl from line `skip` on."""
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(x) for x in lines[skip:] if x.strip()]


def last_step(recs: list[dict]) -> int:
    steps = [r["step"] for r in recs if "loss" in r]
    return steps[-1] if steps else 0


def final_losses(run: Path) -> dict[int, tuple[float, float]]:
    """{step: (loss, grad norm)}; records after a later start mark supersede earlier ones."""
    out = {}
    for rec in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()):
        if "loss" in rec:
            out[rec["step"]] = (rec["loss"], rec["grad_norm"])
    return out


def kill_job(p: subprocess.Popen) -> None:
    for pid in job_processes(p):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    p.wait()


def saving(ckpts: Path, at_least: int, since: float) -> str:
    """The checkpoint being written (its .tmp directory, made after `since`) if it is for step `at_least`
    or later."""
    for tmp in ckpts.glob("step_*.tmp"):
        step = step_of(tmp.with_name(tmp.name[:-len(".tmp")]))
        try:
            fresh = tmp.stat().st_mtime >= since
        except OSError:
            continue
        if fresh and step is not None and step >= at_least:
            return tmp.name
    return ""


def strike(p: subprocess.Popen, run: Path, mode: str, rng: random.Random, timeout: float) -> dict:
    """Launched just now: wait for the moment of `mode` in this launch, then kill the whole job."""
    ckpts = run / "checkpoints"
    since, skip = time.time(), len(records(run))
    latest, _ = read_latest(ckpts)
    base = step_of(latest) if latest else 0
    target = base + rng.randint(1, 3) + (mode == "save")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and p.poll() is None:
        done = read_latest(ckpts)[0] if mode == "step" else None
        if done is not None and step_of(done) >= target:
            time.sleep(rng.uniform(0, 0.05))        # the checkpoint of the target step is complete: strike
            break                                   # within the next step or the next save
        if mode == "save" and saving(ckpts, target, since):
            time.sleep(rng.uniform(0, 0.02))
            break
        time.sleep(0.002)
    if p.poll() is not None:
        return {"missed": True}
    being_written = saving(ckpts, 0, since)
    kill_job(p)
    mine = records(run, skip)
    start = [r["step"] for r in mine if r.get("event") == "start"]
    return {"missed": False, "started_at": start[0] if start else None, "logged_step": last_step(mine),
            "saving": being_written}


def soak(kills: int, nproc: int, tp: int, seed: int, work: Path, timeout: float, steps: int = 0) -> dict:
    steps = steps or 3 * kills + 10
    rng = random.Random(seed)
    reference, run = work / "reference", work / "soak"
    t0 = time.monotonic()
    p = launch(reference, nproc, steps, tp)
    if p.wait(timeout=timeout * steps) != 0:
        raise SystemExit(f"error: the uninterrupted run failed; see {reference}")
    rows = []
    while len(rows) < kills:
        p = launch(run, nproc, steps, tp)
        mode = "save" if len(rows) % 2 else "step"
        seen = strike(p, run, mode, rng, timeout)
        if seen["missed"]:
            raise SystemExit(f"error: the run ended before kill {len(rows) + 1}; raise the number of steps")
        latest, problem = read_latest(run / "checkpoints")
        if latest is None and not checkpoints_in(run / "checkpoints"):
            problem = None                     # killed before its first checkpoint: the next launch starts afresh
        problems = [problem] if problem else verify_checkpoint(latest) if latest else []
        rows.append({"kill": len(rows) + 1, "mode": mode, "started_at": seen["started_at"],
                     "logged_step": seen["logged_step"],
                     "during_save": seen["saving"], "latest": latest.name if latest else "-",
                     "verifies": not problems, "problems": problems,
                     "leftover_tmp": [t.name for t in (run / "checkpoints").glob("*.tmp")]})
    p = launch(run, nproc, steps, tp)
    if p.wait(timeout=timeout * steps) != 0:
        raise SystemExit(f"error: the last resume failed; see {run}")
    ref, got = final_losses(reference), final_losses(run)
    same_loss = sum(got.get(s, (None,))[0] == v[0] for s, v in ref.items())
    same_norm = sum(got.get(s, (None, None))[1] == v[1] for s, v in ref.items())
    delta = max((abs(got[s][0] - v[0]) for s, v in ref.items() if s in got), default=float("nan"))
    marks = [r for r in records(run) if r.get("event") == "start"]
    starts = [r["started_at"] for r in rows[1:]] + [marks[-1]["step"]]
    resumed_ok = all(at is not None and (row["latest"] == "-" and at == 0 or row["latest"] == f"step_{at:07d}")
                     for row, at in zip(rows, starts))
    return {"kills": rows, "steps": steps, "nproc": nproc, "tp": tp, "seed": seed,
            "launches": len(marks),
            "during_saves": sum(bool(r["during_save"]) for r in rows),
            "all_verify": all(r["verifies"] for r in rows), "resumed_from_latest": resumed_ok,
            "steps_compared": len(ref),
            "identical_losses": same_loss, "identical_grad_norms": same_norm, "max_abs_loss_delta": delta,
            "final_checkpoints": [p.name for p in checkpoints_in(run / "checkpoints")],
            "seconds": time.monotonic() - t0,
            "machine": f"{os.cpu_count()} CPUs, Python {platform.python_version()}, {platform.machine()}"}


def table(result: dict) -> str:
    lines = [("| kill | strikes | launch resumed at step | last step it logged | checkpoint being written | "
              "`latest` after the kill | verifies |"), "|---:|---|---:|---:|---|---|---|"]
    for row in result["kills"]:
        lines.append(f"| {row['kill']} | {'in a save' if row['mode'] == 'save' else 'after a step'} | "
                     f"{row['started_at']} | {row['logged_step']} | {row['during_save'] or '-'} | {row['latest']} | "
                     f"{'yes' if row['verifies'] else 'NO: ' + '; '.join(row['problems'])} |")
    r = result
    lines += ["", (f"{len(r['kills'])} kills ({r['during_saves']} while a checkpoint was being written), "
                   f"{r['launches']} launches, {r['nproc']} process(es) at tp={r['tp']}, {r['steps']} steps, "
                   f"{r['seconds']:.0f} s ({r['machine']})"),
              (f"- `latest` verified after every kill: {'yes' if r['all_verify'] else 'NO'}; every launch resumed "
               f"from the `latest` of the kill before it: {'yes' if r['resumed_from_latest'] else 'NO'}"),
              (f"- losses identical to the uninterrupted run: {r['identical_losses']}/{r['steps_compared']} steps "
               f"(max |Δ| {r['max_abs_loss_delta']:.3g}); gradient norms identical: "
               f"{r['identical_grad_norms']}/{r['steps_compared']}")]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=20, help="how many times the job is killed (default 20)")
    p.add_argument("--nproc", type=int, default=2, help="processes (1: python pretrain.py, more: torchrun)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (default: --nproc)")
    p.add_argument("--steps", type=int, default=0, help="training steps (default: 3 per kill + 10)")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for one moment to strike")
    p.add_argument("--workdir", type=Path, default=None, help="where the runs go (default: a temporary dir)")
    add_output_args(p)
    args = p.parse_args(argv)
    folder = output_dir(p, args)
    if args.kills < 1 or args.nproc < 1 or (args.steps and args.steps < 3 * args.kills + 2):
        print("error: --kills and --nproc must be at least 1, --steps at least 3 per kill + 2", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        work = args.workdir or Path(tmp)
        result = soak(args.kills, args.nproc, args.tp or args.nproc, args.seed, work, args.timeout, args.steps)
    print(table(result))
    if folder is not None:
        out = write_text(folder, "soak.json", json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")
    ok = (result["all_verify"] and result["resumed_from_latest"]
          and result["identical_losses"] == result["steps_compared"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
