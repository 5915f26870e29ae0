"""End-to-end training parity: 3 optimizer steps at each layout equal one process (losses and final
weights), and checkpoint/resume continues a run exactly, at the same or another layout."""
import json
from pathlib import Path

import pytest
import torch

from chat_data import write_conversations
from megalysses.config.io import load_config
from megalysses.testing import run_distributed

BASE = [
    "data.mock=true", "data.seq_len=32", "model.vocab_size=128", "model.hidden_size=64", "model.num_layers=4",
    "model.num_heads=8", "model.num_kv_heads=2", "model.attention_backend=sdpa", "training.micro_batch_size=1",
    "training.global_batch_size=4", "training.train_steps=3", "optimizer.lr=1e-3", "optimizer.warmup_steps=1",
    "optimizer.grad_clip=0.5", "logging.log_interval=1", "parallel.timeout_seconds=60",
    # Adam moves an element by ~lr * g / (|g| + eps): where |g| is near eps, fp32 reassociation noise in g
    # becomes noise in the weights, and a few such elements dominate a tensor's error. eps = 1e-6 keeps
    # the final-weight comparison about the layouts (at 1e-8 one o_proj reads 5e-5 for that reason alone).
    "optimizer.eps=1e-6",
    "parallel.grad_bucket_elements=5000",   # several buckets, reduce-scatters overlapped with the backward
    "training.eval_interval=3", "training.eval_steps=1",   # validation (with the layout's sharding) at step 3
]
# conversations packed whole with a loss mask, as NullTokenizer ids: step 1 packed into sequences of 16 tokens,
# steps 2-3 into 32 (those longer truncated), each conversation a document of its own
CHAT = ["data.mock=false", "data.paths=[{chat}]", "data.tokenizer=NullTokenizer", "data.split=3,1,0",
        "data.seq_len_schedule=[[0, 16], [1, 32]]", "data.too_long=truncate", "optimizer.lr=1e-2"]
# each conversation weighing the same in the loss (those that are too long dropped), at 32 tokens throughout
CHAT_DOC = CHAT[:4] + ["data.loss_average=document", "optimizer.lr=1e-2"]
QWEN = ["model.qk_layernorm=true", "model.add_qkv_bias=true", "model.head_dim=12", "model.sliding_window=7",
        "model.rope_scaling.type=yarn", "model.rope_scaling.factor=4",
        "model.rope_scaling.original_max_position_embeddings=16"]
LAYOUTS = {  # name: (world, overrides)
    "single": (1, []),
    "single_chat": (1, CHAT),
    "single_chat_doc": (1, CHAT_DOC),
    "chat_doc_dp2": (2, CHAT_DOC),
    "chat_ring2pp2": (4, CHAT + ["parallel.sp=2", "parallel.sp_ring=2", "parallel.pp=2"]),
    "chat_doc_tp2sp2": (4, CHAT_DOC + ["parallel.tp=2", "parallel.sp=2", "parallel.tp_sequence_parallel=true"]),
    "tp2": (2, ["parallel.tp=2"]),
    "sp2": (2, ["parallel.sp=2"]),
    "pp2": (2, ["parallel.pp=2", "training.activation_checkpointing=true"]),   # 4 micro-batches, 2 stages
    "dp2": (2, []),
    "dp2_no_overlap": (2, ["parallel.overlap_grad_reduce=false"]),
    "pp2v2": (2, ["parallel.pp=2", "parallel.virtual_stages=2"]),   # interleaved 1F1B, 2 chunks per rank
    "sp4": (4, ["parallel.sp=4"]),            # 2 KV heads over 4 sp ranks: KV replication
    "tp2sp2pp2": (8, ["parallel.tp=2", "parallel.sp=2", "parallel.pp=2", "parallel.tp_sequence_parallel=true",
                      "model.tie_embeddings=true"]),
    # FSDP2: weights, gradients and optimizer state sharded over dp x sp
    "fsdp_dp2": (2, ["parallel.fsdp=true"]),
    "fsdp_sp2": (2, ["parallel.sp=2", "parallel.fsdp=true", "training.activation_checkpointing=true",
                     "training.loss_chunk_tokens=4", "training.mlp_chunk_tokens=6"]),
    "fsdp_tp2sp2": (4, ["parallel.tp=2", "parallel.sp=2", "parallel.tp_sequence_parallel=true", "parallel.fsdp=true"]),
    "fsdp_pp2dp2": (4, ["parallel.pp=2", "parallel.fsdp=true"]),
    # bf16 autocast (CPU): FSDP gathers bf16 weights, so pipeline stages produce bf16 activations
    "bf16_pp2dp2": (4, ["parallel.pp=2", "training.dtype=bfloat16"]),
    "bf16_fsdp_pp2dp2": (4, ["parallel.pp=2", "parallel.fsdp=true", "training.dtype=bfloat16"]),
    "fsdp_pp2v2dp2": (4, ["parallel.pp=2", "parallel.virtual_stages=2", "parallel.fsdp=true"]),
    "tp2sp2pp2v2": (8, ["parallel.tp=2", "parallel.sp=2", "parallel.pp=2", "parallel.virtual_stages=2",
                        "parallel.tp_sequence_parallel=true", "model.tie_embeddings=true"]),
    "fsdp_tp2sp2pp2": (8, ["parallel.tp=2", "parallel.sp=2", "parallel.pp=2", "parallel.fsdp=true",
                           "model.tie_embeddings=true"]),
    # sp = ulysses x ring: ring attention alone, and under Ulysses, with pp, dp, FSDP, tp
    "ring2": (2, ["parallel.sp=2", "parallel.sp_ring=2"]),
    "ring2pp2": (4, ["parallel.sp=2", "parallel.sp_ring=2", "parallel.pp=2", "training.activation_checkpointing=true"]),
    # a length the layout does not divide: the ring's 4 zigzag chunks need 32, padded with masked labels,
    # and the pipeline passes the padded activations between stages
    "single_31": (1, ["data.seq_len=31"]),
    "ring2pp2_31": (4, ["parallel.sp=2", "parallel.sp_ring=2", "parallel.pp=2", "data.seq_len=31"]),
    "fsdp_u2ring2": (4, ["parallel.sp=4", "parallel.sp_ring=2", "parallel.fsdp=true"]),
    # 3 and 4 stages with tied embeddings: the middle stages hold neither copy of the embedding
    "single_tied": (1, ["model.tie_embeddings=true"]),
    "single_tied_6": (1, ["model.tie_embeddings=true", "model.num_layers=6"]),
    "pp4_tied": (4, ["parallel.pp=4", "model.tie_embeddings=true"]),
    "pp3_tied": (3, ["parallel.pp=3", "model.tie_embeddings=true", "model.num_layers=6"]),
    # attention in head chunks (2 KV heads: one each), recomputed per chunk: with pp under checkpointing, with
    # FSDP and activation offload over Ulysses (each chunk's KV head replicated), with a ring and pp
    "chunks2_pp2": (2, ["parallel.pp=2", "training.activation_checkpointing=true", "training.attention_head_chunks=2"]),
    "chunks2_fsdp_sp2_offload": (2, ["parallel.sp=2", "parallel.fsdp=true", "training.activation_checkpointing=true",
                                     "training.activation_offload=true", "training.attention_head_chunks=2"]),
    "chunks2_ring2pp2": (4, ["parallel.sp=2", "parallel.sp_ring=2", "parallel.pp=2",
                             "training.attention_head_chunks=2"]),
    "tp2u2ring2": (8, ["parallel.tp=2", "parallel.sp=4", "parallel.sp_ring=2", "parallel.tp_sequence_parallel=true",
                       "model.tie_embeddings=true"]),
    # the Qwen and Mistral settings together (q/k head norms, q/k/v-only biases, heads of 12, YaRN, a sliding
    # window): one process, and tp (TP sequence sharding) x a ring under FSDP
    "single_qwen": (1, QWEN),
    "qwen_fsdp_tp2ring2": (4, QWEN + ["parallel.tp=2", "parallel.tp_sequence_parallel=true", "parallel.sp=2",
                                      "parallel.sp_ring=2", "parallel.fsdp=true"]),
}


def _train_worker(rank, world, runs):
    """Train each (run_dir, overrides) in turn on this world; return this rank's parameter shards."""
    from megalysses.training import loop
    from megalysses.training.runtime import plan_and_grid

    out = []
    for run_dir, overrides in runs:
        cfg = load_config(overrides=BASE + overrides + [f"logging.run_dir={run_dir}"])
        run, grid = plan_and_grid(cfg, torch.device("cpu"))
        shards = {}
        original = loop.build_model

        def keep(*args, original=original, shards=shards):
            model = original(*args)
            shards["model"] = model
            return model

        loop.build_model = keep
        try:
            loop.train(cfg, grid, torch.device("cpu"), run=run)
        finally:
            loop.build_model = original
        params = {n: (full_over_grad(p), getattr(p, "tp_dim", None)) for n, p in shards["model"].named_parameters()}
        out.append({"tp_rank": grid.tp_rank, "tp": grid.tp_size, "dp_sp": (grid.dp_rank, grid.sp_rank),
                    "params": params})
    return out


def full_over_grad(p: torch.Tensor) -> torch.Tensor:
    """This rank's tp shard of a parameter; FSDP's dim-0 chunks are gathered over the grad group first."""
    p = p.detach()
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).clone()


def full_weights(results: list) -> dict:
    """Reassemble full tensors from the tp shards of the (dp=0, sp=0) ranks of every stage."""
    pieces: dict = {}
    for r in results:
        if r["dp_sp"] != (0, 0):
            continue
        for name, (t, tp_dim) in r["params"].items():
            pieces.setdefault(name, {})[r["tp_rank"]] = (t, tp_dim)
    full = {}
    for name, by_rank in pieces.items():
        tp_dim = by_rank[0][1]
        parts = [by_rank[k][0] for k in sorted(by_rank)]
        full[name] = parts[0] if tp_dim is None or len(parts) == 1 else torch.cat(parts, dim=tp_dim)
    return full


def losses(run_dir: Path) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def grad_norms(run_dir: Path) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["grad_norm"] for r in rows if "grad_norm" in r]


def val_losses(run_dir: Path) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["val_loss"] for r in rows if "val_loss" in r]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error in the Frobenius norm. (Adam divides each element by its own gradient scale, so
    the fp32 reassociation noise of near-zero gradients shows up element-wise, not in the norm.)"""
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def run_layouts(tmp_path: Path, world: int, names: list[str], layouts: dict = LAYOUTS, chat: str = "") -> dict:
    """Train each named layout on `world` ranks (one spawned group); `chat` is the conversations' prefix."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    runs = [(str(tmp_path / n), [o.replace("{chat}", chat) for o in layouts[n][1]]) for n in names]
    per_rank = run_distributed(_train_worker, world, tmp_path, args=(runs,), timeout=400)
    return {n: (losses(tmp_path / n), full_weights([r[i] for r in per_rank]), grad_norms(tmp_path / n),
                val_losses(tmp_path / n)) for i, n in enumerate(names)}


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    return write_conversations(tmp_path_factory.mktemp("chat") / "chat_text_document")


@pytest.fixture(scope="module")
def references(tmp_path_factory, chat):
    """Single-process runs, in one spawn: at seq_len 32 and at 31, with tied embeddings (4 and 6 layers), on
    packed conversations (the mean over tokens, and over conversations), and with the Qwen and Mistral settings."""
    return run_layouts(tmp_path_factory.mktemp("ref"), 1, ["single", "single_31", "single_tied", "single_tied_6",
                                                            "single_chat", "single_chat_doc", "single_qwen"],
                       chat=chat)


@pytest.fixture(scope="module")
def reference(references):
    return references["single"]


def check_against(reference, got, name):
    ref_losses, ref_weights, ref_norms, ref_val = reference
    got_losses, got_weights, got_norms, got_val = got
    assert len(got_val) == len(ref_val) == 1
    assert abs(got_val[0] - ref_val[0]) <= 1e-5 * abs(ref_val[0]), f"{name}: validation loss {got_val} != {ref_val}"
    assert len(got_losses) == len(ref_losses) == len(got_norms) == 3
    for step, (a, b) in enumerate(zip(got_losses, ref_losses), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"{name}: step {step} loss {a} != {b}"
    # Adam is blind to a uniform gradient scale: the norm is what shows a mean-instead-of-sum reduction
    for step, (a, b) in enumerate(zip(got_norms, ref_norms), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"{name}: step {step} gradient norm {a} != {b}"
    assert set(got_weights) == set(ref_weights)
    bad = {n: rel(got_weights[n], ref_weights[n]) for n in ref_weights if rel(got_weights[n], ref_weights[n]) > 1e-5}
    assert not bad, f"{name}: final weights differ: {bad}"
    # the optimizer really moved the weights (a test that cannot fail is no test)
    assert ref_losses[2] < ref_losses[0]


def test_layouts_on_2_ranks(tmp_path, references, chat):
    results = run_layouts(tmp_path, 2, ["tp2", "sp2", "pp2", "dp2", "dp2_no_overlap", "fsdp_dp2",
                                        "fsdp_sp2", "pp2v2", "ring2", "chunks2_pp2", "chunks2_fsdp_sp2_offload",
                                        "chat_doc_dp2"], chat=chat)
    for name, got in results.items():
        check_against(references[reference_of(name)], got, name)


def reference_of(name: str) -> str:
    """The single-process run a layout equals."""
    return "single_chat_doc" if name.startswith("chat_doc") else "single_chat" if name.startswith("chat") else "single"


def test_layouts_on_4_ranks(tmp_path, references, chat):
    # sp4: 2 KV heads over 4 sp ranks (KV replication); FSDP with tp + sp and with a pipeline
    results = run_layouts(tmp_path, 4, ["sp4", "fsdp_tp2sp2", "fsdp_pp2dp2", "fsdp_pp2v2dp2", "bf16_pp2dp2",
                                        "bf16_fsdp_pp2dp2", "ring2pp2", "fsdp_u2ring2", "ring2pp2_31", "pp4_tied",
                                        "chunks2_ring2pp2", "chat_ring2pp2", "chat_doc_tp2sp2", "qwen_fsdp_tp2ring2"],
                          chat=chat)
    for name in ("sp4", "fsdp_tp2sp2", "fsdp_pp2dp2", "fsdp_pp2v2dp2", "ring2pp2", "fsdp_u2ring2", "chunks2_ring2pp2",
                 "chat_ring2pp2", "chat_doc_tp2sp2"):
        check_against(references[reference_of(name)], results[name], name)
    check_against(references["single_31"], results["ring2pp2_31"], "ring2pp2_31")
    check_against(references["single_tied"], results["pp4_tied"], "pp4_tied")
    check_against(references["single_qwen"], results["qwen_fsdp_tp2ring2"], "qwen_fsdp_tp2ring2")
    # bf16: FSDP rounds the weights it gathers, so only closeness to the ZeRO-1 bf16 run is expected
    (z_loss, _, z_norm, _), (f_loss, _, f_norm, _) = results["bf16_pp2dp2"], results["bf16_fsdp_pp2dp2"]
    for a, b in zip(f_loss, z_loss):
        assert abs(a - b) <= 2e-3 * abs(b), f"bf16 FSDP pp2 losses {f_loss} vs ZeRO-1 {z_loss}"
    for a, b in zip(f_norm, z_norm):
        assert abs(a - b) <= 3e-2 * abs(b), f"bf16 FSDP pp2 gradient norms {f_norm} vs ZeRO-1 {z_norm}"


def test_pipeline_of_3_stages_with_tied_embeddings(tmp_path, references):
    check_against(references["single_tied_6"], run_layouts(tmp_path, 3, ["pp3_tied"])["pp3_tied"], "pp3_tied")


def test_tp2_sp2_pp2_on_8_ranks(tmp_path, references):
    # tied embeddings and TP sequence sharding here
    ref = references["single_tied"]
    for name, got in run_layouts(tmp_path, 8, ["tp2sp2pp2", "tp2sp2pp2v2", "fsdp_tp2sp2pp2", "tp2u2ring2"]).items():
        check_against(ref, got, name)
