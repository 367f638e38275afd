#!/usr/bin/env bash
# Build the session test image `fgpu-session:test` from Debian's packages, without a registry:
# mmdebstrap a bookworm minbase with what a session needs (bash, python3 for the virtual
# nvidia-smi, procps, util-linux) into a tarball, then `docker import` it. Cached by content: an
# image whose label fgpu.build-hash matches this script's hash is kept as it is.
# Usage: tests/images/build.sh [IMAGE]   (needs root, mmdebstrap and a running Docker Engine)
set -euo pipefail
image="${1:-fgpu-session:test}"
packages="bash,python3,procps,coreutils,util-linux,ca-certificates"
hash=$(cat "$0" | sha256sum | cut -c1-16)

if [ "$(docker image inspect --format '{{index .Config.Labels "fgpu.build-hash"}}' "$image" 2>/dev/null)" = "$hash" ]; then
  echo "image $image is up to date (build hash $hash)"
  exit 0
fi
started=$(date +%s)
tarball=$(mktemp --suffix=.tar)
trap 'rm -f "$tarball"' EXIT
mmdebstrap --quiet --variant=minbase --include="$packages" bookworm "$tarball"
docker import \
  --change 'CMD ["/bin/bash"]' \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
  --change "LABEL fgpu.build-hash=$hash ai.backend.kernelspec=1 ai.backend.features=uid-match ai.backend.base-distro=debian12 ai.backend.runtime-type=python ai.backend.runtime-path=/usr/bin/python3" \
  "$tarball" "$image" >/dev/null
echo "built $image (build hash $hash) in $(( $(date +%s) - started )) s"
