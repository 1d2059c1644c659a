#!/usr/bin/env bash
# Follow a run's log on one worker (worker 0 by default: the one that prints metrics).
#
# Usage: launch/logs.sh --name NAME --zone ZONE (--config CONFIG | --run-dir DIR) [--worker N]
#                       [--project P] [--dry-run]

# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "$0")/common.sh"
parse_common "$@"
RUN_DIR=""
WORKER=0
set -- "${EXTRA[@]+"${EXTRA[@]}"}"
while (($#)); do
  case "$1" in
    --run-dir) RUN_DIR="${2:?--run-dir needs a value}"; shift 2 ;;
    --worker) WORKER="${2:?--worker needs a value}"; shift 2 ;;
    *) die "unknown option: $1" ;;
  esac
done
if [[ -z "$RUN_DIR" ]]; then
  [[ -n "$CONFIG" ]] || die "--config or --run-dir is required"
  RUN_DIR="runs/$(basename "$CONFIG" .gin)"
fi
location_flags
gc compute tpus tpu-vm ssh "$NAME" --worker="$WORKER" "${LOCATION[@]}" \
  --command="tail -n 200 -F ~/mempo_logs/$(printf '%q' "$(basename "$RUN_DIR").log")"
