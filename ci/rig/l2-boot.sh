#!/usr/bin/env bash
# Boot an L2 Linux with vgpu-vmm inside the rig's L1 and check that it reaches userspace.
# Builds the static vgpu-vmm (musl), the L2 initramfs (l2-initramfs.sh), boots L1
# (run-l1.sh) and runs vgpu-vmm there on the rig's own Debian kernel.
# Success: L2 prints "L2-UP" and ends by an i8042 reset, vgpu-vmm exits 0.
#
# Usage: ci/rig/l2-boot.sh [--vcpus N] [--mem-mib M] [--append 'L2 ARGS'] [--quiet-l2]
#                          [--vmlinux] [--no-build] [--timeout S] [--l2-cmd FILE]
#                          [-- run-l1.sh args]
#   --vmlinux   boot the uncompressed vmlinux (l2-vmlinux.sh) instead of the bzImage:
#               no in-guest decompression, but a ~30 MB larger L1 initramfs
# Env: CARGO_TARGET_DIR (default <repo>/target)
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
RIG="$ROOT/ci/rig"
VCPUS=1
MEM=256
APPEND=""
QUIET_L2=0
BUILD=1
TIMEOUT=300
L2CMD=""
VMLINUX=0
EXTRA=()
die() { echo "l2-boot: $*" >&2; exit 1; }
while [ $# -gt 0 ]; do
    case "$1" in
        --vcpus) VCPUS="$2"; shift 2 ;;
        --mem-mib) MEM="$2"; shift 2 ;;
        --append) APPEND="$2"; shift 2 ;;
        --quiet-l2) QUIET_L2=1; shift ;;
        --vmlinux) VMLINUX=1; shift ;;
        --no-build) BUILD=0; shift ;;
        --timeout) TIMEOUT="$2"; shift 2 ;;
        --l2-cmd) L2CMD="$2"; shift 2 ;;
        --) shift; EXTRA+=("$@"); break ;;
        -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
        *) die "unknown argument: $1" ;;
    esac
done

. "$ROOT/ci/lib.sh"
BIN="$MUSL/vgpu-vmm"
[ "$BUILD" = 0 ] || musl_build -p vgpu-vmm --bin vgpu-vmm
[ -x "$BIN" ] || die "no static vgpu-vmm at $BIN (drop --no-build)"
rig_kernel

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
if [ "$VMLINUX" = 1 ]; then
    "$RIG/l2-vmlinux.sh" "$KERNEL" "$WORK/vmlinux"
    KERNEL="$WORK/vmlinux"
fi
l2_adds=()
[ -z "$L2CMD" ] || l2_adds=(--add "$L2CMD:/l2-cmd.sh")
"$RIG/l2-initramfs.sh" --out "$WORK/l2.cpio.gz" ${l2_adds[@]+"${l2_adds[@]}"} >/dev/null

L2_ARGS="console=ttyS0 reboot=k panic=1 pci=off nomodule i8042.noaux i8042.nokbd i8042.nomux i8042.nopnp"
[ "$QUIET_L2" = 0 ] || L2_ARGS="$L2_ARGS quiet"
[ -z "$APPEND" ] || L2_ARGS="$L2_ARGS $APPEND"

cat > "$WORK/cmd.sh" <<CMD
: > /tmp/l2-serial.log
tail -f /tmp/l2-serial.log &
tp=\$!
read -r t0 _ < /proc/uptime
RUST_LOG=info vgpu-vmm --kernel /l2/vmlinuz --initrd /l2/l2.cpio.gz --mem-mib $MEM \\
    --vcpus $VCPUS --timeout $((TIMEOUT - 30)) --cmdline "$L2_ARGS" --serial /tmp/l2-serial.log
rc=\$?
read -r t1 _ < /proc/uptime
sleep 1; kill \$tp
up=\$(grep -a -o 'L2-UP uptime=[0-9.]*' /tmp/l2-serial.log | cut -d= -f2)
echo "L2-RESULT vmm_rc=\$rc l2_uptime_at_init=\${up:-none}s vmm_wall=\$(awk -v a=\$t0 -v b=\$t1 'BEGIN{printf "%.2f", b-a}')s"
[ "\$rc" = 0 ] && [ -n "\$up" ]
CMD

"$RIG/run-l1.sh" --timeout "$TIMEOUT" --script "$WORK/cmd.sh" \
    --add "$BIN:/bin/vgpu-vmm" --add "$KERNEL:/l2/vmlinuz" --add "$WORK/l2.cpio.gz:/l2/l2.cpio.gz" \
    ${EXTRA[@]+"${EXTRA[@]}"}
