#!/usr/bin/env bash
# The container command of every pod of examples/kubernetes/pretrain.yaml: runs this node's torchrun and
# turns the kubelet's SIGTERM (preemption, eviction, node drain, kubectl delete pod) into a checkpoint.
#
#     bash examples/kubernetes/torchrun_pod.sh CONFIG.yaml [--set section.key=value ...]
#
# Environment: NNODES (the Job's parallelism), NPROC_PER_NODE (default gpu: one process per GPU),
# RDZV_ENDPOINT (pod 0 and a port, host:port, through the headless Service), RDZV_ID (default megalysses),
# RETRY_EXIT_CODE (default 75: the exit code the Job's podFailurePolicy ignores).
#
# The kubelet signals this script alone (PID 1 of the container); the training processes run in
# sessions of their own below torchrun and never see it. torchrun itself must not act on SIGTERM (it would
# stop the workers itself and exit 1), so it starts with SIGTERM ignored (--signals-to-handle keeps it from
# taking it back) and this script passes SIGTERM to torchrun's workers. They finish the step, save a
# checkpoint together with every other rank of the job (all ranks agree on stopping after each step, so one
# preempted pod stops them all) and exit 0. The pod then exits with
#   0                once the run has trained all its steps (examples/kubernetes/finished.py): the index is done;
#   RETRY_EXIT_CODE  when torchrun exited 0 before that, on the signalled pod and on every other: the Job
#                    starts those indices again (the podFailurePolicy ignores this code, so it is not counted
#                    against backoffLimit) and the run resumes from `latest`;
#   torchrun's own status otherwise: a failure, counted against backoffLimit.
set -u
CONFIG=${1:?usage: bash examples/kubernetes/torchrun_pod.sh CONFIG.yaml [--set section.key=value ...]}
RETRY=${RETRY_EXIT_CODE:-75}
: "${NNODES:?set NNODES to the number of pods, the parallelism of the Job}"
: "${RDZV_ENDPOINT:?set RDZV_ENDPOINT to host:port of pod 0, e.g. megalysses-0.megalysses:29500}"

# nothing to save before torchrun starts: a stop now is a plain retry (PID 1 ignores a signal it has no trap for)
trap 'echo "torchrun_pod.sh: SIGTERM before training started"; exit "$RETRY"' TERM
host=${RDZV_ENDPOINT%:*}
until getent hosts "$host" > /dev/null; do      # pod 0's DNS name exists once pod 0 does
    echo "torchrun_pod.sh: waiting for $host to resolve"
    sleep 2
done
echo "$(date -Is) pod ${JOB_COMPLETION_INDEX:-?} of $NNODES: torchrun with rendezvous at $RDZV_ENDPOINT, config $CONFIG"

trap '' TERM
torchrun --nnodes="$NNODES" --nproc-per-node="${NPROC_PER_NODE:-gpu}" \
    --rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="${RDZV_ID:-megalysses}" \
    --signals-to-handle=SIGINT,SIGHUP,SIGQUIT \
    pretrain.py --config "$@" &
launcher=$!

forward() {
    local pid
    echo "$(date -Is) torchrun_pod.sh: SIGTERM: asking the training processes to checkpoint and stop"
    for pid in $(cat /proc/"$launcher"/task/*/children 2>/dev/null); do
        kill -s TERM "$pid" 2>/dev/null
    done
}
trap forward TERM

# wait returns early (status > 128) whenever a trapped signal arrives: wait again until torchrun is gone
while kill -0 "$launcher" 2>/dev/null; do
    wait "$launcher"
done
wait "$launcher"
status=$?
if [ "$status" != 0 ]; then
    echo "$(date -Is) torchrun exited with status $status"
    exit "$status"
fi
if python examples/kubernetes/finished.py "$@"; then
    exit 0
fi
echo "$(date -Is) stopped with a checkpoint before the end: exit $RETRY, for the Job to start this pod again"
exit "$RETRY"
