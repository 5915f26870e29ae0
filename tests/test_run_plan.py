"""What the planner predicts is what the run does: the plan tools/plan.py prints for a config equals the
runtime.json that the run's own start-up path writes (train() up to step 1, its model and optimizer built
and checked against the plan), for every shipped config at its GPU count on described H100s with a plain
torch install, and for a tiny real run on this CPU."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megalysses.config.io import load_config
from megalysses.plan import Machine
from megalysses.plan.search import evaluate
from megalysses.plan.step_time import Hardware
from megalysses.tools import plan as plan_cli
from megalysses.tools import pretrain
from tests.fixtures import MOCK_32, SMALL_MODEL

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = [("configs/quickstart.yaml", 4), ("configs/gpt_1b_32k.yaml", 8), ("configs/gpt_1b_8gpu.yaml", 8),
           ("configs/gpt_1b_1m_offload.yaml", 1), ("configs/llama3_8b_128k.yaml", 32),
           ("configs/llama3_8b_1m.yaml", 64), ("configs/llama3_8b_chat_128k.yaml", 8), ("configs/passkey_cpu.yaml", 1)]


def test_every_shipped_config_is_covered():
    assert sorted(p for p, _ in SHIPPED) == sorted(f"configs/{f.name}" for f in (ROOT / "configs").glob("*.yaml"))


def agree(planned: dict, runtime: dict) -> None:
    assert planned, "the planner printed no plan"
    differ = {k: (v, runtime.get(k)) for k, v in planned.items() if runtime.get(k) != v}
    assert not differ, f"planned vs run: {differ}"


HOST_GIB = {"configs/gpt_1b_1m_offload.yaml": 256}      # the node's memory, where a config offloads to it


@pytest.mark.parametrize("path, gpus", SHIPPED)
def test_the_planned_run_is_the_run_that_starts(path, gpus, tmp_path, capsys):
    """... and it fits the machine, as the planner judges it (the dry run's last line)."""
    config = str(ROOT / path)
    host = ["--host-memory-gib", str(HOST_GIB[path])] if path in HOST_GIB else []
    assert plan_cli.main(["--config", config, "--gpus", str(gpus), "--json", "--no-search", *host]) == 0
    judged = json.loads(capsys.readouterr().out)["config_layout"]
    planned = judged["plan"]
    run_dir = tmp_path / "run"
    assert pretrain.main(["--config", config, "--dry-run", "--gpus", str(gpus),
                          "--set", f"logging.run_dir={run_dir}", *host]) == 0
    out = capsys.readouterr().out
    assert "runtime.json written" in out and judged["fits"]
    assert out.strip().splitlines()[-1].startswith("the config's own layout (") and " fits, peak " in out
    agree(planned, json.loads((run_dir / "runtime.json").read_text()))
    assert not (run_dir / "metrics.jsonl").exists() and not any((run_dir / "checkpoints").glob("step_*"))


def test_a_real_run_on_this_cpu_is_the_planned_one(tmp_path):
    """Two gloo ranks under torchrun, one step: its runtime.json is the planner's plan of the same config on
    this machine (its packages, two ranks to the node); --dry-run stops the same launch before step 1."""
    sets = MOCK_32 + SMALL_MODEL + ["training.global_batch_size=2", "training.micro_batch_size=1",
                                    "training.train_steps=1", "parallel.sp=2", "training.activation_checkpointing=true",
            "training.loss_chunk_tokens=8", "parallel.timeout_seconds=60"]
    cfg = load_config(overrides=sets)
    planned = evaluate(cfg, 2, 80, None, Hardware(), machine=Machine.current("cpu", ranks_per_node=2)).plan.record()
    for dry, name in ((False, "real"), (True, "dry")):
        run_dir = tmp_path / name
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(ROOT / "pretrain.py")] + [a for s in sets + [f"logging.run_dir={run_dir}"] for a in ("--set", s)]
        r = subprocess.run(cmd + (["--dry-run"] if dry else []), cwd=ROOT, capture_output=True, text=True,
                           timeout=120, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
        assert r.returncode == 0, r.stdout + r.stderr
        runtime = json.loads((run_dir / "runtime.json").read_text())
        agree(planned, runtime)
        assert (run_dir / "metrics.jsonl").exists() != dry
        # rank 0's communicators, one per process group, counted on the start-up line
        assert f"| {len(runtime['communicators'])} communicators" in r.stdout, r.stdout
        # the background saver's gloo group among them where the plan saves checkpoints in the background
        assert len([c for c in runtime["communicators"] if c["kinds"] == ["checkpoint"]]) == runtime["async_save"]


def test_the_plan_records_what_the_loop_loader_and_model_read():
    """The micro-batches of a step (and of a ramp's batch), the sequence layout that pads every phase, the loss
    tile the model runs (the kernel's default for a rank's rows of the padded vocabulary where none is asked)
    and the gradients' dtype."""
    from megalysses.kernels.linear_cross_entropy import default_chunk_tokens
    from megalysses.plan import resolve

    base = ["data.mock=true", "model.vocab_size=1001", "parallel.tp=2", "parallel.sp=2",
            "parallel.tp_sequence_parallel=true", "data.seq_len=250", "data.seq_len_schedule=[[0, 125], [2, 250]]",
            "training.global_batch_size=8", "training.micro_batch_size=2"]
    cfg = load_config(overrides=base)
    run = resolve(cfg, Machine.current("cpu"), 8)
    assert (run.degrees.dp, run.micro_batch_size, run.micro_batches, run.samples_per_micro_batch) == (2, 2, 2, 4)
    assert run.micro_batches_of(12) == 3
    assert run.sequence.record() == {"sp": 2, "ring": 1, "tp_shard": 2}
    assert [(p.seq_len, p.padded_len) for p in run.phases] == [(125, 128), (250, 252), (250, 252)]
    vocab_rows = cfg.model.padded_vocab_size(2) // 2
    assert run.activation.loss_tile == default_chunk_tokens(vocab_rows) > 0 and run.activation.loss_chunk_tokens == 0
    tiled = resolve(load_config(overrides=base + ["training.loss_chunk_tokens=64"]), Machine.current("cpu"), 8)
    assert (tiled.activation.loss_chunk_tokens, tiled.activation.loss_tile) == (64, 64)
    assert run.grad_dtype == "float32" and run.record()["sequence"] == {"sp": 2, "ring": 1, "tp_shard": 2}
    # the plan holds its degrees once; its record (runtime.json, the planner's JSON) keeps them as flat keys, in
    # the order they always had, the sequence layout right after the phases
    keys = list(run.record())
    assert keys[:10] == ["machine", "world", "tp", "sp", "pp", "dp", "virtual_stages", "ulysses", "ring", "dtype"]
    assert keys[keys.index("phases") + 1:keys.index("phases") + 3] == ["sequence", "activation"]
    assert "degrees" not in keys and run.record()["world"] == 8 == run.degrees.world


def test_the_process_group_starts_with_the_plans_collective(monkeypatch):
    """The device a run resolves its plan on comes before any process group (a gloo run is a CPU run), and the
    group starts with the plan's concrete collective backend, never with `auto`."""
    from megalysses.config import ConfigError
    from megalysses.distributed import init_distributed
    from megalysses.plan import resolve
    from megalysses.plan.machine import local_device

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert local_device() == local_device("nccl") == torch.device("cuda", 1)
    assert local_device("gloo") == torch.device("cpu")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")          # fewer GPUs than local processes: the CPU
    assert local_device() == torch.device("cpu")
    cfg = load_config(overrides=["data.mock=true", "parallel.backend=nccl"])
    with pytest.raises(ConfigError, match="parallel.backend=nccl needs CUDA, which this machine has not"):
        resolve(cfg, Machine.current(local_device(cfg.parallel.backend)), 1)
    assert resolve(load_config(overrides=["data.mock=true"]), Machine.current("cpu"), 1).collective == "gloo"
    with pytest.raises(ValueError, match="pass the plan's run.collective"):
        init_distributed("auto")


def test_async_save_is_decided_once_from_the_nodes_memory():
    """checkpoint.async_save=auto: in the background where the node's memory holds its ranks' staging copy (the
    memory model's pinned host requests, one per saved tensor) beside what they keep there, else synchronous and
    the start-up line says why; unknown memory (a described machine) and false are synchronous, true is kept."""
    from dataclasses import replace

    from megalysses.grid import ParallelGrid
    from megalysses.memory.host import STAGING
    from megalysses.plan import resolve
    from megalysses.plan.memory import estimate_plan, pinned_requests_of
    from megalysses.training.runtime import startup_line

    cfg = load_config(overrides=MOCK_32 + SMALL_MODEL)
    roomy = replace(Machine.current("cpu"), host_memory_gib=64.0, ranks_per_node=2)
    run = resolve(cfg, roomy, 2)
    assert run.async_save and run.async_save_reason.startswith("auto: a staging copy of")
    staging = [r for r in pinned_requests_of(cfg, run, 0) if r.owner == STAGING]
    assert sum(r.count for r in staging) == 4 * len(list(_model_params(cfg)))      # weight, master, moments
    est = estimate_plan(cfg, run)
    assert sum(t.bytes for t in est.terms if t.name.startswith("checkpoint staging")) == sum(r.total for r in staging)
    assert "checkpoints written in the background" in startup_line(cfg, ParallelGrid.single(), run)

    needed = 2 * estimate_plan(cfg, run).host + 2 * est.peak          # a CPU run's peak is host memory too
    tight = resolve(cfg, replace(roomy, host_memory_gib=0.9 * needed / 2**30), 2)
    assert not tight.async_save and "over its" in tight.async_save_reason
    assert not any(r.owner == STAGING for r in pinned_requests_of(cfg, tight, 0))
    line = startup_line(cfg, ParallelGrid.single(), tight)
    assert f"checkpoints written synchronously ({tight.async_save_reason})" in line
    assert resolve(cfg, replace(roomy, host_memory_gib=1.1 * needed / 2**30), 2).async_save
    assert not resolve(cfg, Machine.described(None), 2).async_save
    off = load_config(overrides=MOCK_32 + SMALL_MODEL + ["checkpoint.async_save=false"])
    assert not resolve(off, roomy, 2).async_save
    forced = load_config(overrides=MOCK_32 + SMALL_MODEL + ["checkpoint.async_save=true"])
    assert resolve(forced, replace(roomy, host_memory_gib=0.001), 2).async_save


def _model_params(cfg):
    """The parameter tensors of the whole model of `cfg` (one stage, tp 1)."""
    from megalysses.model.gpt import GPTStage, stage_layers
    from megalysses.model.layers import ParallelGroups
    from megalysses.training.runtime import model_config
    from megalysses.testing import resolve_run

    run = resolve_run(cfg, torch.device("cpu"))
    with torch.device("meta"):
        model = GPTStage(model_config(cfg, run), ParallelGroups(), stage_layers(cfg.model.num_layers, 1, 0),
                         first=True, last=True)
    return model.parameters()
