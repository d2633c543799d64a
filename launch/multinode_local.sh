#!/usr/bin/env bash
# Emulate two nodes with one rank each on this machine: two launcher invocations, node ranks 0 and 1,
# over loopback (DeepSpeed's --no_ssh mode). Same arguments as the script takes:
#
#   launch/multinode_local.sh launch/prune.py --deepspeed ds_configs/zero3_offload.json --output_dir out/mn
set -uo pipefail
hostfile=$(mktemp)
trap 'rm -f "$hostfile"' EXIT
printf 'nodeA slots=1\nnodeB slots=1\n' > "$hostfile"
port=${MASTER_PORT:-$((29600 + RANDOM % 300))}
common=(--hostfile "$hostfile" --no_ssh --master_addr 127.0.0.1 --master_port "$port")
deepspeed "${common[@]}" --node_rank 0 "$@" & node0=$!
deepspeed "${common[@]}" --node_rank 1 "$@" & node1=$!
wait "$node0"; rc0=$?
wait "$node1"; rc1=$?
exit $(( rc0 > rc1 ? rc0 : rc1 ))
