"""What a resolved run is: the RunPlan (every decision of a run of one config on one machine), its
phases and its activation policy. megalysses.plan.resolve makes them; the model, the memory model and
the cost models read them."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Optional

from megalysses.degrees import Degrees
from megalysses.parallel.sequence_layout import SequenceLayout
from megalysses.plan.machine import Machine


@dataclass(frozen=True)
class Phase:
    """One length the run trains (or validates) at, and the padded length the layout makes of it."""

    name: str                   # "train" (from_step 0), "train from step N" (a curriculum's phase), "eval", or
                                # "long_eval" (a length of long_eval.lengths: forward only, not a step's shape)
    seq_len: int
    padded_len: int
    from_step: Optional[int] = None     # a training phase: the optimizer steps from this one on train at seq_len


@dataclass(frozen=True)
class ActivationPolicy:
    """What the backward keeps and where: checkpointing (and what it keeps), offload, tiles. The default
    keeps everything on the device."""

    checkpointing: bool = False
    keep_attention: bool = False    # checkpointing keeps SDPA's outputs (training.recompute_attention=false)
    offload: bool = False           # checkpointed block inputs live in pinned host memory
    checkpoint_stride: int = 1      # checkpointing keeps every k-th block input (groups of k blocks)
    mlp_chunk_tokens: int = 0
    loss_chunk_tokens: int = 0      # the LM head + loss tile asked for (0: the kernel's default)
    loss_tile: int = 0              # the tile the model runs: loss_chunk_tokens, or where that is 0 the kernel's
                                    # default for the local vocabulary (plan/run_plan.py concrete_loss_tile, which
                                    # only a plan can decide: a policy made without one runs loss_chunk_tokens)
    tp_sequence_parallel: bool = False
    head_chunks: int = 1            # attention runs over this many groups of heads (model/layers.py Attention)
    mask_block: int = 128           # FlexAttention's block-mask block size with documents (plan/run_plan.py)

    def __post_init__(self) -> None:
        if not self.loss_tile:
            object.__setattr__(self, "loss_tile", self.loss_chunk_tokens)
        if self.keep_attention and self.offload:
            raise ValueError("keeping attention outputs with activation offload is not supported: they would stay "
                             "on the device (config.checks.check_kept_attention refuses the config)")
        if self.keep_attention and self.head_chunks > 1:
            raise ValueError("keeping attention outputs with head chunks is not supported (validate_config refuses "
                             "the config)")


@dataclass(frozen=True)
class RunPlan:
    """Every decision of a run of one config on one machine."""

    machine: Machine
    degrees: Degrees                # tp, sp = ulysses x ring, pp, dp, virtual stages: the run's one copy of them
    dtype: str                      # compute dtype: "float32" or "bfloat16" (weights, activations, kernels)
    master_dtype: str               # the optimizer's masters and moments: always "float32"
    attention: str                  # core attention (reference, sdpa, flex or flash), or with a ring (ring > 1)
    attention_reason: str           # the backend of its blocks (reference, sdpa or flex)
    kernels: str                    # norms, RoPE, SwiGLU: torch, triton, liger or apex
    collective: str                 # nccl or gloo
    phases: tuple[Phase, ...]
    activation: ActivationPolicy
    micro_batch_size: int           # samples per micro-batch on each dp rank
    micro_batches: int              # micro-batches per step at training.global_batch_size (where a ramp ends)
    grad_dtype: str                 # what gradients accumulate and are reduced in: always "float32"
    optimizer: str                  # where the state lives: "fsdp", "zero1", "zero1-host" (optimizer offload) or
                                    # "fsdp-host" (parameter offload)
    attention_window: int = 0       # the sliding window every attention layer masks (model.sliding_window; 0: none)
    weights: str = "device"         # "host": pinned host memory, streamed in a block ahead (parameter offload)
    gradients: str = "device"       # "host": each bucket (block) leaves the device as its backward finishes
    grad_overlap: bool = True       # the gradient group's collectives run beside the step's others (FSDP's prefetch
                                    # and reduce-scatter, ZeRO-1's buckets during the backward): the grid keeps
                                    # their communicator apart (plan/communicators.py)
    async_save: bool = False        # checkpoints staged in pinned host memory and written in the background
    async_save_reason: str = ""     # why (checkpoint.async_save, and for auto the host memory it needs and has)

    @property
    def sequence(self) -> SequenceLayout:
        """Which positions each sp rank holds; every phase is padded to its multiple."""
        return SequenceLayout(self.degrees, self.activation.tp_sequence_parallel)

    @property
    def padded_seq_len(self) -> int:
        """data.seq_len padded to the layout's multiple (the longest phase but the long-context evaluation's)."""
        return max(p.padded_len for p in self.phases if p.name != "long_eval")

    @property
    def train_phases(self) -> tuple[Phase, ...]:
        """The training phases, in step order: one, or a sequence-length curriculum's."""
        return tuple(p for p in self.phases if p.from_step is not None)

    def train_phase(self, step: int) -> Phase:
        """The training phase of the optimizer step taken after `step` completed steps (the sequence-length
        curriculum's phase, data.seq_len_schedule)."""
        return [p for p in self.train_phases if p.from_step <= step][-1]

    @property
    def fsdp(self) -> bool:
        """FSDP2 shards the weights, gradients and optimizer state (parallel.fsdp)."""
        return self.optimizer.startswith("fsdp")

    @property
    def samples_per_micro_batch(self) -> int:
        """Samples of one micro-batch over the dp ranks."""
        return self.micro_batch_size * self.degrees.dp

    def micro_batches_of(self, batch: int) -> int:
        """Micro-batches of a step of `batch` global samples (a batch of a ramp)."""
        return batch // self.samples_per_micro_batch

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    def record(self) -> dict:
        """The plan as plain data (runtime.json, tools/plan.py --json)."""
        out = {"machine": self.machine.summary(), **self.degrees.record()}     # the degrees as flat keys
        for f in fields(self):
            if f.name in ("machine", "degrees"):
                continue
            value = getattr(self, f.name)
            out[f.name] = asdict(value) if f.name == "activation" else value
            if f.name == "phases":
                out["phases"], out["sequence"] = [asdict(p) for p in self.phases], self.sequence.record()
        out["padded_seq_len"] = self.padded_seq_len
        return out
