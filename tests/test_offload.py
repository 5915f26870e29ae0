"""Activation offload (training.activation_offload): the checkpointed block inputs wait in host memory
between the forward and the backward (megalysses/parallel/offload.py).

On CPU the host copy is a separate CPU tensor: the losses and every gradient of a training step must be
exactly those without offload, at every layout, pipeline schedule and memory option, and what the
forward leaves on the "device" must drop to what the memory model says; with training.checkpoint_stride
only every k-th block input is kept (or offloaded), for the same gradients. The GPU tier (tests/test_gpu.py)
checks the side streams: the copies overlap compute and the device memory drops."""
import functools

import pytest
import torch

from megalysses.config import ConfigError
from megalysses.config.io import load_config
from megalysses.degrees import Degrees
from megalysses.grid import ParallelGrid
from megalysses.measure import measure_retained
from megalysses.memory import PRECISIONS, Options, retained_activation_bytes
from megalysses.model.gpt import GPTStage, init_weights
from megalysses.model.layers import ParallelGroups
from megalysses.model.policies import activation_offload, apply_activation_policy
from megalysses.testing import run_distributed
from megalysses.testing import plan_and_grid
from megalysses.plan import ActivationPolicy
from tests.test_memory_model import measure_forward, measured_step_peak, small_model
from tests.fixtures import PARITY

BASE = PARITY + ["training.train_steps=2", "training.activation_checkpointing=true",
                 "parallel.grad_bucket_elements=5000", "parallel.timeout_seconds=60", "data.document_mask=true"]
LAYOUTS = {   # name: overrides on 4 ranks
    "tp2 sp2, TP sequence sharding, tiled MLP and loss": [
        "parallel.tp=2", "parallel.sp=2", "parallel.tp_sequence_parallel=true", "training.mlp_chunk_tokens=4",
        "training.loss_chunk_tokens=4"],
    "pp2 dp2, 1F1B (2 micro-batches each)": ["parallel.pp=2"],
    "pp2 dp2, interleaved (2 chunks per rank), bf16, tied embeddings": [
        "parallel.pp=2", "parallel.virtual_stages=2", "training.dtype=bfloat16", "model.tie_embeddings=true"],
    "sp2 as a ring of 2, dp2, FSDP, tiled MLP": ["parallel.sp=2", "parallel.sp_ring=2", "parallel.fsdp=true",
                                                 "training.mlp_chunk_tokens=8"],
    "sp4 = ulysses 2 x ring 2": ["parallel.sp=4", "parallel.sp_ring=2"],
    "pp2 dp2, 1F1B, every 2nd block input kept (a group of 2 blocks a stage)": [
        "parallel.pp=2", "training.checkpoint_stride=2"],
}


def one_step(overrides: list[str], world: int) -> dict:
    """Build the model and optimizer of a run, take one training step and return its loss, the reduced
    gradients (this rank's fp32 shards, before the update) and the offloaders' statistics."""
    from megalysses.training.build import build_run
    from megalysses.training.data import TrainingData
    from megalysses.training.step import train_step

    cfg = load_config(overrides=BASE + overrides)
    device = torch.device("cpu")
    p = cfg.parallel
    runtime, grid = plan_and_grid(cfg, device)
    built = build_run(cfg, runtime, grid, device)
    model, opt = built.model, built.opt
    got = {}

    def capture(max_norm: float, ok=None, guard=True) -> torch.Tensor:        # the optimizer's step, up to the update
        if p.fsdp:
            got["grads"] = {n: q.grad.to_local().clone() for n, q in model.named_parameters()}
        else:
            opt.reduce_gradients()
            got["grads"] = {s.name: s.master.grad.clone() for s in opt.slots if s.master is not None}
        norm = opt.grad_norm()
        opt.zero_grad()
        return norm

    opt.step = capture
    batches = next(TrainingData(cfg, grid, runtime, device).train_batches(0))
    result = train_step(model, opt, batches, grid, lr=1e-3, grad_clip=1.0, dtype=runtime.torch_dtype)
    chunks = model.chunks if hasattr(model, "chunks") else [model]
    offloads = [o for o in map(activation_offload, chunks) if o]
    got.update(loss=result.loss, norm=result.grad_norm, stats=[o.stats for o in offloads])
    got["pinned"] = [(o.pinned.capacity, o.pinned.high_water) for o in offloads]
    return got


def _check_arena(name: str, offloaded: dict) -> None:
    """Each chunk's pinned arena, sized from the memory model's count of its block inputs in flight over the
    rank's schedule, is what the step took of it, to the byte (empty where a chunk offloads nothing)."""
    moved = [s.offloaded_bytes for s in offloaded["stats"]]
    arenas = offloaded["pinned"]
    assert len(arenas) == len(moved) and all(cap == high for cap, high in arenas), (name, arenas, moved)
    assert [cap > 0 for cap, _ in arenas] == [n > 0 for n in moved], (name, arenas, moved)


def _parity_worker(rank: int, world: int) -> dict:
    out = {name: (one_step(overrides, world), one_step(overrides + ["training.activation_offload=true"], world))
           for name, overrides in LAYOUTS.items()}
    out[RING_RETAINED] = _ring_retained(world)
    return out


RING_RETAINED = "what a forward keeps at ulysses 2 x ring 2"
RING_OPTIONS = {"none": {}, "checkpointing": {"checkpointing": True},
                "offload": {"checkpointing": True, "offload": True}}


def _ring_retained(world: int) -> dict:
    """This rank's retained bytes (host copies left out) at sp4 = ulysses 2 x ring 2, with and without
    checkpointing and offload: the memory model's ring layouts on the full hybrid."""
    grid = ParallelGrid(Degrees.of_world(world, sp=4, ring=2))
    groups = ParallelGroups(ulysses=grid.ulysses_group, ring=grid.ring_group)
    return {name: measure_forward(small_model(kv_heads=1), 64, opts, groups, sp_rank=grid.sp_rank).bytes
            for name, opts in RING_OPTIONS.items()}


def _check_same(name: str, plain: dict, offloaded: dict) -> None:
    assert offloaded["loss"] == plain["loss"], (name, offloaded["loss"], plain["loss"])
    assert offloaded["norm"] == plain["norm"], (name, offloaded["norm"], plain["norm"])
    assert plain["grads"].keys() == offloaded["grads"].keys() and plain["grads"], name
    for key, g in plain["grads"].items():
        assert torch.equal(offloaded["grads"][key], g), f"{name}: the gradient of {key} differs with offload"
    assert not plain["stats"] and offloaded["stats"], name


def test_offload_gives_the_same_losses_and_gradients_at_every_layout(tmp_path):
    ranks = run_distributed(_parity_worker, 4, tmp_dir=tmp_path, timeout=400)
    cfg, fp32 = small_model(kv_heads=1), PRECISIONS["fp32"]
    for rank, results in enumerate(ranks):
        kept = results.pop(RING_RETAINED)
        for name, opts in RING_OPTIONS.items():
            predicted = retained_activation_bytes(cfg, Degrees(sp=4, ring=2), Options(attention="sdpa",
                                                                                      native_gqa=False, **opts),
                                                  fp32, 64)
            assert kept[name] == predicted, (rank, name, kept[name], predicted)
        assert kept["offload"] < kept["checkpointing"] < kept["none"], kept
        for name, (plain, offloaded) in results.items():
            _check_same(f"{name}, rank {rank}", plain, offloaded)
            stats = offloaded["stats"]
            moved = sum(s.offloaded_bytes for s in stats)
            assert moved == sum(s.fetched_bytes for s in stats), (name, rank, stats)
            assert moved > 0 or all(s.kept for s in stats), (name, rank, stats)
            _check_arena(f"{name}, rank {rank}", offloaded)
            # every block input came back once, prefetched unless it was the first of its backward
            assert all(s.prefetched + s.on_demand == s.offloaded for s in stats), (name, rank, stats)
            if "pp" not in name:     # 4 blocks per forward, 1 of them copied back on demand
                assert all(s.prefetched == 3 * s.on_demand > 0 for s in stats), (name, rank, stats)
    # the second pipeline stage (ranks 2, 3) keeps its received inputs on the device (the schedule holds
    # them): one per micro-batch
    stats_pp = [r["pp2 dp2, 1F1B (2 micro-batches each)"][1]["stats"][0] for r in ranks]
    assert [s.kept for s in stats_pp] == [0, 0, 2, 2], stats_pp


ONE_PROCESS = {   # name: overrides, one process, one micro-batch unless said
    "fp32": [],
    "tiled MLP and loss": ["training.mlp_chunk_tokens=8", "training.loss_chunk_tokens=8"],
    "bf16": ["training.dtype=bfloat16"],
    "bf16, 2 micro-batches (fp32 main_grad)": ["training.dtype=bfloat16", "training.global_batch_size=2"],
}
PEAK = ["training.dtype=float32", "training.global_batch_size=1", "training.activation_checkpointing=true",
        "model.num_layers=8", "data.seq_len=1024", "model.hidden_size=32", "model.ffn_hidden_size=64",
        "model.vocab_size=128"]    # many block inputs, few parameters: the activations decide the peak
BLOCK_INPUT = 1024 * 32 * 4


@pytest.fixture(scope="module")
def one_process() -> dict:
    """One process, no process group (nothing here needs one): each option with and without offload, and
    the peaks of a training step."""
    steps = {name: (one_step(["training.global_batch_size=1"] + extra, 1),
                    one_step(["training.global_batch_size=1", "training.activation_offload=true"] + extra, 1))
             for name, extra in ONE_PROCESS.items()}
    peaks = (measured_step_peak(PEAK),
             measured_step_peak(PEAK + ["training.activation_offload=true"], exclude_host=True))
    return {"steps": steps, "peaks": peaks}


def test_offload_on_one_process_every_memory_option(one_process):
    for name, (plain, offloaded) in one_process["steps"].items():
        _check_same(f"one process, {name}", plain, offloaded)
        _check_arena(f"one process, {name}", offloaded)
        (stats,) = offloaded["stats"]
        M = 2 if "2 micro-batches" in name else 1    # per backward of 4 blocks: 1 on demand, 3 prefetched
        assert (stats.prefetched, stats.on_demand) == (3 * M, M), (name, stats)


def test_offload_lowers_the_peak_of_a_training_step_as_predicted(one_process):
    """The measured peak of live bytes on the 'device' (host copies excluded) drops with offload, and
    both peaks are the model's within 10%."""
    without, with_offload = one_process["peaks"]
    for peak, what in ((without, "on the device"), (with_offload, "offloaded")):
        assert abs(peak.predicted - peak.measured) <= 0.10 * peak.measured, (what, peak)
    assert with_offload.measured < without.measured - 3 * BLOCK_INPUT
    assert with_offload.predicted < without.predicted - 3 * BLOCK_INPUT


def _model(layers: int = 4, offload: bool = True, stride: int = 1, pinned=None) -> GPTStage:
    from megalysses.config import ModelConfig
    cfg = ModelConfig(vocab_size=256, hidden_size=64, num_layers=layers, num_heads=4, num_kv_heads=2,
                      ffn_hidden_size=160, attention_backend="sdpa")
    torch.manual_seed(0)
    policy = ActivationPolicy(checkpointing=True, offload=offload, checkpoint_stride=stride)
    model = apply_activation_policy(GPTStage(cfg, ParallelGroups()), policy, pinned)
    init_weights(model, 0)
    return model


def test_the_device_keeps_what_the_memory_model_says():
    """With offload a forward leaves no block input on the device: only the stage's own tensors (cos/sin,
    the final norm's, the loss gradients) and the host copies, which the model counts as host bytes."""
    model = _model()
    S = 64
    ids, pos = torch.randint(0, 256, (1, S)), torch.arange(S)[None]
    _, kept = measure_retained(lambda: model(ids, pos, labels=ids), exclude=tuple(model.parameters()) + (pos, ids))
    host = activation_offload(model).host_buffers()
    host_bytes = sum(t.numel() * t.element_size() for t in host)
    device = kept.bytes - host_bytes
    opts = Options(checkpointing=True, offload=True, attention="sdpa", native_gqa=False)
    fp32 = PRECISIONS["fp32"]
    assert device == retained_activation_bytes(model.cfg, Degrees(), opts, fp32, S), kept.storages
    assert host_bytes == 4 * S * 64 * 4                                       # 4 block inputs, fp32
    on_device = retained_activation_bytes(model.cfg, Degrees(), Options(checkpointing=True, attention="sdpa",
                                                                       native_gqa=False), fp32, S)
    assert on_device - device == host_bytes


def test_offload_without_checkpointing_is_a_config_error():
    with pytest.raises(ConfigError, match="training.activation_offload=true needs training.activation_checkpointing"):
        load_config(overrides=["data.mock=true", "training.activation_offload=true"])
    with pytest.raises(ConfigError, match="training.optimizer_offload=true is for ZeRO-1"):
        load_config(overrides=["data.mock=true", "training.optimizer_offload=true", "parallel.fsdp=true"])


def test_a_longer_sequence_lets_the_shorter_ones_host_buffers_go():
    """A sequence-length curriculum's next phase: the host buffers of the previous length are not kept
    (a curriculum never returns to a shorter length), and the gradients are those without offload; from an
    arena sized for the longest length, the shorter length's buffers go back to it and the longer ones fit."""
    from megalysses.pinned_arena import PinnedArena, aligned

    grads = {}
    for offload in (None, "own", "arena"):
        arena = PinnedArena(2 * aligned(64 * 64 * 4), torch.device("cpu")) if offload == "arena" else None
        model = _model(layers=2, offload=offload is not None, pinned=arena)
        for S in (32, 64):
            ids, pos = torch.randint(0, 256, (1, S), generator=torch.Generator().manual_seed(S)), torch.arange(S)[None]
            model(ids, pos, labels=ids).backward()
            if offload:
                assert {tuple(t.shape) for t in activation_offload(model).host_buffers()} == {(1, S, 64)}
        if arena is not None:
            assert arena.in_use == arena.capacity == arena.high_water
        grads[offload] = [p.grad for p in model.parameters()]
    assert all(torch.equal(a, b) and torch.equal(c, b) for a, b, c in zip(grads["own"], grads[None], grads["arena"]))


def test_a_checkpoint_stride_keeps_every_kth_block_input_for_the_same_gradients():
    """training.checkpoint_stride: groups of k blocks keep their input only (on the device, or offloaded), and
    recompute each block's input in the backward: the same loss and gradients bit for bit, 1/k of the block
    inputs kept, what the forward keeps exactly the model's, and the peak of a step within 10% of it."""
    for extra in ([], ["training.activation_offload=true"]):
        plain = one_step(["training.global_batch_size=1"] + extra, 1)
        for k in (2, 3):
            grouped = one_step(["training.global_batch_size=1", f"training.checkpoint_stride={k}"] + extra, 1)
            assert grouped["loss"] == plain["loss"] and grouped["norm"] == plain["norm"], (k, extra)
            assert all(torch.equal(grouped["grads"][n], g) for n, g in plain["grads"].items()), (k, extra)
            if extra:      # 4 blocks: 2 groups whatever k (2 + 2, 3 + 1), each group's input offloaded
                assert [s.offloaded for s in grouped["stats"]] == [2], grouped["stats"]
    S, fp32 = 64, PRECISIONS["fp32"]
    ids, pos = torch.randint(0, 256, (1, S)), torch.arange(S)[None]
    for offload in (False, True):
        model = _model(offload=offload, stride=2)
        _, kept = measure_retained(functools.partial(model, ids, pos, labels=ids),
                                   exclude=tuple(model.parameters()) + (pos, ids))
        host = sum(t.numel() * t.element_size() for t in activation_offload(model).host_buffers()) if offload else 0
        opts = Options(checkpointing=True, offload=offload, checkpoint_stride=2,
                       attention="sdpa", native_gqa=False)
        assert kept.bytes - host == retained_activation_bytes(model.cfg, Degrees(), opts, fp32, S), (offload, kept)
        assert host == (2 * S * 64 * 4 if offload else 0)                   # 2 of the 4 block inputs
    for extra in (["training.checkpoint_stride=2"],
                  ["training.checkpoint_stride=4", "training.activation_offload=true"]):
        peak = measured_step_peak(PEAK + extra, exclude_host=True)
        assert abs(peak.predicted - peak.measured) <= 0.10 * peak.measured, (extra, peak)
    with pytest.raises(ConfigError, match="checkpoint_stride=2 needs training.activation_checkpointing"):
        load_config(overrides=["data.mock=true", "training.checkpoint_stride=2"])
    with pytest.raises(ConfigError, match="checkpoint_stride=2 with training.recompute_attention=false"):
        load_config(overrides=["data.mock=true", "training.checkpoint_stride=2",
                               "training.activation_checkpointing=true", "training.recompute_attention=false"])


def test_a_block_input_comes_back_once():
    model = _model(layers=2)
    ids, pos = torch.randint(0, 256, (1, 32)), torch.arange(32)[None]
    loss = model(ids, pos, labels=ids)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="fetched twice"):
        loss.backward()
