"""The memory model: predicted peak bytes per rank for a model, its parallel degrees (megalysses.degrees) and its
memory options.

    est = estimate_plan(cfg, plan)                             # a Config and its RunPlan -> Estimate
    est.peak_gib, est.part, est.terms                        # the peak and its breakdown, term by term
    per_token = layer_terms(cfg.model, Degrees(sp=8), Options(checkpointing=True), PRECISIONS["bf16"])

Everything is counted per rank. Activations are counted per token of the rank's sequence shard inside
the tensor-parallel region (S/sp tokens; the residual stream holds S/(sp*tp) of them under TP sequence
sharding), per layer, as named terms (elements per token, bytes per element). Two tables say what the
code keeps, and are the places to update when it changes:
    PRECISIONS  the compute dtype: the model's weights and activations (bf16 on GPUs, fp32 on CPU); the
                optimizer alone holds fp32 masters and moments; gradients accumulate in the compute dtype
                with one micro-batch per step and in fp32 (ZeRO-1's main_grad) with more
    KERNELS     what model.kernels keeps: the torch references (norms over row tiles keep their input
                alone; RoPE keeps cos/sin cast to the compute dtype; SwiGLU keeps the gate-up output and
                silu(gate)) or the fused kernels (input + 1/rms; the gate-up output)

What a layer keeps for the backward (megalysses/model/layers.py, no checkpointing):
    each norm         its input (and 1/rms, with a fused RMSNorm); the torch norms run over row tiles
                      (kernels/norms.py) and their backward recomputes one tile at a time
    QKV, gate-up      the norm output (under TP sequence sharding the all-gathered copy)
    q/k head norms    (model.qk_layernorm) their input: with the torch norms the whole QKV output it is a view
                      of, with fused ones a copy of q and k and their 1/rms
    RoPE              the torch reference in bf16: cos and sin cast to bf16 for q and for k
    core attention    q, k, v (with Ulysses the all-to-all buffer they are views of; k and v repeated to
                      the query heads when the kernel has no native grouped-query attention; without either,
                      v is a view that keeps the whole QKV output), the output and the fp32 log-sum-exp;
                      the reference backend keeps fp32 S x S probabilities and an S x S mask instead;
                      masks: SDPA's dense one, FlexAttention's block masks (blocks.py flex_mask), none for
                      varlen and flash-attn (cumulative lengths)
    ring attention    (sp = ulysses x ring, Degrees.ring > 1) q (or the all-to-all buffer), its own stack of
                      k and v, the output and the log-sum-exp; its backward adds fp32 dQ and dK/dV buffers
                      travelling the ring. The reference backend on a ring is refused (not modelled)
    o_proj            its input (the inverse all-to-all's output when sp>1, else the attention output)
    SwiGLU MLP        gate-up output (2 x ffn/tp), silu(gate) (torch), the down projection's input
With training.attention_head_chunks the attention keeps only the QKV input (each chunk is recomputed in its
backward: one chunk's activations and buffers at a time, the running sum of o_proj's partial outputs and of
the QKV input's gradients beside them). With training.mlp_chunk_tokens the MLP keeps only its norm output
(tiles are recomputed); with activation checkpointing a layer keeps only its input (with a checkpoint
stride k, one layer in k: a group's backward recomputes the other k - 1 inputs), and with activation
offload not even that: the inputs go to host memory and a window of `offload_prefetch` layers comes back
ahead of the backward. Per stage: rotary
cos/sin (fp32, when something saves them), tp-local token ids; on the last, the final norm and the LM head +
loss, which computes its gradients in the forward and keeps them: the head input's (tokens x h) and the
head weight's (V/tp x h).

The peak is the largest of four parts, each on top of the weights, the gradients that exist by then,
the optimizer state and the activations of the micro-batches in flight (1F1B: pp - stage; interleaved:
Megatron's warm-up count + 1 model chunks):
    loss        the LM head + loss forward: its input, one tile of fp32 logits, the head gradients
    final norm  the backward's first step on the last stage, under every layer's activations
    backward    one layer's backward (the first one, with every layer's activations, or the last one,
                with every layer's gradients): its recomputed activations under checkpointing, the
                residual-stream gradients, then the largest of the attention kernel's buffers (or ring
                attention's; a variable-length kernel's fp32 workspaces with 128 rows more per document,
                Options.varlen_sequences, data.documents_per_million), the QKV gradient assembly, the
                all-to-all's, the MLP's (with head chunks: one chunk's, and a chunk's forward and the summing
                of the chunks' QKV input gradients)
    optimizer   the AdamW step: reduced fp32 gradient shards and the sqrt of v (activations are gone)
Optimizer offload (ZeRO-1) keeps masters, moments and the reduced gradients in host memory and updates
there; the gradients stream out during the backward, so the device holds those waiting for their bucket
(a layer's or a bucket's) and a bucket being reduced, never a whole model's. Parameter offload (FSDP2's
CPUOffloadPolicy) keeps the shards, their gradients and the optimizer state in host memory: the device holds
two gathered blocks, the embedding and head, and one block's gradient (bf16, its fp32 copy and its reduced
shard on the way out). Both are megalysses' own (tests/test_optimizer_offload.py measures them) and model
other systems' published points too (tests/test_plan.py). What megalysses pins in host memory (offloaded
block inputs, optimizer offload's masters, reduced gradients and staging buffers) is counted request by
request as the code makes it (host.py), and the run's pinned arenas are sized from that same count, so the
host terms are what is allocated; FSDP2's own pinned shards and gradients are counted as torch's caching
host allocator takes them (rounded up to a power of two where the torch in use cannot be told otherwise).

Checked on CPU against the bytes a forward retains and the peak a training step reaches
(tests/test_memory_model.py, within 10%); benchmarks/bench_memory.py compares the peak with
torch.cuda.max_memory_allocated on a GPU.

The modules: types.py (the tables above, Options, Workload, Term, Estimate), activations.py (what
a layer and a stage keep), states.py (parameters, micro-batches in flight, weights, gradients, optimizer
state), transients.py (a layer's backward, the norm backward, the loss), estimate.py (the peak over stages
and parts, the longest sequence that fits), host.py (the pinned host requests of a rank).
megalysses/plan/memory.py reads all of it off a RunPlan.
"""

from megalysses.memory.types import (GIB, KERNELS, PRECISIONS, Estimate, Kernels, Options, Precision, Term,
                                     Workload, fmt_bytes)
from megalysses.memory.activations import (SP_BUFFERS, PerToken, bytes_per_token, cos_sin_kept,
                                           head_weight_grad_bytes, kept_layers, kv_replication, layer_terms,
                                           retained_activation_bytes,
                                           sp_buffer_bytes_per_token, stage_layers, stage_terms, tiled)
from megalysses.memory.states import head_norm_params, in_flight, layer_params, stage_params
from megalysses.memory.transients import loss_tile_tokens, norm_backward_bytes, norm_tile_bytes
from megalysses.memory.estimate import estimate, longest_sequence
from megalysses.memory.host import PinnedRequest, arena_bytes, arenas, pinned_requests

__all__ = ["Estimate", "GIB", "KERNELS", "Kernels", "Options", "PRECISIONS", "PerToken", "PinnedRequest",
           "Precision", "arena_bytes", "arenas", "pinned_requests",
           "SP_BUFFERS", "Term", "Workload", "bytes_per_token", "cos_sin_kept", "estimate",
           "fmt_bytes", "head_norm_params", "head_weight_grad_bytes", "in_flight", "kept_layers",
           "kv_replication", "layer_params", "layer_terms", "longest_sequence", "loss_tile_tokens",
           "norm_backward_bytes", "norm_tile_bytes", "retained_activation_bytes",
           "sp_buffer_bytes_per_token", "stage_layers", "stage_params", "stage_terms", "tiled"]
