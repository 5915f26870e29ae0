"""Megatron-LM's names for megalysses' settings: the pretrain_gpt.py flags, the config keys they set here, how
each one maps, and Megatron-LM's spellings of choice values. This module is data; it is read by config.io
(a Megatron-LM name written as a config key gets a written answer), by the config reference (docs/CONFIG.md)
and by tools/from_megatron.py (which parses a Megatron-LM command line with it).

    FLAGS["--context-parallel-size"].keys        # ('parallel.sp',)
    answer_for("parallel.cp")                   # "that is Megatron-LM's --context-parallel-size: here parallel.sp; ..."
    canonical_value("model.norm", "RMSNorm")    # 'rmsnorm'

Each flag has a status: `same` (it maps with the same meaning), `partial` (the values the note names map, the
converter names any other), `none` (nothing here does it: the converter names it and the conversion is
lossy) or `ignored` (performance, profiling or logging only: nothing it changes is trained differently).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class Flag:
    flag: str                       # --num-attention-heads
    kind: str                       # how its value parses: int, float, str, flag, noflag, ints, int3, paths, strs
    keys: tuple[str, ...] = ()      # the megalysses keys it sets
    status: str = "same"
    note: str = ""                  # the arithmetic, what depends on the value, or why nothing maps
    default: Any = None             # Megatron-LM's default (for a flag: False)
    choices: tuple[str, ...] = ()   # Megatron-LM's allowed values
    names: tuple[str, ...] = ()     # other names users write for it (its Megatron-LM attribute, abbreviations)
    values: tuple[tuple[str, str], ...] = ()    # (value, what that value is here) where the meaning depends on it


def _f(flag: str, kind: str, keys: str = "", **fields: Any) -> Flag:
    """A row of the table: `keys` as one space-separated string, the other fields as Flag's; a flag's default is
    False (a noflag's True), whatever is given."""
    if kind in ("flag", "noflag"):
        fields["default"] = kind == "noflag"
    return Flag(flag, kind, tuple(keys.split()), **fields)


_PERF = "speed or memory only: what is trained does not change"
_LOG = "logging or profiling only"
_NO_DROPOUT = "0 maps (megalysses has no dropout); any other value cannot be honoured"
_DTYPE_NOTE = "megalysses trains in bf16 (fp32 master weights) or fp32"
SELECTIVE = ("recomputes core attention only and keeps every other activation, which megalysses does not do; "
             "training.recompute_attention: false is the opposite (with activation_checkpointing it keeps "
             "attention's output and recomputes the rest of each block); without checkpointing, the default, "
             "nothing is recomputed")

_TABLE = [
    # model
    _f("--num-layers", "int", "model.num_layers"),
    _f("--hidden-size", "int", "model.hidden_size"),
    _f("--num-attention-heads", "int", "model.num_heads"),
    _f("--ffn-hidden-size", "int", "model.ffn_hidden_size",
       note="unset with --swiglu, Megatron-LM rounds 8h/3 down to a multiple of 64 (here: up): the converter writes "
            "the width"),
    _f("--group-query-attention", "flag", "model.num_kv_heads", note="with --num-query-groups"),
    _f("--num-query-groups", "int", "model.num_kv_heads", default=1,
       note="read with --group-query-attention; without it every head has its own keys and values"),
    _f("--kv-channels", "int", "model.head_dim", note="the width of each head (hidden_size / num_heads when left "
       "out, as in Megatron-LM): the converter writes it when it differs"),
    _f("--max-position-embeddings", "int", note="rotary positions need no table here; it must be at least "
       "--seq-length, as Megatron-LM requires"),
    _f("--position-embedding-type", "str", "model.rope_scaling.type", status="partial", default="learned_absolute",
       choices=("learned_absolute", "rope", "yarn", "mrope", "relative", "none"),
       note="rope and yarn map (megalysses uses rotary embeddings only, model.rope_theta; yarn is "
            "model.rope_scaling.type yarn); learned_absolute, Megatron-LM's default, and the others cannot be "
            "honoured",
       values=(("rope", ("is always so here (rotary embeddings only): drop the key; --rotary-base is "
                        "model.rope_theta")),
               ("yarn", ("is model.rope_scaling.type: yarn (--rotary-scaling-factor is its factor, --yarn-* and "
                         "--mscale its other settings)")),
               ("learned_absolute", "is not available: megalysses uses rotary embeddings only (model.rope_theta)"))),
    _f("--no-position-embedding", "flag", note="no learned absolute positions: with rotary embeddings, as always "
       "here (Megatron-LM refuses it with any other --position-embedding-type)"),
    _f("--use-rotary-position-embeddings", "flag", note="the older spelling of --position-embedding-type rope"),
    _f("--rotary-base", "int", "model.rope_theta", default=10000),
    _f("--rotary-percent", "float", status="partial", default=1.0,
       note="1.0 maps (every head dimension rotates); a partial rotation cannot be honoured"),
    _f("--use-rope-scaling", "flag", "model.rope_scaling.type",
       note="Llama 3.1's scaling (llama3) with Megatron-LM's constants: low_freq_factor 1, high_freq_factor 4, "
            "original_max_position_embeddings 8192"),
    _f("--rope-scaling-factor", "float", "model.rope_scaling.factor", default=8.0),
    _f("--rotary-seq-len-interpolation-factor", "int", "model.rope_scaling.type model.rope_scaling.factor",
       note="positions divided by it: model.rope_scaling.type linear with this factor"),
    _f("--rotary-scaling-factor", "float", "model.rope_scaling.factor", default=1.0,
       note="YaRN's factor (--position-embedding-type yarn)"),
    _f("--yarn-original-max-position-embeddings", "int", "model.rope_scaling.original_max_position_embeddings",
       default=4096, note="YaRN's original context (Megatron-LM's default 4096)"),
    _f("--yarn-beta-fast", "float", "model.rope_scaling.beta_fast", default=32.0),
    _f("--yarn-beta-slow", "float", "model.rope_scaling.beta_slow", default=1.0),
    _f("--mscale", "float", "model.rope_scaling.mscale model.rope_scaling.attention_factor", default=1.0,
       note="YaRN's attention factor is (1 + 0.1 mscale ln factor) / (1 + 0.1 mscale_all_dim ln factor) in "
            "Megatron-LM: the converter writes the same factor"),
    _f("--mscale-all-dim", "float", "model.rope_scaling.mscale_all_dim model.rope_scaling.attention_factor",
       default=0.0, note="see --mscale"),
    _f("--yarn-correction-range-round-to-int", "flag", "model.rope_scaling.truncate"),
    _f("--no-yarn-correction-range-round-to-int", "noflag", "model.rope_scaling.truncate"),
    _f("--rope-type", "str", status="partial", choices=("rope", "yarn"),
       note="rope maps; Megatron-LM takes yarn only with multi-latent attention, which megalysses does not have "
            "(--position-embedding-type yarn is YaRN for this attention)"),
    _f("--normalization", "str", "model.norm", default="LayerNorm", choices=("LayerNorm", "RMSNorm")),
    _f("--norm-epsilon", "float", "model.norm_eps", default=1e-5, names=("layernorm_epsilon",)),
    _f("--init-method-std", "float", "model.init_std", default=0.02,
       note="the output projections' init divided by sqrt(2 * num_layers) as in Megatron-LM "
            "(model.scaled_residual_init)"),
    _f("--apply-layernorm-1p", "flag", "model.layernorm_1p", names=("layernorm_zero_centered_gamma",)),
    _f("--swiglu", "flag", "model.mlp", note="without it Megatron-LM's MLP is GELU"),
    _f("--openai-gelu", "flag", "model.mlp", note="GELU's tanh approximation, which model.mlp gelu computes"),
    _f("--squared-relu", "flag", status="none", note="squared ReLU is not available: the MLP is SwiGLU or GELU here"),
    _f("--quick-geglu", "flag", status="none", note="quick GeGLU is not available: the MLP is SwiGLU or GELU here"),
    _f("--use-fused-weighted-squared-relu", "flag", status="none",
       note="weighted squared ReLU is not available: the MLP is SwiGLU or GELU here"),
    _f("--untie-embeddings-and-output-weights", "flag", "model.tie_embeddings",
       note="without it Megatron-LM ties the embedding and the output layer"),
    _f("--disable-bias-linear", "noflag", "model.attention_bias model.mlp_bias", names=("add_bias_linear",),
       note="without it every linear layer of Megatron-LM has a bias"),
    _f("--add-qkv-bias", "flag", "model.add_qkv_bias", note="biases on q, k and v alone (Qwen2's); without "
       "--disable-bias-linear every projection has one anyway"),
    _f("--qk-layernorm", "flag", "model.qk_layernorm", note="a norm over each query and key head before RoPE (Qwen3's; "
       "RMSNorm with --normalization RMSNorm)"),
    _f("--window-size", "str", "model.sliding_window", status="partial",
       note="(W - 1, 0), a causal window of W positions with itself, is model.sliding_window W; a window that "
            "looks ahead cannot be honoured"),
    _f("--window-attn-skip-freq", "str", status="none", note="a window in some layers only: every layer attends "
       "alike here (model.sliding_window in all of them)"),
    _f("--attention-dropout", "float", status="partial", default=0.1, note=_NO_DROPOUT + " (Megatron-LM's default "
       "is 0.1)"),
    _f("--hidden-dropout", "float", status="partial", default=0.1, note=_NO_DROPOUT + " (Megatron-LM's default is "
       "0.1)"),
    _f("--make-vocab-size-divisible-by", "int", "model.vocab_pad_multiple", default=128,
       note="Megatron-LM pads to a multiple of this times tp: the converter writes that product, so the padded "
            "vocabulary has Megatron-LM's size; padding rows are never in the softmax here"),
    _f("--padded-vocab-size", "int", "model.vocab_pad_multiple",
       note="the rows of the embedding and output layer, kept as given (no 128 x tp rounding then): the converter "
            "writes Megatron-LM's own multiple where it gives those rows, else the size itself, so the tokenizer's "
            "vocabulary pads to it at every tp that divides it; a size below the tokenizer's or one tp does not "
            "divide is refused, as Megatron-LM's vocab-parallel embedding cannot take it"),
    _f("--vocab-size", "int", "model.vocab_size",
       note="read by Megatron-LM for NullTokenizer; otherwise the tokenizer's size, which the converter reads"),
    _f("--attention-backend", "str", "model.attention_backend", default="auto",
       choices=("auto", "flash", "fused", "unfused", "local"), note="flash reads as auto (flash-attn where it is "
       "installed and the layout runs it), fused as sdpa, unfused and local as reference, each where the layout "
       "runs it (else auto): every backend computes exact attention"),
    _f("--use-flash-attn", "flag", "model.attention_backend", note="model.attention_backend auto, which runs "
       "flash-attn where it is installed and the layout allows it"),
    # parallelism
    _f("--tensor-model-parallel-size", "int", "parallel.tp", default=1),
    _f("--pipeline-model-parallel-size", "int", "parallel.pp", default=1),
    _f("--num-layers-per-virtual-pipeline-stage", "int", "parallel.virtual_stages",
       note="virtual_stages = num_layers / (pp * this)"),
    _f("--num-virtual-stages-per-pipeline-rank", "int", "parallel.virtual_stages"),
    _f("--context-parallel-size", "int", "parallel.sp", default=1, names=("cp", "context_parallel"),
       note="context parallelism is sequence parallelism here: Ulysses all-to-all and ring attention, exact "
            "attention over the whole sequence either way"),
    _f("--cp-comm-type", "strs", "parallel.sp_ring", default=["p2p"],
       note="a2a+p2p splits sp as --hierarchical-context-parallel-sizes says (sp_ring the p2p size); p2p "
            "(Megatron-LM's default), a2a and allgather let megalysses split sp into Ulysses x ring as the heads "
            "allow (sp_ring 0): every split computes the same attention"),
    _f("--hierarchical-context-parallel-sizes", "ints", "parallel.sp_ring",
       note="[a2a, p2p]: the p2p size is the ring degree"),
    _f("--sequence-parallel", "flag", "parallel.tp_sequence_parallel",
       note="Megatron-LM's sequence parallelism shards over tp; megalysses' sequence parallelism (parallel.sp) "
            "is its context parallelism"),
    _f("--use-distributed-optimizer", "flag", note="optimizer state is always sharded over the data-parallel ranks "
       "here (ZeRO-1, or parallel.fsdp)"),
    _f("--overlap-grad-reduce", "flag", "parallel.overlap_grad_reduce"),
    _f("--use-torch-fsdp2", "flag", "parallel.fsdp"),
    _f("--overlap-param-gather", "flag", status="ignored",
       note="ZeRO-1 gathers the updated parameters after the step, not overlapped with the next forward (speed "
            "only: what is trained does not change)"),
    _f("--distributed-timeout-minutes", "int", "parallel.timeout_seconds", default=10,
       note="timeout_seconds = 60 * minutes, raised where a step or validation needs more"),
    _f("--distributed-backend", "str", "parallel.backend", default="nccl", choices=("nccl", "gloo")),
    # data
    _f("--data-path", "paths", "data.paths data.blend_by_size",
       note="an unweighted list is blended by dataset size, as in Megatron-LM (data.blend_by_size)"),
    _f("--split", "str", "data.split", note="Megatron-LM's default with --data-path is 969, 30, 1 (as here)"),
    _f("--valid-data-path", "paths", "data.valid_paths"),
    _f("--train-data-path", "paths", "data.paths", note="read whole, with data.valid_paths or no validation"),
    _f("--tokenizer-type", "str", "data.tokenizer", note="the same names are accepted here"),
    _f("--tokenizer-model", "str", "data.tokenizer_model"),
    _f("--vocab-file", "str", "data.vocab_file"),
    _f("--merge-file", "str", "data.merge_file"),
    _f("--data-cache-path", "str", "data.cache_dir"),
    _f("--mock-data", "flag", "data.mock"),
    _f("--eod-mask-loss", "flag", "data.eod_mask_loss"),
    _f("--reset-position-ids", "flag", "data.reset_position_ids", note="off in Megatron-LM unless given (on here)"),
    _f("--reset-attention-mask", "flag", "data.document_mask", note="off in Megatron-LM unless given (on here)"),
    _f("--seq-length", "int", "data.seq_len"),
    # batch and schedule
    _f("--micro-batch-size", "int", "training.micro_batch_size"),
    _f("--global-batch-size", "int", "training.global_batch_size"),
    _f("--rampup-batch-size", "int3", "training.rampup_batch_size"),
    _f("--step-batch-size-schedule", "str", "training.batch_size_schedule",
       note="thresholds in tokens (K, M, B, T suffixes) become samples of --seq-length tokens"),
    _f("--train-iters", "int", "training.train_steps"),
    _f("--train-samples", "int", "training.train_steps", note="steps = samples / global batch (counted through a "
       "batch-size ramp as Megatron-LM counts them)"),
    _f("--lr", "float", "optimizer.lr"),
    _f("--clip-grad", "float", "optimizer.grad_clip", default=1.0),
    _f("--min-lr", "float", "optimizer.min_lr", default=0.0),
    _f("--weight-decay", "float", "optimizer.weight_decay", default=0.01),
    _f("--adam-beta1", "float", "optimizer.beta1", default=0.9),
    _f("--adam-beta2", "float", "optimizer.beta2", default=0.999),
    _f("--adam-eps", "float", "optimizer.eps", default=1e-8),
    _f("--optimizer", "str", status="partial", default="adam",
       choices=("adam", "sgd", "muon", "dist_muon", "lion", "soap", "adaptive_muon"),
       note="adam maps (Megatron-LM's Adam decouples weight decay: AdamW); the others cannot be honoured"),
    _f("--lr-decay-style", "str", "optimizer.schedule", status="partial", default="linear",
       choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"),
       note="constant, linear, cosine and WSD map; inverse-square-root cannot be honoured"),
    _f("--lr-decay-iters", "int", "optimizer.decay_steps"),
    _f("--lr-decay-samples", "int", "optimizer.decay_steps", note="steps = samples / global batch"),
    _f("--lr-warmup-iters", "int", "optimizer.warmup_steps optimizer.warmup_init", default=0),
    _f("--lr-warmup-samples", "int", "optimizer.warmup_steps optimizer.warmup_init", default=0,
       note="steps = samples / global batch"),
    _f("--lr-warmup-fraction", "float", "optimizer.warmup_steps optimizer.warmup_init",
       note="warmup_steps = fraction * the decay's steps"),
    _f("--lr-warmup-init", "float", "optimizer.warmup_init", default=0.0),
    _f("--lr-wsd-decay-style", "str", "optimizer.wsd_decay_style", default="exponential",
       choices=("exponential", "linear", "cosine", "minus_sqrt")),
    _f("--lr-wsd-decay-iters", "int", "optimizer.wsd_decay_steps"),
    _f("--lr-wsd-decay-samples", "int", "optimizer.wsd_decay_steps", note="steps = samples / global batch"),
    _f("--start-weight-decay", "float", "optimizer.weight_decay", status="partial",
       note="maps when equal to --end-weight-decay (constant weight decay); an increasing weight decay cannot be "
            "honoured"),
    _f("--end-weight-decay", "float", "optimizer.weight_decay", status="partial",
       note="maps when equal to --start-weight-decay"),
    _f("--weight-decay-incr-style", "str", status="partial", default="constant",
       choices=("constant", "linear", "cosine"), note="constant maps; linear and cosine cannot be honoured"),
    _f("--decoupled-lr", "float", status="none", note="a separate learning rate for the embedding and output "
       "layers: one learning rate for every parameter here"),
    _f("--decoupled-min-lr", "float", status="none", note="see --decoupled-lr"),
    # precision, memory
    _f("--bf16", "flag", "training.dtype", note="without --bf16 or --fp16 Megatron-LM trains in fp32"),
    _f("--fp16", "flag", status="none", note=f"fp16 with loss scaling: {_DTYPE_NOTE}"),
    _f("--fp8-format", "str", status="none", choices=("e4m3", "hybrid"), note=f"FP8 training: {_DTYPE_NOTE}"),
    _f("--fp8-amax-history-len", "int", status="none", note="see --fp8-format"),
    _f("--fp8-amax-compute-algo", "str", status="none", note="see --fp8-format"),
    _f("--fp8-param-gather", "flag", status="none", note="see --fp8-format"),
    _f("--grad-reduce-in-bf16", "flag", status="none",
       note="gradients are reduced in fp32 here; a bf16 reduction cannot be honoured"),
    _f("--accumulate-allreduce-grads-in-fp32", "flag", note="always so here"),
    _f("--attention-softmax-in-fp32", "flag", note="always so here"),
    _f("--recompute-granularity", "str", "training.activation_checkpointing", status="partial",
       choices=("full", "selective"),
       note="its meaning depends on the value: full is activation_checkpointing: true; selective recomputes core "
            "attention only, which megalysses does not do",
       values=(("full", "is training.activation_checkpointing: true (each block recomputed in the backward)"),
               ("selective", SELECTIVE))),
    _f("--recompute-activations", "flag", status="none",
       note="Megatron-LM's older spelling of --recompute-granularity selective, which " + SELECTIVE),
    _f("--recompute-method", "str", status="partial", choices=("uniform", "block"),
       note="uniform maps (every layer recomputed); block maps when --recompute-num-layers covers every layer of a "
            "pipeline stage; otherwise it cannot be honoured (checkpointing is all layers or none here)"),
    _f("--recompute-num-layers", "int", status="partial", note="see --recompute-method"),
    _f("--cpu-offloading", "flag", status="none",
       note="(older releases; newer ones turn it on with --cpu-offloading-num-layers) Megatron-LM offloads the "
            "activations of some layers without recomputation; megalysses offloads the checkpointed block inputs "
            "of every layer (training.activation_offload with activation_checkpointing): set them yourself"),
    _f("--cpu-offloading-num-layers", "int", status="none", default=0, note="see --cpu-offloading"),
    _f("--optimizer-cpu-offload", "flag", "training.optimizer_offload"),
    _f("--optimizer-offload-fraction", "float", status="partial", default=1.0, note="1.0 maps (the whole optimizer "
       "state); a fraction cannot be honoured"),
    _f("--calculate-per-token-loss", "flag",
       note="the loss is always the sum over tokens divided by the global token count here; without it "
            "Megatron-LM averages per micro-batch, the same number whenever every label counts"),
    _f("--seed", "int", "training.seed", default=1234),
    _f("--exit-interval", "int", "training.exit_interval"),
    _f("--exit-duration-in-mins", "int", "training.max_wall_minutes"),
    _f("--exit-signal-handler", "flag", note="always on here: SIGTERM or SIGUSR1 saves and exits"),
    # checkpoints
    _f("--save", "str", "checkpoint.dir"),
    _f("--save-interval", "int", "checkpoint.save_interval"),
    _f("--load", "str", "checkpoint.load", note="the same directory as --save is checkpoint.load: auto; megalysses "
       "reads its own checkpoints and Hugging Face models, not Megatron-LM checkpoints"),
    _f("--finetune", "flag", "checkpoint.init_from", note="the weights of --load, a fresh optimizer, step 0"),
    _f("--ckpt-format", "str", status="partial", default="torch_dist",
       choices=("torch", "torch_dist", "torch_dcp", "fsdp_dtensor"),
       note="torch_dist and torch_dcp map (checkpoints are torch.distributed.checkpoint here, resharding at any "
            "layout); the other formats are not written"),
    _f("--no-load-optim", "flag", status="none", note="a resume loads the optimizer state here"),
    _f("--no-load-rng", "flag", status="none", note="a resume loads the RNG state here"),
    # logging
    _f("--log-interval", "int", "logging.log_interval", default=100),
    _f("--eval-interval", "int", "training.eval_interval", note="unset, Megatron-LM does not validate during training"),
    _f("--eval-iters", "int", "training.eval_steps", default=100, note="0 turns validation off"),
    _f("--tensorboard-dir", "str", "logging.tensorboard logging.tensorboard_dir"),
    _f("--wandb-project", "str", "logging.wandb_project logging.wandb_mode", note="wandb_mode online"),
    _f("--wandb-exp-name", "str", status="ignored", note=_LOG),
    _f("--wandb-save-dir", "str", status="ignored", note=_LOG),
    # profiling: the torch profiler over a window of steps
    _f("--profile", "flag", "profile.start_step profile.end_step", status="partial",
       note="with --use-pytorch-profiler, the torch profiler over --profile-step-start to --profile-step-end; "
            "alone, Megatron-LM opens an nsys capture range (cudaProfilerStart/Stop) for a launch under `nsys "
            "profile --capture-range=cudaProfilerApi`, which has no counterpart here"),
    _f("--use-pytorch-profiler", "flag", "profile.start_step profile.end_step", note="with --profile"),
    _f("--profile-step-start", "int", "profile.start_step", default=10,
       note="Megatron-LM's torch profiler records steps start to end - 1, after a warm-up step: profile.start_step "
            "= start (at least 1), profile.end_step = end - 1 (its nsys range is start + 1 to end)"),
    _f("--profile-step-end", "int", "profile.end_step", default=12, note="profile.end_step = end - 1, inclusive"),
    _f("--profile-ranks", "ints", "profile.ranks", default=[0],
       note="Megatron-LM's default [0] (its newest releases profile every rank when the flag is left out)"),
]

_IGNORED = {  # flags whose only effect is speed, memory layout, profiling or logging: accepted, named, harmless
    "flag": ["--use-mcore-models", "--log-throughput", "--manual-gc", "--cross-entropy-loss-fusion",
             "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--no-masked-softmax-fusion",
             "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
             "--no-gradient-accumulation-fusion", "--use-cpu-initialization", "--log-params-norm",
             "--log-num-zeros-in-grad", "--log-timers-to-tensorboard", "--log-validation-ppl-to-tensorboard",
             "--log-memory-to-tensorboard", "--tp-comm-overlap", "--ckpt-fully-parallel-load", "--async-save"],
    "int": ["--num-workers", "--empty-unused-memory-level",
            "--manual-gc-interval", "--tensorboard-log-interval", "--timing-log-level", "--tensorboard-queue-size",
            "--num-dataset-builder-threads"],
    "str": ["--transformer-impl", "--dataloader-type", "--cross-entropy-fusion-impl", "--tiktoken-pattern",
            "--timing-log-option", "--dist-ckpt-strictness"],
}
for _kind, _names in _IGNORED.items():
    _TABLE += [_f(n, _kind, status="ignored", note=_PERF) for n in _names]

FLAGS: dict[str, Flag] = {f.flag: f for f in _TABLE}

# Megatron-LM's spellings of choice values that mean the same thing here; and what a spelling implies
VALUE_ALIASES: dict[str, dict[str, str]] = {
    "model.norm": {"RMSNorm": "rmsnorm", "LayerNorm": "layernorm"},
    "optimizer.schedule": {"WSD": "wsd"},
    "model.attention_backend": {"fused": "sdpa", "unfused": "reference", "local": "reference"},
}
IMPLIED: dict[tuple[str, str], dict[str, str]] = {
    # Megatron-LM's WSD decays exponentially unless told otherwise (--lr-wsd-decay-style)
    ("optimizer.schedule", "WSD"): {"wsd_decay_style": "exponential"},
}

# abbreviations people bring from other frameworks, each with the key it means
_ABBREVIATIONS = {"cp": "parallel.sp", "tensor_parallel": "parallel.tp", "pipeline_parallel": "parallel.pp",
                  "num_attention_heads": "model.num_heads", "num_key_value_heads": "model.num_kv_heads"}


def _names() -> dict[str, Flag]:
    out: dict[str, Flag] = {}
    for f in _TABLE:
        if f.status == "ignored":
            continue
        for name in (f.flag[2:].replace("-", "_"), f.flag[2:]) + f.names:
            out.setdefault(name, f)
    return out


_BY_NAME = _names()


def flags_for_key(key: str) -> list[str]:
    """The Megatron-LM flags that set config key `key` (for the config reference)."""
    return [f.flag for f in _TABLE if key in f.keys and f.status in ("same", "partial")]


def answer_for(where: str, value: Any = None) -> Optional[str]:
    """A written answer for the unknown config key `where` (dotted) when it is a Megatron-LM name: which key it
    is here, or why there is none, for the `value` given where its meaning depends on it; None when it is not
    one."""
    name = where.rsplit(".", 1)[-1]
    flag = _BY_NAME.get(name)
    key = _ABBREVIATIONS.get(name)
    if flag is None and key is None:
        return None
    if flag is None:
        return f"that is {key} here"
    said = f"that is Megatron-LM's {flag.flag}"
    if isinstance(value, str) and value in dict(flag.values):
        return f"{said}, whose meaning depends on its value: {value} {dict(flag.values)[value]}"
    if not flag.keys:
        return f"{said}: {flag.note}" if flag.note else f"{said}, which has no counterpart here"
    keys = flag.keys[0] + (f" (with {', '.join(flag.keys[1:])})" if len(flag.keys) > 1 else "")
    return f"{said}: here {keys}" + (f"; {flag.note}" if flag.note else "")


def canonical_value(key: str, value: Any) -> Any:
    """`value` of choice key `key`, with Megatron-LM's spelling replaced by megalysses' (others unchanged)."""
    if isinstance(value, str):
        return VALUE_ALIASES.get(key, {}).get(value, value)
    return value


def implied_keys(key: str, value: Any) -> dict[str, str]:
    """Keys of the same section that Megatron-LM's spelling `value` of `key` implies, unless they are given."""
    return IMPLIED.get((key, value), {}) if isinstance(value, str) else {}
