#!/usr/bin/env bash
# The direct path under QEMU: the same guest test as ci/qemu/guest-test.sh, but with a
# QEMU whose generic vhost-user device has the vhost-user shared-memory messages
# (GET_SHMEM_CONFIG, SHMEM_MAP/UNMAP; the series accepted for QEMU 11), so vgpu.ko finds
# the region and submits directly (sysfs, API: submission=direct). No such QEMU can be
# built here yet (Debian's 11.x sources are indexed but not downloadable from these
# machines), so the script skips, saying why, unless VGPU_QEMU_SHMEM names one.
#
# Usage: VGPU_QEMU_SHMEM=/path/to/qemu-system-x86_64 [VGPU_QEMU_DEVICE=name] \
#            ci/qemu/direct-test.sh [guest-test.sh options]
# Prints "QG-SKIP direct: <reason>" and exits 0 when it cannot run; otherwise the guest
# test's "QG-STEP"/"QG-RESULT" lines and its exit code.
#
# Before trusting a pass, check the protocol feature bit and the message numbers of
# that QEMU's docs/interop/vhost-user.rst against the `vhost` crate (a version of the
# QEMU series numbered VHOST_USER_PROTOCOL_F_SHMEM 20; vhost 0.18 uses 22): a mismatch
# shows as the device coming up forwarded, which this test reports as a failure.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
QEMU="${VGPU_QEMU_SHMEM:-}"
skip() {
    echo "QG-SKIP direct: $*"
    exit 0
}
[ -n "$QEMU" ] || skip "no QEMU with vhost-user SHMEM is reachable here (QEMU 10.x has no" \
    "GET_SHMEM_CONFIG/SHMEM_MAP; set VGPU_QEMU_SHMEM to a QEMU 11 or later)"
[ -x "$QEMU" ] || skip "VGPU_QEMU_SHMEM=$QEMU is not an executable"
version="$("$QEMU" --version | head -n1)"
major="$(sed -n 's/.*version \([0-9]*\)\..*/\1/p' <<<"$version")"
[ -n "$major" ] || skip "cannot read the version of $QEMU ($version)"
[ "$major" -ge 11 ] || skip "$QEMU is $version: vhost-user SHMEM came after QEMU 10"
device="${VGPU_QEMU_DEVICE:-vhost-user-device-pci}"
"$QEMU" -device help 2>/dev/null | grep -q "\"$device\"" \
    || skip "$QEMU has no device named $device (set VGPU_QEMU_DEVICE)"
echo "direct-test: $version, device $device" >&2
exec "$HERE/guest-test.sh" --qemu "$QEMU" --device "$device" --expect-mode direct "$@"
