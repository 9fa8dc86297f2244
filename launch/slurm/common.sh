# Shared by train.sbatch and prm.sbatch (sourced, not run): the job's settings, one torchrun per node as an srun
# step, the USR1 stop request, and the requeue of a job that stopped early with a checkpoint.
#
# Environment it reads (exported to the job by sbatch):
#   NPROC_PER_NODE  ranks per node (default: the job's GPUs on the node, or 2 gloo processes on a CPU node)
#   RDZV_PORT       torchrun rendezvous port on the first node (default: derived from the job id; step k of the
#                   job uses RDZV_PORT + k)
#   PYTHON          interpreter with grpo_mega installed (default: python on PATH)
#   GRPO_MEGA_ENTRY the module every rank runs (default grpo_mega.cli); bench/chaos.py runs bench.fault_inject,
#                   grpo-mega with its faults planted
#
# Preemption: sbatch --signal=B:USR1@300 sends USR1 to the batch shell 300 s before the time limit
# (`scancel --signal=USR1 --batch JOBID` does the same by hand). The trap sends SIGTERM to the running step
# through slurmd (`scancel --signal=TERM JOBID`; not to srun, which would take it as "cancel the step" and kill the
# ranks before they save); torchrun forwards it to the ranks, which save the step in flight and exit with status 3.
# The launcher (grpo_mega.run.torchrun: torchrun, its failures in one line) exits with the first failed rank's status;
# the stop is recognised by the command's "<command>: stopped after step N" line in this restart's part of the log,
# or by the USR1 itself.
#
# Faults: a failed rank prints "<command>: rank R on HOST failed (cause=CAUSE) at step N (PHASE): ..." (the rank that
# wrote run_dir/failure.json ends that line with its path). The job requeues itself (and resumes from the last
# complete checkpoint) when the cause is transient (collective_timeout, peer_lost, phase_timeout, hardware,
# terminated: the rank was being torn down, as torchrun does to every rank once one has died) or when
# no rank named one (a rank or node died without a word: SIGKILL, OOM killer, node loss; a lost rendezvous or store
# is named by the launcher itself: "grpo-mega launcher (torchrun) on HOST failed (cause=peer_lost)"), at most
# GRPO_MAX_FAULT_REQUEUES times (default 3) over the job's life; it stops, with the step's status, on a cause a
# restart would repeat (config, data, non_finite, disk_full, error, interrupted).

# grpo_job_setup: print the banner, fill in NPROC_PER_NODE / OMP_NUM_THREADS / RDZV_PORT / PYTHON, find this job's
# log (log_file) and where this restart's part of it starts (log_start), and install the USR1 trap.
grpo_job_setup() {
  echo "=== grpo-mega job ${SLURM_JOB_ID} ${SLURM_JOB_NAME:-} SLURM_RESTART_COUNT=${SLURM_RESTART_COUNT:-0}" \
       "nodes=${SLURM_JOB_NODELIST} $(date -u +%FT%TZ)"
  if [[ -z "${NPROC_PER_NODE:-}" ]]; then
    # The GPUs SLURM gave the job on this node (--gpus-per-node), else those nvidia-smi lists, else 2 on CPU.
    local gpus=${SLURM_GPUS_ON_NODE:-0}
    if (( gpus == 0 )) && command -v nvidia-smi >/dev/null 2>&1; then
      gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    fi
    if (( gpus > 0 )); then NPROC_PER_NODE=$gpus; else NPROC_PER_NODE=2; fi
  fi
  # srun steps do not take --cpus-per-task from the job since Slurm 22.05 (only from SRUN_CPUS_PER_TASK): without
  # this the torchrun step, and all the ranks it starts, would be bound to one CPU where tasks are bound to cores.
  if [[ -n "${SLURM_CPUS_PER_TASK:-}" ]]; then export SRUN_CPUS_PER_TASK=${SRUN_CPUS_PER_TASK:-$SLURM_CPUS_PER_TASK}; fi
  local cores=${SLURM_CPUS_ON_NODE:-$(nproc)}
  local threads=$(( cores / NPROC_PER_NODE ))
  export NPROC_PER_NODE
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( threads > 0 ? threads : 1 ))}
  export RDZV_PORT=${RDZV_PORT:-$(( 20000 + SLURM_JOB_ID % 10000 ))}
  export PYTHON=${PYTHON:-python}
  GRPO_MAX_FAULT_REQUEUES=${GRPO_MAX_FAULT_REQUEUES:-3}
  # torchrun, signalled with the step, gives the ranks this long to finish the step in flight and save before it
  # SIGKILLs them (its default, 30 s, is shorter than one GRPO step of a 7B model); 240 s leaves 60 of the 300 s
  # USR1 lead (--signal=B:USR1@300) for the requeue. A rank that hangs (SIGSTOP, a dead GPU) ends within
  # trainer.collective_timeout_s + this grace.
  export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-240}

  log_file=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/^ *StdOut=//p' | head -n1)
  log_start=0
  if [[ -n "$log_file" && -f "$log_file" ]]; then log_start=$(wc -l < "$log_file"); fi

  stop_requested=0
  step_pid=
  steps_started=0
  trap grpo_on_usr1 USR1
}

grpo_on_usr1() {
  stop_requested=1
  echo "=== grpo-mega job ${SLURM_JOB_ID}: USR1 received, sending SIGTERM to the running step $(date -u +%FT%TZ)"
  # Without --batch/--full this reaches every step of the job, not this shell.
  scancel --signal=TERM "$SLURM_JOB_ID" || { [[ -n "$step_pid" ]] && kill -TERM "$step_pid" 2>/dev/null; } || true
}

# grpo_run_step NAME ARGS...: `grpo-mega ARGS...` with one torchrun per node (NPROC_PER_NODE ranks each); returns
# its exit status. The rendezvous host, the first node of the job, is computed inside the step (on the node),
# not in this batch shell.
grpo_run_step() {
  local name=$1
  shift
  local port=$(( RDZV_PORT + steps_started ))
  steps_started=$(( steps_started + 1 ))
  echo "=== grpo-mega job ${SLURM_JOB_ID}: step ${name}: grpo-mega $* $(date -u +%FT%TZ)"
  srun --kill-on-bad-exit=1 --ntasks-per-node=1 bash -c '
    head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
    port=$1 rdzv_id=$2
    shift 2
    exec "$PYTHON" -m grpo_mega.run.torchrun \
      --nnodes="$SLURM_NNODES" --nproc-per-node="$NPROC_PER_NODE" \
      --rdzv-backend=c10d --rdzv-endpoint="$head:$port" --rdzv-id="$rdzv_id" \
      -m -- "${GRPO_MEGA_ENTRY:-grpo_mega.cli}" "$@"
  ' "grpo-mega-$name" "$port" "$SLURM_JOB_ID-$name" "$@" &
  step_pid=$!
  # `wait` returns early (status > 128) when the USR1 trap runs; wait again until srun has really exited.
  local status
  while true; do
    wait "$step_pid"
    status=$?
    if ! kill -0 "$step_pid" 2>/dev/null; then break; fi
  done
  step_pid=
  echo "=== grpo-mega job ${SLURM_JOB_ID}: step ${name} exited with status ${status} $(date -u +%FT%TZ)"
  return "$status"
}

# grpo_log_part: this restart's part of the job log (nothing when the log is not found).
grpo_log_part() {
  [[ -n "$log_file" && -f "$log_file" ]] && tail -n +"$(( log_start + 1 ))" "$log_file"
}

# grpo_log_since_start PATTERN: whether this restart's part of the job log has a line matching PATTERN.
grpo_log_since_start() {
  grpo_log_part | grep -q -- "$1"
}

# grpo_requeue: put this job back in the queue (same job id, SLURM_RESTART_COUNT + 1) and end this run.
grpo_requeue() {
  echo "=== grpo-mega job ${SLURM_JOB_ID}: $1; requeueing"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
}

# grpo_failure_cause: the cause named in this restart's part of the log by the rank that wrote failure.json (its
# line ends with that path), else by the first failure line; nothing when no rank named one.
grpo_failure_cause() {
  local lines line
  lines=$(grpo_log_part | grep -a 'failed (cause=[a-z_]*)')
  line=$(grep -a 'failure\.json$' <<<"$lines" | head -n1)
  [[ -n "$line" ]] || line=$(head -n1 <<<"$lines")
  grep -o 'failed (cause=[a-z_]*)' <<<"$line" | head -n1 | sed 's/^failed (cause=\([a-z_]*\))$/\1/'
}

# grpo_fault_requeues: how many times this job requeued itself after a transient fault (the log is appended to).
grpo_fault_requeues() {
  if [[ -n "$log_file" && -f "$log_file" ]]; then
    grep -c "^=== grpo-mega job ${SLURM_JOB_ID}: transient fault" "$log_file" || true
  else
    echo 0
  fi
}

# grpo_finish_training_step STATUS STOP_LINE: after a training step, requeue when it stopped early with a checkpoint
# (a USR1 arrived, or the trainer printed STOP_LINE: trainer.save_before_seconds) or failed for a transient cause
# (see the top of this file), else exit with its status.
grpo_finish_training_step() {
  local status=$1 stop_line=$2
  (( status == 0 )) && exit 0
  if (( stop_requested )) || grpo_log_since_start "$stop_line"; then
    grpo_requeue "stopped early with a checkpoint"
  fi
  local cause done_requeues
  cause=$(grpo_failure_cause)
  case "$cause" in
    collective_timeout|peer_lost|phase_timeout|hardware|terminated|"")
      done_requeues=$(grpo_fault_requeues)
      if (( done_requeues < GRPO_MAX_FAULT_REQUEUES )); then
        grpo_requeue "transient fault (cause=${cause:-none named: a rank or node died without a word}), fault requeue $(( done_requeues + 1 )) of ${GRPO_MAX_FAULT_REQUEUES}"
      fi
      echo "=== grpo-mega job ${SLURM_JOB_ID}: failed (cause=${cause:-none named}) after ${done_requeues} fault" \
           "requeues (GRPO_MAX_FAULT_REQUEUES=${GRPO_MAX_FAULT_REQUEUES}); not requeueing" ;;
    *)
      echo "=== grpo-mega job ${SLURM_JOB_ID}: failed (cause=${cause}), which a restart would repeat; not requeueing" \
           "(the run folder's failure.json has the details)" ;;
  esac
  exit "$status"
}
