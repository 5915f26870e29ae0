"""Run a function on W CPU ranks (gloo, file:// store) and collect what each rank returns; plan a test's run on
this machine as a process that starts one does.

    def check(rank, world, x):          # module-level, so the ranks can import it
        ...
        return {"loss": loss.item()}

    results = run_distributed(check, world=4, tmp_dir=tmp_path, args=(x,))   # list, one per rank

    plan, grid = plan_and_grid(cfg, device)      # a test's run: its plan on this machine, and the grid

A rank that raises fails the call with that rank's traceback; a rank that hangs is ended by the
short collective timeout and, failing that, by the overall `timeout`.

Ranks start from a fork server that has imported torch (and what `preload` adds) once, so a
rank costs a fork instead of several seconds of imports; the fork server only imports (it never runs
an OpenMP region), so forking it is safe. Each rank then takes the caller's environment of the moment
of the call, as a spawned process would.
"""
from __future__ import annotations

import functools
import os
import pickle
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megalysses.config import Config, ConfigError
from megalysses.grid import ParallelGrid
from megalysses.plan import Machine, RunPlan, resolve


class DistributedTestError(AssertionError):
    """A rank failed: the message carries its traceback."""


# imported once by the fork server (torch.optim pulls in dynamo on first use); `preload` adds to it
_preload = ["torch", "torch.distributed", "torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.fsdp"]


def preload(*modules: str) -> None:
    """Have the fork server import `modules` too (before its first use), so that ranks start with them loaded."""
    _preload.extend(m for m in modules if m not in _preload)


def _worker(rank: int, fn: Callable, world: int, store: str, out_dir: str, args: tuple, pg_timeout: float,
            env: dict) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    out = Path(out_dir) / f"rank{rank}.pkl"
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=pg_timeout))
        try:
            result = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        payload = ("ok", result)
    except BaseException:  # noqa: BLE001 - report everything to the parent
        payload = ("error", traceback.format_exc())
    with open(out, "wb") as f:
        pickle.dump(payload, f)


def run_distributed(fn: Callable, world: int, tmp_dir: Optional[str | os.PathLike] = None, args: tuple = (),
                    timeout: float = 240.0, pg_timeout: float = 60.0) -> list[Any]:
    """Run `fn(rank, world, *args)` on `world` gloo ranks; return the per-rank results in rank order."""
    tmp = Path(tempfile.mkdtemp(prefix="mgl-", dir=tmp_dir))
    store = tmp / "store"
    mp.get_context("forkserver").set_forkserver_preload(_preload)   # takes effect when the server starts
    ctx = mp.start_processes(_worker, args=(fn, world, str(store), str(tmp), args, pg_timeout, dict(os.environ)),
                             nprocs=world, join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=0.2):
            if time.monotonic() > deadline:
                raise DistributedTestError(f"distributed run of {fn.__name__} on {world} ranks "
                                           f"timed out after {timeout}s")
    except mp.ProcessRaisedException as e:  # pragma: no cover - _worker catches everything
        raise DistributedTestError(str(e)) from None
    except mp.ProcessExitedException as e:
        raise DistributedTestError(f"a rank of {fn.__name__} died: {e}") from None
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    results, errors = [], []
    for rank in range(world):
        path = tmp / f"rank{rank}.pkl"
        if not path.exists():
            errors.append(f"rank {rank}: produced no result")
            continue
        with open(path, "rb") as f:
            status, value = pickle.load(f)
        if status == "error":
            errors.append(f"rank {rank} raised:\n{value}")
        results.append(value)
    if errors:
        # the first failing rank's traceback usually explains the rest (timeouts on the others)
        raise DistributedTestError(f"{fn.__name__} failed on {len(errors)}/{world} ranks\n" + "\n".join(errors[:2]))
    return results


@functools.lru_cache(maxsize=1)
def triton_interpreter_runs_our_kernels() -> bool:
    """Whether Triton's CPU interpreter (TRITON_INTERPRET=1, set before the call) can run a loop over
    rows bounded by tl.program_id, as our persistent kernels do. Triton 3.6 and older cannot with numpy
    2.4 (the program id is a one-element array numpy no longer turns into an int); compiled kernels on a
    GPU are unaffected. Asked once per process."""
    import triton
    import triton.language as tl

    @triton.jit
    def probe(x_ptr, n):
        for i in range(tl.program_id(0), n, tl.num_programs(0)):
            tl.store(x_ptr + i, 1.0)

    x = torch.zeros(4)
    try:
        probe[(2,)](x, 4)
    except Exception:  # noqa: BLE001 - the interpreter raises its own error types
        return False
    return bool((x == 1).all())


def resolve_run(cfg: Config, device: torch.device, grid: Optional[ParallelGrid] = None) -> RunPlan:
    """The plan of this run on this rank's machine (its device, packages and ranks per node) and the grid's
    world (without a grid, one model replica: tp * sp * pp ranks); ConfigError names what cannot run here.
    The grid must split sp as the plan does."""
    p = cfg.parallel
    run = resolve(cfg, Machine.current(device), grid.world if grid is not None else p.tp * p.sp * p.pp)
    d = run.degrees
    if grid is not None and (grid.ulysses_size, grid.ring_size) != (d.ulysses, d.ring):
        raise ConfigError(f"the process grid splits sp={grid.sp_size} as ulysses {grid.ulysses_size} x ring "
                          f"{grid.ring_size} but the config resolves to ulysses {d.ulysses} x ring {d.ring}: "
                          f"build it with ParallelGrid.for_plan(run)")
    return run


def plan_and_grid(cfg: Config, device: torch.device) -> tuple[RunPlan, ParallelGrid]:
    """The plan of a run of `cfg` on this machine over the process group's world (without one, a world of one), and
    the grid it lays out: the two as a run builds them (tools/pretrain.py)."""
    if not dist.is_initialized():
        return resolve(cfg, Machine.current(device), 1), ParallelGrid.single()
    run = resolve(cfg, Machine.current(device), dist.get_world_size())
    return run, ParallelGrid.for_plan(run, cfg.parallel.timeout_seconds)
