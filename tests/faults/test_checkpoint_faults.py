"""Checkpoint integrity: every flipped byte is caught before loading, a damaged checkpoint is named in
one message, resume falls back to the newest checkpoint that verifies, pruning never deletes `latest`,
an abandoned timeline is moved aside, and metrics.jsonl tells the runs apart."""
import contextlib
import io
import json
import random
import shutil
from pathlib import Path

import pytest

from megalysses.checkpoint.manifest import MANIFEST, read_latest, verify_checkpoint
from megalysses.testing import run_distributed
from tests.faults.launch import TINY


def _pretrain(run: Path, *overrides: str) -> tuple[int, str]:
    """pretrain's main in this process (a world of one); (exit status, everything it printed)."""
    from megalysses.tools.pretrain import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        status = main([a for o in TINY + [f"logging.run_dir={run}", *overrides] for a in ("--set", o)])
    return status, out.getvalue()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """One small real checkpoint (two steps of the tiny model, one process)."""
    run = tmp_path_factory.mktemp("saved") / "run"
    status, out = _pretrain(run, "training.train_steps=2")
    assert status == 0, out
    return run


def test_every_flipped_byte_is_caught(saved, tmp_path):
    ckpt = tmp_path / "step"
    shutil.copytree(read_latest(saved / "checkpoints")[0], ckpt)
    assert verify_checkpoint(ckpt) == []
    files = sorted(p for p in ckpt.iterdir())
    rng = random.Random(0)
    trials, caught = 300, 0
    for _ in range(trials):                       # a file, then a byte of it, then a bit pattern
        path = rng.choice(files)
        data = bytearray(path.read_bytes())
        i, flip = rng.randrange(len(data)), rng.randrange(1, 256)
        data[i] ^= flip
        path.write_bytes(bytes(data))
        problems = verify_checkpoint(ckpt)
        caught += bool(problems)
        assert problems, f"a flipped byte at {i} of {path.name} was not caught"
        if path.name != MANIFEST:
            assert path.name in problems[0], problems
        data[i] ^= flip
        path.write_bytes(bytes(data))
    assert caught == trials
    assert verify_checkpoint(ckpt) == []


@pytest.mark.parametrize("damage,needle", [
    (lambda d: (d / "__0_0.distcp").write_bytes((d / "__0_0.distcp").read_bytes()[:1000]), "truncated"),
    (lambda d: (d / "__0_0.distcp").write_bytes(b""), "empty"),
    (lambda d: (d / "__0_0.distcp").unlink(), "missing"),
    (lambda d: (d / ".metadata").unlink(), ".metadata is missing"),
    (lambda d: (d / "rng_rank0.pt").write_bytes(b"garbage"), "rng_rank0.pt"),
    (lambda d: (d / "meta.json").write_text("{"), "meta.json"),
    (lambda d: (d / MANIFEST).unlink(), "manifest.json is missing"),
])
def test_damage_is_named(saved, tmp_path, damage, needle):
    ckpt = tmp_path / "step"
    shutil.copytree(read_latest(saved / "checkpoints")[0], ckpt)
    damage(ckpt)
    problems = verify_checkpoint(ckpt)
    assert problems and needle in problems[0], problems


def test_a_stuck_rank_while_loading_is_not_a_damaged_checkpoint(saved, monkeypatch):
    """A collective that times out inside dcp.load (another rank stuck) is raised as it is, for pretrain
    to hand to the watchdog (which names the rank); any other failure in there names the checkpoint."""
    from megalysses.checkpoint import dcp_io as checkpoint
    from megalysses.checkpoint.manifest import CheckpointError

    latest = read_latest(saved / "checkpoints")[0]
    timeout = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                           "6000ms for recv operation to complete")

    def load(error):
        def fail(*args, **kwargs):
            raise error
        return fail
    monkeypatch.setattr(checkpoint.dcp, "load", load(timeout))
    with pytest.raises(RuntimeError) as e:
        checkpoint._load({}, latest)
    assert e.value is timeout
    monkeypatch.setattr(checkpoint.dcp, "load", load(RuntimeError("unpickling stack underflow")))
    with pytest.raises(CheckpointError, match=f"checkpoint {latest} cannot be loaded .*underflow"):
        checkpoint._load({}, latest)


def test_finished_run_says_so_and_warnings_are_printed_once(saved):
    status, out = _pretrain(saved, "training.train_steps=2", "optimizer.lr=0", "optimizer.warmup_steps=5")
    assert status == 0, out
    done = [line for line in out.splitlines() if line.startswith("done:")]
    assert done == [done[0]] and "already finished" in done[0] and "step 2" in done[0] and "nan" not in done[0]
    warnings = [line for line in out.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 2 and "optimizer.lr=0" in warnings[0] and "warmup_steps=5" in warnings[1], out


def _runs(run: Path) -> list[dict]:
    """metrics.jsonl split at its start marks: one {step: loss} per run."""
    runs = []
    for rec in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()):
        if rec.get("event") == "start":
            runs.append({})
        elif "loss" in rec:
            runs[-1][rec["step"]] = rec["loss"]
    return runs


def _lifecycle(rank, world, root):
    """Several runs in one directory at tp=2; returns what each run saw (rank 0's output included)."""
    from megalysses.config.io import load_config
    from megalysses.grid import ParallelGrid
    from megalysses.degrees import Degrees
    from megalysses.checkpoint.dcp_io import CheckpointError
    from megalysses.training.loop import train
    from megalysses.testing import resolve_run
    import torch
    import torch.distributed as dist

    root = Path(root)
    grid = ParallelGrid(Degrees.of_world(world, tp=2), timeout_seconds=60)
    base = TINY + ["parallel.tp=2", "training.train_steps=4", "checkpoint.save_interval=1", "checkpoint.keep_last=3"]
    seen = {}

    def go(name, run, *extra):
        cfg = load_config(overrides=base + [f"logging.run_dir={root / run}", *extra])
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                train(cfg, resolve_run(cfg, torch.device("cpu"), grid), grid, torch.device("cpu"))
            seen[name] = ("ok", out.getvalue())
        except CheckpointError as e:
            seen[name] = ("error", str(e))
        dist.barrier()

    ckpts = root / "run" / "checkpoints"
    go("straight", "straight")
    go("first", "run", "training.exit_at_step=3")                 # checkpoints 2, 3; latest = 3
    if rank == 0:                                                 # one flipped byte in rank 1's shard of step 3
        shard = ckpts / "step_0000003" / "__1_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x10
        shard.write_bytes(bytes(data))
    dist.barrier()
    go("strict", "run", "checkpoint.fallback=false")
    go("fallback", "run")                                         # resumes from step 2, trains 3 and 4
    go("older", "run", "training.train_steps=5", "training.exit_at_step=3",
       f"checkpoint.load={ckpts / 'step_0000002'}")               # a new timeline from step 2
    seen["dirs"] = sorted(p.name for p in ckpts.iterdir())
    aside = ckpts / "abandoned"
    seen["abandoned"] = sorted(p.name for p in aside.iterdir()) if aside.exists() else []
    if rank == 0:
        (ckpts / "latest").unlink()
    dist.barrier()
    go("no_latest_strict", "run", "checkpoint.fallback=false", "training.train_steps=5")
    go("no_latest", "run", "training.train_steps=5")
    return seen


def test_fallback_pruning_timelines_and_metrics(tmp_path):
    seen = run_distributed(_lifecycle, 2, tmp_path, args=(str(tmp_path),), timeout=400)
    r0, r1 = seen
    for run in ("strict", "no_latest_strict"):
        assert r0[run] == r1[run], "ranks disagree"         # every rank raises the same error
    kind, message = r0["strict"]
    assert kind == "error" and "step_0000003" in message and "__1_0.distcp" in message and "checksum" in message
    kind, out = r0["fallback"]
    assert kind == "ok" and "resuming from" in out and "step_0000002" in out, out
    # metrics.jsonl: the start marks split it into runs; the run that fell back continued exactly
    straight, runs = _runs(tmp_path / "straight"), _runs(tmp_path / "run")
    assert [sorted(r) for r in runs] == [[1, 2, 3], [3, 4], [3], [4, 5]]
    assert runs[0] == {s: straight[0][s] for s in (1, 2, 3)} and runs[1] == {s: straight[0][s] for s in (3, 4)}
    # a resume from an older checkpoint: latest (step 3) kept, the later step 4 moved aside, not deleted
    assert r0["dirs"] == ["abandoned", "latest", "step_0000002", "step_0000003"], r0["dirs"]
    assert r0["abandoned"] == ["step_0000004"]
    # no `latest`: an error without fallback, the newest checkpoint that verifies with it
    kind, message = r0["no_latest_strict"]
    assert kind == "error" and "latest is missing" in message and "checkpoint.fallback=true" in message
    kind, out = r0["no_latest"]
    assert kind == "ok" and "latest is missing" in out and "step_0000003" in out, out
    marks = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if '"event"' in x]
    assert [(m["run"], m["step"]) for m in marks] == [(1, 0), (2, 2), (3, 2), (4, 3)]
    assert marks[1]["resumed_from"].endswith("step_0000002") and marks[0]["resumed_from"] is None


def test_a_failed_background_write_is_one_error_and_keeps_latest(tmp_path, monkeypatch):
    """A background write that fails (the disk full while rank 0 checksums its files) is one `error:` line naming
    the step, and `latest` stays at the checkpoint before it."""
    import megalysses.checkpoint.dcp_io as ckpt

    real = ckpt.checksums

    def full(directory, names):
        if directory.name == "step_0000004.tmp":
            raise OSError(28, "No space left on device")
        return real(directory, names)

    monkeypatch.setattr(ckpt, "checksums", full)
    run = tmp_path / "run"
    status, out = _pretrain(run, "training.train_steps=4", "checkpoint.save_interval=2", "checkpoint.async_save=true")
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert status != 0 and len(errors) == 1 and "Traceback" not in out, out
    assert "step 4" in errors[0] and "No space left on device" in errors[0], errors
    assert read_latest(run / "checkpoints")[0].name == "step_0000002"


def test_a_stop_signal_finishes_the_background_save(tmp_path, monkeypatch):
    """SIGTERM arrives while step 2's checkpoint is written in the background: the run stops after the step it is
    on, saves it, and exits 0 only once that checkpoint is complete (its write held back a second) and `latest`."""
    import os
    import signal
    import time

    import megalysses.checkpoint.dcp_io as ckpt

    real = ckpt.checksums

    def slow(directory, names):
        if directory.name == "step_0000002.tmp":
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            time.sleep(1.0)
        return real(directory, names)

    monkeypatch.setattr(ckpt, "checksums", slow)
    run = tmp_path / "run"
    status, out = _pretrain(run, "training.train_steps=50", "checkpoint.save_interval=2", "checkpoint.async_save=true")
    assert status == 0, out
    stopped = [line for line in out.splitlines() if line.startswith("stopped at step")]
    assert stopped and "(signal)" in stopped[0], out
    step = int(stopped[0].split()[3])
    latest = read_latest(run / "checkpoints")[0]
    assert 2 < step < 50 and latest.name == f"step_{step:07d}" and verify_checkpoint(latest) == []
    assert not list((run / "checkpoints").glob("*.tmp")), "a save was left incomplete"
