#!/usr/bin/env bash
# Launch a grpo-mega command on this machine with torchrun.
#   launch/local.sh [--dry-run] [--dp N | NPROC] COMMAND [ARGS...]
#   launch/local.sh train --config configs/qwen2.5-math-7b_grpo.yaml [key=value ...]   # its world_size: 8
#   launch/local.sh --dp 2 train --config configs/quickstart_grpo.yaml                 # 1 x 1 x 2 = 2
#   launch/local.sh 4 prm train --config configs/quickstart_prm.yaml parallel.tensor=2
# NPROC processes (one per GPU on a GPU node; on CPU, gloo processes sharing the cores). Without NPROC, the
# config's whole world size: parallel.tensor x parallel.pipeline x data parallel, from --config FILE and the
# key=value overrides, where data parallel is --dp N, else the world size the config was written for (its
# "# world_size: N" line, as the shipped real-model configs have) divided by tensor x pipeline, else 1. With
# rollout.mode=async, rollout.async_ranks more processes (the rollout ranks; a world size line counts them).
# --dry-run prints the torchrun command line instead of running it. PYTHON: the interpreter (default: python).
set -euo pipefail
usage="usage: launch/local.sh [--dry-run] [--dp N | NPROC] COMMAND [ARGS...]"
dry_run=0
if [[ "${1:-}" == "--dry-run" ]]; then dry_run=1; shift; fi
dp=
if [[ "${1:-}" == "--dp" || "${1:-}" == --dp=* ]]; then
  if [[ "$1" == "--dp" ]]; then dp=${2:-}; shift $(( $# > 1 ? 2 : 1 )); else dp=${1#--dp=}; shift; fi
  [[ "$dp" =~ ^[0-9]+$ ]] && (( dp > 0 )) || { echo "launch/local.sh: --dp must be an integer >= 1, got '$dp'" >&2; exit 2; }
fi
(( $# > 0 )) || { echo "$usage" >&2; exit 2; }
python=${PYTHON:-python}

if [[ -z "$dp" && "$1" =~ ^[0-9]+$ ]]; then
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
    echo "launch/local.sh: no NPROC given and no --config to read the world size (parallel.tensor x" \
         "parallel.pipeline x data parallel) from" >&2
    echo "$usage" >&2
    exit 2
  fi
  nproc=$("$python" -c '
import re
import sys
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

path, dp, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
try:
    text = open(path).read()
    cfg = OmegaConf.merge(OmegaConf.create(text), OmegaConf.from_dotlist(overrides))
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
model_parallel = sizes[0] * sizes[1]
# rollout.mode=async: rollout.async_ranks processes generate beside the training ranks (the world size line counts both)
rollout_ranks = 0
if OmegaConf.select(cfg, "rollout.mode", default="colocated") == "async":
    rollout_ranks = OmegaConf.select(cfg, "rollout.async_ranks", default=1)
    if isinstance(rollout_ranks, bool) or not isinstance(rollout_ranks, int) or rollout_ranks < 1:
        sys.exit(f"launch/local.sh: rollout.async_ranks must be an integer >= 1, got {rollout_ranks!r} ({path} and overrides)")
if dp:
    print(model_parallel * int(dp) + rollout_ranks)
    sys.exit()
worlds = re.findall(r"^# world_size: (\d+)[ \t]*$", text, flags=re.MULTILINE)
if len(worlds) > 1:
    sys.exit(f"launch/local.sh: {path} has {len(worlds)} \"# world_size: N\" lines; keep one")
if not worlds:
    print(model_parallel + rollout_ranks)  # one data-parallel replica
    sys.exit()
world = int(worlds[0])
if world <= rollout_ranks or (world - rollout_ranks) % model_parallel:
    less = f" less rollout.async_ranks={rollout_ranks}" if rollout_ranks else ""
    sys.exit(f"launch/local.sh: parallel.tensor x parallel.pipeline = {sizes[0]} x {sizes[1]} does not divide the "
             f"world size {world} of {path} (its \"# world_size: {world}\" line{less}); give --dp N or NPROC")
print(world)
' "$config" "$dp" "${overrides[@]}") || exit 2
fi

(( $# > 0 )) || { echo "$usage" >&2; exit 2; }
cores=$(nproc)
threads=$(( cores / nproc ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( threads > 0 ? threads : 1 ))}
# "--" ends torchrun's options: its parser would take flags of the command (--n, --nproc) for its own.
command=("$python" -m grpo_mega.run.torchrun --standalone --nproc-per-node="$nproc" -m -- grpo_mega.cli "$@")
if (( dry_run )); then
  echo "OMP_NUM_THREADS=$OMP_NUM_THREADS ${command[*]@Q}"
  exit 0
fi
exec "${command[@]}"
