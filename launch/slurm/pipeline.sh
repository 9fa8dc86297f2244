#!/usr/bin/env bash
# Submit "train the PRM, then process-supervised GRPO" as two dependent SLURM jobs: prm.sbatch (labels + PRM
# training), then train.sbatch, which starts only after the PRM job has completed successfully
# (--dependency=afterok; with --kill-on-invalid-dep=yes it is cancelled when the PRM job fails). Run it on the login
# node; it prints the job ids (prm_job=ID, grpo_job=ID).
#
#   mkdir -p logs
#   PRM_CONFIG=configs/quickstart_prm.yaml LABEL_POLICY=runs/sft LABEL_PROMPTS=data/train.jsonl \
#   LABELS=runs/prm/labels.jsonl GRPO_CONFIG=configs/quickstart_grpo.yaml \
#     launch/slurm/pipeline.sh model.hf_config=runs/model model.init_from=runs/sft trainer.run_dir=runs/prm \
#       -- model.init_from=runs/sft trainer.run_dir=runs/grpo \
#          algorithm.supervision=process process_reward.source=prm process_reward.prm=runs/prm
#
# Arguments: key=value overrides of `grpo-mega prm train`, then "--", then those of `grpo-mega train`.
# Environment:
#   PRM_CONFIG      PRM training config (prm.sbatch's CONFIG; required)
#   GRPO_CONFIG     GRPO config of the last stage (train.sbatch's CONFIG; required)
#   LABELS, LABEL_POLICY, LABEL_PROMPTS, LABEL_ARGS, NPROC_PER_NODE, PYTHON: passed to the jobs (see prm.sbatch)
#   PRM_SBATCH, GRPO_SBATCH  more sbatch options for each job, split on whitespace
#                   (e.g. PRM_SBATCH="--nodes=1 --time=02:00:00" GRPO_SBATCH="--nodes=4 --time=24:00:00");
#                   options for both: sbatch's own SBATCH_* variables (SBATCH_PARTITION, SBATCH_ACCOUNT, ...)
#
# The GRPO stage runs GRPO_CONFIG with its overrides as given: the learned PRM reaches it through
# process_reward.prm=<the PRM stage's trainer.run_dir> (with algorithm.supervision=process and
# process_reward.source=prm, or the same keys in GRPO_CONFIG); without them it is outcome-supervised GRPO.
set -euo pipefail
: "${PRM_CONFIG:?set PRM_CONFIG=path/to/prm_config.yaml}" "${GRPO_CONFIG:?set GRPO_CONFIG=path/to/grpo_config.yaml}"
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

prm_overrides=()
while (( $# > 0 )) && [[ "$1" != "--" ]]; do prm_overrides+=("$1"); shift; done
if (( $# > 0 )); then shift; fi
grpo_overrides=("$@")

# shellcheck disable=SC2086  # PRM_SBATCH / GRPO_SBATCH are lists of options
prm_job=$(CONFIG="$PRM_CONFIG" sbatch --parsable ${PRM_SBATCH:-} "$here/prm.sbatch" "${prm_overrides[@]}")
prm_job=${prm_job%%;*}
# shellcheck disable=SC2086
grpo_job=$(CONFIG="$GRPO_CONFIG" sbatch --parsable --dependency="afterok:$prm_job" --kill-on-invalid-dep=yes \
  ${GRPO_SBATCH:-} "$here/train.sbatch" "${grpo_overrides[@]}")
grpo_job=${grpo_job%%;*}
echo "prm_job=$prm_job"
echo "grpo_job=$grpo_job"
