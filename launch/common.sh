#!/usr/bin/env bash
# shellcheck disable=SC2034  # the option variables are read by the scripts that source this file
# Shared option parsing and the gcloud wrapper of the launch scripts (sourced, not run).
#
# Every script takes:
#   --name NAME              TPU VM / queued-resource name        (default $MEMPO_TPU_NAME)
#   --zone ZONE              e.g. us-east5-a                      (default $MEMPO_ZONE)
#   --project PROJECT        GCP project                          (default $MEMPO_PROJECT, else gcloud's)
#   --config FILE            gin recipe; TPUConfig.accelerator_type / runtime_version are read from it
#   --accelerator-type TYPE  overrides the config's TPUConfig.accelerator_type
#   --version VERSION        overrides the config's TPUConfig.runtime_version
#   --queued                 the slice is a queued resource (create / delete)
#   --dry-run                print the gcloud commands instead of running them
#   -h | --help
# Script-specific options are left in the array EXTRA for the script to parse.

set -euo pipefail

NAME="${MEMPO_TPU_NAME:-}"
ZONE="${MEMPO_ZONE:-}"
PROJECT="${MEMPO_PROJECT:-}"
CONFIG=""
ACCELERATOR=""
VERSION=""
QUEUED=0
DRY_RUN=0
EXTRA=()

usage() {
  sed -n '2,/^$/{s/^# \{0,1\}//;p}' "$0" >&2
  exit "${1:-2}"
}

die() {
  echo "error: $*" >&2
  exit 2
}

parse_common() {
  while (($#)); do
    case "$1" in
      --name) NAME="${2:?--name needs a value}"; shift 2 ;;
      --zone) ZONE="${2:?--zone needs a value}"; shift 2 ;;
      --project) PROJECT="${2:?--project needs a value}"; shift 2 ;;
      --config) CONFIG="${2:?--config needs a value}"; shift 2 ;;
      --accelerator-type) ACCELERATOR="${2:?--accelerator-type needs a value}"; shift 2 ;;
      --version) VERSION="${2:?--version needs a value}"; shift 2 ;;
      --queued) QUEUED=1; shift ;;
      --dry-run) DRY_RUN=1; shift ;;
      -h|--help) usage 0 ;;
      *) EXTRA+=("$1"); shift ;;
    esac
  done
  [[ -n "$NAME" ]] || die "--name (or \$MEMPO_TPU_NAME) is required"
  [[ -n "$ZONE" ]] || die "--zone (or \$MEMPO_ZONE) is required"
  if [[ -n "$CONFIG" ]]; then
    [[ -f "$CONFIG" ]] || die "no such config: $CONFIG"
    [[ -n "$ACCELERATOR" ]] || ACCELERATOR="$(gin_string TPUConfig.accelerator_type "$CONFIG")"
    [[ -n "$VERSION" ]] || VERSION="$(gin_string TPUConfig.runtime_version "$CONFIG")"
  fi
}

# gin_string KEY FILE: the quoted string bound to KEY in a gin file ("" when unbound).
gin_string() {
  sed -n "s/^[[:space:]]*${1//./\\.}[[:space:]]*=[[:space:]]*[\"']\([^\"']*\)[\"'].*/\1/p" "$2" | tail -n 1
}

# Flags every gcloud call shares.
location_flags() {
  LOCATION=("--zone=$ZONE")
  if [[ -n "$PROJECT" ]]; then
    LOCATION+=("--project=$PROJECT")
  fi
}

# gc ARGS...: run `gcloud ARGS...`, or print it (shell-quoted, one line) with --dry-run.
gc() {
  if ((DRY_RUN)); then
    printf 'gcloud'
    printf ' %q' "$@"
    printf '\n'
  else
    gcloud "$@"
  fi
}

# remote_command WORDS...: the words shell-quoted into one string for `ssh --command`.
remote_command() {
  local out="" word
  for word in "$@"; do
    out+="$(printf '%q' "$word") "
  done
  printf '%s' "${out% }"
}
