"""tools/from_megatron.py on command lines written for these tests in the style of NVIDIA's Megatron-LM example
scripts (GPT-3 175B and Llama-3 8B): the script read as bash reads it, Megatron-LM's meaning kept (its defaults,
its arithmetic, the tokenizer's size, a blend by size), what cannot be honoured named, and of the issue's flag
list at least 90% mapped with the same meaning."""
import shutil
import subprocess

import pytest

from megalysses.config.io import load_config
from megalysses.tools.from_megatron import main
from megalysses.tools.megatron_convert import convert
from megalysses.tools.megatron_script import MegatronArgsError, parse_arguments, script_arguments
from tests.fixtures import step_rows

LLAMA3 = r"""#!/bin/bash
# Llama-3 8B shape, Megatron-LM launch script style: $1 checkpoints, $2 TensorBoard logs, $3 the tokenizer
# folder, $4 the dataset prefixes ("MOCK" or left out: mock data)
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

CHECKPOINT_PATH=${1:-"checkpoints/llama3_8b"}
TENSORBOARD_LOGS_PATH=${2:-"tensorboard_logs/llama3_8b"}
TOKENIZER_ARG=${3:-"MOCK"}
DATA_ARG=${4:-"MOCK"}

GPUS_PER_NODE=8
NUM_NODES=4
TP_SIZE=2
CP_SIZE=2
SEQ_LENGTH=8192
GLOBAL_BATCH_SIZE=$(( GPUS_PER_NODE * NUM_NODES / (TP_SIZE * CP_SIZE) * 16 ))
DTYPE="fp8"

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NUM_NODES
    --master_addr ${MASTER_ADDR:-localhost}
)

MODEL_ARGS=(
    --use-mcore-models
    --num-layers 32
    --hidden-size 4096
    --ffn-hidden-size 14336
    --num-attention-heads 32
    --group-query-attention
    --num-query-groups 8
    --kv-channels 128
    --seq-length $SEQ_LENGTH
    --max-position-embeddings $SEQ_LENGTH
    --position-embedding-type rope
    --rotary-base 500000
    --rotary-percent 1.0
    --use-rope-scaling --rope-scaling-factor 8.0
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --swiglu
    --normalization RMSNorm
    --norm-epsilon 1e-5
    --init-method-std 0.0134
    --attention-backend fused
    --apply-layernorm-1p
    --untie-embeddings-and-output-weights
    --disable-bias-linear
    --make-vocab-size-divisible-by 128
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size $GLOBAL_BATCH_SIZE
    --train-samples 2000000
    --lr-decay-samples 1990000
    --lr-warmup-samples 4096
    --lr 0.00015
    --min-lr 0.00001
    --decoupled-lr 5.0e-4      # a higher rate for the embedding and the output layer
    --lr-decay-style cosine
    --clip-grad 1.0
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --adam-eps 1e-8
    --bf16
    --grad-reduce-in-bf16
    --cross-entropy-loss-fusion
    --calculate-per-token-loss
    --manual-gc
    --exit-duration-in-mins 235
    --optimizer-cpu-offload
)

DTYPE_ARGS=()
if [[ "$DTYPE" == "fp8" ]]; then
    DTYPE_ARGS+=("--fp8-format hybrid" "--fp8-amax-history-len 1024")
fi

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size $TP_SIZE
    --context-parallel-size $CP_SIZE
    --cp-comm-type a2a+p2p
    --hierarchical-context-parallel-sizes 1 2
    --sequence-parallel
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
)

DATA_ARGS_LIST=()
if [[ "$TOKENIZER_ARG" == "MOCK" ]] || [[ "$DATA_ARG" == "MOCK" ]] || [[ -z "$TOKENIZER_ARG" ]]; then
    DATA_ARGS_LIST+=("--mock-data" "--tokenizer-type NullTokenizer" "--vocab-size 128256")
else
    DATA_ARGS_LIST+=(
        "--data-path $DATA_ARG"
        "--tokenizer-type HuggingFaceTokenizer"
        "--tokenizer-model $TOKENIZER_ARG"
        "--data-cache-path ${CHECKPOINT_PATH}/index_cache"
        "--eod-mask-loss"
        "--reset-position-ids"
        "--reset-attention-mask"
    )
fi
DATA_ARGS_LIST+=("--split '99,1,0'" --num-workers 2)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 10
    --eval-iters 32
    --eval-interval 500
    --save-interval 1000
    --ckpt-format torch_dist
    --distributed-timeout-minutes 60
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)

if [ ! -f "pretrain_gpt.py" ]; then
    echo "run this from the Megatron-LM checkout"
    exit 1
fi

torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py \
    ${MODEL_ARGS[@]} \
    ${TRAINING_ARGS[@]} \
    ${DTYPE_ARGS[@]} \
    ${MODEL_PARALLEL_ARGS[@]} \
    ${DATA_ARGS_LIST[@]} \
    ${EVAL_AND_LOGGING_ARGS[@]}
"""

GPT3 = r"""#!/bin/bash
# The "175B" GPT-3 shape, Megatron-LM launch script style: $1 checkpoints, $2 TensorBoard logs,
# $3 vocab.json, $4 merges.txt, $5 the dataset prefix
export CUDA_DEVICE_MAX_CONNECTIONS=1
GPUS_PER_NODE=8
NUM_NODES=16
CHECKPOINT_PATH=$1
TENSORBOARD_LOGS_PATH=$2
VOCAB_FILE=$3
MERGE_FILE=$4
DATA_PATH=$5

DISTRIBUTED_ARGS=(--nproc_per_node $GPUS_PER_NODE --nnodes $NUM_NODES --master_addr localhost --master_port 6000)

GPT_MODEL_ARGS=(
    --num-layers 96
    --hidden-size 12288
    --num-attention-heads 96
    --seq-length 2048
    --max-position-embeddings 2048
    --attention-backend auto   # or flash, fused, unfused, local
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 1536
    --step-batch-size-schedule "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536"
    --train-iters 500000
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --init-method-std 0.006
    --clip-grad 1.0
    --fp16
    --lr 6.0e-5
    --lr-decay-style cosine
    --min-lr 6.0e-6
    --lr-warmup-fraction .001
    --lr-decay-iters 430000
    --recompute-granularity full
    --recompute-method uniform
    --recompute-num-layers 1
    --use-flash-attn
    --seed 1234
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 8
    --pipeline-model-parallel-size 16
    --num-layers-per-virtual-pipeline-stage 3
)

DATA_ARGS=(
    --data-path $DATA_PATH
    --vocab-file $VOCAB_FILE
    --merge-file $MERGE_FILE
    --split 949,50,1
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 100
    --save-interval 10000
    --eval-interval 1000
    --save $CHECKPOINT_PATH
    --load $CHECKPOINT_PATH
    --eval-iters 10
    --tensorboard-dir $TENSORBOARD_LOGS_PATH
    --wandb-project gpt3
    --exit-interval 20000
)

torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py \
    ${GPT_MODEL_ARGS[@]} \
    "${TRAINING_ARGS[@]}" \
    ${MODEL_PARALLEL_ARGS[@]} \
    ${DATA_ARGS[@]} \
    ${EVAL_AND_LOGGING_ARGS[@]}
"""

# a Llama-3 8B continued-pretraining variant, as arguments: iteration-based WSD, a batch ramp, FSDP2
VARIANT = ("--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
           "--group-query-attention --num-query-groups 8 --seq-length 8192 --max-position-embeddings 8192 "
           "--position-embedding-type rope --rotary-base 500000 --swiglu --normalization RMSNorm "
           "--untie-embeddings-and-output-weights --disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0 "
           "--micro-batch-size 1 --global-batch-size 256 --rampup-batch-size 64 64 960000 --train-iters 20000 "
           "--lr 3e-5 --min-lr 3e-6 --lr-decay-style WSD --lr-wsd-decay-style minus_sqrt --lr-wsd-decay-iters 4000 "
           "--lr-decay-iters 18000 --lr-warmup-iters 200 --lr-warmup-init 1e-7 --start-weight-decay 0.1 "
           "--end-weight-decay 0.1 --bf16 --recompute-granularity selective --cpu-offloading "
           "--use-torch-fsdp2 --context-parallel-size 4 --cp-comm-type p2p --pipeline-model-parallel-size 2 "
           "--num-layers-per-virtual-pipeline-stage 4 --mock-data --tokenizer-type NullTokenizer --vocab-size 128256 "
           "--load checkpoints/base --finetune --save checkpoints/continued --wandb-project llama3 --seed 7 "
           "--exit-interval 1000").split()

# the issue's acceptance set (97 flags): those of NVIDIA's GPT-3 175B and Llama-3 8B example scripts
ISSUE_FLAGS = """--num-layers --hidden-size --num-attention-heads --ffn-hidden-size --group-query-attention
--num-query-groups --kv-channels --max-position-embeddings --position-embedding-type --rotary-base --rotary-percent
--use-rope-scaling --rope-scaling-factor --normalization --norm-epsilon --init-method-std --apply-layernorm-1p
--swiglu --untie-embeddings-and-output-weights --disable-bias-linear --attention-dropout --hidden-dropout
--make-vocab-size-divisible-by --vocab-size --attention-backend --use-flash-attn --tensor-model-parallel-size
--pipeline-model-parallel-size --num-layers-per-virtual-pipeline-stage --context-parallel-size --cp-comm-type
--hierarchical-context-parallel-sizes --sequence-parallel --use-distributed-optimizer --overlap-grad-reduce
--use-torch-fsdp2 --overlap-param-gather --distributed-timeout-minutes --data-path --split --valid-data-path
--tokenizer-type --tokenizer-model --vocab-file --merge-file --data-cache-path --mock-data --eod-mask-loss
--reset-position-ids --reset-attention-mask --seq-length --micro-batch-size --global-batch-size --rampup-batch-size
--step-batch-size-schedule --train-iters --train-samples --lr --clip-grad --min-lr --weight-decay --adam-beta1
--adam-beta2 --adam-eps --lr-decay-style --lr-decay-iters --lr-warmup-iters --lr-warmup-fraction --lr-warmup-init
--lr-wsd-decay-style --lr-wsd-decay-iters --start-weight-decay --end-weight-decay --decoupled-lr --bf16 --fp16
--fp8-format --grad-reduce-in-bf16 --recompute-granularity --recompute-method --recompute-num-layers
--cpu-offloading --optimizer-cpu-offload --save --save-interval --load --finetune --ckpt-format --exit-interval
--exit-duration-in-mins --seed --log-interval --eval-interval --eval-iters --tensorboard-dir --wandb-project
--calculate-per-token-loss""".split()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A Hugging Face tokenizer folder, GPT-2 vocab.json + merges.txt, two datasets of different sizes."""
    from tokenizers import ByteLevelBPETokenizer

    from test_data_gpt import make_dataset
    from test_data_hf_tokenizer import word_tokenizer

    tmp = tmp_path_factory.mktemp("megatron")
    words = ["<unk>", "<|begin_of_text|>", "<|end_of_text|>"] + [f"w{i}" for i in range(37)]
    word_tokenizer(tmp / "llama_tokenizer", words)
    gpt2 = ByteLevelBPETokenizer()
    gpt2.train_from_iterator(["the cat sat on the mat"] * 20, vocab_size=300, special_tokens=["<|endoftext|>"])
    (tmp / "gpt2").mkdir()
    gpt2.save_model(str(tmp / "gpt2"))
    make_dataset(tmp / "web_text_document", [300] * 50)
    make_dataset(tmp / "code_text_document", [500] * 90)
    (tmp / "pretrain_gpt.py").write_text("")
    return tmp


def llama_args(files):
    return [str(files / "ckpt"), str(files / "tb"), str(files / "llama_tokenizer"),
            f"{files}/web_text_document {files}/code_text_document"]


def gpt3_args(files):
    return [str(files / "ckpt"), str(files / "tb"), str(files / "gpt2" / "vocab.json"),
            str(files / "gpt2" / "merges.txt"), str(files / "web_text_document")]


PASS_ON = 'set -e\ntorchrun pretrain_gpt.py --data-path "$@" --seed $# --save ${HOME}/ck --lr "${LR:-1e-4}"\n'


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash as the reference")
@pytest.mark.parametrize("script,args", [(LLAMA3, llama_args), (GPT3, gpt3_args), (LLAMA3, lambda f: []),
                                         (PASS_ON, lambda f: ["a b", "c"])])
def test_the_script_reads_as_bash_runs_it(files, tmp_path, script, args):
    """bash itself is the reference: torchrun becomes a function that prints what it would pass on."""
    path = tmp_path / "train.sh"
    path.write_text("torchrun() { while [ \"$1\" != pretrain_gpt.py ]; do shift; done; shift; "
                    "printf '%s\\0' \"$@\"; exit 0; }\n" + script)
    out = subprocess.run(["bash", str(path), *args(files)], cwd=files, capture_output=True, check=True).stdout
    expected = [a.strip("'") for a in out.decode().split("\0")[:-1]]
    assert script_arguments(script, args(files)) == expected
    assert {LLAMA3: "--fp8-format", GPT3: "--fp16", PASS_ON: "a b"}[script] in expected


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash as the reference")
def test_an_empty_expansion_leaves_the_next_one_split(tmp_path):
    """An unquoted expansion whose value splits into no word (empty, or whitespace) does not stop the next one in
    the same word from splitting, as in bash."""
    script = 'E=""\nS=" "\nB="x y"\ntorchrun pretrain_gpt.py --data-path $E$B a$S$B --lr 1\n'
    path = tmp_path / "train.sh"
    path.write_text("torchrun() { while [ \"$1\" != pretrain_gpt.py ]; do shift; done; shift; "
                    "printf '%s\\0' \"$@\"; exit 0; }\n" + script)
    out = subprocess.run(["bash", str(path)], capture_output=True, check=True).stdout.decode().split("\0")[:-1]
    assert out == ["--data-path", "x", "y", "a", "x", "y", "--lr", "1"]
    assert script_arguments(script, []) == out


def test_llama3_style_script(files, tmp_path, capsys):
    out = tmp_path / "llama3.yaml"
    script = tmp_path / "train.sh"
    script.write_text(LLAMA3)
    assert main(["--script", str(script), *llama_args(files), "--output", str(out)]) == 1
    text = capsys.readouterr()
    assert not out.exists() and "pass --allow-lossy" in text.err
    for flag in ("--decoupled-lr", "--fp8-format", "--fp8-amax-history-len", "--grad-reduce-in-bf16"):
        assert f"  {flag}: " in text.out.split("left out:")[0]
    assert main(["--script", str(script), *llama_args(files), "--output", str(out), "--allow-lossy"]) == 0
    report = capsys.readouterr().out
    cfg = load_config(out)
    m, p, d, o, t = cfg.model, cfg.parallel, cfg.data, cfg.optimizer, cfg.training
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.ffn_hidden_size) == (32, 4096, 32, 8, 14336)
    assert (m.norm, m.mlp, m.layernorm_1p, m.tie_embeddings, m.attention_bias, m.mlp_bias) == (
        "rmsnorm", "swiglu", True, False, False, False)
    # --attention-backend fused is SDPA, whose ring blocks take no document mask on a GPU: auto (FlexAttention)
    assert (m.rope_theta, m.rope_scaling.type, m.rope_scaling.factor, m.attention_backend, m.head_dim) == (
        500000.0, "llama3", 8.0, "auto", None)
    assert ("model.attention_backend=auto instead of sdpa: model.attention_backend=sdpa: attention backend 'sdpa' "
            "runs ring-attention blocks on CUDA") in report
    assert "on 32 GPUs (8 a node): attention flex" in report and "ulysses 1 x ring 2 (parallel.sp_ring" in report
    assert m.vocab_size == 40 and m.vocab_pad_multiple == 256            # the tokenizer's size; 128 x tp
    assert (p.tp, p.sp, p.sp_ring, p.tp_sequence_parallel, p.timeout_seconds) == (2, 2, 2, True, 3600.0)
    assert d.paths == [f"{files}/web_text_document", f"{files}/code_text_document"] and d.blend_by_size
    assert (d.tokenizer, d.tokenizer_model, d.split, d.seq_len) == (
        "HuggingFaceTokenizer", str(files / "llama_tokenizer"), "99,1,0", 8192)
    assert (d.eod_mask_loss, d.reset_position_ids, d.document_mask) == (True, True, True)
    gbs = 8 * 4 // 4 * 16
    assert (t.global_batch_size, t.train_steps, t.dtype, t.optimizer_offload) == (gbs, 2000000 // gbs, "bfloat16",
                                                                                   True)
    assert (o.decay_steps, o.warmup_steps, o.warmup_init) == (round(1990000 / gbs), 4096 // gbs, 0.0)
    assert (o.lr, o.min_lr, o.weight_decay, o.beta2, o.schedule) == (1.5e-4, 1e-5, 0.1, 0.95, "cosine")
    assert (cfg.checkpoint.dir, cfg.checkpoint.load, cfg.logging.tensorboard_dir) == (
        str(files / "ckpt"), "auto", str(files / "tb"))
    # the blend's shares by size: one epoch of each train split (99% of 50 x 300 and of 90 x 500 tokens)
    web, code = (round(0.99 * 50) * 300 - 1) // 8192, (round(0.99 * 90) * 500 - 1) // 8192
    assert f"web_text_document {100 * web / (web + code):.1f}%" in report
    dry_run(out, 32, tmp_path)


def test_the_readmes_example_runs_as_written(files, tmp_path, capsys, monkeypatch):
    """The README's `--script` command, on a script in the style of the example it names and the test's files for
    its CKPT TB TOKENIZER DATA: it writes the config; without --allow-lossy it lists the same flags and ends in
    the error line the README quotes."""
    import re
    import shlex
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("## Coming from Megatron-LM", 1)[1]
    line = re.search(r"\n    (python tools/from_megatron.py --script .*?)\n(?!        )", section, re.S).group(1)
    argv = shlex.split(line.replace("\\\n", " "))
    script = argv[argv.index("--script") + 1]
    (tmp_path / script).write_text(LLAMA3)
    (tmp_path / "configs").mkdir()
    monkeypatch.chdir(tmp_path)
    at = argv.index("CKPT")
    assert argv[at:at + 4] == ["CKPT", "TB", "TOKENIZER", "DATA"] and "--allow-lossy" in argv, argv
    argv[at:at + 4] = llama_args(files)
    assert argv[:2] == ["python", "tools/from_megatron.py"] and main(argv[2:]) == 0
    report = capsys.readouterr().out
    assert load_config(tmp_path / "configs" / "mine.yaml").model.num_layers == 32
    (tmp_path / "configs" / "mine.yaml").unlink()
    assert main([a for a in argv[2:] if a != "--allow-lossy"]) == 1
    said = capsys.readouterr()
    assert not (tmp_path / "configs" / "mine.yaml").exists()
    for flag in ("--fp8-format", "--fp8-amax-history-len", "--decoupled-lr", "--grad-reduce-in-bf16"):
        assert f"`{flag}`" in section.split("not honoured", 1)[1][:200] and f"  {flag}: " in report
    assert re.match(r"error: \d+ settings cannot be honoured \(above\): configs/mine.yaml not written",
                    said.err.strip()), said.err
    assert "error: N settings cannot be honoured (above): configs/mine.yaml not written" in section


def test_gpt3_style_script(files, tmp_path, capsys):
    out = tmp_path / "gpt3.yaml"
    script = tmp_path / "gpt3.sh"
    script.write_text(GPT3)
    assert main(["--script", str(script), *gpt3_args(files), "--output", str(out), "--allow-lossy"]) == 0
    report = capsys.readouterr().out
    # Megatron-LM's defaults the script leaves to it, named when they cannot be honoured
    for named in ("--fp16:", "--position-embedding-type (left out: Megatron-LM's default): learned_absolute",
                  "--attention-dropout (left out: Megatron-LM's default): dropout 0.1"):
        assert named in report
    cfg = load_config(out)
    m, p, o, t = cfg.model, cfg.parallel, cfg.optimizer, cfg.training
    assert (m.norm, m.mlp, m.tie_embeddings, m.attention_bias, m.mlp_bias, m.ffn_hidden_size) == (
        "layernorm", "gelu", True, True, True, 4 * 12288)                 # GPT-3: Megatron-LM's own defaults
    assert (m.vocab_pad_multiple, m.attention_backend, m.init_std) == (1024, "auto", 0.006)   # --use-flash-attn
    assert "on 128 GPUs (8 a node): attention sdpa" in report           # a plain torch: no flash-attn
    assert (p.tp, p.pp, p.virtual_stages) == (8, 16, 2)                    # 96 layers / (16 stages x 3)
    assert t.batch_size_schedule == [[0, 16], [1171875, 320], [2343750, 624], [3515625, 928], [4687500, 1232],
                                     [5859375, 1536]] and t.global_batch_size == 1536
    assert (t.train_steps, o.decay_steps, o.warmup_steps, o.warmup_init) == (500000, 430000, 430, 0.0)
    assert (t.activation_checkpointing, t.dtype, t.exit_interval, t.eval_interval, t.eval_steps) == (
        True, "bfloat16", 20000, 1000, 10)
    assert (cfg.data.tokenizer, cfg.data.blend_by_size, cfg.data.document_mask) == ("GPT2BPETokenizer", False, False)
    assert (cfg.logging.wandb_project, cfg.logging.wandb_mode, cfg.checkpoint.load) == ("gpt3", "online", "auto")
    # Megatron-LM's 10 minutes bound one collective; the watchdog's bound a whole validation of 10 x 1536 samples
    assert p.timeout_seconds > 600 and "instead of 600 (--distributed-timeout-minutes)" in report
    dry_run(out, 128, tmp_path)


def test_variant_schedule_and_ramp(capsys, tmp_path):
    out = tmp_path / "variant.yaml"
    assert main(["--output", str(out), "--allow-lossy", "--", *VARIANT]) == 0
    cfg = load_config(out)
    o, t, p = cfg.optimizer, cfg.training, cfg.parallel
    assert (o.schedule, o.wsd_decay_style, o.wsd_decay_steps, o.decay_steps, o.warmup_steps, o.warmup_init) == (
        "wsd", "minus_sqrt", 4000, 18000, 200, 1e-7)
    assert (t.rampup_batch_size, t.global_batch_size, t.train_steps, t.exit_interval, t.seed) == (
        [64, 64, 960000], 256, 20000, 1000, 7)
    assert (p.sp, p.sp_ring, p.pp, p.virtual_stages, p.fsdp) == (4, 0, 2, 4, True)     # --cp-comm-type p2p
    assert (cfg.checkpoint.init_from, cfg.checkpoint.dir, o.weight_decay) == ("checkpoints/base",
                                                                              "checkpoints/continued", 0.1)
    assert (t.activation_checkpointing, cfg.logging.wandb_mode) == (False, "online")
    report = capsys.readouterr().out
    assert "--recompute-granularity: selective: recomputes core attention only" in report
    assert "--cpu-offloading:" in report
    # 32 heads, 8 KV heads: Ulysses takes all of cp 4, megalysses' choice (Megatron-LM's p2p is a ring)
    assert "parallel.sp=4, split into Ulysses x ring by megalysses" in report
    assert "parallel.sp=4 runs as ulysses 4 x ring 1 (megalysses' choice)" in report
    dry_run(out, 8, tmp_path)


def dry_run(config, gpus: int, tmp_path) -> None:
    """`pretrain.py --dry-run --gpus N` starts the converted config (wandb, online in the scripts, need not be
    installed here)."""
    from megalysses.tools import pretrain

    assert pretrain.main(["--config", str(config), "--dry-run", "--gpus", str(gpus), "--set",
                          f"logging.run_dir={tmp_path / 'dry'}", "--set", "logging.wandb_mode=disabled"]) == 0


# a Qwen3-style command line: q/k norms, q/k/v biases alone, heads of 128 at hidden 2048, a sliding window, linear
# RoPE scaling; and flags megalysses has no entry for, of each group
QWEN = ("--num-layers 4 --hidden-size 2048 --num-attention-heads 32 --group-query-attention --num-query-groups 4 "
        "--kv-channels 128 --qk-layernorm --add-qkv-bias --disable-bias-linear --swiglu --normalization RMSNorm "
        "--ffn-hidden-size 6144 --position-embedding-type rope --no-position-embedding --rotary-base 1000000 "
        "--rotary-seq-len-interpolation-factor 4 --window-size 4095,0 --untie-embeddings-and-output-weights "
        "--attention-dropout 0 --hidden-dropout 0 --seq-length 4096 --max-position-embeddings 32768 "
        "--micro-batch-size 1 --global-batch-size 8 --train-iters 10 --lr 1e-4 --bf16 --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 151936 --context-parallel-size 8 --attention-backend flash "
        "--recompute-activations --squared-relu --wandb-entity me --non-persistent-save-interval 100 "
        "--rotary-interleaved").split()


def test_qwen_style_flags_and_flags_without_an_entry(tmp_path, capsys):
    conv = convert(parse_arguments(QWEN))
    v = conv.values
    assert (v["model.qk_layernorm"], v["model.add_qkv_bias"], v["model.head_dim"], v["model.sliding_window"]) == (
        True, True, 128, 4096)
    assert (v["model.rope_scaling.type"], v["model.rope_scaling.factor"], v["parallel.sp_ring"]) == ("linear", 4.0, 0)
    assert "--no-position-embedding" in conv.mapped and "--kv-channels" in conv.mapped
    lossy, ignored = conv.lossy, conv.ignored
    assert lossy["--recompute-activations"].startswith("Megatron-LM's older spelling of --recompute-granularity "
                                                       "selective, which recomputes core attention only")
    assert lossy["--squared-relu"] == "squared ReLU is not available: the MLP is SwiGLU or GELU here"
    assert lossy["--non-persistent-save-interval"].startswith("checkpoint format and persistence")
    assert lossy["--rotary-interleaved"] == "Megatron-LM flags megalysses has no equivalent for"
    assert ignored["--wandb-entity"].startswith("logging destinations")
    out = tmp_path / "qwen.yaml"
    assert main(["--output", str(out), "--allow-lossy", "--gpus", "16", "--", *QWEN]) == 0
    report = capsys.readouterr().out
    # 32 heads at cp 8: Ulysses 8 inside a node; --attention-backend flash is auto: without flash-attn, torch's
    # varlen attention takes the window
    assert "on 16 GPUs (8 a node): attention varlen (a sliding window in torch's varlen_attn" in report
    assert "parallel.sp=8 runs as ulysses 8 x ring 1 (megalysses' choice)" in report
    assert load_config(out).model.attention_backend == "auto"
    dry_run(out, 16, tmp_path)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_padded_vocabulary_has_megatron_lms_rows(tp):
    """--padded-vocab-size (Qwen conversions give 152064) is the rows of Megatron-LM's embedding and output layer,
    kept as given (its _set_padded_vocab_size pads only where none is given): the converted config pads the
    tokenizer's vocabulary to those rows, at the script's tp and at every tp that divides them; Megatron-LM's own
    multiple (128 x tp) is kept where it gives the same rows (at tp 2: 151936 pads to 152064)."""
    from megalysses.config import ModelConfig

    rows, argv = 152064, QWEN + ["--padded-vocab-size", "152064", "--tensor-model-parallel-size", str(tp)]
    conv = convert(parse_arguments(argv))
    vocab, multiple = conv.values["model.vocab_size"], conv.values["model.vocab_pad_multiple"]
    assert "--padded-vocab-size" in conv.mapped and "--padded-vocab-size" not in conv.lossy
    megatron = 128 * tp
    assert multiple == (megatron if -(-vocab // megatron) * megatron == rows else rows), (vocab, multiple)
    model = ModelConfig(vocab_size=vocab, vocab_pad_multiple=multiple)
    assert {model.padded_vocab_size(t) for t in (tp, 2 * tp, 4 * tp)} == {rows}
    assert convert(parse_arguments(QWEN)).values["model.vocab_pad_multiple"] == 128      # none given: 128 x tp


def test_yarn_flags_give_megatron_lms_frequencies_and_attention_factor():
    """Megatron-LM's YaRN (--position-embedding-type yarn) with its defaults and with an mscale of its own: the
    attention factor Megatron-LM computes, (1 + 0.1 mscale ln f) / (1 + 0.1 mscale_all_dim ln f), in the config."""
    import math

    from megalysses.config import RopeScalingConfig
    from megalysses.kernels.rope import rope_attention_factor

    base = "--position-embedding-type yarn --rotary-scaling-factor 4".split()
    ln4 = math.log(4)
    for extra, want in (([], 1 + 0.1 * ln4), (["--mscale", "0.5"], 1 + 0.05 * ln4),
                        (["--mscale", "1", "--mscale-all-dim", "0.5"], (1 + 0.1 * ln4) / (1 + 0.05 * ln4))):
        v = convert(parse_arguments(VARIANT + base + extra + ["--yarn-beta-fast", "16",
                                                             "--no-yarn-correction-range-round-to-int"])).values
        scaling = RopeScalingConfig(**{k.split(".")[-1]: x for k, x in v.items() if k.startswith("model.rope_scaling")})
        assert (scaling.type, scaling.factor, scaling.original_max_position_embeddings, scaling.beta_fast,
                scaling.beta_slow, scaling.truncate) == ("yarn", 4.0, 4096, 16.0, 1.0, False)
        assert rope_attention_factor(scaling) == pytest.approx(want, rel=1e-12)


def test_every_unknown_flag_is_named_at_once_and_experts_are_refused(capsys, tmp_path):
    """A mixture-of-experts command line with flags Megatron-LM does not have: one line names the experts and every
    such flag, with the real flag where one is close (a YaRN flag's Megatron-LM spelling), never a misleading one."""
    argv = VARIANT + "--num-experts 8 --moe-router-topk 2 --hiden-size 64 --beta-fast 32 --foo".split()
    assert main(["--output", str(tmp_path / "x.yaml"), "--", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [("error: this is a mixture-of-experts command line (--num-experts 8, --moe-router-topk): megalysses "
                    "trains dense models, so it is not converted; 3 flags that Megatron-LM's pretrain_gpt.py does not "
                    "have: --hiden-size (did you mean --hidden-size?), --beta-fast (did you mean --yarn-beta-fast?), "
                    "--foo: remove them, or convert without them and set the config keys by hand")]
    # a real Megatron-LM flag megalysses does not map is no 'unknown flag' with a guess: it is named for what it is
    conv = convert(parse_arguments(VARIANT + ["--no-position-embedding", "--rotary-interleaved"]))
    assert "--no-position-embedding" in conv.mapped and "--rotary-interleaved" in conv.lossy


def test_at_least_90_percent_of_the_issue_flags_map(files, capsys):
    """Every flag of the list appears in the three command lines and is either mapped (with the same meaning) or
    named; a flag counts as mapped only where every line that gives it maps it."""
    lines = [script_arguments(LLAMA3, llama_args(files)), script_arguments(GPT3, gpt3_args(files)), VARIANT,
             script_arguments(LLAMA3, []) + ["--valid-data-path", str(files / "code_text_document")]]
    results = [(parse_arguments(argv), convert(parse_arguments(argv))) for argv in lines]
    given = {f for g, _ in results for f in g}
    assert set(ISSUE_FLAGS) <= given, set(ISSUE_FLAGS) - given
    mapped, named = set(ISSUE_FLAGS), set()
    for g, conv in results:
        for flag in g:
            assert (flag in conv.mapped) + (flag in conv.lossy) + (flag in conv.ignored) == 1, flag
            if flag not in conv.mapped:
                mapped.discard(flag)
                named.add(flag)
    share = len(mapped & set(ISSUE_FLAGS)) / len(ISSUE_FLAGS)
    print(f"{len(mapped & set(ISSUE_FLAGS))} of {len(ISSUE_FLAGS)} flags map; named: {sorted(named)}")
    assert len(ISSUE_FLAGS) == 97 and share >= 0.9, (share, sorted(named & set(ISSUE_FLAGS)))


@pytest.mark.parametrize("argv,message", [
    (["--num-layers", "2", "--hiden-size", "64"], "does not have: --hiden-size \\(did you mean --hidden-size\\?\\)"),
    (["--num-layers", "two"], "--num-layers: expected an integer, got 'two'"),
    (["--lr", "fast"], "--lr: expected a number, got 'fast'"),
    (["--normalization", "BatchNorm"], "--normalization: 'BatchNorm' is not one of LayerNorm, RMSNorm"),
    (["--num-layers"], "--num-layers needs one value"),
    (["--rampup-batch-size", "16", "16"], "--rampup-batch-size needs three integers"),
    (["--swiglu=yes"], "--swiglu takes no value"),
    (["stray", "--swiglu"], "unexpected argument 'stray'"),
])
def test_unreadable_arguments_name_the_flag(argv, message):
    with pytest.raises(MegatronArgsError, match=message):
        parse_arguments(argv)


@pytest.mark.parametrize("script,message", [
    ("echo hello\n", "never runs pretrain_gpt.py"),
    ("for L in 1 2; do ARGS+=(--num-layers $L); done\ntorchrun pretrain_gpt.py ${ARGS[@]}\n", "line 1: a 'for' block"),
    ("torchrun pretrain_gpt.py --num-layers $(cat layers.txt)\n", "is a command's output"),
    ("X='unclosed\ntorchrun pretrain_gpt.py\n", "unclosed ' quote"),
])
def test_unreadable_scripts_name_the_line(script, message):
    with pytest.raises(MegatronArgsError, match=message):
        script_arguments(script)


def test_the_tool_answers_bad_input_in_one_line(tmp_path, capsys):
    base = ["--output", str(tmp_path / "x.yaml")]
    cases = [(base + ["--", "--num-layers", "2", "--bogus"], "does not have: --bogus"),
             (base, "give either --script FILE or the pretrain_gpt.py arguments after --"),
             (base + ["--script", str(tmp_path / "nope.sh")], "cannot read the script"),
             (base + ["--", *VARIANT[:8]], "--seq-length is missing")]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not (tmp_path / "x.yaml").exists()


def test_a_converted_config_trains(tmp_path, capsys):
    """A small Megatron-LM command line (Llama-style, a batch ramp, WSD) converts to a config pretrain.py runs."""
    import json

    from megalysses.tools import pretrain

    argv = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
            "--seq-length 32 --max-position-embeddings 32 --position-embedding-type rope --swiglu --normalization "
            "RMSNorm --apply-layernorm-1p --untie-embeddings-and-output-weights --disable-bias-linear "
            "--attention-dropout 0 --hidden-dropout 0 --micro-batch-size 1 --global-batch-size 4 "
            "--rampup-batch-size 2 2 4 --train-iters 4 --lr 1e-3 --lr-decay-style WSD --lr-wsd-decay-iters 2 "
            "--lr-warmup-iters 1 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 --eval-iters 0 "
            "--log-interval 1 --attention-backend unfused --profile --use-pytorch-profiler --profile-step-start 2 "
            "--profile-step-end 4").split()
    out, run = tmp_path / "tiny.yaml", tmp_path / "run"
    assert main(["--output", str(out), "--run-dir", str(run), "--", *argv]) == 0
    assert pretrain.main(["--config", str(out), "--set", "parallel.timeout_seconds=60"]) == 0
    rows = step_rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[0]["lr"] == 0.0      # warmup from 0, as Megatron-LM
    assert "global batch 4 from step 3" in capsys.readouterr().out
    # Megatron-LM's torch profiler records steps 2 and 3 of --profile-step-start 2 --profile-step-end 4, on rank 0
    trace = json.loads((run / "profile" / "rank0.steps2-3.pt.trace.json").read_text())
    ranges = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("step ")}
    assert ranges == {"step 2", "step 3"} and any(e.get("name") == "aten::mm" for e in trace["traceEvents"])


def test_profile_flags_map_with_the_torch_profiler_only():
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "4",
            "--train-iters", "4", "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "128"]
    window = ["--profile-step-start", "10", "--profile-step-end", "12", "--profile-ranks", "0", "3"]
    conv = convert(parse_arguments(base + ["--profile", "--use-pytorch-profiler"] + window))
    assert {k: v for k, v in conv.values.items() if k.startswith("profile.")} == {
        "profile.start_step": 10, "profile.end_step": 11, "profile.ranks": [0, 3]}
    assert {"--profile", "--use-pytorch-profiler", "--profile-step-start", "--profile-ranks"} <= set(conv.mapped)
    nsys = convert(parse_arguments(base + ["--profile"] + window))       # an nsys capture range in Megatron-LM
    assert not any(k.startswith("profile.") for k in nsys.values)
    assert "nsys capture range" in nsys.ignored["--profile"] and "--profile-step-end" in nsys.ignored
    assert "profiles nothing" in convert(parse_arguments(base + window)).ignored["--profile-ranks"]
    with pytest.raises(MegatronArgsError, match="--profile-step-end 10 is not after --profile-step-start 10"):
        convert(parse_arguments(base + ["--profile", "--use-pytorch-profiler", "--profile-step-start", "10",
                                        "--profile-step-end", "10"]))
