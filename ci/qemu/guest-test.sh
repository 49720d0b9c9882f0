#!/usr/bin/env bash
# A Debian guest under QEMU (TCG, built by ci/qemu/build.sh) with vgpu.ko, attached to
# vgpu-backend through QEMU's generic vhost-user device, started without vhost-user
# shared memory (shmem=off, patch 0006), so the device runs in forwarded mode (protocol.md
# §9.1; --expect-mode direct leaves shared memory on). The same backend serves a
# loopback VM in direct mode on the host. ci/qemu/guest_test.py then checks: the guest
# passes the rig's guest checks (vgpu-smoke, hostile, ...); both VMs share the GPU within
# 3 pp of their entitlement; a guest reboot (QMP system_reset) and a backend restart
# (QEMU reconnects) are survived. Prints "QG-STEP ..." lines and "QG-RESULT ok|FAIL ...".
#
# Usage: ci/qemu/guest-test.sh [--no-build] [--fair-secs S] [--keep]
#                              [--qemu BIN --device NAME] [--expect-mode forwarded|direct]
#                              [--bench]
#   --no-build   use the binaries, vgpu.ko and QEMU already built
#   --keep       keep the work directory (logs) even on success
#   --qemu/--device  another QEMU (and its generic vhost-user device's name) instead of
#                the one ci/qemu/build.sh builds; --expect-mode direct for one with SHMEM
#                (ci/qemu/direct-test.sh; a second, forwarded QEMU guest joins the
#                fairness run)
#   --bench      also time submissions in each QEMU guest (vgpu-guest-bench --submit-only)
# Env: CARGO_TARGET_DIR (default <repo>/target)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
HERE="$ROOT/ci/qemu"
RIG="$ROOT/ci/rig"
BUILD=1 FAIR_SECS=40 KEEP=0 QEMU_OVERRIDE="" DEVICE_OVERRIDE="" EXPECT_MODE=forwarded BENCH=""
die() { echo "guest-test: $*" >&2; exit 1; }
while [ $# -gt 0 ]; do
    case "$1" in
        --no-build) BUILD=0; shift ;;
        --fair-secs) FAIR_SECS="$2"; shift 2 ;;
        --keep) KEEP=1; shift ;;
        --qemu) QEMU_OVERRIDE="$2"; shift 2 ;;
        --device) DEVICE_OVERRIDE="$2"; shift 2 ;;
        --expect-mode) EXPECT_MODE="$2"; shift 2 ;;
        --bench) BENCH=--bench; shift ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
        *) die "unknown argument: $1" ;;
    esac
done
START=$(date +%s)
. "$ROOT/ci/lib.sh"

# QEMU (cached), the rig's Debian kernel + modules + headers (cached).
if [ -n "$QEMU_OVERRIDE" ]; then
    QEMU="$QEMU_OVERRIDE" QEMU_DEVICE="${DEVICE_OVERRIDE:-vhost-user-device-pci}"
else
    eval "$("$HERE/build.sh" $([ "$BUILD" = 1 ] || echo --no-install) | grep -E '^QEMU(_DEVICE)?=')"
fi
rig_kernel
[ -f /usr/share/qemu/linuxboot_dma.bin ] || apt-get install -y -q --no-install-recommends qemu-system-data >&2

if [ "$BUILD" = 1 ]; then
    musl_build_guest_tools
    # The host binaries as the test suite builds them (`cargo test --workspace`: vgpu-bench
    # turns on the tools' loopback feature): after CI's test step a no-op, where a `-p`
    # build's own feature set compiled the backend, the VMM and the tools again (~3.5 min
    # of a CI run).
    (cd "$ROOT" && cargo test --release --workspace --no-run >&2)
    build_guest_driver
fi
DRIVER="$ROOT/guest-driver/kernel/vgpu.ko"
modinfo -F vermagic "$DRIVER" | grep -q "^$KVER " || die "$DRIVER is not built for $KVER"
for b in vgpu-backend vgpuctl vgpu-throttle vgpu-smoke; do
    [ -x "$HOSTBIN/$b" ] || die "no $HOSTBIN/$b (drop --no-build)"
done

WORK="$(mktemp -d /tmp/vgpu-qemu-test.XXXXXX)"
cleanup() { [ "$KEEP" = 1 ] || [ "${RC:-1}" != 0 ] || rm -rf "$WORK"; }
trap cleanup EXIT
# The guest: the rig's L2 initramfs with virtio_pci, vgpu.ko, the static tools, the rig's
# guest checks, and our command loop as /l2-cmd.sh.
adds=()
add_virtio_mods adds
add_guest_tools "$WORK" adds
{ echo "VIRTIO_MODS='$VIRTIO_MODS'"; cat "$HERE/guest-cmd.sh"; } > "$WORK/l2-cmd.sh"
adds+=(--add "$DRIVER:/mods/vgpu.ko" --add "$WORK/l2-cmd.sh:/l2-cmd.sh"
       --add "$RIG/l2-guest-checks.sh:/l2-guest-checks.sh")
INITRD="$("$RIG/l2-initramfs.sh" --out "$WORK/guest.cpio.gz" "${adds[@]}")"

echo "guest-test: QEMU $QEMU ($QEMU_DEVICE), kernel $KVER, work $WORK (setup $(( $(date +%s) - START ))s)" >&2
RC=0
python3 "$HERE/guest_test.py" --qemu "$QEMU" --device "$QEMU_DEVICE" --kernel "$KERNEL" \
    --initrd "$INITRD" --backend "$HOSTBIN/vgpu-backend" --vgpuctl "$HOSTBIN/vgpuctl" \
    --throttle "$HOSTBIN/vgpu-throttle" --smoke "$HOSTBIN/vgpu-smoke" --work "$WORK" --log "$WORK/guest.log" \
    --fair-secs "$FAIR_SECS" --expect-mode "$EXPECT_MODE" $BENCH || RC=$?
echo "guest-test: total $(( $(date +%s) - START ))s; logs in $WORK$([ "$RC" = 0 ] && [ "$KEEP" = 0 ] && echo ' (removed)')" >&2
exit $RC
