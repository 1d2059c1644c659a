#!/usr/bin/env bash
# Run a gin recipe on every worker of the slice (the same command on all hosts; each is one JAX
# process: mempo_jax.core.distributed.maybe_initialize sees MEMPO_MULTIHOST=1). Detached: the job
# keeps running after ssh returns; its output goes to ~/mempo_logs/RUN.log on each worker.
#
# Usage: launch/run.sh --config CONFIG --name NAME --zone ZONE [--project P]
#                      [--run-dir DIR] [--gin_param BINDING]... [--dry-run]
# --run-dir defaults to runs/<config name>. Metrics and summaries are written by worker 0;
# checkpoints by every worker into DIR/checkpoints (put DIR on a shared file system, e.g. a
# gcsfuse mount, for a multi-host slice).

# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "$0")/common.sh"
parse_common "$@"
[[ -n "$CONFIG" ]] || die "--config is required"
RUN_DIR=""
GIN_PARAMS=()
set -- "${EXTRA[@]+"${EXTRA[@]}"}"
while (($#)); do
  case "$1" in
    --run-dir) RUN_DIR="${2:?--run-dir needs a value}"; shift 2 ;;
    --gin_param) GIN_PARAMS+=(--gin_param "${2:?--gin_param needs a value}"); shift 2 ;;
    *) die "unknown option: $1" ;;
  esac
done
CONFIG_NAME="$(basename "$CONFIG" .gin)"
RUN_DIR="${RUN_DIR:-runs/$CONFIG_NAME}"
LOG="$(printf '%q' "$(basename "$RUN_DIR").log")"
location_flags

TRAIN="$(remote_command python3 -m mempo_jax.commands.train --run_dir "$RUN_DIR" --gin_file "$CONFIG" \
  "${GIN_PARAMS[@]+"${GIN_PARAMS[@]}"}")"
REMOTE="mkdir -p ~/mempo_logs && cd ~/mempo_jax && MEMPO_MULTIHOST=1 nohup $TRAIN > ~/mempo_logs/$LOG 2>&1 < /dev/null &"
gc compute tpus tpu-vm ssh "$NAME" --worker=all "${LOCATION[@]}" --command="$REMOTE"
