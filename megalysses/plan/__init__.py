"""Decisions in one place: a Config and a Machine resolve into a RunPlan (run_plan.py) that the run, the
memory model (megalysses.memory) and the cost models here read.

    machine.py    Machine: the real device and its packages, or a described one (planning)
    described.py  the figures that describe a machine (tools/plan.py's and the dry run's flags), checked once
    types.py      RunPlan, Phase, ActivationPolicy: what a resolved run is
    run_plan.py   resolve(cfg, machine, world) -> RunPlan: dtype, ulysses x ring, attention, kernels, ...
    tiles.py      the MLP and loss tiles `auto` resolves to, from the memory model
    flops.py      FLOPs per token and the peak table (MFU)
    step_time.py  Hardware and the step-time model
    search.py     a config's predicted memory and step time on a machine, the layouts that fit, and the
                  phase-time check of a run (tools/plan.py is the command line over it)
    memory.py     the memory model (megalysses.memory) read off a RunPlan: its estimate and pinned requests
    communicators.py  which of a run's process groups share a communicator, and their device memory

It sits below config, kernels (what each kernel can run), memory and parallel (the sequence layout) in the
README's code map, and imports nothing further down.
"""
from megalysses.plan.machine import Machine
from megalysses.plan.run_plan import resolve
from megalysses.plan.types import ActivationPolicy, Phase, RunPlan

__all__ = ["ActivationPolicy", "Machine", "Phase", "RunPlan", "resolve"]
