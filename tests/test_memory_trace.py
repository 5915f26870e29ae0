"""The memory trace (megalysses/training/trace.py: one training step on fake tensors, the meta device standing for
a GPU) and the memory model against it at small real shapes: the model's peak within 3% of the traced one, at
the same moment, and the host memory within 3%, for each kind of run (ZeRO-1 and FSDP, activation, optimizer
and parameter offload, tiles, head chunks, Ulysses and ring, a pipeline's first and last stage, tensor
parallelism, the Triton kernels, the guarded update of training.nan_policy=skip). The live-bytes tracker itself is
checked on tensors whose bytes are known."""
import json

import pytest
import torch

from megalysses.config.io import load_config
from megalysses.kernels.triton_support import triton_importable
from megalysses.plan import Machine
from megalysses.plan.search import estimate_config
from megalysses import tracker
from megalysses.tracker import DEVICE, HOST, PINNED, LiveBytes, project_file
from megalysses.training.trace import model_part, trace_run, traced_peak

MiB = 2 ** 20
SMALL = ["data.mock=true", "model.vocab_size=512", "model.hidden_size=128", "model.num_layers=2", "model.num_heads=4",
         "model.num_kv_heads=2", "model.ffn_hidden_size=320", "training.micro_batch_size=1", "data.seq_len=4096",
         "training.global_batch_size=1", "training.dtype=bfloat16", "training.activation_checkpointing=true"]
CASES = {   # name: (world, overrides on SMALL)
    "ZeRO-1, activation offload, MLP and loss tiles": (1, ["training.activation_offload=true",
                                                          "training.mlp_chunk_tokens=1024",
                                                          "training.loss_chunk_tokens=1024"]),
    "FSDP, parameter and activation offload": (1, ["parallel.fsdp=true", "training.param_offload=true",
                                                   "training.activation_offload=true"]),
    "optimizer offload (streamed gradients), 2 micro-batches": (1, ["training.optimizer_offload=true",
                                                                    "training.global_batch_size=2"]),
    "Ulysses 2, 2 head chunks": (2, ["parallel.sp=2", "training.attention_head_chunks=2"]),
    "ring 2 (FlexAttention), FSDP over dp 2": (4, ["parallel.sp=2", "parallel.sp_ring=2", "parallel.fsdp=true",
                                                   "training.global_batch_size=2"]),
    "1F1B over 2 stages, 4 micro-batches": (2, ["parallel.pp=2", "training.global_batch_size=4"]),
    "tp 2 with sequence sharding, fp32, no checkpointing": (2, ["parallel.tp=2", "parallel.tp_sequence_parallel=true",
                                                                "training.dtype=float32",
                                                                "training.activation_checkpointing=false"]),
    "Triton kernels, MLP tiles": (1, ["model.kernels=triton", "training.mlp_chunk_tokens=1024"]),
    # short sequences: the optimizer step is the peak, a guarded update's (nan_policy=skip) kept copies in it
    "nan_policy=skip, ZeRO-1": (1, ["data.seq_len=256", "training.nan_policy=skip"]),
    "nan_policy=skip, FSDP": (1, ["data.seq_len=256", "training.nan_policy=skip", "parallel.fsdp=true"]),
    "nan_policy=skip, optimizer offload (the copies in host memory)": (1, ["data.seq_len=256",
                                                                           "training.nan_policy=skip",
                                                                           "training.optimizer_offload=true"]),
}
H100 = Machine.described("H100", packages=("triton",))


@pytest.mark.parametrize("name", list(CASES))
def test_model_equals_the_trace(name, monkeypatch):
    world, overrides = CASES[name]
    if "triton" in name.lower() and not triton_importable():
        pytest.skip("triton is not installed")
    # the trace runs the kernels' fake forms, but the first import of a kernel module decorates its kernels for
    # good: under Triton's CPU interpreter, so that later tests in this process can run them on CPU tensors
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = load_config(overrides=SMALL + overrides)
    traces = trace_run(cfg, H100, world)
    top = traced_peak(traces)
    est = estimate_config(cfg, world, H100)
    where = f"{name}: traced {top.device.bytes / MiB:.2f} MiB at {top.device.moment}, modelled {est.peak / MiB:.2f}"
    assert abs(est.peak / top.device.bytes - 1) <= 0.03, where
    # the same moment: the model's bytes at the traced moment's part (of the traced stage) are the traced peak's
    at_moment = est.parts.get((top.stage, model_part(top.device.moment)))
    assert at_moment is not None and abs(at_moment / top.device.bytes - 1) <= 0.03, (where, est.parts)
    host = max(t.host.bytes for t in traces)
    assert abs(est.host - host) <= 0.03 * max(host, MiB), \
        f"{name}: host {host / MiB:.2f} MiB traced, {est.host / MiB:.2f} modelled"


def test_tracker_counts_what_is_alive():
    """Views count once; a storage counts from the op that makes it until it is freed; resized storages change
    size; pinned host memory counts in host memory too; a peak lists what was alive then (also what was freed
    after it); an op's workspace is a transient at that op; data-dependent ops get what good data gives."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), LiveBytes() as live:
        a = torch.empty(1024, device="meta")                        # 4 KiB
        nothing = torch.empty(0, device="meta")                     # 0 bytes: alive, never listed
        view = a[:512]
        live.reset_peaks()
        b = torch.empty(2048, device="meta")                        # 8 KiB: the peak, 12 KiB
        del b
        c = torch.empty(256, device="meta")                         # 1 KiB
        assert live.current[DEVICE] == 5 * 1024
        c.untyped_storage().resize_(4 * 1024)
        assert live.current[DEVICE] == 8 * 1024
        with live.pinned():
            p = torch.empty(256, device="cpu")
        q = torch.empty(512, device="meta").to("cpu", non_blocking=True)     # a copy to pinned host memory
        r = torch.empty(128, device="cpu")
        assert (live.current[PINNED], live.current[HOST]) == (3 * 1024, 3 * 1024 + 512)
        live.transient(16 * 1024, "a kernel's workspace")
        rows = torch.empty(3, 4, device="meta").nonzero()
        assert tuple(rows.shape) == (12, 2)                         # every element selected: the most bytes
        assert bool(torch.isfinite(torch.empty((), device="meta")))
        assert torch.empty(3, device="meta").sum().item() == 1.0
        assert not bool((torch.empty(4, device="meta") < 0).any())
        del view, p, q, r, nothing
    device = live.peaks[DEVICE]                     # a and the resized c beside the workspace
    assert device.bytes == 24 * 1024 and "a kernel's workspace" in str(device.moment)
    assert [x.bytes for x in device.largest] == [16 * 1024, 4 * 1024, 4 * 1024]
    assert [x.shape for x in device.largest] == [(16 * 1024,), (1024,), (256,)]     # the workspace in bytes
    assert live.peaks[PINNED].bytes == 3 * 1024 and live.peaks[HOST].bytes == 3 * 1024 + 512


def test_plan_trace_and_dry_run_trace_memory(tmp_path, capfd):
    """tools/plan.py --trace adds the traced peak, moment and host memory to the top layout of --json;
    pretrain.py --dry-run --gpus N --trace-memory prints the traced peak beside the model's and writes
    memory_trace.json; torch warns of nothing on the way (its fake process group's default backend)."""
    capsys = capfd
    from megalysses.tools import plan as plan_tool
    from megalysses.tools import pretrain

    assert plan_tool.main(["--config", "configs/quickstart.yaml", "--gpus", "4", "--top", "1", "--json",
                           "--trace"]) == 0
    out, err = capsys.readouterr()
    assert "No backend of type" not in err
    best = json.loads(out)["best"]
    assert best["traced_peak_gib"] > 0 and best["traced_part"] in ("loss", "backward", "final norm", "optimizer")
    assert abs(best["peak_gib"] - best["traced_peak_gib"]) <= 0.01, best      # peak_gib is rounded to 0.01
    assert best["traced_host_gib"] >= best["traced_pinned_gib"] >= 0
    # the traced roofline of the step beside the step-time model's, by the same categories
    assert best["traced_step_s"] == pytest.approx(sum(best["traced_step_breakdown"].values()), rel=1e-4)
    assert set(best["traced_step_breakdown"]) <= set(best["step_breakdown"])
    assert best["traced_mfu"] > 0 and best["traced_launches"] > 0
    assert best["traced_host_syncs"] == 0      # varlen attention: the documents' boundaries come from the loader
    assert best["traced_mask_evaluations"] >= 0
    run_dir = tmp_path / "run"
    assert pretrain.main(["--config", "configs/quickstart.yaml", "--set", "data.mock=true", "--set",
                          f"logging.run_dir={run_dir}", "--dry-run", "--gpus", "4", "--trace-memory"]) == 0
    out = capsys.readouterr().out
    assert "memory trace: peak" in out and "the memory model:" in out
    assert "step trace:" in out and "the step-time model:" in out and "kernel launches" in out
    record = json.loads((run_dir / "memory_trace.json").read_text())
    assert record["stages"][0]["device"]["gib"] > 0 and record["model"]["peak_gib"] > 0
    assert record["step"]["traced_step_s"] > 0 and record["model"]["step_s"] > 0
    assert pretrain.main(["--config", "configs/quickstart.yaml", "--trace-memory"]) == 2


def test_trace_names_the_code_wherever_the_checkout_is():
    """A frame is the project's when its file is in the package's own directory: a checkout named megalysses
    with its virtual environment inside names torch's files by their own paths, not the project's."""
    package = "/home/u/megalysses/megalysses/"
    assert project_file("/home/u/megalysses/.venv/lib/python3.12/site-packages/torch/_dynamo/eval_frame.py",
                        package) is None
    assert project_file("/home/u/megalysses/tests/test_memory_trace.py", package) is None
    assert project_file("/home/u/megalysses/megalysses/training/step.py", package) == "training/step.py"
    assert project_file(tracker.__file__) == "tracker.py"


def test_varlen_workspace_per_document():
    """flash-attn's varlen backward keeps its fp32 dq accumulator and rowsum(dO * O) at T + 128 rows per document
    (mha_varlen_bwd): the trace's batch carries the documents the plan counts (data.documents_per_million), one
    document, the default figure, half the worst case and the worst case the corpus tools allow (a one-token
    text and its EOD); the model follows the trace within 3% at the same moment in each, and between the two
    largest (both peaking in attention's backward) the trace grows by exactly that workspace."""
    from megalysses.plan.memory import documents_per_sequence

    peaks = {}
    for per_million in (0, 1000, 250_000, 500_000):
        cfg = load_config(overrides=SMALL + [f"data.documents_per_million={per_million}"])
        top = traced_peak(trace_run(cfg, H100, 1))
        assert top.plan.attention == "varlen"
        est = estimate_config(cfg, 1, H100)
        where = (f"{per_million} a million: traced {top.device.bytes / MiB:.2f} MiB at {top.device.moment}, "
                 f"modelled {est.peak / MiB:.2f}")
        assert abs(est.peak / top.device.bytes - 1) <= 0.03, where
        at_moment = est.parts.get((top.stage, model_part(top.device.moment)))
        assert at_moment is not None and abs(at_moment / top.device.bytes - 1) <= 0.03, (where, est.parts)
        peaks[per_million] = top.device.bytes, documents_per_sequence(cfg, cfg.data.seq_len), str(top.device.moment)
    assert peaks[0][1] == 1 and peaks[500_000][1] == 1 + 4096 // 2
    (half, docs_half, at_half), (worst, docs, at_worst) = peaks[250_000], peaks[500_000]
    assert at_half == at_worst and "varlen_attn_backward" in at_worst, (at_half, at_worst)
    heads, head_dim = 4, 128 // 4
    # dq_accum's and softmax_d's 128 rows, fp32, and the document's int32 in the batch's cumulative lengths
    per_document = 128 * heads * (head_dim + 1) * 4 + 4
    assert worst - half == (docs - docs_half) * per_document, (worst - half, (docs - docs_half) * per_document)


@pytest.mark.parametrize("head_size, accumulated", [(80, 96), (200, 256)])
def test_varlen_accumulator_head_size_is_the_kernels(head_size, accumulated):
    """mha_varlen_bwd sizes its fp32 dq accumulator by the head size rounded up to 32 up to 128 and to 64 above
    (flash_api.cpp's round_multiple(head_size, head_size <= 128 ? 32 : 64), torch's build and flash-attn's): at a
    head size that is not a multiple of 32, each document's 128 rows grow the trace by that width, and the model
    follows the trace within 3% at the same moment."""
    from megalysses.plan.memory import documents_per_sequence

    heads = 4
    shape = ["model.vocab_size=512", f"model.hidden_size={heads * head_size}", f"model.num_heads={heads}"]
    peaks = {}
    for per_million in (250_000, 500_000):
        cfg = load_config(overrides=SMALL + shape + [f"data.documents_per_million={per_million}"])
        top = traced_peak(trace_run(cfg, H100, 1))
        assert top.plan.attention == "varlen" and "varlen_attn_backward" in str(top.device.moment)
        est = estimate_config(cfg, 1, H100)
        at_moment = est.parts.get((top.stage, model_part(top.device.moment)))
        where = f"{per_million}: traced {top.device.bytes / MiB:.3f} MiB, modelled {est.peak / MiB:.3f}, {est.parts}"
        assert abs(est.peak / top.device.bytes - 1) <= 0.03 and abs(at_moment / top.device.bytes - 1) <= 0.03, where
        peaks[per_million] = top.device.bytes, documents_per_sequence(cfg, cfg.data.seq_len)
    (half, docs_half), (worst, docs) = peaks[250_000], peaks[500_000]
    per_document = 128 * heads * (accumulated + 1) * 4 + 4      # dq_accum's and softmax_d's rows, the int32 length
    assert worst - half == (docs - docs_half) * per_document, (worst - half, (docs - docs_half) * per_document)
