#!/usr/bin/env bash
# Render the single_node job script, submit it to Slurm, wait for it, and
# check that it COMPLETED and wrote RUN_DIR/metrics.jsonl.
#
# Usage:  .ci/slurm_job_test.sh VENV_DIR
#   VENV_DIR                  virtual environment with hpcpax's dependencies (mpi4py...)
#   env SLURM_JOB_TEST_TIMEOUT=300   seconds to wait for the job
#       SLURM_JOB_TEST_COMMAND       overrides the program each rank runs
#                                    (default: the template's `python -m mpi4py -m hpcpax.train`)
#       SLURM_JOB_TEST_TRAIN_ARGS    default "--model lm --steps 20"
#       SLURM_JOB_TEST_NTASKS        ranks on the node, default 4
# Needs a running Slurm (.ci/slurm_up.sh starts one). Exits non-zero on failure.
set -euo pipefail

if [[ $# -ne 1 || ! -f $1/bin/activate ]]; then
    echo "usage: $0 VENV_DIR   (VENV_DIR/bin/activate must exist)" >&2
    exit 2
fi
venv=$(cd "$1" && pwd)
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
timeout_s=${SLURM_JOB_TEST_TIMEOUT:-300}
ntasks=${SLURM_JOB_TEST_NTASKS:-4}
train_args=${SLURM_JOB_TEST_TRAIN_ARGS:---model lm --steps 20}

log() { echo "[slurm_job_test] $*" >&2; }

for tool in sbatch scontrol sinfo; do
    command -v "$tool" >/dev/null || { log "ERROR: $tool not found; run .ci/slurm_up.sh first"; exit 1; }
done
timeout 15 sinfo -h >/dev/null || { log "ERROR: Slurm does not answer (sinfo); run .ci/slurm_up.sh"; exit 1; }

work=$(mktemp -d /tmp/hpcpax-slurm-job.XXXXXX)
run_dir=$work/run
job_id=""

fail() {
    log "FAILED: $*"
    if [[ -n $job_id ]]; then
        echo "----- scontrol show job $job_id -----" >&2
        timeout 15 scontrol show job "$job_id" >&2 || true
    fi
    for f in "$work"/slurm-*.out; do
        [[ -f $f ]] || continue
        echo "----- job output $f -----" >&2
        tail -n 60 "$f" >&2
    done
    log "files kept in $work"
    exit 1
}

# ---- render ---------------------------------------------------------------
render_args=(
    single_node
    --job-name hpcpax-ci
    --nodes 1
    --ntasks-per-node "$ntasks"
    --cpus-per-task 1
    --time 00:10:00
    --signal-seconds 30
    --slurm-output "$work/slurm-%j.out"
    --activate "$venv/bin/activate"
    --train-args "$train_args"
    --run-dir "$run_dir"
    -o "$work/job.sbatch"
)
if [[ -n ${SLURM_JOB_TEST_COMMAND:-} ]]; then
    render_args+=(--command "$SLURM_JOB_TEST_COMMAND")
fi
(cd "$repo" && "$venv/bin/python" -m hpcpax.jobscript "${render_args[@]}") || fail "rendering the job script"
bash -n "$work/job.sbatch" || fail "rendered job script has a syntax error"

# A runner with fewer cores than ranks (or a cluster without slurm_up.sh's
# oversubscription) needs --overcommit to start the job at all.
sbatch_args=(--parsable --chdir "$repo")
node_cpus=$(timeout 15 sinfo -h -o '%c' | sort -n | tail -n 1 | tr -d '+ ')
if [[ -n $node_cpus && $node_cpus -lt $ntasks ]]; then
    sbatch_args+=(--overcommit)
fi

# ---- submit and wait ------------------------------------------------------
log "submitting $work/job.sbatch (timeout ${timeout_s}s)"
start=$(date +%s)
status=0
timeout 60 sbatch "${sbatch_args[@]}" "$work/job.sbatch" >"$work/sbatch.out" 2>"$work/sbatch.err" || status=$?
job_id=$(head -n 1 "$work/sbatch.out" | cut -d';' -f1 | tr -d '[:space:]')
[[ $status -eq 0 && -n $job_id ]] || { cat "$work/sbatch.err" >&2; fail "sbatch gave no job id (exit $status)"; }
# Polled every half second (sbatch --wait sleeps up to 32 s between its looks).
while :; do
    state=$(timeout 15 scontrol show job -o "$job_id" 2>/dev/null | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p' || true)
    case $state in
        COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY|PREEMPTED|BOOT_FAIL|DEADLINE) break ;;
    esac
    if (( $(date +%s) - start > timeout_s )); then
        timeout 15 scancel "$job_id" || true
        fail "job did not finish within ${timeout_s}s (cancelled)"
    fi
    sleep 0.5
done
log "job $job_id ended ($state) after $(($(date +%s) - start))s"

# ---- check ----------------------------------------------------------------
# No slurmdbd, so no sacct: scontrol keeps finished jobs for MinJobAge (300 s).
job_line=$(timeout 15 scontrol show job -o "$job_id" 2>/dev/null || true)
state=$(sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p' <<<"$job_line")
exit_code=$(sed -n 's/.* ExitCode=\([0-9:]*\).*/\1/p' <<<"$job_line")
if [[ -n $state ]]; then
    [[ $state == COMPLETED ]] || fail "job state $state, expected COMPLETED"
    [[ $exit_code == 0:0 ]] || fail "job exit code $exit_code, expected 0:0"
else
    fail "scontrol no longer knows job $job_id"
fi
metrics=$run_dir/metrics.jsonl
[[ -s $metrics ]] || fail "$metrics is missing or empty"
lines=$(wc -l <"$metrics")
[[ $lines -ge 1 ]] || fail "$metrics has no complete line"

log "OK: job $job_id ${state:-finished} exit ${exit_code:-0}, $metrics has $lines lines"
rm -rf "$work"
