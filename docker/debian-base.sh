#!/usr/bin/env bash
# The base image the CPU Dockerfiles name, python:3.11-slim-bookworm, made from Debian's packages
# for a host that reaches Debian's mirrors but no image registry: Debian 12's Python 3.11 in a
# virtual environment at /usr/local (python, pip and site-packages where the official image has
# them), imported into podman's local storage. Needs root, mmdebstrap and podman.
#
#   docker/debian-base.sh [MIRROR]      # default http://deb.debian.org/debian
#
# `podman build --pull=never` then takes it for the FROM line; a registry's image is not replaced
# where one exists already.
set -euo pipefail
image=python:3.11-slim-bookworm
mirror=${1:-http://deb.debian.org/debian}
if podman image exists "$image"; then
  echo "$image: already in podman's storage"
  exit 0
fi
tarball=$(mktemp --suffix=.tar)
trap 'rm -f "$tarball"' EXIT
mmdebstrap --quiet --variant=minbase --include=python3-venv,passwd \
  --customize-hook='chroot "$1" python3 -m venv /usr/local' \
  --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/* "$1"/usr/share/doc/* "$1"/usr/share/man/*' \
  bookworm "$tarball" "$mirror"
podman import \
  --change 'ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' \
  "$tarball" "localhost/$image" >/dev/null
echo "$image: made from Debian's packages ($(podman run --rm --network=none "$image" python --version))"
