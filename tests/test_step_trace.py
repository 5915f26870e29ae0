"""The traced roofline (megalysses/training/roofline.py): each op's FLOPs, bytes, launches and host syncs on
fake tensors whose costs are known, collectives by their group's link, the overlap that streams, events and
asynchronous collectives arrange and no more, micro-batches scaled to the step; and the step-time model
against a traced step at a small real shape, category by category."""
import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from megalysses.config.io import load_config
from megalysses.plan import Machine
from megalysses.plan.search import predict
from megalysses.plan.step_time import Hardware
from megalysses.tracker import LiveBytes
from megalysses.training.roofline import CATEGORIES, Roofline, Tally
from megalysses.training.trace import roofline_fields, trace_run

HW = Hardware()
BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def triton_kernels_for_the_interpreter(monkeypatch):
    """The trace runs the kernels' fake forms, but the first import of a kernel module decorates its kernels for
    good: under Triton's CPU interpreter, so that later tests in this process can run them on CPU tensors."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _device_seconds(flops: float, nbytes: float, efficiency: float = 0.0) -> float:
    compute = flops / (HW.peak_tflops * 1e12 * efficiency) if efficiency else 0.0
    return max(compute, nbytes / (HW.hbm_gbs * 1e9))


def test_ops_by_their_flops_bytes_launches_and_syncs():
    """A matmul by torch's formula at the matmul kernels' efficiency, an elementwise op by its bytes, views and
    empty tensors free, a blocking copy to the host at the host link and a host sync, .item() a host sync; each
    kernel one launch."""
    m, k, n = 4096, 4096, 8192
    with FakeTensorMode(), LiveBytes(), Roofline(HW) as roof:       # LiveBytes answers .item()
        a = torch.empty(m, k, device="meta", dtype=BF16)
        b = torch.empty(k, n, device="meta", dtype=BF16)
        c = a @ b
        d = (c * 2).view(-1)
        host = d.to("cpu")
        d.sum().item()
        roof.finish()
    r = roof.result(1, 1)
    mm = 2 * m * k * n
    assert r.flops["matmul"] == mm and r.flops["attention"] == 0
    assert r.launches == 4 and r.host_syncs == 2           # mm, mul, the copy, sum; the copy and .item()
    c_bytes = m * n * 2
    expected = (_device_seconds(mm, (m * k + k * n) * 2 + c_bytes, HW.matmul_efficiency)
                + _device_seconds(0, 2 * c_bytes) + _device_seconds(0, c_bytes + 2))
    assert r.seconds["compute"] == pytest.approx(expected)
    assert r.seconds["host copies"] == pytest.approx(c_bytes / (HW.host_gbs * 1e9)) and r.host_bytes == c_bytes
    assert r.seconds["launches"] == pytest.approx(4 * HW.launch_us * 1e-6)
    assert r.total == pytest.approx(sum(r.seconds[k] for k in CATEGORIES))
    del host


def test_collectives_by_group_and_overlap():
    """A collective moves its ring's bytes over its group's link (inter-node when its ranks span nodes); a
    synchronous one holds the stream, an asynchronous one only the op that reads its buffer, after the compute
    queued between them; a side stream's copy shows only where an event makes the main stream wait for it."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=16)
    try:
        near, far = dist.new_group([0, 1]), dist.new_group([0, 8])
        with FakeTensorMode(), Roofline(HW) as roof:
            x = torch.empty(64 << 20, device="meta", dtype=BF16)                # 128 MiB
            a = torch.empty(8192, 8192, device="meta", dtype=BF16)
            dist.all_reduce(x, group=near)                                       # sync: all of it exposed
            sync = roof.tally.seconds["communication"]
            assert sync == pytest.approx(2 * 0.5 * x.nbytes / HW.link(2))
            dist.all_reduce(x, group=far, async_op=True)                         # async, then a matmul
            before = roof.tally.seconds["communication"]
            a @ a
            matmul = roof.tally.seconds["compute"] + HW.launch_us * 1e-6        # the matmul and its launch
            x.add_(1)                                                            # reads it: waits for the rest
            waited = roof.tally.seconds["communication"] - before
            side = roof.stream()
            side.wait_stream(roof.current)
            with roof.on(side):
                x.to("cpu", non_blocking=True)                                   # a copy on a side stream
            done = side.record_event()
            a @ a
            roof.current.wait_event(done)
            roof.finish()
        r = roof.result(1, 1)
        inter = 2 * 0.5 * x.nbytes / HW.link(9)
        assert HW.link(9) < HW.link(2)
        assert waited == pytest.approx(inter - matmul)
        assert r.collective_bytes == {"allreduce over 2 ranks (intra-node)": x.nbytes,
                                      "allreduce over 2 ranks (inter-node)": x.nbytes}
        copy = x.nbytes / (HW.host_gbs * 1e9)
        assert r.seconds["host copies"] == pytest.approx(copy - _device_seconds(2 * 8192 ** 3, 3 * a.nbytes,
                                                                                HW.matmul_efficiency))
        assert r.host_syncs == 0                                                 # a non-blocking copy
    finally:
        dist.destroy_process_group()


def test_micro_batches_scaled_to_the_step():
    """Three traced micro-batches of many: the first, the last and the middle one for each of the others; the
    parts before them and the optimizer's once; a pipeline's schedule scaled by its share."""
    roof = Roofline(HW)
    for name, seconds in (("start", 1.0), ("micro-batch", 10.0), ("micro-batch", 20.0), ("micro-batch", 30.0),
                          ("optimizer", 5.0)):
        t = Tally()
        t.seconds["compute"], t.launches = seconds, 1
        roof.parts.append((name, t))
    r = roof.result(8, 3)
    assert r.seconds["compute"] == 1 + 10 + 30 + 6 * 20 + 5 and r.launches == 1 + 1 + 1 + 6 + 1
    assert roof.result(3, 3).seconds["compute"] == 66
    roof.parts = [("micro-batches", Tally(seconds={**dict.fromkeys(CATEGORIES, 0.0), "compute": 6.0}))]
    assert roof.result(8, 6).seconds["compute"] == 8.0


SMALL = ["data.mock=true", "model.vocab_size=512", "model.hidden_size=128", "model.num_layers=2", "model.num_heads=4",
         "model.num_kv_heads=2", "model.ffn_hidden_size=320", "training.micro_batch_size=1", "data.seq_len=4096",
         "training.dtype=bfloat16", "training.activation_checkpointing=true"]
# wide enough that every matmul is bound by its FLOPs, as at the real shapes
WIDE = ["model.hidden_size=1024", "model.num_heads=8", "model.num_kv_heads=4", "model.ffn_hidden_size=2816"]


@pytest.mark.parametrize("world,overrides", [
    (1, ["training.global_batch_size=5"]),
    (1, ["training.global_batch_size=2", "training.mlp_chunk_tokens=1024"]),
    (4, ["parallel.sp=2", "parallel.sp_ring=2", "parallel.fsdp=true", "training.global_batch_size=4"]),
])
def test_model_against_the_trace(world, overrides):
    """At a small real shape (one GPU, with MLP tiles; a ring of 2 with FlexAttention and FSDP, several
    micro-batches each), the step-time model against the traced step: the FLOPs by torch's formulas and the
    kernels' own, the matmuls within 1% (a block's recomputation stopping before the MLP's down projection; MLP
    tiles recomputing each tile once more), attention by the pairs its masks allow (a backward 2.5 forwards in
    both); and every category of the model's breakdown (compute, attention, masks, communication not
    overlapped, host copies, optimizer, launches) within 5% of the trace's."""
    cfg = load_config(overrides=SMALL + WIDE + overrides)
    traces = trace_run(cfg, Machine.described("H100", packages=("triton",)), world, hw=HW)
    traced = roofline_fields(traces)
    model = predict(cfg, traces[0].plan, None, None, HW).step
    flops = traced["traced_flops"]
    assert flops["matmul"] == pytest.approx(model.flops["matmul"], rel=0.01), (flops, model.flops)
    assert flops["attention"] == pytest.approx(model.flops["attention"], rel=0.01), (flops, model.flops)
    seconds = max(traces, key=lambda t: t.roofline.total).roofline.seconds          # unrounded
    breakdown = model.breakdown(HW)
    assert set(seconds) <= set(breakdown) and breakdown["pipeline bubble"] == 0
    far = {k: (seconds[k], breakdown[k]) for k in CATEGORIES if breakdown[k] != pytest.approx(seconds[k], rel=0.05)}
    assert not far, far
    assert (seconds["masks"] > 0) == (world > 1) and seconds["launches"] > 0
    assert traced["traced_launches"] == pytest.approx(model.kernels, rel=0.05)
    # no host sync in a step: varlen attention's documents come from the loader, their longest in host memory
    assert traced["traced_host_syncs"] == 0, (traces[0].plan.attention, traced["traced_host_syncs"])
    if world > 1:       # the ring's K/V blocks: the model's bytes
        sent = sum(v for k, v in traced["traced_collective_gb"].items() if k.startswith("send"))
        assert sent * 1e9 == pytest.approx(model.bytes["ring_p2p"], rel=0.05)


@pytest.mark.parametrize("world,overrides", [
    (4, ["parallel.sp=2", "parallel.sp_ring=2", "parallel.fsdp=true", "training.global_batch_size=4",
         "model.kernels=triton", "training.attention_head_chunks=2", "data.seq_len=16384"]),
    (2, ["parallel.sp=2", "training.global_batch_size=2", "training.activation_checkpointing=false"]),
])
def test_model_against_the_trace_with_head_chunks_and_ulysses(world, overrides):
    """Head chunks in a ring with the Triton kernels at 16K tokens (the norm's backward over two row tiles, each
    chunk's attention, its ring blocks and their merges once more in its backward, its QKV projection again but
    not its output projection, the partial sums' in-place matmuls counted as matmuls), and Ulysses without
    checkpointing (the all-to-alls' memory-bound passes by forward and backward): the matmul FLOPs within 1%,
    the kernels, the compute (matmuls and memory-bound kernels), the launches and the block-mask builds within
    5% of the trace's, and Ulysses' communication not overlapped (ZeRO-1's last gradient bucket, reduced after
    the backward, among it; the ring's: benchmarks/results/trace.md)."""
    cfg = load_config(overrides=SMALL + WIDE + overrides)
    traces = trace_run(cfg, Machine.described("H100", packages=("triton",)), world, hw=HW)
    traced = roofline_fields(traces)
    model = predict(cfg, traces[0].plan, None, None, HW).step
    assert traced["traced_flops"]["matmul"] == pytest.approx(model.flops["matmul"], rel=0.01)
    assert traced["traced_launches"] == pytest.approx(model.kernels, rel=0.05)
    seconds, breakdown = max(traces, key=lambda t: t.roofline.total).roofline.seconds, model.breakdown(HW)
    checked = ("compute", "launches", "masks") + (("communication",) if cfg.parallel.sp_ring <= 1 else ())
    far = {k: (seconds[k], breakdown[k]) for k in checked
           if breakdown[k] != pytest.approx(seconds[k], rel=0.05)}
    assert not far, far


def test_in_place_matmuls_by_their_formula():
    """addmm_ (the head chunks' partial sums) is a matmul by addmm's formula, not a memory-bound op."""
    with FakeTensorMode(), Roofline(HW) as roof:
        a, b = torch.empty(4096, 512, device="meta", dtype=BF16), torch.empty(512, 4096, device="meta", dtype=BF16)
        acc = torch.empty(4096, 4096, device="meta", dtype=BF16)
        acc.addmm_(a, b)
        roof.finish()
    assert roof.result(1, 1).flops["matmul"] == 2 * 4096 * 512 * 4096


def test_block_mask_builds_at_long_lengths():
    """A ring step's block masks at a length where the pairs of blocks outweigh the queries and the build goes
    over several groups of rows (kernels/block_mask.py ROW_CHUNK): the model's seconds (bytes per query and per
    pair) and kernels within 5% of the traced builds of ring rank 0 (its own block, causal, and the other's with
    the second half of its queries)."""
    from megalysses.degrees import Degrees
    from megalysses.kernels.block_mask import MaskPattern, build_block_mask
    from megalysses.memory import PRECISIONS, Options, Workload
    from megalysses.config import ModelConfig
    from megalysses.plan.step_time import _mask_launches, step_time

    S, ring = 1 << 19, 2
    block, half = S // ring, S // (2 * ring)
    with FakeTensorMode(), LiveBytes(), Roofline(HW) as roof:
        with roof.category("masks"):
            for sq, causal in ((block, True), (half, False)):
                docs = torch.zeros(1, block, dtype=torch.long, device="meta")
                build_block_mask(MaskPattern(causal, docs[:, :sq], docs), sq, block, 128, torch.device("meta"))
        roof.finish()
    traced = roof.result(1, 1)
    layout, opts, work = Degrees(sp=ring, ring=ring), Options(attention="flex", documents=True), Workload(S)
    model = step_time(ModelConfig(), layout, opts, PRECISIONS["bf16"], work, HW)
    assert model.breakdown(HW)["masks"] == pytest.approx(traced.seconds["masks"], rel=0.05)
    assert _mask_launches(layout, opts, work) == pytest.approx(traced.launches, rel=0.05)


@pytest.mark.parametrize("world,overrides", [
    (1, ["training.activation_checkpointing=false", "training.mlp_chunk_tokens=1024"]),
    (1, ["parallel.fsdp=true", "training.param_offload=true", "training.activation_offload=true",
         "training.mlp_chunk_tokens=1024"]),
    (4, ["parallel.sp=4"]),
])
def test_kernels_per_layer_against_the_trace(world, overrides):
    """The kernels a layer adds to a step (4 layers against 2, one micro-batch, the Triton kernels), the model's
    and the trace's equal: MLP tiles without checkpointing (no tile's forward recomputed), one rank's FSDP2 with
    its shards and the block inputs in host memory, and ZeRO-1 over 4 ranks (each parameter tensor's chunk padded
    and copied back once per rank of the group, each bucket's chunks cast to bf16 before they are gathered, and
    the bytes of its reduce-scatters and gathers)."""
    counts = []
    for layers in (2, 4):
        cfg = load_config(overrides=SMALL + WIDE + overrides + ["model.kernels=triton", "training.global_batch_size=1",
                                                                f"model.num_layers={layers}"])
        traces = trace_run(cfg, Machine.described("H100", packages=("triton",)), world, hw=HW)
        model = predict(cfg, traces[0].plan, None, None, HW).step
        counts.append((max(t.roofline.launches for t in traces), model.kernels))
    (traced2, model2), (traced4, model4) = counts
    assert traced4 - traced2 == pytest.approx(model4 - model2, rel=0.01), counts     # ZeRO-1's buckets by size
    if world > 1:       # ZeRO-1's fp32 gradients reduce-scattered and its bf16 weights (not fp32 chunks) gathered
        moved = roofline_fields(traces)["traced_collective_gb"]
        sent = sum(v for k, v in moved.items() if k.startswith(("allgather", "reduce_scatter")))
        assert sent * 1e9 == pytest.approx(model.bytes["all_reduce"], rel=0.01), (moved, model.bytes)
