#!/usr/bin/env bash
# Launch a grpo-mega command on this machine with torchrun.
#   launch/local.sh NPROC train --config configs/quickstart_grpo.yaml [key=value ...]
# One process per GPU on a GPU node; on CPU, NPROC gloo processes share the cores.
set -euo pipefail
nproc=${1:?usage: launch/local.sh NPROC COMMAND [ARGS...]}
shift
threads=$(( $(nproc) / nproc ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( threads > 0 ? threads : 1 ))}
exec python -m torch.distributed.run --standalone --nproc-per-node="$nproc" -m grpo_mega.cli "$@"
