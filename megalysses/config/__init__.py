"""Typed configuration: nested dataclasses are the schema, YAML is their serialized form.

    cfg = load_config("configs/quickstart.yaml", overrides=["optimizer.lr=3e-4", "parallel.tp=2"])
    save_config(cfg, "runs/x/config.yaml")   # loads back to an equal object

This module is the schema; reading, overrides and writing are in megalysses/config/io.py, the
cross-field rules (`validate_config`, which says every number involved) in megalysses/config/checks.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Optional, Union


class ConfigError(ValueError):
    """A bad config key, value, override or cross-field combination. The message names the field."""


@dataclass
class RopeScalingConfig:
    """Rotary frequency scaling for contexts longer than the model was trained at."""

    type: Literal["none", "llama3", "linear", "yarn"] = "none"
    """Frequency scaling of RoPE, each as Hugging Face's rope_type of that name computes it: none; llama3 (Llama
    3.1: low frequencies divided by `factor`, high ones kept, a smooth ramp between); linear (every frequency
    divided by `factor`: positions interpolated, Megatron-LM's --rotary-seq-len-interpolation-factor); yarn
    (YaRN, as Qwen2.5 and Qwen3 extend 32K to 128K: frequencies below beta_slow rotations over the original
    context interpolated, above beta_fast kept, a linear ramp between, and cos and sin scaled by an attention
    factor)."""
    factor: float = 8.0
    """llama3, linear, yarn: the context extension factor (the new context over the original)."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths above original_max_position_embeddings / low_freq_factor are scaled fully."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below original_max_position_embeddings / high_freq_factor are kept."""
    original_max_position_embeddings: int = 8192
    """llama3, yarn: the context length the frequencies were trained at."""
    beta_fast: float = 32.0
    """yarn: frequencies that turn more than this many times over the original context are kept."""
    beta_slow: float = 1.0
    """yarn: frequencies that turn fewer than this many times over the original context are interpolated."""
    mscale: float = 0.0
    """yarn: with mscale_all_dim (both non-zero), the attention factor is
    (1 + 0.1 mscale ln factor) / (1 + 0.1 mscale_all_dim ln factor); 0 = unset (1 + 0.1 ln factor)."""
    mscale_all_dim: float = 0.0
    """yarn: see mscale; 0 = unset."""
    attention_factor: Optional[float] = None
    """yarn: the factor cos and sin are scaled by (the attention logits by its square); None = from factor,
    mscale and mscale_all_dim as above."""
    truncate: bool = True
    """yarn: round the ends of the ramp between beta_fast and beta_slow to whole dimensions (Hugging Face's
    truncate, Megatron-LM's yarn_correction_range_round_to_int); false keeps them fractional."""


@dataclass
class ModelConfig:
    """The model: a decoder-only transformer (Llama architecture by default) and the kernels that run it."""

    vocab_size: int = 4096
    """Vocabulary size: token ids are 0 .. vocab_size-1 (at least the tokenizer's size)."""
    vocab_pad_multiple: int = 128
    """The embedding and LM head get rows up to a multiple of lcm(this, tp), for the kernels and an even tp
    split; padding rows are never a label and are left out of the softmax, so the loss is that of the
    true vocabulary. With the default, any tp dividing 128 gives the same padded size, so checkpoints
    reshard across tp. 1 = pad only to a multiple of tp."""
    hidden_size: int = 256
    """Model width h."""
    num_layers: int = 4
    """Number of transformer blocks."""
    num_heads: int = 8
    """Query heads."""
    num_kv_heads: Optional[int] = None
    """Key/value heads for grouped-query attention (None = num_heads, 1 = MQA)."""
    head_dim: Optional[int] = None
    """Width of each query, key and value head (Hugging Face's head_dim, Megatron-LM's --kv-channels). None =
    hidden_size / num_heads; another width (Qwen3, Mistral) makes the attention width num_heads x head_dim,
    which the QKV projection maps to and the output projection maps back from hidden_size."""
    ffn_hidden_size: Optional[int] = None
    """MLP inner width (None = 4h for GELU, round(8h/3) to a multiple of 64 for SwiGLU)."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    """Rotary frequency scaling (model.rope_scaling.type=llama3 for Llama 3.1+ checkpoints)."""
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    """Normalisation layer type."""
    norm_eps: float = 1e-5
    """Epsilon of the norm layers."""
    layernorm_1p: bool = False
    """Zero-centred norm weights (Megatron-LM's --apply-layernorm-1p): every norm scales by (1 + weight) and its
    weight starts at 0, the same function as a weight starting at 1; checkpoints hold the offset, Hugging Face
    conversion adds or removes the 1."""
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    """MLP type: SwiGLU (Llama) or GELU (GPT-2)."""
    tie_embeddings: bool = False
    """Share the input embedding with the LM head."""
    attention_bias: bool = False
    """Biases on the attention projections (QKV and output), as Hugging Face's attention_bias."""
    add_qkv_bias: bool = False
    """Biases on the query, key and value projections alone, not the output projection, as Qwen2 and Qwen2.5
    (Megatron-LM's --add-qkv-bias). attention_bias puts them on the output projection too."""
    qk_layernorm: bool = False
    """RMSNorm over each query head and each key head before RoPE, one weight of head_dim for all query heads
    and one for all key heads, as Qwen3 (Megatron-LM's --qk-layernorm)."""
    sliding_window: int = 0
    """Sliding-window attention in every layer: each token attends to itself and the sliding_window - 1 tokens
    before it (inside its document), as Hugging Face's sliding_window (Mistral). 0 = full causal attention.
    The reference, sdpa (a dense mask), flex and flash backends mask it, and ring attention's blocks with the
    reference, flex and (on CPU) sdpa."""
    mlp_bias: bool = False
    """Biases on the MLP projections, as Hugging Face's mlp_bias."""
    init_std: float = 0.02
    """Standard deviation of the normal weight init."""
    scaled_residual_init: bool = True
    """Scale the init of the residual output projections by 1/sqrt(2 * num_layers)."""
    kernels: Literal["torch", "triton", "liger", "apex"] = "torch"
    """Implementation of the fused ops (RMSNorm and the residual add before it, RoPE on q and k, SwiGLU):
    the torch reference; our Triton kernels (CUDA, needs triton; checked against the reference under
    Triton's CPU interpreter); liger-kernel's; or apex's RMSNorm with our Triton kernels for the rest."""
    attention_backend: Literal["auto", "reference", "sdpa", "flex", "flash"] = "auto"
    """Core attention implementation; auto picks flash-attn, then FlexAttention (GPU), then SDPA."""

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    def padded_vocab_size(self, tp: int = 1) -> int:
        """Rows of the embedding and LM head: vocab_size rounded up to a multiple of lcm(vocab_pad_multiple, tp)."""
        multiple = math.lcm(max(self.vocab_pad_multiple, 1), tp)
        return -(-self.vocab_size // multiple) * multiple

    @property
    def head_size(self) -> int:
        """Width of one attention head: head_dim, or hidden_size / num_heads."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @property
    def qkv_bias(self) -> bool:
        """Whether the QKV projection has a bias (attention_bias or add_qkv_bias)."""
        return self.attention_bias or self.add_qkv_bias

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.mlp == "gelu":
            return 4 * self.hidden_size
        return 64 * ((8 * self.hidden_size // 3 + 63) // 64)


@dataclass
class ParallelConfig:
    """How the processes split the work: tensor, sequence (Ulysses x ring) and pipeline parallelism, and
    the data parallelism the rest of the world size gives; gradient reduction and sharding."""

    tp: int = 1
    """Tensor-parallel degree (keep inside a node)."""
    sp: int = 1
    """Sequence-parallel degree = ulysses x ring: Ulysses (all-to-all onto heads, inside a node) as far as
    the heads allow, ring attention (K/V blocks passed around, log-sum-exp merge) for the rest."""
    sp_ring: int = 0
    """Ring degree r of sp (a divisor of sp; Ulysses gets sp / r). 0 = automatic: the largest Ulysses degree
    the heads allow (query heads per tp rank divisible by it, KV heads dividing it or divisible by it) whose
    tp x ulysses ranks fit inside a node (the launcher's ranks per node, LOCAL_WORLD_SIZE), so the
    all-to-alls stay on the node's links and only the ring's overlapped p2p crosses nodes. tools/plan.py
    tries every split the heads allow and names the ring of each layout it lists (its `ring` column)."""
    pp: int = 1
    """Pipeline-parallel degree (stages)."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved 1F1B: the bubble shrinks by this factor). Needs
    pp >= 2, num_layers divisible by pp * virtual_stages and micro-batches per step divisible by pp."""
    tp_sequence_parallel: bool = False
    """Shard norms and the residual stream over tp (Megatron 'sequence parallel')."""
    overlap_grad_reduce: bool = True
    """ZeRO-1: start each gradient bucket's reduce-scatter during the last micro-batch's backward, as soon
    as its gradients are final, instead of after the backward. With training.optimizer_offload the buckets
    are reduced during every micro-batch's backward either way (the gradients stream to host memory)."""
    grad_bucket_elements: int = 32_000_000
    """ZeRO-1: gradient elements per reduce-scatter / all-gather bucket."""
    fsdp: bool = False
    """Shard parameters and gradients too (FSDP2 fully_shard over the dp x sp ranks, one unit per block),
    not only the optimizer state (ZeRO-1, the default). For models whose weights do not fit per device."""
    timeout_seconds: float = 600.0
    """A dead or stuck rank ends the job after this long instead of hanging: the timeout of every
    collective, and the longest any rank may spend on one activity of the loop (a step, a save, loading)."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Process-group backend; auto = NCCL when CUDA is available, gloo otherwise."""


@dataclass
class DataConfig:
    """The training data: Megatron-LM .bin/.idx datasets (tools/preprocess_data.py), their blend and split,
    the tokenizer, and how samples are packed."""

    paths: list[str] = field(default_factory=list)
    """Dataset prefixes (without .bin/.idx), optionally weighted:
    ["0.7", "a_text_document", "0.3", "b_text_document"]; unweighted, blended with equal weights (or by size,
    blend_by_size)."""
    blend_by_size: bool = False
    """Blend an unweighted list of paths (or valid_paths) in proportion to the datasets' sizes, as Megatron-LM
    blends an unweighted --data-path: each dataset weighs the samples of data.seq_len tokens that one pass over
    its share of the split holds. False: equal weights. A weighted list keeps its weights either way."""
    split: str = "969,30,1"
    """train,valid,test ratios over the dataset's sequences (its documents, unless preprocessing split them
    into sentences), divided as Megatron-LM divides them (docs/DATA_FORMAT.md)."""
    valid_paths: list[str] = field(default_factory=list)
    """A validation set of its own (prefixes or a weighted blend, as in paths; Megatron-LM's
    --valid-data-path): validation reads it whole, and training reads the whole of paths (split does
    not apply)."""
    seq_len: int = 1024
    """Tokens per sample (the model sees seq_len tokens and predicts seq_len labels); with a
    seq_len_schedule, the final and longest length."""
    seq_len_schedule: list[list[int]] = field(default_factory=list)
    """Sequence-length curriculum: [[from_step, seq_len], ...], e.g. [[0, 8192], [2000, 32768], [4000, 131072]]:
    once from_step optimizer steps are done, train at that length (here steps 1-2000 at 8192, 2001-4000 at
    32768, then 131072). The first entry starts at step 0, steps increase, lengths never decrease, every
    length divides data.seq_len and the last one is data.seq_len. Samples are still drawn at data.seq_len
    and at length L each is cut into data.seq_len / L consecutive sequences (positions and documents
    restart in each), so tokens per step and per micro-batch, the number of micro-batches and the data
    order are those of a run without a schedule, and a resume anywhere is exact. Validation runs at
    data.seq_len. Empty: data.seq_len throughout."""
    tokenizer: str = "byte"
    """Tokenizer type: byte (no file), sentencepiece (a .model), huggingface (a tokenizer.json or a folder
    holding one), gpt2bpe (vocab_file + merge_file) or null (token ids as text); Megatron-LM's
    --tokenizer-type names (HuggingFaceTokenizer, SentencePieceTokenizer, GPT2BPETokenizer, ...) too."""
    tokenizer_model: Optional[str] = None
    """The sentencepiece .model file, or the tokenizer.json (or its folder) of a huggingface tokenizer."""
    vocab_file: Optional[str] = None
    """gpt2bpe: the vocab.json file."""
    merge_file: Optional[str] = None
    """gpt2bpe: the merges.txt file."""
    eod: Optional[str] = None
    """End-of-document token ('<|end_of_text|>') or id ('128001') that separates packed documents
    (default: the tokenizer's EOS)."""
    bos: Optional[str] = None
    """BOS token or id that starts every document, as written by tools/preprocess_data.py --bos; generation
    then starts prompts with it too (default: none besides what the tokenizer itself adds)."""
    document_mask: bool = True
    """Attention does not cross the EOD boundaries of packed documents."""
    documents_per_million: float = 1000.0
    """Packed documents per million tokens that the memory plan counts with document_mask (flash-attn's
    variable-length backward, which the varlen and flash backends run, keeps 128 rows of fp32 workspace per
    document): a sequence of S tokens counts 1 + S x this / 10^6 documents. State the corpus's figure (the
    number of documents tools/preprocess_data.py reports, per million of its tokens); the default is a mean
    document of 1,000 tokens. The worst case the corpus tools allow is a one-token text and its EOD: 500,000."""
    reset_position_ids: bool = True
    """Position ids restart at 0 after every EOD."""
    eod_mask_loss: bool = False
    """Mask the label predicted at each EOD (the first token of the next document)."""
    pack: Literal["ffd", "none"] = "ffd"
    """Conversations (a dataset with a loss mask beside it, tools/preprocess_data.py --chat) are packed whole into
    the sequences of each curriculum length: ffd = first-fit decreasing (the longest first, each into the first
    sequence with room, then the sequences shuffled), none = one conversation per sequence. Each conversation is a
    document of its own (needs document_mask and reset_position_ids with ffd), the padding after them too, and
    only the tokens the loss mask marks carry the loss. A dataset without a loss mask trains every token."""
    too_long: Literal["drop", "truncate", "error"] = "drop"
    """A conversation longer than the sequence it is packed into (data.seq_len, or the curriculum's length at its
    phase): drop it, truncate it to its first tokens (dropped if none of them carries the loss), or stop with an
    error; the start-up summary counts each."""
    loss_average: Literal["token", "document"] = "token"
    """token: the loss is the mean over every label that carries the loss in the global batch (a long answer
    weighs more); document: the mean over the global batch's documents (conversations) of each one's mean
    token loss, so every conversation weighs the same. The same at every layout either way."""
    cache_dir: Optional[str] = None
    """Where sample/shuffle indices are cached (default: beside the data)."""
    mock: bool = False
    """Train on deterministic synthetic tokens instead of paths (smoke tests)."""

    def seq_len_at(self, step: int) -> int:
        """The sequence length of the optimizer step taken after `step` completed steps (seq_len_schedule)."""
        length = self.seq_len
        for from_step, phase_len in self.seq_len_schedule:
            if step >= from_step:
                length = phase_len
        return length


@dataclass
class OptimizerConfig:
    """AdamW and the learning-rate schedule."""

    lr: float = 3e-4
    """Peak learning rate."""
    min_lr: float = 3e-5
    """Learning rate at the end of the decay."""
    weight_decay: float = 0.1
    """Decoupled AdamW weight decay (not applied to norms and biases)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = off)."""
    schedule: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    """LR shape after warmup, down to min_lr at decay_steps; wsd = constant, then a decay (wsd_decay_style) over
    the last decay_fraction (or wsd_decay_steps). Megatron-LM's spelling WSD is read as wsd with its default
    decay style, exponential, unless wsd_decay_style is given."""
    warmup_steps: int = 100
    """Linear warmup steps."""
    warmup_init: Optional[float] = None
    """Megatron-LM's warmup (--lr-warmup-init): the learning rate rises from this value, step k (counted from 0)
    training at warmup_init + (lr - warmup_init) * k / warmup_steps, so the first step trains at warmup_init
    (0.0 in Megatron-LM) and step warmup_steps + 1 at lr. None: the first step trains at lr / warmup_steps and
    step warmup_steps at lr."""
    decay_steps: int = 0
    """Steps over which the learning rate decays to min_lr, counted from the start, warmup included (Megatron-LM's
    --lr-decay-iters): the steps after the first decay_steps train at min_lr. 0 = training.train_steps."""
    decay_fraction: float = 0.2
    """For wsd without wsd_decay_steps: the fraction of decay_steps spent decaying, the last step (decay_steps)
    training at min_lr."""
    wsd_decay_steps: int = 0
    """For wsd: the decay spans this many steps and ends after decay_steps, counted as Megatron-LM counts
    --lr-wsd-decay-iters: after d = decay_steps - wsd_decay_steps steps at lr, step k (counted from 0) trains at
    the decay's value after k - d of its steps, and the steps after the first decay_steps at min_lr.
    0 = decay_fraction."""
    wsd_decay_style: Literal["linear", "exponential", "cosine", "minus_sqrt"] = "linear"
    """For wsd: the decay's shape as Megatron-LM defines them (--lr-wsd-decay-style), the share of (lr - min_lr)
    left after a fraction r of the decay: linear 1 - r, cosine (1 + cos(pi r)) / 2, exponential 2 * 0.5^r - 1,
    minus_sqrt 1 - sqrt(r)."""


@dataclass
class TrainingConfig:
    """The training run: batch sizes, length, stops, validation, precision and memory options."""

    seed: int = 1234
    """Seed for init, data order and dropout; the same seed gives the same model at every layout."""
    micro_batch_size: int = 1
    """Samples (of data.seq_len tokens) per micro-batch per dp rank; at a data.seq_len_schedule phase of length
    L, each is data.seq_len / L sequences of L tokens."""
    global_batch_size: int = 8
    """Samples (of data.seq_len tokens) per optimizer step over all dp ranks (a multiple of micro_batch_size *
    dp); at a data.seq_len_schedule phase of length L, each is data.seq_len / L sequences of L tokens. With a
    batch-size ramp (rampup_batch_size or batch_size_schedule), the batch the ramp ends at."""
    rampup_batch_size: list[int] = field(default_factory=list)
    """Batch-size ramp-up, Megatron-LM's --rampup-batch-size: [start, increment, samples]: the global batch starts
    at `start` and grows by `increment` (global_batch_size - start) / increment times, evenly over the first
    `samples` samples consumed, then stays at global_batch_size. Each step's batch follows from the samples
    consumed before it, so a resume is exact; the learning rate then advances by samples, counted in batches of
    global_batch_size, as in Megatron-LM. Empty: no ramp."""
    batch_size_schedule: list[list[int]] = field(default_factory=list)
    """Batch size by samples consumed, Megatron-LM's --step-batch-size-schedule: [[from_sample, batch], ...]: a step
    that starts once from_sample samples are consumed has that global batch; the first entry starts at 0, samples
    increase and the last batch is global_batch_size. The learning rate advances as with rampup_batch_size.
    Empty: no schedule."""
    train_steps: int = 1000
    """Optimizer steps to run."""
    exit_at_step: int = 0
    """Checkpoint and exit after this step (0 = off); the LR schedule still spans train_steps, so a
    long run can be split into jobs that resume exactly."""
    exit_interval: int = 0
    """Checkpoint and exit after every step that is a multiple of this (Megatron-LM's --exit-interval), so each
    job of a resumed run trains up to the next multiple (0 = off)."""
    max_wall_minutes: float = 0.0
    """Stop (with a checkpoint) after this many minutes (0 = no limit)."""
    eval_interval: int = 0
    """Validate every N steps (0 = never)."""
    eval_steps: int = 4
    """Batches per validation."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype; auto = bf16 with fp32 master weights on GPU, fp32 on CPU."""
    activation_checkpointing: bool = False
    """Recompute each block in the backward instead of storing its activations."""
    recompute_attention: bool = True
    """With activation_checkpointing: false keeps each layer's attention output and log-sum-exp from the
    forward, so the backward recomputes everything in the block but attention (the S^2 part), for about
    one more block input of memory per layer. Needs attention_backend sdpa, no ring (parallel.sp at most
    the heads allow) and no activation_offload."""
    loss_chunk_tokens: Union[int, Literal["auto"]] = 0
    """The LM head + loss runs over sequence tiles of this many tokens (its gradients computed tile by tile in
    the forward), so full logits (S/sp x V/tp floats) never exist. 0: tiles of at most 512 MiB of fp32
    logits. auto: the largest tile, from that one up to the whole sequence, that does not raise the step's
    predicted peak (megalysses/plan/tiles.py); the start-up line says which."""
    mlp_chunk_tokens: Union[int, Literal["auto"]] = 0
    """Run each MLP over sequence tiles of this many (local) tokens, recomputed in the backward, so only
    one tile's (tile x ffn/tp) intermediate exists at a time (0 = no tiling). For long context. auto: from
    the memory model, the largest tile, from `hidden` tokens (ALST's TiledMLP) up to no tiling, that does not
    raise the step's predicted peak above that of hidden-token tiles (megalysses/plan/tiles.py)."""
    attention_head_chunks: Union[int, Literal["auto"]] = 1
    """Run the attention half of each layer over this many groups of the rank's heads, one at a time (QKV
    projection, RoPE, the Ulysses all-to-all, attention, the inverse all-to-all and the group's share of the
    output projection, which accumulates), each group recomputed in the backward: attention's activations
    and its backward's buffers shrink to 1/chunks. A count keeps whole KV groups together and splits
    evenly over the Ulysses ranks; another is a config error listing the valid ones. 1 = all heads at once;
    auto = the fewest chunks with which the predicted peak fits the GPU (or, when none does, the fewest
    with the lowest peak), 1 where the device's memory is unknown (CPU)."""
    activation_offload: bool = False
    """Keep the checkpointed block inputs in pinned host memory instead of on the device: copied out on a
    side stream during the forward, copied back one block ahead of the backward. Needs
    activation_checkpointing (the block inputs are all a checkpointed forward keeps)."""
    checkpoint_stride: int = 1
    """With activation_checkpointing: keep the input of every k-th block only (groups of k blocks). The
    backward recomputes a group from its input, keeping each block's input on the device, then each block
    recomputes itself in its own backward: 1/k of the inputs kept (or offloaded to host memory), for one
    more forward of every layer and k - 1 more block inputs on the device while a group runs backward."""
    optimizer_offload: bool = False
    """ZeRO-1: keep the fp32 master weights, AdamW's moments and the reduced gradients in pinned host
    memory and run the AdamW update on the CPU. The gradients stream there during the backward, bucket by
    bucket as each is complete, and a step's micro-batches are summed on the host: the device holds the
    compute weights and the gradients of a layer or two, never a whole model's."""
    param_offload: bool = False
    """With parallel.fsdp: keep the weights in pinned host memory too (FSDP2's CPUOffloadPolicy): each block's
    weights are copied in one block ahead of its forward and its backward and freed after, its gradients go
    back to host memory as its backward finishes, and the AdamW update runs on the CPU. The device holds two
    blocks' weights, one block's gradients and the embedding and head."""
    nan_policy: Literal["abort", "skip"] = "abort"
    """On a NaN/Inf loss or gradient norm: abort the run, or skip the step (it updates nothing: the weights,
    AdamW's moments and its step count stay as they were; its batch is consumed and the learning-rate schedule
    moves on, as for any step). Both are decided on the device, without waiting for it: an abort is reported at
    the next logging step (logging.log_interval), naming the step it happened at, before anything is saved."""


@dataclass
class CheckpointConfig:
    """Checkpoints: where, how often, what to resume from."""

    dir: Optional[str] = None
    """Checkpoint directory (default: <run_dir>/checkpoints)."""
    save_interval: int = 0
    """Save every N steps (0 = only at the end / on preemption)."""
    keep_last: int = 2
    """Keep this many checkpoints, counting back from the one just saved (0 = keep all); the one `latest`
    names is never deleted, nor one holding a KEEP file (weights a checkpoint.init_from names: the converter's
    step-0 weights, a checkpoint folder a run started from)."""
    load: Optional[str] = "auto"
    """auto = resume from <dir>/latest if present; a path = load it; None = start fresh."""
    init_from: Optional[str] = None
    """Start from these weights (a Hugging Face model directory with config.json and safetensors, a run
    directory or a checkpoint) with a fresh optimizer at step 0, when there is no checkpoint of this run
    to resume (a resumed run keeps its own weights)."""
    fallback: bool = True
    """When the checkpoint to resume from fails its checksums (or `latest` is missing or damaged), resume
    from the newest older checkpoint that verifies, saying so; false = stop with the error."""
    async_save: Union[bool, Literal["auto"]] = "auto"
    """Write checkpoints in the background: each save copies this rank's state into pinned host memory (an arena
    the plan counts, reused by every save) and training goes on while a thread writes it; the next save, a stop
    and the end of training wait for it, and `latest` moves only once every rank has written it. auto = where
    this node's memory holds the copy beside what the run keeps there (the plan decides once; the start-up line
    says which), else synchronous; false = every rank waits for its files to reach storage."""


@dataclass
class LoggingConfig:
    """The run directory, metrics and their loggers."""

    run_dir: str = "runs/default"
    """Run directory: resolved config, metrics.jsonl, checkpoints."""
    log_interval: int = 10
    """Print a metrics line every N steps. Only these steps read the step's figures back to the host (the
    others do not wait for the device), so a stop signal, training.max_wall_minutes and a NaN abort take
    effect at the next of them."""
    wandb_mode: Literal["disabled", "offline", "online"] = "disabled"
    """Weights & Biases mode (online needs network)."""
    wandb_project: str = "megalysses"
    """Weights & Biases project."""
    tensorboard: bool = False
    """Also write the logged scalars as TensorBoard event files to tensorboard_dir (the `tensorboard` extra)."""
    tensorboard_dir: Optional[str] = None
    """Where TensorBoard event files go (Megatron-LM's --tensorboard-dir; default: <run_dir>/tensorboard)."""
    peak_tflops: float = 0.0
    """Peak dense TFLOP/s of one device for MFU (0 = the bf16 peak guessed from the GPU name, for bf16
    runs; no MFU otherwise)."""
    straggler_warn_fraction: float = 0.2
    """Name a straggler: each rank measures its busy time, the time it works before each blocking collective of a
    step that every rank leaves together (the ranks it keeps waiting are idle there; training/step.py BusyClock),
    and every logging step brings these to rank 0; metrics.jsonl carries their spread over the ranks
    (busy_s_min, busy_s_median, busy_s_max: seconds a step) and busy_slowest_rank. When the slowest rank's busy
    time exceeds the median of the other ranks of its pipeline stage by more than this fraction of the step time
    (they waited that long for it), a warning names it with its host (0 = never warn)."""


LongEvalTask = Literal["passkey", "niah", "niah-multikey", "position-loss"]


@dataclass
class LongEvalConfig:
    """Long-context evaluation while training, forward only on the training grid: passkey retrieval, needle in a
    haystack (one needle, or several keys) and the loss by position within the document
    (megalysses/training/long_eval.py); its figures go to metrics.jsonl, wandb and TensorBoard under long_eval/.
    tools/eval_long.py takes the tasks, lengths, depths, samples, seed and haystack from here as defaults."""

    interval: int = 0
    """Evaluate every N steps (0 = never)."""
    tasks: list[LongEvalTask] = field(default_factory=lambda: ["passkey", "niah", "niah-multikey", "position-loss"])
    """The tasks: passkey (a key in repeated filler sentences), niah (a number for a key in real text), niah-multikey
    (the same among three other keys' numbers), position-loss (the loss by position within the document); the
    last three read real text (haystack)."""
    lengths: list[int] = field(default_factory=list)
    """Lengths in tokens to evaluate at; empty: the length the step trains at (data.seq_len, or the phase of a
    data.seq_len_schedule). Lengths past the trained one measure extrapolation."""
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    """Where the needle goes, as a fraction of the text: 0 right after the intro, 1 right before the question."""
    samples: int = 4
    """Samples per task, length and depth (loss by position: per length)."""
    seed: int = 0
    """Seed of the keys, needles and texts: the same prompts at every evaluation of a run."""
    haystack: list[str] = field(default_factory=list)
    """Dataset prefixes whose documents are the real text (empty: the run's validation data, data.valid_paths or
    the valid split of data.paths)."""


@dataclass
class ProfileConfig:
    """The torch profiler over a window of training steps, as Megatron-LM's --profile --use-pytorch-profiler:
    a Chrome trace per profiled rank under <run_dir>/profile/."""

    start_step: Optional[int] = None
    """The first training step profiled (1 = the run's first step; Megatron-LM's --profile-step-start).
    Profiling is on when start_step and end_step are both set; the step before it runs under the profiler
    unrecorded, so the recorded steps do not pay for the profiler's start."""
    end_step: Optional[int] = None
    """The last step profiled, inclusive (Megatron-LM's --profile-step-end). Each profiled rank then writes
    <run_dir>/profile/rank<R>.steps<start>-<end>.pt.trace.json (CPU operators, and CUDA kernels on a GPU),
    for Perfetto (ui.perfetto.dev), chrome://tracing or TensorBoard's profiler plugin. The watchdog allows
    these steps, and the writing of the traces, which every rank waits for, 3 times parallel.timeout_seconds."""
    ranks: list[int] = field(default_factory=lambda: [0])
    """Global ranks to profile (Megatron-LM's --profile-ranks), each writing its own trace."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    long_eval: LongEvalConfig = field(default_factory=LongEvalConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)


PATH_KEYS = (("data", "paths"), ("data", "valid_paths"), ("data", "tokenizer_model"), ("data", "vocab_file"),
             ("data", "merge_file"), ("data", "cache_dir"), ("checkpoint", "dir"), ("checkpoint", "load"),
             ("checkpoint", "init_from"), ("logging", "run_dir"), ("long_eval", "haystack"))
"""The keys whose values are files or folders (data.paths and valid_paths: a blend's weights are not).
A config file names them relative to the working directory; a run's own config.yaml, absolute."""
