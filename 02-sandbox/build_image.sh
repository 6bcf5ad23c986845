#!/usr/bin/env bash
# Build the sandbox image on a machine that cannot pull from any image registry.
#
#   02-sandbox/build_image.sh [IMAGE]          default IMAGE: tool-rl-lab-sandbox:latest
#
# 1. debootstrap a minimal Debian root file system with python3, numpy and sympy
#    (Debian packages, so no pip and no network at build time beyond the Debian mirror);
# 2. `docker import` it as the base image;
# 3. build 02-sandbox/Dockerfile on top of it with `--build-arg BASE=<that image>`,
#    so the same Dockerfile serves users who can pull `python:3.11-slim`.
#
# Environment: SUITE (default bookworm), MIRROR (default: debootstrap's own default),
# KEEP_ROOTFS=1 to keep the temporary folder for inspection. Needs root, debootstrap, docker.
set -euo pipefail

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi
image=${1:-tool-rl-lab-sandbox:latest}
suite=${SUITE:-bookworm}
here=$(cd "$(dirname "$0")" && pwd)
base="${image%%:*}-rootfs:${suite}"

command -v debootstrap >/dev/null || { echo "build_image.sh: debootstrap is not installed (apt-get install debootstrap)" >&2; exit 1; }
command -v docker >/dev/null || { echo "build_image.sh: docker CLI is not installed" >&2; exit 1; }
[[ $(id -u) == 0 ]] || { echo "build_image.sh: debootstrap needs root" >&2; exit 1; }

work=$(mktemp -d /tmp/sandbox-rootfs.XXXXXX)
[[ "${KEEP_ROOTFS:-0}" == 1 ]] || trap 'rm -rf "$work"' EXIT

if ! docker image inspect "$base" >/dev/null 2>&1; then
    echo "build_image.sh: debootstrap $suite into $work/rootfs"
    # minbase: dpkg, apt and coreutils only; the three packages pull their own dependencies.
    debootstrap --variant=minbase --include=python3,python3-numpy,python3-sympy \
        "$suite" "$work/rootfs" ${MIRROR:+"$MIRROR"} >"$work/debootstrap.log" 2>&1 \
        || { tail -20 "$work/debootstrap.log" >&2; exit 1; }
    # Caches and docs are a third of the size and nothing at run time reads them.
    rm -rf "$work"/rootfs/var/cache/apt/* "$work"/rootfs/var/lib/apt/lists/* \
           "$work"/rootfs/usr/share/doc "$work"/rootfs/usr/share/man "$work"/rootfs/usr/share/locale
    tar -C "$work/rootfs" -c . | docker import - "$base" >/dev/null
fi
# The legacy builder talks to the engine directly: no buildx plugin is needed, and
# `--network none` because nothing in the Dockerfile may download when BASE already has it all.
DOCKER_BUILDKIT=0 docker build --quiet --network none --build-arg BASE="$base" -t "$image" "$here" >"$work/build.log" 2>&1 \
    || { tail -20 "$work/build.log" >&2; exit 1; }
echo "build_image.sh: built $image from $base"
