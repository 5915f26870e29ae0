"""The layout planner (tools/plan.py) against published results, the project's configs and its CLI.

The published points are modelled with the settings those systems used; the planner's figures
(megalysses.plan.step_time.Hardware: H100 SXM) and the memory model are the same for every point."""
import json
from dataclasses import replace

import pytest
import torch

from megalysses.config import ConfigError, ModelConfig
from megalysses.config.checks import check_heads, check_world_size, validate_config
from megalysses.config.io import load_config
from megalysses.degrees import Degrees
import megalysses.plan.step_time as step_time_module
from megalysses.memory import (GIB, PRECISIONS, Options, Workload, estimate, layer_params,
                               stage_params)
from megalysses.plan.communicators import axis_sizes, communicators
from megalysses.plan.search import (Search, candidate_configs, check_activity_time, evaluate, plan,
                                    predicted_step_seconds, ranking)
from megalysses.plan.step_time import KERNEL_PASSES, Hardware, Overlap, step_time
from megalysses.plan.tiles import could_fit
from megalysses.tools.plan import Progress, _flags, main
from megalysses.testing import resolve_run
from tests.planning import LLAMA3_8B, h100s, load

FLASH = ("flash_attn", "triton")      # GPU machines with flash-attn installed


# Megatron-Core r0.8.0 weak scaling on H100 (github.com/NVIDIA/Megatron-LM README, "Training Speed and
# Scalability", images/model_table.png, July 2024): GPT models, vocabulary 131072, sequence 4096,
# data-parallel size 48; (name, heads, hidden, layers, tp, pp, global batch, published MFU).
MEGATRON_H100 = [("1.7B", 16, 2048, 24, 1, 1, 192, 0.41), ("7.1B", 32, 4096, 30, 2, 1, 192, 0.47),
                 ("16B", 48, 6144, 32, 4, 1, 192, 0.49), ("32B", 56, 7168, 48, 8, 1, 192, 0.46),
                 ("70B", 64, 8192, 84, 8, 2, 384, 0.42), ("119B", 80, 10240, 92, 8, 4, 768, 0.43),
                 ("177B", 96, 12288, 96, 8, 6, 1152, 0.44), ("314B", 128, 16384, 96, 8, 8, 1536, 0.48),
                 ("462B", 144, 18432, 112, 8, 16, 3072, 0.47)]


# Megatron-Core's memory-bound kernels (Transformer Engine), counted from what they read and write in bf16 per
# token of a layer: LayerNorm fused into the QKV and fc1 GEMMs' input (read h, write h, each norm), bias-GeLU
# fused (read f, write f), bias-dropout-add fused (read 2 h, write h, twice), the backward twice the forward:
# 60 bytes an h element, 12 an f element; gradient accumulation fused into the weight-gradient GEMMs (no pass
# per parameter) and the vocabulary-parallel cross-entropy fused (read the logits once, write their gradient:
# 4 bytes a vocabulary element)
MEGATRON_PASSES = replace(KERNEL_PASSES["triton"], layer=(60.0, 12.0, 0.0), recompute=(0.0, 0.0, 0.0), head=0.0,
                          params=(0.0, 0.0), loss=4.0)


@pytest.mark.parametrize("name, heads, hidden, layers, tp, pp, batch, published", MEGATRON_H100)
def test_megatron_core_h100_mfu(name, heads, hidden, layers, tp, pp, batch, published, monkeypatch):
    """Predicted MFU, counted as Megatron counts it (72 B s l h^2 (1 + s/6h + V/12hl) FLOPs per step
    against 989 TFLOP/s), within 15% of each of the nine published points. Modelled as Megatron ran them:
    GPT blocks (GELU MLP of 4h, multi-head attention), micro-batch 1, the 1F1B schedule, TP sequence
    parallelism with fused QKV and fc1 projections, fp32 gradient reduce-scatter (the distributed
    optimizer), and tensor-parallel, pipeline and data-parallel communication overlapped with compute
    (--tp-comm-overlap, --overlap-grad-reduce, --overlap-param-gather), with Megatron-Core's own fused
    memory-bound kernels (MEGATRON_PASSES) beside the matmul kernels at Hardware's matmul efficiency and its
    distributed optimizer's flat buffers."""
    monkeypatch.setitem(KERNEL_PASSES, "triton", MEGATRON_PASSES)     # the kernel set the model below names
    # the distributed optimizer's gradients and parameters in contiguous buffers: no chunk of each parameter
    # tensor padded and copied per rank of the group, as megalysses' ZeRO-1 does
    monkeypatch.setattr(step_time_module, "ZERO_RANK_LAUNCHES", 0)
    V, S, dp = 131072, 4096, 48
    m = ModelConfig(vocab_size=V, hidden_size=hidden, num_layers=layers, num_heads=heads,
                    ffn_hidden_size=4 * hidden, mlp="gelu")
    layout = Degrees(tp=tp, pp=pp, dp=dp)
    opts = Options(tp_sequence_parallel=tp > 1, attention="flash", kernels="triton")
    hw = Hardware()
    step = step_time(m, layout, opts, PRECISIONS["bf16"], Workload(S, 1, batch // dp), hw,
                     Overlap(tp=True, ulysses=True, p2p=True, grad_reduce=True, param_gather=True))
    flops = 72 * batch * S * layers * hidden ** 2 * (1 + S / (6 * hidden) + V / (12 * hidden * layers))
    mfu = flops / step.total / (layout.world * hw.peak_tflops * 1e12)
    assert abs(mfu - published) <= 0.15 * published, (name, round(mfu, 3), published)


@pytest.mark.parametrize("path, gpus, host_gib", [
    ("configs/llama3_8b_1m.yaml", 64, None),
    ("configs/gpt_1b_8gpu.yaml", 8, None),
    ("configs/gpt_1b_1m_offload.yaml", 1, 256),
])
def test_configs_fit_at_their_own_layout(path, gpus, host_gib):
    cfg = load_config(path)
    validate_config(cfg, world_size=gpus)
    p = evaluate(cfg, gpus, 80, host_gib, Hardware())
    assert p.fits, f"{path}: {p.why_not}"
    assert cfg.data.seq_len == 1048576


@pytest.mark.parametrize("path, gpus", [("configs/llama3_8b_1m.yaml", 64), ("configs/gpt_1b_8gpu.yaml", 8),
                                        ("configs/gpt_1b_1m_offload.yaml", 1), ("configs/llama3_8b_128k.yaml", 8),
                                        ("configs/gpt_1b_32k.yaml", 8), ("configs/quickstart.yaml", 4),
                                        ("configs/llama3_8b_chat_128k.yaml", 8)])
def test_configs_give_a_step_the_time_it_takes(path, gpus):
    """A step of 1M tokens takes minutes: each config's parallel.timeout_seconds (the longest the watchdog
    lets a rank spend on one activity) is over twice its predicted step on H100s, and a run whose timeout
    is not stops before step 1 with the value to set."""
    cfg = load_config(path)
    run = h100s(cfg, gpus)
    check_activity_time(cfg, run, Hardware().peak_tflops)
    step = predicted_step_seconds(cfg, gpus, Hardware())
    short = replace(cfg, parallel=replace(cfg.parallel, timeout_seconds=1.5 * step))
    with pytest.raises(ConfigError, match=r"parallel.timeout_seconds=\S+ is less than twice the time of a training "
                                          r"step .* --set parallel.timeout_seconds=(\d+)$") as e:
        check_activity_time(short, run, Hardware().peak_tflops)
    suggested = int(str(e.value).rsplit("=", 1)[1])
    check_activity_time(replace(cfg, parallel=replace(cfg.parallel, timeout_seconds=suggested)), run, 989.0)
    check_activity_time(short, run, None)       # an unknown GPU: nothing to predict with


def test_a_long_validation_needs_the_time_too():
    cfg = load_config("configs/gpt_1b_8gpu.yaml", ["training.eval_interval=100", "training.eval_steps=20"])
    with pytest.raises(ConfigError, match=r"time of a validation \(20 x global batch 8 x 1048576 tokens\) predicted"):
        check_activity_time(cfg, h100s(cfg, 8), 989.0)
    check_activity_time(replace(cfg, training=replace(cfg.training, eval_interval=0)), h100s(cfg, 8), 989.0)


def _one_gpu_8b(**sets):
    """Llama-3.1-8B at 1M tokens on one GPU, global batch 1: the settings of the issue's one-GPU target."""
    return load("configs/llama3_8b_1m.yaml", **{"parallel.sp": 1, "parallel.pp": 1, "parallel.virtual_stages": 1,
                                                 "training.global_batch_size": 1, "training.activation_offload": "true",
                                                 "training.optimizer_offload": "true", "model.kernels": "triton",
                                                 **sets})


def test_activity_time_is_judged_at_the_runs_own_batch_and_longest_length():
    """The step the watchdog check predicts is the run's own: its global batch (where a batch ramp ends) and its
    curriculum's longest length. A 1M-token run of the 8B model on one GPU at global batch 1 is accepted with a
    timeout over twice its step, though that timeout is far under a step of global batch 8 (hours), which is
    refused, naming the batch it judged."""
    one = _one_gpu_8b()
    step = predicted_step_seconds(one, 1, Hardware())
    eight = predicted_step_seconds(_one_gpu_8b(**{"training.global_batch_size": 8}), 1, Hardware())
    assert step > 600 and eight > 7 * step         # minutes at batch 1; hours at batch 8
    timeout = 2.5 * step
    check_activity_time(_one_gpu_8b(**{"parallel.timeout_seconds": timeout}), h100s(one, 1), 989.0)
    batch8 = _one_gpu_8b(**{"parallel.timeout_seconds": timeout, "training.global_batch_size": 8})
    with pytest.raises(ConfigError, match=r"a training step \(global batch 8 x 1048576 tokens\) predicted .* "
                                          r"\(~\d+ s at 989 TFLOP/s"):
        check_activity_time(batch8, h100s(batch8, 1), 989.0)
    # a ramp ends at the global batch, which is what is judged; a curriculum's longest length is data.seq_len
    ramp = _one_gpu_8b(**{"training.global_batch_size": 8, "training.rampup_batch_size": "[1,1,100]"})
    curriculum = _one_gpu_8b(**{"data.seq_len_schedule": "[[0,131072],[100,1048576]]"})
    assert predicted_step_seconds(ramp, 1, Hardware()) == eight
    assert predicted_step_seconds(curriculum, 1, Hardware()) == step
    short = _one_gpu_8b(**{"data.seq_len": 131072})
    assert predicted_step_seconds(short, 1, Hardware()) < step / 10


def test_one_gpu_config_needs_offload():
    """The 1M-token single-GPU config fits only with activation offload. Its fused kernels keep the least; the
    torch norms run over row tiles (no fp32 copy of the whole activation), so the torch kernels fit too, their
    peak set by the MLP tile, not the norms' backward."""
    cfg = load_config("configs/gpt_1b_1m_offload.yaml")
    assert cfg.training.activation_offload and cfg.model.kernels == "triton"
    on_device = replace(cfg, training=replace(cfg.training, activation_offload=False))
    assert not evaluate(on_device, 1, 80, 256, Hardware()).fits
    fused = evaluate(cfg, 1, 80, 256, Hardware())
    torch_kernels = evaluate(replace(cfg, model=replace(cfg.model, kernels="torch")), 1, 80, 256, Hardware())
    assert torch_kernels.fits and torch_kernels.estimate.peak > fused.estimate.peak
    assert not any("norm" in t.name for t in torch_kernels.estimate.terms if t.name.startswith("backward of one"))


def test_planned_layouts_obey_the_layout_rules():
    """A 4-head model (2 KV heads) gets every Ulysses degree that divides its heads per tp rank (KV heads dividing
    it or divisible by it) and a ring for the rest of sp, as the config resolves it; every layout validates; the
    ring's bytes appear with a ring only. (Without document masks: with them, a ring's blocks at this head dim of
    48 would need FlexAttention, which takes powers of two only, and the reference backend, which the memory
    model does not cover on a ring.)"""
    cfg = load("configs/quickstart.yaml", **{"data.mock": "true", "training.global_batch_size": 8,
                                              "data.document_mask": "false"})
    fitting, considered = plan(cfg, 8, 4096, 80)
    assert considered and fitting
    rings = {}
    for p in fitting:
        validate_config(p.cfg, world_size=8)
        par, layout = p.cfg.parallel, p.estimate.layout
        m = p.cfg.model
        ulysses, ring = check_heads(m.num_heads, m.kv_heads, par.tp, par.sp, par.sp_ring, ranks_per_node=8)
        assert (p.plan.degrees.ulysses, p.plan.degrees.ring) == (ulysses, ring) == (par.sp // par.sp_ring, par.sp_ring)
        assert (layout.ulysses, layout.ring) == (ulysses, ring) and cfg.model.num_heads // par.tp % ulysses == 0
        assert par.tp * par.sp * par.pp * layout.dp == 8
        assert (p.row()["ring_p2p_gb"] > 0) == (ring > 1) and (p.row()["all_to_all_gb"] > 0) == (ulysses > 1)
        rings.setdefault((par.tp, par.sp), set()).add(ring)
    # tp 1 (4 query, 2 KV heads per rank): Ulysses 1, 2 or 4; tp 2 (2 and 1): Ulysses 1 or 2; tp 4: 2 KV heads
    # do not split over 4 ranks
    assert rings == {(1, 1): {1}, (1, 2): {1, 2}, (1, 4): {1, 2, 4}, (1, 8): {2, 4, 8},
                     (2, 1): {1}, (2, 2): {1, 2}, (2, 4): {2, 4}}
    times = [p.step.total for p in fitting]
    assert times == sorted(times)


def test_candidates_split_sp_every_way_the_heads_allow():
    """candidate_configs gives each (tp, sp) every ulysses x ring split the heads allow, the ring explicit
    (parallel.sp_ring), each with the head chunk counts of its own Ulysses degree; each candidate validates
    (at one stage, where every dp divides the batch) and resolves to its split (with attention recomputed:
    kept attention outputs need SDPA, which document masks rule out here)."""
    cfg = load("configs/quickstart.yaml", **{"data.mock": "true", "training.global_batch_size": 8,
                                              "training.micro_batch_size": 1})
    splits, chunks = {}, {}
    for c in candidate_configs(cfg, 8, offload=False):
        p = c.parallel
        splits.setdefault((p.tp, p.sp), set()).add(p.sp_ring)
        chunks.setdefault((p.tp, p.sp, p.sp_ring), set()).add(c.training.attention_head_chunks)
        if p.pp == 1:
            validate_config(c, world_size=8)
        if p.pp == 1 and c.training.recompute_attention:
            run = h100s(c, 8)
            assert (run.degrees.ulysses, run.degrees.ring) == (p.sp // p.sp_ring, p.sp_ring)
    assert splits[(1, 8)] == {2, 4, 8} and splits[(1, 4)] == {1, 2, 4} and splits[(2, 4)] == {2, 4}
    # 2 KV heads per rank: 2 chunks of one KV head and 2 query heads split over at most 2 Ulysses ranks
    assert chunks[(1, 8, 2)] == {1} and chunks[(1, 8, 4)] == chunks[(1, 8, 8)] == {1, 2}


def test_cli_json_best_and_null(capsys):
    assert main(["--config", "configs/gpt_1b_8gpu.yaml", "--gpus", "8", "--gpu-memory-gib", "80",
                 "--seq-len", "262144", "--json", "--top", "3"]) == 0
    said = capsys.readouterr()
    out, err = json.loads(said.out), said.err          # the progress goes to stderr: stdout stays one object
    assert err.startswith("planning: ") and " candidate layouts and options searched" in err, err
    best = out["best"]
    assert {"tp", "sp", "pp", "dp", "peak_gib"} <= set(best)
    assert best["tp"] * best["sp"] * best["pp"] * best["dp"] == 8 and best["peak_gib"] <= 80
    assert out["layouts"][0] == best and out["config_layout"]["fits"]
    own = out["config_layout"]                         # where the config's own layout ranks, and by what it trails
    assert own["rank"] > 1 and own["step_s"] > best["step_s"]
    assert sum(own["behind_best_s"].values()) == pytest.approx(own["step_s"] - best["step_s"], abs=1e-3)
    # by default an H100 80GB as it is exposed (79.6 GiB): the budget takes off the reserve, the layout's
    # communicators and a fragmentation allowance of at least the layout's largest block (here a block input:
    # 256K / sp tokens x hidden x 2 B)
    assert main(["--config", "configs/gpt_1b_8gpu.yaml", "--gpus", "8", "--seq-len", "262144", "--json",
                 "--no-search"]) == 0
    out, hw = json.loads(capsys.readouterr().out), Hardware()
    best, hidden = out["config_layout"], load_config("configs/gpt_1b_8gpu.yaml").model.hidden_size
    assert out["gpu_memory_gib"] == 79.6 and best["largest_block_gib"] >= 262144 / best["sp"] * hidden * 2 / GIB
    allowance = max(hw.fragmentation * 79.6, best["largest_block_gib"])
    sizes = axis_sizes(best["tp"], best["sp"] // best["ring"], best["ring"], best["dp"], best["pp"])
    comms = communicators(sizes, grad_apart=True)        # ZeRO-1 overlapping its reduce-scatters (the default)
    assert (best["communicators"], best["communicators_gib"]) == (len(comms),
                                                               round(sum(c.bytes for c in comms) / GIB, 2))
    assert best["usable_gib"] == pytest.approx(79.6 - hw.reserve_gib - sum(c.bytes for c in comms) / GIB - allowance,
                                               abs=0.01)
    assert best["peak_gib"] <= best["usable_gib"]
    # --set overrides the config as pretrain.py's does
    assert main(["--config", "configs/gpt_1b_8gpu.yaml", "--gpus", "8", "--gpu-memory-gib", "80", "--json",
                 "--seq-len", "65536", "--no-search", "--set", "training.global_batch_size=16"]) == 0
    assert json.loads(capsys.readouterr().out)["config_layout"]["micro_batches"] == 16
    # nothing fits: the 8B model's states alone on one small GPU
    assert main(["--config", "configs/llama3_8b_1m.yaml", "--gpus", "1", "--gpu-memory-gib", "16",
                 "--seq-len", "8192", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["best"] is None and out["layouts"] == [] and not out["config_layout"]["fits"]


def test_cli_seq_len_defaults_to_the_configs(capsys):
    assert main(["--config", "configs/gpt_1b_8gpu.yaml", "--gpus", "8", "--gpu-memory-gib", "80", "--json",
                 "--no-search"]) == 0
    assert json.loads(capsys.readouterr().out)["seq_len"] == load_config("configs/gpt_1b_8gpu.yaml").data.seq_len


def test_cli_explain_shows_the_arithmetic(capsys):
    assert main(["--config", "configs/gpt_1b_1m_offload.yaml", "--gpus", "1", "--gpu-memory-gib", "80",
                 "--seq-len", "1048576", "--host-memory-gib", "256", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "offloaded block inputs" in out and "recomputed activations" in out and "offload window" in out
    # the table's columns line up whatever the options' length; the options are named and explained
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.lstrip().startswith("#  tp"))
    rows = [line for line in lines[head + 1:] if line[:3].strip().isdigit()]
    assert len({len(line) for line in [lines[head]] + rows}) == 1, lines
    assert "loss-tile=" in out and "options: " in out and "loss-tile = training.loss_chunk_tokens" in out
    assert "the config's own layout (tp 1, sp 1 (ring 1), pp 1, dp 1;" in out and "fits" in out
    assert "TFLOP/s" in out and "tokens/s" in out and "peak" in out


def test_cli_no_search_checks_the_configs_own_layout_alone(capsys):
    """--no-search: the config's own layout, as the search would report it, and no other."""
    argv = ["--config", "configs/gpt_1b_1m_offload.yaml", "--gpus", "1", "--host-memory-gib", "120"]
    assert main(argv + ["--json", "--top", "1"]) == 0
    searched = json.loads(capsys.readouterr().out)
    assert main(argv + ["--json", "--no-search"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert (alone["considered"], alone["layouts"], alone["best"]) == (0, [], None) and searched["considered"] > 0
    mine = {k: v for k, v in searched["config_layout"].items() if k not in ("rank", "behind_best_s")}
    assert alone["config_layout"] == mine and mine["fits"]
    assert main(argv + ["--no-search"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "the config's own layout (tp 1, sp 1 (ring 1), pp 1, dp 1;" in out[0], out
    assert main(argv[:-2] + ["--host-memory-gib", "40", "--no-search"]) == 0
    assert "the config's own layout does not fit (host" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--config", "missing.yaml", "--gpus", "8", "--gpu-memory-gib", "80", "--seq-len", "1024"], "does not exist"),
    (["--config", "configs/gpt_1b_8gpu.yaml", "--gpus", "0", "--gpu-memory-gib", "80", "--seq-len", "1024"], "--gpus"),
    (["--config", "configs/gpt_1b_8gpu.yaml", "--gpus", "8", "--gpu-memory-gib", "80", "--seq-len", "-1"], "--seq-len"),
    (["--config", "configs/gpt_1b_8gpu.yaml", "--gpus", "8", "--gpu-memory-gib", "1"], "leaves nothing usable"),
])
def test_cli_bad_input_is_one_error_line(capsys, argv, message):
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]


HARDWARE_FLAGS = [("--peak-tflops", "0"), ("--peak-tflops", "inf"), ("--matmul-efficiency", "0"),
                  ("--matmul-efficiency", "1.5"), ("--attention-efficiency", "0"), ("--attention-efficiency", "nan"),
                  ("--intra-node-gbs", "0"), ("--inter-node-gbs", "-40"), ("--host-gbs", "0"),
                  ("--host-adam-gparams", "0"), ("--hbm-gbs", "0"), ("--gpus-per-node", "0"),
                  ("--reserve-gib", "-1"), ("--fragmentation", "1"), ("--fragmentation", "-0.1")]


@pytest.mark.parametrize("flag, value", HARDWARE_FLAGS)
def test_cli_hardware_flags_are_checked(capsys, flag, value):
    """Each of Hardware's figures out of range is one error line naming its flag, not a division by zero, an
    MFU over 100% or "no layout fits"; the dataclass refuses it too."""
    argv = ["--config", "configs/gpt_1b_8gpu.yaml", "--gpus", "8", "--gpu-memory-gib", "80", "--seq-len", "8192"]
    assert main(argv + [flag, value]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {flag} must be"), err
    field = flag[2:].replace("-", "_")
    with pytest.raises(ValueError, match=field):
        Hardware(**{field: type(getattr(Hardware(), field))(float(value))})


def test_cli_every_bad_flag_is_a_line(capsys):
    argv = ["--config", "configs/gpt_1b_8gpu.yaml", "--gpus", "0", "--gpu-memory-gib", "80", "--peak-tflops", "0",
            "--matmul-efficiency", "2", "--gpus-per-node", "0"]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert [line.split()[1] for line in err] == ["--gpus", "--peak-tflops", "--matmul-efficiency", "--gpus-per-node"]
    # the edges that are allowed: an efficiency of 1, no reserve, no fragmentation
    assert main(argv[:3] + ["8", "--gpu-memory-gib", "80", "--seq-len", "8192", "--matmul-efficiency", "1",
                            "--reserve-gib", "0", "--fragmentation", "0", "--json", "--no-search"]) == 0
    assert 0 < json.loads(capsys.readouterr().out)["config_layout"]["mfu"] <= 1


def test_offload_needs_host_memory():
    """Offload layouts are only planned with --host-memory-gib, and must fit in it."""
    cfg = load_config("configs/gpt_1b_1m_offload.yaml")
    p = evaluate(cfg, 1, 80, None, Hardware())
    assert not p.fits and "host" in p.why_not
    assert not evaluate(cfg, 1, 80, 32, Hardware()).fits          # 64 GiB offloaded > 32 GiB


def test_optimizer_offload_is_planned_when_the_states_do_not_fit(capsys):
    """Llama-3-8B on one 80 GB GPU: weights, gradients and ZeRO-1 state (~16 B per parameter) do not fit;
    with host memory the planner moves masters and moments there and the step fits."""
    argv = ["--config", "configs/llama3_8b_1m.yaml", "--gpus", "1", "--gpu-memory-gib", "80", "--seq-len", "8192",
            "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["best"] is None
    assert main(argv + ["--host-memory-gib", "512"]) == 0
    best = json.loads(capsys.readouterr().out)["best"]
    assert best["optimizer_offload"] and not best["fsdp"] and best["peak_gib"] <= 80


def test_ring_with_the_reference_backend_is_refused_not_guessed(tmp_path, capsys):
    """The memory model does not count what the reference backend keeps on a ring: the config's own layout
    says so, and no ring layout is planned for it."""
    path = tmp_path / "reference.yaml"
    path.write_text("model: {vocab_size: 4096, hidden_size: 192, num_layers: 4, num_heads: 4, num_kv_heads: 2, "
                    "attention_backend: reference}\nparallel: {sp: 8}\ndata: {mock: true}\n")
    assert main(["--config", str(path), "--gpus", "8", "--gpu-memory-gib", "80", "--seq-len", "4096", "--json",
                 "--top", "100"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert not out["config_layout"]["fits"] and "reference backend" in out["config_layout"]["why_not"]
    assert out["layouts"] and all(row["ring"] == 1 for row in out["layouts"])


def test_kept_attention_is_planned_with_sdpa_faster_for_more_memory():
    """Checkpointing that keeps the attention outputs (training.recompute_attention=false) is planned beside
    full recomputation where a run accepts it (SDPA, no ring, no activation offload): one attention forward
    fewer per layer, for an attention output more per layer. With flash-attn it is not planned."""
    sets = {"training.activation_offload": "false", "model.kernels": "torch"}
    cfg = load("configs/gpt_1b_1m_offload.yaml", **sets, **{"model.attention_backend": "sdpa"})
    fitting, _ = plan(cfg, 1, 131072, 80)
    by_options = {(p.cfg.training.recompute_attention, p.cfg.training.mlp_chunk_tokens, p.cfg.parallel.fsdp): p
                  for p in fitting if p.cfg.training.activation_checkpointing}
    kept, full = by_options[(False, 0, False)], by_options[(True, 0, False)]
    assert kept.step.total < full.step.total and kept.estimate.peak > full.estimate.peak
    assert "keep-attn" in _flags(kept.row()) and "keep-attn" not in _flags(full.row())
    for p in fitting:
        if not p.cfg.training.recompute_attention:
            resolve_run(p.cfg, torch.device("cpu"))      # the run accepts what is planned
    flash = load("configs/gpt_1b_1m_offload.yaml", **sets, **{"model.attention_backend": "flash"})
    assert all(p.cfg.training.recompute_attention for p in plan(flash, 1, 131072, 80, packages=FLASH)[0])
    # a config that asks for it where the run refuses it is not reported as fitting
    flash_kept = replace(flash, training=replace(flash.training, activation_checkpointing=True,
                                                 recompute_attention=False))
    with pytest.raises(ConfigError, match="model.attention_backend=sdpa"):
        evaluate(flash_kept, 1, 80, None, Hardware(), FLASH)



def test_parameter_offload_is_planned_where_the_weights_bind():
    """Llama-3-8B on one 80 GB GPU at 512K tokens with Triton kernels: nothing fits without host memory; with
    it the planner offers parameter offload (FSDP2's CPUOffloadPolicy: the running block's weights and one
    block's fp32 gradient on the device) and ranks it first; ZeRO-1 with optimizer offload (gradients streamed,
    the weights on the device) at the same activation options does not fit. The run it plans resolves to weights,
    gradients and optimizer on the host, and its step counts the host copies: every block's fp32 shard in twice and its
    gradient out once."""
    cfg = load("configs/llama3_8b_1m.yaml", **{"training.global_batch_size": 1, "model.kernels": "triton"})
    S = 1 << 19
    assert not plan(cfg, 1, S, 80)[0]
    fitting, _ = plan(cfg, 1, S, 80, host_memory_gib=1769)
    best = fitting[0]
    assert best.cfg.training.param_offload and best.cfg.parallel.fsdp, [p.row() for p in fitting]
    assert (best.plan.weights, best.plan.gradients, best.plan.optimizer) == ("host", "host", "fsdp-host")
    # ZeRO-1 with optimizer offload at the same activation options (checkpointing, tiles, head chunks, stride):
    # the weights on the device cost more than the budget leaves
    c = best.cfg
    streamed = evaluate(replace(c, parallel=replace(c.parallel, fsdp=False),
                                training=replace(c.training, param_offload=False, optimizer_offload=True)),
                        1, 80, 1769, Hardware())
    assert streamed.plan.activation == best.plan.activation and not streamed.fits
    assert (streamed.plan.weights, streamed.plan.gradients) == ("device", "host")
    assert best.estimate.peak < streamed.estimate.peak - 8 * GIB
    blocks, root = stage_params(cfg.model, Degrees(), True, True)    # root: embedding, final norm, head
    n, block = blocks + root, layer_params(cfg.model)
    device = {t.name: t.bytes for t in best.estimate.terms if not t.host}
    # at the backward's peak: the running block and the root unit (embedding, final norm, head) gathered, the
    # root's unsharded gradients (the head's and the final norm's, kept to the end of the backward) and the
    # newest block's fp32 reduce-scatter input
    head = cfg.model.padded_vocab_size(1) * cfg.model.hidden_size + cfg.model.hidden_size
    weights_and_grads = sum(device[k] for k in (
        "gathered block (the one running)", "gathered embedding / head (kept through the step)",
        "the root unit's unsharded gradients (the head's, kept to the end of the backward)",
        "the newest reduce-scatter's fp32 input (one block's)"))
    assert best.estimate.part == "backward"
    assert weights_and_grads == block * (2 + 4) + root * 2 + head * 2
    host = {t.name: t.bytes for t in best.estimate.terms if t.host}
    assert host["master, moments, gradients (FSDP shards)"] == n * 16
    activations = host["offloaded block inputs"]
    assert best.step.bytes["host"] == pytest.approx(2 * activations + n * (2 * 4 + 4))
    assert streamed.step.bytes["host"] == pytest.approx(2 * activations + n * 4 + n * 2)


def test_streamed_gradients_leave_no_main_grad_on_the_device():
    """ZeRO-1 with optimizer offload, 4 micro-batches: without it the fp32 main_grad of every parameter is on
    the device (29.9 GiB at 8B); with it, at the peak (the first block's backward) only the gradients that wait
    for their bucket. The host holds the reduced fp32 gradients and two buckets staged for their addition; every
    micro-batch's reduced chunks are copied out, the weights come back once."""
    m, layout, bf16 = LLAMA3_8B, Degrees(sp=8), PRECISIONS["bf16"]
    base = Options(checkpointing=True, offload=True, loss_chunk_tokens=8192)
    work = Workload(1 << 20, 1, 4)
    on_device = estimate(m, layout, base, bf16, work)
    streamed = estimate(m, layout, replace(base, optimizer_offload=True), bf16, work)
    n, G, bucket = sum(stage_params(m, layout, True, True)), 8, base.bucket_bytes / 4
    assert {t.name: t.bytes for t in on_device.terms}["gradients (fp32 main_grad)"] == n * 4
    device = {t.name: t.bytes for t in streamed.terms if not t.host}
    grads = {k: b for k, b in device.items() if k.startswith("gradient")}
    # the peak is the first block's backward: the head's gradient, a bucket of its own, has gone to the host;
    # the final norm's waits for its bucket to fill
    assert streamed.part == "backward"
    assert grads == {"gradients waiting for their bucket (the head's and 0 layers')": m.hidden_size * 2}
    assert on_device.peak - streamed.peak > n * 4
    host = {t.name: t.bytes for t in streamed.terms if t.host}
    # pinned, a request per parameter of the largest rank's chunk (ceil(rows / G) rows); two staging buffers of a
    # bucket's share each, the sums of a later micro-batch waiting there to be added
    assert host["reduced fp32 gradients"] == pytest.approx(n * 4 / G, rel=1e-4)
    assert host["gradient staging buffers"] == 2 * bucket * 4 / G
    step = step_time(m, layout, replace(base, optimizer_offload=True), bf16, work, Hardware())
    assert step.bytes["host"] == pytest.approx(4 * n / G * 4 + n / G * 2)


def test_a_checkpoint_stride_is_planned_where_host_memory_binds():
    """The 1B model at 1M tokens on one GPU offloads 64 GiB of block inputs: with 40 GiB of host memory only
    layouts keeping every 2nd or 4th block input fit (32 and 16 GiB of them), slower by a forward of every
    layer; with 120 GiB, those keeping every input come first."""
    cfg = load_config("configs/gpt_1b_1m_offload.yaml")
    tight, _ = plan(cfg, 1, 1 << 20, 80, host_memory_gib=40)
    assert tight and all(p.cfg.training.checkpoint_stride > 1 for p in tight)
    assert all(p.host_per_node <= 40 * GIB for p in tight)
    roomy, _ = plan(cfg, 1, 1 << 20, 80, host_memory_gib=120)
    assert roomy[0].cfg.training.checkpoint_stride == 1
    # the config's options but the stride
    every = {p.cfg.training.checkpoint_stride: p for p in roomy if not p.cfg.parallel.fsdp
             and p.cfg.training.optimizer_offload and p.plan.activation.head_chunks == 1
             and not p.plan.activation.keep_attention}
    one, two = every[1], every[2]
    offloaded = {k: sum(t.bytes for t in p.estimate.terms if t.name == "offloaded block inputs")
                 for k, p in every.items()}
    assert offloaded[2] == offloaded[1] / 2
    # one more forward of every layer (forward, backward = 2.5 forwards of attention, recomputations 1 -> 2):
    # matmuls and attention
    assert two.step.flops["attention"] == pytest.approx(one.step.flops["attention"] * 5.5 / 4.5)
    assert two.step.flops["matmul"] > one.step.flops["matmul"] and one.step.total < two.step.total


@pytest.mark.parametrize("path, sets, gpus, tokens, gpu_gib, host_gib", [
    ("configs/llama3_8b_1m.yaml", {"training.global_batch_size": 1, "model.kernels": "triton"}, 1, 1 << 19, 80, 1769),
    # on a 24 GiB GPU some fit only with the loss in one tile of the whole sequence (no fp32 head gradient sum)
    ("configs/llama3_8b_1m.yaml", {"training.global_batch_size": 1, "model.kernels": "triton"}, 1, 4096, 24, 1769),
    ("configs/quickstart.yaml", {"data.mock": "true", "data.document_mask": "false", "training.micro_batch_size": 1,
                                 "training.global_batch_size": 4}, 8, 1 << 16, 3, None)])
def test_the_search_skips_only_what_cannot_fit(monkeypatch, path, sets, gpus, tokens, gpu_gib, host_gib):
    """plan() checks a layout's batch arithmetic once for all its memory options, and skips the tile search of a
    candidate that no tiles can fit: the layouts that fit, their order and how many were considered are those
    of validating and searching every candidate; and the shortcuts skip some here."""
    import megalysses.plan.search as search

    cfg = load(path, **sets)
    skipped = {"layouts": 0, "candidates": 0}

    def world(c, n):
        try:
            check_world_size(c, n)
        except ConfigError:
            skipped["layouts"] += 1
            raise

    def bound(*args):
        fits = could_fit(*args)
        skipped["candidates"] += not fits
        return fits

    monkeypatch.setattr(search, "check_world_size", world)
    monkeypatch.setattr(search, "could_fit", bound)
    fitting, considered = plan(cfg, gpus, tokens, gpu_gib, host_gib)
    assert fitting and skipped["candidates"] > 0 and (gpus == 1 or skipped["layouts"] > 0), skipped
    monkeypatch.setattr(search, "check_world_size", lambda c, n: None)
    monkeypatch.setattr(search, "could_fit", lambda *args: True)
    every, every_considered = plan(cfg, gpus, tokens, gpu_gib, host_gib)
    assert [p.row() for p in fitting] == [p.row() for p in every] and considered == every_considered


def test_cli_refuses_before_any_search_what_no_layout_can_run(capsys, monkeypatch):
    """More --gpus than any layout of the config can use, or a --seq-len the config cannot run at (its curriculum
    ends at another length), is one error line naming the number or the cause, and nothing is searched."""
    from megalysses.tools import plan as plan_tool

    def no_search(*args, **kwargs):
        raise AssertionError("searched")

    monkeypatch.setattr(plan_tool, "plan", no_search)
    cfg = load_config("configs/quickstart.yaml")
    t, m = cfg.training, cfg.model
    most = t.global_batch_size // t.micro_batch_size * m.num_heads * m.num_layers * max(1, cfg.data.seq_len // 256)
    assert main(["--config", "configs/quickstart.yaml", "--gpus", str(most + 1)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --gpus {most + 1} is more than this config can use: at most "
                                               f"{most} GPUs = dp "), err
    assert main(["--config", "configs/quickstart.yaml", "--gpus", str(most), "--no-search"]) == 0
    assert "the config's own layout" in capsys.readouterr().out
    assert main(["--config", "configs/llama3_8b_128k.yaml", "--gpus", "64", "--seq-len", "1048576"]) == 1
    out = capsys.readouterr()
    assert not out.out and out.err.count("\n") == 1 and out.err.startswith(
        "error: --seq-len 1048576: this config cannot run at that length: data.seq_len_schedule ends at seq_len "
        "131072"), out.err


def test_between_equal_layouts_fewer_communicators_first():
    """The search's order: step time, then peak, then the number of communicators (sp over the whole world shares
    WORLD's; with tp beside it, tp and sp each have their own)."""
    from types import SimpleNamespace

    def layout(tp, ulysses, step=1.0, peak=1.0):
        plan = SimpleNamespace(degrees=Degrees(tp=tp, sp=ulysses), grad_overlap=True)
        return SimpleNamespace(step=SimpleNamespace(total=step), estimate=SimpleNamespace(peak=peak), plan=plan)

    sp8, tp2sp4 = layout(1, 8), layout(2, 4)
    assert sorted([tp2sp4, sp8], key=ranking) == [sp8, tp2sp4]
    assert sorted([sp8, layout(2, 4, step=0.9)], key=ranking)[0].step.total == 0.9
    assert sorted([sp8, layout(2, 4, peak=0.9)], key=ranking)[0].estimate.peak == 0.9


def test_the_pruned_search_returns_the_whole_searchs_top_layouts():
    """plan() with Search.top weighs only candidates whose step can still rank (a floor on the step time) and
    returns the same top layouts, in the same order, as the whole search, with every one within Search.within
    seconds (to rank the config's own layout); it tells its progress from its first candidate, layout by layout,
    the candidates enumerated as it goes."""
    cfg = load("configs/quickstart.yaml", **{"data.mock": "true", "data.document_mask": "false",
                                             "training.micro_batch_size": 1, "training.global_batch_size": 4})
    every_search = Search()
    every, every_considered = plan(cfg, 8, 1 << 16, 3, search=every_search)
    assert len(every) > 10
    told = []
    top = Search(top=3, within=every[6].step.total, progress=lambda *counts: told.append(counts))
    fitting, considered = plan(cfg, 8, 1 << 16, 3, search=top)
    within = [p for p in every if p.step.total <= top.within]
    assert [p.row() for p in fitting] == [p.row() for p in (every[:3] if len(within) < 3 else within)]
    assert considered == every_considered and top.evaluated < every_search.evaluated / 4, (top, every_search)
    assert told[0][0] == 0 and told[-1][1] == told[-1][2] and told[-1][0] == sum(
        1 for c in candidate_configs(cfg, 8, offload=False) if _batch_fits(c, 8))
    unpruned = Search(top=3, prune=False)
    assert [p.row() for p in plan(cfg, 8, 1 << 16, 3, search=unpruned)[0]] == [p.row() for p in every[:3]]
    assert unpruned.evaluated == every_search.evaluated


def _batch_fits(cfg, gpus: int) -> bool:
    try:
        check_world_size(cfg, gpus)
    except ConfigError:
        return False
    return True


def test_the_progress_line_starts_at_the_first_candidate(capsys):
    """tools/plan.py's progress line (not on a terminal) is printed at the first candidate, then every 10 s, and
    at the end."""
    progress = Progress()
    progress(0, 3, 40, 0)
    progress(5, 4, 40, 1)
    progress(9, 40, 40, 2)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[0].startswith("planning: 0 candidate") and "(40 of 40 layouts), 2 fit" in lines[1]
