"""Ring attention and sp = ulysses x ring: the zigzag layout and padding, the block kernels with their
log-sum-exp, the merge, the ring on real gloo ranks (exchanges posted before compute, bytes equal to the
closed form), the backend choice, and training through torchrun equal to one process."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megalysses.config import ConfigError
from megalysses.config.io import load_config
from megalysses.grid import ParallelGrid
from megalysses.degrees import Degrees
from megalysses.kernels import attention, block_attention as blocks
from megalysses.kernels.attention import core_attention
from megalysses.kernels.block_attention import AttentionBlock, merge_block
from megalysses.parallel.sequence_layout import IGNORE_INDEX, SequenceLayout, shard_sample
from megalysses.plan import Machine
from megalysses.plan.run_plan import choose_attention
from megalysses.testing import run_distributed
from megalysses.training.runtime import startup_line, write_runtime
from megalysses.testing import resolve_run
from tests import ring_oracle
from tests.ring_oracle import blockwise_attention
from tests.parity import (GQA_2_PER_RANK, MQA, ONE_HEAD, QWEN, THREE_HEADS, case, check_model_parity, check_run, logged,
                          model_parity_worker)

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("bench_ulysses_comm", ROOT / "benchmarks" / "bench_ulysses_comm.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


# the model matrix at sp up to 8 (see test_model_parity.py); cases on fewer ranks leave the rest idle
PARITY_ON_8 = [
    case(1, 8, True, model={**MQA, **QWEN, "sliding_window": 70}, seq_len=250),   # ulysses 2 x ring 4
    case(2, 4, True, True, tied=True, sp_ring=2, seq_len=61),         # tp 2 x ulysses 2 x ring 2
    case(1, 8, True, sp_ring=8, seq_len=47, tile=5),                  # ring 8, GQA
    case(1, 4, True, model=MQA, sp_ring=4, seq_len=37),               # ring 4 x dp 2, MQA
    case(1, 3, True, seq_len=40, world=3),                            # 8 heads over 3 ranks: ring 3
    case(1, 5, True, model=ONE_HEAD, seq_len=23, world=5),
    case(1, 6, True, model=THREE_HEADS, seq_len=50, world=6),         # ulysses 3 x ring 2
    case(1, 7, False, model=MQA, seq_len=45, world=7),
    # tp 2 x ulysses 2 x ring 2 in 2 head chunks (each chunk's KV head replicated), checkpointed
    case(2, 4, True, True, sp_ring=2, seq_len=61, model=GQA_2_PER_RANK, chunks=2, ckpt=True),
]


def qkv(B=2, S=48, hq=4, hkv=2, D=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, S, h, D, generator=g).to(dtype).requires_grad_() for h in (hq, hkv, hkv)]


def doc_ids(S=48):
    """Row 0: documents of 10, 20 and 18 tokens; row 1: 5, 1, 30 and the rest. Some queries then have no
    allowed key in some ring blocks (empty rows)."""
    return torch.tensor([[0] * 10 + [1] * 20 + [2] * (S - 30), [0] * 5 + [1] + [2] * 30 + [3] * (S - 36)])


def grads(out, inputs, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.autograd.grad(out, inputs, torch.randn(out.shape, generator=g).to(out.dtype))


def close(got, want, tol=1e-5):
    return ((got - want).abs().max() / want.abs().max()).item() <= tol


# ----------------------------------------------------------------------------- layout and padding

@pytest.mark.parametrize("sp,ring,tp_shard", [(1, 1, 1), (4, 1, 2), (4, 2, 1), (4, 4, 1), (6, 2, 1), (8, 4, 2),
                                              (3, 3, 1), (7, 7, 1)])
def test_layout_partitions_the_padded_sequence(sp, ring, tp_shard):
    layout = SequenceLayout(Degrees(tp=tp_shard, sp=sp, ring=ring), tp_sequence_parallel=True)
    for seq_len in (1, 29, 64, 250):
        S = layout.padded_len(seq_len)
        assert S >= seq_len and S - seq_len < layout.multiple and S % (sp * tp_shard) == 0
        per_rank = [layout.positions(S, r) for r in range(sp)]
        assert sorted(np.concatenate(per_rank).tolist()) == list(range(S))
        if ring == 1:
            assert per_rank[0].tolist() == list(range(S // sp))            # Ulysses alone: contiguous slices
            continue
        c = S // (2 * ring)
        for i in range(ring):                                              # zigzag: chunks i and 2r-1-i
            block = np.concatenate(per_rank[i * (sp // ring):(i + 1) * (sp // ring)])
            mirror = list(range((2 * ring - 1 - i) * c, (2 * ring - i) * c))
            assert block.tolist() == list(range(i * c, (i + 1) * c)) + mirror
            assert np.array_equal(block, layout.ring_positions(S, i))


def test_shard_sample_pads_with_masked_labels_and_a_document_of_its_own():
    layout = SequenceLayout(Degrees(sp=4, ring=2))                         # multiple lcm(4, 4) = 4
    inputs = np.arange(10, 20)[None]
    labels = np.arange(11, 21)[None]
    labels[0, 0] = IGNORE_INDEX
    pos = np.arange(10)[None]
    docs = np.array([[0] * 6 + [1] * 4])
    shards = [shard_sample(layout, r, inputs, labels, pos, docs, pad_id=99) for r in range(4)]
    S = layout.padded_len(10)
    assert S == 12
    order = np.concatenate([layout.positions(S, r) for r in range(4)])
    full = {k: np.empty((1, S), dtype=np.int64) for k in ("input_ids", "labels", "position_ids")}
    for k in full:
        full[k][:, order] = np.concatenate([s[k] for s in shards], axis=1)
    assert full["input_ids"].tolist() == [list(range(10, 20)) + [99, 99]]
    assert full["labels"].tolist() == [[IGNORE_INDEX] + list(range(12, 21)) + [IGNORE_INDEX] * 2]
    assert full["position_ids"].tolist() == [list(range(12))]
    assert all(s["doc_ids"].tolist() == [[0] * 6 + [1] * 4 + [2] * 2] for s in shards)


# ----------------------------------------------------------------------------- blocks, merge, the ring on one device

@pytest.mark.parametrize("backend", ["reference", "sdpa"])
@pytest.mark.parametrize("ring", [1, 2, 3, 4])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (4, 1), (2, 2)])
def test_blockwise_equals_single_pass(backend, ring, hq, hkv):
    """The ring's blocks, kernels, merge and backward, run for every ring rank on one device, equal plain
    attention: outputs and q/k/v gradients, causal and with packed documents (empty rows included), with and
    without a sliding window (blocks wholly outside it are empty)."""
    for docs, window in ((None, 0), (doc_ids(), 0), (None, 3), (doc_ids(), 5)):
        q, k, v = qkv(hq=hq, hkv=hkv)
        want = core_attention(q, k, v, doc_ids=docs, backend="reference", window=window)
        got = blockwise_attention(q, k, v, ring, doc_ids=docs, backend=backend, window=window)
        assert close(got, want), (docs is not None, window, (got - want).abs().max())
        for g, w in zip(grads(got, (q, k, v)), grads(want, (q, k, v))):
            assert close(g, w), (docs is not None, window, (g - w).abs().max())


def test_flex_blocks_forward_and_their_backward_formula(monkeypatch):
    """FlexAttention's blocks with their LSE (forward, eager on CPU), and the flex backward (re-run the block,
    differentiate through out and LSE) with a differentiable stand-in for the kernel, since torch has no
    FlexAttention backward on CPU."""
    if "flex" not in attention.available_backends("cpu"):
        pytest.skip("this torch has no FlexAttention")
    q, k, v = qkv(D=16)
    with torch.no_grad():                     # documents: blocks of every shape, masked, with empty rows
        want = core_attention(q, k, v, doc_ids=doc_ids(), backend="reference")
        assert close(blockwise_attention(q, k, v, 2, doc_ids=doc_ids(), backend="flex"), want)
        want = core_attention(q, k, v, doc_ids=doc_ids(), backend="reference", window=5)       # and a window
        assert close(blockwise_attention(q, k, v, 2, doc_ids=doc_ids(), backend="flex", window=5), want)

    # the stand-in: reference math with out and LSE both differentiable, shaped as FlexAttention's
    def stand_in(q_, k_, v_, block, scale):
        o, block_lse, _ = blocks._reference_forward(*(t.transpose(1, 2) for t in (q_, k_, v_)), block, scale)
        return o.transpose(1, 2), block_lse

    monkeypatch.setattr(AttentionBlock, "flex_mask", lambda self, sq, sk, device: self)
    monkeypatch.setattr(blocks, "_flex_call", stand_in)
    monkeypatch.setattr(ring_oracle, "check_backend", lambda *args, **kwargs: None)   # no flex backward on CPU
    for docs in (None, doc_ids()):
        want = core_attention(q, k, v, doc_ids=docs, backend="reference")
        got = blockwise_attention(q, k, v, 4, doc_ids=docs, backend="flex")
        assert close(got, want)
        for g, w in zip(grads(got, (q, k, v)), grads(want, (q, k, v))):
            assert close(g, w)


def test_merge_is_exact_and_empty_rows_weigh_nothing():
    B, S, H, D = 1, 3, 1, 2
    out, lse = torch.zeros(B, S, H, D), torch.full((B, H, S), float("-inf"))
    a, la = torch.randn(B, S, H, D), torch.tensor([[[0.5, float("-inf"), float("-inf")]]])
    b, lb = torch.randn(B, S, H, D), torch.tensor([[[1.5, 2.0, float("-inf")]]])
    merge_block(out, lse, a, la)
    merge_block(out, lse, b, lb)
    total = torch.logaddexp(la, lb)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(total)) and torch.allclose(lse[0, 0, :2], total[0, 0, :2])
    want0 = (torch.exp(la[0, 0, 0] - total[0, 0, 0]) * a[0, 0] + torch.exp(lb[0, 0, 0] - total[0, 0, 0]) * b[0, 0])
    assert torch.allclose(out[0, 0], want0) and torch.allclose(out[0, 1], b[0, 1])
    assert torch.equal(out[0, 2], torch.zeros(1, 2))


def test_sdpa_blocks_report_empty_rows_as_minus_infinity():
    """torch's CPU flash kernel reports LSE 0 for a row with no allowed key; the block kernel must not."""
    q, k, v = (t.detach() for t in qkv(S=8))
    docs_q, docs_k = torch.tensor([[0] * 4 + [1] * 4] * 2), torch.tensor([[1] * 8] * 2)
    block = AttentionBlock(False, docs_q, docs_k)
    out, lse, _ = blocks.block_attention(q, k, v, block, "sdpa", 0.3)
    ref_out, ref_lse, _ = blocks.block_attention(q, k, v, block, "reference", 0.3)
    assert torch.isneginf(lse[..., :4]).all() and torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    assert torch.allclose(out, ref_out, atol=1e-6)


# ----------------------------------------------------------------------------- the backend choice and the run plan

def test_ring_layouts_choose_a_backend_that_returns_the_lse():
    plain, cpu = Machine.described("H100"), Machine.described(None)     # a plain torch install: no flash-attn
    with_flash = Machine.described("H100", packages=("flash_attn", "triton"))

    def select(requested, machine, dtype, head_dim=64, **kw):
        return choose_attention(requested, machine, dtype, head_dim, ring=True, **kw)[0]

    assert select("auto", cpu, "float32", has_docs=True) == "sdpa"
    assert select("auto", plain, "bfloat16") == "sdpa"
    assert select("auto", plain, "bfloat16", has_docs=True) == "flex"
    assert select("auto", plain, "float32") == "flex"
    assert select("auto", plain, "float32", 12, has_docs=True) == "reference"
    with pytest.raises(ConfigError, match="'sdpa' runs ring-attention blocks on CUDA .* no packed-document mask"):
        select("sdpa", plain, "bfloat16", has_docs=True)
    assert choose_attention("auto", with_flash, "bfloat16", 64)[0] == "flash"
    assert select("auto", with_flash, "bfloat16") == "sdpa"
    with pytest.raises(ConfigError, match="'flash' cannot run the blocks of ring attention"):
        select("flash", with_flash, "bfloat16")


def test_run_plan_prints_and_records_the_factorisation(tmp_path):
    cfg = load_config(overrides=["data.mock=true", "data.seq_len=250", "model.hidden_size=64", "model.num_heads=2",
                                 "model.num_kv_heads=1", "parallel.sp=4"])
    rt = resolve_run(cfg, torch.device("cpu"))
    assert (rt.degrees.ulysses, rt.degrees.ring, rt.padded_seq_len, rt.attention) == (2, 2, 252, "sdpa")
    grid = ParallelGrid.single()
    with pytest.raises(ConfigError, match="ulysses 1 x ring 1 but the config resolves to ulysses 2 x ring 2"):
        resolve_run(cfg, torch.device("cpu"), grid)
    assert "sp = ulysses 2 x ring 2, seq_len 250 padded to 252" in startup_line(cfg, grid, rt)
    flash = load_config(overrides=["data.mock=true", "model.hidden_size=64", "model.num_heads=2",
                                   "model.num_kv_heads=1", "parallel.sp=4", "model.attention_backend=flash"])
    with pytest.raises(ConfigError, match=r"model.attention_backend=flash: .* \(this layout runs ring attention: "
                                          r"parallel.sp=4 = ulysses 2 x ring 2\)"):
        resolve_run(flash, torch.device("cpu"))
    write_runtime(tmp_path, cfg, grid, rt)
    record = json.loads((tmp_path / "runtime.json").read_text())
    assert (record["ulysses"], record["ring"], record["padded_seq_len"]) == (2, 2, 252)


# ----------------------------------------------------------------------------- on gloo ranks

def _ring_worker(rank, world, shape, parity_cases):
    from megalysses.parallel import ring as ring_module
    from megalysses.parallel.ring import RingMask, ring_attention
    from megalysses.parallel.ulysses import prepare_sequence_mask, ulysses_attention

    out = {}
    # sp = 8 as ring 8, ulysses 2 x ring 4 and ulysses 4 x ring 2 (the all-to-all around the ring)
    for ring in (8, 4, 2):
        grid = ParallelGrid(Degrees(sp=world, ring=ring))
        layout = grid.sequence_layout(False)
        for backend, dtype in (("reference", torch.float32), ("sdpa", torch.float32), ("sdpa", torch.bfloat16)):
            for docs in (None, doc_ids()):
                q, k, v = qkv(hq=4, hkv=1, dtype=dtype)
                want = core_attention(*(t.float() for t in (q, k, v)), doc_ids=docs, backend="reference")
                pos = torch.from_numpy(layout.positions(48, grid.sp_rank))
                mine = [t.detach()[:, pos].clone().requires_grad_() for t in (q, k, v)]
                mask = prepare_sequence_mask(docs, backend, grid.ulysses_group, grid.ring_group, len(pos))
                def attn(q_, k_, v_, g=grid, m=mask, b=backend):
                    return ring_attention(q_, k_, v_, g.ring_group, m, b)
                got = ulysses_attention(*mine, grid.ulysses_group, attn)
                tol = 1e-5 if dtype == torch.float32 else 3e-2
                ok = close(got.float(), want[:, pos], tol)
                upstream = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
                local = torch.autograd.grad(got, mine, upstream[:, pos].to(dtype))
                for g, w in zip(local, torch.autograd.grad(want, (q, k, v), upstream)):
                    ok = ok and close(g.float(), w[:, pos].float(), tol)
                out[(ring, backend, str(dtype), docs is not None)] = ok

    # every exchange is posted before the block it overlaps is computed, forward and backward
    grid = ParallelGrid(Degrees(sp=world, ring=world))
    events = []
    real_exchange, real_forward, real_backward = (ring_module.comm.ring_exchange, ring_module.block_attention,
                                                  ring_module.block_attention_backward)

    def exchange(tensors, group):
        events.append("post")
        return real_exchange(tensors, group)

    ring_module.comm.ring_exchange = exchange
    ring_module.block_attention = lambda *a: (events.append("fwd"), real_forward(*a))[1]
    ring_module.block_attention_backward = lambda *a: (events.append("bwd"), real_backward(*a))[1]
    try:
        q, k, v = (t.detach()[:, :6].clone().requires_grad_() for t in qkv())
        ring_attention(q, k, v, grid.ring_group, RingMask(None, grid.ring_rank, world, 48), "sdpa").sum().backward()
    finally:
        ring_module.comm.ring_exchange, ring_module.block_attention = real_exchange, real_forward
        ring_module.block_attention_backward = real_backward
    out["events"] = events

    # bytes sent by one attention layer at each split of sp, counted on gloo
    out["bytes"] = {ring: bench.count_layer(rank, world, shape, ring) for _, ring in bench.factorisations(shape, world)}
    # the whole model at sp up to 8 (test_model_parity's matrix), in the same group of ranks
    out["parity"] = model_parity_worker(rank, world, parity_cases)
    return out


def test_ring_on_8_ranks(tmp_path):
    shape = {"seq_len": 64, "batch": 1, "hidden": 64, "heads": 4, "kv_heads": 1}
    results = run_distributed(_ring_worker, 8, tmp_path, args=(shape, PARITY_ON_8), timeout=600)
    for out in results:
        bad = [key for key, ok in out.items() if isinstance(key, tuple) and not ok]
        assert not bad, f"(ring, backend, dtype, documents) differing from the reference: {bad}"
        # forward: post + block, the last block without an exchange; backward: post before every block,
        # then the hop that brings dK/dV home
        assert out["events"] == ["post", "fwd"] * 7 + ["fwd"] + ["post", "bwd"] * 8 + ["post"], out["events"]
    splits = bench.factorisations(shape, 8)
    assert [r for _, r in splits] == [2, 4, 8]                              # 4 x 2, 2 x 4, 1 x 8 with 4 query heads
    for u, r in splits:
        want = bench.closed_form(shape, 8, u, r)
        assert want["ring_fwd"] > 0 and (u == 1) == (want["ulysses_fwd"] == 0)
        for out in results:
            got = out["bytes"][r]
            assert all(got[key] == want[key] for key in bench.KEYS), (u, r, got, want)
    check_model_parity([out["parity"] for out in results], PARITY_ON_8)


# ----------------------------------------------------------------------------- through torchrun

def test_torchrun_ulysses_times_ring_equals_one_process(tmp_path):
    """The issue's example, 2 query heads and 1 KV head at sp=4 with 250 tokens (ulysses 2 x ring 2, padded
    to 252), trains as one process does: losses, gradient norms and the validation loss in metrics.jsonl;
    tools/generate.py then samples from its checkpoint in one process."""
    sets = ["data.mock=true", "data.seq_len=250", "model.vocab_size=512", "model.hidden_size=32", "model.num_layers=2",
            "model.num_heads=2", "model.num_kv_heads=1", "training.global_batch_size=2", "training.micro_batch_size=1",
            "training.train_steps=2", "optimizer.warmup_steps=1", "logging.log_interval=1", "training.eval_interval=2",
            "training.eval_steps=1", "parallel.timeout_seconds=60", "checkpoint.save_interval=0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = {}
    for name, nproc, extra in (("one", 1, []), ("sp4", 4, ["parallel.sp=4", "parallel.sp_ring=2"])):
        run = tmp_path / name
        args = [a for s in sets + extra + [f"logging.run_dir={run}"] for a in ("--set", s)]
        launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else []
        cmd = [sys.executable, *launch, str(ROOT / "pretrain.py"), *args]
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        runs[name] = r.stdout
    assert "sp = ulysses 2 x ring 2, seq_len 250 padded to 252" in runs["sp4"]
    check_run(logged(tmp_path / "one"), logged(tmp_path / "sp4"), "sp4", steps=2, evals=1,
              quantities=("losses", "grad_norms", "val_losses"))
    gen = subprocess.run([sys.executable, str(ROOT / "tools" / "generate.py"), "--run", str(tmp_path / "sp4"),
                          "--prompt", "ab", "--max-new-tokens", "3", "--temperature", "0"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert gen.returncode == 0 and "sampled from" in gen.stdout, gen.stdout + gen.stderr
