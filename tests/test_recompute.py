"""training.recompute_attention=false: activation checkpointing keeps SDPA's attention outputs and the
backward recomputes the rest of the block (megalysses/model/recompute.py).

At every layout the option allows, the losses and every reduced gradient equal those of full
recomputation bit for bit, and the attention kernel runs once per layer and micro-batch in the forward
instead of twice. What it keeps is checked against the memory model in tests/test_memory_model.py;
layouts it cannot serve are config errors."""
import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megalysses.config import ConfigError
from megalysses.config_io import load_config
from megalysses.grid import ParallelGrid
from megalysses.model.recompute import attention_kernels
from megalysses.testing import run_distributed
from megalysses.training.runtime import memory_options, plan_runtime

BASE = ["data.mock=true", "data.seq_len=32", "model.vocab_size=128", "model.hidden_size=64", "model.num_layers=3",
        "model.num_heads=8", "model.num_kv_heads=2", "model.attention_backend=sdpa", "training.micro_batch_size=1",
        "training.global_batch_size=4", "training.train_steps=2", "training.activation_checkpointing=true",
        "parallel.grad_bucket_elements=5000", "parallel.timeout_seconds=60", "data.document_mask=true"]
LAYOUTS = {   # name: (overrides on 4 ranks, layers x micro-batches on one rank)
    "tp2 sp2, TP sequence sharding, tiled MLP and loss": (
        ["parallel.tp=2", "parallel.sp=2", "parallel.tp_sequence_parallel=true", "training.mlp_chunk_tokens=4",
         "training.loss_chunk_tokens=4"], 3 * 4),
    "pp2 dp2, 1F1B, bf16": (["parallel.pp=2", "training.dtype=bfloat16", "model.num_layers=4"], 2 * 2),
    "sp4 (KV heads replicated), dp FSDP": (["parallel.sp=4", "parallel.fsdp=true"], 3 * 4),
}


class CountAttention(TorchDispatchMode):
    """How many times SDPA's attention kernel runs (forward kernels only: the backward has its own ops)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in attention_kernels():
            self.calls[str(func)] += 1
        return func(*args, **(kwargs or {}))


def one_step(overrides: list[str], world: int) -> dict:
    """One training step of a run: its loss, the reduced gradients (this rank's fp32 shards, before the
    update) and how many times the attention kernel ran."""
    from megalysses.training import loop
    from megalysses.training.data import TrainingData
    from megalysses.training.step import train_step

    cfg = load_config(overrides=BASE + overrides)
    device = torch.device("cpu")
    grid = ParallelGrid.for_config(cfg) if world > 1 else ParallelGrid.single()
    runtime = plan_runtime(cfg, device, grid)
    model, opt = loop.build_model_and_optimizer(cfg, grid, device, runtime)
    got = {}

    def capture(max_norm: float) -> float:        # the optimizer's step, up to the update
        if cfg.parallel.fsdp:
            got["grads"] = {n: q.grad.to_local().clone() for n, q in model.named_parameters()}
        else:
            opt.reduce_gradients()
            got["grads"] = {s.name: s.master.grad.clone() for s in opt.slots if s.master is not None}
        norm = opt.grad_norm().item()
        opt.zero_grad()
        return norm

    opt.step = capture
    batches = next(TrainingData(cfg, grid, device).train_batches(0))
    with CountAttention() as counter:
        result = train_step(model, opt, batches, grid, lr=1e-3, grad_clip=1.0, dtype=runtime.torch_dtype)
    got.update(loss=result.loss, calls=sum(counter.calls.values()))
    return got


def _worker(rank: int, world: int) -> dict:
    return {name: (one_step(overrides, world), one_step(overrides + ["training.recompute_attention=false"], world))
            for name, (overrides, _) in LAYOUTS.items()}


def test_kept_attention_gives_the_same_gradients_and_runs_attention_once(tmp_path):
    results = run_distributed(_worker, 4, tmp_path, timeout=400)
    for rank, by_layout in enumerate(results):
        for name, (full, kept) in by_layout.items():
            where = f"{name}, rank {rank}"
            assert kept["loss"] == full["loss"], where
            assert kept["grads"].keys() == full["grads"].keys() and kept["grads"], where
            for p, g in full["grads"].items():
                assert torch.equal(kept["grads"][p], g), f"{where}: {p}"
            runs = LAYOUTS[name][1]          # layer forwards on this rank in the step
            assert full["calls"] == 2 * runs, (where, full["calls"])     # the forward, then the recomputation
            assert kept["calls"] == runs, (where, kept["calls"])


@pytest.mark.parametrize("overrides, message", [
    (["training.activation_checkpointing=false"], "training.activation_checkpointing=true"),
    (["model.attention_backend=reference"], "model.attention_backend=sdpa"),
    (["training.activation_offload=true"], "choose one of them"),
    (["model.num_heads=2", "model.num_kv_heads=1", "parallel.sp=4"], "ring attention"),
])
def test_layouts_it_cannot_serve_are_config_errors(overrides, message):
    cfg = load_config(overrides=BASE + ["training.recompute_attention=false"] + overrides)
    with pytest.raises(ConfigError, match=message):
        plan_runtime(cfg, torch.device("cpu"))


def test_the_start_up_line_says_what_checkpointing_keeps():
    cfg = load_config(overrides=BASE + ["training.recompute_attention=false"])
    assert "activation checkpointing (attention outputs kept)" in memory_options(cfg)
    assert "activation checkpointing" in memory_options(load_config(overrides=BASE))
