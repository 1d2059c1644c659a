#!/usr/bin/env bash
# Copy this checkout (git HEAD) to every worker of the slice and install it there:
# requirements.txt plus jax[tpu] in requirements.txt's jax range.
#
# Usage: launch/setup.sh --name NAME --zone ZONE [--project P] [--dry-run]
# The code lands in ~/mempo_jax on each worker; data and checkpoints (the config's data_path and
# ModelOptions.checkpoint, relative to ~/mempo_jax) are copied by you, e.g. with
# `gcloud compute tpus tpu-vm scp --worker=all --recurse`.

# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "$0")/common.sh"
parse_common "$@"
((${#EXTRA[@]} == 0)) || die "unknown option: ${EXTRA[0]}"
location_flags
REPO="$(cd "$(dirname "$0")/.." && pwd)"
JAX_SPEC="$(sed -n 's/^jax\([<>=!~][^ #]*\).*/\1/p' "$REPO/requirements.txt")"  # e.g. >=0.10.2,<0.13
[[ -n "$JAX_SPEC" ]] || die "requirements.txt names no jax version"
TARBALL="${TMPDIR:-/tmp}/mempo_jax-$NAME.tar.gz"
if ((!DRY_RUN)); then
  git -C "$REPO" archive --format=tar.gz -o "$TARBALL" HEAD
fi

gc compute tpus tpu-vm scp "$TARBALL" "$NAME:~/mempo_jax.tar.gz" --worker=all "${LOCATION[@]}"
INSTALL="mkdir -p ~/mempo_jax ~/mempo_logs && tar -xzf ~/mempo_jax.tar.gz -C ~/mempo_jax && cd ~/mempo_jax"
# gcsfs (pyproject's gcs extra): --run_dir gs://BUCKET/... without a gcsfuse mount
INSTALL+=" && python3 -m pip install -q -r requirements.txt 'jax[tpu]$JAX_SPEC' 'gcsfs>=2026.4.0'"
gc compute tpus tpu-vm ssh "$NAME" --worker=all "${LOCATION[@]}" --command="$INSTALL"
