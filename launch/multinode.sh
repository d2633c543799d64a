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
# DeepSpeed's pdsh launcher sends each node one line, `cd CHECKOUT; PYTHON -u -m deepspeed.launcher.launch ... ARGS`,
# that a shell there reads again: it quotes an argument only where it holds a space, and pdsh replaces %n and %h in it.
# So an argument holding $, `, \, quotes, ;, &, |, <, >, (, ), {, }, [, ], *, ?, ~, !, #, % or a control character
# would be run or changed there (an audit: --model 'm$(touch X)' ran `touch X` on every node), and an empty one vanishes.
plain() {  # plain WHAT VALUE: refuse VALUE unless a remote shell reads it back as it is
  if [[ -z $2 || $2 == *[\$\`\\\"\'\;\&\|\<\>\(\)\{\}\[\]\*\?\~\!\#%]* || $2 =~ [[:cntrl:]] ]]; then
    fail "$1 $(printf '%q' "$2") is empty or holds a character the shell on each node would read again (DeepSpeed's pdsh \
launcher passes the command as one line, quoting only spaces): use a value without \$ \` \\ quotes ; & | < > ( ) { } [ ] * ? ~ ! # %, \
or put it in a --recipe file (a --targets regex, say)"
  fi
}
checkout=$(pwd -P)  # as DeepSpeed names it: os.path.abspath('.'), links resolved
plain "the checkout's folder" "$checkout"
[[ $checkout != *" "* ]] || fail "the checkout's folder $(printf '%q' "$checkout") holds a space: DeepSpeed's pdsh launcher runs \`cd \
FOLDER\` on each node unquoted; run from a checkout whose path has none"
for arg in "$@"; do plain argument "$arg"; done
master=$(awk '!/^[[:space:]]*#/ && NF {print $1; exit}' "$hostfile")
[[ -n $master ]] || fail "hostfile $hostfile names no node (one line per node: HOST slots=GPUS)"
addr=${MASTER_ADDR:-$master} port=${MASTER_PORT:-29500}
# both go into that one line too (an audit: MASTER_ADDR='node1;touch X' ran; `export MASTER_ADDR=$(hostname -I)` is several)
plain "MASTER_ADDR (the first node's address)" "$addr"
[[ $addr != *[[:space:]]* ]] || fail "MASTER_ADDR $(printf '%q' "$addr") names several hosts: give one (the first node's)"
[[ $port =~ ^[1-9][0-9]{0,4}$ ]] && (( port <= 65535 )) || fail "MASTER_PORT $(printf '%q' "$port") is not a TCP port (1-65535)"
exec deepspeed --hostfile "$hostfile" --master_addr "$addr" --master_port "$port" "$@"
