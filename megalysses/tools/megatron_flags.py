"""The flags of Megatron-LM's training argument parser (megatron/training/arguments.py, read by pretrain_gpt.py),
releases core_v0.12.0 to core_v0.19.0 and the main branch of 2026, by how many values each takes: data, for
tools/from_megatron.py to tell a Megatron-LM flag that megalysses does not map from one that Megatron-LM does not
have, to read past its values, and to say what kind of flag it is. Names without their leading "--".

    megatron_flag_arity("--num-experts")      # "value"; "switch", "values" (one or more), None: not a flag
    flag_group("--num-experts")               # "moe"; "checkpoint", "logging" or "other"
"""
from __future__ import annotations

from typing import Optional

_SWITCHES = """
account-for-embedding-in-pipeline-split account-for-loss-in-pipeline-split accumulate-allreduce-grads-in-fp32
add-qkv-bias adlr-autoresume allow-ambiguous-pad-tokens apply-layernorm-1p apply-query-key-layer-scaling
apply-residual-connection-post-layernorm apply-wd-to-qk-layernorm async-ckpt-use-cpu-shm async-save
attention-output-gate attention-softmax-in-fp32 auto-detect-ckpt-format batch-invariant-mode bert-no-binary-head
bf16 biencoder-shared-query-context-model cache-mla-latents calc-ft-timeouts calculate-per-token-loss
check-for-large-grads check-for-spiky-loss checkpoint-activations ckpt-assume-constant-structure
ckpt-convert-update-legacy-dist-opt-format ckpt-drop-redundant-extra-state ckpt-fully-parallel-load
ckpt-fully-parallel-load-per-rank-objects ckpt-fully-parallel-save ckpt-pg-tensors-cache-create
cpu-offloading-retain-pinned-cpu-buffers create-all-gather-group cross-entropy-loss-fusion data-parallel-random-init
dataloader-defer-npy-index-mmap dataloader-fast-cache-load dataloader-inter-document-masking
ddp-average-in-collective ddp-pad-buckets-for-high-nccl-busbw ddp-reduce-scatter-with-fp32-accumulation
decode-only-cuda-graphs decrease-batch-size-if-needed defer-embedding-wgrad-compute delay-offload-until-cuda-graph
delay-wgrad-compute deterministic-mode dino-norm-last-layer disable-align-grad-reduce
disable-async-tensor-model-parallel-allreduce disable-bf16-reduced-precision-matmul disable-bias-linear
disable-chunked-prefill disable-ckpt-fully-parallel-save disable-ckpt-load-validate-sharding-integrity
disable-clone-scatter-output-in-embedding disable-dsa-indexer-rotate-activation disable-dsa-indexer-scoring-relu
disable-flight-recorder-dump-on-timeout disable-flight-recorder-extra-dump-on-exec
disable-flight-recorder-include-only-active disable-fp8-wgrad disable-gloo-process-groups disable-jit-fuser
disable-log-loss-scale-to-tensorboard disable-mamba-mem-eff-path disable-manual-gc-eval disable-msc
disable-pad-vocab-size disable-save-tokenizer-assets disable-straggler-on-startup disable-stream-ckpt-dequant
disable-strict-fsdp-dtensor-load disable-symmetric-registration
disable-tokenizer-sentencepiece-ignore-extra-whitespaces disable-tp-comm-bulk-dgrad disable-tp-comm-bulk-wgrad
disable-tp-comm-overlap-ag disable-tp-comm-overlap-rs disable-tp-comm-split-ag disable-tp-comm-split-rs
disable-use-tokenizer-model-from-checkpoint-args dist-ckpt-optim-fully-reshardable dist-ckpt-save-pre-mcore-014
distrib-optim-fully-reshardable-mem-efficient distribute-saved-activations dsa-indexer-k-norm-fp32
dsa-indexer-rope-interleaved dsa-indexer-use-sparse-loss enable-chunked-prefill enable-cuda-graph
enable-experimental enable-ft-package enable-full-sharding-in-hsdp enable-mhc-connections enable-msc eod-mask-loss
ep-overlap-early-attn-memory-release exit-on-missing-checkpoint exit-signal-handler
exit-signal-handler-for-dataloader exit-signal-handler-for-training external-cuda-graph fake-process-group fim-data
fine-grained-activation-offloading finetune first-last-layers-bf16 flash-decode flight-recorder-include-stack-trace
fp16 fp16-lm-cross-entropy fp32-residual-connection fp4-param-gather fp8-output-proj fp8-param-gather
freeze-all-layers fsdp-db-use-persist-buf-on-alloc-fail fsdp-double-buffer fsdp-manual-registration full-validation
fused-residual-rmsnorm gdp-cutedsl-kernel grad-reduce-in-bf16 group-query-attention
grpo-filter-groups-with-same-reward gtp-expert-remat-nccl-ub gtp-remat-nccl-ub
gtp-remat-reduce-scatter-with-fp32-accumulation help high-priority-a2a-comm-stream hybrid-context-parallel
inference-cuda-graph-all-prefills inference-disable-ep-consensus inference-disable-triton-nvls-kernels
inference-dynamic-batching inference-dynamic-batching-prefix-caching
inference-dynamic-batching-track-generated-token-events inference-dynamic-batching-track-paused-request-events
inference-fuse-tp-communication inference-moe-disable-fused-quant-kernels inference-rng-tracker
inference-text-gen-server-logging inference-use-synchronous-zmq-collectives inference-wandb-logging
init-method-xavier-uniform init-model-with-meta-device inprocess-empty-cuda-cache inprocess-restart is-hybrid-model
keep-fp8-transpose-cache keep-fp8-transpose-cache-when-using-custom-fsdp langrl-external-server lazy-mpu-init
legacy-tokenizer load-main-params-from-ckpt load-model-opt-format log-device-memory-used log-energy
log-max-attention-logit log-memory-to-tensorboard log-num-zeros-in-grad log-params-norm log-progress log-straggler
log-throughput log-timers-to-tensorboard log-validation-ppl-to-tensorboard log-world-size-to-tensorboard
logits-load-ignore-errors manual-gc megatron-fsdp-enable-fine-grained-param-gather
megatron-fsdp-max-pool-double-buffer mla-down-proj-fusion mock-data moe-apply-probs-on-input moe-enable-deepep
moe-enable-routing-replay moe-extended-tp moe-grouped-gemm moe-hybridep-pad-uneven-dispatch-inputs
moe-layer-recompute moe-ncclep-static-shape moe-ncclep-zero-copy moe-pad-expert-input-to-capacity
moe-pad-experts-for-cuda-graph-inference moe-paged-stash moe-per-layer-logging moe-permute-fusion
moe-permute-fusion-into-hybridep moe-router-enable-expert-bias moe-router-force-load-balancing moe-router-fusion
moe-router-padding-for-fp8 moe-router-padding-for-quantization moe-router-pre-softmax
moe-routing-trace-capture-hidden-states moe-routing-trace-capture-logits moe-routing-trace-dump-weights
moe-shared-expert-gate moe-shared-expert-overlap moe-single-grouped-bias moe-single-grouped-weight
moe-use-grouped-tensor moe-use-legacy-grouped-gemm moe-use-upcycling mtp-detach-heads mtp-hsm mtp-standalone
mtp-use-repeated-layer multi-latent-attention multiple-validation-sets muon-nesterov muon-no-split-qkv
muon-use-nesterov muon-use-syrk nccl-all-reduce-for-prefill no-align-grad-reduce no-align-param-gather
no-async-tensor-model-parallel-allreduce no-barrier-with-level-1-timing no-bias-dropout-fusion no-bias-gelu-fusion
no-bias-swiglu-fusion no-check-for-nan-in-loss-and-grad no-ckpt-fully-parallel-save
no-ckpt-load-validate-sharding-integrity no-clone-scatter-output-in-embedding no-create-attention-mask-in-dataloader
no-data-sharding no-dsa-indexer-rotate-activation no-dsa-indexer-scoring-relu no-flight-recorder-dump-on-timeout
no-flight-recorder-extra-dump-on-exec no-flight-recorder-include-only-active no-fp8-wgrad
no-gradient-accumulation-fusion no-gradient-reduce-div-fusion no-inference-disable-ep-consensus
no-inference-dynamic-batching-prefix-caching no-inference-text-gen-server-logging
no-inference-use-synchronous-zmq-collectives no-inference-wandb-logging no-initialization no-langrl-external-server
no-load-optim no-load-rng no-log-loss-scale-to-tensorboard no-manual-gc-eval no-masked-softmax-fusion
no-mmap-bin-files no-one-logger no-overlap-p2p-communication no-pad-vocab-size no-persist-layer-norm
no-pin-cpu-grads no-pin-cpu-params no-position-embedding no-rl-inference-logprobs-is-correction
no-rl-offload-inference-model-weights-when-idle no-rl-offload-kv-cache-during-training no-rl-partial-rollouts
no-rl-persist-cuda-graphs no-rl-remove-kv-cache-during-training no-rl-reset-cuda-graphs no-rl-skip-bos-token
no-rl-training-cuda-graphs no-rl-use-sequence-packing no-rl-verify-model-weights-swap no-rope-fusion no-save-optim
no-save-rng no-save-tokenizer-assets no-scatter-gather-tensors-in-pipeline no-stream-ckpt-dequant
no-strict-fsdp-dtensor-load no-tokenizer-sentencepiece-ignore-extra-whitespaces no-tp-comm-bulk-dgrad
no-tp-comm-bulk-wgrad no-tp-comm-overlap-ag no-tp-comm-overlap-rs no-tp-comm-split-ag no-tp-comm-split-rs
no-use-layer-wise-param-layout no-use-tokenizer-model-from-checkpoint-args no-yarn-correction-range-round-to-int
nvtx-ranges one-logger-async openai-gelu optimizer-cpu-offload optimizer-cuda-graph otel-enabled
output-bert-embeddings overlap-cpu-optimizer-d2h-h2d overlap-dispatch-backward-with-experts-wgrad
overlap-grad-reduce overlap-moe-expert-parallel-comm overlap-p2p-communication-warmup-flush overlap-param-gather
overlap-param-gather-with-optimizer-step override-opt-param-scheduler override-opt_param-scheduler perform-rl-step
profile pytorch-profiler-collect-callstack pytorch-profiler-collect-chakra pytorch-profiler-collect-shapes qk-clip
qk-l2-norm qk-layernorm quick-geglu recompute-activations record-memory-history record-shapes replication
reset-attention-mask reset-position-ids retriever-score-scaling retro-add-retriever retro-no-verify-neighbor-count
reuse-grad-buf-for-mxfp8-param-ag rl-durable-rollout-bank rl-inference-logprobs-is-correction
rl-offload-inference-model-weights-when-idle rl-offload-kv-cache-during-training
rl-offload-optimizer-during-inference rl-partial-rollouts rl-persist-cuda-graphs rl-profile
rl-remove-kv-cache-during-training rl-reset-cuda-graphs rl-skip-bos-token rl-training-cuda-graphs
rl-use-sequence-packing rl-verify-model-weights-swap rotary-interleaved run-workload-inspector-server
sequence-parallel sft skip-train squared-relu swiglu te-rng-tracker test-mode tokenizer-hf-include-special-tokens
tokenizer-hf-no-include-special-tokens tokenizer-hf-no-use-fast tokenizer-hf-use-fast tokenizer-sentencepiece-legacy
torch-fsdp2-no-reshard-after-forward tp-comm-overlap tp-comm-overlap-rs-dgrad trust-remote-code
untie-embeddings-and-output-weights use-checkpoint-args use-checkpoint-opt-param-scheduler
use-checkpoint-opt_param-scheduler use-cpu-initialization use-custom-fsdp use-dist-ckpt use-distributed-optimizer
use-flash-attn use-fused-weighted-squared-relu use-gigatoken use-grouped-gemm-for-dense-mlp
use-grouped-gemm-for-shared-expert use-kitchen-attention use-legacy-models use-legacy-static-engine use-mcore-models
use-megatron-fsdp use-mp-args-from-checkpoint-args use-mup use-nccl-ub use-one-sent-docs use-persistent-ckpt-worker
use-precision-aware-optimizer use-pytorch-profiler use-ring-exchange-p2p use-rope-scaling
use-rotary-position-embeddings use-same-sampling-seed-across-dp-ranks use-sharp use-te-activation-func
use-torch-fsdp2 use-torch-optimizer-for-cpu-offload use-tp-pp-dp-mapping use-transformer-engine-op-fuser
verify-integrity vision-pretraining yarn-correction-range-round-to-int
"""
_VALUE = """
activation-func-clamp-value activation-offload-fraction adam-beta1 adam-beta2 adam-eps adlr-autoresume-interval
app-tag-run-name app-tag-run-version async-ckpt-cpu-priority async-ckpt-io-priority async-strategy attention-backend
attention-dropout batch-invariant-backend batch-size bert-embedder-type bert-load biencoder-projection-dim
block-data-path chat-template check-weight-hash-across-dp-replicas-interval ckpt-convert-format ckpt-convert-save
ckpt-format ckpt-fully-parallel-load-exchange-algo ckpt-fully-parallel-load-process-group
ckpt-fully-parallel-save-process-group ckpt-pg-tensors-cache-path ckpt-step classes-fraction clip-grad
config-logger-dir context-parallel-size cpu-offloading-num-layers cross-entropy-fusion-impl cuda-graph-impl
cuda-graph-warmup-steps data-args-path data-cache-path data-parallel-sharding-strategy data-per-class-fraction
dataloader-type ddp-bucket-size ddp-num-buckets decoder-first-pipeline-num-layers decoder-last-pipeline-num-layers
decoder-num-layers decoder-seq-length decoupled-lr decoupled-min-lr delta-offload-bytes-across-pp-ranks
dino-bottleneck-size dino-freeze-last-layer dino-head-hidden-size dino-local-crops-number dino-local-img-size
dino-teacher-temp dino-warmup-teacher-temp dino-warmup-teacher-temp-epochs dist-ckpt-format dist-ckpt-strictness
dist-ckpt-workers distributed-backend distributed-timeout-minutes distributed-timeout-seconds-after-init
dsa-indexer-head-dim dsa-indexer-k-norm-epsilon dsa-indexer-loss-coeff dsa-indexer-n-heads
dsa-indexer-skip-topk-offset dsa-indexer-topk dsa-indexer-topk-freq dsa-kernel-backend dump-param-to-param-group-map
embedding-init-method-std embedding-path empty-unused-memory-level encoder-num-layers
encoder-pipeline-model-parallel-size encoder-seq-length encoder-tensor-model-parallel-size end-weight-decay
error-injection-rate error-injection-type eval-global-batch-size eval-interval eval-iters eval-micro-batch-size
evidence-data-path exit-duration-in-mins exit-interval exit-signal exp-avg-dtype exp-avg-sq-dtype
experimental-attention-variant expert-model-parallel-size expert-tensor-parallel-num-weight-shards
expert-tensor-parallel-size fault-injector-delay-start-iteration fault-injector-fault-delay
fault-injector-fault-probabilities fault-injector-fault-types fault-injector-mtti-seconds fault-injector-num-ranks
fault-injector-offset-seconds fault-injector-ranks fault-injector-seed ffn-hidden-size fim-eod-token
fim-fragment-rate fim-middle-token fim-no-prefix fim-pad-token fim-prefix-token fim-rate fim-split-sample
fim-spm-rate fim-suffix-token fine-grained-offloading-max-inflight-offloads flash-attention-version
flight-recorder-dump-path flight-recorder-trace-buffer-size fp4-format fp4-quantizer-factory fp4-recipe
fp8-amax-compute-algo fp8-amax-history-len fp8-format fp8-interval fp8-margin fp8-quantizer-factory fp8-recipe
ft-num-warmup-iters gdp-num-chunk-states-to-recompute gdp-num-householder global-batch-size glu-linear-offset
gpu-sniff-test-interval grpo-clamp-eps-lower grpo-clamp-eps-upper grpo-entropy-term-weight grpo-group-size
grpo-iterations grpo-kl-beta grpo-prompts-per-step head-lr-mult heterogeneous-layers-config-encoded-json
heterogeneous-layers-config-path hidden-dropout hidden-size hybrid-attention-ratio hybrid-layer-pattern
hybrid-mlp-ratio hybrid-override-pattern hysteresis ict-head-size ict-load img-h img-w indexer-batch-size
indexer-log-interval inference-batch-times-seqlen-threshold inference-coordinator-port
inference-cuda-graph-max-tokens inference-cuda-graph-scope inference-dynamic-batching-async-sched-mode
inference-dynamic-batching-block-size inference-dynamic-batching-buffer-guaranteed-fraction
inference-dynamic-batching-buffer-overflow-factor inference-dynamic-batching-buffer-size-gb
inference-dynamic-batching-chunk-size inference-dynamic-batching-cuda-graph-max-tokens
inference-dynamic-batching-cuda-graph-mixed-prefill-count inference-dynamic-batching-cuda-graph-sizing-distribution
inference-dynamic-batching-logprobs-mode inference-dynamic-batching-mamba-memory-ratio
inference-dynamic-batching-max-requests inference-dynamic-batching-max-requests-override
inference-dynamic-batching-max-tokens inference-dynamic-batching-max-tokens-override
inference-dynamic-batching-num-cuda-graphs inference-dynamic-batching-paused-buffer-size-gb
inference-dynamic-batching-prefix-caching-coordinator-policy
inference-dynamic-batching-prefix-caching-eviction-policy inference-dynamic-batching-prefix-caching-mamba-gb
inference-dynamic-batching-prefix-caching-routing-alpha inference-dynamic-batching-sampling-backend
inference-dynamic-batching-unified-memory-level inference-grouped-gemm-backend inference-logging-step-interval
inference-max-batch-size inference-max-requests inference-max-seq-length inference-moe-token-dispatcher-type
inference-shards init-method-std initial-loss-scale inprocess-active-world-size inprocess-barrier-timeout
inprocess-completion-timeout inprocess-granularity inprocess-hard-timeout inprocess-heartbeat-interval
inprocess-heartbeat-timeout inprocess-last-call-wait inprocess-max-iterations inprocess-monitor-process-interval
inprocess-monitor-thread-interval inprocess-progress-watchdog-interval inprocess-soft-timeout
inprocess-termination-grace-time iter-per-epoch kitchen-attention-backend kitchen-config-file kitchen-recipe-number
kv-channels kv-lora-rank langrl-env-config langrl-inference-server-conversation-template
langrl-inference-server-type linear-attention-freq linear-conv-kernel-dim linear-key-head-dim linear-num-key-heads
linear-num-value-heads linear-value-head-dim lion-beta1 lion-beta2 load local-rank log-interval log-memory-interval
logging-level logits-load-decode-threads logits-load-dir logits-load-kd-loss-alpha logits-load-msc-prefetch-depth
logits-load-prefetch-factor logits-save-dir logits-save-dtype logits-save-top-k logits-save-top-p
logits-save-top-p-min-k loss-scale loss-scale-window lr lr-decay-iters lr-decay-samples lr-decay-style
lr-warmup-fraction lr-warmup-init lr-warmup-iters lr-warmup-samples lr-wsd-decay-iters lr-wsd-decay-samples
lr-wsd-decay-style main-grads-dtype main-params-dtype make-vocab-size-divisible-by mamba-head-dim
mamba-inference-conv-states-dtype mamba-inference-ssm-states-dtype mamba-num-groups mamba-num-heads mamba-state-dim
mamba-training-ssm-states-dtype manual-gc-interval mask-factor mask-prob mask-type max-position-embeddings
max-seqlen-per-dp-cp-rank max-tokens-to-oom megatron-fsdp-grad-comm-dtype megatron-fsdp-main-grads-dtype
megatron-fsdp-main-params-dtype megatron-fsdp-version memory-snapshot-path merge-file mhc-init-gating-factor
mhc-num-residual-streams mhc-recompute-layer-num mhc-sinkhorn-iterations micro-batch-size
microbatch-group-size-per-virtual-pipeline-stage mid-level-dataset-surplus min-loss-scale min-lr
min-offloaded-tensor-size mlp-chunks-for-prefill mlp-chunks-for-training model-parallel-size moe-combine-bwd-dtype
moe-deepep-num-sms moe-dispatch-fwd-dtype moe-expert-capacity-factor moe-expert-rank-capacity-factor
moe-ffn-hidden-size moe-flex-dispatcher-backend moe-flex-dispatcher-num-sms moe-hybridep-num-blocks-permute
moe-hybridep-num-blocks-unpermute moe-hybridep-num-sms moe-hybridep-num-sms-preprocessing moe-input-jitter-eps
moe-latent-size moe-layer-freq moe-mlp-glu-interleave-size moe-paged-stash-buffer-size-factor-cpu
moe-paged-stash-buffer-size-factor-cuda moe-paged-stash-page-size moe-router-bias-update-rate moe-router-dtype
moe-router-force-biased moe-router-group-topk moe-router-num-groups moe-router-quantile-balancing-ema
moe-router-score-function moe-router-topk moe-router-topk-scaling-factor moe-routing-trace-max-training-iters
moe-routing-trace-path moe-shared-expert-glu-interleave-size moe-shared-expert-intermediate-size
moe-token-dispatcher-type moe-token-drop-policy moe-upcycling-granularity moe-z-loss-coeff mscale mscale-all-dim
mtp-hybrid-override-pattern mtp-loss-scaling-factor mtp-num-layers muon-coefficient-type muon-extra-scale-factor
muon-fp32-matmul-prec muon-momentum muon-num-ns-steps muon-scalar-optimizer muon-scale-mode muon-tp-mode
mup-attn-scale-power mup-base-head-dim mup-base-hidden-size mup-embedding-mult mup-output-mult mup-width-mult
nccl-communicator-config-path no-rope-freq no-weight-decay-cond-type non-persistent-ckpt-type
non-persistent-global-ckpt-dir non-persistent-local-ckpt-algo non-persistent-local-ckpt-dir
non-persistent-save-interval norm-epsilon normalization null-tokenizer-eod-id null-tokenizer-pad-id
num-attention-heads num-channels num-classes num-dataset-builder-threads num-distributed-optimizer-instances
num-experts num-layers num-layers-at-end-in-bf16 num-layers-at-start-in-bf16 num-layers-per-virtual-pipeline-stage
num-query-groups num-speculative-tokens num-virtual-stages-per-pipeline-rank num-workers object-storage-cache-path
one-logger-project one-logger-run-name onnx-safe optimizer optimizer-offload-fraction otel-service-name
otel-span-groups outer-dp-sharding-strategy output-logit-dtype override-ckpt-iteration padded-vocab-size patch-dim
per-dataset-sequences-path per-split-data-args-path persistent-save-interval phase-transition-iterations
pipeline-model-parallel-comm-backend pipeline-model-parallel-layout pipeline-model-parallel-size
pipeline-model-parallel-split-rank position-embedding-type pretrained-checkpoint profile-step-end profile-step-start
q-lora-rank qk-clip-alpha qk-clip-threshold qk-head-dim qk-pos-emb-head-dim query-in-block-prob
recompute-granularity recompute-method recompute-num-layers refit-method relative-attention-max-distance
relative-attention-num-buckets replication-factor replication-jump rerun-mode result-rejected-tracker-filename
retriever-seq-length retro-attention-gate retro-cyclic-train-iters retro-encoder-attention-dropout
retro-encoder-hidden-dropout retro-encoder-layers retro-num-neighbors retro-num-retrieved-chunks retro-project-dir
rl-consumption-granularity rl-default-temperature rl-default-top-k rl-default-top-p rl-generation-lag
rl-importance-sampling-truncation-coef rl-inference-expert-model-parallel-size
rl-inference-expert-tensor-model-parallel-size rl-inference-model-unified-memory-level
rl-inference-pipeline-model-parallel-size rl-inference-tensor-model-parallel-size rl-kv-cache-management-mode
rl-max-inflight-requests rl-parallel-generation-tasks rl-profile-dir rl-prompts-per-eval rl-rollout-bank-dir
rl-rollout-bank-max-bytes rl-sequence-packing-algo rl-sequence-packing-max-sequences-per-bin
rl-submission-granularity rope-scaling-factor rope-type rotary-base rotary-percent rotary-scaling-factor
rotary-seq-len-interpolation-factor s3-cache-path sample-rate save save-activations-interval save-dgrads-interval
save-interval save-params-interval save-retain-interval save-tokens-per-expert-interval save-wgrads-interval seed
seq-length sft-tokenizer-prompt-format sgd-momentum sharp-enabled-group short-seq-prob softmax-type split
start-eval-at-iter start-weight-decay step-batch-size-schedule straggler-ctrlr-port straggler-minmax-count
suggested-communication-unit-size swin-backbone-type symmetric-ar-type te-precision-config-file
tensor-model-parallel-size tensor-parallel-num-weight-shards tensorboard-dir tensorboard-log-interval
tensorboard-queue-size tiktoken-num-special-tokens tiktoken-pattern timing-log-level timing-log-option
titles-data-path tokenizer-metadata tokenizer-model tokenizer-type tp-comm-bootstrap-backend tp-comm-overlap-cfg
train-iters train-samples train-sync-interval transformer-impl v-head-dim vision-backbone-type
vision-pretraining-type vocab-extra-ids vocab-file vocab-size wandb-entity wandb-exp-name wandb-project
wandb-save-dir warmup weight-decay weight-decay-incr-style wgrad-deferral-limit window-attn-skip-freq window-size
yaml-cfg yarn-beta-fast yarn-beta-slow yarn-original-max-position-embeddings
"""
_VALUES = """
cp-comm-type cuda-graph-modules cuda-graph-scope data-path ddp-param-name-patterns-for-fp32-local-accumulation
gtp-remat-opt-in-modules hierarchical-context-parallel-sizes high-priority-stream-groups iterations-to-skip
moe-aux-loss-coeff moe-router-load-balancing-type mrope-section offload-modules profile-ranks rampup-batch-size
recompute-modules retriever-report-topk-accuracies rl-inference-parsers spec test-data-path tiktoken-special-tokens
tokenizer-special-tokens train-data-path valid-data-path validation-set-names
"""
_ARITY = {f"--{name}": kind for kind, names in (("switch", _SWITCHES), ("value", _VALUE), ("values", _VALUES))
          for name in names.split()}


GROUPS = {"moe": "mixture of experts (megalysses trains dense models)",
          "checkpoint": "checkpoint format and persistence (megalysses writes torch.distributed.checkpoint "
                        "checkpoints of its own: checkpoint.*)",
          "logging": "logging destinations (megalysses logs to stdout, metrics.jsonl, TensorBoard and Weights & "
                     "Biases: logging.*)",
          "other": "Megatron-LM flags megalysses has no equivalent for"}
"""What each group of flags is, as tools/from_megatron.py names them."""

_CHECKPOINT = ("ckpt", "checkpoint", "--save", "--load", "--no-save", "--no-load", "--async-save", "--non-persistent",
               "--use-persistent", "--exit-on-missing")
_LOGGING = ("--wandb", "--tensorboard", "--log-", "--no-log-", "--logging", "--one-logger", "--enable-one-logger",
            "--timing-log", "--record-memory-history", "--memory-snapshot-path", "--app-tag", "--straggler",
            "--disable-straggler", "--log_")


def flag_group(flag: str) -> str:
    """The group of a Megatron-LM flag (a key of GROUPS): its mixture-of-experts flags, its checkpoint format and
    persistence options, its logging destinations, or another flag."""
    name = flag.removeprefix("--")
    if "moe" in name.split("-") or "expert" in name or name.startswith("moe-"):
        return "moe"
    if flag in ("--checkpoint-activations",):
        return "other"
    if any(flag.startswith(p) if p.startswith("--") else p in name for p in _CHECKPOINT):
        return "checkpoint"
    if any(flag.startswith(p) for p in _LOGGING):
        return "logging"
    return "other"


def megatron_flags() -> list[str]:
    """Every flag of the table."""
    return list(_ARITY)


def megatron_flag_arity(flag: str) -> Optional[str]:
    """How many values Megatron-LM's parser reads after `flag`: "switch" (none), "value" (one), "values" (one or
    more); None when no release of Megatron-LM has the flag."""
    return _ARITY.get(flag)
