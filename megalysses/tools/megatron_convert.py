"""A Megatron-LM pretrain_gpt.py command line as megalysses config values, with Megatron-LM's meaning: its
defaults for the flags left out, its arithmetic (samples to steps, warmup fractions, layers per virtual stage,
--cp-comm-type to the ring degree, the padded vocabulary), the tokenizer's size, the blend of an unweighted
--data-path by size.

    conv = convert(parse_arguments(argv))
    conv.values     # {"model.num_layers": 32, ...}: every setting, with Megatron-LM's meaning
    conv.mapped     # {flag: what it set}; conv.lossy {flag: why it cannot be honoured}; conv.ignored; conv.notes

Every flag given lands in exactly one of mapped, lossy and ignored; lossy also names the Megatron-LM defaults
of flags left out that megalysses cannot honour (learned absolute positions, dropout 0.1). A Megatron-LM flag
without an entry in the table (parse_arguments' `unmapped`) is named by its group (megatron_flags.GROUPS): a
logging destination is left out, any other cannot be honoured.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from megalysses.data.blend import is_weighted
from megalysses.config.megatron_names import FLAGS
from megalysses.tools.megatron_flags import GROUPS, flag_group
from megalysses.tools.megatron_positions import rope, window
from megalysses.tools.megatron_script import MegatronArgsError


@dataclass
class Conversion:
    values: dict[str, Any] = field(default_factory=dict)
    mapped: dict[str, str] = field(default_factory=dict)
    lossy: dict[str, str] = field(default_factory=dict)
    ignored: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


class _Converter:
    def __init__(self, given: dict[str, Any], read_files: bool, vocab_size: Optional[int]) -> None:
        self.given, self.read_files, self.vocab_size, self.out = given, read_files, vocab_size, Conversion()

    def has(self, flag: str) -> bool:
        return flag in self.given

    def get(self, flag: str) -> Any:
        return self.given[flag] if flag in self.given else FLAGS[flag].default

    def need(self, flag: str, why: str = "Megatron-LM needs it too") -> Any:
        if self.given.get(flag) in (None, []):
            raise MegatronArgsError(f"{flag} is missing: {why}")
        return self.given[flag]

    def set(self, flags: str, **keys: Any) -> None:
        """Set keys (section__key=value) for the given flags among `flags` (space-separated)."""
        for k, v in keys.items():
            self.out.values[k.replace("__", ".", 1)] = v
        said = ", ".join(f"{k.replace('__', '.', 1)}={v}" for k, v in keys.items())
        for f in flags.split():
            if self.has(f) and f not in self.out.lossy:
                self.out.mapped.setdefault(f, said)

    def lossy(self, flag: str, why: str) -> None:
        """`flag` (given, or left at a Megatron-LM default) cannot be honoured."""
        self.out.mapped.pop(flag, None)
        self.out.lossy[flag if self.has(flag) else f"{flag} (left out: Megatron-LM's default)"] = why

    def note(self, text: str) -> None:
        self.out.notes.append(text)


def convert(given: dict[str, Any], read_files: bool = True, vocab_size: Optional[int] = None) -> Conversion:
    """Megatron-LM's settings for `given` (parse_arguments' output) as megalysses config values. `read_files`:
    read the tokenizer for vocab_size and the .idx files for an unweighted blend's sizes; `vocab_size`: the
    tokenizer's size when its files are not here."""
    c = _Converter(given, read_files, vocab_size)
    _model(c)
    _parallel(c)
    _data(c)
    _batch_and_schedule(c)
    _precision_memory(c)
    _checkpoint_logging(c)
    _profiling(c)
    for flag in given:
        f = FLAGS[flag]
        if flag not in c.out.mapped and flag not in c.out.lossy:
            if f.status == "ignored":
                c.out.ignored[flag] = f.note
            elif f.status == "none" and given[flag]:
                c.lossy(flag, f.note)
            else:
                c.out.mapped[flag] = f.note or "accepted"
    for flag in getattr(given, "unmapped", {}):
        group = flag_group(flag)
        if group == "logging":
            c.out.ignored[flag] = GROUPS[group]
        elif group == "moe":        # parse_arguments refuses a command line with experts
            c.out.ignored[flag] = "a mixture-of-experts setting without --num-experts: unused, as in Megatron-LM"
        else:
            c.out.lossy[flag] = GROUPS[group]
    return c.out


def _model(c: _Converter) -> None:
    layers, hidden, heads = (c.need(f) for f in ("--num-layers", "--hidden-size", "--num-attention-heads"))
    c.set("--num-layers", model__num_layers=layers)
    c.set("--hidden-size", model__hidden_size=hidden)
    c.set("--num-attention-heads", model__num_heads=heads)
    groups = c.get("--num-query-groups") if c.get("--group-query-attention") else None   # None: one per head
    c.set("--group-query-attention --num-query-groups", model__num_kv_heads=groups)
    if c.has("--num-query-groups") and not c.get("--group-query-attention"):
        c.out.mapped["--num-query-groups"] = "ignored without --group-query-attention, as in Megatron-LM"
    kv = c.get("--kv-channels")
    c.set("--kv-channels", model__head_dim=kv if kv is not None and kv * heads != hidden else None)
    swiglu = c.get("--swiglu")
    ffn = c.get("--ffn-hidden-size") or (int((4 * hidden * 2 / 3) / 64) * 64 if swiglu else 4 * hidden)
    c.set("--ffn-hidden-size", model__ffn_hidden_size=ffn)
    if not c.has("--ffn-hidden-size"):
        c.note(f"model.ffn_hidden_size={ffn}: Megatron-LM's width when --ffn-hidden-size is left out")
    c.set("--swiglu --openai-gelu", model__mlp="swiglu" if swiglu else "gelu")
    c.set("--normalization", model__norm=c.get("--normalization").lower())
    c.set("--norm-epsilon", model__norm_eps=c.get("--norm-epsilon"))
    c.set("--init-method-std", model__init_std=c.get("--init-method-std"), model__scaled_residual_init=True)
    c.set("--apply-layernorm-1p", model__layernorm_1p=bool(c.get("--apply-layernorm-1p")))
    untie = c.get("--untie-embeddings-and-output-weights")
    c.set("--untie-embeddings-and-output-weights", model__tie_embeddings=not untie)
    bias = c.get("--disable-bias-linear")
    c.set("--disable-bias-linear", model__attention_bias=bias, model__mlp_bias=bias)
    c.set("--add-qkv-bias", model__add_qkv_bias=bool(c.get("--add-qkv-bias")) and not bias)
    if c.get("--add-qkv-bias") and bias:
        c.out.mapped["--add-qkv-bias"] = "every projection has a bias already (no --disable-bias-linear)"
    c.set("--qk-layernorm", model__qk_layernorm=bool(c.get("--qk-layernorm")))
    if c.get("--qk-layernorm") and c.get("--normalization") != "RMSNorm":
        c.lossy("--qk-layernorm", "LayerNorms over the q and k heads (--normalization LayerNorm): the head norms are "
                                  "RMSNorm here")
    window(c)
    rope(c)
    seq = c.need("--seq-length")
    if c.has("--max-position-embeddings") and c.get("--max-position-embeddings") < seq:
        raise MegatronArgsError(f"--max-position-embeddings {c.get('--max-position-embeddings')} is below "
                                f"--seq-length {seq}: Megatron-LM refuses it too")
    for flag in ("--attention-dropout", "--hidden-dropout"):
        if c.get(flag) != 0:
            c.lossy(flag, f"dropout {c.get(flag)}: megalysses has no dropout (trains as with 0)")
    # flash-attn where it is installed and the layout runs it (not ring blocks): auto; the converter then checks the
    # layout runs the backend chosen (tools/from_megatron.py), else it falls back to auto
    backend = "auto" if c.get("--use-flash-attn") else {"auto": "auto", "flash": "auto", "fused": "sdpa",
                                                         "unfused": "reference", "local": "reference"}[
        c.get("--attention-backend")]
    c.set("--attention-backend --use-flash-attn", model__attention_backend=backend)
    if c.has("--use-flash-attn") or c.get("--attention-backend") == "flash":
        c.note("--attention-backend flash / --use-flash-attn: model.attention_backend=auto, flash-attn wherever it is "
               "installed and the layout can run it (with a ring, blocks on FlexAttention or SDPA)")


def _parallel(c: _Converter) -> None:
    tp, pp, cp = c.get("--tensor-model-parallel-size"), c.get("--pipeline-model-parallel-size"), \
        c.get("--context-parallel-size")
    c.set("--tensor-model-parallel-size", parallel__tp=tp)
    c.set("--pipeline-model-parallel-size", parallel__pp=pp)
    c.set("--context-parallel-size", parallel__sp=cp)
    types = sorted(set(c.get("--cp-comm-type")))
    if len(types) > 1:
        c.lossy("--cp-comm-type", f"a communication type per layer ({', '.join(types)}): one split of sp here")
    kind, ring = types[0], 0
    if kind == "a2a+p2p":
        sizes = c.need("--hierarchical-context-parallel-sizes", "--cp-comm-type a2a+p2p takes its split from it")
        if math.prod(sizes) != cp or len(sizes) != 2:
            raise MegatronArgsError(f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes))}: expected "
                                    f"two sizes (a2a, p2p) whose product is --context-parallel-size {cp}")
        ring = sizes[1]
    elif cp > 1:       # every split of sp computes the same attention: megalysses chooses it (tools/from_megatron.py)
        c.note(f"--context-parallel-size {cp} (--cp-comm-type {kind}): parallel.sp={cp}, split into Ulysses x ring by "
               f"megalysses as the heads allow (parallel.sp_ring 0); Megatron-LM's {kind} computes the same attention")
    c.set("--cp-comm-type --hierarchical-context-parallel-sizes", parallel__sp_ring=ring if cp > 1 else 0)
    layers = c.get("--num-layers")
    if c.has("--num-layers-per-virtual-pipeline-stage"):
        per = c.get("--num-layers-per-virtual-pipeline-stage")
        if layers % (pp * per):
            raise MegatronArgsError(f"--num-layers-per-virtual-pipeline-stage {per}: --num-layers {layers} is not "
                                    f"divisible by pipeline size {pp} x {per}")
        c.set("--num-layers-per-virtual-pipeline-stage", parallel__virtual_stages=layers // (pp * per))
    if c.has("--num-virtual-stages-per-pipeline-rank"):
        c.set("--num-virtual-stages-per-pipeline-rank",
              parallel__virtual_stages=c.get("--num-virtual-stages-per-pipeline-rank"))
    c.set("--sequence-parallel", parallel__tp_sequence_parallel=bool(c.get("--sequence-parallel")) and tp > 1)
    if c.get("--sequence-parallel") and tp == 1:
        c.out.mapped["--sequence-parallel"] = "off at tensor-parallel size 1, as Megatron-LM turns it off"
    if c.has("--overlap-grad-reduce"):
        c.set("--overlap-grad-reduce", parallel__overlap_grad_reduce=True)
    c.set("--use-torch-fsdp2", parallel__fsdp=bool(c.get("--use-torch-fsdp2")))
    c.set("--distributed-timeout-minutes", parallel__timeout_seconds=60.0 * c.get("--distributed-timeout-minutes"))
    if c.has("--distributed-backend"):
        c.set("--distributed-backend", parallel__backend=c.get("--distributed-backend"))


def _data(c: _Converter) -> None:
    from megalysses.tools.megatron_files import blend_shares, tokenizer_size

    seq = c.get("--seq-length")
    c.set("--seq-length", data__seq_len=seq)
    mock = bool(c.get("--mock-data"))
    paths = c.get("--data-path") or c.get("--train-data-path") or []
    if mock:
        c.set("--mock-data", data__mock=True)
    elif not paths:
        raise MegatronArgsError("--data-path is missing (or empty: an unset variable?): give the dataset prefixes, "
                                "or --mock-data")
    else:
        c.set("--data-path --train-data-path", data__paths=[str(p) for p in paths])
    split = c.get("--split") or "969, 30, 1"
    if c.has("--train-data-path") and not c.has("--data-path"):
        split = "1,0,0"
    c.set("--split", data__split=split.replace(" ", ""))
    if c.get("--valid-data-path"):
        c.set("--valid-data-path", data__valid_paths=[str(p) for p in c.get("--valid-data-path")])
    unweighted = paths and not is_weighted(paths)
    if not mock and unweighted and len(paths) > 1:
        c.set("--data-path --train-data-path", data__blend_by_size=True)
        if c.read_files:
            c.note(blend_shares([str(p) for p in paths], split.replace(" ", ""), seq))
    kind = c.get("--tokenizer-type")
    if kind is None and c.has("--vocab-file") and c.has("--merge-file"):
        kind = "GPT2BPETokenizer"
        c.note("--tokenizer-type is missing: --vocab-file and --merge-file read as GPT2BPETokenizer")
    if kind is None:
        raise MegatronArgsError("--tokenizer-type is missing: name the tokenizer (HuggingFaceTokenizer, "
                                "GPT2BPETokenizer, SentencePieceTokenizer, NullTokenizer, ...)")
    c.set("--tokenizer-type", data__tokenizer=kind)
    for flag, key in (("--tokenizer-model", "tokenizer_model"), ("--vocab-file", "vocab_file"),
                      ("--merge-file", "merge_file"), ("--data-cache-path", "cache_dir")):
        if c.has(flag):
            c.set(flag, **{f"data__{key}": c.get(flag)})
    c.set("--eod-mask-loss", data__eod_mask_loss=bool(c.get("--eod-mask-loss")))
    c.set("--reset-position-ids", data__reset_position_ids=bool(c.get("--reset-position-ids")))
    c.set("--reset-attention-mask", data__document_mask=bool(c.get("--reset-attention-mask")))
    vocab = tokenizer_size(kind, c.get("--tokenizer-model"), c.get("--vocab-file"), c.get("--merge-file"),
                           c.get("--vocab-size"), c.read_files, c.note, c.vocab_size)
    c.set("--vocab-size --tokenizer-model --vocab-file", model__vocab_size=vocab)
    c.set("--make-vocab-size-divisible-by --padded-vocab-size", model__vocab_pad_multiple=_pad_multiple(c, vocab))


def _pad_multiple(c: _Converter, vocab: int) -> int:
    """model.vocab_pad_multiple that pads `vocab` tokens to Megatron-LM's rows: its vocab_size_with_padding (a
    multiple of --make-vocab-size-divisible-by x tp) unless --padded-vocab-size gives the rows, which it keeps
    as given; then that multiple where it gives the same rows, else the rows themselves (which pad `vocab` to
    them at every tp that divides them)."""
    tp = c.get("--tensor-model-parallel-size")
    multiple = c.get("--make-vocab-size-divisible-by") * tp
    rows = c.get("--padded-vocab-size")
    if rows is None:
        return multiple
    if rows < vocab:
        raise MegatronArgsError(f"--padded-vocab-size {rows} is smaller than the tokenizer's {vocab} tokens: the "
                                f"embedding would not hold every token id; give at least {vocab} (or leave it out: "
                                f"Megatron-LM pads to a multiple of --make-vocab-size-divisible-by x tp)")
    if rows % tp:
        raise MegatronArgsError(f"--padded-vocab-size {rows} is not divisible by --tensor-model-parallel-size {tp}: "
                                f"Megatron-LM's vocab-parallel embedding splits the rows evenly over tp; give a "
                                f"multiple of {tp}")
    if -(-vocab // multiple) * multiple == rows:
        return multiple
    c.note(f"--padded-vocab-size {rows}: model.vocab_pad_multiple={rows}, so the {vocab} tokens pad to {rows} rows, "
           f"Megatron-LM's, at every tp that divides {rows}")
    return rows


def _batch_and_schedule(c: _Converter) -> None:
    gbs, steps, by_samples = _batch_and_steps(c)
    _lr_schedule(c, gbs, steps, by_samples)
    _adamw(c)


def _batch_and_steps(c: _Converter) -> tuple[int, int, bool]:
    """The batch (micro, global, a ramp or a step schedule) and the training length in steps; returns (the final
    global batch, the steps, whether Megatron-LM counted in samples)."""
    from megalysses.tools.megatron_files import rampup_train_iters, step_schedule

    mbs = c.need("--micro-batch-size")
    c.set("--micro-batch-size", training__micro_batch_size=mbs)
    seq, gbs, levels = c.get("--seq-length"), c.get("--global-batch-size"), None
    if c.has("--step-batch-size-schedule"):
        levels = step_schedule(c.get("--step-batch-size-schedule"), seq)
        if gbs is not None and gbs != levels[-1][1]:
            raise MegatronArgsError(f"--global-batch-size {gbs} and --step-batch-size-schedule (ending at "
                                    f"{levels[-1][1]}) are both given: Megatron-LM refuses both; keep one")
        if gbs is not None:
            c.note("--global-batch-size with --step-batch-size-schedule: Megatron-LM refuses the two together; both "
                   f"give {gbs} here")
        gbs = levels[-1][1]
        c.set("--step-batch-size-schedule", training__batch_size_schedule=[list(s) for s in levels])
    if gbs is None:
        raise MegatronArgsError("--global-batch-size is missing: without it Megatron-LM takes micro-batch-size x "
                                "data-parallel size, which depends on the world size; give it")
    c.set("--global-batch-size --step-batch-size-schedule", training__global_batch_size=gbs)
    ramp = c.get("--rampup-batch-size")
    if ramp:
        c.set("--rampup-batch-size", training__rampup_batch_size=list(ramp))
        c.note("--rampup-batch-size follows Megatron-LM's ramp (releases since 2026-04 ignore the flag in favour of "
               "--step-batch-size-schedule)")
    if c.has("--train-iters") == c.has("--train-samples"):
        raise MegatronArgsError("give one of --train-iters and --train-samples (Megatron-LM needs exactly one)")
    by_samples = c.has("--train-samples")
    if by_samples:
        samples = c.get("--train-samples")
        steps = rampup_train_iters(samples, gbs, ramp, levels)
        c.set("--train-samples", training__train_steps=steps)
        c.note(f"--train-samples {samples}: training.train_steps={steps} steps of the global batch")
    else:
        steps = c.get("--train-iters")
        c.set("--train-iters", training__train_steps=steps)
    return gbs, steps, by_samples


def _lr_schedule(c: _Converter, gbs: int, steps: int, by_samples: bool) -> None:
    """The learning-rate schedule's lengths in steps of the final global batch: decay, warm-up, WSD's decay."""
    mode = "--train-samples" if by_samples else "--train-iters"
    for iters_flag, samples_flag in (("--lr-decay-iters", "--lr-decay-samples"),
                                     ("--lr-warmup-iters", "--lr-warmup-samples"),
                                     ("--lr-wsd-decay-iters", "--lr-wsd-decay-samples")):
        wrong, right = (iters_flag, samples_flag) if by_samples else (samples_flag, iters_flag)
        if c.get(wrong):
            raise MegatronArgsError(f"{wrong} with {mode}: Megatron-LM does not take it there; give {right}")

    def in_steps(flag: str, samples_flag: str) -> Optional[float]:
        """A length in steps of the final global batch (the unit of the schedule's progress)."""
        if by_samples:
            return c.get(samples_flag) / gbs if c.has(samples_flag) else None
        return float(c.get(flag)) if c.has(flag) else None

    decay = in_steps("--lr-decay-iters", "--lr-decay-samples") or (c.get("--train-samples") / gbs if by_samples
                                                                     else float(steps))
    decay_steps = _whole(c, decay, "--lr-decay-samples" if by_samples else "--lr-decay-iters", "optimizer.decay_steps")
    c.set("--lr-decay-iters --lr-decay-samples", optimizer__decay_steps=decay_steps if decay_steps != steps else 0)
    if c.has("--lr-warmup-fraction"):
        warmup = c.get("--lr-warmup-fraction") * decay
        where = "--lr-warmup-fraction"
    else:
        warmup = in_steps("--lr-warmup-iters", "--lr-warmup-samples") or 0.0
        where = "--lr-warmup-samples" if by_samples else "--lr-warmup-iters"
    warmup_steps = _whole(c, warmup, where, "optimizer.warmup_steps")
    init = float(c.get("--lr-warmup-init")) if warmup_steps else None      # Megatron-LM warms up from 0.0
    c.set("--lr-warmup-iters --lr-warmup-samples --lr-warmup-fraction --lr-warmup-init",
          optimizer__warmup_steps=warmup_steps, optimizer__warmup_init=init)
    style = c.get("--lr-decay-style")
    if style == "inverse-square-root":
        c.lossy("--lr-decay-style", "inverse-square-root decay is not available; the converted config decays "
                                    "with cosine")
    c.set("--lr-decay-style", optimizer__schedule={"WSD": "wsd", "inverse-square-root": "cosine"}.get(style, style))
    if style == "WSD":
        wsd = in_steps("--lr-wsd-decay-iters", "--lr-wsd-decay-samples")
        if wsd is None:
            raise MegatronArgsError("--lr-decay-style WSD needs --lr-wsd-decay-iters (or -samples): Megatron-LM "
                                    "stops without it")
        c.set("--lr-wsd-decay-iters --lr-wsd-decay-samples", optimizer__wsd_decay_steps=_whole(
            c, wsd, "--lr-wsd-decay-samples" if by_samples else "--lr-wsd-decay-iters", "optimizer.wsd_decay_steps"))
        c.set("--lr-wsd-decay-style", optimizer__wsd_decay_style=c.get("--lr-wsd-decay-style"))


def _adamw(c: _Converter) -> None:
    """The learning rates, gradient clipping, weight decay and Adam's settings."""
    c.set("--lr", optimizer__lr=c.need("--lr"))
    c.set("--min-lr", optimizer__min_lr=c.get("--min-lr"))
    c.set("--clip-grad", optimizer__grad_clip=c.get("--clip-grad"))
    wd = c.get("--weight-decay")          # the start and the end of Megatron-LM's weight decay, unless given
    start, end = (c.get(f) if c.get(f) is not None else wd for f in ("--start-weight-decay", "--end-weight-decay"))
    if start != end or c.get("--weight-decay-incr-style") != "constant":
        for f in ("--start-weight-decay", "--end-weight-decay", "--weight-decay-incr-style"):
            if c.has(f):
                c.lossy(f, f"weight decay from {start} to {end} ({c.get('--weight-decay-incr-style')}): one weight "
                           f"decay throughout here; the converted config uses {end}")
    c.set("--weight-decay --start-weight-decay --end-weight-decay --weight-decay-incr-style",
          optimizer__weight_decay=end)
    c.set("--adam-beta1", optimizer__beta1=c.get("--adam-beta1"))
    c.set("--adam-beta2", optimizer__beta2=c.get("--adam-beta2"))
    c.set("--adam-eps", optimizer__eps=c.get("--adam-eps"))
    if c.get("--optimizer") != "adam":
        c.lossy("--optimizer", f"{c.get('--optimizer')}: AdamW only here")
    for flag in ("--decoupled-lr", "--decoupled-min-lr"):
        if c.has(flag):
            c.lossy(flag, FLAGS[flag].note)


def _whole(c: _Converter, value: float, flag: str, key: str) -> int:
    """A step count; Megatron-LM's count in samples need not be whole steps: say so when it is rounded."""
    steps = round(value)
    if abs(steps - value) > 1e-9 * max(1.0, value):
        c.note(f"{flag}: {value:,.2f} steps of the global batch, rounded to {key}={steps}")
    return steps


def _precision_memory(c: _Converter) -> None:
    if c.get("--fp16"):
        c.lossy("--fp16", FLAGS["--fp16"].note + "; the converted config trains in bf16")
    dtype = "bfloat16" if c.get("--bf16") or c.get("--fp16") else "float32"
    c.set("--bf16 --fp16", training__dtype=dtype)
    for flag in ("--fp8-format", "--fp8-amax-history-len", "--fp8-amax-compute-algo", "--fp8-param-gather",
                 "--grad-reduce-in-bf16", "--no-load-optim", "--no-load-rng"):
        if c.get(flag):
            c.lossy(flag, FLAGS[flag].note)
    granularity, method, n = (c.get(f) for f in ("--recompute-granularity", "--recompute-method",
                                                 "--recompute-num-layers"))
    per_stage = c.get("--num-layers") // c.get("--pipeline-model-parallel-size")
    full = granularity == "full"
    if granularity == "selective":
        c.lossy("--recompute-granularity", "selective: " + dict(FLAGS["--recompute-granularity"].values)["selective"])
    if c.get("--recompute-activations"):
        c.lossy("--recompute-activations", FLAGS["--recompute-activations"].note)
    if full and method == "block" and (n or 0) < per_stage:
        c.lossy("--recompute-method", f"block recomputation of {n} of the {per_stage} layers of a stage: every "
                                      f"layer is recomputed here")
    elif full and method == "uniform" and n and n > 1:
        c.note(f"--recompute-method uniform --recompute-num-layers {n}: every layer is recomputed on its own here "
               f"(the same arithmetic, less memory)")
    c.set("--recompute-granularity --recompute-method --recompute-num-layers", training__activation_checkpointing=full)
    if c.get("--cpu-offloading") or c.get("--cpu-offloading-num-layers"):
        for flag in ("--cpu-offloading", "--cpu-offloading-num-layers"):
            if c.has(flag):
                c.lossy(flag, FLAGS["--cpu-offloading"].note)
    c.set("--optimizer-cpu-offload", training__optimizer_offload=bool(c.get("--optimizer-cpu-offload")))
    if c.get("--optimizer-offload-fraction") != 1.0:
        c.lossy("--optimizer-offload-fraction", FLAGS["--optimizer-offload-fraction"].note)
    if c.get("--eod-mask-loss") and not c.get("--calculate-per-token-loss"):
        c.lossy("--calculate-per-token-loss", "without it Megatron-LM averages the loss per micro-batch, and with "
                                              "--eod-mask-loss micro-batches count different tokens; megalysses "
                                              "divides by the global token count")


PROFILE_FLAGS = ("--use-pytorch-profiler", "--profile-step-start", "--profile-step-end", "--profile-ranks")


def _profiling(c: _Converter) -> None:
    """--profile --use-pytorch-profiler: Megatron-LM's torch profiler records steps start to end - 1 (as it logs
    them, after a warm-up step) on --profile-ranks: the profile section, whose end_step is inclusive."""
    if not c.get("--profile") or not c.get("--use-pytorch-profiler"):
        why = ("without --profile Megatron-LM profiles nothing" if not c.get("--profile") else
               "--profile without --use-pytorch-profiler: Megatron-LM opens an nsys capture range (cudaProfilerStart/"
               "Stop over steps start + 1 to end) for `nsys profile --capture-range=cudaProfilerApi`, which has no "
               "counterpart here; profile.start_step and profile.end_step record steps with the torch profiler")
        for flag in ("--profile",) + PROFILE_FLAGS:
            if c.has(flag):
                c.out.ignored[flag] = why
        return
    start, end = c.get("--profile-step-start"), c.get("--profile-step-end")
    if end <= max(start, 1):
        raise MegatronArgsError(f"--profile-step-end {end} is not after --profile-step-start {start}: Megatron-LM's "
                                f"torch profiler records steps start to end - 1")
    c.set("--profile --use-pytorch-profiler --profile-step-start --profile-step-end", profile__start_step=max(start, 1),
          profile__end_step=end - 1)
    c.set("--profile-ranks", profile__ranks=list(c.get("--profile-ranks")))


def _checkpoint_logging(c: _Converter) -> None:
    c.set("--seed", training__seed=c.get("--seed"))
    c.set("--exit-interval", training__exit_interval=c.get("--exit-interval") or 0)
    c.set("--exit-duration-in-mins", training__max_wall_minutes=float(c.get("--exit-duration-in-mins") or 0))
    save, load = c.get("--save"), c.get("--load")
    if save:
        c.set("--save", checkpoint__dir=save)
    c.set("--save-interval", checkpoint__save_interval=c.get("--save-interval") or 0)
    if c.get("--finetune"):
        if not load:
            raise MegatronArgsError("--finetune without --load: Megatron-LM fine-tunes the checkpoint --load names")
        c.set("--finetune --load", checkpoint__init_from=load, checkpoint__load="auto")
        c.note(f"--finetune --load {load}: checkpoint.init_from reads megalysses runs and Hugging Face models, not "
               f"Megatron-LM checkpoints")
    elif load and load == save:
        c.set("--load", checkpoint__load="auto")
    elif load:
        c.set("--load", checkpoint__load=load)
        c.note(f"--load {load}: checkpoint.load reads megalysses checkpoints, not Megatron-LM's")
    else:
        c.set("--load", checkpoint__load=None)
        c.note("no --load: Megatron-LM starts afresh on every launch (checkpoint.load: null); set "
               "checkpoint.load: auto to resume from the latest checkpoint")
    fmt = c.get("--ckpt-format")
    if fmt not in ("torch_dist", "torch_dcp"):
        c.out.ignored["--ckpt-format"] = f"{fmt}: {FLAGS['--ckpt-format'].note}"
    c.set("--log-interval", logging__log_interval=c.get("--log-interval"))
    iters = c.get("--eval-iters")
    c.set("--eval-interval --eval-iters", training__eval_interval=(c.get("--eval-interval") or 0) if iters else 0,
          training__eval_steps=max(iters, 1))
    if c.has("--tensorboard-dir"):
        c.set("--tensorboard-dir", logging__tensorboard=True, logging__tensorboard_dir=c.get("--tensorboard-dir"))
    if c.has("--wandb-project"):
        c.set("--wandb-project", logging__wandb_project=c.get("--wandb-project"), logging__wandb_mode="online")
