#!/usr/bin/env bash
# Create the TPU slice of a recipe: a TPU VM, or with --queued a queued resource (the way to get
# v5p / large v5e and v6e slices; it is provisioned when capacity is available).
#
# Usage: launch/create.sh --config CONFIG --name NAME --zone ZONE [--project P] [--queued]
#                         [--spot] [--accelerator-type TYPE] [--version VERSION] [--dry-run]
# Example: launch/create.sh --config configs/qwen2_5_7b_v5p64.gin --name mempo-7b --zone us-east5-a --queued
# Then: launch/setup.sh, launch/run.sh, launch/logs.sh, launch/copy_results.sh, launch/delete.sh.

# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "$0")/common.sh"
parse_common "$@"
SPOT=()
for arg in "${EXTRA[@]+"${EXTRA[@]}"}"; do
  case "$arg" in
    --spot) SPOT=(--spot) ;;
    *) die "unknown option: $arg" ;;
  esac
done
[[ -n "$ACCELERATOR" ]] || die "no accelerator type: give --config (TPUConfig.accelerator_type) or --accelerator-type"
[[ -n "$VERSION" ]] || die "no runtime version: give --config (TPUConfig.runtime_version) or --version"
location_flags

if ((QUEUED)); then
  gc compute tpus queued-resources create "$NAME" --node-id="$NAME" "${LOCATION[@]}" \
    --accelerator-type="$ACCELERATOR" --runtime-version="$VERSION" "${SPOT[@]+"${SPOT[@]}"}"
  if ((!DRY_RUN)); then
    echo "queued; watch it with: gcloud compute tpus queued-resources describe $NAME ${LOCATION[*]}" >&2
  fi
else
  gc compute tpus tpu-vm create "$NAME" "${LOCATION[@]}" --accelerator-type="$ACCELERATOR" --version="$VERSION" \
    "${SPOT[@]+"${SPOT[@]}"}"
fi
