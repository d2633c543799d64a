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
hostfile=${1:?usage: launch/multinode.sh HOSTFILE SCRIPT [ARGS...]}
shift
master=$(awk '!/^#/ && NF {print $1; exit}' "$hostfile")
exec deepspeed --hostfile "$hostfile" --master_addr "${MASTER_ADDR:-$master}" --master_port "${MASTER_PORT:-29500}" "$@"
