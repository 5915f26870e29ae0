"""A run's plan on this rank's machine, told to the user: the start-up line, and <run_dir>/runtime.json
beside config.yaml (the plan, the layout and the software the choices were made with).

    model_cfg = model_config(cfg, plan)             # cfg.model with the concrete attention and kernels
    print0(startup_line(cfg, grid, plan))
"""
from __future__ import annotations

import dataclasses
import json
import platform
from pathlib import Path

import torch

from megalysses.config import Config, ModelConfig
from megalysses.grid import ParallelGrid
from megalysses.kernels.attention import flash_attn_func
from megalysses.kernels.triton_support import triton_importable
from megalysses.plan import RunPlan
from megalysses.plan.communicators import checkpoint_record


def check_built(model: torch.nn.Module, grid: ParallelGrid, plan: RunPlan) -> None:
    """The built model and grid do what the plan says: every attention layer runs the plan's backend and
    sliding window, every fused op its kernels (the q/k head norms' too), every stage and its blocks the
    activation policy (as model/policies.py applied it), the grid its ulysses x ring, the weights its dtype (FSDP
    keeps fp32 shards and gathers in the plan's dtype). A difference is a bug: what the planner predicted would
    not be what the run does."""
    from megalysses.model.gpt import GPTStage
    from megalysses.model.layers import MLP, Attention, HeadNorm, Norm
    from megalysses.model.policies import applied_policy

    wrong = []
    if (grid.ulysses_size, grid.ring_size) != (plan.degrees.ulysses, plan.degrees.ring):
        wrong.append(f"grid ulysses x ring {grid.ulysses_size} x {grid.ring_size}")
    for name, m in model.named_modules():
        if isinstance(m, Attention) and (m.backend, m.window) != (plan.attention, plan.attention_window):
            wrong.append(f"{name} attention {m.backend}, window {m.window}")
        if isinstance(m, (Attention, MLP, Norm, HeadNorm)) and m.impl != plan.kernels:
            wrong.append(f"{name} kernels {m.impl}")
        if isinstance(m, GPTStage):
            try:
                applied = applied_policy(m)
            except ValueError as e:
                applied = str(e)
            # read back, a stage asks for the loss tile it runs (the plan's concrete one)
            if applied != dataclasses.replace(plan.activation, loss_chunk_tokens=plan.activation.loss_tile):
                wrong.append(f"{name or 'stage'} activation policy {applied}")
    if not plan.optimizer.startswith("fsdp"):
        dtypes = {str(p.dtype).removeprefix("torch.") for p in model.parameters()}
        if dtypes != {plan.dtype}:
            wrong.append(f"weights in {sorted(dtypes)}")
    if wrong:
        raise RuntimeError(f"the built run differs from its plan ({', '.join(wrong)}): planned {plan.attention} "
                           f"attention, {plan.kernels} kernels, {plan.dtype}, ulysses {plan.degrees.ulysses} x ring "
                           f"{plan.degrees.ring}")


def model_config(cfg: Config, plan: RunPlan) -> ModelConfig:
    """cfg.model with the concrete attention backend and kernels the run uses."""
    return dataclasses.replace(cfg.model, attention_backend=plan.attention, kernels=plan.kernels)


DYNAMO_DEFAULT_LIMIT = 8   # slack above the counted specialisations: dynamo's own default per function


def flex_compile_budget(plan: RunPlan) -> int:
    """How many specialisations compiled FlexAttention may need in this run: one per shape and grad mode,
    and the shapes change with the length (each phase of a curriculum, validation at data.seq_len, the lengths of
    long_eval). A length without a ring has one attention shape, compiled with grad (training) and without
    (validation); with a ring it has three block shapes (the diagonal block, the first half of the keys, the
    second half of the queries), each compiled for the forward and for the backward's recomputation with grad."""
    lengths = {p.padded_len for p in plan.phases}
    return DYNAMO_DEFAULT_LIMIT + (6 if plan.degrees.ring > 1 else 2) * len(lengths)


def memory_options(cfg: Config, plan: RunPlan) -> list[str]:
    a = plan.activation
    opts = [{"fsdp": "FSDP2", "fsdp-host": "FSDP2", "zero1": "ZeRO-1", "zero1-host": "ZeRO-1"}[plan.optimizer]]
    if a.checkpointing:
        opts.append("activation checkpointing" + (f" (one block input in {a.checkpoint_stride} kept)"
                                                  if a.checkpoint_stride > 1 else "")
                    + (" (inputs offloaded to host memory)" if a.offload else "")
                    + (" (attention outputs kept)" if a.keep_attention else ""))
    if plan.optimizer == "zero1-host":
        opts.append("optimizer state and update on the host, gradients streamed there")
    if plan.weights == "host":
        opts.append("weights, gradients and optimizer on the host, streamed a block ahead")
    if a.mlp_chunk_tokens:
        opts.append(f"tiled MLP ({a.mlp_chunk_tokens} tokens)")
    if a.head_chunks > 1:
        auto = " (auto)" if cfg.training.attention_head_chunks == "auto" else ""
        opts.append(f"attention in {a.head_chunks} head chunks{auto}")
    if a.loss_chunk_tokens:
        opts.append(f"tiled loss ({a.loss_chunk_tokens} tokens)")
    if a.tp_sequence_parallel:
        opts.append("TP sequence sharding")
    if plan.degrees.virtual_stages > 1:
        opts.append(f"interleaved pipeline (v={plan.degrees.virtual_stages})")
    if plan.async_save:
        opts.append("checkpoints written in the background")
    elif cfg.checkpoint.async_save == "auto" and plan.async_save_reason:
        opts.append(f"checkpoints written synchronously ({plan.async_save_reason})")
    return opts


def sequence_summary(cfg: Config, plan: RunPlan) -> str:
    """How the sequence is split: 'sp = ulysses 2 x ring 2, seq_len 250 padded to 252', and the curriculum:
    'seq_len 250 (padded to 252) -> 1000 at step 101'."""
    text = f"sp = ulysses {plan.degrees.ulysses} x ring {plan.degrees.ring}"
    schedule = cfg.data.seq_len_schedule
    train = [p for p in plan.phases if p.name not in ("eval", "long_eval")]
    if schedule:
        lengths = [f"{p.seq_len}" + (f" (padded to {p.padded_len})" if p.padded_len != p.seq_len else "")
                  + (f" at step {step + 1}" if step else "") for (step, _), p in zip(schedule, train)]
        text += ", seq_len " + " -> ".join(lengths)
    elif plan.padded_seq_len != cfg.data.seq_len:
        text += f", seq_len {cfg.data.seq_len} padded to {plan.padded_seq_len}"
    return text


def startup_line(cfg: Config, grid: ParallelGrid, plan: RunPlan) -> str:
    """One line with everything that decides speed and memory."""
    m = cfg.model
    padded = m.padded_vocab_size(grid.tp_size)
    vocab = f"vocab {m.vocab_size}" + (f" (padded to {padded})" if padded != m.vocab_size else "")
    allocator = f" | allocator {plan.machine.allocator}" if plan.machine.allocator else ""
    return (f"megalysses: world={grid.world} tp={grid.tp_size} sp={grid.sp_size} pp={grid.pp_size} "
            f"dp={grid.dp_size} | {sequence_summary(cfg, plan)} | {plan.machine.device} {plan.dtype} | attention "
            f"{plan.attention} ({plan.attention_reason}) | kernels {plan.kernels} | {vocab} | "
            f"{', '.join(memory_options(cfg, plan))} | {len(rank_communicators(grid, plan))} communicators{allocator}")


def runtime_record(cfg: Config, plan: RunPlan) -> dict:
    """What runtime.json holds: the plan and the start-up line's memory options."""
    return {**plan.record(), "memory_options": memory_options(cfg, plan)}


def rank_communicators(grid: ParallelGrid, plan: RunPlan) -> list[dict]:
    """This rank's communicators as runtime.json lists them: the grid's, and the background saver's where the plan
    saves checkpoints in the background (training/loop.py background_saver makes it)."""
    saver = [checkpoint_record(grid.world)] if plan.async_save and grid.world > 1 else []
    return grid.communicators + saver


def write_runtime(run_dir: Path, cfg: Config, grid: ParallelGrid, plan: RunPlan) -> None:
    """<run_dir>/runtime.json: the plan (runtime_record), this rank's communicators (one per process group: its ranks,
    the kinds of group that share it) and the software it was made with."""
    versions = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                "triton": _version("triton") if triton_importable() else None,
                "flash_attn": _version("flash_attn") if flash_attn_func is not None else None}
    record = {**runtime_record(cfg, plan), "communicators": rank_communicators(grid, plan), "versions": versions}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "runtime.json").write_text(json.dumps(record, indent=1) + "\n")


def _version(module: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module.replace("_", "-"))
    except PackageNotFoundError:
        return None
