#!/usr/bin/env bash
# The direct path under QEMU. Our QEMU (ci/qemu/build.sh) has vhost-user shared memory
# (GET_SHMEM_CONFIG, SHMEM_MAP/UNMAP and the generic device's shared-memory BAR: patches
# 0005/0006, the numbers of QEMU 11.1's series; 0007 for map-over and held stores; 0008
# serves each region as one memory slot with the backend's pages placed by
# mmap(MAP_FIXED)), so vgpu.ko can find the region and submit directly. Three parts:
#   1. QEMU's half, without a guest: ci/qemu/shmem_probe.py (a fake backend: negotiation,
#      the BAR, map/unmap read back through the BAR, refusals, reconnect, reset).
#      A failure fails the test.
#   2. vgpu-backend's region must fit one PCI BAR (a power of two, or QEMU refuses the
#      device): QEMU is started against the backend, no guest. A refusal fails the test.
#   3. The guest test of ci/qemu/guest-test.sh with --expect-mode direct: the guest must
#      come up with submission=direct (sysfs, API) and pass every step, next to a
#      forwarded QEMU guest and a loopback VM (see guest_test.py).
#
# Usage: ci/qemu/direct-test.sh [guest-test.sh options]
# Env: VGPU_QEMU_SHMEM   another QEMU with vhost-user shared memory (e.g. a QEMU >= 11.1)
#      VGPU_QEMU_DEVICE  its generic vhost-user PCI device (default vhost-user-device-pci;
#                        QEMU >= 10.1 calls it vhost-user-test-device-pci)
#      CARGO_TARGET_DIR  as for guest-test.sh
# Prints "SP-STEP"/"SP-RESULT" lines (part 1), then the guest test's "QG-STEP"/"QG-RESULT"
# lines and its exit code ("QG-SKIP direct: <reason>" and exit 0 only for a QEMU given by
# VGPU_QEMU_SHMEM that lacks the device).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
die() { echo "direct-test: $*" >&2; exit 1; }
skip() {
    echo "QG-SKIP direct: $*"
    [ -z "${WORK:-}" ] || rm -rf "$WORK"
    exit 0
}
BUILD=1
for a in "$@"; do [ "$a" = --no-build ] && BUILD=0; done
. "$ROOT/ci/lib.sh"

QEMU="${VGPU_QEMU_SHMEM:-}"
if [ -n "$QEMU" ]; then
    [ -x "$QEMU" ] || skip "VGPU_QEMU_SHMEM=$QEMU is not an executable"
    QEMU_DEVICE="${VGPU_QEMU_DEVICE:-vhost-user-device-pci}"
else
    eval "$("$HERE/build.sh" $([ "$BUILD" = 1 ] || echo --no-install) | grep -E '^QEMU(_DEVICE)?=')"
fi
"$QEMU" -device help 2>/dev/null | grep -q "\"$QEMU_DEVICE\"" \
    || skip "$QEMU has no device named $QEMU_DEVICE (set VGPU_QEMU_DEVICE)"
echo "direct-test: $("$QEMU" --version | head -n1), device $QEMU_DEVICE" >&2

WORK="$(mktemp -d /tmp/vgpu-qemu-direct.XXXXXX)"
BPID=""
cleanup() { [ -z "$BPID" ] || kill "$BPID" 2>/dev/null || true; }
trap cleanup EXIT

# --- 1. QEMU's half -------------------------------------------------------------------
python3 "$HERE/shmem_probe.py" --qemu "$QEMU" --device "$QEMU_DEVICE" --work "$WORK" \
    || { echo "QG-RESULT FAIL QEMU's vhost-user shared memory (shmem_probe.py; logs in $WORK)"; exit 1; }

# --- 2. the backend's regions in one BAR ----------------------------------------------
if [ "$BUILD" = 1 ]; then
    # As the test suite builds it (see guest-test.sh).
    (cd "$ROOT" && cargo test --release --workspace --no-run >&2)
fi
[ -x "$HOSTBIN/vgpu-backend" ] || die "no $HOSTBIN/vgpu-backend (drop --no-build)"
"$HOSTBIN/vgpu-backend" --socket-dir "$WORK" --vm probe >"$WORK/backend.log" 2>&1 &
BPID=$!
for _ in $(seq 100); do [ -S "$WORK/probe.sock" ] && break; sleep 0.1; done
rc=0
timeout 10 "$QEMU" -accel tcg -machine pc -m 64M -nodefaults -display none -S \
    -L /usr/share/seabios -L /usr/share/qemu -serial none -monitor none \
    -chardev "socket,id=c0,path=$WORK/probe.sock" \
    -device "$QEMU_DEVICE,chardev=c0,virtio-id=60,num_vqs=2,vq_size=256,config_size=32" \
    >"$WORK/qemu-probe.log" 2>&1 || rc=$?
kill "$BPID" 2>/dev/null || true
wait "$BPID" 2>/dev/null || true
BPID=""
# QEMU runs until the timeout (124) when it accepts the device.
if [ "$rc" != 124 ]; then
    cat "$WORK/qemu-probe.log" >&2
    echo "QG-RESULT FAIL QEMU does not start the device against vgpu-backend (rc=$rc)"
    exit 1
fi
rm -rf "$WORK"
trap - EXIT

# --- 3. the guest --------------------------------------------------------------------
exec "$HERE/guest-test.sh" --qemu "$QEMU" --device "$QEMU_DEVICE" --expect-mode direct "$@"
