"""benchmarks/per_pair_masks.py: the old path of a ring's FlexAttention block masks (create_block_mask's mask_mod
on every pair, built again at every use), reinstated in a trace through its kernels' forms for bench_trace.py's
before-and-after comparison. At a small ring, counted by hand: one build per use of a block (forward, the
checkpointed layer's recomputation, the head chunk's recomputation, the block's backward) in every layer and head
chunk, each Sq x Sk evaluations, where today's path builds each ring block's mask once and keeps it."""
import pytest

from benchmarks.per_pair_masks import Builds, per_pair_forms
from megalysses.config.io import load_config
from megalysses.plan import Machine
from megalysses.plan.step_time import Hardware
from megalysses.training.roofline import CUDA_CORE_SHARE, MASK_EVALUATION_OPS
from megalysses.training.trace import roofline_fields, trace_run

HW = Hardware()
LAYERS, CHUNKS, RING, SEQ = 2, 2, 2, 4096
RING_CASE = ["data.mock=true", "model.vocab_size=512", "model.hidden_size=128", f"model.num_layers={LAYERS}",
             "model.num_heads=4", "model.num_kv_heads=2", "model.ffn_hidden_size=320", "training.micro_batch_size=1",
             f"data.seq_len={SEQ}", "training.dtype=bfloat16", "training.activation_checkpointing=true",
             f"parallel.sp={RING}", f"parallel.sp_ring={RING}", "training.global_batch_size=1",
             f"training.attention_head_chunks={CHUNKS}"]


@pytest.fixture(autouse=True)
def triton_kernels_for_the_interpreter(monkeypatch):
    """The trace runs the kernels' fake forms, but the first import of a kernel module decorates its kernels for
    good: under Triton's CPU interpreter, so that later tests in this process can run them on CPU tensors."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_per_pair_masks_are_built_at_every_use_of_a_ring_block():
    cfg = load_config(overrides=RING_CASE)
    machine = Machine.described("H100", packages=("triton",))
    after = trace_run(cfg, machine, RING, hw=HW)
    builds = Builds()
    before = trace_run(cfg, machine, RING, hw=HW, forms=per_pair_forms(builds))
    plan = after[0].plan
    assert plan.attention == "flex" and plan.degrees.ring == RING and plan.micro_batches == 1
    # rank 0 of the zigzag ring: its own block causal (s x s), the next one's by the half of its queries (s/2 x s)
    s = SEQ // RING
    uses = 4                    # forward, the layer's recomputation, the head chunk's, the block's backward
    assert builds.kept == RING                                         # today's: one a ring block and step
    assert builds.per_pair == LAYERS * CHUNKS * RING * uses
    per_use = s * s + (s // 2) * s
    assert builds.evaluations == LAYERS * CHUNKS * uses * per_use
    fa, fb = roofline_fields(after), roofline_fields(before)
    assert fa["traced_mask_evaluations"] == 0 and fb["traced_mask_evaluations"] == builds.evaluations
    evaluating = builds.evaluations * MASK_EVALUATION_OPS / (HW.peak_tflops * 1e12 * CUDA_CORE_SHARE)
    masks_b, masks_a = fb["traced_step_breakdown"]["masks"], fa["traced_step_breakdown"]["masks"]
    assert evaluating < masks_b < evaluating + 1e-3 and masks_a < evaluating
    for category in ("compute", "attention", "communication", "optimizer"):     # nothing else changes
        assert fb["traced_step_breakdown"][category] == pytest.approx(fa["traced_step_breakdown"][category])
    assert fb["traced_launches"] > fa["traced_launches"] + builds.per_pair


def test_bench_trace_refuses_per_pair_masks_without_a_ring():
    """The old per-use build stands for a ring block's mask only (attention without a ring built its mask once per
    step before too): a layout without a ring is refused in one error line, before any trace."""
    from benchmarks import bench_trace
    from megalysses.plan.machine import device_memory_gib

    with pytest.raises(SystemExit) as e:
        bench_trace.measure("quickstart", HW, device_memory_gib("H100"), masks="per-pair")
    assert str(e.value).startswith("error: --masks per-pair") and "ring1" in str(e.value) and "\n" not in str(e.value)
