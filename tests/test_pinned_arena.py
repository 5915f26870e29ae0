"""Pinned host memory as the plan sizes it (megalysses/pinned_arena.py, memory/host.py): the arena's slices, the
arena a run builds from its plan, and optimizer offload's staging buffers. The runs that fill an arena to the
byte are in tests/test_offload.py and tests/test_optimizer_offload.py; registration with CUDA and the
asynchronous copies are the GPU tier's (tests/test_gpu.py)."""
import pytest
import torch

from megalysses import accelerator
from megalysses.model.policies import activation_offload
from megalysses.pinned_arena import ALIGN, PinnedArena, aligned
from tests.fixtures import MOCK_32, SMALL_MODEL, with_model


def test_an_arena_hands_out_aligned_slices_and_takes_them_back():
    arena = PinnedArena(4 * ALIGN, torch.device("cpu"), "two tests")
    a = arena.empty((3, 5), torch.float32)                  # 60 B: one ALIGN
    b = arena.empty((ALIGN // 2 + 1,), torch.bfloat16)       # ALIGN + 2 B: two
    assert a.shape == (3, 5) and a.dtype == torch.float32 and b.dtype == torch.bfloat16
    starts = [t.storage_offset() * t.element_size() for t in (a, b)]
    assert starts == [0, ALIGN] and arena.in_use == arena.high_water == 3 * ALIGN
    a.fill_(1.0)
    b.fill_(2.0)
    assert a.sum().item() == 15 and arena.buffer[:60].view(torch.float32).eq(1.0).all()
    assert arena.empty((0, 5), torch.float32).numel() == 0 and arena.in_use == 3 * ALIGN      # nothing taken
    with pytest.raises(RuntimeError, match=f"request of {2 * ALIGN} bytes .* which the plan sized for two tests"):
        arena.empty((2 * ALIGN,), torch.uint8)
    arena.release(a)
    arena.release(b)                                         # free again, as one range
    assert arena.in_use == 0 and arena.high_water == 3 * ALIGN
    whole = arena.empty((ALIGN,), torch.float32)             # all of it: the freed ranges were joined
    assert whole.storage_offset() == 0
    with pytest.raises(ValueError, match="not a slice of this arena"):
        arena.release(torch.empty(4))
    assert aligned(1) == aligned(ALIGN) == ALIGN and aligned(0) == 0


def test_an_arena_is_one_request_to_the_host_and_works_on_meta_tensors():
    """A trace's Host sees the arena as one pinned request of its size; a dry run's arena (meta) slices
    shapes only."""
    asked = []

    class Counting(accelerator.Host):
        def pinned_empty(self, shape, dtype, device):
            asked.append((shape, dtype))
            return super().pinned_empty(shape, dtype, device)

    with accelerator.use(Counting()):
        arena = PinnedArena(3 * ALIGN, torch.device("cpu"))
        arena.empty((4,), torch.float32)
        arena.empty((4,), torch.float32)
    assert asked == [((3 * ALIGN,), torch.uint8)]
    meta = PinnedArena(1 << 40, torch.device("meta"))        # a terabyte of shapes, no memory
    t = meta.empty((1 << 20, 4096), torch.bfloat16)
    assert t.is_meta and meta.in_use == (1 << 33)


def test_a_run_sizes_its_arena_from_the_plan():
    """What build_run pins is one arena of the memory model's pinned requests for the rank's
    stage, and those are the estimate's pinned host terms."""
    from megalysses.config.io import load_config
    from megalysses.grid import ParallelGrid
    from megalysses.memory import arena_bytes
    from megalysses.plan.memory import estimate_plan, pinned_requests_of
    from megalysses.training.build import build_run
    from megalysses.testing import resolve_run

    cfg = load_config(overrides=with_model(MOCK_32 + SMALL_MODEL, num_layers=3) + ["training.global_batch_size=2",
                                 "training.micro_batch_size=1", "training.activation_checkpointing=true",
                                 "training.activation_offload=true", "training.optimizer_offload=true",
                                 "checkpoint.async_save=false"])      # the background saver's arena: test_checkpoint
    grid, cpu = ParallelGrid.single(), torch.device("cpu")
    run = resolve_run(cfg, cpu, grid)
    built = build_run(cfg, run, grid, cpu)
    model, opt = built.model, built.opt
    reqs = pinned_requests_of(cfg, run, 0)
    mine = {owner: [r for r in reqs if r.owner == owner] for owner in ("optimizer", "model chunk 0")}
    assert sum(map(len, mine.values())) == len(reqs)
    assert opt.pinned.capacity == arena_bytes(mine["optimizer"])
    assert activation_offload(model).pinned.capacity == arena_bytes(mine["model chunk 0"])
    assert {r.name for r in reqs} == {"offloaded block inputs", "fp32 masters", "reduced fp32 gradients",
                                      "gradient staging buffers"}
    (inputs,) = mine["model chunk 0"]
    assert (inputs.name, inputs.count, inputs.nbytes) == ("offloaded block inputs", 3, 32 * 32 * 4)  # fp32, 3 blocks
    host = {t.name: t.bytes for t in estimate_plan(cfg, run).terms if t.host}
    assert sum(host[name] for name in {r.name for r in reqs}) == arena_bytes(reqs)
    # the masters and reduced gradients are taken at once; the block inputs in the first forward
    masters = sum(r.total for r in reqs if r.name in ("fp32 masters", "reduced fp32 gradients"))
    assert opt.pinned.in_use == masters and activation_offload(model).pinned.in_use == 0


def test_a_bucket_larger_than_a_staging_buffer_fills_them_in_turn():
    """Optimizer offload's staging buffers (a later micro-batch's reduced gradients wait there to be added on
    the host) are made once, STAGING_BUFFERS of them at their planned size, and a bucket larger than one is staged
    through them in turn: every host gradient gets its sum."""
    from megalysses.memory.host import STAGING_BUFFERS, staging_elements
    from megalysses.pinned_arena import PinnedRequests
    from megalysses.parallel.host_gradients import HostGradients

    class Done:                                  # an event whose work has finished (a copy on a CPU)
        def synchronize(self):
            pass

        def query(self):
            return True

    class Immediate(accelerator.Host):
        def event(self, stream):
            return Done()

    made = []

    class Counting(PinnedRequests):
        def empty(self, shape, dtype):
            made.append(shape)
            return super().empty(shape, dtype)

    assert staging_elements(10, 2, 100) == 5 and staging_elements(10, 2, 3) == 3
    with accelerator.use(Immediate()):
        host = HostGradients(torch.device("cpu"), Counting(torch.device("cpu")), staging_elements=4)
        grads = [torch.zeros(7), torch.zeros(3)]
        for micro in range(3):
            pieces = [torch.arange(7.0) + micro, torch.arange(3.0) * 10]
            host._stage_pieces([(g, p) for g, p in zip(grads, pieces)])
            while host._pending:
                host._add(host._pending.pop(0))
    assert made == [(4,)] * STAGING_BUFFERS
    assert torch.equal(grads[0], 3 * torch.arange(7.0) + 3) and torch.equal(grads[1], torch.arange(3.0) * 30)


def test_the_plan_counts_the_block_inputs_each_schedule_keeps_in_flight():
    """Activation offload's buffers on each pipeline rank: per model chunk, the block inputs a forward offloads
    (each checkpointed group's, but a received pipeline input) times the most forwards of that chunk whose
    backward has not started, over the schedule the run executes (parallel/pipeline.py, interleaved.py)."""
    from megalysses.config.io import load_config
    from megalysses.degrees import Degrees
    from megalysses.memory import Options, Workload
    from megalysses.memory.host import offload_buffers
    from megalysses.parallel.interleaved import rank_order

    m = load_config(overrides=["data.mock=true", "model.num_layers=8"]).model
    for P, v, stride in ((2, 1, 1), (4, 1, 2), (2, 2, 1), (4, 2, 1), (2, 4, 2)):
        opts = Options(checkpointing=True, offload=True, checkpoint_stride=stride)
        groups = -(-(8 // (P * v)) // stride)
        for M in (P, 2 * P):
            for stage in range(P):
                most, now = [0] * v, [0] * v
                for action in rank_order(P, v, M, stage):
                    now[action.chunk] += 1 if action.kind == "F" else -1
                    most[action.chunk] = max(most[action.chunk], now[action.chunk])
                if v == 1:          # 1F1B (pipeline.py): P - stage - 1 forwards of warm-up, then one of each
                    most = [min(P - stage, M)]
                expected = [n * (groups - (0 if stage == 0 and c == 0 else 1)) for c, n in enumerate(most)]
                got = offload_buffers(m, Degrees(pp=P, virtual_stages=v), opts, Workload(64, 1, M), stage)
                assert got == expected, (P, v, stride, M, stage, got, expected)
    one = Options(checkpointing=True, offload=True, checkpoint_stride=3)
    assert offload_buffers(m, Degrees(), one, Workload(64, 1, 4), 0) == [3]      # one micro-batch at a time
