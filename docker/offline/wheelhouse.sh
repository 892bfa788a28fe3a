#!/usr/bin/env bash
# Fills docker/wheelhouse/ with every wheel the CPU image installs, using the host's pip and its
# package sources (its index, find-links, a local mirror), so that
#   docker build --build-arg WHEELHOUSE_ONLY=1 -f docker/Dockerfile .
# needs neither PyPI nor the PyTorch index. Wheels are for CPython 3.11 on x86-64 Linux, the
# Python of the images (python:3.11-slim, or the Debian bookworm base).
#
#   docker/offline/wheelhouse.sh [PYTHON]         # PYTHON: the host interpreter (default python3)
#   docker/offline/wheelhouse.sh PYTHON phoenix   # Arize Phoenix -> docker/wheelhouse/phoenix/
#
# The second form fills the build context of docker/offline/Dockerfile.phoenix with the wheels of
# arize-phoenix (the version that Dockerfile pins) and its dependencies, kept apart from the CPU
# image's wheels so neither changes which versions the other gets.
set -euo pipefail
cd "$(dirname "$0")/../.."
python=${1:-python3}
what=${2:-specinfer}
dest=docker/wheelhouse
torch_version=${TORCH_VERSION:-2.13.0}

# Every manylinux tag bookworm's glibc (2.36) runs, newest first: pip takes a wheel only if its
# tag is listed here, so a dependency built for, say, glibc 2.31 needs that tag.
platforms=()
for glibc in 36 35 34 33 32 31 30 29 28 27 26 25 24 23 22 21 20 19 18 17; do
  platforms+=(--platform "manylinux_2_${glibc}_x86_64")
done
platforms+=(--platform manylinux2014_x86_64 --platform linux_x86_64)
quiet_links() { grep -v 'is ignored: it is neither a file nor a directory' >&2; }

if [ "$what" = phoenix ]; then
  version=$(sed -n 's/^ARG PHOENIX_VERSION=//p' docker/offline/Dockerfile.phoenix)
  [ -n "$version" ] || { echo "wheelhouse: no PHOENIX_VERSION in docker/offline/Dockerfile.phoenix" >&2; exit 1; }
  dest=docker/wheelhouse/phoenix
  "$python" -m pip download -q -d "$dest" --only-binary=:all: \
    --python-version 3.11 --implementation cp "${platforms[@]}" \
    "arize-phoenix==${version}" 2> >(quiet_links)
  echo "wheelhouse: $(ls "$dest"/*.whl | wc -l) wheels, $(du -sh "$dest" | cut -f1) in $dest (arize-phoenix ${version})"
  exit 0
fi

# The runtime dependencies as pyproject.toml lists them, plus the build tools of the builder stage.
mapfile -t requirements < <("$python" - <<'PY'
import tomllib
with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)
for req in project["project"]["dependencies"] + project["build-system"]["requires"]:
    if not req.startswith("torch"):
        print(req)
print("setuptools>=68,<90")
print("wheel")
# redis needs it below Python 3.11.3, and Debian bookworm's Python is 3.11.2; pip would only add
# it for the host's own version.
print("async-timeout>=4.0.3")
PY
)
# torch alone first: a `+cpu` build wherever the host's pip has one, never the CUDA wheels.
torch_spec="torch==${torch_version}"
if "$python" -m pip download --no-deps -q -d "$dest" --only-binary=:all: "torch==${torch_version}+cpu" 2>/dev/null; then
  torch_spec="torch==${torch_version}+cpu"
fi
"$python" -m pip download -q -d "$dest" --only-binary=:all: \
  --python-version 3.11 --implementation cp "${platforms[@]}" \
  "$torch_spec" "${requirements[@]}" 2> >(quiet_links)
if ls "$dest"/nvidia_* >/dev/null 2>&1; then
  echo "wheelhouse: warning: CUDA wheels came with torch; the host's pip has no CPU build of torch ${torch_version}" >&2
fi
echo "wheelhouse: $(ls "$dest"/*.whl | wc -l) wheels, $(du -sh "$dest" | cut -f1) in $dest"
