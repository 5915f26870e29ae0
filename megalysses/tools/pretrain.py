"""Pretrain a GPT with megalysses.

    torchrun --nproc-per-node 4 pretrain.py --config configs/quickstart.yaml [--set section.key=value ...]

On CPU the processes talk over gloo, on GPUs over NCCL (one process per GPU). Bad input (config,
layout, data, checkpoint) ends the run with one message on rank 0 and a non-zero exit.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch.distributed as dist

from megalysses.config import ConfigError, load_config, validate_config
from megalysses.distributed import destroy_distributed, init_distributed
from megalysses.grid import LayoutError, ParallelGrid
from megalysses.training.checkpoint import CheckpointError
from megalysses.training.loop import train
from megalysses.training.metrics import print0
from megalysses.training.step import NonFiniteLossError
from megalysses.data import DatasetError

USER_ERRORS = (ConfigError, LayoutError, CheckpointError, DatasetError, NonFiniteLossError, FileNotFoundError)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config (see configs/)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value; repeatable")
    args = parser.parse_args(argv)
    rank0 = os.environ.get("RANK", "0") == "0"     # before the process group exists
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        if rank0:
            print(f"config error: {e}", file=sys.stderr)
        return 2
    try:
        device = init_distributed(cfg.parallel.backend, cfg.parallel.timeout_seconds)
    except RuntimeError as e:
        if rank0:
            print(f"error: cannot start the process group: {e}", flush=True)
        return 1
    try:
        validate_config(cfg, world_size=dist.get_world_size())
        grid = ParallelGrid.for_config(cfg)
        summary = train(cfg, grid, device)
        print0(f"done: step {summary['step']}, loss {summary['loss']:.4f} ({summary['stopped_by']})")
        return 0
    except USER_ERRORS as e:
        print0(f"error: {e}")
        return 1
    finally:
        destroy_distributed()


def cli() -> int:
    return main()


if __name__ == "__main__":
    sys.exit(cli())
