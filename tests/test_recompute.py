"""training.recompute_attention=false: activation checkpointing keeps SDPA's attention outputs and the
backward recomputes the rest of the block (megalysses/model/recompute.py).

At every layout the option allows, the losses and every reduced gradient equal those of full
recomputation bit for bit, and the attention kernel runs once per layer and micro-batch in the forward
instead of twice. What it keeps is checked against the memory model in tests/test_memory_model.py;
layouts it cannot serve are config errors."""
import collections
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megalysses.config import ConfigError
from megalysses.config.io import load_config
from megalysses.model.recompute import attention_kernels
from megalysses.testing import run_distributed
from megalysses.training.runtime import memory_options
from megalysses.testing import resolve_run
from tests.test_offload import BASE
from tests.test_offload import one_step as offload_step

LAYOUTS = {   # name: (overrides on 4 ranks of test_offload.py's 4-layer model, layers x micro-batches a rank runs)
    "tp2 sp2, TP sequence sharding, tiled MLP and loss": (
        ["parallel.tp=2", "parallel.sp=2", "parallel.tp_sequence_parallel=true", "training.mlp_chunk_tokens=4",
         "training.loss_chunk_tokens=4"], 4 * 4),
    "pp2 dp2, 1F1B, bf16": (["parallel.pp=2", "training.dtype=bfloat16"], 2 * 2),
    "pp2 dp2, interleaved (2 chunks per rank), tied embeddings": (
        ["parallel.pp=2", "parallel.virtual_stages=2", "model.tie_embeddings=true"], 2 * 2),
    "sp4 (KV heads replicated), dp FSDP": (["parallel.sp=4", "parallel.fsdp=true"], 4 * 4),
}


class CountAttention(TorchDispatchMode):
    """How many times SDPA's attention kernel runs (forward kernels only: the backward has its own ops)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in attention_kernels():
            self.calls[str(func)] += 1
        return func(*args, **(kwargs or {}))


def one_step(overrides: list[str], world: int) -> dict:
    """tests/test_offload.py's training step (its loss and reduced gradients), counting the attention kernel."""
    with CountAttention() as counter:
        got = offload_step(overrides, world)
    return dict(got, calls=sum(counter.calls.values()))


def _worker(rank: int, world: int) -> dict:
    return {name: (one_step(overrides, world), one_step(overrides + ["training.recompute_attention=false"], world))
            for name, (overrides, _) in LAYOUTS.items()}


def test_kept_attention_gives_the_same_gradients_and_runs_attention_once(tmp_path):
    results = run_distributed(_worker, 4, tmp_path, timeout=400)
    for rank, by_layout in enumerate(results):
        for name, (full, kept) in by_layout.items():
            where = f"{name}, rank {rank}"
            assert kept["loss"] == full["loss"], where
            assert kept["grads"].keys() == full["grads"].keys() and kept["grads"], where
            for p, g in full["grads"].items():
                assert torch.equal(kept["grads"][p], g), f"{where}: {p}"
            runs = LAYOUTS[name][1]          # layer forwards on this rank in the step
            assert full["calls"] == 2 * runs, (where, full["calls"])     # the forward, then the recomputation
            assert kept["calls"] == runs, (where, kept["calls"])


@pytest.mark.parametrize("overrides, message", [
    (["training.activation_checkpointing=false"], "training.activation_checkpointing=true"),
    (["model.attention_backend=reference"], "model.attention_backend=sdpa"),
    (["training.activation_offload=true"], "choose one of them"),
    (["model.num_heads=2", "model.num_kv_heads=1", "parallel.sp=4"], "ring attention"),
])
def test_layouts_it_cannot_serve_are_config_errors(overrides, message):
    cfg = load_config(overrides=BASE + ["training.recompute_attention=false"] + overrides)
    with pytest.raises(ConfigError, match=message):
        resolve_run(cfg, torch.device("cpu"))


def test_the_start_up_line_says_what_checkpointing_keeps():
    cfg = load_config(overrides=BASE + ["training.recompute_attention=false"])
    cpu = torch.device("cpu")
    assert "activation checkpointing (attention outputs kept)" in memory_options(cfg, resolve_run(cfg, cpu))
    plain = load_config(overrides=BASE)
    assert "activation checkpointing" in memory_options(plain, resolve_run(plain, cpu))


def test_a_forward_that_keeps_nothing_warns_once():
    """SDPA's math path (here forced) is not one kernel: nothing is kept, the backward recomputes attention
    as with full checkpointing, and the run is told so once."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megalysses.model.gpt import GPTStage
    from megalysses.model.policies import apply_activation_policy
    from megalysses.plan import ActivationPolicy
    from tests.test_memory_model import small_model

    torch.manual_seed(0)
    model = apply_activation_policy(GPTStage(small_model()), ActivationPolicy(checkpointing=True, keep_attention=True))
    ids = torch.randint(0, 256, (1, 32))
    pos = torch.arange(32)[None]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(ids, pos, labels=ids).backward()                      # the fused CPU kernel: kept, no warning
    with sdpa_kernel(SDPBackend.MATH), pytest.warns(RuntimeWarning, match="kept nothing"):
        model(ids, pos, labels=ids).backward()
    with sdpa_kernel(SDPBackend.MATH), warnings.catch_warnings():
        warnings.simplefilter("error")
        model(ids, pos, labels=ids).backward()                      # once
