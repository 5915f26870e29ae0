"""Pretrain a GPT with megalysses.

    torchrun --nproc-per-node 4 pretrain.py --config configs/quickstart.yaml [--set section.key=value ...]
    python pretrain.py --config configs/quickstart.yaml --print-config    # the resolved config, explained
    python pretrain.py --print-config                                     # every default, explained

Every key is listed in docs/CONFIG.md; tools/from_megatron.py turns a Megatron-LM command line into a config.

On CPU the processes talk over gloo, on GPUs over NCCL (one process per GPU). Bad input (config,
layout, data, checkpoint) ends the run with one message on rank 0 and a non-zero exit.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megalysses.accelerator import configure_allocator
from megalysses.checkpoint.dcp_io import CheckpointError
from megalysses.checkpoint.manifest import read_latest, step_of
from megalysses.config import Config, ConfigError
from megalysses.config.checks import config_warnings, validate_config
from megalysses.config.doc import annotated_yaml
from megalysses.config.io import load_config
from megalysses.data import DatasetError
from megalysses.distributed import (collective_failure, destroy_distributed, die_with_launcher, init_distributed,
                                    print0, write_error_file)
from megalysses.grid import LayoutError, ParallelGrid
from megalysses.plan import Machine, RunPlan, resolve
from megalysses.plan.machine import PLAIN_TORCH, local_device
from megalysses.training.dry_run import dry_run
from megalysses.training.loop import train
from megalysses.training.signals import StopSignals
from megalysses.training.step import NonFiniteLossError
from megalysses.training.watchdog import Watchdog

USER_ERRORS = (ConfigError, LayoutError, CheckpointError, DatasetError, NonFiniteLossError, FileNotFoundError)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config (see configs/)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value; repeatable")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config as YAML, each key's meaning as a comment, and exit (without "
                             "--config: the defaults)")
    dry = parser.add_argument_group("dry run: the start-up path up to step 1, runtime.json written, nothing trained")
    dry.add_argument("--dry-run", action="store_true",
                     help="stop before step 1; under torchrun on this machine, or with --gpus in this one process "
                          "for a described machine (as tools/plan.py plans for it)")
    dry.add_argument("--gpus", type=int, help="--dry-run for a described machine of this many GPUs in all")
    dry.add_argument("--gpu", default="H100", help="the described GPU (default H100)")
    dry.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    dry.add_argument("--gpu-memory-gib", type=float, default=None,
                     help="memory one GPU exposes (default: the described GPU's, 79.6 for an H100 80GB)")
    dry.add_argument("--host-memory-gib", type=float, default=None,
                     help="host memory per node, to judge what the config offloads to it as tools/plan.py does "
                          "(default: not judged; a run checks its node's at start-up)")
    dry.add_argument("--packages", default=",".join(PLAIN_TORCH),
                     help=f"the described machine's optional packages (default {','.join(PLAIN_TORCH)})")
    dry.add_argument("--trace-memory", action="store_true",
                     help="with --gpus: then trace one training step at the real shape on fake tensors (rank 0 of "
                          "the first and the last pipeline stage): the peak per GPU, its moment and the largest "
                          "tensors then, pinned and all host memory, beside the memory model's prediction; written "
                          "to <run_dir>/memory_trace.json")
    args = parser.parse_args(argv)
    interruption = Interruption()
    signals = StopSignals(on_stuck=interruption.leave)   # first: a preemption signal during start-up is kept
    try:
        return _run(args, signals, interruption)
    except KeyboardInterrupt:      # before the run started
        return interruption.said()
    finally:
        signals.restore()


class Interruption:
    """What a Ctrl-C says, from what the run has come to know: its config, then what it is doing (the watchdog)."""

    def __init__(self) -> None:
        self.cfg: Optional[Config] = None
        self.watchdog: Optional[Watchdog] = None

    def said(self) -> int:
        """One line from the first rank saying what is kept, and later Ctrl-Cs (a launcher passes its own on)
        ignored; Ctrl-C's exit status."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        if os.environ.get("RANK", "0") == "0":
            doing = self.watchdog.current if self.watchdog is not None else "starting up"
            print(f"interrupted (Ctrl-C) while {doing}: {_kept(self.cfg)}; to stop after the current step with a "
                  f"checkpoint, send SIGTERM or SIGUSR1 instead", flush=True)
        return 130

    def leave(self) -> None:
        """A Ctrl-C the main thread cannot take (it waits inside torch for a peer that has left): the same line,
        and the process ends at once."""
        os._exit(self.said())


def _kept(cfg: Optional[Config]) -> str:
    """What a restart of the interrupted run starts from, in words."""
    if cfg is None:
        return "nothing was trained"
    root = Path(cfg.checkpoint.dir or Path(cfg.logging.run_dir) / "checkpoints")
    latest, _ = read_latest(root)
    load = cfg.checkpoint.load
    if load is None:
        restart = "a restart starts afresh (checkpoint.load: null)"
    elif load != "auto":
        restart = f"a restart loads checkpoint.load={load}"
    elif latest is None:
        start = f"the weights of checkpoint.init_from={cfg.checkpoint.init_from}" if cfg.checkpoint.init_from else \
            "step 0"
        return f"no checkpoint was saved ({root} holds none), so a restart begins again from {start}"
    else:
        restart = "a restart resumes from it"
    if latest is None:
        return f"no checkpoint was saved in {root}; {restart}"
    return f"the last checkpoint saved is {latest} (step {step_of(latest)}), the steps after it are lost; {restart}"


def _run(args: argparse.Namespace, signals: StopSignals, interruption: Interruption) -> int:
    rank0 = os.environ.get("RANK", "0") == "0"     # before the process group exists
    try:
        cfg = interruption.cfg = load_config(args.config, args.overrides, validate=not args.print_config)
    except ConfigError as e:
        if rank0:
            print(f"config error: {e}", file=sys.stderr)
        write_error_file(f"config error: {e}")
        return 2
    if args.print_config:
        if rank0:
            _print_config(cfg)
        return 0
    if args.gpus is not None:
        return _described_dry_run(cfg, args)
    if args.gpu_memory_gib is not None or args.host_memory_gib is not None:
        print("error: --gpu-memory-gib and --host-memory-gib describe the machine of a --dry-run --gpus N: add "
              "--gpus (a run on this machine reads its own)", file=sys.stderr)
        return 2
    if args.trace_memory:
        print("error: --trace-memory traces a run on a described machine in this process: add --dry-run --gpus N",
              file=sys.stderr)
        return 2
    die_with_launcher()
    configure_allocator(cuda=torch.cuda.is_available())      # before CUDA allocates anything
    try:
        run = _plan(cfg, rank0)
        device = init_distributed(run.collective, cfg.parallel.timeout_seconds)
    except (RuntimeError, ValueError) as e:
        message = f"error: {e}" if isinstance(e, ConfigError) else \
            f"error: cannot start the process group: {' '.join(str(e).split())[:300]}"
        if rank0:
            print(message, flush=True)
        write_error_file(message)
        return 1
    except KeyboardInterrupt:
        return interruption.said()
    watchdog = interruption.watchdog = Watchdog.start(dist.get_rank(), dist.get_world_size(),
                                                      cfg.parallel.timeout_seconds)
    try:
        grid = ParallelGrid.for_plan(run, cfg.parallel.timeout_seconds)
        summary = train(cfg, run, grid, device, signals=signals, watchdog=watchdog, dry_run=args.dry_run)
        if summary["stopped_by"] == "dry_run":
            print0(f"dry run: stopped before step 1; {cfg.logging.run_dir}/runtime.json written")
        elif summary["stopped_by"] == "already_finished":
            print0(f"done: this run already finished: its checkpoint is at step {summary['step']} "
                   f"(training.train_steps={cfg.training.train_steps}); raise training.train_steps to train further")
        else:
            print0(f"done: step {summary['step']}, loss {summary['loss']:.4f} ({summary['stopped_by']})")
        return 0
    except KeyboardInterrupt:
        return interruption.said()
    except Exception as e:  # noqa: BLE001 - every error ends the job with one line, from the rank that has it
        if signals.interrupted:          # a peer interrupted first left this rank's collective
            return interruption.said()
        if collective_failure(e) and not isinstance(e, torch.OutOfMemoryError):
            watchdog.fail(f"a collective failed on rank {dist.get_rank()} while {watchdog.current} "
                          f"({' '.join(str(e).split())[:200]})")
        watchdog.report(_error_line(e, watchdog.current))
        return 1
    finally:
        watchdog.stop()
        destroy_distributed()


def _plan(cfg: Config, rank0: bool) -> RunPlan:
    """The run's plan, before any process group: the config checked at torchrun's world size and every decision
    made on this process's machine (the collective backend the group starts with among them); ConfigError
    names what cannot run, here or at that size. The config's warnings are printed first, from rank 0."""
    # torchrun's world, or that of a process group already started (a test harness, a notebook)
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    if rank0:
        for note in config_warnings(cfg):
            print(f"warning: {note}", flush=True)
    validate_config(cfg, world_size=world)
    return resolve(cfg, Machine.current(local_device(cfg.parallel.backend)), world)    # every decision, once


def _print_config(cfg: Config) -> None:
    """The config as YAML, each key's meaning as a comment (without --config: the defaults); what would stop a
    run of it as it is (the defaults name no data), on stderr."""
    print(annotated_yaml(cfg), end="")
    try:
        validate_config(cfg)
    except ConfigError as e:
        print(f"note: a run of this config as it is would stop with: config error: {e}", file=sys.stderr)


def _described_dry_run(cfg, args: argparse.Namespace) -> int:
    """--dry-run --gpus N: rank 0's start-up path of a run on a described machine (training/dry_run.py), its
    flags checked as tools/plan.py checks them (plan/described.py), then whether the config's own layout fits
    that machine, judged and worded as tools/plan.py judges it (with --trace-memory, the traced peak too): a
    layout that does not fit ends in one error line and a non-zero exit."""
    from megalysses.plan.described import MachineFigures, flag_lines, machine_problems
    from megalysses.plan.step_time import Hardware

    if not args.dry_run:
        print("error: --gpus N describes the machine of a --dry-run: add --dry-run", file=sys.stderr)
        return 2
    packages = tuple(p for p in args.packages.split(",") if p)
    bad = machine_problems(MachineFigures(args.gpus, args.gpu, args.gpu_memory_gib, args.host_memory_gib, packages),
                           {"gpus_per_node": args.gpus_per_node})
    if bad:
        print("\n".join(flag_lines(bad)), file=sys.stderr)
        return 2
    try:
        machine = Machine.described(args.gpu, ranks_per_node=min(args.gpus, args.gpus_per_node),
                                    memory_gib=args.gpu_memory_gib, packages=packages)
        record = dry_run(cfg, machine, args.gpus)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"dry run: {args.gpus} x {args.gpu}: attention {record['attention']}, kernels {record['kernels']}, "
          f"{record['dtype']}; {Path(cfg.logging.run_dir) / 'runtime.json'} written")
    from megalysses.tools.plan import Described, own_layout

    host = float("inf") if args.host_memory_gib is None else args.host_memory_gib    # unsaid: not judged here
    mine, own_row = own_layout(cfg, args.gpus, Hardware(gpus_per_node=args.gpus_per_node),
                               Described(args.gpu_memory_gib, host, packages, machine))
    traced = None
    if args.trace_memory:
        traced = _trace_memory(cfg, machine, args.gpus)
        if traced is None:
            return 1
    return _fit_verdict(mine, own_row, traced, args)


def _fit_verdict(mine, own_row: dict, traced: Optional[float], args: argparse.Namespace) -> int:
    """The described dry run's last line: tools/plan.py's verdict on the config's own layout, and the traced peak
    (bytes, with --trace-memory) held to the same usable memory; 0 where both fit, 1 with one error line where
    either does not."""
    from megalysses.memory import GIB
    from megalysses.tools.plan import own_verdict

    why, note = [own_row["why_not"]] if own_row["why_not"] else [], ""
    if mine is not None and traced is not None:
        over = traced > mine.usable
        said = f"traced peak {traced / GIB:.2f} GiB {'>' if over else '<='} usable {mine.usable / GIB:.2f} GiB"
        why, note = (why + [said], note) if over else (why, f"; {said}")
    if mine is not None and not why:
        if args.host_memory_gib is None and own_row["host_gib_per_node"] > 0:
            note += (f"; {own_row['host_gib_per_node']:g} GiB of host memory per node, which --host-memory-gib "
                     f"judges (the run checks its node's at start-up)")
        print(own_verdict(mine, own_row) + note)
        return 0
    print(f"error: {own_verdict(None, {**own_row, 'why_not': '; '.join(why)})}: tools/plan.py --config "
          f"{args.config or 'CONFIG'} --gpus {args.gpus} lists the layouts that fit", file=sys.stderr)
    return 1


def _trace_memory(cfg, machine: Machine, gpus: int) -> Optional[float]:
    """--trace-memory: one step traced on fake tensors (training/trace.py), printed beside the memory model's
    prediction and written to <run_dir>/memory_trace.json; returns the traced peak per GPU in bytes (None after
    an error line)."""
    import json

    from megalysses.memory import GIB
    from megalysses.plan.search import estimate_config, predict
    from megalysses.plan.step_time import Hardware
    from megalysses.training.trace import model_part, roofline_fields, trace_run

    try:
        traces = trace_run(cfg, machine, gpus)
        est = estimate_config(cfg, gpus, machine)
        model = predict(cfg, traces[0].plan, None, None, Hardware()).step
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    for t in traces:
        print("\n".join(t.lines()))
    top = max(traces, key=lambda t: t.device.bytes)
    print(f"memory trace: peak {top.device.bytes / GIB:.2f} GiB per GPU on stage {top.stage} at "
          f"{model_part(top.device.moment)}; the memory model: {est.peak_gib:.2f} GiB on stage {est.stage} at "
          f"{est.part} ({est.peak / max(top.device.bytes, 1) - 1:+.1%}); host {top.host.bytes / GIB:.2f} GiB per "
          f"rank traced, {est.host / GIB:.2f} modelled")
    roof, modelled = roofline_fields(traces), model.breakdown(Hardware())
    print(f"step trace: {roof['traced_step_s']:.4g} s per optimizer step; the step-time model: {model.total:.4g} s; "
          f"{roof['traced_launches']:,} kernel launches, {roof['traced_host_syncs']} host syncs, "
          f"{roof['traced_mask_evaluations']:.3g} mask evaluations; seconds traced / modelled: "
          + ", ".join(f"{k} {v:.3g} / {modelled.get(k, 0.0):.3g}" for k, v in roof["traced_step_breakdown"].items()))
    out = Path(cfg.logging.run_dir) / "memory_trace.json"
    out.write_text(json.dumps({"gpus": gpus, "machine": machine.summary(), "stages": [t.summary() for t in traces],
                               "model": {"peak_gib": est.peak_gib, "stage": est.stage, "part": est.part,
                                         "host_gib": est.host / GIB, "step_s": model.total,
                                         "step_breakdown": modelled},
                               "step": roof}, indent=1))
    print(f"{out} written")
    return float(top.device.bytes)


def _error_line(e: Exception, doing: str) -> str:
    """The one line an error ends the job with: bad input says what to fix; anything else is a bug, reported
    with its traceback (on stderr) and the rank and what it was doing."""
    if isinstance(e, USER_ERRORS):
        return f"error: {e}"
    if isinstance(e, MemoryError):
        return (f"error: out of host memory while {doing}: lower data.seq_len or training.micro_batch_size, or "
                f"use more ranks")
    if isinstance(e, torch.OutOfMemoryError):
        return (f"error: out of GPU memory while {doing}: lower training.micro_batch_size, enable "
                f"training.activation_checkpointing, or shard more (parallel.fsdp, tp, sp, pp)")
    traceback.print_exc()
    return f"error: rank {dist.get_rank()} failed while {doing}: {type(e).__name__}: {' '.join(str(e).split())}"


def cli() -> int:
    return main()


if __name__ == "__main__":
    sys.exit(cli())
