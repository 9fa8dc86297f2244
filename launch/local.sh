#!/usr/bin/env bash
# Launch a grpo-mega command on this machine with torchrun.
#   launch/local.sh [--dry-run] [NPROC] COMMAND [ARGS...]
#   launch/local.sh train --config configs/quickstart_grpo.yaml [key=value ...]
#   launch/local.sh 4 prm train --config configs/quickstart_prm.yaml parallel.tensor=2
# NPROC processes (one per GPU on a GPU node; on CPU, gloo processes sharing the cores). Without NPROC, the
# config's parallel layout decides: parallel.tensor x parallel.pipeline from --config FILE and the key=value
# overrides (one data-parallel replica; give NPROC, a multiple of it, for data parallelism).
# --dry-run prints the torchrun command line instead of running it. PYTHON: the interpreter (default: python).
set -euo pipefail
usage="usage: launch/local.sh [--dry-run] [NPROC] COMMAND [ARGS...]"
dry_run=0
if [[ "${1:-}" == "--dry-run" ]]; then dry_run=1; shift; fi
(( $# > 0 )) || { echo "$usage" >&2; exit 2; }
python=${PYTHON:-python}

if [[ "$1" =~ ^[0-9]+$ ]]; then
  nproc=$1
  shift
  (( nproc > 0 )) || { echo "launch/local.sh: NPROC must be >= 1, got $nproc" >&2; exit 2; }
else
  # The config file and the key=value overrides (arguments with '=' that are not --flags) of the command.
  config=
  overrides=()
  args=("$@")
  for (( i = 0; i < ${#args[@]}; i++ )); do
    case "${args[i]}" in
      --config) config=${args[i + 1]:-} ;;
      --config=*) config=${args[i]#--config=} ;;
      -*) ;;
      *=*) overrides+=("${args[i]}") ;;
    esac
  done
  if [[ -z "$config" ]]; then
    echo "launch/local.sh: no NPROC given and no --config to read parallel.tensor x parallel.pipeline from" >&2
    echo "$usage" >&2
    exit 2
  fi
  nproc=$("$python" -c '
import sys
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

path, overrides = sys.argv[1], sys.argv[2:]
try:
    cfg = OmegaConf.merge(OmegaConf.load(path), OmegaConf.from_dotlist(overrides))
except FileNotFoundError:
    sys.exit(f"launch/local.sh: config file {path} does not exist")
except OmegaConfBaseException as error:
    sys.exit(f"launch/local.sh: {path} and overrides: {str(error).splitlines()[0]}")
sizes = []
for key in ("parallel.tensor", "parallel.pipeline"):
    value = OmegaConf.select(cfg, key, default=1)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        sys.exit(f"launch/local.sh: {key} must be an integer >= 1, got {value!r} ({path} and overrides)")
    sizes.append(value)
print(sizes[0] * sizes[1])
' "$config" "${overrides[@]}") || exit 2
fi

(( $# > 0 )) || { echo "$usage" >&2; exit 2; }
cores=$(nproc)
threads=$(( cores / nproc ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( threads > 0 ? threads : 1 ))}
# "--" ends torchrun's options: its parser would take flags of the command (--n, --nproc) for its own.
command=("$python" -m torch.distributed.run --standalone --nproc-per-node="$nproc" -m -- grpo_mega.cli "$@")
if (( dry_run )); then
  echo "OMP_NUM_THREADS=$OMP_NUM_THREADS ${command[*]@Q}"
  exit 0
fi
exec "${command[@]}"
