"""training.mlp_chunk_tokens and loss_chunk_tokens `auto` (megalysses/plan/tiles.py): the config takes the
word, resolve turns it into concrete tiles in the ActivationPolicy by the memory model's rule, the planner
explores tiles that way, and a run with auto tiles reaches the peak the model predicts for them."""
from dataclasses import replace

import pytest

from megalysses.config import ConfigError
from megalysses.config.io import load_config, save_config
from megalysses.plan.memory import estimate_plan
from megalysses.plan import resolve
from megalysses.plan.machine import Machine
from megalysses.plan.search import described_machine, plan
from megalysses.plan.step_time import Hardware
from megalysses.plan.tiles import loss_tile, mlp_tile

AUTO = ["training.mlp_chunk_tokens=auto", "training.loss_chunk_tokens=auto"]
ONE_GPU_8B = ["parallel.sp=1", "parallel.pp=1", "parallel.virtual_stages=1", "training.global_batch_size=1",
              "training.activation_offload=true", "training.optimizer_offload=true"]


def _peak(cfg, run, **tiles) -> float:
    return estimate_plan(cfg, replace(run, activation=replace(run.activation, **tiles))).peak


def test_config_takes_auto_and_integers(tmp_path):
    cfg = load_config(overrides=["data.mock=true"] + AUTO)
    assert (cfg.training.mlp_chunk_tokens, cfg.training.loss_chunk_tokens) == ("auto", "auto")
    save_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml").training == cfg.training
    assert load_config(overrides=["data.mock=true", "training.mlp_chunk_tokens=4096"]).training.mlp_chunk_tokens == 4096
    with pytest.raises(ConfigError, match=r"training.mlp_chunk_tokens: expected an integer or auto, got 'big'"):
        load_config(overrides=["data.mock=true", "training.mlp_chunk_tokens=big"])
    with pytest.raises(ConfigError, match=r"training.loss_chunk_tokens=-1 is out of range"):
        load_config(overrides=["data.mock=true", "training.loss_chunk_tokens=-1"])


def test_auto_resolves_to_concrete_tiles_by_the_rule():
    """8B at 131K tokens on one GPU. Where the untiled MLP fits the device (an 80 GiB H100), auto does not tile
    (no recomputation). Where it does not (a 40 GiB GPU; or no memory known, as on CPU), the MLP tile is
    hidden x 2^k: its peak is that of hidden-token tiles (ALST's) and the next size up raises it. The loss
    tile's peak is the kernel's default tile's, and the next size up (or one tile of everything) raises it."""
    cfg = load_config("configs/llama3_8b_1m.yaml", ONE_GPU_8B + ["data.seq_len=131072"] + AUTO)
    h = cfg.model.hidden_size
    on_h100 = resolve(cfg, described_machine(1, 80, Hardware()), 1)
    assert on_h100.activation.mlp_chunk_tokens == 0
    assert _peak(cfg, on_h100, mlp_chunk_tokens=0) <= Hardware().usable_bytes(80)
    for machine in (described_machine(1, 40, Hardware()), replace(Machine.described("H100", 1), memory_gib=None)):
        run = resolve(cfg, machine, 1)
        tile, loss = run.activation.mlp_chunk_tokens, run.activation.loss_chunk_tokens
        assert isinstance(tile, int) and isinstance(loss, int)
        assert tile >= h and tile % h == 0 and (tile // h) & (tile // h - 1) == 0, tile
        at_h = _peak(cfg, run, mlp_chunk_tokens=h)
        assert _peak(cfg, run) == at_h < _peak(cfg, run, mlp_chunk_tokens=0)
        assert 2 * tile >= 131072 or _peak(cfg, run, mlp_chunk_tokens=2 * tile) > at_h
        default = _peak(cfg, run, loss_chunk_tokens=0)
        assert _peak(cfg, run) <= default
        assert loss == 131072 or _peak(cfg, run, loss_chunk_tokens=min(2 * loss, 131072)) > default
        assert (tile, loss) == (mlp_tile(cfg, run), loss_tile(cfg, run))
    # 1M tokens on 64 GPUs (16K a rank), FSDP, no checkpointing: the loss sets the peak, so the MLP's tiles grow
    # to the largest that splits the sequence, 2 x hidden, and the loss keeps the default tile
    wide = load_config("configs/llama3_8b_1m.yaml", ["parallel.sp=64", "parallel.pp=1", "parallel.virtual_stages=1",
                                                     "parallel.fsdp=true", "training.activation_checkpointing=false",
                                                     "training.global_batch_size=1"] + AUTO)
    run = resolve(wide, Machine.described("H100", 8, memory_gib=None), 64)
    default_loss = _peak(wide, run, loss_chunk_tokens=0)
    assert run.activation.mlp_chunk_tokens == 2 * h and _peak(wide, run, mlp_chunk_tokens=h) == _peak(wide, run)
    assert _peak(wide, run) == default_loss < _peak(wide, run, loss_chunk_tokens=2 * run.activation.loss_chunk_tokens)
    # a rank's sequence of no more than `hidden` tokens is not tiled
    short = load_config("configs/llama3_8b_1m.yaml", ONE_GPU_8B + ["data.seq_len=4096"] + AUTO)
    assert resolve(short, Machine.described("H100", 1, memory_gib=None), 1).activation.mlp_chunk_tokens == 0


def test_integers_keep_their_meaning():
    cfg = load_config("configs/llama3_8b_1m.yaml")
    run = resolve(cfg, described_machine(64, 80, Hardware()), 64)
    assert (run.activation.mlp_chunk_tokens, run.activation.loss_chunk_tokens) == (16384, 8192)


def test_planner_explores_tiles():
    """The 1B model at 1M tokens on one GPU with host memory: the planner's layouts carry concrete tiles, and the
    top one's MLP tile is one `auto` chooses; an untiled layout is planned where it fits."""
    cfg = load_config("configs/gpt_1b_1m_offload.yaml")
    fitting, considered = plan(cfg, 1, 1 << 20, 80, 256)
    assert fitting and considered
    rows = [p.row() for p in fitting]
    assert all(isinstance(r["mlp_chunk_tokens"], int) and isinstance(r["loss_chunk_tokens"], int) for r in rows)
    best = fitting[0]
    assert best.cfg.training.mlp_chunk_tokens == "auto" and rows[0]["mlp_chunk_tokens"] % cfg.model.hidden_size == 0
    short, _ = plan(cfg, 1, 8192, 80, 256)
    assert short[0].row()["mlp_chunk_tokens"] == 0          # untiled, the fastest, fits at 8K tokens
