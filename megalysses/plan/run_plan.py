"""Resolve a run once: a Config and a Machine become a RunPlan, every `auto` decided.

    plan = resolve(cfg, Machine.current(device), world_size)      # ConfigError: what cannot run there, and why
    plan.dtype, plan.attention, plan.kernels, plan.degrees, plan.phases, ...

The decisions that depend on the machine or the layout are made here and nowhere else: the compute
dtype, sp = ulysses x ring, the attention backend of core attention and of the ring's blocks, the kernel
implementation, the collective backend, the padded length of every phase, the activation policy and
where the weights, the gradients and the optimizer state live. The model, the layers and the kernels
receive the concrete names; the start-up line, runtime.json, the memory model and the planner read the
same RunPlan.

Attention `auto` picks the first backend that can run the shape (kernels/attention.unsupported_reason):
flash-attn on CUDA in half precision; on CUDA with packed documents torch's variable-length attention
(cumulative lengths, O(S)), then compiled FlexAttention (a block-sparse mask, O((S/block)^2), where SDPA
would need a dense (S, S) one), FlexAttention first where the variable-length backward's workspace of 128 rows a
document is alone more than the device holds and FlexAttention fits (flex_for_documents); else SDPA. For the
blocks of ring attention only backends that return the log-sum-exp qualify: torch's SDPA flash kernel (CPU; CUDA without
documents, half precision), then FlexAttention, then the reference. The backend is resolved for
training (a backward), which is what every phase of the run then uses: evaluation runs the same kernel
forward only. The kernels are model.kernels' (the torch references by default: the Triton kernels are
opt-in until measured on a GPU), refused where they cannot run. Attention head chunks are checked against
the layout's heads (config.checks.head_chunk_counts); `auto` asks the memory model for the fewest that fit
the device (auto_head_chunks). Checkpoints are saved in the background where the node's memory holds the
staging copy beside what the run keeps there (choose_async_save).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from megalysses.config import Config, ConfigError
from megalysses.config.checks import check_head_chunks, check_heads, check_kept_attention, head_chunk_counts
from megalysses.degrees import Degrees
from megalysses.kernels.attention import AttentionNeeds, unsupported_reason
from megalysses.kernels.linear_cross_entropy import default_chunk_tokens
from megalysses.memory.types import fmt_bytes
from megalysses.parallel.sequence_layout import SequenceLayout
from megalysses.plan.machine import Machine
from megalysses.plan.types import ActivationPolicy, Phase, RunPlan


def compute_dtype(requested: str, machine: Machine) -> str:
    """training.dtype: auto = bf16 on CUDA, fp32 elsewhere."""
    if requested == "auto":
        return "bfloat16" if machine.cuda else "float32"
    return requested


def collective_backend(requested: str, machine: Machine) -> str:
    """parallel.backend: auto = NCCL on CUDA, gloo elsewhere."""
    if requested == "auto":
        return "nccl" if machine.cuda else "gloo"
    if requested == "nccl" and not machine.cuda:
        raise ConfigError("cannot start the process group: parallel.backend=nccl needs CUDA, which this machine has "
                          "not: use gloo or auto")
    return requested


def choose_attention(requested: str, machine: Machine, dtype: str, head_dim: Optional[int] = None,
                     has_docs: bool = False, training: bool = True, ring: bool = False,
                     window: bool = False) -> tuple[str, str]:
    """(concrete backend, why) for model.attention_backend `requested` ("auto" or a name) on `machine`, with
    packed documents and a sliding window when asked. An explicit backend that cannot run raises ConfigError
    saying why."""
    import torch

    tdtype = getattr(torch, dtype)

    def why_not(name: str) -> Optional[str]:
        return unsupported_reason(name, machine.device, tdtype, head_dim,
                                  AttentionNeeds(training, has_docs, ring, window), machine.packages)

    if requested != "auto":
        why = why_not(requested)
        if why is not None:
            raise ConfigError(f"model.attention_backend={requested}: attention backend {requested!r} {why}")
        return requested, "requested"
    if ring:
        for name, why in (("sdpa", "ring blocks: torch's flash kernel returns the log-sum-exp"),
                          ("flex", "ring blocks: FlexAttention returns the log-sum-exp")):
            if why_not(name) is None:
                return name, why
        return "reference", "ring blocks: no fused kernel returns the log-sum-exp for this shape here"
    if machine.cuda and why_not("flash") is None:
        return "flash", "flash-attn is installed and takes this shape and dtype"
    what = " and ".join(n for n, on in (("packed documents", has_docs), ("a sliding window", window)) if on)
    if machine.cuda and (has_docs or window) and why_not("varlen") is None:
        how = " and ".join(n for n, on in (("documents as cumulative lengths", has_docs),
                                           ("the window as its window_size", window)) if on)
        return "varlen", f"{what} in torch's varlen_attn ({how}): no (S, S) mask of any kind"
    if machine.cuda and (has_docs or window) and why_not("flex") is None:
        return "flex", f"{what}: a block-sparse mask instead of a dense (S, S) one"
    return "sdpa", "the portable default" if not machine.cuda else "flash-attn and FlexAttention do not apply here"


_LIBRARY_PACKAGES = {"liger": "liger_kernel", "apex": "apex"}


def choose_kernels(requested: str, machine: Machine) -> str:
    """model.kernels as given, where it can run: triton needs triton on CUDA (or its CPU interpreter); liger
    and apex need their package on CUDA (apex's missing ops run on our Triton kernels)."""
    if requested in _LIBRARY_PACKAGES:
        package = _LIBRARY_PACKAGES[requested]
        if not machine.has(package) or not machine.cuda:
            why = f"{package} is not installed" if not machine.has(package) else f"the device is {machine.device}"
            raise ConfigError(f"model.kernels={requested}: {requested} is unavailable: {why} ({requested} runs on "
                              f"CUDA); available: torch, triton")
    if requested in ("triton", "apex"):
        if not machine.has("triton") or not (machine.cuda or machine.triton_interpreter):
            why = ("triton is not importable" if not machine.has("triton") else
                   f"the device is {machine.device} (Triton needs CUDA, or TRITON_INTERPRET=1 set before first use)")
            raise ConfigError(f"model.kernels={requested}: impl 'triton' is unavailable: {why}; available: torch")
    return requested


def _phases(cfg: Config, sequence: SequenceLayout) -> tuple[Phase, ...]:
    d = cfg.data
    train = [Phase("train" if step == 0 else f"train from step {step + 1}", n, sequence.padded_len(n), step)
             for step, n in (d.seq_len_schedule or [[0, d.seq_len]])]
    long_eval = [Phase("long_eval", n, sequence.padded_len(n)) for n in sorted(set(cfg.long_eval.lengths))]
    return tuple(train) + (Phase("eval", d.seq_len, sequence.padded_len(d.seq_len)),) + tuple(long_eval)


def resolve(cfg: Config, machine: Machine, world_size: int, tiles: bool = True, mask_block: bool = True) -> RunPlan:
    """Every decision of a run of `cfg` on `world_size` ranks of `machine`; ConfigError names what cannot run
    there. `cfg` is assumed to have passed config.checks.validate_config at this world size. With
    tiles=False the `auto` MLP and loss tiles are left undecided, 0 in the plan's activation policy (the
    planner bounds what they can resolve to: plan/tiles.py could_fit); with mask_block=False FlexAttention's
    block-mask block is left at 128 (flex_mask_block weighs memory alone: the planner's step-time floor)."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    ulysses, ring = check_heads(m.num_heads, m.kv_heads, p.tp, p.sp, p.sp_ring, machine.ranks_per_node)
    dtype = compute_dtype(t.dtype, machine)
    has_docs = cfg.data.document_mask
    try:
        attention, reason = choose_attention(m.attention_backend, machine, dtype, m.head_size, has_docs,
                                             ring=ring > 1, window=m.sliding_window > 0)
    except ConfigError as e:
        if ring > 1:
            raise ConfigError(f"{e} (this layout runs ring attention: parallel.sp={p.sp} = ulysses {ulysses} x "
                              f"ring {ring})") from None
        raise
    if not t.recompute_attention:
        check_kept_attention(cfg, attention, ulysses, ring)
    activation = ActivationPolicy(checkpointing=t.activation_checkpointing,
                                  keep_attention=t.activation_checkpointing and not t.recompute_attention,
                                  offload=t.activation_offload, mlp_chunk_tokens=_until_auto(t.mlp_chunk_tokens),
                                  loss_chunk_tokens=_until_auto(t.loss_chunk_tokens),
                                  checkpoint_stride=t.checkpoint_stride if t.activation_checkpointing else 1,
                                  tp_sequence_parallel=p.tp_sequence_parallel)
    if t.attention_head_chunks != "auto":
        check_head_chunks(m.num_heads, m.kv_heads, p.tp, ulysses, ring, t.attention_head_chunks)
        activation = replace(activation, head_chunks=t.attention_head_chunks)
    dp = max(world_size // (p.tp * p.sp * p.pp), 1)
    degrees = Degrees(tp=p.tp, sp=p.sp, pp=p.pp, dp=dp, virtual_stages=p.virtual_stages, ring=ring)
    sequence = SequenceLayout(degrees, p.tp_sequence_parallel)
    plan = RunPlan(machine=machine, degrees=degrees, dtype=dtype, master_dtype="float32",
                   attention=attention, attention_reason=reason, attention_window=m.sliding_window,
                   kernels=choose_kernels(m.kernels, machine), collective=collective_backend(p.backend, machine),
                   phases=_phases(cfg, sequence), activation=activation,
                   micro_batch_size=t.micro_batch_size,
                   micro_batches=max(t.global_batch_size // (t.micro_batch_size * dp), 1), grad_dtype="float32",
                   optimizer=("fsdp-host" if t.param_offload else "fsdp") if p.fsdp else
                   "zero1-host" if t.optimizer_offload else "zero1",
                   weights="host" if t.param_offload else "device",
                   gradients="host" if t.param_offload or t.optimizer_offload else "device",
                   grad_overlap=p.fsdp or p.overlap_grad_reduce or t.optimizer_offload or t.param_offload)
    if tiles:
        plan = _auto_tiles(cfg, plan)
    if t.attention_head_chunks == "auto":
        plan = replace(plan, activation=replace(plan.activation, head_chunks=auto_head_chunks(cfg, plan)))
    if attention == "flex" and has_docs and mask_block:
        plan = replace(plan, activation=replace(plan.activation, mask_block=flex_mask_block(cfg, plan)))
    plan = replace(plan, activation=replace(plan.activation, loss_tile=concrete_loss_tile(cfg, plan)))
    flex = flex_for_documents(cfg, plan, world_size, tiles, mask_block)
    if flex is not None:
        return flex
    if tiles:
        asynchronous, why = choose_async_save(cfg, plan)
        plan = replace(plan, async_save=asynchronous, async_save_reason=why)
    return plan


GIB = 2**30


def choose_async_save(cfg: Config, plan: RunPlan) -> tuple[bool, str]:
    """(whether checkpoints are written in the background, why): checkpoint.async_save as given, or for `auto`
    whether one node's ranks' host memory, with the staging copy of their checkpoint state, fits the node's
    memory (the memory model's host bytes, and on a CPU run its peak too, which is host memory there): the
    copy is pinned and never swapped out. Synchronous where the node's memory is unknown (a described
    machine) or the memory model does not cover the run."""
    requested = cfg.checkpoint.async_save
    if requested is not True and requested != "auto":
        return False, "checkpoint.async_save=false"
    from megalysses.plan.memory import estimate_plan      # the memory model reads RunPlans: import late

    try:
        est = estimate_plan(cfg, replace(plan, async_save=True))
    except ValueError:
        return requested is True, "checkpoint.async_save=true" if requested is True else \
            "auto: the memory model does not cover this run"
    staging = sum(t.bytes for t in est.terms if t.host and t.name.startswith("checkpoint staging"))
    copy = f"a staging copy of {fmt_bytes(staging)} per rank"
    if requested is True:
        return True, f"checkpoint.async_save=true: {copy}"
    node = plan.machine.host_memory_gib
    if node is None:
        return False, "auto: this node's memory is not known"
    ranks = plan.machine.ranks_per_node or 1
    needed = ranks * (est.host + (0 if plan.machine.cuda else est.peak))
    if needed > node * GIB:
        return False, (f"auto: {copy} would bring the node's {ranks} rank(s) to {needed / GIB:.1f} GiB of host "
                       f"memory, over its {node:.1f} GiB")
    return True, f"auto: {copy}, {needed / GIB:.1f} GiB of the node's {node:.1f} GiB with it"


def concrete_loss_tile(cfg: Config, plan: RunPlan) -> int:
    """The LM head + loss tile the model runs: the one asked for (or `auto`'s), else the kernel's default for a
    rank's rows of the padded vocabulary."""
    vocab_local = cfg.model.padded_vocab_size(plan.degrees.tp) // plan.degrees.tp
    return plan.activation.loss_chunk_tokens or default_chunk_tokens(vocab_local)


MASK_SHARE = 0.01     # FlexAttention's block mask may take this share of the predicted peak


def flex_mask_block(cfg: Config, plan: RunPlan) -> int:
    """FlexAttention's block-mask block size with documents: the smallest of 128 x 2^k tokens (the kernel's tile
    divides it; finer blocks skip more masked work) whose block mask the memory model finds within MASK_SHARE
    of the predicted peak (its four index tensors shrink as the square of the block), at most the sequence a
    mask spans. 128 where the memory model does not cover the run."""
    from megalysses.plan.memory import estimate_plan      # the memory model reads RunPlans: import late

    span = plan.padded_seq_len // plan.degrees.ring
    block = 128
    while True:
        try:
            est = estimate_plan(cfg, replace(plan, activation=replace(plan.activation, mask_block=block)))
        except ValueError:
            return 128
        mask = sum(t.bytes for t in est.terms if t.name.startswith("FlexAttention"))
        if mask <= MASK_SHARE * est.peak or block >= span:
            return block
        block *= 2


def flex_for_documents(cfg: Config, plan: RunPlan, world_size: int, tiles: bool, mask_block: bool) -> Optional[RunPlan]:
    """model.attention_backend=auto with packed documents: FlexAttention's plan where the backward workspace a
    variable-length kernel (torch's varlen_attn, flash-attn's flash_attn_varlen_func) keeps per document is
    alone more than the device's usable memory, so that no tiles, head chunks or offload of this run can fit
    with it, and FlexAttention, whose backward keeps nothing per document, can fit (None: `plan` stands). The
    workspace is 128 fp32 rows of the dq accumulator and rowsum(dO * O) a document (data.documents_per_million;
    memory.transients.varlen_document_bytes); fitting is what the planner asks of a candidate before weighing it
    (plan/tiles.py could_fit). Neither depends on the tiles: a run resolved with tiles=False or mask_block=False
    chooses alike."""
    from megalysses.memory.transients import varlen_document_bytes     # the memory model: import late
    from megalysses.plan.memory import options_of

    if (cfg.model.attention_backend != "auto" or plan.attention not in ("varlen", "flash")
            or not cfg.data.document_mask or plan.machine.memory_gib is None):
        return None
    workspace = varlen_document_bytes(cfg.model, plan.degrees, options_of(cfg, plan), plan.micro_batch_size)
    if workspace <= _budget(plan):
        return None
    flex_cfg = replace(cfg, model=replace(cfg.model, attention_backend="flex"))
    try:
        untiled = resolve(flex_cfg, plan.machine, world_size, tiles=False)
    except ConfigError:             # FlexAttention does not run here
        return None
    if not _could_fit(flex_cfg, untiled):
        return None
    flex = untiled if not tiles and mask_block else resolve(flex_cfg, plan.machine, world_size, tiles, mask_block)
    return replace(flex, attention_reason=(
        f"packed documents: a block-sparse mask, since {plan.attention}'s variable-length backward would keep "
        f"{fmt_bytes(workspace)} for the documents alone (128 fp32 rows each, "
        f"{cfg.data.documents_per_million:g} a million tokens: data.documents_per_million), more than the device "
        f"holds; FlexAttention's keeps nothing per document"))


def _budget(plan: RunPlan) -> float:
    """The device's usable memory for `plan` as the planner's search bounds a candidate: its memory less the
    reserve, the fragmentation allowance and the layout's communicators."""
    from megalysses.plan.communicators import communicator_bytes     # they read RunPlans: import late
    from megalysses.plan.step_time import Hardware

    return Hardware().usable_bytes(plan.machine.memory_gib) - communicator_bytes(plan)


def _could_fit(cfg: Config, plan: RunPlan) -> bool:
    """Whether some tiles that `cfg`'s `auto` ones can take leave the memory model's peak of `plan` within the
    budget (plan/tiles.py could_fit, as the planner's search asks it); False where the memory model does not
    cover the run."""
    from megalysses.plan.tiles import could_fit

    try:
        return could_fit(cfg, plan, _budget(plan))
    except ValueError:
        return False


def _until_auto(tile: int | str) -> int:
    """A tile of the config, 0 where it is `auto` until _auto_tiles decides it."""
    return 0 if tile == "auto" else tile


def _auto_tiles(cfg: Config, plan: RunPlan) -> RunPlan:
    """`plan` with the config's `auto` MLP and loss tiles made concrete by the memory model (plan/tiles.py,
    imported here: it reads RunPlans)."""
    if "auto" not in (cfg.training.mlp_chunk_tokens, cfg.training.loss_chunk_tokens):
        return plan
    from megalysses.plan.tiles import auto_tiles

    return replace(plan, activation=auto_tiles(cfg, plan))


def auto_head_chunks(cfg: Config, plan: RunPlan) -> int:
    """training.attention_head_chunks=auto: the fewest chunks the layout allows with which the memory model's
    peak fits the device (its memory less the planner's reserve and fragmentation allowance), or when none fits the
    fewest with the lowest peak. 1 where the device's memory is unknown (CPU), where attention outputs are
    kept (recompute_attention=false), or where the memory model does not cover the run."""
    if plan.machine.memory_gib is None or plan.activation.keep_attention:
        return 1
    from megalysses.plan.memory import estimate_plan      # the memory model reads RunPlans: import late
    from megalysses.plan.communicators import communicator_bytes
    from megalysses.plan.step_time import Hardware

    m, hw = cfg.model, Hardware()
    peaks = []
    for n in head_chunk_counts(m.num_heads, m.kv_heads, plan.degrees.tp, plan.degrees.ulysses):
        try:
            est = estimate_plan(cfg, replace(plan, activation=replace(plan.activation, head_chunks=n)))
        except ValueError:
            return 1
        peak = est.peak
        if peak <= hw.usable_bytes(plan.machine.memory_gib, est.largest.bytes, communicator_bytes(plan)):
            return n
        peaks.append((peak, n))
    return min(peaks)[1]
