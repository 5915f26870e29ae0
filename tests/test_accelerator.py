"""The allocator settings a run makes at start-up (megalysses/accelerator.py): expandable segments on CUDA unless
the user set their own, pinned requests allocated as asked where torch can, named in the plan's machine, the
start-up line and runtime.json; and the Host interface a trace swaps."""
import torch

from megalysses import accelerator
from megalysses.accelerator import AllocatorSettings, allocator_settings, pinned_rounding_settable
from megalysses.plan.machine import Machine


def test_allocator_settings_at_start_up():
    exact = pinned_rounding_settable()
    pinned = "pinned_max_round_threshold_mb:1,pinned_max_cached_size_mb:1" if exact else ""
    mine = allocator_settings(True, {})
    assert mine.ours == ",".join(x for x in ("expandable_segments:True", pinned) if x) and not mine.user
    assert mine.pinned_exact == exact
    # the user's own settings are kept as they are: no expandable segments of ours, either variable
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        theirs = allocator_settings(True, {name: "max_split_size_mb:64"})
        assert theirs.user == f"{name}=max_split_size_mb:64" and "expandable" not in theirs.ours
        assert "the user's" in theirs.describe()
    # a user who names a pinned key keeps it; rounding is stopped only if they stop it
    kept = allocator_settings(True, {"PYTORCH_ALLOC_CONF": "pinned_max_cached_size_mb:8"})
    assert kept.ours == "" and not kept.pinned_exact and "rounded up" in kept.describe()
    assert allocator_settings(False, {}) == AllocatorSettings("", "", True)
    # what a described H100 machine records: the settings a run there makes
    machine = Machine.described("H100", 8)
    assert machine.allocator == mine.describe() and machine.pinned_exact == exact
    assert machine.summary()["allocator"] == mine.describe() and Machine.current("cpu").allocator == ""
    # the probe changes no setting: a known key with a bad value is refused, an unknown one ignored
    assert isinstance(exact, bool)


def test_a_host_in_place_of_the_real_one():
    """A trace's Host replaces the real one for a block and counts what megalysses pins."""
    class Counting(accelerator.Host):
        pinned = 0

        def pinned_empty(self, shape, dtype, device):
            Counting.pinned += torch.Size(shape).numel() * dtype.itemsize
            return super().pinned_empty(shape, dtype, device)

    real = accelerator.current()
    with accelerator.use(Counting()) as host:
        assert accelerator.current() is host
        t = accelerator.current().pinned_empty((3, 5), torch.float32, torch.device("cpu"))
        assert not t.is_pinned() and host.stream("cpu") is None and host.event(None) is None
    assert accelerator.current() is real and Counting.pinned == 60
