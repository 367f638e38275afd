#!/usr/bin/env bash
# Build the session image `fgpu-session:latest` (agent.toml's default-image, `make image`), also
# tagged `fgpu-session:test` (what the tests ask for), from Debian's packages, without a registry:
# mmdebstrap a bookworm minbase with what a session needs (bash, python3 for the virtual
# nvidia-smi, procps, util-linux) and JupyterLab (the session app `jupyter`, issue 16: pinned as
# in pyproject.toml's `test` extra, from PyPI) into a tarball, then `docker import` it.
# Cached by content: an image whose label fgpu.build-hash matches this script's hash is kept as
# it is. JupyterLab's wheels are downloaded on the host (its pip has the machine's certificates
# and proxy settings; the chroot's has neither) for bookworm's Python 3.11 and glibc 2.36, kept in
# $FGPU_IMAGE_WHEELS (default /var/cache/fgpu-session-wheels) for the next build, and installed
# in the chroot from there without an index. Recommends are left out, no pip cache in the image.
# Progress is shown (pip's downloads, mmdebstrap's steps); about 5 minutes on 2 cores, less with the
# wheels cached.
# Usage: tests/images/build.sh [IMAGE...]   (needs root, mmdebstrap and a running Docker Engine; one
# image under every name given, default fgpu-session:latest and fgpu-session:test)
set -euo pipefail
[ $# -gt 0 ] || set -- fgpu-session:latest fgpu-session:test
image="$1"
packages="bash,python3,python3-pip,procps,coreutils,util-linux,ca-certificates"
jupyterlab="jupyterlab==4.6.6"  # as the test extra
wheels="${FGPU_IMAGE_WHEELS:-/var/cache/fgpu-session-wheels}/${jupyterlab/==/-}"
hash=$(cat "$0" | sha256sum | cut -c1-16)

for name in "$@"; do
  if [ "$(docker image inspect --format '{{index .Config.Labels "fgpu.build-hash"}}' "$name" 2>/dev/null)" = "$hash" ]; then
    for other in "$@"; do docker tag "$name" "$other"; done
    echo "image $* is up to date (build hash $hash)"
    exit 0
  fi
done
echo "building $* from Debian bookworm's packages (build hash $hash)"
started=$(date +%s)
tarball=$(mktemp --suffix=.tar)
trap 'rm -f "$tarball"' EXIT
if [ ! -e "$wheels/.complete" ]; then
  platforms=()
  for minor in $(seq 17 36); do platforms+=(--platform "manylinux_2_${minor}_x86_64"); done
  mkdir -p "$wheels"
  echo "downloading $jupyterlab's wheels into $wheels"
  python3 -m pip download --progress-bar on --disable-pip-version-check --dest "$wheels" --only-binary=:all: \
    --python-version 3.11 --implementation cp --abi cp311 --platform manylinux2014_x86_64 "${platforms[@]}" "$jupyterlab"
  touch "$wheels/.complete"
fi
echo "mmdebstrap: a bookworm minbase with $packages and $jupyterlab"
mmdebstrap --variant=minbase --include="$packages" --aptopt='APT::Install-Recommends "false"' \
  --customize-hook='mkdir -p "$1/tmp/wheels"' \
  --customize-hook="copy-in $wheels/. /tmp/wheels" \
  --customize-hook="chroot \"\$1\" env -i PATH=/usr/local/bin:/usr/bin:/bin python3 -m pip install --quiet --no-index \
    --find-links /tmp/wheels --no-cache-dir --break-system-packages --root-user-action=ignore \
    --disable-pip-version-check $jupyterlab" \
  --customize-hook='rm -rf "$1/tmp/wheels" "$1"/var/cache/apt/archives/*.deb "$1"/var/lib/apt/lists/*' \
  bookworm "$tarball"
docker import \
  --change 'CMD ["/bin/bash"]' \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
  --change "LABEL fgpu.build-hash=$hash ai.backend.kernelspec=1 ai.backend.features=uid-match ai.backend.base-distro=debian12 ai.backend.runtime-type=python ai.backend.runtime-path=/usr/bin/python3 ai.backend.service-ports=jupyterlab:http:8090" \
  "$tarball" "$image" >/dev/null
for other in "$@"; do docker tag "$image" "$other"; done
echo "built $* (build hash $hash) in $(( $(date +%s) - started )) s"
