"""The allocator settings a run makes at start-up (megalysses/accelerator.py): expandable segments on CUDA unless
the user set their own, pinned requests allocated as asked where torch can, named in the plan's machine, the
start-up line and runtime.json; and the Host interface a trace swaps."""
from dataclasses import replace

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


def test_the_model_counts_pinned_requests_as_allocated():
    """megalysses' own pinned memory is never rounded: at 6M tokens on 8 ranks a block input is 6 GiB (768K tokens
    x 4096 x 2 B) and takes 6 GiB whatever the torch. What torch pins for FSDP2 (parameter offload) is counted
    rounded up to a power of two where the torch in use cannot stop it, and 1 MiB requests even where it can. A
    node whose memory cannot hold the host terms of its ranks is refused before step 1."""
    import pytest

    from megalysses.config import ConfigError
    from megalysses.degrees import Degrees
    from megalysses.memory import GIB, PRECISIONS, Options, Workload, estimate
    from megalysses.memory.states import shard_elements
    from megalysses.memory.types import torch_pinned
    from megalysses.plan.search import check_host_memory, described_machine
    from megalysses.plan import resolve
    from megalysses.plan.step_time import Hardware
    from tests.planning import LLAMA3_8B, load

    opts = Options(checkpointing=True, offload=True, fsdp=True, param_offload=True,
                   attention="flash", kernels="triton")
    work, layout, bf16 = Workload(6 << 20), Degrees(sp=8), PRECISIONS["bf16"]
    block = (6 << 20) // 8 * LLAMA3_8B.hidden_size * 2
    terms = {}
    for rounding in (False, True):
        est = estimate(LLAMA3_8B, layout, replace(opts, pinned_rounding=rounding), bf16, work)
        terms[rounding] = {t.name: t.bytes for t in est.terms if t.host}
    layers = LLAMA3_8B.num_layers
    assert block == 6 * GIB and terms[False]["offloaded block inputs"] == terms[True]["offloaded block inputs"] \
        == layers * block
    shards = shard_elements(LLAMA3_8B, layout, True, True)
    fsdp = {rounding: terms[rounding]["master, moments, gradients (FSDP shards)"] for rounding in (False, True)}
    assert fsdp[True] - fsdp[False] == 2 * sum(c * (torch_pinned(4 * n, False) - torch_pinned(4 * n, True))
                                               for n, c in shards) > 0
    assert torch_pinned(6 * GIB, True) == 6 * GIB and torch_pinned(6 * GIB, False) == 8 * GIB
    # 1.5 MiB: as asked where torch can be told, else 2 MiB; 768 KiB: 1 MiB even then
    assert torch_pinned(3 << 19, True) == 3 << 19 and torch_pinned(3 << 19, False) == 2 << 20
    assert torch_pinned(3 << 18, True) == 1 << 20
    cfg = load("configs/gpt_1b_1m_offload.yaml", **{"training.global_batch_size": 1})
    run = resolve(cfg, described_machine(1, None, Hardware()), 1)
    check_host_memory(cfg, run, node_bytes=4096 * GIB)
    with pytest.raises(ConfigError, match="GiB of host memory per node"):
        check_host_memory(cfg, run, node_bytes=8 * GIB)
