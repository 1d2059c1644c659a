#!/usr/bin/env bash
# Run a gin recipe on every worker of the slice (the same command on all hosts; each is one JAX
# process: mempo_jax.core.distributed.maybe_initialize sees MEMPO_MULTIHOST=1). Detached: the job
# keeps running after ssh returns; its output goes to ~/mempo_logs/RUN.log on each worker.
#
# Usage: launch/run.sh --config CONFIG --name NAME --zone ZONE [--project P]
#                      [--run-dir DIR] [--gin_param BINDING]... [--dry-run]
#                      [--max-restarts N [--queued] [--spot] [--poll SECONDS] [--after-create CMD]]
# --run-dir defaults to runs/<config name>. Metrics and summaries are written by worker 0;
# checkpoints by every worker into DIR/checkpoints (for a multi-host slice DIR must be shared:
# gs://BUCKET/PREFIX, written directly, or a gcsfuse mount).
#
# --max-restarts N: stay in the foreground and follow the job. Every --poll seconds (default 60)
# it reads the slice's state (the queued resource's with --queued, else the TPU VM's) and each
# worker's job status (~/mempo_logs/RUN.status, written when the job ends). A preempted or failed
# slice (SUSPENDED, FAILED, PREEMPTED, TERMINATED, gone) is deleted and created again
# (launch/delete.sh, launch/create.sh, launch/setup.sh, then --after-create CMD, run locally,
# e.g. to copy data), and the job is relaunched; a worker that exited without finishing (a lost
# process, a preemption's exit 0 before the end, exit 4) is relaunched on the same slice. The
# trainer resumes from the last complete checkpoint, so DIR must outlive the slice
# (gs://BUCKET/PREFIX, or a gcsfuse mount of a bucket). Each restart is one line on stderr; after N restarts, or when a worker
# stops with status 2 (bad config or input) or 3 (numerical faults), it gives up with that
# status; it exits 0 once every worker reports the run done (RUN_DIR/summary.json written).
# With --dry-run it prints the gcloud commands of the launch, one look at the job and one restart.

# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "$0")/common.sh"
parse_common "$@"
[[ -n "$CONFIG" ]] || die "--config is required"
RUN_DIR=""
GIN_PARAMS=()
MAX_RESTARTS=""
POLL=60
SPOT=()
AFTER_CREATE=""
set -- "${EXTRA[@]+"${EXTRA[@]}"}"
while (($#)); do
  case "$1" in
    --run-dir) RUN_DIR="${2:?--run-dir needs a value}"; shift 2 ;;
    --gin_param) GIN_PARAMS+=(--gin_param "${2:?--gin_param needs a value}"); shift 2 ;;
    --max-restarts) MAX_RESTARTS="${2:?--max-restarts needs a value}"; shift 2 ;;
    --poll) POLL="${2:?--poll needs a value}"; shift 2 ;;
    --spot) SPOT=(--spot); shift ;;
    --after-create) AFTER_CREATE="${2:?--after-create needs a value}"; shift 2 ;;
    *) die "unknown option: $1" ;;
  esac
done
if [[ -n "$MAX_RESTARTS" ]]; then
  [[ "$MAX_RESTARTS" =~ ^[0-9]+$ ]] || die "--max-restarts must be a whole number, got '$MAX_RESTARTS'"
  [[ "$POLL" =~ ^[0-9]+$ ]] || die "--poll must be a whole number of seconds, got '$POLL'"
fi
CONFIG_NAME="$(basename "$CONFIG" .gin)"
RUN_DIR="${RUN_DIR:-runs/$CONFIG_NAME}"
LOG="$(printf '%q' "$(basename "$RUN_DIR").log")"
location_flags

TRAIN="$(remote_command python3 -m mempo_jax.commands.train --run_dir "$RUN_DIR" --gin_file "$CONFIG" \
  "${GIN_PARAMS[@]+"${GIN_PARAMS[@]}"}")"
if [[ -z "$MAX_RESTARTS" ]]; then
  REMOTE="mkdir -p ~/mempo_logs && cd ~/mempo_jax && MEMPO_MULTIHOST=1 nohup $TRAIN > ~/mempo_logs/$LOG 2>&1 < /dev/null &"
  gc compute tpus tpu-vm ssh "$NAME" --worker=all "${LOCATION[@]}" --command="$REMOTE"
  exit 0
fi

# ---- the supervisor ---------------------------------------------------------------------------
STATUS="$(printf '%q' "$(basename "$RUN_DIR").status")"
PID="$(printf '%q' "$(basename "$RUN_DIR").pid")"
SUMMARY="$(printf '%q' "$RUN_DIR/summary.json")"
if [[ "$RUN_DIR" == gs://* ]]; then
  FINISHED="gcloud storage ls $SUMMARY > /dev/null 2>&1"  # the worker's service account reads the bucket
else
  FINISHED="[ -f $SUMMARY ]"
fi
# The job appends its log, records the trainer's pid and, when it ends, writes "done" (exit 0 with a
# summary) or its exit status. A relaunch first stops a trainer still running there (SIGTERM: it saves).
JOB="$TRAIN >> ~/mempo_logs/$LOG 2>&1 < /dev/null & echo \$! > ~/mempo_logs/$PID; wait \$!; rc=\$?"
JOB+="; rm -f ~/mempo_logs/$PID; if [ \$rc = 0 ] && $FINISHED; then echo done; else echo \$rc; fi > ~/mempo_logs/$STATUS"
STOP="if [ -f ~/mempo_logs/$PID ]; then p=\$(cat ~/mempo_logs/$PID); kill \$p 2> /dev/null; while kill -0 \$p 2> /dev/null; do sleep 1; done; fi"
REMOTE="mkdir -p ~/mempo_logs && { $STOP; } && rm -f ~/mempo_logs/$STATUS && cd ~/mempo_jax && MEMPO_MULTIHOST=1 nohup bash -c $(printf '%q' "$JOB") > /dev/null 2>&1 < /dev/null &"
PROBE="cat ~/mempo_logs/$STATUS 2> /dev/null || echo running"
SLICE=(--name "$NAME" --zone "$ZONE")
if [[ -n "$PROJECT" ]]; then
  SLICE+=(--project "$PROJECT")
fi
DRY=()
if ((DRY_RUN)); then
  DRY=(--dry-run)
fi
QUEUE=()
if ((QUEUED)); then
  QUEUE=(--queued)
fi

say() {
  echo "[launch/run.sh $(date -u +%Y-%m-%dT%H:%M:%SZ)] $*" >&2
}

launch() {
  gc compute tpus tpu-vm ssh "$NAME" --worker=all "${LOCATION[@]}" --command="$REMOTE"
}

# slice_state: the queued resource's (or TPU VM's) state into STATE ("" when it does not exist).
slice_state() {
  local kind=(tpu-vm) format="value(state)"
  if ((QUEUED)); then
    kind=(queued-resources)
    format="value(state.state)"
  fi
  if ((DRY_RUN)); then
    gc compute tpus "${kind[@]}" describe "$NAME" "${LOCATION[@]}" --format="$format"
    STATE="${DRY_STATE:-SUSPENDED}"
  else
    STATE="$(gcloud compute tpus "${kind[@]}" describe "$NAME" "${LOCATION[@]}" --format="$format" 2> /dev/null)" \
      || STATE=""
  fi
}

# job_status: every worker's status line into JOB_STATUS (running, done or an exit status).
job_status() {
  if ((DRY_RUN)); then
    gc compute tpus tpu-vm ssh "$NAME" --worker=all "${LOCATION[@]}" --command="$PROBE"
    JOB_STATUS="running"
  else
    # the workers that answer (an unreachable one fails the ssh, the others' statuses still count)
    JOB_STATUS="$({ gcloud compute tpus tpu-vm ssh "$NAME" --worker=all "${LOCATION[@]}" --command="$PROBE" 2> /dev/null \
      || true; } | { grep -E '^(running|done|[0-9]+)$' || true; } | sort -u | tr '\n' ' ')"
  fi
}

recreate() {
  bash "$(dirname "$0")/delete.sh" "${SLICE[@]}" "${QUEUE[@]+"${QUEUE[@]}"}" "${DRY[@]+"${DRY[@]}"}"
  bash "$(dirname "$0")/create.sh" --config "$CONFIG" "${SLICE[@]}" "${QUEUE[@]+"${QUEUE[@]}"}" \
    "${SPOT[@]+"${SPOT[@]}"}" --accelerator-type "$ACCELERATOR" --version "$VERSION" "${DRY[@]+"${DRY[@]}"}"
  while true; do  # provisioning a queued resource can take long: wait for it
    DRY_STATE=ACTIVE slice_state
    case "$STATE" in
      ACTIVE|READY) break ;;
      ""|FAILED|SUSPENDED|PREEMPTED|TERMINATED) say "the new slice is ${STATE:-missing}"; return 1 ;;
    esac
    sleep "$POLL"
  done
  bash "$(dirname "$0")/setup.sh" "${SLICE[@]}" "${DRY[@]+"${DRY[@]}"}"
  if [[ -n "$AFTER_CREATE" ]]; then
    if ((DRY_RUN)); then
      echo "$AFTER_CREATE"
    else
      MEMPO_TPU_NAME="$NAME" MEMPO_ZONE="$ZONE" bash -c "$AFTER_CREATE"
    fi
  fi
}

RESTARTS=0
restart() {  # restart REASON RECREATE(0|1)
  if ((RESTARTS >= MAX_RESTARTS)); then
    say "giving up: $1, and --max-restarts $MAX_RESTARTS are used"
    exit 1
  fi
  RESTARTS=$((RESTARTS + 1))
  if (($2)); then
    say "restart $RESTARTS/$MAX_RESTARTS: $1; recreating the slice, then relaunching from the last checkpoint"
    until recreate; do
      sleep "$POLL"
    done
  else
    say "restart $RESTARTS/$MAX_RESTARTS: $1; relaunching from the last checkpoint"
  fi
  launch || say "the launch failed on some worker (unreachable?); the next look at the job decides"
}

launch
say "following the job (--max-restarts $MAX_RESTARTS, every ${POLL}s)"
while true; do
  if ((DRY_RUN)); then
    slice_state
    job_status
    restart "$(if ((QUEUED)); then echo queued resource; else echo TPU VM; fi) $NAME is $STATE (dry run)" 1
    exit 0
  fi
  sleep "$POLL"
  slice_state
  case "$STATE" in
    ACTIVE|READY) ;;
    ACCEPTED|PROVISIONING|WAITING_FOR_RESOURCES|CREATING|RESTARTING|REPAIRING) continue ;;
    *) restart "$(if ((QUEUED)); then echo queued resource; else echo TPU VM; fi) $NAME is ${STATE:-gone}" 1; continue ;;
  esac
  job_status
  case " $JOB_STATUS" in
    " done ") say "the run is done (every worker reports it)"; exit 0 ;;
    *" 2 "*) say "a worker stopped with status 2 (bad config or input: see ~/mempo_logs/$LOG); not restarting"; exit 2 ;;
    *" 3 "*) say "a worker stopped with status 3 (numerical faults: see ~/mempo_logs/$LOG); not restarting"; exit 3 ;;
    *[0-9]*|*done*) restart "a worker exited before the end (statuses: ${JOB_STATUS% })" 0 ;;
  esac
done
