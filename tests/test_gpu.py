"""The GPU tier: what only a CUDA device can show. Marked `gpu` and skipped without one.

    make test-gpu        # = pytest -m gpu tests (on a machine with a CUDA GPU)

The rest of the suite runs on a CUDA machine too (`make test`): the kernel and attention-backend tests
then compare the Triton kernels and compiled FlexAttention on the GPU against the references.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megalysses.config.io import load_config
from megalysses.testing import run_distributed
from megalysses.testing import resolve_run
from megalysses.model.policies import activation_offload, apply_activation_policy
from megalysses.plan import ActivationPolicy
from tests.fixtures import metrics

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU tier)")]
TINY = ["data.mock=true", "data.seq_len=256", "model.vocab_size=1000", "model.hidden_size=256", "model.num_layers=2",
        "model.num_heads=4", "model.num_kv_heads=2", "training.global_batch_size=4", "training.micro_batch_size=2",
        "logging.log_interval=1", "parallel.timeout_seconds=120", "optimizer.warmup_steps=2"]


def _sets(overrides):
    return [a for o in overrides for a in ("--set", o)]


@pytest.mark.timeout(900)   # compiles and several processes
def test_pretrain_on_one_gpu_with_nccl_kernels_eval_checkpoint_and_resume(tmp_path):
    """torchrun on one GPU: NCCL, bf16 weights, Triton kernels, validation, a checkpoint, a resume."""
    run = tmp_path / "run"
    base = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
            str(ROOT / "pretrain.py")]
    sets = TINY + ["model.kernels=triton", "training.eval_interval=4", "training.eval_steps=1",
                   "checkpoint.save_interval=4", f"logging.run_dir={run}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.run(base + _sets(sets + ["training.train_steps=4"]), cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    runtime = json.loads((run / "runtime.json").read_text())
    assert runtime["device"].startswith("cuda") and runtime["dtype"] == "bfloat16" and runtime["kernels"] == "triton"
    second = subprocess.run(base + _sets(sets + ["training.train_steps=8"]), cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resumed from" in second.stdout
    losses = [r["loss"] for r in metrics(run) if "loss" in r]
    assert len(losses) == 8 and all(x == x and x < 1e3 for x in losses)
    assert any("val_loss" in r for r in metrics(run))


def _gloo_on_gpu_worker(rank, world, run_dir):
    from megalysses import comm
    from megalysses.degrees import Degrees
    from megalysses.grid import ParallelGrid
    from megalysses.training import loop

    def on_the_gpu(op, group, *tensors):      # gloo takes CPU tensors too: here every one must be on the GPU
        for t in tensors:
            if t.device.type != "cuda":
                raise RuntimeError(f"{op}: a tensor on {t.device} was handed to a collective")

    comm.check_device = on_the_gpu
    torch.cuda.set_device(0)
    cfg = load_config(overrides=TINY + ["parallel.tp=2", "training.train_steps=3", "training.dtype=bfloat16",
                                        f"logging.run_dir={run_dir}"])
    grid = ParallelGrid(Degrees.of_world(world, tp=2))
    return loop.train(cfg, resolve_run(cfg, torch.device("cuda", 0), grid), grid, torch.device("cuda", 0))["loss"]


def test_two_ranks_on_one_gpu_keep_every_tensor_on_it(tmp_path):
    """NCCL refuses two ranks on one GPU; gloo carries CUDA tensors for all-reduce, so tp=2 (all-reduces
    only) trains with every tensor, collectives' included, on the GPU (what NCCL's device check would
    ask, asked of every tensor our collectives are given)."""
    losses = run_distributed(_gloo_on_gpu_worker, 2, tmp_path, args=(str(tmp_path / "run"),), timeout=300)
    assert losses[0] == losses[1] and losses[0] == losses[0]


def _curve(tmp: Path, dtype: str) -> list[float]:
    from megalysses.grid import ParallelGrid
    from megalysses.training import loop

    cfg = load_config(overrides=TINY + ["training.train_steps=50", f"training.dtype={dtype}", "optimizer.lr=1e-3",
                                        f"logging.run_dir={tmp / dtype}"])
    loop.train(cfg, resolve_run(cfg, torch.device("cuda", 0)), ParallelGrid.single(), torch.device("cuda", 0))
    return [r["loss"] for r in metrics(tmp / dtype) if "loss" in r]


def _curves_worker(rank, world, tmp):
    torch.cuda.set_device(0)
    return {dtype: _curve(Path(tmp), dtype) for dtype in ("float32", "bfloat16")}


BF16_CURVE_TOLERANCE = 0.03   # relative, per step, averaged over the last 10 of 50 steps


@pytest.mark.timeout(900)   # compiles and several processes
def test_bf16_training_tracks_fp32(tmp_path):
    """A small model's loss over 50 steps in bf16 (bf16 weights and activations, fp32 masters) stays
    within 3% of the fp32 run's, averaged over the last 10 steps, and both learn."""
    curves = run_distributed(_curves_worker, 1, tmp_path, args=(str(tmp_path),), timeout=600)[0]
    fp32, bf16 = curves["float32"], curves["bfloat16"]
    assert len(fp32) == len(bf16) == 50 and fp32[-1] < fp32[0] - 1.0
    rel = [abs(a - b) / b for a, b in zip(bf16[-10:], fp32[-10:])]
    assert sum(rel) / len(rel) <= BF16_CURVE_TOLERANCE, (bf16[-10:], fp32[-10:])


def _flex_curriculum_worker(rank, world, run_dir):
    import torch._dynamo

    from megalysses.grid import ParallelGrid
    from megalysses.training import loop

    from megalysses.training import runtime

    torch.cuda.set_device(0)
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = 1              # every specialisation past the first must be the run's reservation,
    dynamo.fail_on_recompile_limit_hit = True   # and running past it fails instead of going unfused
    runtime.DYNAMO_DEFAULT_LIMIT = 0        # with no slack for other functions: the budget alone covers flex
    cfg = load_config(overrides=TINY + [
        "model.attention_backend=flex", "data.document_mask=true", "data.seq_len=512", "training.train_steps=4",
        "data.seq_len_schedule=[[0, 64], [1, 128], [2, 256], [3, 512]]", "training.eval_interval=2",
        "training.eval_steps=1", f"logging.run_dir={run_dir}"])
    loop.train(cfg, resolve_run(cfg, torch.device("cuda", 0)), ParallelGrid.single(), torch.device("cuda", 0))
    return [r["seq_len"] for r in metrics(Path(run_dir)) if "loss" in r]


@pytest.mark.timeout(900)   # compiles and several processes
def test_compiled_flex_through_a_curriculum_stays_compiled(tmp_path):
    """Four lengths with packed documents, validation between them: compiled FlexAttention specialises for
    each shape and grad mode, and with dynamo's limit at 1 the run's own reservation must cover them all."""
    lengths = run_distributed(_flex_curriculum_worker, 1, tmp_path, args=(str(tmp_path / "run"),), timeout=600)[0]
    assert lengths == [64, 128, 256, 512]


def test_attention_auto_on_this_gpu_can_run_every_head_dim():
    """auto never picks a backend that fails on the shape: run it for head dims Inductor and flash-attn
    treat differently, with packed documents, forward and backward."""
    from megalysses.kernels.attention import core_attention, prepare_attention_mask
    from megalysses.plan import Machine
    from megalysses.plan.run_plan import choose_attention

    for D in (8, 16, 48, 64, 128):
        backend = choose_attention("auto", Machine.current("cuda"), "bfloat16", head_dim=D, has_docs=True)[0]
        q, k, v = (torch.randn(1, 256, h, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for h in (4, 2, 2))
        doc_ids = torch.cat([torch.zeros(100, dtype=torch.long), torch.ones(156, dtype=torch.long)])[None].cuda()
        mask = prepare_attention_mask(doc_ids, backend)
        core_attention(q, k, v, mask=mask, backend=backend).float().square().sum().backward()
        assert q.grad is not None and torch.isfinite(q.grad).all(), (D, backend)


# ----------------------------------------------------------------------------- pinned host memory

def test_pinned_memory_is_registered_exactly_and_copies_asynchronously():
    """megalysses' pinned host memory (accelerator.Host.pinned_empty, and the arena a run slices from it) is
    plain host memory of exactly the bytes asked, registered with CUDA: torch sees it pinned (every slice), a
    non-blocking copy into it returns before the copy has run (from pageable memory it would wait), and torch's
    caching host allocator, which would round 768 MiB up to 1 GiB, holds none of it."""
    from megalysses.pinned_arena import PinnedArena

    torch.cuda.init()
    stats = getattr(torch.cuda, "host_memory_stats", dict)       # torch's allocator's figures, where it has them
    before = stats().get("allocated_bytes.current", 0)
    nbytes = 3 << 28                                             # 768 MiB
    arena = PinnedArena(nbytes, torch.device("cuda"), "a test")
    assert arena.buffer.untyped_storage().nbytes() == nbytes and arena.buffer.is_pinned()
    n = 1 << 27                                                  # 256 MiB of bf16
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    ahead = arena.empty((1000,), torch.uint8)                    # a slice not at the arena's start
    host = arena.empty((n,), torch.bfloat16)
    assert host.is_pinned() and host.data_ptr() > ahead.data_ptr()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e8))                                  # the stream is busy for a while ...
    host.copy_(x, non_blocking=True)                             # ... and the copy queued behind it
    done = torch.cuda.Event()
    done.record()
    assert not done.query(), "a non-blocking copy to the arena waited for the copy: the memory is not pinned"
    done.synchronize()
    assert torch.equal(host.to("cuda"), x)
    arena.release(host)
    assert arena.in_use == 1024 and stats().get("allocated_bytes.current", 0) == before


# ----------------------------------------------------------------------------- activation offload

OFFLOAD_LAYERS, OFFLOAD_SEQ, OFFLOAD_HIDDEN = 8, 8192, 1024


def _offload_model(offload: bool, keep_attention: bool = False):
    """A stage of 8 checkpointed blocks, bf16, on the GPU; with `offload` their inputs go to pinned host
    memory (parallel/offload.py); with `keep_attention` the attention outputs stay (model/recompute.py)."""
    from megalysses.config import ModelConfig
    from megalysses.model.gpt import GPTStage, init_weights
    from megalysses.model.layers import ParallelGroups

    cfg = ModelConfig(vocab_size=1024, hidden_size=OFFLOAD_HIDDEN, num_layers=OFFLOAD_LAYERS, num_heads=8,
                      num_kv_heads=2, attention_backend="sdpa")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = apply_activation_policy(GPTStage(cfg, ParallelGroups()),
                                        ActivationPolicy(checkpointing=True, offload=offload, mlp_chunk_tokens=2048,
                                                         keep_attention=keep_attention))
    init_weights(model, 0)
    model.to(torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (1, OFFLOAD_SEQ), device="cuda")
    return model, ids, torch.arange(OFFLOAD_SEQ, device="cuda")[None]


def test_activation_offload_drops_device_memory_and_keeps_the_gradients():
    peaks, grads, losses = {}, {}, {}
    for offload in (False, True):
        model, ids, pos = _offload_model(offload)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = model(ids, pos, labels=ids)
        torch.cuda.synchronize()
        torch.empty(1, device="cuda")     # the allocator releases blocks whose side-stream copies are done
        after_forward = torch.cuda.memory_allocated() - base
        loss.backward()
        torch.cuda.synchronize()
        peaks[offload] = (after_forward, torch.cuda.max_memory_allocated() - base)
        grads[offload] = {n: p.grad.float() for n, p in model.named_parameters()}
        losses[offload] = loss.item()
        if offload:
            stats = activation_offload(model).stats
            assert (stats.prefetched, stats.on_demand) == (OFFLOAD_LAYERS - 1, 1), stats
            assert all(t.is_pinned() for t in activation_offload(model).host_buffers())
    block_input = OFFLOAD_SEQ * OFFLOAD_HIDDEN * 2
    # 8 block inputs leave the device after the forward (one may still be on its way out)
    assert peaks[False][0] - peaks[True][0] >= (OFFLOAD_LAYERS - 1) * block_input, peaks
    assert peaks[True][1] < peaks[False][1], peaks
    # the same arithmetic; SDPA's CUDA backward accumulates with atomics, so bitwise equality is not promised
    assert abs(losses[True] - losses[False]) <= 1e-3 * abs(losses[False])
    for n, g in grads[False].items():
        assert (grads[True][n] - g).norm() <= 1e-2 * g.norm() + 1e-6, n


def test_kept_attention_runs_the_kernel_once_and_keeps_its_outputs():
    """training.recompute_attention=false on CUDA: SDPA's kernel (flash or cuDNN) runs once per layer instead
    of twice, the forward keeps its output and log-sum-exp per layer, and the gradients match full
    recomputation."""
    from tests.test_recompute import CountAttention

    kept, grads, calls = {}, {}, {}
    for keep in (False, True):
        model, ids, pos = _offload_model(False, keep_attention=keep)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        with CountAttention() as counter:
            loss = model(ids, pos, labels=ids)
            kept[keep] = torch.cuda.memory_allocated() - base
            loss.backward()
        calls[keep] = sum(counter.calls.values())
        grads[keep] = {n: p.grad.float() for n, p in model.named_parameters()}
    assert (calls[False], calls[True]) == (2 * OFFLOAD_LAYERS, OFFLOAD_LAYERS), calls
    heads, head_dim = 8, OFFLOAD_HIDDEN // 8
    per_layer = OFFLOAD_SEQ * heads * (head_dim * 2 + 4)           # bf16 output, fp32 log-sum-exp
    assert abs(kept[True] - kept[False] - OFFLOAD_LAYERS * per_layer) <= 0.1 * OFFLOAD_LAYERS * per_layer, kept
    for n, g in grads[False].items():
        assert (grads[True][n] - g).norm() <= 1e-2 * g.norm() + 1e-6, n


def _elapsed_ms(run, stream=None, repeats: int = 5) -> float:
    """The median time of run() between two CUDA events recorded on `stream` (default: the current one)."""
    stream = stream or torch.cuda.current_stream()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        run()
        end.record(stream)
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def test_activation_offload_copies_overlap_compute():
    """CUDA events on the compute stream: a training step's forward and backward with offload take the time
    of the compute (the same step without offload) plus at most half the time its copies take alone on a
    stream of their own (8 block inputs to pinned host memory and back). Copies that did not overlap the
    compute would add all of it. The backward's first input comes back on demand, not overlapped: 1 of
    the 16 copies."""
    plain, ids, pos = _offload_model(False)
    offloaded, _, _ = _offload_model(True)

    def step(model):
        return lambda: model(ids, pos, labels=ids).backward()

    for model in (plain, offloaded):        # warm up: kernels, the allocator, the pinned host buffers
        step(model)()
    torch.cuda.synchronize()
    compute = _elapsed_ms(step(plain))
    with_offload = _elapsed_ms(step(offloaded))
    # the same copies alone: a block input to pinned host buffers and back, on a side stream
    x = torch.empty(1, OFFLOAD_SEQ, OFFLOAD_HIDDEN, dtype=torch.bfloat16, device="cuda")
    host = [torch.empty(x.shape, dtype=x.dtype, pin_memory=True) for _ in range(OFFLOAD_LAYERS)]
    side = torch.cuda.Stream()

    def copies_alone():
        with torch.cuda.stream(side):
            for h in host:
                h.copy_(x, non_blocking=True)
            for h in host:
                x.copy_(h, non_blocking=True)

    copies = _elapsed_ms(copies_alone, stream=side)
    assert copies >= 0.05 * compute, f"copies {copies:.2f} ms against compute {compute:.2f} ms: too few to show"
    assert with_offload - compute <= 0.5 * copies, \
        f"with offload {with_offload:.2f} ms, compute {compute:.2f} ms, the copies alone {copies:.2f} ms"
    stats = activation_offload(offloaded).stats
    assert stats.on_demand == stats.offloaded // OFFLOAD_LAYERS


# ----------------------------------------------------------------------------- gradients and weights off the GPU

OFF_GPU = TINY + ["model.vocab_size=32000", "model.hidden_size=1024", "model.num_layers=4", "model.num_heads=8",
                  "model.num_kv_heads=4", "data.seq_len=1024", "training.global_batch_size=2",
                  "training.micro_batch_size=1", "training.train_steps=4", "training.activation_checkpointing=true",
                  "training.dtype=bfloat16", "optimizer.lr=1e-4"]
OFF_GPU_RUNS = {   # name: (overrides, its plain counterpart)
    "zero1": ([], None),
    "zero1, optimizer offload (gradients streamed)": (["training.optimizer_offload=true"], "zero1"),
    "fsdp": (["parallel.fsdp=true"], None),
    "fsdp, parameter offload": (["parallel.fsdp=true", "training.param_offload=true"], "fsdp"),
}


@pytest.mark.timeout(900)   # four runs
def test_gradients_and_weights_off_the_gpu(tmp_path):
    """torchrun on one GPU (NCCL), 2 micro-batches a step, ~116M parameters: with ZeRO-1's optimizer offload
    the gradients stream to pinned host memory (parallel/host_gradients.py: the side stream, the staged sums of
    the second micro-batch), with FSDP's parameter offload the weights live there; both train the losses of
    the runs without them (the update runs on the CPU: its rounding may differ in the last bits) at a much
    lower peak (fp32 masters, moments and gradients of the whole model are gone from the GPU)."""
    base = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
            str(ROOT / "pretrain.py")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    got = {}
    for name, (extra, _) in OFF_GPU_RUNS.items():
        run = tmp_path / name.replace(" ", "_").replace(",", "")
        sets = OFF_GPU + extra + [f"logging.run_dir={run}"]
        done = subprocess.run(base + _sets(sets), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        records = [r for r in metrics(run) if "loss" in r]
        got[name] = ([r["loss"] for r in records], max(r["peak_mem_gib"] for r in records))
    for name, (_, plain) in OFF_GPU_RUNS.items():
        if plain is not None:
            (losses, peak), (plain_losses, plain_peak) = got[name], got[plain]
            assert len(losses) == 4 and losses == pytest.approx(plain_losses, rel=1e-3), (name, losses, plain_losses)
            assert peak < 0.6 * plain_peak, (name, peak, plain_peak)
