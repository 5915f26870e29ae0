"""Pinned host memory in arenas (megalysses/pinned_arena.py): the arena's slices, on CPU and meta tensors.
Registration with CUDA and the asynchronous copies are the GPU tier's (tests/test_gpu.py)."""
import pytest
import torch

from megalysses import accelerator
from megalysses.pinned_arena import ALIGN, PinnedArena, aligned


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
