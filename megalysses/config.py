"""Typed configuration: nested dataclasses are the schema, YAML is their serialized form.

    cfg = load_config("configs/quickstart.yaml", overrides=["optimizer.lr=3e-4", "parallel.tp=2"])
    save_config(cfg, "runs/x/config.yaml")   # loads back to an equal object

Unknown keys fail with the key, its path and the nearest valid name; values are parsed by the
field's type; cross-field rules live in `validate_config` and say every number involved.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml


class ConfigError(ValueError):
    """A bad config key, value, override or cross-field combination. The message names the field."""


@dataclass
class RopeScalingConfig:
    type: Literal["none", "llama3"] = "none"
    """Frequency scaling of RoPE: none, or Llama 3.1's (low frequencies divided by `factor`, high ones
    kept, a smooth ramp between), as Hugging Face's rope_type "llama3"."""
    factor: float = 8.0
    """llama3: the context extension factor."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths above original_max_position_embeddings / low_freq_factor are scaled fully."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below original_max_position_embeddings / high_freq_factor are kept."""
    original_max_position_embeddings: int = 8192
    """llama3: the context length the frequencies were trained at."""


@dataclass
class ModelConfig:
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
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    """MLP type: SwiGLU (Llama) or GELU (GPT-2)."""
    tie_embeddings: bool = False
    """Share the input embedding with the LM head."""
    attention_bias: bool = False
    """Biases on the attention projections (QKV and output), as Hugging Face's attention_bias."""
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
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.mlp == "gelu":
            return 4 * self.hidden_size
        return 64 * ((8 * self.hidden_size // 3 + 63) // 64)


@dataclass
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel degree (keep inside a node)."""
    sp: int = 1
    """Sequence-parallel degree = ulysses x ring: Ulysses (all-to-all onto heads, inside a node) as far as
    the heads allow, ring attention (K/V blocks passed around, log-sum-exp merge) for the rest."""
    sp_ring: int = 0
    """Ring degree r of sp (a divisor of sp; Ulysses gets sp / r). 0 = automatic: the largest Ulysses degree
    the heads allow (query heads per tp rank divisible by it, KV heads dividing it or divisible by it) whose
    tp x ulysses ranks fit inside a node (the launcher's ranks per node, LOCAL_WORLD_SIZE), so the
    all-to-alls stay on the node's links and only the ring's overlapped p2p crosses nodes."""
    pp: int = 1
    """Pipeline-parallel degree (stages)."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved 1F1B: the bubble shrinks by this factor). Needs
    pp >= 2, num_layers divisible by pp * virtual_stages and micro-batches per step divisible by pp."""
    tp_sequence_parallel: bool = False
    """Shard norms and the residual stream over tp (Megatron 'sequence parallel')."""
    overlap_grad_reduce: bool = True
    """ZeRO-1: start each gradient bucket's reduce-scatter during the last micro-batch's backward, as soon
    as its gradients are final, instead of after the backward."""
    grad_bucket_elements: int = 32_000_000
    """ZeRO-1: gradient elements per reduce-scatter / all-gather bucket."""
    fsdp: bool = False
    """Shard parameters and gradients too (FSDP2 fully_shard over the dp x sp ranks, one unit per block),
    not only the optimizer state (ZeRO-1, the default). For models whose weights do not fit per device."""
    timeout_seconds: float = 600.0
    """A dead or stuck rank ends the job after this long instead of hanging: the timeout of every
    collective, and the longest any rank may spend in one phase of the loop (a step, a save, loading)."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Process-group backend; auto = NCCL when CUDA is available, gloo otherwise."""


@dataclass
class DataConfig:
    paths: list[str] = field(default_factory=list)
    """Dataset prefixes (without .bin/.idx), optionally weighted:
    ["0.7", "a_text_document", "0.3", "b_text_document"]."""
    split: str = "969,30,1"
    """train,valid,test ratios over documents."""
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
    reset_position_ids: bool = True
    """Position ids restart at 0 after every EOD."""
    eod_mask_loss: bool = False
    """Mask the label predicted at each EOD (the first token of the next document)."""
    cache_dir: Optional[str] = None
    """Where sample/shuffle indices are cached (default: beside the data)."""
    mock: bool = False
    """Train on deterministic synthetic tokens instead of paths (smoke tests)."""

    def seq_len_at(self, step: int) -> int:
        """The sequence length of the optimizer step taken after `step` completed steps (seq_len_schedule)."""
        length = self.seq_len
        for from_step, stage_len in self.seq_len_schedule:
            if step >= from_step:
                length = stage_len
        return length


@dataclass
class OptimizerConfig:
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
    """LR shape after warmup; wsd = constant then a linear decay over the last decay_fraction."""
    warmup_steps: int = 100
    """Linear warmup steps."""
    decay_fraction: float = 0.2
    """For wsd: the fraction of training spent decaying."""


@dataclass
class TrainingConfig:
    seed: int = 1234
    """Seed for init, data order and dropout; the same seed gives the same model at every layout."""
    micro_batch_size: int = 1
    """Samples (of data.seq_len tokens) per micro-batch per dp rank; at a data.seq_len_schedule stage of length
    L, each is data.seq_len / L sequences of L tokens."""
    global_batch_size: int = 8
    """Samples (of data.seq_len tokens) per optimizer step over all dp ranks (a multiple of micro_batch_size *
    dp); at a data.seq_len_schedule stage of length L, each is data.seq_len / L sequences of L tokens."""
    train_steps: int = 1000
    """Optimizer steps to run."""
    exit_at_step: int = 0
    """Checkpoint and exit after this step (0 = off); the LR schedule still spans train_steps, so a
    long run can be split into jobs that resume exactly."""
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
    loss_chunk_tokens: int = 0
    """Compute the LM head + loss in sequence tiles of this many tokens, recomputed in the backward
    (0 = no tiling). Needed at long context: the full logits would be S/sp x V/tp floats."""
    mlp_chunk_tokens: int = 0
    """Run each MLP over sequence tiles of this many (local) tokens, recomputed in the backward, so only
    one tile's (tile x ffn/tp) intermediate exists at a time (0 = no tiling). For long context."""
    activation_offload: bool = False
    """Keep the checkpointed block inputs in pinned host memory instead of on the device: copied out on a
    side stream during the forward, copied back one block ahead of the backward. Needs
    activation_checkpointing (the block inputs are all a checkpointed forward keeps)."""
    optimizer_offload: bool = False
    """ZeRO-1: keep the fp32 master weights, AdamW's moments and the reduced gradients in pinned host
    memory and run the AdamW update on the CPU; the device holds the compute weights and gradients only."""
    nan_policy: Literal["abort", "skip"] = "abort"
    """On a NaN/Inf loss: abort the run, or skip the step."""


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None
    """Checkpoint directory (default: <run_dir>/checkpoints)."""
    save_interval: int = 0
    """Save every N steps (0 = only at the end / on preemption)."""
    keep_last: int = 2
    """Keep this many checkpoints, counting back from the one just saved (0 = keep all); the one `latest`
    names is never deleted."""
    load: Optional[str] = "auto"
    """auto = resume from <dir>/latest if present; a path = load it; None = start fresh."""
    init_from: Optional[str] = None
    """Start from these weights (a Hugging Face model directory with config.json and safetensors, a run
    directory or a checkpoint) with a fresh optimizer at step 0, when there is no checkpoint of this run
    to resume (a resumed run keeps its own weights)."""
    fallback: bool = True
    """When the checkpoint to resume from fails its checksums (or `latest` is missing or damaged), resume
    from the newest older checkpoint that verifies, saying so; false = stop with the error."""


@dataclass
class LoggingConfig:
    run_dir: str = "runs/default"
    """Run directory: resolved config, metrics.jsonl, checkpoints."""
    log_interval: int = 10
    """Print a metrics line every N steps."""
    wandb_mode: Literal["disabled", "offline", "online"] = "disabled"
    """Weights & Biases mode (online needs network)."""
    wandb_project: str = "megalysses"
    """Weights & Biases project."""
    tensorboard: bool = False
    """Also write the logged scalars as TensorBoard event files to <run_dir>/tensorboard (the `tensorboard`
    extra)."""
    peak_tflops: float = 0.0
    """Peak dense TFLOP/s of one device for MFU (0 = the bf16 peak guessed from the GPU name, for bf16
    runs; no MFU otherwise)."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


# ----------------------------------------------------------------------------- parsing

def _nearest(name: str, choices: list[str]) -> str:
    match = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
    return f" (did you mean '{match[0]}'?)" if match else f" (valid: {', '.join(choices)})"


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Convert a YAML / override value to the field type `tp`, or raise ConfigError naming `path`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "~")):
            return None
        return _coerce(value, args[0], path)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{path}: {value!r} is not one of {', '.join(map(str, allowed))}")
        return value
    if origin is list:
        (inner,) = typing.get_args(tp)
        if isinstance(value, str):
            text = value.strip()
            value = yaml.safe_load(text) if text.startswith("[") else [v for v in text.split(",") if v]
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        return [_coerce(v, inner, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ConfigError(f"{path}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{path}: expected a number, got {value!r}") from None
        if not math.isfinite(number):
            raise ConfigError(f"{path}: {value!r} is not a finite number: give a real value")
        return number
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return str(value)
    raise ConfigError(f"{path}: unsupported field type {tp}")


def _build(cls: type, data: Any, path: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping of keys, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in names:
            raise ConfigError(f"unknown config key '{where}'{_nearest(str(key), names)}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, where)
        else:
            kwargs[key] = _coerce(value, tp, where)
    return cls(**kwargs)


def config_from_dict(data: dict) -> Config:
    """Build a Config from a nested dict, strictly (unknown keys and bad types raise ConfigError)."""
    return _build(Config, data, "")


def config_to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def apply_override(data: dict, override: str) -> None:
    """Apply one `section.key=value` override to a nested dict (checked against the schema)."""
    if "=" not in override:
        raise ConfigError(f"override '{override}': expected section.key=value (e.g. optimizer.lr=3e-4)")
    dotted, raw = override.split("=", 1)
    parts = dotted.strip().split(".")
    cls: Any = Config
    node = data
    for i, part in enumerate(parts):
        where = ".".join(parts[: i + 1])
        names = [f.name for f in dataclasses.fields(cls)]
        if part not in names:
            raise ConfigError(f"override '{override}': unknown config key '{where}'{_nearest(part, names)}")
        tp = typing.get_type_hints(cls)[part]
        last = i == len(parts) - 1
        if dataclasses.is_dataclass(tp):
            if last:
                raise ConfigError(f"override '{override}': '{where}' is a section; set one of its keys")
            if part not in node or node[part] is None:
                node[part] = {}
            elif not isinstance(node[part], dict):
                raise ConfigError(f"{where}: expected a mapping of keys, got {node[part]!r}")
            node = node[part]
            cls = tp
        else:
            if not last:
                raise ConfigError(f"override '{override}': '{where}' is a value, not a section")
            value = yaml.safe_load(raw) if raw.strip() else ""
            node[part] = _coerce(value if value is not None else None, tp, where)


def load_config(path: Optional[str | Path] = None, overrides: Optional[list[str]] = None) -> Config:
    """Read YAML (if given), apply `--set` overrides, build and validate the Config."""
    data: dict = {}
    if path is not None:
        data = read_yaml(Path(path))
    for ov in overrides or []:
        apply_override(data, ov)
    cfg = config_from_dict(data)
    validate_config(cfg)
    return cfg


class _StrictLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (YAML would keep the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":      # `<<: *anchor`: merged keys may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise ConfigError(f"the key '{key}' appears twice (lines {seen[key]} and "
                                  f"{key_node.start_mark.line + 1}): keep one")
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def read_yaml(p: Path) -> dict:
    """The config file as a dict: UTF-8 text, valid YAML, no duplicate keys, a mapping at the top."""
    if p.is_dir():
        raise ConfigError(f"config file '{p}' is a directory: give the path of a YAML file")
    if not p.is_file():
        raise ConfigError(f"config file '{p}' does not exist")
    try:
        text = p.read_bytes().decode("utf-8")
    except OSError as e:
        raise ConfigError(f"config file '{p}' cannot be read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file '{p}' is not UTF-8 text (byte {e.start}): save it as UTF-8 YAML") from None
    loader = _StrictLoader(text)
    loader.name = str(p)     # YAML errors then point at the file, not "<unicode string>"
    try:
        data = loader.get_single_data()
    except ConfigError as e:
        raise ConfigError(f"config file '{p}': {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file '{p}' is not valid YAML: {' '.join(str(e).split())}") from None
    finally:
        loader.dispose()
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{p}': the top level must be a mapping of sections")
    return data


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(dump_config(cfg))


# ----------------------------------------------------------------------------- validation

def validate_config(cfg: Config, world_size: Optional[int] = None) -> None:
    """Cross-field rules. With `world_size`, also the layout and batch arithmetic. Raises ConfigError."""
    m, p, d, t = cfg.model, cfg.parallel, cfg.data, cfg.training
    _check_ranges(cfg)
    if m.hidden_size % m.num_heads:
        raise ConfigError(f"model.hidden_size={m.hidden_size} is not divisible by model.num_heads={m.num_heads}")
    if m.head_dim % 2:
        raise ConfigError(f"model head_dim={m.head_dim} (hidden_size/num_heads) must be even for rotary embeddings")
    if m.num_heads % m.kv_heads:
        raise ConfigError(f"model.num_heads={m.num_heads} is not divisible by model.num_kv_heads={m.kv_heads}")
    check_heads(m.num_heads, m.kv_heads, p.tp, p.sp, p.sp_ring)
    rs = m.rope_scaling
    if rs.type == "llama3" and rs.high_freq_factor <= rs.low_freq_factor:
        raise ConfigError(f"model.rope_scaling: high_freq_factor={rs.high_freq_factor} must exceed "
                          f"low_freq_factor={rs.low_freq_factor}")
    if m.ffn_size % p.tp:
        raise ConfigError(f"MLP width {m.ffn_size} (model.ffn_hidden_size) is not divisible by parallel.tp={p.tp}: "
                          f"each tp rank holds an equal slice; set model.ffn_hidden_size to a multiple of {p.tp}")
    # any data.seq_len works: samples are padded to the layout's multiple (parallel/sequence_layout.py)
    if p.virtual_stages > 1:
        if p.pp < 2:
            raise ConfigError(f"parallel.virtual_stages={p.virtual_stages} needs parallel.pp >= 2 (it interleaves "
                              f"model chunks over pipeline ranks)")
        if m.num_layers % (p.pp * p.virtual_stages):
            raise ConfigError(f"model.num_layers={m.num_layers} is not divisible by parallel.pp * "
                              f"parallel.virtual_stages = {p.pp} * {p.virtual_stages}: every virtual stage holds "
                              f"the same number of layers")
    if m.num_layers % p.pp:
        raise ConfigError(f"model.num_layers={m.num_layers} is not divisible by parallel.pp={p.pp}: "
                          f"every pipeline stage holds the same number of layers")
    _check_tokenizer(d)
    if not d.mock and not d.paths:
        raise ConfigError("data.paths is empty: give dataset prefixes (tools/preprocess_data.py output) "
                          "or set data.mock=true")
    if d.mock and m.vocab_size < 3:
        raise ConfigError(f"model.vocab_size={m.vocab_size}: data.mock needs at least 3 tokens (two and the EOD)")
    if cfg.checkpoint.load is not None and not cfg.checkpoint.load.strip():
        raise ConfigError("checkpoint.load is empty: give auto, none (start afresh) or the path of a checkpoint")
    if not cfg.logging.run_dir.strip():
        raise ConfigError("logging.run_dir is empty: give the run directory (config, metrics, checkpoints)")
    _check_data(d)
    _check_seq_len_schedule(d)
    if t.micro_batch_size < 1 or t.global_batch_size < 1:
        raise ConfigError("training.micro_batch_size and training.global_batch_size must be >= 1")
    if world_size is not None:
        mp = p.tp * p.sp * p.pp
        if world_size % mp:
            raise ConfigError(f"world size {world_size} is not divisible by tp*sp*pp = {p.tp}*{p.sp}*{p.pp} = {mp}: "
                              f"launch a multiple of {mp} processes or change the layout")
        dp = world_size // mp
        per_step = t.micro_batch_size * dp
        if t.global_batch_size % per_step:
            raise ConfigError(f"training.global_batch_size={t.global_batch_size} is not divisible by "
                              f"micro_batch_size={t.micro_batch_size} * dp={dp} = {per_step}")
        micro = t.global_batch_size // per_step
        if p.virtual_stages > 1 and micro % p.pp:
            raise ConfigError(f"interleaved pipeline: {micro} micro-batches per step (global_batch_size / "
                              f"(micro_batch_size * dp)) is not a multiple of parallel.pp={p.pp}: change "
                              f"training.global_batch_size or micro_batch_size")


MAX_SEQ_LEN = 2**31 - 2
"""Longest sample: token positions and sample-index offsets are 32-bit."""

# (section, field, lowest allowed value, highest allowed value or None)
_RANGES = [
    ("model", "vocab_size", 1, None), ("model", "vocab_pad_multiple", 1, None), ("model", "hidden_size", 1, None),
    ("model", "num_layers", 1, None), ("model", "num_heads", 1, None), ("model", "num_kv_heads", 1, None),
    ("model", "ffn_hidden_size", 1, None), ("model", "norm_eps", 0.0, None), ("model", "init_std", 0.0, None),
    ("model", "rope_theta", 1.0, None),
    ("model.rope_scaling", "factor", 1.0, None), ("model.rope_scaling", "low_freq_factor", 0.0, None),
    ("model.rope_scaling", "high_freq_factor", 0.0, None),
    ("model.rope_scaling", "original_max_position_embeddings", 1, None),
    ("data", "seq_len", 1, MAX_SEQ_LEN),
    ("optimizer", "lr", 0.0, None), ("optimizer", "min_lr", 0.0, None), ("optimizer", "weight_decay", 0.0, None),
    ("optimizer", "beta1", 0.0, 1.0), ("optimizer", "beta2", 0.0, 1.0), ("optimizer", "eps", 0.0, None),
    ("optimizer", "grad_clip", 0.0, None), ("optimizer", "warmup_steps", 0, None),
    ("optimizer", "decay_fraction", 0.0, 1.0),
    ("training", "seed", 0, 2**63 - 1), ("training", "train_steps", 1, None), ("training", "exit_at_step", 0, None),
    ("training", "max_wall_minutes", 0.0, None), ("training", "eval_interval", 0, None),
    ("training", "eval_steps", 1, None), ("checkpoint", "save_interval", 0, None), ("checkpoint", "keep_last", 0, None),
    ("training", "loss_chunk_tokens", 0, None), ("training", "mlp_chunk_tokens", 0, None),
    ("logging", "log_interval", 1, None), ("logging", "peak_tflops", 0.0, None),
    ("parallel", "timeout_seconds", 1.0, None),
    ("parallel", "tp", 1, None), ("parallel", "sp", 1, None), ("parallel", "sp_ring", 0, None),
    ("parallel", "pp", 1, None),
    ("parallel", "virtual_stages", 1, None), ("parallel", "grad_bucket_elements", 1, None),
]


def _check_ranges(cfg: Config) -> None:
    for section in dataclasses.fields(cfg):     # every float, also of a Config built in code
        for f in dataclasses.fields(getattr(cfg, section.name)):
            value = getattr(getattr(cfg, section.name), f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{section.name}.{f.name}={value} is not a finite number: give a real value")
    for section, name, lo, hi in _RANGES:
        owner = cfg
        for part in section.split("."):
            owner = getattr(owner, part)
        value = getattr(owner, name)
        if value is None:
            continue
        if value < lo or (hi is not None and value > hi):
            allowed = f">= {lo}" if hi is None else f"between {lo} and {hi}"
            raise ConfigError(f"{section}.{name}={value} is out of range: it must be {allowed}")


def config_warnings(cfg: Config) -> list[str]:
    """Settings that are legal but almost certainly not what was meant (printed once, by rank 0)."""
    o, t = cfg.optimizer, cfg.training
    notes = []
    if o.lr == 0:
        notes.append("optimizer.lr=0: the weights will not change")
    elif o.min_lr > o.lr:
        notes.append(f"optimizer.min_lr={o.min_lr:g} is above optimizer.lr={o.lr:g}: the learning rate will rise "
                     f"during the decay")
    late = [(step, length) for step, length in cfg.data.seq_len_schedule if step >= t.train_steps]
    if late:
        notes.append(f"data.seq_len_schedule: the stage from step {late[0][0]} (seq_len {late[0][1]}) starts at or "
                     f"after training.train_steps={t.train_steps}: it never runs, and neither does "
                     f"data.seq_len={cfg.data.seq_len}")
    if o.warmup_steps > t.train_steps:
        notes.append(f"optimizer.warmup_steps={o.warmup_steps} is more than training.train_steps={t.train_steps}: "
                     f"the learning rate never reaches optimizer.lr")
    return notes


def _check_seq_len_schedule(d: DataConfig) -> None:
    """data.seq_len_schedule: [from_step, seq_len] pairs from step 0, steps increasing, lengths growing to
    data.seq_len, each dividing it."""
    example = f"e.g. [[0, {d.seq_len // 4 if d.seq_len % 4 == 0 else 1}], [1000, {d.seq_len}]]"
    prev_step, prev_len = -1, 0
    for i, entry in enumerate(d.seq_len_schedule):
        where = f"data.seq_len_schedule[{i}]={entry}"
        if len(entry) != 2:
            raise ConfigError(f"{where}: each entry is a [from_step, seq_len] pair, {example}")
        step, length = entry
        if length < 1:
            raise ConfigError(f"{where}: seq_len {length} must be >= 1")
        if i == 0 and step != 0:
            raise ConfigError(f"{where}: the first entry must start at step 0 (it gives the length of the first "
                              f"steps): make it [0, {length}]")
        if step <= prev_step:
            raise ConfigError(f"{where}: from_step {step} is not after the previous entry's {prev_step}: list the "
                              f"stages in order of strictly increasing from_step")
        if length < prev_len:
            raise ConfigError(f"{where}: seq_len {length} is shorter than the previous entry's {prev_len}: a "
                              f"curriculum only grows the length; lengths must not decrease")
        if d.seq_len % length:
            raise ConfigError(f"{where}: seq_len {length} does not divide data.seq_len={d.seq_len}: every sample "
                              f"of data.seq_len tokens is cut into data.seq_len / seq_len sequences; use a divisor "
                              f"of {d.seq_len}")
        prev_step, prev_len = step, length
    if d.seq_len_schedule and prev_len != d.seq_len:
        raise ConfigError(f"data.seq_len_schedule ends at seq_len {prev_len} but data.seq_len={d.seq_len} is the "
                          f"final length: append [from_step, {d.seq_len}] to the schedule, or set "
                          f"data.seq_len={prev_len}")


def _check_data(d: DataConfig) -> None:
    from megalysses.data.blend import parse_blend
    from megalysses.data.gpt_dataset import parse_split

    try:
        parse_split(d.split)
        if not d.mock and d.paths:
            parse_blend(d.paths)
    except ValueError as e:
        raise ConfigError(f"data.{'split' if str(e).startswith('split') else 'paths'}: {e}") from None


def _check_tokenizer(d: DataConfig) -> None:
    from megalysses.data.tokenizer import TokenizerError, canonical_kind

    try:
        kind = canonical_kind(d.tokenizer)
    except TokenizerError as e:
        raise ConfigError(f"data.tokenizer: {e}") from None
    if kind in ("sentencepiece", "huggingface") and not d.tokenizer_model:
        what = "the .model file" if kind == "sentencepiece" else "a tokenizer.json or the folder holding it"
        raise ConfigError(f"data.tokenizer={d.tokenizer} needs data.tokenizer_model ({what})")
    if kind == "gpt2bpe" and not (d.vocab_file and d.merge_file):
        raise ConfigError(f"data.tokenizer={d.tokenizer} needs data.vocab_file (vocab.json) and data.merge_file "
                          f"(merges.txt)")


def check_heads(num_heads: int, kv_heads: int, tp: int, sp: int, sp_ring: int = 0,
                ranks_per_node: int = 0) -> tuple[int, int]:
    """Head-count rules for tp, then sp = ulysses x ring; returns (ulysses, ring) or raises ConfigError with
    the numbers and the fix. Ulysses gives each of its ranks whole query heads (query heads per tp rank
    divisible by ulysses) and whole KV heads (replicated up to ulysses when fewer, so one must divide the
    other); the ring has no head rule. sp_ring=0 picks the largest Ulysses degree, so any sp is possible;
    with `ranks_per_node` (0 = unknown) the largest whose tp x ulysses block of consecutive ranks lies
    inside one node, when there is one besides tp alone crossing nodes."""
    if num_heads % tp:
        raise ConfigError(f"model.num_heads={num_heads} is not divisible by parallel.tp={tp}")
    if kv_heads % tp:
        raise ConfigError(f"model.num_kv_heads={kv_heads} is not divisible by parallel.tp={tp}: each tp rank "
                          f"needs whole KV heads; use tp <= {kv_heads} (a divisor) and put the rest into sp")
    hq, hk = num_heads // tp, kv_heads // tp

    def fits(u: int) -> bool:
        return hq % u == 0 and (hk % u == 0 or u % hk == 0)

    if sp_ring == 0:
        allowed = [u for u in range(1, sp + 1) if sp % u == 0 and fits(u)]
        in_node = [u for u in allowed if ranks_per_node and ranks_per_node % (tp * u) == 0]
        ulysses = max(in_node or allowed)
        return ulysses, sp // ulysses
    if sp % sp_ring:
        raise ConfigError(f"parallel.sp_ring={sp_ring} does not divide parallel.sp={sp}: sp = ulysses x ring; "
                          f"choose a divisor of {sp} (or 0 for automatic)")
    ulysses = sp // sp_ring
    if not fits(ulysses):
        rings = [sp // u for u in range(1, sp + 1) if sp % u == 0 and fits(u)]
        raise ConfigError(f"parallel.sp={sp} with parallel.sp_ring={sp_ring} leaves a Ulysses degree of {ulysses}, "
                          f"which the heads do not allow: query heads per tp rank = {hq} must be divisible by it and "
                          f"KV heads per tp rank = {hk} must divide it or be divisible by it; sp_ring can be one of "
                          f"{', '.join(map(str, sorted(rings)))} (or 0 for automatic)")
    return ulysses, sp_ring


def ulysses_ring(cfg: Config, ranks_per_node: Optional[int] = None) -> tuple[int, int]:
    """(ulysses, ring) degrees of cfg's sequence parallelism: sp = ulysses x ring (see check_heads).
    `ranks_per_node` defaults to the launcher's (torchrun's LOCAL_WORLD_SIZE; unknown without one)."""
    m, p = cfg.model, cfg.parallel
    if ranks_per_node is None:
        ranks_per_node = launcher_ranks_per_node()
    return check_heads(m.num_heads, m.kv_heads, p.tp, p.sp, p.sp_ring, ranks_per_node)


def launcher_ranks_per_node() -> int:
    """Ranks per node as torchrun reports them (LOCAL_WORLD_SIZE); 0 when not launched by it."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.isdigit() else 0
