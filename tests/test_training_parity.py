"""End-to-end training parity: 3 optimizer steps at each layout equal one process (losses, gradient norms, the
validation loss and final weights), one spawned group of ranks per world size, through tests/parity.py's runner."""
import json

import pytest
import torch

from chat_data import write_conversations
from megalysses.degrees import Degrees
from megalysses.grid import GridLayout
from tests.parity import Run, check_run, run_layouts
from tests.test_grid import check_communicators

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


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    return write_conversations(tmp_path_factory.mktemp("chat") / "chat_text_document")


@pytest.fixture(scope="module")
def references(tmp_path_factory, chat):
    """Single-process runs, in one spawn: at seq_len 32 and at 31, with tied embeddings (4 and 6 layers), on
    packed conversations (the mean over tokens, and over conversations), and with the Qwen and Mistral settings."""
    return run_layouts(tmp_path_factory.mktemp("ref"), 1, ["single", "single_31", "single_tied", "single_tied_6",
                                                            "single_chat", "single_chat_doc", "single_qwen"],
                       LAYOUTS, chat=chat)


# the run each layout equals: one process at the same length, tie and model, or (bf16 FSDP, whose gathered
# weights are rounded) the ZeRO-1 bf16 run, in losses within 2e-3 and gradient norms within 3e-2
REFERENCE = {"ring2pp2_31": "single_31", "pp4_tied": "single_tied", "pp3_tied": "single_tied_6",
             "qwen_fsdp_tp2ring2": "single_qwen", "tp2sp2pp2": "single_tied", "tp2sp2pp2v2": "single_tied",
             "fsdp_tp2sp2pp2": "single_tied", "tp2u2ring2": "single_tied", "bf16_fsdp_pp2dp2": "bf16_pp2dp2"}
CLOSE = {"bf16_fsdp_pp2dp2": dict(tol={"losses": 2e-3, "grad_norms": 3e-2}, quantities=("losses", "grad_norms"))}


def reference_of(name: str) -> str:
    """The run a layout equals."""
    if name in REFERENCE:
        return REFERENCE[name]
    return "single_chat_doc" if name.startswith("chat_doc") else "single_chat" if name.startswith("chat") else "single"


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_layouts_equal_one_process(tmp_path, references, chat, world):
    """Every layout on `world` ranks (one spawned group) against its reference: the single-process runs, or a
    layout of the same group (bf16_pp2dp2, only a reference)."""
    names = [n for n, (w, _) in LAYOUTS.items() if w == world]
    results = run_layouts(tmp_path, world, names, LAYOUTS, chat=chat)
    for name in names:
        # rank 0's communicators, one per set of ranks (the gradients' kept apart where they overlap the step)
        record = json.loads((tmp_path / name / "runtime.json").read_text())
        layout = GridLayout(Degrees.of_world(world, **{k: record[k] for k in ("tp", "sp", "pp", "ring")}))
        check_communicators(layout, 0, record["communicators"], record["grad_overlap"])
        if name in REFERENCE.values():
            continue
        want = reference_of(name)
        check_run(references[want] if want in references else results[want], results[name], name,
                  **CLOSE.get(name, {}))


def test_check_run_fails_on_each_quantity():
    """The comparison every run goes through tells apart a loss, a gradient norm, a validation loss or a weight
    off by 2e-5 relative, a missing step, and a reference whose loss did not fall."""
    want = Run([3.0, 2.5, 2.0], {"w": torch.ones(4, 4)}, [1.5, 1.2, 1.0], [2.1])
    check_run(want, Run(*want), "same")
    off = 1 + 2e-5
    for got in (Run([3.0, 2.5 * off, 2.0], *want[1:]), Run(want[0], want[1], [1.5, 1.2, off], want[3]),
                Run(*want[:3], [2.1 * off]), Run(want[0], {"w": torch.ones(4, 4) * off}, *want[2:]),
                Run(want[0][:2], *want[1:])):
        with pytest.raises(AssertionError):
            check_run(want, got, "off")
    flat = Run([2.0, 2.5, 3.0], *want[1:])
    with pytest.raises(AssertionError, match="did not fall"):
        check_run(flat, flat, "flat")
