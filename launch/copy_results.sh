#!/usr/bin/env bash
# Copy a run folder (metrics.jsonl, summary.json, rollouts.jsonl, config.gin, checkpoints written
# there) from worker 0 to this machine; a gs://BUCKET/PREFIX run folder from the bucket.
#
# Usage: launch/copy_results.sh --name NAME --zone ZONE (--config CONFIG | --run-dir DIR)
#                               [--dest LOCAL_DIR] [--project P] [--dry-run]
# --dest defaults to results/<NAME>/.

# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "$0")/common.sh"
parse_common "$@"
RUN_DIR=""
DEST=""
set -- "${EXTRA[@]+"${EXTRA[@]}"}"
while (($#)); do
  case "$1" in
    --run-dir) RUN_DIR="${2:?--run-dir needs a value}"; shift 2 ;;
    --dest) DEST="${2:?--dest needs a value}"; shift 2 ;;
    *) die "unknown option: $1" ;;
  esac
done
if [[ -z "$RUN_DIR" ]]; then
  [[ -n "$CONFIG" ]] || die "--config or --run-dir is required"
  RUN_DIR="runs/$(basename "$CONFIG" .gin)"
fi
DEST="${DEST:-results/$NAME}"
if ((!DRY_RUN)); then
  mkdir -p "$DEST"
fi
location_flags
if [[ "$RUN_DIR" == gs://* ]]; then
  gc storage cp --recursive "$RUN_DIR" "$DEST"
else
  gc compute tpus tpu-vm scp --recurse "$NAME:~/mempo_jax/$RUN_DIR" "$DEST" --worker=0 "${LOCATION[@]}"
fi
