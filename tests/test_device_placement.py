"""Every tensor that reaches a collective or a kernel is on the run's device.

The first CUDA run of this code died at step 1: a flag built with torch.tensor([...]) (so on the CPU)
was handed to an NCCL all-reduce. No CPU test could see it, because on CPU the default device IS the
run's device. Here the default device is switched to `meta` while training runs on CPU: a tensor that
our code creates without naming its device lands on meta, and the collectives' device check (or the
first op mixing it with real tensors) fails the run. torch's own checkpoint internals are run with the
default device left alone: they are torch's business, not ours.
"""
import json

import pytest
import torch

from megalysses import comm
from megalysses.config.io import load_config
from megalysses.degrees import Degrees
from megalysses.testing import run_distributed
from megalysses.testing import resolve_run
from tests.fixtures import PARITY, with_model

BASE = with_model(PARITY, num_heads=4) + ["logging.log_interval=1", "training.eval_interval=2",
                                          "training.eval_steps=1", "parallel.timeout_seconds=60"]
LAYOUTS = {
    "dp2_save_resume": ["checkpoint.save_interval=2", "training.train_steps=2"],
    "tp2": ["parallel.tp=2", "parallel.tp_sequence_parallel=true", "model.tie_embeddings=true",
            "training.loss_chunk_tokens=8", "training.mlp_chunk_tokens=8", "training.activation_checkpointing=true"],
    "sp2": ["parallel.sp=2"],
    "pp2": ["parallel.pp=2"],
    "pp2v2": ["parallel.pp=2", "parallel.virtual_stages=2"],
    "fsdp_dp2": ["parallel.fsdp=true"],
}


def _meta_default_worker(rank, world, tmp):
    from megalysses.grid import ParallelGrid
    from megalysses.checkpoint import dcp_io as checkpoint
    from megalysses.training import loop

    def on_cpu(fn):
        def run(*args, **kwargs):
            with torch.device("cpu"):
                return fn(*args, **kwargs)
        return run

    checkpoint.dcp.save, checkpoint.dcp.load = on_cpu(checkpoint.dcp.save), on_cpu(checkpoint.dcp.load)
    losses = {}
    for name, extra in LAYOUTS.items():
        cfg = load_config(overrides=BASE + ["training.train_steps=3"] + extra + [f"logging.run_dir={tmp}/{name}"])
        grid, cpu = ParallelGrid(Degrees.of_world(world, tp=cfg.parallel.tp, sp=cfg.parallel.sp,
                                                    pp=cfg.parallel.pp)), torch.device("cpu")
        with torch.device("meta"):
            assert torch.tensor([1.0]).device.type == "meta"      # the trap is armed
            losses[name] = loop.train(cfg, resolve_run(cfg, cpu, grid), grid, cpu)["loss"]
            if name == "dp2_save_resume":                         # resume from the step-2 checkpoint
                cfg.training.train_steps = 3
                losses[name] = loop.train(cfg, resolve_run(cfg, cpu, grid), grid, cpu)["loss"]
    return losses


def test_training_never_relies_on_the_default_device(tmp_path):
    results = run_distributed(_meta_default_worker, 2, tmp_path, args=(str(tmp_path),), timeout=300)
    for name in LAYOUTS:
        assert all(torch.isfinite(torch.tensor(r[name])) for r in results), name
    # the choices of the run, written once to the run directory
    runtime = json.loads((tmp_path / "tp2" / "runtime.json").read_text())
    assert runtime["attention"] == "sdpa" and runtime["dtype"] == "float32" and runtime["kernels"] == "torch"
    layout = {k: runtime[k] for k in ("world", "tp", "sp", "pp", "dp")}
    assert layout == {"world": 2, "tp": 2, "sp": 1, "pp": 1, "dp": 1}
    assert "TP sequence sharding" in runtime["memory_options"] and runtime["versions"]["torch"] == torch.__version__


def _collectives_worker(rank, world):
    group = comm.world()
    good = torch.ones(4)
    bad = torch.ones(4, device="meta")
    calls = {
        "all_reduce": lambda t: comm.all_reduce_(t, group),
        "reduce_scatter": lambda t: comm.reduce_scatter_into(t[:2], t, group),
        "all_gather": lambda t: comm.all_gather_into(torch.empty(8, device=t.device), t, group),
        "all_to_all": lambda t: comm.all_to_all(t, group, scatter_dim=0, gather_dim=0),
        "send_recv": lambda t: comm.send_recv(sends=[(t, 1 - rank)], recvs=[(torch.empty_like(t), 1 - rank)]),
    }
    refused = {}
    for name, call in calls.items():
        call(good)                                               # a real tensor goes through
        try:
            call(bad)
            refused[name] = None
        except RuntimeError as e:
            refused[name] = str(e)
    return refused


def test_collectives_refuse_tensors_off_the_run_device(tmp_path):
    for refused in run_distributed(_collectives_worker, 2, tmp_path):
        for name, message in refused.items():
            assert message is not None, f"{name} accepted a meta tensor"
            assert f"{name}: a tensor on meta" in message and "run's device" in message, message


def test_nccl_groups_need_cuda_tensors(monkeypatch):
    """What the check says on an NCCL group, without NCCL: a CPU tensor is refused by name."""
    monkeypatch.setattr(comm.dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(RuntimeError, match="all_reduce: a tensor on cpu was handed to a nccl collective"):
        comm.check_device("all_reduce", None, torch.ones(1))
