"""Bad configs given to pretrain (in-process, a world of one): the config file, --set overrides, values
that are not finite or out of range, layouts, and what the machine cannot do."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Union

from tests.faults.corpus import Case

TINY = ["data.mock=true", "data.seq_len=32", "model.vocab_size=128", "model.hidden_size=32", "model.num_layers=2",
        "model.num_heads=4", "training.global_batch_size=2", "training.micro_batch_size=1",
        "training.train_steps=1", "parallel.timeout_seconds=30"]


def pretrain(*overrides: str, config: Optional[str] = None,
             prepare: Optional[Callable[[Path], None]] = None) -> Callable[[Path], int]:
    """A case body: pretrain.main with the tiny model, the given --set overrides, run_dir in the case's tmp.
    `config` is a path (formatted with tmp) passed as --config; `prepare(tmp)` runs first."""
    def run(tmp: Path) -> int:
        from megalysses.tools.pretrain import main
        if prepare is not None:
            prepare(tmp)
        argv = [] if config is None else ["--config", config.format(tmp=tmp)]
        sets = TINY + [f"logging.run_dir={tmp}/run"] + [o.format(tmp=tmp) for o in overrides]
        return main(argv + [a for o in sets for a in ("--set", o)])
    return run


def with_file(content: Union[str, bytes], *overrides: str) -> Callable[[Path], int]:
    """pretrain with --config pointing at a file holding `content` (text is written as UTF-8)."""
    def write(tmp: Path) -> None:
        data = content.encode() if isinstance(content, str) else content
        (tmp / "config.yaml").write_bytes(data)
    return pretrain(*overrides, config="{tmp}/config.yaml", prepare=write)


def _dir(tmp: Path) -> None:
    (tmp / "configs").mkdir()


FILES = [
    Case("config/file_missing", pretrain(config="{tmp}/nope.yaml"), "does not exist"),
    Case("config/file_is_a_directory", pretrain(config="{tmp}/configs", prepare=_dir), "is a directory"),
    Case("config/file_latin1", with_file("model:\n  norm: rmsnorm # d\xe9j\xe0 vu\n".encode("latin-1")), "not UTF-8"),
    Case("config/file_utf16", with_file("model:\n  num_layers: 2\n".encode("utf-16")), "not UTF-8"),
    Case("config/file_binary", with_file(bytes(range(256)) * 4), "not UTF-8"),
    Case("config/file_binary_ascii", with_file(bytes(range(128)) * 4), "is binary"),
    Case("config/file_of_zeros", with_file(bytes(4096)), "is binary"),
    Case("config/file_control_characters", with_file("model:\n  num_layers: 2\x07\n"), "unacceptable character"),
    Case("config/yaml_unclosed_bracket", with_file("model: [\n"), "not valid YAML"),
    Case("config/yaml_tab_indent", with_file("model:\n\tnum_layers: 2\n"), "not valid YAML"),
    Case("config/yaml_bad_indent", with_file("model:\n  num_layers: 2\n   hidden_size: 32\n"), "not valid YAML"),
    Case("config/yaml_section_twice", with_file("model:\n  num_layers: 2\noptimizer:\n  lr: 1.0e-3\n"
                                                "model:\n  hidden_size: 32\n"), "'model' appears twice"),
    Case("config/yaml_key_twice", with_file("optimizer:\n  lr: 1.0e-3\n  lr: 3.0e-4\n"), "'lr' appears twice"),
    Case("config/yaml_top_level_list", with_file("- model\n- optimizer\n"), "top level must be a mapping"),
    Case("config/yaml_top_level_scalar", with_file("pretrain\n"), "top level must be a mapping"),
    Case("config/yaml_section_scalar", with_file("model: 3\n"), "model: expected a mapping"),
    Case("config/yaml_unknown_section", with_file("optimiser:\n  lr: 1.0e-3\n"), "did you mean 'optimizer'"),
    Case("config/yaml_unknown_key", with_file("training:\n  train_step: 5\n"), "did you mean 'train_steps'"),
    Case("config/yaml_lr_nan", with_file("optimizer:\n  lr: .nan\n"), "optimizer.lr"),
    Case("config/yaml_lr_inf", with_file("optimizer:\n  lr: .inf\n"), "optimizer.lr"),
    Case("config/yaml_lr_blank", with_file("optimizer:\n  lr:\n"), "optimizer.lr"),
    Case("config/yaml_flow_key_twice", with_file("optimizer: {lr: 1.0e-3, lr: 3.0e-4}\n"), "'lr' appears twice"),
    Case("config/yaml_warmup_list", with_file("optimizer:\n  warmup_steps: [2, 4]\n"), "optimizer.warmup_steps"),
]

OVERRIDES = [
    Case("config/unknown_key", pretrain("model.hiden_size=3"), "hidden_size"),
    Case("config/override_without_value", pretrain("optimizer.lr"), "section.key=value"),
    Case("config/override_empty_value", pretrain("optimizer.lr="), "optimizer.lr"),
    Case("config/override_unknown_section", pretrain("optimiser.lr=1e-3"), "optimizer"),
    Case("config/override_section_itself", pretrain("optimizer=1"), "is a section"),
    Case("config/override_below_a_value", pretrain("model.hidden_size.x=1"), "not a section"),
    Case("config/override_without_key", pretrain("=3"), "unknown config key"),
    Case("config/override_empty_segment", pretrain("model..hidden_size=3"), "unknown config key"),
]

TYPES = [
    Case(f"config/type_{name}", pretrain(override), field) for name, override, field in [
        ("layers_word", "model.num_layers=four", "model.num_layers"),
        ("layers_fraction", "model.num_layers=2.5", "model.num_layers"),
        ("layers_list", "model.num_layers=[2]", "model.num_layers"),
        ("lr_word", "optimizer.lr=fast", "optimizer.lr"),
        ("lr_bool", "optimizer.lr=true", "optimizer.lr"),
        ("tie_maybe", "model.tie_embeddings=maybe", "model.tie_embeddings"),
        ("norm_batchnorm", "model.norm=batchnorm", "model.norm"),
        ("mlp_relu", "model.mlp=relu", "model.mlp"),
        ("dtype_float16", "training.dtype=float16", "training.dtype"),
        ("backend_mpi", "parallel.backend=mpi", "parallel.backend"),
        ("mlp_tile_word", "training.mlp_chunk_tokens=big", "training.mlp_chunk_tokens: expected an integer or auto"),
        ("loss_tile_fraction", "training.loss_chunk_tokens=0.5", "training.loss_chunk_tokens"),
        ("nan_policy_ignore", "training.nan_policy=ignore", "training.nan_policy"),
        ("attention_xformers", "model.attention_backend=xformers", "model.attention_backend"),
        ("schedule_step", "optimizer.schedule=step", "optimizer.schedule"),
        ("steps_word", "training.train_steps=many", "training.train_steps"),
        ("batch_bool", "training.global_batch_size=true", "training.global_batch_size"),
        ("fsdp_maybe", "parallel.fsdp=maybe", "parallel.fsdp"),
        ("overlap_two", "parallel.overlap_grad_reduce=2", "parallel.overlap_grad_reduce"),
        ("fallback_maybe", "checkpoint.fallback=maybe", "checkpoint.fallback"),
        ("keep_last_word", "checkpoint.keep_last=two", "checkpoint.keep_last"),
        ("wandb_cloud", "logging.wandb_mode=cloud", "logging.wandb_mode"),
        ("log_interval_fraction", "logging.log_interval=1.5", "logging.log_interval"),
        ("timeout_word", "parallel.timeout_seconds=ten", "parallel.timeout_seconds"),
        ("kv_heads_list", "model.num_kv_heads=[2]", "model.num_kv_heads"),
        ("ffn_word", "model.ffn_hidden_size=big", "model.ffn_hidden_size"),
        ("exit_at_word", "training.exit_at_step=last", "training.exit_at_step"),
    ]
]

NOT_FINITE = [
    Case(f"config/{field.replace('.', '_')}_{value}", pretrain(f"{field}={value}"), field) for field, value in [
        ("optimizer.grad_clip", "nan"), ("training.max_wall_minutes", "nan"), ("parallel.timeout_seconds", "nan"),
        ("optimizer.lr", "nan"), ("optimizer.lr", "inf"), ("optimizer.lr", "-inf"), ("optimizer.beta1", "inf"),
        ("optimizer.beta2", "nan"), ("optimizer.eps", "inf"), ("optimizer.min_lr", "nan"),
        ("optimizer.weight_decay", "nan"), ("optimizer.decay_fraction", "nan"), ("model.rope_theta", "nan"),
        ("model.norm_eps", "inf"), ("model.init_std", "nan"), ("logging.peak_tflops", "inf"),
        ("parallel.timeout_seconds", "inf"), ("optimizer.warmup_init", "nan"),
    ]
]

RANGES = [
    Case(f"config/range_{field.replace('.', '_')}_{value}".replace("-", "minus"), pretrain(f"{field}={value}"),
         f"{field}={value}") for field, value in [
        ("model.num_kv_heads", "0"), ("model.num_kv_heads", "-2"), ("model.ffn_hidden_size", "-3"),
        ("model.ffn_hidden_size", "0"), ("model.num_heads", "0"), ("model.hidden_size", "0"),
        ("model.num_layers", "0"), ("model.vocab_size", "0"), ("model.vocab_size", "-1"), ("data.seq_len", "0"),
        ("data.seq_len", "-5"), ("data.seq_len", "1000000000000"), ("optimizer.lr", "-0.001"),
        ("optimizer.beta1", "1.5"), ("optimizer.beta2", "-0.1"), ("optimizer.eps", "-1.0"),
        ("optimizer.grad_clip", "-1.0"), ("optimizer.warmup_steps", "-1"), ("optimizer.decay_fraction", "1.5"),
        ("training.train_steps", "0"), ("training.exit_at_step", "-1"), ("training.max_wall_minutes", "-5.0"),
        ("training.eval_interval", "-1"), ("training.eval_steps", "0"), ("training.seed", "-1"),
        ("training.loss_chunk_tokens", "-1"), ("training.mlp_chunk_tokens", "-1"),
        ("checkpoint.save_interval", "-1"), ("checkpoint.keep_last", "-1"), ("logging.log_interval", "0"),
        ("parallel.timeout_seconds", "0.0"), ("parallel.tp", "0"), ("parallel.sp", "-1"), ("parallel.pp", "0"),
        ("parallel.virtual_stages", "0"), ("parallel.grad_bucket_elements", "0"), ("model.rope_theta", "0.0"),
        ("model.norm_eps", "-1.0"), ("parallel.grad_bucket_elements", "-5"), ("model.init_std", "-0.02"),
        ("optimizer.min_lr", "-1e-05"), ("optimizer.weight_decay", "-0.1"), ("logging.peak_tflops", "-5.0"),
        ("optimizer.decay_steps", "-1"), ("optimizer.wsd_decay_steps", "-2"), ("optimizer.warmup_init", "-0.5"),
        ("training.exit_interval", "-1"), ("training.attention_head_chunks", "0"),
        ("data.documents_per_million", "-1.0"), ("data.documents_per_million", "2000000.0"),
    ]
]

RULES = [
    Case("config/hidden_not_divisible_by_heads", pretrain("model.hidden_size=30"), "num_heads"),
    Case("config/odd_head_dim", pretrain("model.hidden_size=36"), "head_dim=9"),
    Case("config/heads_not_divisible_by_kv_heads", pretrain("model.num_kv_heads=3"), "num_kv_heads=3"),
    Case("config/kv_heads_above_heads", pretrain("model.num_kv_heads=8"), "num_kv_heads=8"),
    Case("config/heads_not_divisible_by_tp", pretrain("parallel.tp=3"), "parallel.tp=3"),
    # any vocabulary and any sequence length fit any layout (both are padded to its multiple): what is left
    # to refuse is what padding cannot fix: the MLP width over tp, the padding multiple itself, and an
    # explicit ulysses x ring split of sp (a ring that divides sp, whole query heads per Ulysses rank, KV
    # heads that divide the Ulysses degree or are divisible by it)
    Case("config/ffn_not_divisible_by_tp", pretrain("model.ffn_hidden_size=66", "parallel.tp=4"),
         "set model.ffn_hidden_size to a multiple of 4"),
    Case("config/vocab_pad_multiple_zero", pretrain("model.vocab_pad_multiple=0", "parallel.tp=2"),
         "vocab_pad_multiple=0"),
    Case("config/sp_ring_not_dividing_sp", pretrain("parallel.sp=4", "parallel.sp_ring=3"), "choose a divisor of 4"),
    Case("config/layers_not_divisible_by_pp", pretrain("model.num_layers=3", "parallel.pp=2"), "num_layers=3"),
    Case("config/virtual_stages_without_pp", pretrain("parallel.virtual_stages=2"), "virtual_stages=2"),
    Case("config/kv_heads_not_divisible_by_tp", pretrain("model.num_kv_heads=1", "parallel.tp=2"), "num_kv_heads=1"),
    Case("config/sp_ring_leaves_ulysses_the_query_heads_refuse",
         pretrain("model.num_heads=6", "model.hidden_size=48", "parallel.sp=4", "parallel.sp_ring=1"),
         "query heads per tp rank = 6 must be divisible by it"),
    Case("config/sp_ring_leaves_ulysses_the_kv_heads_refuse",
         pretrain("model.num_heads=12", "model.num_kv_heads=6", "model.hidden_size=96", "parallel.sp=4",
                  "parallel.sp_ring=1"), "sp_ring can be one of 2, 4"),
    # attention head chunks: whole KV groups (4 heads, MHA: 1, 2 or 4), a count or auto, not with kept outputs
    Case("config/head_chunks_not_whole_kv_groups", pretrain("training.attention_head_chunks=3"),
         "choose one of 1, 2, 4, or auto"),
    Case("config/head_chunks_not_a_count", pretrain("training.attention_head_chunks=half"),
         "expected an integer or auto, got 'half'"),
    Case("config/head_chunks_with_kept_attention",
         pretrain("training.attention_head_chunks=2", "training.activation_checkpointing=true",
                  "training.recompute_attention=false"), "attention_head_chunks=2 with training.recompute_attention"),
    Case("config/micro_batch_zero", pretrain("training.micro_batch_size=0"), "micro_batch_size"),
    Case("config/global_batch_negative", pretrain("training.global_batch_size=-2"), "global_batch_size"),
    Case("config/global_batch_not_divisible", pretrain("training.micro_batch_size=2", "training.global_batch_size=3"),
         "global_batch_size=3"),
    Case("config/no_data", pretrain("data.mock=false"), "data.paths"),
    Case("config/mock_vocab_too_small", pretrain("model.vocab_size=2"), "vocab_size=2"),
    Case("config/run_dir_empty", pretrain("logging.run_dir="), "run_dir is empty"),
    Case("config/checkpoint_load_empty", pretrain("checkpoint.load="), "checkpoint.load is empty"),
    Case("config/layout_larger_than_world", pretrain("parallel.tp=2"), "world size 1"),
    Case("config/sp_larger_than_world", pretrain("parallel.sp=2"), "world size 1"),
    Case("config/pp_larger_than_world", pretrain("parallel.pp=2"), "world size 1"),
    Case("config/seq_len_schedule_not_from_step_0", pretrain("data.seq_len_schedule=[[5, 8], [9, 32]]"),
         "must start at step 0"),
    Case("config/seq_len_schedule_steps_out_of_order", pretrain("data.seq_len_schedule=[[0, 8], [9, 16], [4, 32]]"),
         "strictly increasing"),
    Case("config/seq_len_schedule_shrinks", pretrain("data.seq_len_schedule=[[0, 16], [4, 8], [9, 32]]"),
         "must not decrease"),
    Case("config/seq_len_schedule_not_a_divisor", pretrain("data.seq_len_schedule=[[0, 10], [4, 32]]"),
         "does not divide data.seq_len=32"),
    Case("config/seq_len_schedule_short_of_seq_len", pretrain("data.seq_len_schedule=[[0, 8], [4, 16]]"),
         "data.seq_len=32 is the final length"),
    Case("config/seq_len_schedule_not_pairs", pretrain("data.seq_len_schedule=[[0, 8, 2]]"),
         "[from_step, seq_len] pair"),
    # Megatron-LM's schedule settings
    Case("config/rampup_two_numbers", pretrain("training.rampup_batch_size=[1, 1]"), "[start, increment, samples]"),
    Case("config/rampup_not_reaching_the_batch", pretrain("training.global_batch_size=4",
                                                          "training.rampup_batch_size=[1, 2, 10]"),
         "4 - start a multiple of 2"),
    Case("config/batch_schedule_not_from_0", pretrain("training.batch_size_schedule=[[5, 1], [9, 2]]"),
         "must start at sample 0"),
    Case("config/batch_schedule_not_ending_at_the_batch", pretrain("training.batch_size_schedule=[[0, 1], [9, 4]]"),
         "ends at batch 4"),
    Case("config/two_batch_ramps", pretrain("training.rampup_batch_size=[1, 1, 4]",
                                            "training.batch_size_schedule=[[0, 1], [4, 2]]"), "both set"),
    Case("config/ramp_batch_over_dp", pretrain("training.global_batch_size=4", "training.micro_batch_size=2",
                                               "training.rampup_batch_size=[1, 1, 8]"),
         "global batch 1 is not divisible"),
    Case("config/decay_before_warmup_ends", pretrain("optimizer.decay_steps=5", "optimizer.warmup_steps=5"),
         "decay_steps=5 is not after"),
    Case("config/wsd_decay_longer_than_the_run", pretrain("optimizer.schedule=wsd", "optimizer.warmup_steps=0",
                                                          "optimizer.wsd_decay_steps=3"), "wsd_decay_steps=3"),
    Case("config/wsd_decay_style_unknown", pretrain("optimizer.wsd_decay_style=step"), "optimizer.wsd_decay_style"),
    Case("config/megatron_name_as_key", pretrain("parallel.context_parallel_size=2"), "here parallel.sp"),
    Case("config/megatron_selective_recompute", pretrain("training.recompute_granularity=selective"),
         "recomputes core attention only"),
    Case("config/checkpoint_stride_without_checkpointing", pretrain("training.checkpoint_stride=2"),
         "needs training.activation_checkpointing=true"),
    Case("config/checkpoint_stride_zero", pretrain("training.checkpoint_stride=0"), "training.checkpoint_stride"),
    Case("config/param_offload_without_fsdp", pretrain("training.param_offload=true"), "set parallel.fsdp=true"),
    Case("config/param_offload_with_optimizer_offload", pretrain("training.param_offload=true", "parallel.fsdp=true",
                                                                 "training.optimizer_offload=true"),
         "drop training.optimizer_offload"),
    Case("config/profile_start_without_end", pretrain("profile.start_step=3"), "set profile.end_step too"),
    Case("config/profile_end_before_start", pretrain("profile.start_step=3", "profile.end_step=2"),
         "profile.end_step=2 is before profile.start_step=3"),
    Case("config/profile_rank_outside_the_world", pretrain("profile.start_step=1", "profile.end_step=1",
                                                           "profile.ranks=[0, 2]"), "rank 2 is not in a world of 1"),
]

MACHINE = [
    Case("config/nccl_without_cuda", pretrain("parallel.backend=nccl"), "nccl"),
    Case("config/flash_attention_on_cpu", pretrain("model.attention_backend=flash"), "attention_backend=flash"),
    Case("config/triton_kernels_on_cpu", pretrain("model.kernels=triton"), "model.kernels=triton"),
]

CASES = FILES + OVERRIDES + TYPES + NOT_FINITE + RANGES + RULES + MACHINE
