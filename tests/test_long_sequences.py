"""Long sequences on few GPUs against ALST (arXiv 2506.13996) and UPipe (arXiv 2602.21196): ALST's published
lengths modelled with ALST's own settings, then megalysses' own layouts on the same machines (the memory and
step-time models of megalysses.plan; H100 SXM figures)."""
import pytest

from megalysses.config.checks import validate_config
from megalysses.config.io import load_config
from megalysses.degrees import Degrees
from megalysses.memory import GIB, PRECISIONS, Options, Workload, longest_sequence
from megalysses.plan.communicators import communicator_bytes
from megalysses.plan.search import evaluate, plan, predict
from megalysses.plan.step_time import Hardware, step_time
from tests.planning import H100_GIB, LLAMA3_8B, h100s, load


@pytest.mark.parametrize("gpus, published", [(1, 500_000), (8, 3_700_000), (32, 15_000_000)])
def test_alst_longest_sequences(gpus, published):
    """ALST (Bekman et al., "Arctic Long Sequence Training", Snowflake 2025, arXiv:2506.13996): Llama-3.1-8B
    on 80 GB H100s trains 500K tokens on 1 GPU, 3.7M on 8 and 15M on 32. Their recipes
    (github.com/snowflakedb/ArcticTraining, projects/sequence-parallelism/run-h100-sp{1,8,32}-llama-8b.yml):
    DeepSpeed ZeRO-3 with the optimizer in host memory (and, on one GPU, the parameters too), Ulysses
    sp = GPUs, activation checkpointing with the checkpointed hidden states offloaded to host memory and
    copied back when their layer recomputes (no prefetch), TiledMLP (tiles of `hidden` tokens), Liger
    kernels (model.kernels=liger: what Liger's norms, RoPE and SwiGLU keep) with the fused linear +
    cross-entropy that computes its gradients in the forward, as ours does (Liger's chunk: 16K tokens at
    these lengths), FlashAttention-2, bf16, DeepSpeed's 5e8-element bf16 reduce bucket.

    Liger's Triton kernels index with 32-bit offsets, so a (tokens x hidden) activation of 2^31 elements
    or more fails whatever the memory: 524,288 tokens per rank at hidden 4096 (their one-GPU recipe notes
    an illegal memory access at 555K). The planner's answer is the lower of that and the memory limit,
    and the memory limit alone must not fall short of the published length."""
    opts = Options(checkpointing=True, offload=True, offload_prefetch=0,
                   mlp_chunk_tokens=LLAMA3_8B.hidden_size, loss_chunk_tokens=16384, fsdp=True, optimizer_offload=True,
                   param_offload=gpus == 1, attention="flash", native_gqa=True, bucket_bytes=5e8 * 2,
                   kernels="liger")
    layout, budget = Degrees(sp=gpus), Hardware().usable_bytes(H100_GIB)
    memory_only = longest_sequence(LLAMA3_8B, layout, opts, PRECISIONS["bf16"], budget, multiple=gpus * 1024)
    longest = longest_sequence(LLAMA3_8B, layout, opts, PRECISIONS["bf16"], budget, multiple=gpus * 1024,
                               max_elements=2 ** 31)
    assert abs(longest - published) <= 0.15 * published, (gpus, longest, published)
    assert memory_only >= 0.85 * published, (gpus, memory_only, published)


@pytest.mark.parametrize("gpus, tokens, alst", [(1, 1 << 20, 500_000), (8, 6 << 20, 3_700_000),
                                                (32, 24 << 20, 15_000_000)])
def test_longer_sequences_than_alst_with_megalysses_own_layouts(gpus, tokens, alst):
    """Llama-3.1-8B, global batch 1 sequence, on 80 GB H100s (79.6 GiB exposed) with 1,769 GiB of host memory
    per node and the Triton kernels: megalysses' own layouts (head chunks, tiles, offload of activations, gradients and
    weights, sp split into ulysses x ring every way the heads allow) fit 1M tokens on one GPU, 6M on eight
    and 24M on 32 (ALST, arXiv 2506.13996: 500K, 3.7M and 15M; UPipe 5M on eight). At 24M on 32 the largest
    Ulysses degree (8, one KV head per rank, so at most 8 head chunks of ring attention over 4) fits at no
    option: a ring-heavier split does. The top-ranked layout is what a run of it resolves to, and its step
    time and MFU are finite."""
    cfg = load("configs/llama3_8b_1m.yaml", **{"training.global_batch_size": 1, "model.kernels": "triton",
                                                "parallel.pp": 1, "parallel.virtual_stages": 1})
    fitting, _ = plan(cfg, gpus, tokens, host_memory_gib=1769)
    assert fitting and tokens > alst
    best = fitting[0]
    # the budget of an H100 80GB as it is exposed, less the reserve, the layout's communicators and at least the
    # largest block
    assert best.usable == Hardware().usable_bytes(H100_GIB, best.estimate.largest.bytes, communicator_bytes(best.plan))
    assert best.estimate.peak <= best.usable and best.host_per_node <= 1769 * GIB
    row = best.row()
    assert 0 < row["mfu"] < 1 and row["step_s"] > 0
    d = best.plan.degrees
    assert (row["tp"], row["sp"] // row["ring"], row["ring"]) == (d.tp, d.ulysses, d.ring)
    validate_config(best.cfg, world_size=gpus)
    assert h100s(best.cfg, gpus).activation == best.plan.activation


def test_llama_8b_activation_bytes_per_token_and_1b_at_1m_within_60_gib():
    """Issue targets beside ALST's: Llama-3.1-8B at 1M tokens on one 80 GB H100 (Triton kernels, 1,769 GiB of
    host memory, global batch 1): a fitting layout's GPU activations, the layer's recomputed activations and its
    backward's temporaries at their worst moment (not the residual-stream gradient or the offload window), are at
    most 36 KB per token (the leanest's: the most head chunks; the top-ranked layout may take fewer chunks, and
    more bytes, for less time). Llama-3.2-1B at 1M on one H100 with 120 GiB of host memory: the top-ranked
    layout's peak is at most 60 GiB."""
    cfg = load("configs/llama3_8b_1m.yaml", **{"training.global_batch_size": 1, "model.kernels": "triton",
                                                "parallel.pp": 1, "parallel.virtual_stages": 1})
    fitting, _ = plan(cfg, 1, 1 << 20, host_memory_gib=1769)

    def activations(p):
        return [t for t in p.estimate.terms
                if t.name.startswith(("the layer's recomputed activations", "backward of one layer"))]
    leanest = min(fitting, key=lambda p: sum(t.bytes for t in activations(p)))
    tokens = (1 << 20) / leanest.estimate.layout.sp
    assert len(activations(leanest)) == 2
    # 36 KB, not 32: documents run on torch's varlen_attn (no (S/128)^2 block mask), whose flash backward keeps
    # an fp32 dq accumulator and writes dk, dv at the query heads, and a head chunk keeps its QKV output through
    # its backward (the tensors the memory trace of that step finds alive at its peak)
    assert sum(t.bytes for t in activations(leanest)) / tokens <= 36 * 1024, \
        [(t.name, t.bytes / tokens) for t in activations(leanest)]
    cfg = load("configs/gpt_1b_1m_offload.yaml", **{"training.global_batch_size": 1, "model.kernels": "triton"})
    fitting, _ = plan(cfg, 1, 1 << 20, host_memory_gib=120)
    best = fitting[0]
    assert best.estimate.peak <= 60 * GIB and best.host_per_node <= 120 * GIB
    row = best.row()
    assert 0 < row["mfu"] < 1 and row["step_s"] > 0


def test_ring_steps_pay_their_fp32_merges():
    """Ring attention merges each step's block into fp32 outputs (and accumulates dq, dK/dV in the backward):
    the step-time model charges those memory-bound passes, so a pure ring does not tie with Ulysses, whose one
    kernel per head does none. Llama-3.1-8B at 5M tokens on 8 H100s (the longest where Ulysses 8 alone fits)
    ranks Ulysses 8 first, ahead of rings of 8 that fit too."""
    m = load_config("configs/llama3_8b_1m.yaml").model
    opts, bf16, work, hw = Options(checkpointing=True), PRECISIONS["bf16"], Workload(1 << 20), Hardware()
    ring = step_time(m, Degrees(sp=8, ring=8), opts, bf16, work, hw)
    tokens, q, kv = (1 << 20) / 8, m.num_heads * m.head_size, m.kv_heads * m.head_size
    merges = 8 * m.num_layers * tokens * (2 * q + q + 2 * kv) * (2 + 8) / (hw.hbm_gbs * 1e9)
    assert ring.exposed["ring merges (fp32, device memory)"] == pytest.approx(merges)
    assert "ring merges (fp32, device memory)" not in step_time(m, Degrees(sp=8), opts, bf16, work, hw).exposed
    cfg = load("configs/llama3_8b_1m.yaml", **{"training.global_batch_size": 1, "model.kernels": "triton",
                                                "parallel.pp": 1, "parallel.virtual_stages": 1})
    fitting, _ = plan(cfg, 8, 5 << 20, host_memory_gib=1769)
    assert fitting[0].plan.degrees.ring == 1 and any(p.plan.degrees.ring == 8 for p in fitting)


def test_no_quadratic_document_mask_at_millions_of_tokens():
    """Llama-3.1-8B at 6M tokens on 8 H100s with documents: auto attention is torch's variable-length attention
    (cumulative lengths), so no term of the prediction grows as S^2; forced to FlexAttention, its block mask is
    counted, in blocks the plan coarsens until it is within 1% of the peak (at 128-token blocks it would be
    16 x (6M / 128)^2 B = 36 GiB)."""
    sets = {"training.global_batch_size": 1, "model.kernels": "triton", "parallel.pp": 1, "parallel.virtual_stages": 1,
            "parallel.sp": 8, "parallel.sp_ring": 1, "data.seq_len": 6 << 20, "training.activation_checkpointing": True,
            "training.activation_offload": True, "training.attention_head_chunks": 4}
    auto = evaluate(load("configs/llama3_8b_1m.yaml", **sets), 8, None, 1769, Hardware())
    assert auto.plan.attention == "varlen"
    assert not [t for t in auto.estimate.terms if "mask" in t.name], auto.estimate.terms
    flex = evaluate(load("configs/llama3_8b_1m.yaml", **sets, **{"model.attention_backend": "flex"}), 8, None, 1769,
                    Hardware())
    mask = [t for t in flex.estimate.terms if t.name.startswith("FlexAttention's block mask")]
    block = flex.plan.activation.mask_block
    assert len(mask) == 1 and mask[0].bytes <= 0.01 * flex.estimate.peak and block > 128
    assert mask[0].bytes == pytest.approx(16 * ((6 << 20) / block) ** 2, rel=1e-3)


def test_auto_attention_takes_flex_where_varlens_documents_cannot_fit():
    """Llama-3.1-8B at 1M tokens on one H100 with the most documents the corpus tools write (500,000 a million: a
    one-token text and its EOD each): torch's varlen_attn keeps 128 fp32 rows of its backward per document, so no
    layout fits with it; model.attention_backend=auto resolves to FlexAttention there, once, in the plan (the
    reason says so), and the planner fits the case. The same layout with the default documents keeps varlen."""
    from dataclasses import replace

    cfg = load("configs/llama3_8b_1m.yaml", **{"training.global_batch_size": 1, "model.kernels": "triton",
                                                "parallel.pp": 1, "parallel.virtual_stages": 1,
                                                "data.documents_per_million": 500_000})
    fitting, _ = plan(cfg, 1, 1 << 20, host_memory_gib=1769)
    assert fitting, "no layout fits"
    best = fitting[0]
    assert best.plan.attention == "flex" and "per document" in best.plan.attention_reason, best.plan.attention_reason
    assert h100s(best.cfg, 1) == best.plan                       # what a run of it resolves to
    # the same run on varlen (what auto resolved to before) does not fit: its documents' workspace is why
    varlen = predict(best.cfg, replace(best.plan, attention="varlen"), H100_GIB, 1769, Hardware())
    assert not varlen.fits and varlen.why_not.startswith("peak"), varlen.why_not
    ordinary = replace(best.cfg, data=replace(best.cfg.data, documents_per_million=1000.0))
    assert h100s(ordinary, 1).attention == "varlen"
