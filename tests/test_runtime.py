"""The run's choices are made once (training/runtime.py): dtype, attention backend, kernels, printed on the
start-up line; what this machine cannot do is a ConfigError before anything is built."""
import pytest
import torch

from megalysses.config import ConfigError, load_config
from megalysses.grid import ParallelGrid
from megalysses.training.runtime import plan_runtime, startup_line

BASE = ["data.mock=true", "data.seq_len=32", "model.hidden_size=64", "model.num_heads=4", "model.vocab_size=1000"]


def test_auto_on_cpu():
    cfg = load_config(overrides=BASE + ["training.activation_checkpointing=true", "training.loss_chunk_tokens=8"])
    rt = plan_runtime(cfg, torch.device("cpu"))
    assert (rt.attention_backend, rt.dtype, rt.kernels) == ("sdpa", "float32", "torch")
    assert rt.model_config(cfg).attention_backend == "sdpa" and cfg.model.attention_backend == "auto"
    line = startup_line(cfg, ParallelGrid.single(), rt)
    for part in ("world=1 tp=1 sp=1 pp=1 dp=1", "cpu float32", "attention sdpa", "kernels torch", "ZeRO-1",
                 "activation checkpointing", "tiled loss (8 tokens)", "vocab 1000 (padded to 1024)"):
        assert part in line, (part, line)


@pytest.mark.parametrize("override,message", [
    ("model.attention_backend=flex", "model.attention_backend=flex: attention backend 'flex' has no backward on CPU"),
    ("model.attention_backend=flash", "'flash' is unavailable on cpu"),
    ("model.kernels=liger", "model.kernels=liger: model.kernels impl 'liger' is unavailable"),
    ("model.kernels=apex", "model.kernels=apex: model.kernels impl 'apex' is unavailable"),
])
def test_what_cannot_run_here_is_a_config_error(override, message):
    if override.endswith("flex"):
        from megalysses.kernels.attention import available_backends
        if "flex" not in available_backends("cpu"):
            pytest.skip("this torch has no FlexAttention")
    cfg = load_config(overrides=BASE + [override])
    with pytest.raises(ConfigError) as e:
        plan_runtime(cfg, torch.device("cpu"))
    assert message in str(e.value)
