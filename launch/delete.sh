#!/usr/bin/env bash
# Delete the slice (without a prompt). With --queued the queued resource and its TPU VM go.
#
# Usage: launch/delete.sh --name NAME --zone ZONE [--project P] [--queued] [--dry-run]

# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "$0")/common.sh"
parse_common "$@"
((${#EXTRA[@]} == 0)) || die "unknown option: ${EXTRA[0]}"
location_flags
if ((QUEUED)); then
  gc compute tpus queued-resources delete "$NAME" "${LOCATION[@]}" --force --quiet
else
  gc compute tpus tpu-vm delete "$NAME" "${LOCATION[@]}" --quiet
fi
