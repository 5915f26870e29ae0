"""What a run will use, decided once before anything is built: the compute dtype, the sequence-parallel
factorisation (sp = ulysses x ring) and the padded sequence length, the attention backend, the kernels.
Printed on the start-up line and written to <run_dir>/runtime.json beside config.yaml.

    runtime = plan_runtime(cfg, device, grid)     # ConfigError when the machine cannot do what cfg asks
    model_cfg = runtime.model_config(cfg)          # cfg.model with the concrete backend
    print0(startup_line(cfg, grid, runtime))

Every choice is made here from the device, the installed packages, the head dim, the dtype, the masks
and the layout, so the model, the masks and the log agree: `auto` never picks a backend that cannot run
the shape (with a ring, one that returns the log-sum-exp), and an explicit backend that cannot run it is
a ConfigError before step 1.
"""
from __future__ import annotations

import dataclasses
import json
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from megalysses.config import Config, ConfigError, ModelConfig
from megalysses.config_checks import check_kept_attention, ulysses_ring
from megalysses.grid import ParallelGrid
from megalysses.kernels.attention import flash_attn_func, select_backend
from megalysses.kernels.triton_support import choose_impl, triton_importable
from megalysses.training.metrics import check_logging_backends
from megalysses.parallel.sequence_layout import SequenceLayout


@dataclass(frozen=True)
class Runtime:
    device: str
    dtype: str                  # "float32" or "bfloat16": weights, activations and kernels' inputs
    attention_backend: str      # concrete: reference, sdpa, flex or flash
    attention_reason: str
    kernels: str                # torch, triton, liger or apex (norms, RoPE, SwiGLU)
    ulysses: int = 1            # sp = ulysses x ring
    ring: int = 1
    padded_seq_len: int = 0     # data.seq_len rounded up to the layout's multiple (padding labels masked)
    padded_stage_lens: tuple[int, ...] = ()   # each data.seq_len_schedule length, rounded up the same way

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def model_config(self, cfg: Config) -> ModelConfig:
        """cfg.model with the concrete attention backend this run uses."""
        return dataclasses.replace(cfg.model, attention_backend=self.attention_backend)


def compute_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    """training.dtype, with auto = bf16 on CUDA, fp32 elsewhere."""
    if cfg.training.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.training.dtype]


def plan_runtime(cfg: Config, device: torch.device, grid: ParallelGrid | None = None) -> Runtime:
    """Decide dtype, sp factorisation, attention backend and kernels for this run; ConfigError names what
    cannot run here. With `grid`, also check that it was built with the same factorisation."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    if t.activation_offload and not t.activation_checkpointing:
        raise ConfigError("training.activation_offload=true needs training.activation_checkpointing=true: the "
                          "offloaded tensors are the checkpointed block inputs (set both, or neither)")
    if t.optimizer_offload and p.fsdp:
        raise ConfigError("training.optimizer_offload=true is for ZeRO-1: with parallel.fsdp=true the optimizer "
                          "state is already sharded with the weights; set one of them to false")
    dtype = compute_dtype(cfg, device)
    ulysses, ring = ulysses_ring(cfg)
    if grid is not None and (grid.ulysses_size, grid.ring_size) != (ulysses, ring):
        raise ConfigError(f"the process grid splits sp={grid.sp_size} as ulysses {grid.ulysses_size} x ring "
                          f"{grid.ring_size} but the config resolves to ulysses {ulysses} x ring {ring}: build it "
                          f"with ParallelGrid.for_config(cfg)")
    try:
        backend, reason = select_backend(m.attention_backend, device, dtype, head_dim=m.head_dim,
                                         has_docs=cfg.data.document_mask, training=True, ring=ring > 1)
    except (RuntimeError, ValueError) as e:
        where = f" (this layout runs ring attention: parallel.sp={p.sp} = ulysses {ulysses} x ring {ring})" \
            if ring > 1 else ""
        raise ConfigError(f"model.attention_backend={m.attention_backend}: {e}{where}") from None
    if not t.recompute_attention:
        check_kept_attention(cfg, backend, ulysses, ring)
    sequence = SequenceLayout(p.sp, ring, p.tp if p.tp_sequence_parallel else 1)
    probe = torch.empty(0, device=device)
    for impl in {"torch": [], "triton": ["triton"], "liger": ["liger"], "apex": ["apex", "triton"]}[m.kernels]:
        try:
            choose_impl(impl, probe, "model.kernels")
        except RuntimeError as e:
            raise ConfigError(f"model.kernels={m.kernels}: {e}") from None
    check_logging_backends(cfg)
    return Runtime(device=str(device), dtype=str(dtype).removeprefix("torch."), attention_backend=backend,
                   attention_reason=reason, kernels=m.kernels, ulysses=ulysses, ring=ring,
                   padded_seq_len=sequence.padded_len(cfg.data.seq_len),
                   padded_stage_lens=tuple(sequence.padded_len(n) for _, n in cfg.data.seq_len_schedule))


def check_phase_time(cfg: Config, world: int, peak_tflops: float | None) -> None:
    """ConfigError when a training step, or a validation, at the planner's predicted speed on a GPU of
    `peak_tflops` takes more than half of parallel.timeout_seconds, the longest the watchdog lets a rank
    spend in one phase of the loop: it would end the run as stuck. Half leaves room for the prediction's
    error; a run on an unknown GPU (no peak) or outside what the planner covers is not checked."""
    if not peak_tflops:
        return
    from megalysses.tools.plan import Hardware, predicted_step_seconds

    step = predicted_step_seconds(cfg, world, Hardware(peak_tflops=peak_tflops))
    if step is None:
        return
    t = cfg.training
    validation = step / 3 * t.eval_steps if t.eval_interval else 0.0     # forward passes only
    what, seconds = ("a validation", validation) if validation > step else ("a training step", step)
    timeout = cfg.parallel.timeout_seconds
    if 2 * seconds > timeout:
        suggest = 600 * -(-4 * seconds // 600)
        raise ConfigError(f"parallel.timeout_seconds={timeout:g} is less than twice the time of {what} predicted "
                          f"for this layout on this GPU (~{seconds:.0f} s at {peak_tflops:g} TFLOP/s; tools/plan.py "
                          f"--explain shows the arithmetic): the watchdog would end it as stuck. Raise it, e.g. "
                          f"--set parallel.timeout_seconds={suggest:.0f}")


DYNAMO_DEFAULT_LIMIT = 8   # slack above the counted specialisations: dynamo's own default per function


def flex_compile_budget(runtime: Runtime) -> int:
    """How many specialisations compiled FlexAttention may need in this run: one per shape and grad mode,
    and the shapes change with the length (each curriculum stage, validation at data.seq_len). A length
    without a ring has one attention shape, compiled with grad (training) and without (validation); with
    a ring it has three block shapes (the diagonal block, the first half of the keys, the second half of
    the queries), each compiled for the forward and for the backward's recomputation with grad."""
    lengths = {runtime.padded_seq_len, *runtime.padded_stage_lens}
    return DYNAMO_DEFAULT_LIMIT + (6 if runtime.ring > 1 else 2) * len(lengths)


def memory_options(cfg: Config) -> list[str]:
    t, p = cfg.training, cfg.parallel
    opts = ["FSDP2" if p.fsdp else "ZeRO-1"]
    if t.activation_checkpointing:
        opts.append("activation checkpointing" + (" (inputs offloaded to host memory)" if t.activation_offload else "")
                    + ("" if t.recompute_attention else " (attention outputs kept)"))
    if t.optimizer_offload:
        opts.append("optimizer state and update on the host")
    if t.mlp_chunk_tokens:
        opts.append(f"tiled MLP ({t.mlp_chunk_tokens} tokens)")
    if t.loss_chunk_tokens:
        opts.append(f"tiled loss ({t.loss_chunk_tokens} tokens)")
    if p.tp_sequence_parallel:
        opts.append("TP sequence sharding")
    if p.virtual_stages > 1:
        opts.append(f"interleaved pipeline (v={p.virtual_stages})")
    return opts


def sequence_summary(cfg: Config, runtime: Runtime) -> str:
    """How the sequence is split: 'sp = ulysses 2 x ring 2, seq_len 250 padded to 252', and the curriculum:
    'seq_len 250 (padded to 252) -> 1000 at step 101'."""
    text = f"sp = ulysses {runtime.ulysses} x ring {runtime.ring}"
    schedule = cfg.data.seq_len_schedule
    if schedule:
        stages = [f"{n}" + (f" (padded to {padded})" if padded != n else "") + (f" at step {step + 1}" if step else "")
                  for (step, n), padded in zip(schedule, runtime.padded_stage_lens)]
        text += ", seq_len " + " -> ".join(stages)
    elif runtime.padded_seq_len != cfg.data.seq_len:
        text += f", seq_len {cfg.data.seq_len} padded to {runtime.padded_seq_len}"
    return text


def startup_line(cfg: Config, grid: ParallelGrid, runtime: Runtime) -> str:
    """One line with everything that decides speed and memory."""
    m = cfg.model
    padded = m.padded_vocab_size(grid.tp_size)
    vocab = f"vocab {m.vocab_size}" + (f" (padded to {padded})" if padded != m.vocab_size else "")
    return (f"megalysses: world={grid.world} tp={grid.tp_size} sp={grid.sp_size} pp={grid.pp_size} "
            f"dp={grid.dp_size} | {sequence_summary(cfg, runtime)} | {runtime.device} {runtime.dtype} | attention "
            f"{runtime.attention_backend} ({runtime.attention_reason}) | kernels {runtime.kernels} | {vocab} | "
            f"{', '.join(memory_options(cfg))}")


def write_runtime(run_dir: Path, cfg: Config, grid: ParallelGrid, runtime: Runtime) -> None:
    """<run_dir>/runtime.json: the choices above, the layout and the software they were made with."""
    versions = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                "triton": _version("triton") if triton_importable() else None,
                "flash_attn": _version("flash_attn") if flash_attn_func is not None else None}
    record = {**dataclasses.asdict(runtime), "memory_options": memory_options(cfg),
              "layout": {"world": grid.world, "tp": grid.tp_size, "sp": grid.sp_size, "pp": grid.pp_size,
                         "dp": grid.dp_size}, "versions": versions}
    if runtime.device.startswith("cuda"):
        record["gpu"] = torch.cuda.get_device_name(torch.device(runtime.device))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "runtime.json").write_text(json.dumps(record, indent=1) + "\n")


def _version(module: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module.replace("_", "-"))
    except PackageNotFoundError:
        return None


def source_commit() -> str | None:
    """The short git commit of the megalysses checkout this runs from (benchmarks record it with their
    results); None outside a git checkout or without git."""
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return out or None
