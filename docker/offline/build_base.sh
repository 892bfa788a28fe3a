#!/usr/bin/env bash
# Builds the base image for machines without a container registry: a Debian bookworm root
# filesystem made by mmdebstrap from Debian's own packages, imported into Docker and tagged.
#
#   docker/offline/build_base.sh [TAG]            # default specinfer-base:bookworm
#
# It holds Python 3.11 (with venv, as `python`), CA certificates, redis-server and gcc (for the CPU
# matrix kernel, built with the package), so one base
# serves the SpecInfer images (PYTHON_IMAGE=TAG) and the Redis image (docker/offline/redis.Dockerfile).
# Needs root, mmdebstrap (`apt-get install mmdebstrap`), a Debian mirror (DEBIAN_MIRROR) and a
# running Docker engine. An existing TAG is kept unless REBUILD=1.
set -euo pipefail

tag=${1:-specinfer-base:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
security_mirror=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
packages=python3,python3-venv,python-is-python3,ca-certificates,redis-server,gcc,libc6-dev

if [ "${REBUILD:-0}" != 1 ] && docker image inspect "$tag" >/dev/null 2>&1; then
  echo "build_base: $tag exists (REBUILD=1 rebuilds it)"
  exit 0
fi
command -v mmdebstrap >/dev/null || { echo "build_base: needs mmdebstrap (apt-get install mmdebstrap)" >&2; exit 1; }

echo "build_base: building $tag from $mirror ($packages)"
# minbase + the packages; documentation, man pages and apt's caches are left out of the image.
mmdebstrap --variant=minbase --include="$packages" \
  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
  bookworm - \
  "deb $mirror bookworm main" "deb $mirror bookworm-updates main" "deb $security_mirror bookworm-security main" \
  | docker import \
      --change 'ENV LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      --change 'CMD ["python"]' \
      - "$tag"
echo "build_base: $tag ready"
