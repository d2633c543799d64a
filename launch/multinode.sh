#!/usr/bin/env bash
# Run an elsa_ds entry point across nodes with DeepSpeed's pdsh/ssh launcher, from the first node.
#
#   launch/multinode.sh HOSTFILE launch/prune.py --deepspeed ds_configs/zero3_offload.json \
#       --model google/gemma-2-27b --output_dir /shared/out/gemma2-27b-s70 --save_interval 256
#
# Needs: passwordless ssh between the nodes, the same checkout and venv path on every node,
# --output_dir on a filesystem every node sees (checkpoints are written by every rank), and for NVMe
# offload a local --nvme_path that exists on every node. MASTER_PORT (default 29500) must be open.
set -euo pipefail
fail() { echo "elsa_ds: error: launch/multinode.sh: $*" >&2; exit 2; }
(( $# >= 2 )) || fail "usage: launch/multinode.sh HOSTFILE SCRIPT [ARGS...] (launch/hostfile.example shows the hostfile)"
hostfile=$1
shift
[[ -f $hostfile && -r $hostfile ]] || fail "hostfile $hostfile: no such readable file (one line per node: HOST slots=GPUS)"
[[ -f $1 ]] || fail "$1: no such script (e.g. launch/prune.py, run from the checkout's root)"
# every line that is not a comment: HOST slots=N, as DeepSpeed's launcher reads it (it raises a traceback otherwise)
bad=$(awk '!/^[[:space:]]*#/ && NF && !($2 ~ /^slots=[0-9]+$/ && NF == 2) {print NR": "$0; exit}' "$hostfile")
[[ -z $bad ]] || fail "hostfile $hostfile, line $bad: each node's line is HOST slots=GPUS"
master=$(awk '!/^[[:space:]]*#/ && NF {print $1; exit}' "$hostfile")
[[ -n $master ]] || fail "hostfile $hostfile names no node (one line per node: HOST slots=GPUS)"
exec deepspeed --hostfile "$hostfile" --master_addr "${MASTER_ADDR:-$master}" --master_port "${MASTER_PORT:-29500}" "$@"
