"""The run's choices are made once (megalysses.plan.resolve, on this machine through training/runtime.py):
dtype, attention backend, kernels, printed on the start-up line; what this machine cannot do is a
ConfigError before anything is built."""
import json

import pytest
import torch

from megalysses.config import ConfigError
from megalysses.config.io import load_config
from megalysses.grid import ParallelGrid
from megalysses.training.runtime import model_config, startup_line, write_runtime
from megalysses.testing import resolve_run

BASE = ["data.mock=true", "data.seq_len=32", "model.hidden_size=64", "model.num_heads=4", "model.vocab_size=1000"]


def test_auto_on_cpu():
    cfg = load_config(overrides=BASE + ["training.activation_checkpointing=true", "training.loss_chunk_tokens=8"])
    rt = resolve_run(cfg, torch.device("cpu"))
    assert (rt.attention, rt.dtype, rt.kernels) == ("sdpa", "float32", "torch")
    assert model_config(cfg, rt).attention_backend == "sdpa" and cfg.model.attention_backend == "auto"
    line = startup_line(cfg, ParallelGrid.single(), rt)
    for part in ("world=1 tp=1 sp=1 pp=1 dp=1", "cpu float32", "attention sdpa", "kernels torch", "ZeRO-1",
                 "activation checkpointing", "tiled loss (8 tokens)", "vocab 1000 (padded to 1024)",
                 "| 0 communicators"):       # one process without a process group
        assert part in line, (part, line)


@pytest.mark.parametrize("override,message", [
    ("model.attention_backend=flex", "model.attention_backend=flex: attention backend 'flex' has no backward on CPU"),
    ("model.attention_backend=flash", "'flash' is unavailable on cpu"),
    ("model.kernels=liger", "model.kernels=liger: liger is unavailable"),
    ("model.kernels=apex", "model.kernels=apex: apex is unavailable"),
])
def test_what_cannot_run_here_is_a_config_error(override, message):
    if override.endswith("flex"):
        from megalysses.kernels.attention import available_backends
        if "flex" not in available_backends("cpu"):
            pytest.skip("this torch has no FlexAttention")
    cfg = load_config(overrides=BASE + [override])
    with pytest.raises(ConfigError) as e:
        resolve_run(cfg, torch.device("cpu"))
    assert message in str(e.value)


def test_startup_line_and_runtime_json_show_the_curriculum(tmp_path):
    """Each stage's length, the step it starts at and its padding to the layout's multiple (sp=4 as
    ulysses 2 x ring 2 pads to multiples of 4)."""
    cfg = load_config(overrides=BASE + ["model.num_kv_heads=1", "model.num_heads=2", "parallel.sp=4",
                                        "data.seq_len_schedule=[[0, 2], [10, 8], [20, 32]]"])
    rt = resolve_run(cfg, torch.device("cpu"))
    assert (rt.degrees.ulysses, rt.degrees.ring) == (2, 2)
    assert [(p.name, p.seq_len, p.padded_len) for p in rt.phases] == [
        ("train", 2, 4), ("train from step 11", 8, 8), ("train from step 21", 32, 32), ("eval", 32, 32)]
    line = startup_line(cfg, ParallelGrid.single(), rt)
    assert "sp = ulysses 2 x ring 2, seq_len 2 (padded to 4) -> 8 at step 11 -> 32 at step 21 |" in line, line
    write_runtime(tmp_path, cfg, ParallelGrid.single(), rt)
    phases = json.loads((tmp_path / "runtime.json").read_text())["phases"]
    assert [p["padded_len"] for p in phases] == [4, 8, 32, 32]


def test_compiled_flex_may_specialise_for_every_length_and_block_of_the_run():
    """Compiled FlexAttention specialises per shape and grad mode: a curriculum of 3 lengths under a ring
    (3 block shapes, forward and recomputed backward) needs more than dynamo's default of 8 per function,
    past which a new shape would silently run the unfused (S, S) eager path. The run reserves what it
    needs and never lowers a higher limit. (tests/test_gpu.py trains through it with the limit at 1.)"""
    import torch._dynamo

    from megalysses.kernels.attention import reserve_compiles
    from megalysses.training.runtime import flex_compile_budget

    schedule = "data.seq_len_schedule=[[0, 8], [10, 16], [20, 32]]"
    ring = resolve_run(load_config(overrides=BASE + ["model.num_kv_heads=1", "model.num_heads=2", "parallel.sp=4",
                                                      schedule]), torch.device("cpu"))
    plain = resolve_run(load_config(overrides=BASE + [schedule]), torch.device("cpu"))
    fixed = resolve_run(load_config(overrides=BASE), torch.device("cpu"))
    assert ring.degrees.ring == 2 and flex_compile_budget(ring) >= 8 + 3 * 3 * 2
    assert flex_compile_budget(fixed) < flex_compile_budget(plain) < flex_compile_budget(ring)
    dynamo = torch._dynamo.config
    name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
    with dynamo.patch(**{name: 8}, accumulated_recompile_limit=dynamo.accumulated_recompile_limit):
        assert reserve_compiles(flex_compile_budget(ring)) == flex_compile_budget(ring) == getattr(dynamo, name)
    with dynamo.patch(**{name: 1000}, accumulated_recompile_limit=dynamo.accumulated_recompile_limit):
        assert reserve_compiles(flex_compile_budget(ring)) == 1000
