"""A run's start-up path on a described machine, without it: the dry run of `pretrain.py --dry-run --gpus N`.

    record = dry_run(cfg, Machine.described("H100", ranks_per_node=8), world=64)   # runtime.json's contents

Rank 0 of a world of `world` ranks runs train()'s start-up path up to step 1 in this one process: the
config checked at that world size, the plan resolved on the machine, the grid's process groups created
(on torch's fake process-group backend, whose collectives do nothing), rank 0's model and optimizer built
(on the meta device for a GPU machine: shapes and dtypes only) and checked against the plan, and
<run_dir>/runtime.json written. Nothing is read, trained or saved. What it shows: that the run the
planner plans (tools/plan.py) is the run that starts.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from megalysses.config import Config, ConfigError
from megalysses.config.checks import validate_config
from megalysses.grid import ParallelGrid
from megalysses.plan import Machine, resolve


def dry_run(cfg: Config, machine: Machine, world: int) -> dict:
    """Rank 0's start-up path of a run of `cfg` on `world` ranks of `machine`; returns its runtime.json."""
    from megalysses.training.loop import train

    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError:
        raise ConfigError(f"a dry run for a described machine needs torch's fake process-group backend, which "
                          f"torch {torch.__version__} lacks: run --dry-run under torchrun on the machine itself "
                          f"instead") from None
    if dist.is_initialized():
        raise RuntimeError("a dry run creates its own process group: call it outside one")
    validate_config(cfg, world_size=world)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        plan = resolve(cfg, machine, world)
        with warnings.catch_warnings():     # the fake backend takes no group timeouts, and says so per group
            warnings.filterwarnings("ignore", message="Set timeout is now only supported")
            grid = ParallelGrid.for_plan(plan, cfg.parallel.timeout_seconds)
            train(cfg, plan, grid, torch.device("meta" if machine.cuda else "cpu"), dry_run=True)
    finally:
        dist.destroy_process_group()
    return json.loads((Path(cfg.logging.run_dir) / "runtime.json").read_text())
