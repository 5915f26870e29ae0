"""The memory model against measurements on CPU: the bytes a forward keeps for the backward (saved-tensor
hooks, deduplicated by storage), exactly, per memory option, dtype, kernel and layout (tp, TP sequence
sharding, Ulysses, ring); and the peak of live bytes over whole training steps
(megalysses.measure.measure_peak): what a step adds at its peak to the weights, optimizer state and batch that
are there before it (its activations, gradients and buffers) within 5%.

Fails if any retained activation grows as S^2 (measured at S and 2S) or is left unsharded under sp
(a rank keeps 1/sp of one process's bytes plus the sp buffers the model names); both checks are shown
to fail on a case made for it (the reference backend's S x S probabilities, an attention that gathers
the sequence)."""
import functools
import importlib.util
import json
from dataclasses import dataclass, replace
from typing import Optional

import pytest
import torch
import torch.distributed as dist

from megalysses import comm
from megalysses.config import ModelConfig
from megalysses.config.io import load_config
from megalysses.kernels.triton_support import triton_importable
from megalysses.measure import Retained, host_resident, measure_peak, measure_retained
from megalysses.degrees import Degrees
from megalysses.memory import (PRECISIONS, Options, Workload, bytes_per_token, estimate,
                               head_weight_grad_bytes, in_flight, layer_terms, retained_activation_bytes,
                               sp_buffer_bytes_per_token, stage_params)
from megalysses.model.gpt import GPTStage, init_weights
from megalysses.model.layers import ParallelGroups
from megalysses.model.policies import activation_offload, apply_activation_policy
from megalysses.parallel.interleaved import rank_order
from megalysses.parallel.sequence_layout import SequenceLayout
from megalysses.plan import ActivationPolicy, Machine
from megalysses.plan.search import estimate_config
from megalysses.testing import run_distributed

S = 64                     # and 2S: the S^2 check
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
OPTIONS = {
    "none": {},
    "checkpointing": {"checkpointing": True},
    "checkpointing, attention kept": {"checkpointing": True, "keep_attention": True},
    "tiled MLP": {"mlp_chunk_tokens": 16},
    "loss tiles": {"loss_chunk_tokens": 16},
    "all three": {"checkpointing": True, "mlp_chunk_tokens": 16, "loss_chunk_tokens": 16},
    "head chunks": {"head_chunks": 2},
}


def small_model(layers: int = 2, backend: str = "sdpa", kv_heads: int = 2, kernels: str = "torch") -> ModelConfig:
    return ModelConfig(vocab_size=256, hidden_size=64, num_layers=layers, num_heads=4, num_kv_heads=kv_heads,
                       ffn_hidden_size=160, attention_backend=backend, kernels=kernels)


def measure_forward(cfg: ModelConfig, seq: int, opts: dict, groups: Optional[ParallelGroups] = None, tp_rank: int = 0,
             sp_rank: int = 0, dtype: torch.dtype = torch.float32) -> Retained:
    """One forward of a whole-model stage on this rank's shard of a length-`seq` sequence (its zigzag
    positions with a ring): the Retained measurement (bytes, storages). With activation offload the host
    copies (CPU tensors here) are left out of `bytes`."""
    groups = groups or ParallelGroups()
    torch.manual_seed(0)
    model = apply_activation_policy(GPTStage(cfg, groups), ActivationPolicy(**opts))     # the memory model's names
    init_weights(model, 0, tp_rank, groups.tp_size)
    model.to(dtype)
    ids = torch.randint(0, cfg.vocab_size, (1, seq))
    layout = SequenceLayout(Degrees(sp=groups.sp_size, ring=comm.group_size(groups.ring)))
    chunk = torch.from_numpy(layout.positions(seq, sp_rank))
    pos = chunk[None]
    ids_local = ids[:, chunk].contiguous()
    _, retained = measure_retained(lambda: model(ids_local, pos, labels=ids_local),
                                   exclude=tuple(model.parameters()) + (pos, ids_local))
    if activation_offload(model) is not None:
        host = sum(t.numel() * t.element_size() for t in activation_offload(model).host_buffers())
        retained = replace(retained, bytes=retained.bytes - host)
    return retained


@functools.lru_cache(maxsize=None)
def _single(name: str, seq: int, layers: int = 2, backend: str = "sdpa", dtype: str = "fp32", kv_heads: int = 2):
    """One process, cached: several tests look at the same measurement."""
    return measure_forward(small_model(layers, backend, kv_heads), seq, OPTIONS[name], dtype=DTYPES[dtype])


def _options(cfg: ModelConfig, opts: dict, sequence_parallel: bool = False) -> Options:
    """The model's view of a CPU run: SDPA expands grouped KV heads there."""
    return Options(attention=cfg.attention_backend, native_gqa=False, tp_sequence_parallel=sequence_parallel,
                   kernels=cfg.kernels, **opts)


def _predicted(cfg: ModelConfig, seq: int, opts: dict, tp: int = 1, sp: int = 1, sequence_parallel: bool = False,
               dtype: str = "fp32", ring: int = 1) -> float:
    return retained_activation_bytes(cfg, Degrees(tp=tp, sp=sp, ring=ring), _options(cfg, opts, sequence_parallel),
                                     PRECISIONS[dtype], seq)


def grows_quadratically(small, large, factor: float = 2.0) -> bool:
    """True when what is retained grows faster than the sequence from `small` (S) to `large` (factor*S):
    the total, or the largest storage (an S^2 tensor grows factor^2). A smaller S^2 term also breaks the
    agreement with the model (which is linear in S) at one of the two lengths."""
    return large.bytes > 1.1 * factor * small.bytes or large.storages[0][0] > 1.1 * factor * small.storages[0][0]


def _close(measured: float, predicted: float, what: str, tolerance: float = 0.10) -> None:
    assert abs(predicted - measured) <= tolerance * measured, \
        f"{what}: model {predicted:.0f} B vs measured {measured:.0f} B ({predicted / measured - 1:+.1%})"


def _close_step(peak: "StepPeak", what: str) -> None:
    """A training step's peak: what it adds to what is there before it (weights, optimizer state, the batch),
    its activations, gradients and buffers, the model's within 5% of the measured; the totals agree as well."""
    _close(peak.measured_before, peak.predicted_before, f"{what}: what is there before the step", 0.01)
    _close(peak.measured_step, peak.predicted_step, f"{what}: what the step adds at its peak", 0.05)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", list(OPTIONS))
def test_single_rank_options_match_the_model_exactly_and_stay_linear(name, dtype):
    opts, cfg = OPTIONS[name], small_model()
    small, large = _single(name, S, dtype=dtype), _single(name, 2 * S, dtype=dtype)
    assert small.bytes == _predicted(cfg, S, opts, dtype=dtype), (name, dtype, small.storages)
    assert large.bytes == _predicted(cfg, 2 * S, opts, dtype=dtype), (name, dtype, large.storages)
    assert not grows_quadratically(small, large), f"{name}: {small.storages[:3]} -> {large.storages[:3]}"
    # per layer: the difference a third layer makes, per token, against the model's layer terms
    per_layer = (_single(name, S, layers=3, dtype=dtype).bytes - small.bytes) / S
    assert per_layer == bytes_per_token(layer_terms(cfg, Degrees(), _options(cfg, opts), PRECISIONS[dtype], S))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_multi_head_attention_keeps_the_qkv_output_through_v(dtype):
    """With as many KV heads as query heads nothing repeats k and v: v is a view of the QKV output and
    keeps all of it (torch kernels), as the model says."""
    cfg = small_model(kv_heads=4)
    for name in ("none", "tiled MLP"):
        kept = _single(name, S, dtype=dtype, kv_heads=4)
        assert kept.bytes == _predicted(cfg, S, OPTIONS[name], dtype=dtype), (name, kept.storages)


QWEN = {"add_qkv_bias": True, "qk_layernorm": True, "head_dim": 12}     # heads of 12 at hidden 64


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_qwen_settings_keep_what_the_model_says(dtype):
    """q/k head norms (their input keeps the whole QKV output, a view of it), q/k/v-only biases and an attention
    width other than hidden: exactly the model's bytes."""
    cfg = replace(small_model(), **QWEN)
    for name in ("none", "head chunks"):
        kept = measure_forward(cfg, S, OPTIONS[name], dtype=DTYPES[dtype])
        assert kept.bytes == _predicted(cfg, S, OPTIONS[name], dtype=dtype), (name, dtype, kept.storages)


@pytest.mark.parametrize("extra", [{}, {"attention_bias": True, "mlp_bias": True}, QWEN,
                                   {"attention_bias": True, "mlp_bias": True, "norm": "layernorm", "mlp": "gelu"},
                                   {"tie_embeddings": True, "mlp_bias": True}])
@pytest.mark.parametrize("tp", [1, 2])
def test_parameter_count_is_the_models(extra, tp):
    """Per tp rank: a parameter split over tp (it has a tp_dim) counts 1/tp, a replicated one whole."""
    m = ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=96,
                    **extra)
    per_rank = sum(p.numel() // (1 if getattr(p, "tp_dim", None) is None else tp) for p in GPTStage(m).parameters())
    assert sum(stage_params(m, Degrees(tp=tp), True, True)) == per_rank


def test_options_shrink_what_is_kept():
    kept = {name: _single(name, S).bytes for name in OPTIONS}
    assert kept["checkpointing"] < kept["tiled MLP"] < kept["none"]
    assert kept["loss tiles"] == kept["none"]          # the loss keeps its gradients, whatever its tile
    assert kept["all three"] == kept["checkpointing"] == min(kept.values())
    assert _single("none", S, dtype="bf16").bytes < kept["none"]


def test_quadratic_detector_flags_the_reference_backend():
    """The check above can fail: the reference backend keeps S x S probabilities, and the model knows it."""
    small, large = _single("none", S, backend="reference"), _single("none", 2 * S, backend="reference")
    assert grows_quadratically(small, large)
    assert large.bytes == _predicted(small_model(backend="reference"), 2 * S, {})


@pytest.mark.skipif(not triton_importable(), reason="triton is not installed")
def test_triton_kernels_keep_what_the_model_says(monkeypatch):
    """model.kernels=triton through Triton's CPU interpreter: the fused norms keep their input and 1/rms,
    RoPE the stage's cos/sin, SwiGLU its input only."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from megalysses.testing import triton_interpreter_runs_our_kernels
    if not triton_interpreter_runs_our_kernels():
        pytest.skip("this Triton's CPU interpreter cannot run loops bounded by the program id with this numpy "
                    "(Triton 3.6 and older with numpy 2.4: pip install 'numpy<2.4')")
    cfg = replace(small_model(layers=1), kernels="triton")
    for name in ("none", "checkpointing"):
        kept = measure_forward(cfg, 32, OPTIONS[name])
        assert kept.bytes == _predicted(cfg, 32, OPTIONS[name]), (name, kept.storages)
    assert kept.bytes < measure_forward(replace(cfg, kernels="torch"), 32, {}).bytes
    qwen = replace(cfg, **QWEN)                 # the fused head norms keep a copy of q and k, and their 1/rms
    assert measure_forward(qwen, 32, {}).bytes == _predicted(qwen, 32, {})


LAYOUTS = {   # name: (tp, sp, ring, TP sequence sharding, memory options), on 2 ranks
    "tp2": (2, 1, 1, False, "none"),
    "tp2 sequence-parallel": (2, 1, 1, True, "none"),
    "tp2 sequence-parallel, checkpointing + tiles": (2, 1, 1, True, "all three"),
    "sp2": (1, 2, 1, False, "none"),
    "sp2, tiled MLP": (1, 2, 1, False, "tiled MLP"),
    "sp2, checkpointing + tiles": (1, 2, 1, False, "all three"),
    "sp2, one KV head (replicated to each sp rank)": (1, 2, 1, False, "none"),
    "sp2 as a ring of 2": (1, 2, 2, False, "none"),
    "sp2 as a ring of 2, tiled MLP": (1, 2, 2, False, "tiled MLP"),
    "sp2 as a ring of 2, multi-head attention": (1, 2, 2, False, "none"),
    "sp2, head chunks (each chunk's KV head replicated)": (1, 2, 1, False, "head chunks"),
    "sp2 as a ring of 2, head chunks": (1, 2, 2, False, "head chunks"),
    "tp2 sequence-parallel, multi-head attention, head chunks": (2, 1, 1, True, "head chunks"),
}
UNSHARDED = "sp2 with an attention that gathers the whole sequence"


def _layout_cfg(name: str) -> ModelConfig:
    return small_model(kv_heads=1 if "one KV head" in name else 4 if "multi-head" in name else 2)


def unsharded_under_sp(kept: float, single: float, cfg: ModelConfig, seq: int, opts: dict, sp: int,
                       ring: int = 1) -> bool:
    """True when a rank of sp keeps more than 1/sp of what one process keeps at the same length, beyond
    the buffers sequence parallelism adds per S/sp token (memory.sp_buffer_bytes_per_token: the all-to-all
    buffers, the ring's copy of k and v) and 1%: something the rank keeps is not split over sp. The LM
    head's weight gradient is a weight's, the same at any sp, so it comes off both."""
    head = head_weight_grad_bytes(cfg, Degrees(), PRECISIONS["fp32"])
    layout = Degrees(sp=sp, ring=ring)
    per_token = sp_buffer_bytes_per_token(cfg, layout, _options(cfg, opts), PRECISIONS["fp32"])
    buffers = seq / sp * cfg.num_layers * per_token
    return kept - head - buffers > 1.01 * (single - head) / sp


def _gathering_attention(q, k, v, group, attn):
    """The mistake the shard check is for: q, k and v all-gathered to the whole sequence on every rank (and
    kept for the backward), full attention, this rank's rows kept."""
    s = q.shape[1]
    full = [comm.all_gather_from_tp(t, group, dim=1) for t in (q, k, v)]
    out = attn(*full)
    rank = comm.group_rank(group)
    return out[:, rank * s:(rank + 1) * s]


def _measure_layouts(rank: int, world: int) -> dict:
    from megalysses.model import layers

    group = dist.new_group([0, 1])
    out = {}
    for name, (tp, sp, ring, seq_par, option) in LAYOUTS.items():
        groups = ParallelGroups(tp=group if tp > 1 else None, ulysses=group if sp > ring else None,
                                ring=group if ring > 1 else None, sequence_parallel=seq_par)
        out[name] = [measure_forward(_layout_cfg(name), n, OPTIONS[option], groups, tp_rank=rank if tp > 1 else 0,
                              sp_rank=rank if sp > 1 else 0) for n in (S, 2 * S)]
    original = layers.ulysses_attention
    layers.ulysses_attention = _gathering_attention
    try:
        out[UNSHARDED] = measure_forward(_layout_cfg("sp2"), S, {}, ParallelGroups(ulysses=group), sp_rank=rank)
    finally:
        layers.ulysses_attention = original
    out["peak"] = _step_peaks(rank, world)
    return out


def test_layouts_match_the_model_and_shard_over_sp(tmp_path):
    ranks = run_distributed(_measure_layouts, 2, tmp_dir=tmp_path)
    for name, (tp, sp, ring, seq_par, option) in LAYOUTS.items():
        opts, cfg = OPTIONS[option], _layout_cfg(name)
        for rank, measured in enumerate(ranks):
            small, large = measured[name]
            assert small.bytes == _predicted(cfg, S, opts, tp, sp, seq_par, ring=ring), (name, rank, small.storages)
            assert large.bytes == _predicted(cfg, 2 * S, opts, tp, sp, seq_par, ring=ring), (name, rank, large.storages)
            assert not grows_quadratically(small, large), f"{name}: {small.storages[:3]} -> {large.storages[:3]}"
        if sp > 1:
            single = _single(option, S, kv_heads=cfg.num_kv_heads).bytes
            for rank, measured in enumerate(ranks):
                assert not unsharded_under_sp(measured[name][0].bytes, single, cfg, S, opts, sp, ring), \
                    (name, rank, measured[name][0].storages[:4], single)
    # the shard check can fail: an attention that keeps the whole sequence's q, k, v on every rank
    cfg = _layout_cfg("sp2")
    single = _single("none", S).bytes
    for rank, measured in enumerate(ranks):
        assert unsharded_under_sp(measured[UNSHARDED].bytes, single, cfg, S, {}, 2), \
            (rank, measured[UNSHARDED].storages[:4])
    for rank, measured in enumerate(ranks):
        for name, peak in measured["peak"].items():
            _close_step(peak, f"{name}, rank {rank}")
    for name in ("multi-head attention", "8 query heads"):     # shapes whose peak is ring attention's backward
        (overrides,) = [o for n, o in LAYOUT_PEAKS.items() if name in n]
        terms = [t.name for t in estimate_config(load_config(overrides=STEP + overrides), 2, CPU).terms]
        assert any("ring attention's backward" in t for t in terms), (name, terms)


def test_in_flight_matches_the_schedules():
    """1F1B: stage p holds P - p micro-batches; interleaved: Megatron's warm-up + 1 chunks (per rank_order)."""
    for P, v, M in [(2, 1, 4), (4, 1, 8), (4, 1, 2), (2, 2, 4), (4, 2, 8), (2, 4, 2)]:
        for stage in range(P):
            if v == 1:
                expect = min(P - stage, M)
            else:
                depth, peak = 0, 0
                for a in rank_order(P, v, M, stage):
                    depth += 1 if a.kind == "F" else -1
                    peak = max(peak, depth)
                expect = peak / v
            assert in_flight(Degrees(pp=P, virtual_stages=v), stage, M) == expect, (P, v, M, stage)


# ----------------------------------------------------------------------------- the peak of a training step

CPU = Machine.described(None, ranks_per_node=0)      # what a test run on CPU resolves on

STEP = ["data.mock=true", "model.vocab_size=256", "model.hidden_size=64", "model.num_layers=2", "model.num_heads=4",
        "model.num_kv_heads=2", "model.ffn_hidden_size=160", "model.attention_backend=sdpa", "data.document_mask=false",
        "training.micro_batch_size=1", "parallel.grad_bucket_elements=100000", "data.seq_len=1024"]
PEAKS = {   # name: overrides (one rank); each is the peak of a second step, the first having made the state
    "fp32": ["training.dtype=float32", "training.global_batch_size=1"],
    "bf16, checkpointing": ["training.dtype=bfloat16", "training.global_batch_size=1",
                            "training.activation_checkpointing=true"],
    "bf16, checkpointing, tiles, 2 micro-batches": ["training.dtype=bfloat16", "training.global_batch_size=2",
                                                    "training.activation_checkpointing=true",
                                                    "training.mlp_chunk_tokens=64", "training.loss_chunk_tokens=64"],
    "bf16, checkpointing, attention kept, tiled MLP": [
        "training.dtype=bfloat16", "training.global_batch_size=1", "training.activation_checkpointing=true",
        "training.recompute_attention=false", "training.mlp_chunk_tokens=256"],
    "bf16, tiled MLP, 4 layers": ["training.dtype=bfloat16", "training.global_batch_size=1", "model.num_layers=4",
                                  "training.mlp_chunk_tokens=128"],
    # tiles resolved from the memory model (plan/tiles.py; on CPU, with no device memory to fill)
    "bf16, checkpointing, auto tiles": ["training.dtype=bfloat16", "training.global_batch_size=1",
                                        "training.activation_checkpointing=true", "training.mlp_chunk_tokens=auto",
                                        "training.loss_chunk_tokens=auto"],
    "bf16, checkpointing, optimizer offload (gradients streamed), 2 micro-batches": [
        "training.dtype=bfloat16", "training.global_batch_size=2", "training.activation_checkpointing=true",
        "training.optimizer_offload=true", "model.num_layers=4"],
}
LAYOUT_PEAKS = {   # name: overrides on 2 ranks
    "sp2, bf16, checkpointing": ["parallel.sp=2", "training.dtype=bfloat16", "training.global_batch_size=1",
                                 "training.activation_checkpointing=true"],
    # attention-heavy shapes (small MLP and loss tiles): ring attention's backward is the peak
    "sp2 as a ring of 2, multi-head attention, bf16, checkpointing": [
        "parallel.sp=2", "parallel.sp_ring=2", "training.dtype=bfloat16", "training.global_batch_size=1",
        "training.activation_checkpointing=true", "model.num_kv_heads=4", "model.ffn_hidden_size=32",
        "training.loss_chunk_tokens=64"],
    "sp2 as a ring of 2, 8 query heads of 16 on 2 KV heads, fp32, checkpointing": [
        "parallel.sp=2", "parallel.sp_ring=2", "training.dtype=float32", "training.global_batch_size=1",
        "training.activation_checkpointing=true", "model.num_heads=8", "model.num_kv_heads=2", "model.head_dim=16",
        "model.ffn_hidden_size=32", "training.loss_chunk_tokens=64"],
    "tp2 sequence-parallel, fp32": ["parallel.tp=2", "parallel.tp_sequence_parallel=true",
                                    "training.dtype=float32", "training.global_batch_size=1"],
    "sp2 as a ring of 2, 4 KV heads, bf16, checkpointing, 2 head chunks": [
        "parallel.sp=2", "parallel.sp_ring=2", "training.dtype=bfloat16", "training.global_batch_size=1",
        "training.activation_checkpointing=true", "model.num_kv_heads=4", "model.ffn_hidden_size=32",
        "training.loss_chunk_tokens=64", "training.attention_head_chunks=2"],
    "tp2 sequence-parallel, 8 heads on 4 KV heads, fp32, 2 head chunks": [
        "parallel.tp=2", "parallel.tp_sequence_parallel=true", "training.dtype=float32", "training.global_batch_size=1",
        "model.num_heads=8", "model.num_kv_heads=4", "model.ffn_hidden_size=32", "training.loss_chunk_tokens=64",
        "training.attention_head_chunks=2"],
}


@dataclass
class StepPeak:
    """A training step's peak on this rank, measured and predicted, and of each the part the step adds to what
    is there before it (weights, optimizer state, the step's batch): its activations, gradients and buffers."""

    measured: int
    predicted: float
    measured_before: int
    predicted_before: float

    @property
    def measured_step(self) -> int:
        return self.measured - self.measured_before

    @property
    def predicted_step(self) -> float:
        return self.predicted - self.predicted_before


# the model's terms for what is there before a step: weights, optimizer state, the step's batch
BEFORE = ("weights", "master + moments", "sharded parameters", "sharded moments", "the step's batch",
          "compute-dtype parameter")


def measured_step_peak(overrides: list[str], world: int = 1, exclude_host: bool = False) -> StepPeak:
    """The measured peak of live bytes over one training step and the model's prediction, on this rank;
    `exclude_host`: leave out the activation offload's host copies (CPU tensors here). What an offloaded
    optimizer keeps in host memory is left out too (masters, moments, host gradients; with parameter offload
    FSDP's shards and their gradients), and so is its update, which runs on the host."""
    from megalysses.training.build import build_run
    from megalysses.testing import plan_and_grid
    from megalysses.training.step import train_step

    cfg = load_config(overrides=STEP + overrides)
    device = torch.device("cpu")
    p = cfg.parallel
    runtime, grid = plan_and_grid(cfg, device)
    built = build_run(cfg, runtime, grid, device)
    model, opt = built.model, built.opt
    g = torch.Generator().manual_seed(0)
    S_ = cfg.data.seq_len
    local = torch.from_numpy(grid.sequence_layout(p.tp_sequence_parallel).positions(S_, grid.sp_rank))

    def batch() -> list[dict]:
        out = []
        for _ in range(cfg.training.global_batch_size // grid.dp_size):
            tokens = torch.randint(0, cfg.model.vocab_size, (1, S_ + 1), generator=g)
            out.append({"input_ids": tokens[:, :-1][:, local].contiguous(),
                        "labels": tokens[:, 1:][:, local].contiguous(),
                        "position_ids": local[None].clone()})      # each micro-batch's own, as the loader's
        return out

    def step(mbs):
        return train_step(model, opt, mbs, grid, lr=1e-3, grad_clip=1.0, dtype=runtime.torch_dtype)

    step(batch())
    mbs = batch()

    def as_local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    shards = list(model.parameters())      # FSDP: the sharded parameters (a forward swaps in gathered ones)
    state = [as_local(t) for st in opt.optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    masters = [s_.master for s_ in opt.slots if s_.master is not None] if hasattr(opt, "slots") else []
    held = runtime.optimizer in ("zero1-host", "fsdp-host")       # the optimizer in host memory
    resident = host_resident(model, opt, runtime, activations=exclude_host)

    def offloaded() -> list[torch.Tensor]:   # parameter offload: FSDP's shards and their gradients
        if runtime.weights != "host":
            return resident()
        return resident() + [as_local(q) for q in shards] + [as_local(q.grad) for q in shards if q.grad is not None]

    before = ([] if runtime.weights == "host" else [as_local(q) for q in shards]) + ([] if held else state + masters) \
        + [t for mb in mbs for t in mb.values()]
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in before}
    _, peak = measure_peak(lambda: step(mbs), before, host=offloaded)
    est = estimate_config(cfg, world, CPU)
    return StepPeak(peak.bytes, est.peak, sum(storages.values()),
                    sum(t.bytes for t in est.terms if not t.host and t.name.startswith(BEFORE)))


def _step_peaks(rank: int, world: int) -> dict:
    return {name: measured_step_peak(overrides, world) for name, overrides in LAYOUT_PEAKS.items()}


@pytest.mark.parametrize("name", list(PEAKS))
def test_training_step_peaks_match_the_model(name):
    """Weights, gradients, optimizer state, the loss's and every layer's activations and the worst moment of
    a layer's backward: what the step adds to the weights and optimizer state at its peak, the model's within
    5% of the measured, in one process (no process group)."""
    _close_step(measured_step_peak(PEAKS[name]), name)


HEAD_CHUNKS = {   # name: overrides (one rank), run with training.attention_head_chunks 1 and 4
    # the peak is the MLP norm's backward, then the final norm's: what the layers keep shrinks
    "fp32, 8 query heads on 4 KV heads": ["training.dtype=float32", "training.global_batch_size=1",
                                          "model.num_heads=8", "model.num_kv_heads=4", "model.ffn_hidden_size=32",
                                          "training.loss_chunk_tokens=64"],
    # the peak is the recomputed attention's backward, then a chunk's (its QKV input gradients summed)
    "fp32, LayerNorm, 16 query heads on 8 KV heads, checkpointing": [
        "training.dtype=float32", "training.global_batch_size=1", "model.hidden_size=128", "model.num_heads=16",
        "model.num_kv_heads=8", "model.ffn_hidden_size=32", "model.norm=layernorm", "model.mlp=gelu",
        "training.loss_chunk_tokens=64", "training.activation_checkpointing=true"],
}


@pytest.mark.parametrize("name", list(HEAD_CHUNKS))
def test_head_chunks_lower_the_peak_as_predicted(name):
    """Attention in 4 head chunks against all heads at once: what each step adds at its peak is the model's
    within 5%, and the measured drop, a sizeable share of the peak, is the predicted drop within 10%. (With
    checkpointing, 2 chunks too: there the peak is one chunk's attention backward.)"""
    counts = (1, 2, 4) if "checkpointing" in name else (1, 4)
    peaks = {n: measured_step_peak(HEAD_CHUNKS[name] + [f"training.attention_head_chunks={n}"]) for n in counts}
    for n, peak in peaks.items():
        _close_step(peak, f"{name}, {n} head chunks")
    one, four = peaks[1], peaks[4]
    assert one.measured - four.measured > 0.15 * one.measured, (name, one, four)
    _close(one.measured - four.measured, one.predicted - four.predicted,
           f"{name}: what 4 head chunks take off the peak")
    if 2 in peaks:
        terms = [t.name for t in estimate_config(load_config(overrides=STEP + HEAD_CHUNKS[name] + [
            "training.attention_head_chunks=2"]), 1, CPU).terms]
        assert any("one of 2 head chunks" in t for t in terms), terms


@pytest.mark.parametrize("tile_rows", [512, 256])
def test_norm_tiles_at_the_peak_of_a_training_step(monkeypatch, tile_rows):
    """The torch norms in tiles of `tile_rows` of the 1024 tokens (kernels/norms.py; 2^24 elements by default),
    with a small MLP (untiled: MLP tiles run their norm inside each tile) and loss tiles: the MLP norm's
    backward, with one norm tile's temporaries, is the worst moment of the step, and what the step adds at its
    peak is the model's within 5%."""
    from megalysses.kernels import norms

    monkeypatch.setattr(norms, "NORM_TILE_ELEMENTS", tile_rows * 64)
    overrides = ["training.dtype=bfloat16", "training.global_batch_size=1", "training.activation_checkpointing=true",
                 "model.ffn_hidden_size=32", "training.loss_chunk_tokens=64"]
    est = estimate_config(load_config(overrides=STEP + overrides), 1, CPU)
    assert est.part == "backward" and any(t.name.endswith("MLP norm: its backward's temporaries") for t in est.terms)
    _close_step(measured_step_peak(overrides), f"norm tiles of {tile_rows} rows")


def test_estimate_breakdown_adds_up_and_offload_moves_activations_to_host():
    cfg = load_config("configs/llama3_8b_128k.yaml", ["data.mock=true", "data.paths=[]"])
    est = estimate_config(cfg, 32, Machine.described("H100", packages=("flash_attn", "triton")))
    assert abs(sum(t.bytes for t in est.terms if not t.host) - est.peak) < 1.0
    m, layout, bf16 = cfg.model, Degrees(sp=8, dp=4), PRECISIONS["bf16"]
    base = Options(checkpointing=True, loss_chunk_tokens=8192)
    kept = {S_: {t.name: t.bytes for t in estimate(m, layout, base, bf16, Workload(S_)).terms}
            for S_ in (2 ** 17, 2 ** 18)}
    assert kept[2 ** 18]["layer activations"] == 2 * kept[2 ** 17]["layer activations"]
    assert kept[2 ** 18]["weights"] == kept[2 ** 17]["weights"]
    S_ = 2 ** 20     # 128K tokens per rank: the block inputs outweigh the 8B model's gradients
    on_device = estimate(m, layout, base, bf16, Workload(S_))
    offloaded = estimate(m, layout, replace(base, offload=True), bf16, Workload(S_))
    block_input = S_ / 8 * m.hidden_size * 2
    assert on_device.part == offloaded.part == "backward"
    # the block inputs leave the device; the backward's last layer still holds every bf16 gradient
    n = sum(stage_params(m, layout, True, True))
    assert on_device.peak - offloaded.peak >= (m.num_layers - 2) * block_input - 2 * n
    assert {t.name: t.bytes for t in offloaded.terms if t.host}["offloaded block inputs"] == m.num_layers * block_input
    states = estimate(m, layout, replace(base, optimizer_offload=True), bf16, Workload(S_))
    # host: masters, moments, reduced gradients, sqrt(v), all fp32 and sharded over the 32 grad ranks; the
    # masters and reduced gradients pinned, a request per parameter of the largest rank's chunk (ceil(rows / 32))
    from megalysses.memory.states import shard_elements
    from megalysses.pinned_arena import aligned

    chunks = sum(count * aligned(4 * e) for e, count in shard_elements(m, layout, True, True))
    assert {t.name: t.bytes for t in states.terms if t.host} == {
        "fp32 masters": chunks, "reduced fp32 gradients": chunks, "AdamW moments (ZeRO-1)": n * 8 / 32,
        "AdamW sqrt(v)": n * 4 / 32}
    assert states.peak < on_device.peak and states.host == pytest.approx(n * (12 + 4 + 4) / 32, rel=1e-4)


def test_bench_memory_smoke(tmp_path):
    """benchmarks/bench_memory.py --smoke: the GPU benchmark's harness end to end on CPU."""
    spec = importlib.util.spec_from_file_location("bench_memory", "benchmarks/bench_memory.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "memory_cpu.json"
    assert bench.main(["--smoke", "--out-dir", str(tmp_path)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["seq_len"] for r in rows] == [256, 1024]
    for r in rows:     # the smoke shape offloads its activations (configs/gpt_1b_1m_offload.yaml)
        assert abs(r["error"]) <= 0.10 and r["loss"] > 0 and r["activation_offload"] and r["host_gib"] > 0, r
    # one step (for lengths whose step takes minutes), after creating the optimizer state as a resume does
    assert bench.main(["--smoke", "--steps", "1", "--out-dir", str(tmp_path)]) == 0
    for one, two in zip(json.loads(out.read_text())["rows"], rows):
        assert one["steps"] == 1 and two["steps"] == 2 and abs(one["error"]) <= 0.10, one


def test_bench_memory_runs_add_up(tmp_path):
    """Lengths run as separate commands into one file make one record, and the targets are over all of them;
    a run of another config (here: other overrides) starts its own."""
    spec = importlib.util.spec_from_file_location("bench_memory", "benchmarks/bench_memory.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "memory_cpu.json"
    assert bench.main(["--smoke", "--lengths", "256", "--out-dir", str(tmp_path)]) == 0
    assert bench.main(["--smoke", "--lengths", "384", "--steps", "1", "--out-dir", str(tmp_path)]) == 0
    result = json.loads(out.read_text())
    assert [(r["seq_len"], r["steps"]) for r in result["rows"]] == [(256, 2), (384, 1)]
    assert result["targets"]["longest_trained"] == 384
    assert bench.main(["--smoke", "--lengths", "256", "--set", "training.mlp_chunk_tokens=64",
                       "--out-dir", str(tmp_path)]) == 0
    assert [r["seq_len"] for r in json.loads(out.read_text())["rows"]] == [256]


def test_bench_memory_time_budget(tmp_path):
    """benchmarks/bench_memory.py --time-budget: lengths past the budget are rows saying so, the JSON is still
    written, and a length still running when the budget ends is stopped and is a row, not a crash."""
    spec = importlib.util.spec_from_file_location("bench_memory", "benchmarks/bench_memory.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "memory_cpu.json"
    assert bench.main(["--smoke", "--time-budget", "1e-9", "--out-dir", str(tmp_path)]) == 0
    result = json.loads(out.read_text())
    assert [(r["seq_len"], r["error_text"]) for r in result["rows"]] == [
        (256, "not run: the time budget ended"), (1024, "not run: the time budget ended")]
    assert result["targets"]["longest_trained"] == 0
    assert bench.in_subprocess("configs/gpt_1b_1m_offload.yaml", [], 256, steps=1, timeout=0.01) == {
        "seq_len": 256, "error_text": "did not finish within the time budget"}
    assert bench.main(["--smoke", "--time-budget", "-1", "--out-dir", str(tmp_path)]) == 1
