"""The figures that describe a machine to plan for, checked in one place for every command line that takes them:
tools/plan.py and `pretrain.py --dry-run --gpus N`.

    bad = machine_problems(MachineFigures(gpus=8, gpu_memory_gib=-80), {"gpus_per_node": 8})
    # {"gpu_memory_gib": "must be positive, got -80"}

Each problem is keyed by its flag's name (`gpu_memory_gib` is --gpu-memory-gib) and says what the value must
be and what it is: the sizes positive, the optional packages known, the GPU's memory known (or given), the
step-time model's figures in range (step_time.hardware_problems), and something left of the device's memory
once the reserve and the fragmentation allowance are taken off.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional

from megalysses.plan.machine import DEVICE_MEMORY_GIB, OPTIONAL_PACKAGES, PLAIN_TORCH, device_memory_gib
from megalysses.plan.step_time import Hardware, hardware_problems


@dataclass(frozen=True)
class MachineFigures:
    """What a command line says of the machine it plans for (None: not given, the default stands)."""

    gpus: Optional[int] = None
    gpu: str = "H100"
    gpu_memory_gib: Optional[float] = None      # None: what the GPU exposes (machine.DEVICE_MEMORY_GIB)
    host_memory_gib: Optional[float] = None     # None: no host memory to offload to
    packages: tuple[str, ...] = PLAIN_TORCH


def machine_problems(m: MachineFigures, hardware: Mapping[str, Any]) -> dict[str, str]:
    """{flag name: what it must be, and what it is} for each figure of `m` and of `hardware` (Hardware's fields,
    as given; the rest at Hardware's defaults) that cannot describe a machine. Empty when every one can."""
    bad = {name: f"must be positive, got {value:g}" for name, value in
           (("gpus", m.gpus), ("gpu_memory_gib", m.gpu_memory_gib), ("host_memory_gib", m.host_memory_gib))
           if value is not None and not value > 0}
    bad.update(hardware_problems(hardware))
    unknown = sorted(set(m.packages) - set(OPTIONAL_PACKAGES))
    if unknown:
        bad["packages"] = f"unknown {', '.join(unknown)}; choose from {', '.join(OPTIONAL_PACKAGES)}"
    memory = m.gpu_memory_gib
    if memory is None:
        try:
            memory = device_memory_gib(m.gpu)
        except ValueError:
            bad["gpu"] = (f"{m.gpu}: its memory is not known here ({', '.join(DEVICE_MEMORY_GIB)} is): give it in GiB "
                          f"(--gpu-memory-gib)")
    if bad or memory is None:
        return bad
    hw = Hardware(**{**asdict(Hardware()), **hardware})
    if hw.usable_bytes(memory) <= 0:
        bad["gpu_memory_gib"] = (f"{memory:g} leaves nothing usable after --reserve-gib {hw.reserve_gib:g} and "
                                 f"--fragmentation {hw.fragmentation:g}: give the memory of one GPU (79.6 for an H100 "
                                 f"80GB)")
    return bad


def flag_lines(bad: Mapping[str, str]) -> list[str]:
    """One `error:` line per bad figure, naming its flag."""
    return [f"error: --{name.replace('_', '-')} {why}" for name, why in bad.items()]
