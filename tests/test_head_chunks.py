"""training.attention_head_chunks: which counts a layout allows, how the config and the run plan take them (auto
from the device's memory), what the start-up line and the planner show, and that the step-time model counts
the attention each chunk recomputes as a training step on CPU runs it.

Parity with all heads at once is in tests/test_model_parity.py (2 and 4 ranks), tests/test_ring.py (8) and
tests/test_training_parity.py; the memory each chunk saves in tests/test_memory_model.py."""
import collections

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from megalysses.config import ConfigError
from megalysses.config.checks import head_chunk_counts
from megalysses.config.io import load_config
from megalysses.degrees import Degrees
from megalysses.memory import PRECISIONS, Options, Workload
from megalysses.plan.memory import estimate_plan
from megalysses.model.recompute import attention_kernels
from megalysses.plan import Machine, resolve
from megalysses.plan.search import described_machine, evaluate
from megalysses.plan.step_time import Hardware, step_time
from megalysses.tools.plan import _flags
from megalysses.training.runtime import memory_options
from tests.test_offload import BASE
from tests.test_offload import one_step

LLAMA_8B = ["model.vocab_size=128256", "model.hidden_size=4096", "model.num_layers=32", "model.num_heads=32",
            "model.num_kv_heads=8", "model.ffn_hidden_size=14336", "data.mock=true", "model.kernels=triton",
            "training.global_batch_size=1", "training.activation_checkpointing=true",
            "training.activation_offload=true", "training.mlp_chunk_tokens=16384", "training.loss_chunk_tokens=8192",
            "parallel.fsdp=true", "parallel.sp=8"]


def test_counts_keep_whole_kv_groups_and_split_over_ulysses():
    # Llama-3-8B, 32 query heads on 8 KV heads
    assert head_chunk_counts(32, 8, tp=1, ulysses=1) == [1, 2, 4, 8]
    assert head_chunk_counts(32, 8, tp=1, ulysses=8) == [1, 2, 4]      # 8 chunks: 4 query heads over 8 ranks
    assert head_chunk_counts(32, 8, tp=2, ulysses=4) == [1, 2, 4]
    assert head_chunk_counts(32, 8, tp=8, ulysses=1) == [1]             # one KV group a rank
    assert head_chunk_counts(8, 1, tp=1, ulysses=1) == [1]              # MQA: one group
    assert head_chunk_counts(12, 12, tp=1, ulysses=3) == [1, 2, 4]      # 3 and 6 leave heads Ulysses cannot split


def test_config_values_and_errors():
    assert load_config(overrides=["data.mock=true", "training.attention_head_chunks=auto"]).training \
        .attention_head_chunks == "auto"
    assert load_config(overrides=["data.mock=true", "training.attention_head_chunks=4"]).training \
        .attention_head_chunks == 4
    for value, message in (("0", "attention_head_chunks=0 is out of range"),
                           ("many", "expected an integer or auto, got 'many'")):
        with pytest.raises(ConfigError, match=message):
            load_config(overrides=["data.mock=true", f"training.attention_head_chunks={value}"])
    with pytest.raises(ConfigError, match="recompute_attention=false is not supported"):
        load_config(overrides=["data.mock=true", "training.attention_head_chunks=2",
                               "training.activation_checkpointing=true", "training.recompute_attention=false"])
    # 8 query heads on 2 KV heads at sp 2: 2 chunks of one KV head (replicated to both Ulysses ranks), not 4
    cfg = load_config(overrides=["data.mock=true", "model.num_kv_heads=2", "parallel.sp=2",
                                 "training.attention_head_chunks=4"])
    with pytest.raises(ConfigError, match=r"attention_head_chunks=4 does not split .* choose one of 1, 2, or auto"):
        resolve(cfg, Machine.described(None), 2)


def _plan(seq_len: int, chunks: str = "auto", gpus: int = 8):
    cfg = load_config(overrides=LLAMA_8B + [f"data.seq_len={seq_len}", f"training.attention_head_chunks={chunks}"])
    return cfg, resolve(cfg, described_machine(gpus, 80, Hardware(), packages=("triton",)), gpus)


def test_auto_is_the_fewest_chunks_that_fit_and_one_without_a_known_memory():
    peaks, budgets = {}, {}
    for n in (1, 2, 4):                                      # Llama-3-8B at 5M tokens on 8 GPUs
        cfg, run = _plan(5 << 20, str(n))
        e = estimate_plan(cfg, run)
        peaks[n], budgets[n] = e.peak, Hardware().usable_bytes(80, e.largest.bytes)
    assert peaks[1] > peaks[2] > peaks[4]
    assert peaks[1] > budgets[1] and peaks[2] > budgets[2] and budgets[4] >= peaks[4]
    assert _plan(5 << 20)[1].activation.head_chunks == 4
    assert _plan(1 << 20)[1].activation.head_chunks == 1     # fits with all heads at once
    cfg, run = _plan(24 << 20)                               # fits with none: the lowest peak
    e = estimate_plan(cfg, run)
    assert run.activation.head_chunks == 4 and e.peak > Hardware().usable_bytes(80, e.largest.bytes)
    cfg = load_config(overrides=LLAMA_8B + ["data.seq_len=6291456", "training.attention_head_chunks=auto",
                                            "model.kernels=torch"])
    assert resolve(cfg, Machine.described(None, ranks_per_node=8), 8).activation.head_chunks == 1   # CPU


def test_the_start_up_line_and_the_planner_show_chunks():
    cfg, run = _plan(6 << 20)
    assert "attention in 4 head chunks (auto)" in memory_options(cfg, run)
    cfg, run = _plan(1 << 20, "4")
    assert "attention in 4 head chunks" in memory_options(cfg, run)
    prediction = evaluate(cfg, 8, 80, 1769, Hardware(), ("triton",))
    assert prediction.row()["attention_head_chunks"] == 4 and "head-chunks=4" in _flags(prediction.row())
    assert "head-chunks" not in _flags(evaluate(_plan(1 << 20, "1")[0], 8, 80, 1769, Hardware(), ("triton",)).row())


class CountAttention(TorchDispatchMode):
    """The query heads SDPA's forward kernel runs over, summed over its calls (q is (B, H, S, D))."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in attention_kernels():
            self.heads["q"] += args[0].shape[1]
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_step_time_counts_each_chunks_recomputed_attention(checkpointing):
    """The attention forwards of a CPU training step (query heads run, over the heads of one forward), with 2
    head chunks against all heads at once, are what the step-time model counts: one forward more, in each
    chunk's backward, on top of checkpointing's. Its attention FLOPs are those forwards plus a backward of
    2.5 of one (torch.utils.flop_counter's count)."""
    overrides = [f"training.activation_checkpointing={str(checkpointing).lower()}", "training.global_batch_size=1"]
    forwards = {}
    for n in (1, 2):
        with CountAttention() as counter:
            one_step(overrides + [f"training.attention_head_chunks={n}"], 1)
        forwards[n] = counter.heads["q"] / (8 * 4)              # 8 query heads, 4 layers, 1 micro-batch
    assert forwards[2] == forwards[1] + 1 == (3 if checkpointing else 2)
    m = load_config(overrides=BASE).model
    flops = {n: step_time(m, Degrees(), Options(checkpointing=checkpointing, head_chunks=n),
                          PRECISIONS["fp32"], Workload(32), Hardware()).flops["attention"] for n in (1, 2)}
    assert flops[2] / flops[1] == pytest.approx((forwards[2] + 2.5) / (forwards[1] + 2.5))
