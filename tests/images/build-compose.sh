#!/usr/bin/env bash
# The compose stack's images for a machine with no registry (CI; issue 37.5), built as tests/images/build.sh
# builds the session image: mmdebstrap a bookworm minbase into a tarball, then `docker import` it. compose.yaml
# takes them through FGPU_BASE_IMAGE, FGPU_POSTGRES_IMAGE and FGPU_REDIS_IMAGE (README, "Compose"); unset,
# it uses the public images (python:3.11-slim, postgres:16, redis:7).
#   - fgpu-compose-base:bookworm, the Dockerfile's base in place of python:3.11-slim: bookworm's Python 3.11
#     in a virtualenv on PATH (/opt/venv, so `python` and `pip install` act as in the public image), iptables,
#     and pyproject.toml's dependencies already installed (their list is part of the build hash), with pip
#     pointed at the wheels it still needs to build the project offline (PIP_NO_INDEX, /opt/wheels);
#   - fgpu-compose-postgres:15, bookworm's PostgreSQL 15 with an entrypoint that acts on POSTGRES_USER,
#     POSTGRES_PASSWORD and POSTGRES_DB as the official image's does (tests/images/postgres-entrypoint.sh);
#   - fgpu-compose-redis:7, bookworm's Redis 7.0, run as the user redis.
# Cached by content: an image whose label fgpu.build-hash matches the hash of what it is made from (its part
# of this script, and the files and lists named above) is kept as it is; a second when all are.
# Wheels are downloaded on the host (its pip has the machine's certificates and proxy settings; the chroot's
# has neither) for bookworm's Python 3.11 and glibc 2.36, kept in $FGPU_IMAGE_WHEELS (default
# /var/cache/fgpu-session-wheels) for the next build, and installed in the chroot from there without an
# index. Recommends are left out, no pip or apt cache in the images. Progress is shown.
# Usage: tests/images/build-compose.sh   (needs root, mmdebstrap and a running Docker Engine)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cache="${FGPU_IMAGE_WHEELS:-/var/cache/fgpu-session-wheels}"
tarball=$(mktemp --suffix=.tar)
trap 'rm -f "$tarball"' EXIT

# Documentation, manual pages and translations are left out of every image (their copyright files kept).
slim=(--dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright'
      --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*'
      --dpkgopt='path-exclude=/usr/share/locale/*')

# build_hash FUNCTION [FILE...]: the hash of what an image is made from: its function and the helpers it
# calls (their text, not the rest of this script's), the options above, and the files it copies in.
build_hash() {
  (declare -f up_to_date wheels import "$1"; printf '%s\n' "${slim[@]}"; shift; [ $# -eq 0 ] || cat "$@") \
    | sha256sum | cut -c1-16
}

# up_to_date HASH NAME...: true (and every name tagged) when one of the names holds an image of this hash.
up_to_date() {
  local hash="$1" name other
  shift
  for name in "$@"; do
    if [ "$(docker image inspect --format '{{index .Config.Labels "fgpu.build-hash"}}' "$name" 2>/dev/null)" = "$hash" ]; then
      for other in "$@"; do docker tag "$name" "$other"; done
      echo "image $* is up to date (build hash $hash)"
      return 0
    fi
  done
  return 1
}

# wheels DIR REQUIREMENT...: the binary wheels of the requirements for bookworm's CPython 3.11.2, into DIR once.
# pip evaluates environment markers (python_full_version < "3.11.3": redis's async-timeout) with the Python it
# runs on, whatever --python-version says: Debian's own /usr/bin/python3 (bookworm's, as in the image) runs it
# where it has pip (.ci/run installs python3-pip), else the python3 on PATH.
wheels() {
  local dir="$1" minor
  shift
  [ -e "$dir/.complete" ] && return 0
  local platforms=()
  for minor in $(seq 17 36); do platforms+=(--platform "manylinux_2_${minor}_x86_64"); done
  mkdir -p "$dir"
  echo "downloading the wheels of $* into $dir"
  local python=python3
  /usr/bin/python3 -m pip --version >/dev/null 2>&1 && python=/usr/bin/python3
  "$python" -m pip download --progress-bar on --disable-pip-version-check --dest "$dir" --only-binary=:all: \
    --python-version 3.11.2 --implementation cp --abi cp311 --platform manylinux2014_x86_64 "${platforms[@]}" \
    --platform any "$@"
  touch "$dir/.complete"
}

# import HASH NAME... -- CHANGE...: docker import the tarball under every name, with the changes and the hash's label.
import() {
  local hash="$1" names=() changes=() other
  shift
  while [ "$1" != "--" ]; do names+=("$1"); shift; done
  shift
  for change in "$@"; do changes+=(--change "$change"); done
  docker import "${changes[@]}" --change "LABEL fgpu.build-hash=$hash" "$tarball" "${names[0]}" >/dev/null
  for other in "${names[@]}"; do docker tag "${names[0]}" "$other"; done
  echo "built ${names[*]} (build hash $hash) in $(( $(date +%s) - started )) s"
}

# The Dockerfile's base for CI: pyproject.toml's dependencies installed in /opt/venv; the build backend
# pyproject.toml names (setuptools, wheel and what they need) left in /opt/wheels for `pip install .`.
# The wheels are kept by what they are for (the two lists), the image by that and this function.
compose_base() {
  local packages="python3,python3-venv,ca-certificates,iptables"
  local requirements backend
  requirements=$(python3 -c 'import sys, tomllib; print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))' \
    "$root/pyproject.toml")
  backend=$(python3 -c 'import sys, tomllib; print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["build-system"]["requires"]))' \
    "$root/pyproject.toml")
  local lists hash
  lists=$( (echo "$requirements"; echo "$backend") | sha256sum | cut -c1-16)
  hash=$( (build_hash compose_base; echo "$lists") | sha256sum | cut -c1-16)
  up_to_date "$hash" "$@" && return 0
  echo "building $* from Debian bookworm's packages and pyproject.toml's dependencies (build hash $hash)"
  started=$(date +%s)
  local dir="$cache/compose-base-$lists"
  # shellcheck disable=SC2086
  wheels "$dir/dependencies" $requirements
  # shellcheck disable=SC2086
  wheels "$dir/backend" $backend
  local list
  list=$(mktemp)
  echo "$requirements" >"$list"
  mmdebstrap --variant=minbase --include="$packages" --aptopt='APT::Install-Recommends "false"' "${slim[@]}" \
    --customize-hook='mkdir -p "$1/opt/wheels" "$1/tmp/wheels"' \
    --customize-hook="copy-in $dir/dependencies/. /tmp/wheels" \
    --customize-hook="copy-in $dir/backend/. /opt/wheels" \
    --customize-hook="copy-in $list /tmp/wheels" \
    --customize-hook="chroot \"\$1\" env -i PATH=/usr/bin:/bin sh -c 'python3 -m venv /opt/venv && \
      /opt/venv/bin/pip install --quiet --no-index --find-links /tmp/wheels --no-cache-dir --root-user-action=ignore \
      --disable-pip-version-check -r /tmp/wheels/$(basename "$list") && rm -f /opt/wheels/.complete'" \
    --customize-hook='rm -rf "$1/tmp/wheels" "$1"/var/cache/apt/archives/*.deb "$1"/var/lib/apt/lists/*' \
    bookworm "$tarball"
  rm -f "$list"
  import "$hash" "$@" -- 'CMD ["python3"]' \
    'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 PIP_NO_INDEX=1 PIP_FIND_LINKS=/opt/wheels PIP_DISABLE_PIP_VERSION_CHECK=1'
}

compose_postgres() {
  local hash entrypoint="$here/postgres-entrypoint.sh"
  hash=$(build_hash compose_postgres "$entrypoint")
  up_to_date "$hash" "$@" && return 0
  echo "building $* from Debian bookworm's postgresql-15 (build hash $hash)"
  started=$(date +%s)
  # Without JIT: bookworm's postgresql-15 depends on LLVM (~110 MB) for it alone; without llvmjit.so the
  # server compiles nothing at run time and says nothing (jit_provider cannot load: JIT is off).
  mmdebstrap --variant=minbase --include=postgresql-15 --aptopt='APT::Install-Recommends "false"' "${slim[@]}" \
    --dpkgopt='path-exclude=/usr/lib/x86_64-linux-gnu/libLLVM-*' --dpkgopt='path-exclude=/usr/lib/postgresql/15/lib/llvmjit*' \
    --dpkgopt='path-exclude=/usr/lib/postgresql/15/lib/bitcode/*' \
    --customize-hook="copy-in $entrypoint /usr/local/bin" \
    --customize-hook='chroot "$1" sh -c "chmod 0755 /usr/local/bin/postgres-entrypoint.sh && mkdir -p /var/lib/postgresql/data /run/postgresql && chown postgres:postgres /var/lib/postgresql/data /run/postgresql && chmod 0700 /var/lib/postgresql/data"' \
    --customize-hook='rm -rf "$1"/var/cache/apt/archives/*.deb "$1"/var/lib/apt/lists/* "$1"/var/lib/postgresql/15 "$1"/etc/postgresql/15' \
    bookworm "$tarball"
  import "$hash" "$@" -- 'ENTRYPOINT ["/usr/local/bin/postgres-entrypoint.sh"]' 'CMD ["postgres"]' \
    'ENV PATH=/usr/lib/postgresql/15/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 PGDATA=/var/lib/postgresql/data' \
    'EXPOSE 5432'
}

compose_redis() {
  local hash
  hash=$(build_hash compose_redis)
  up_to_date "$hash" "$@" && return 0
  echo "building $* from Debian bookworm's redis-server (build hash $hash)"
  started=$(date +%s)
  mmdebstrap --variant=minbase --include=redis-server --aptopt='APT::Install-Recommends "false"' "${slim[@]}" \
    --customize-hook='rm -rf "$1"/var/cache/apt/archives/*.deb "$1"/var/lib/apt/lists/*' \
    bookworm "$tarball"
  # As the official image: the server as the unprivileged user redis, in /data.
  import "$hash" "$@" -- 'USER redis' 'WORKDIR /var/lib/redis' 'CMD ["redis-server"]' 'EXPOSE 6379' \
    'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8'
}

compose_base fgpu-compose-base:bookworm
compose_postgres fgpu-compose-postgres:15
compose_redis fgpu-compose-redis:7
