"""Cross-field rules of a config: ranges, head counts against the layout, the data and tokenizer
settings, the memory options, the batch arithmetic of a world size; the (ulysses, ring) split that the
heads allow (megalysses.plan.resolve applies it on a machine); the optional logging packages; and the
warnings for settings that are legal but almost certainly not meant.

    validate_config(cfg, world_size=8)      # raises ConfigError naming every number involved
    ulysses, ring = check_heads(num_heads, kv_heads, tp, sp, sp_ring, ranks_per_node)
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

from megalysses.config import Config, ConfigError, DataConfig, RopeScalingConfig, TrainingConfig


def validate_config(cfg: Config, world_size: Optional[int] = None, paths_later: bool = False) -> None:
    """Cross-field rules. With `world_size`, also the layout and batch arithmetic; with `paths_later`, an empty
    data.paths is allowed (a converted model's config, given its data when training starts). Raises ConfigError."""
    m, p, d, t = cfg.model, cfg.parallel, cfg.data, cfg.training
    _check_ranges(cfg)
    if m.head_dim is None and m.hidden_size % m.num_heads:
        raise ConfigError(f"model.hidden_size={m.hidden_size} is not divisible by model.num_heads={m.num_heads}: "
                          f"the head width is hidden_size / num_heads unless model.head_dim gives it")
    if m.head_size % 2:
        where = "model.head_dim" if m.head_dim is not None else "model head_dim (hidden_size / num_heads)"
        raise ConfigError(f"{where}: head_dim={m.head_size} must be even for rotary embeddings")
    if m.num_heads % m.kv_heads:
        raise ConfigError(f"model.num_heads={m.num_heads} is not divisible by model.num_kv_heads={m.kv_heads}")
    check_heads(m.num_heads, m.kv_heads, p.tp, p.sp, p.sp_ring)
    _check_rope_scaling(m.rope_scaling)
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
    if not d.mock and not d.paths and not paths_later:
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
    if t.activation_offload and not t.activation_checkpointing:
        raise ConfigError("training.activation_offload=true needs training.activation_checkpointing=true: the "
                          "offloaded tensors are the checkpointed block inputs (set both, or neither)")
    if t.attention_head_chunks not in ("auto", 1) and not t.recompute_attention:
        raise ConfigError(f"training.attention_head_chunks={t.attention_head_chunks} with "
                          f"training.recompute_attention=false is not supported: kept attention outputs are every "
                          f"layer's, all heads, which chunks cannot shrink; choose one of them")
    if t.checkpoint_stride > 1 and not t.activation_checkpointing:
        raise ConfigError(f"training.checkpoint_stride={t.checkpoint_stride} needs "
                          f"training.activation_checkpointing=true: it says which block inputs the checkpoints keep")
    if t.checkpoint_stride > 1 and not t.recompute_attention:
        raise ConfigError(f"training.checkpoint_stride={t.checkpoint_stride} with training.recompute_attention=false "
                          f"is not supported: a group's recomputation would keep attention's outputs for every block "
                          f"of the group; choose one of them")
    if t.param_offload and not p.fsdp:
        raise ConfigError("training.param_offload=true streams the weights through FSDP2 (its CPUOffloadPolicy): set "
                          "parallel.fsdp=true as well (ZeRO-1 keeps whole weights on every rank; "
                          "training.optimizer_offload is its offload)")
    if t.param_offload and t.optimizer_offload:
        raise ConfigError("training.param_offload=true already keeps the optimizer state in host memory and updates "
                          "it there: drop training.optimizer_offload (it is ZeRO-1's)")
    if t.optimizer_offload and p.fsdp:
        raise ConfigError("training.optimizer_offload=true is for ZeRO-1: with parallel.fsdp=true the optimizer "
                          "state is already sharded with the weights; set one of them to false")
    _check_batch_sizes(t)
    _check_lr_schedule(cfg)
    _check_long_eval(cfg)
    _check_profile(cfg, world_size)
    if world_size is not None:
        _check_world(cfg, world_size)


def _check_rope_scaling(rs: RopeScalingConfig) -> None:
    if rs.type == "llama3" and rs.high_freq_factor <= rs.low_freq_factor:
        raise ConfigError(f"model.rope_scaling: high_freq_factor={rs.high_freq_factor} must exceed "
                          f"low_freq_factor={rs.low_freq_factor}")
    if rs.type == "yarn" and rs.beta_fast <= rs.beta_slow:
        raise ConfigError(f"model.rope_scaling: beta_fast={rs.beta_fast} must exceed beta_slow={rs.beta_slow} "
                          f"(rotations over the original context: above beta_fast kept, below beta_slow "
                          f"interpolated)")
    if rs.type == "yarn" and rs.attention_factor is not None and rs.attention_factor <= 0:
        raise ConfigError(f"model.rope_scaling.attention_factor={rs.attention_factor} must be positive (or null: "
                          f"from factor and mscale)")


def check_world_size(cfg: Config, world_size: int) -> None:
    """The batch arithmetic of `cfg`'s layout on `world_size` ranks, a part of validate_config (which raises
    whatever this raises): it reads the layout (tp, sp, pp, virtual stages) and the batch settings only, so
    the planner checks a layout once for all its memory options."""
    _check_batch_sizes(cfg.training)
    _check_world(cfg, world_size)


def _check_profile(cfg: Config, world_size: Optional[int]) -> None:
    pr = cfg.profile
    if (pr.start_step is None) != (pr.end_step is None):
        given, missing = ("start_step", "end_step") if pr.end_step is None else ("end_step", "start_step")
        raise ConfigError(f"profile.{given} is set but profile.{missing} is not: profiling is on when both are "
                          f"(the first and the last step profiled); set profile.{missing} too, or neither")
    if pr.start_step is None:
        return
    if pr.end_step < pr.start_step:
        raise ConfigError(f"profile.end_step={pr.end_step} is before profile.start_step={pr.start_step}: the window "
                          f"is start_step to end_step, both included")
    if not pr.ranks or min(pr.ranks) < 0:
        raise ConfigError(f"profile.ranks={pr.ranks}: give the global ranks to profile (0 or more each; default [0])")
    if world_size is not None and max(pr.ranks) >= world_size:
        raise ConfigError(f"profile.ranks={pr.ranks}: rank {max(pr.ranks)} is not in a world of {world_size} "
                          f"(ranks 0 to {world_size - 1})")


def _check_batch_sizes(t: TrainingConfig) -> None:
    if t.micro_batch_size < 1 or t.global_batch_size < 1:
        raise ConfigError("training.micro_batch_size and training.global_batch_size must be >= 1")
    _check_batch_ramp(t)


def _check_world(cfg: Config, world_size: int) -> None:
    p, t = cfg.parallel, cfg.training
    mp = p.tp * p.sp * p.pp
    if world_size % mp:
        raise ConfigError(f"world size {world_size} is not divisible by tp*sp*pp = {p.tp}*{p.sp}*{p.pp} = {mp}: "
                          f"launch a multiple of {mp} processes (torchrun --nproc-per-node {mp} pretrain.py ...) "
                          f"or change the layout")
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
    _check_ramp_layout(cfg, per_step, dp)


MAX_SEQ_LEN = 2**31 - 2
"""Longest sample: token positions and sample-index offsets are 32-bit."""

# (section, field, lowest allowed value, highest allowed value or None)
_RANGES = [
    ("model", "vocab_size", 1, None), ("model", "vocab_pad_multiple", 1, None), ("model", "hidden_size", 1, None),
    ("model", "num_layers", 1, None), ("model", "num_heads", 1, None), ("model", "num_kv_heads", 1, None),
    ("model", "head_dim", 2, None), ("model", "sliding_window", 0, None),
    ("model", "ffn_hidden_size", 1, None), ("model", "norm_eps", 0.0, None), ("model", "init_std", 0.0, None),
    ("model", "rope_theta", 1.0, None),
    ("model.rope_scaling", "factor", 1.0, None), ("model.rope_scaling", "low_freq_factor", 0.0, None),
    ("model.rope_scaling", "high_freq_factor", 0.0, None),
    ("model.rope_scaling", "original_max_position_embeddings", 1, None),
    ("model.rope_scaling", "beta_fast", 0.0, None), ("model.rope_scaling", "beta_slow", 0.0, None),
    ("data", "seq_len", 1, MAX_SEQ_LEN),
    ("optimizer", "lr", 0.0, None), ("optimizer", "min_lr", 0.0, None), ("optimizer", "weight_decay", 0.0, None),
    ("optimizer", "beta1", 0.0, 1.0), ("optimizer", "beta2", 0.0, 1.0), ("optimizer", "eps", 0.0, None),
    ("optimizer", "grad_clip", 0.0, None), ("optimizer", "warmup_steps", 0, None),
    ("optimizer", "decay_fraction", 0.0, 1.0), ("optimizer", "warmup_init", 0.0, None),
    ("optimizer", "decay_steps", 0, None), ("optimizer", "wsd_decay_steps", 0, None),
    ("training", "exit_interval", 0, None),
    ("training", "seed", 0, 2**63 - 1), ("training", "train_steps", 1, None), ("training", "exit_at_step", 0, None),
    ("training", "max_wall_minutes", 0.0, None), ("training", "eval_interval", 0, None),
    ("training", "eval_steps", 1, None), ("checkpoint", "save_interval", 0, None), ("checkpoint", "keep_last", 0, None),
    ("training", "loss_chunk_tokens", 0, None), ("training", "mlp_chunk_tokens", 0, None),
    ("training", "attention_head_chunks", 1, None),
    ("training", "checkpoint_stride", 1, None),
    ("logging", "log_interval", 1, None), ("logging", "peak_tflops", 0.0, None),
    ("logging", "straggler_warn_fraction", 0.0, None),
    ("profile", "start_step", 1, None), ("profile", "end_step", 1, None),
    ("parallel", "timeout_seconds", 1.0, None),
    ("parallel", "tp", 1, None), ("parallel", "sp", 1, None), ("parallel", "sp_ring", 0, None),
    ("parallel", "pp", 1, None),
    ("parallel", "virtual_stages", 1, None), ("parallel", "grad_bucket_elements", 1, None),
    ("long_eval", "interval", 0, None), ("long_eval", "samples", 1, None), ("long_eval", "seed", 0, 2**63 - 1),
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
        if value is None or isinstance(value, str):      # None, or a word an integer field also takes (auto)
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
        notes.append(f"data.seq_len_schedule: the phase from step {late[0][0]} (seq_len {late[0][1]}) starts at or "
                     f"after training.train_steps={t.train_steps}: it never runs, and neither does "
                     f"data.seq_len={cfg.data.seq_len}")
    if o.warmup_init is not None and o.warmup_init > o.lr:
        notes.append(f"optimizer.warmup_init={o.warmup_init:g} is above optimizer.lr={o.lr:g}: the learning rate "
                     f"will fall during warmup")
    if cfg.profile.start_step is not None and cfg.profile.start_step > t.train_steps:
        notes.append(f"profile.start_step={cfg.profile.start_step} is after training.train_steps={t.train_steps}: "
                     f"nothing will be profiled")
    if o.warmup_steps > t.train_steps:
        notes.append(f"optimizer.warmup_steps={o.warmup_steps} is more than training.train_steps={t.train_steps}: "
                     f"the learning rate never reaches optimizer.lr")
    rs, plain = cfg.model.rope_scaling, RopeScalingConfig()
    unused = [f"model.rope_scaling.{f.name}={getattr(rs, f.name)}" for f in dataclasses.fields(rs)
              if f.name != "type" and getattr(rs, f.name) != getattr(plain, f.name)]
    if rs.type == "none" and unused:
        notes.append(f"{', '.join(unused)} {'is' if len(unused) == 1 else 'are'} unused: model.rope_scaling.type "
                     f"is none (plain RoPE); set model.rope_scaling.type (llama3, linear or yarn) to apply it")
    return notes


def _check_batch_ramp(t: TrainingConfig) -> None:
    """training.rampup_batch_size ([start, increment, samples]) or batch_size_schedule ([[from_sample, batch], ...]),
    each ending at global_batch_size."""
    gbs = t.global_batch_size
    if t.rampup_batch_size and t.batch_size_schedule:
        raise ConfigError("training.rampup_batch_size and training.batch_size_schedule are both set: a run ramps "
                          "its batch size one way; keep one")
    ramp = t.rampup_batch_size
    if ramp:
        where = f"training.rampup_batch_size={ramp}"
        if len(ramp) != 3 or min(ramp) < 1:
            raise ConfigError(f"{where}: give [start, increment, samples], three numbers >= 1, e.g. "
                              f"[{max(gbs // 8, 1)}, {max(gbs // 8, 1)}, 1000000]")
        start, increment, _ = ramp
        if start >= gbs or (gbs - start) % increment:
            raise ConfigError(f"{where}: the ramp goes from start={start} to training.global_batch_size={gbs} in "
                              f"steps of increment={increment}, so start must be below {gbs} and {gbs} - start a "
                              f"multiple of {increment}")
    prev = -1
    for i, entry in enumerate(t.batch_size_schedule):
        where = f"training.batch_size_schedule[{i}]={entry}"
        if len(entry) != 2:
            raise ConfigError(f"{where}: each entry is a [from_sample, batch] pair, e.g. [[0, {max(gbs // 4, 1)}], "
                              f"[100000, {gbs}]]")
        sample, batch = entry
        if i == 0 and sample != 0:
            raise ConfigError(f"{where}: the first entry must start at sample 0: make it [0, {batch}]")
        if sample <= prev:
            raise ConfigError(f"{where}: from_sample {sample} is not after the previous entry's {prev}: list the "
                              f"entries in order of strictly increasing from_sample")
        if batch < 1:
            raise ConfigError(f"{where}: batch {batch} must be >= 1")
        prev = sample
    if t.batch_size_schedule and t.batch_size_schedule[-1][1] != gbs:
        raise ConfigError(f"training.batch_size_schedule ends at batch {t.batch_size_schedule[-1][1]} but "
                          f"training.global_batch_size={gbs} is the batch it ends at: make them equal")


def _check_ramp_layout(cfg: Config, per_step: int, dp: int) -> None:
    """Every batch of a ramp is whole micro-batches on every dp rank (and whole pipeline rounds, interleaved)."""
    from megalysses.config.batch_schedule import BatchSizes

    t, p = cfg.training, cfg.parallel
    what = "rampup_batch_size" if t.rampup_batch_size else "batch_size_schedule"
    for batch in BatchSizes.from_config(t).batches():
        if batch % per_step:
            raise ConfigError(f"training.{what}: the global batch {batch} is not divisible by micro_batch_size="
                              f"{t.micro_batch_size} * dp={dp} = {per_step}: every batch of the ramp must be; "
                              f"make start and increment multiples of {per_step}")
        if p.virtual_stages > 1 and (batch // per_step) % p.pp:
            raise ConfigError(f"interleaved pipeline: the global batch {batch} of training.{what} is "
                              f"{batch // per_step} micro-batches, not a multiple of parallel.pp={p.pp}")


def _check_lr_schedule(cfg: Config) -> None:
    """optimizer.decay_steps after warmup; a WSD decay (wsd_decay_steps) that starts after warmup ends."""
    o = cfg.optimizer
    decay = o.decay_steps or cfg.training.train_steps
    if o.schedule != "constant" and o.decay_steps and o.decay_steps <= o.warmup_steps:
        raise ConfigError(f"optimizer.decay_steps={o.decay_steps} is not after optimizer.warmup_steps="
                          f"{o.warmup_steps}: the decay would end before warmup does; raise decay_steps")
    if o.schedule == "wsd" and o.wsd_decay_steps > decay - o.warmup_steps:
        raise ConfigError(f"optimizer.wsd_decay_steps={o.wsd_decay_steps} is more than the {decay - o.warmup_steps} "
                          f"steps between warmup (optimizer.warmup_steps={o.warmup_steps}) and the end of the "
                          f"decay ({'optimizer.decay_steps' if o.decay_steps else 'training.train_steps'}={decay}): "
                          f"the decay would start during warmup; lower it")


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
                              f"phases in order of strictly increasing from_step")
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


def _check_long_eval(cfg: Config) -> None:
    """long_eval: tasks, lengths and depths that make sense, and real text for the tasks that read it."""
    e = cfg.long_eval
    if not e.tasks:
        raise ConfigError("long_eval.tasks is empty: name at least one of passkey, niah, niah-multikey, position-loss")
    bad = [n for n in e.lengths if not 1 <= n <= MAX_SEQ_LEN]
    if bad:
        raise ConfigError(f"long_eval.lengths holds {bad[0]}: lengths are token counts between 1 and {MAX_SEQ_LEN}")
    bad_depths = [x for x in e.depths if not 0.0 <= x <= 1.0] if e.depths else [None]
    if bad_depths:
        raise ConfigError(f"long_eval.depths holds {bad_depths[0]}: give the needle depths as fractions in [0, 1] "
                          f"(0: right after the intro, 1: right before the question)")
    text = [t for t in e.tasks if t != "passkey"]
    if e.interval and text and cfg.data.mock and not e.haystack:
        raise ConfigError(f"long_eval.tasks holds {text[0]}, which reads real text, but the run trains on mock data: "
                          f"name a dataset in long_eval.haystack, or keep only passkey in long_eval.tasks")
    if e.haystack:
        from megalysses.config.values import parse_blend

        try:
            parse_blend(e.haystack)
        except ValueError as err:
            raise ConfigError(f"long_eval.haystack: {err}") from None


def _check_data(d: DataConfig) -> None:
    from megalysses.config.values import parse_blend
    from megalysses.config.values import parse_split

    try:
        parse_split(d.split)
        if not d.mock and d.paths:
            parse_blend(d.paths)
    except ValueError as e:
        raise ConfigError(f"data.{'split' if str(e).startswith('split') else 'paths'}: {e}") from None
    try:
        if not d.mock and d.valid_paths:
            parse_blend(d.valid_paths)
    except ValueError as e:
        raise ConfigError(f"data.valid_paths: {e}") from None
    if not 0 <= d.documents_per_million <= 1e6:
        raise ConfigError(f"data.documents_per_million={d.documents_per_million} is outside [0, 1000000]: give the "
                          f"corpus's documents per million tokens (at most one document a token)")


def _check_tokenizer(d: DataConfig) -> None:
    from megalysses.config.values import TokenizerError, canonical_kind

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


def head_chunk_counts(num_heads: int, kv_heads: int, tp: int, ulysses: int) -> list[int]:
    """The values of training.attention_head_chunks a layout allows: each chunk holds whole KV groups of the tp
    rank (a KV head with the query heads that read it: chunks divide the KV heads per tp rank), and its heads
    split over the Ulysses ranks as check_heads requires of all of them (its query heads divisible by ulysses,
    its KV heads dividing ulysses or divisible by it; fewer are replicated)."""
    hq, hk = num_heads // tp, kv_heads // tp
    return [n for n in range(1, hk + 1) if hk % n == 0 and (hq // n) % ulysses == 0
            and ((hk // n) % ulysses == 0 or ulysses % (hk // n) == 0)]


def check_head_chunks(num_heads: int, kv_heads: int, tp: int, ulysses: int, ring: int, chunks: int) -> None:
    """training.attention_head_chunks=`chunks` at this layout, or ConfigError naming the values it allows."""
    allowed = head_chunk_counts(num_heads, kv_heads, tp, ulysses)
    if chunks not in allowed:
        raise ConfigError(
            f"training.attention_head_chunks={chunks} does not split this layout's heads: each chunk holds whole KV "
            f"groups of a tp rank ({num_heads // tp} query heads on {kv_heads // tp} KV heads at parallel.tp={tp}) "
            f"and splits evenly over the {ulysses} Ulysses ranks (sp = ulysses {ulysses} x ring {ring}); choose "
            f"one of {', '.join(map(str, allowed))}, or auto")


def check_kept_attention(cfg: Config, backend: str, ulysses: int, ring: int) -> None:
    """training.recompute_attention=false keeps SDPA's kernel outputs (model/recompute.py): it needs
    checkpointing without offload, SDPA, and no ring."""
    if not cfg.training.activation_checkpointing:
        raise ConfigError("training.recompute_attention=false keeps attention outputs through activation "
                          "checkpointing, which is off: set training.activation_checkpointing=true, or drop "
                          "recompute_attention (without checkpointing nothing is recomputed)")
    if cfg.training.activation_offload:
        raise ConfigError("training.recompute_attention=false with training.activation_offload=true is not "
                          "supported: the kept attention outputs would stay on the device, as large as the block "
                          "inputs that offload moves to host memory; choose one of them")
    if backend != "sdpa":
        raise ConfigError(f"training.recompute_attention=false keeps the outputs of SDPA's attention kernels, but "
                          f"this run's attention backend is {backend}: set model.attention_backend=sdpa, or "
                          f"training.recompute_attention=true")
    if ring > 1:
        raise ConfigError(f"training.recompute_attention=false is not supported with ring attention (parallel.sp="
                          f"{cfg.parallel.sp} = ulysses {ulysses} x ring {ring}): its blocks are many kernel "
                          f"calls; use an sp the heads allow (no ring), or training.recompute_attention=true")


def check_logging_backends(cfg: Config) -> None:
    """The optional logging packages the config asks for are importable; raises ConfigError naming the fix."""
    if cfg.logging.wandb_mode != "disabled":
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ConfigError(f"logging.wandb_mode={cfg.logging.wandb_mode} needs wandb: pip install "
                              f"'megalysses[wandb]', or set logging.wandb_mode=disabled") from None
    if cfg.logging.tensorboard:
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError:
            raise ConfigError("logging.tensorboard=true needs tensorboard: pip install 'megalysses[tensorboard]', "
                              "or set logging.tensorboard=false") from None
