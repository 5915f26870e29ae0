#!/usr/bin/env bash
# The task srun starts on every node: runs the torchrun command given as arguments and passes the
# stop signals Slurm sends to the job step on to the training processes, which save a checkpoint
# and exit 0, so that torchrun, and with it the step, exits 0.
#
#     srun --ntasks-per-node=1 bash examples/slurm/torchrun_node.sh torchrun --signals-to-handle=SIGINT,SIGHUP,SIGQUIT ... pretrain.py ...
#
# Slurm signals a step's tasks (this script), not their descendants: the training processes run in
# sessions of their own below torchrun and never see the signal. torchrun itself must not act on it:
# SIGUSR1 would kill it at once, leaving the workers without their launcher; on SIGTERM it would stop
# the workers itself and exit 1, and kill them 30 s later. So torchrun starts with both ignored
# (--signals-to-handle keeps it from taking SIGTERM back), and this script signals torchrun's
# children directly: SIGUSR1 as SIGUSR1 (the --signal warning, forwarded by srun), SIGTERM as SIGTERM
# (time limit, scancel, preemption).
set -u
trap '' USR1 TERM
"$@" &
launcher=$!

forward() {
    local pid
    echo "torchrun_node.sh: SIG$1 on $(hostname): asking the training processes to checkpoint and stop" >&2
    for pid in $(cat /proc/"$launcher"/task/*/children 2>/dev/null); do
        kill -s "$1" "$pid" 2>/dev/null
    done
}
trap 'forward USR1' USR1
trap 'forward TERM' TERM

# wait returns early (status > 128) whenever a trapped signal arrives: wait again until torchrun is gone
while kill -0 "$launcher" 2>/dev/null; do
    wait "$launcher"
done
wait "$launcher"
