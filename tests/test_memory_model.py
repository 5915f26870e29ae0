"""Saved-activation accounting: what each memory option and layout keeps for the backward, measured with
saved-tensor hooks (deduplicated by storage) on CPU with SDPA, against the memory model (within 10%, fp32).

Fails if any retained activation grows as S^2 (measured at S and 2S) or is left unsharded under
Ulysses sp (per-rank bytes must scale as 1/sp)."""
import functools
import importlib.util
import json
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from megalysses.config import Config, ConfigError, ModelConfig, load_config
from megalysses.memory import (IMPLEMENTATIONS, PRECISIONS, Layout, Options, Retained, Workload, bytes_per_token,
                               estimate, estimate_config, in_flight, layer_terms, measure_retained,
                               retained_activation_bytes)
from megalysses.model.gpt import GPTStage, init_weights
from megalysses.model.layers import ParallelGroups
from megalysses.parallel.interleaved import rank_order
from megalysses.testing import run_distributed
from megalysses.training.loop import check_environment

S = 64                     # and 2S: the S^2 check
FP32 = PRECISIONS["fp32"]
OPTIONS = {
    "none": {},
    "checkpointing": {"activation_checkpointing": True},
    "tiled MLP": {"mlp_chunk_tokens": 16},
    "tiled loss": {"loss_chunk_tokens": 16},
    "all three": {"activation_checkpointing": True, "mlp_chunk_tokens": 16, "loss_chunk_tokens": 16},
}


def _model_cfg(layers: int = 2, backend: str = "sdpa", kv_heads: int = 2) -> ModelConfig:
    return ModelConfig(vocab_size=256, hidden_size=64, num_layers=layers, num_heads=4, num_kv_heads=kv_heads,
                       ffn_hidden_size=160, attention_backend=backend)


def _measure(cfg: ModelConfig, seq: int, opts: dict, groups: ParallelGroups = ParallelGroups(), tp_rank: int = 0,
             sp_rank: int = 0) -> Retained:
    """One forward of a whole-model stage on this rank's shard of a length-`seq` sequence: the Retained
    measurement (bytes, storages)."""
    torch.manual_seed(0)
    model = GPTStage(cfg, groups, activation_checkpointing=opts.get("activation_checkpointing", False),
                     loss_chunk_tokens=opts.get("loss_chunk_tokens", 0), mlp_chunk_tokens=opts.get("mlp_chunk_tokens", 0))
    init_weights(model, 0, tp_rank, groups.tp_size)
    ids = torch.randint(0, cfg.vocab_size, (1, seq))
    s = seq // groups.sp_size
    chunk = slice(sp_rank * s, (sp_rank + 1) * s)
    pos = torch.arange(seq)[None, chunk]
    ids_local = ids[:, chunk].contiguous()
    _, retained = measure_retained(lambda: model(ids_local, pos, labels=ids_local),
                                   exclude=tuple(model.parameters()) + (pos,))
    return retained


@functools.lru_cache(maxsize=None)
def _single(name: str, seq: int, layers: int = 2, backend: str = "sdpa"):
    """One process, cached: several tests look at the same measurement."""
    return _measure(_model_cfg(layers, backend), seq, OPTIONS[name])


def _predicted(cfg: ModelConfig, seq: int, opts: dict, tp: int = 1, sp: int = 1, sequence_parallel: bool = False) -> float:
    options = Options(attention=cfg.attention_backend, native_gqa=False, tp_sequence_parallel=sequence_parallel, **opts)
    return retained_activation_bytes(cfg, Layout(tp=tp, sp=sp), options, FP32, seq)


def grows_quadratically(small, large, factor: float = 2.0) -> bool:
    """True when what is retained grows faster than the sequence from `small` (S) to `large` (factor*S):
    the total, or the largest storage (an S^2 tensor grows factor^2). A smaller S^2 term also breaks the
    10% agreement with the model (which is linear in S) at one of the two lengths."""
    return large.bytes > 1.1 * factor * small.bytes or large.storages[0][0] > 1.1 * factor * small.storages[0][0]


def _close(measured: float, predicted: float, what: str) -> None:
    assert abs(predicted - measured) <= 0.10 * measured, f"{what}: model {predicted:.0f} B vs measured {measured:.0f} B"


@pytest.mark.parametrize("name", list(OPTIONS))
def test_single_rank_options_match_the_model_and_stay_linear(name):
    opts = OPTIONS[name]
    cfg = _model_cfg()
    small, large = _single(name, S), _single(name, 2 * S)
    _close(small.bytes, _predicted(cfg, S, opts), f"{name} at S={S}")
    _close(large.bytes, _predicted(cfg, 2 * S, opts), f"{name} at S={2 * S}")
    assert not grows_quadratically(small, large), f"{name}: {small.storages[:3]} -> {large.storages[:3]}"
    # per layer: the difference a third layer makes, per token, against the model's layer terms
    per_layer = (_single(name, S, layers=3).bytes - small.bytes) / S
    options = Options(attention="sdpa", native_gqa=False, **opts)
    _close(per_layer, bytes_per_token(layer_terms(cfg, Layout(), options, S), FP32, IMPLEMENTATIONS["megalysses"]), f"{name}: bytes per token per layer")


def test_options_shrink_what_is_kept():
    kept = {name: _single(name, S).bytes for name in OPTIONS}
    assert kept["checkpointing"] < kept["tiled MLP"] < kept["none"]
    assert kept["tiled loss"] < kept["none"]
    assert kept["all three"] == min(kept.values())


def test_quadratic_detector_flags_the_reference_backend():
    """The check above can fail: the reference backend keeps S x S probabilities, and the model knows it."""
    small, large = _single("none", S, backend="reference"), _single("none", 2 * S, backend="reference")
    assert grows_quadratically(small, large)
    _close(large.bytes, _predicted(_model_cfg(backend="reference"), 2 * S, {}), "reference backend")


LAYOUTS = {   # name: (tp, sp, TP sequence sharding, memory options)
    "tp2": (2, 1, False, "none"),
    "tp2 sequence-parallel": (2, 1, True, "none"),
    "tp2 sequence-parallel, checkpointing + tiles": (2, 1, True, "all three"),
    "sp2": (1, 2, False, "none"),
    "sp2, tiled MLP": (1, 2, False, "tiled MLP"),
    "sp2, checkpointing + tiles": (1, 2, False, "all three"),
    "sp2, one KV head (replicated to each sp rank)": (1, 2, False, "none"),
}


def _layout_cfg(name: str) -> ModelConfig:
    return _model_cfg(kv_heads=1 if "one KV head" in name else 2)


def _measure_layouts(rank: int, world: int) -> dict:
    group = dist.new_group([0, 1])
    out = {}
    for name, (tp, sp, seq_par, option) in LAYOUTS.items():
        opts = OPTIONS[option]
        groups = ParallelGroups(tp=group if tp > 1 else None, sp=group if sp > 1 else None, sequence_parallel=seq_par)
        out[name] = [_measure(_layout_cfg(name), n, opts, groups, tp_rank=rank if tp > 1 else 0,
                              sp_rank=rank if sp > 1 else 0) for n in (S, 2 * S)]
    return out


def test_layouts_match_the_model_and_shard_over_sp(tmp_path):
    ranks = run_distributed(_measure_layouts, 2, tmp_dir=tmp_path)
    for name, (tp, sp, seq_par, option) in LAYOUTS.items():
        opts, cfg = OPTIONS[option], _layout_cfg(name)
        for rank, measured in enumerate(ranks):
            small, large = measured[name]
            _close(small.bytes, _predicted(cfg, S, opts, tp, sp, seq_par), f"{name}, rank {rank}, S={S}")
            _close(large.bytes, _predicted(cfg, 2 * S, opts, tp, sp, seq_par), f"{name}, rank {rank}, S={2 * S}")
            assert not grows_quadratically(small, large), f"{name}: {small.storages[:3]} -> {large.storages[:3]}"
        if sp > 1:   # per rank, about 1/sp of one process's bytes (sp adds the all-to-all buffer and a copy of o)
            single = _measure(cfg, S, opts).bytes
            for rank, measured in enumerate(ranks):
                assert measured[name][0].bytes <= 1.2 * single / sp, (name, rank, measured[name][0].bytes, single)


def test_in_flight_matches_the_schedules():
    """1F1B: stage p holds P - p micro-batches; interleaved: Megatron's warm-up + 1 chunks (per rank_order)."""
    for P, v, M in [(2, 1, 4), (4, 1, 8), (4, 1, 2), (2, 2, 4), (4, 2, 8), (2, 4, 2)]:
        for stage in range(P):
            if v == 1:
                expect = min(P - stage, M)
            else:
                depth, peak = 0, 0
                for a in rank_order(P, v, M, stage):
                    depth += 1 if a.kind == "F" else -1
                    peak = max(peak, depth)
                expect = peak / v
            assert in_flight(Layout(pp=P, virtual_stages=v), stage, M) == expect, (P, v, M, stage)


def test_estimate_breakdown_adds_up_and_offload_moves_activations_to_host():
    cfg = load_config("configs/llama3_8b_128k.yaml", ["data.mock=true", "data.paths=[]"])
    est = estimate_config(cfg, world_size=32)
    assert abs(sum(t.bytes for t in est.terms if not t.host) - est.peak) < 1.0
    m, layout, bf16 = cfg.model, Layout(sp=8, dp=4), PRECISIONS["bf16"]
    base = Options(activation_checkpointing=True, loss_chunk_tokens=8192)
    kept = {S: {t.name: t.bytes for t in estimate(m, layout, base, bf16, Workload(S)).terms} for S in (2 ** 17, 2 ** 18)}
    assert kept[2 ** 18]["layer activations"] == 2 * kept[2 ** 17]["layer activations"]
    assert kept[2 ** 18]["weights"] == kept[2 ** 17]["weights"]
    on_device = estimate(m, layout, base, bf16, Workload(2 ** 17))
    offloaded = estimate(m, layout, replace(base, activation_offload=True), bf16, Workload(2 ** 17))
    assert offloaded.peak < on_device.peak
    assert offloaded.host == kept[2 ** 17]["layer activations"]


def test_training_refuses_activation_offload_until_it_exists():
    cfg = Config()
    cfg.training.activation_offload = True
    with pytest.raises(ConfigError, match="activation offload is not implemented yet"):
        check_environment(cfg, torch.device("cpu"))


def test_bench_memory_smoke(tmp_path):
    """benchmarks/bench_memory.py --smoke: the GPU benchmark's harness end to end on CPU."""
    spec = importlib.util.spec_from_file_location("bench_memory", "benchmarks/bench_memory.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "memory.json"
    assert bench.main(["--smoke", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["seq_len"] for r in rows] == [128, 256]
    for r in rows:
        assert abs(r["error"]) <= 0.10 and r["loss"] > 0, r
