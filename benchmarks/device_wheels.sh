#!/usr/bin/env bash
# Build the wheel folder a lent accelerator's image needs for benchmarks/device_check.py and the
# test suite: the project's requirements that the image lacks, and their dependencies that it lacks,
# as .whl files for CPython 3.12 on x86-64 Linux. The image has: jax (CUDA plugin), jaxlib, flax,
# optax, orbax-checkpoint, tensorstore, jaxtyping, safetensors, tokenizers, sentencepiece,
# transformers, torch, pytest (and their dependencies: numpy, scipy, jinja2, tqdm, pyyaml, ...).
#
# Usage: bash benchmarks/device_wheels.sh [DIR]   (default wheels/device; DIR is git-ignored)
# On the machine: python -m pip install --no-index --find-links DIR DIR/*.whl
# Exits 1 when the folder exceeds 40 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-wheels/device}"
rm -rf "$dir"
mkdir -p "$dir"
# The project's pins of what the image lacks (requirements*.txt), plus the test-only checkers.
wanted=()
for name in grain gin-config bm25s tensorboardX matplotlib fastapi uvicorn httpx hypothesis beartype; do
  line=$(grep -ihE "^${name}(==|>=|$)" requirements.txt requirements-test.txt | head -1 | sed 's/[[:space:]]*#.*//')
  wanted+=("${line:-$name}")
done
python3 -m pip download -q --dest "$dir" --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "${wanted[@]}"
# Drop what the image already has (the packages above and their usual dependencies).
have='^(jax|jaxlib|jax_cuda.*|flax|optax|orbax_checkpoint|tensorstore|jaxtyping|safetensors|tokenizers|sentencepiece|transformers|torch|pytest|numpy|scipy|ml_dtypes|opt_einsum|jinja2|markupsafe|tqdm|pyyaml|packaging|typing_extensions|protobuf|filelock|fsspec|huggingface_hub|requests|urllib3|idna|certifi|charset_normalizer|regex|wadler_lindig|msgpack|rich|markdown_it_py|mdurl|pygments|absl_py|etils|treescope|nest_asyncio|aiofiles|humanize|simplejson|zipp|importlib_resources|pluggy|iniconfig|sympy|mpmath|networkx|toolz|psutil|chex)-'
for whl in "$dir"/*.whl; do
  base=$(basename "$whl" | tr '[:upper:]' '[:lower:]')
  if [[ "$base" =~ $have ]]; then rm -f "$whl"; fi
done
bytes=$(du -cb "$dir"/*.whl | tail -1 | cut -f1)
echo "$(find "$dir" -name '*.whl' | wc -l) wheels, $((bytes / 1024 / 1024)) MiB in $dir"
ls "$dir"
if (( bytes > 40 * 1024 * 1024 )); then
  echo "error: $dir is over 40 MiB" >&2
  exit 1
fi
