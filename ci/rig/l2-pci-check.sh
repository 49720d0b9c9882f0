#!/usr/bin/env bash
# Boot an L2 Linux with `vgpu-vmm --vgpu-stub` inside the rig's L1 and check that L2's PCI
# core enumerates the vgpu virtio-pci function (sysfs: vendor 0x1af4, device 0x107c) and
# that Linux's virtio_pci driver (loaded from the rig kernel's modules) probes it as virtio
# device 60 (/sys/bus/virtio/devices/*/device = 0x003c).
# Success: the L2 check prints "L2-PCI-RESULT found=1 virtio=1", vgpu-vmm exits 0.
#
# Usage: ci/rig/l2-pci-check.sh [--no-build] [--no-virtio] [--timeout S] [-- run-l1.sh args]
# Env: CARGO_TARGET_DIR (default <repo>/target)
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
RIG="$ROOT/ci/rig"
BUILD=1
VIRTIO=1
TIMEOUT=300
EXTRA=()
die() { echo "l2-pci-check: $*" >&2; exit 1; }
while [ $# -gt 0 ]; do
    case "$1" in
        --no-build) BUILD=0; shift ;;
        --no-virtio) VIRTIO=0; shift ;;
        --timeout) TIMEOUT="$2"; shift 2 ;;
        --) shift; EXTRA+=("$@"); break ;;
        -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
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

# The check that runs in L2 (busybox sh; no lspci: read sysfs).
l2_adds=(--add "$WORK/l2-cmd.sh:/l2-cmd.sh")
[ "$VIRTIO" = 0 ] || add_virtio_mods l2_adds
{ echo "VIRTIO_MODS='$VIRTIO_MODS'"; cat <<'L2'
found=0
for d in /sys/bus/pci/devices/*; do
    [ -e "$d/vendor" ] || continue
    v=$(cat "$d/vendor"); id=$(cat "$d/device"); cls=$(cat "$d/class")
    echo "L2-PCI ${d##*/} vendor=$v device=$id class=$cls"
    if [ "$v" = 0x1af4 ] && [ "$id" = 0x107c ]; then
        found=1
        echo "L2-PCI-RESOURCES"; cat "$d/resource"
    fi
done
virtio=0
if [ -d /mods ]; then
    for m in $VIRTIO_MODS; do
        busybox insmod "/mods/$m.ko" || echo "L2-INSMOD-FAIL $m"
    done
    for v in /sys/bus/virtio/devices/*; do
        [ -e "$v/device" ] || continue
        echo "L2-VIRTIO ${v##*/} device=$(cat "$v/device") vendor=$(cat "$v/vendor") status=$(cat "$v/status" 2>/dev/null)"
        [ "$(cat "$v/device")" = 0x003c ] && virtio=1
    done
else
    virtio=skipped
fi
dmesg | grep -i -E 'pci|virtio' | grep -v -i 'acpi'
echo "L2-PCI-RESULT found=$found virtio=$virtio"
L2
} > "$WORK/l2-cmd.sh"
"$RIG/l2-initramfs.sh" --out "$WORK/l2.cpio.gz" "${l2_adds[@]}" >/dev/null

L2_ARGS="console=ttyS0 reboot=k panic=1 pci=conf1 i8042.noaux i8042.nokbd i8042.nomux i8042.nopnp"
EXPECT="found=1 virtio=1"
[ "$VIRTIO" = 1 ] || EXPECT="found=1 virtio=skipped"

cat > "$WORK/cmd.sh" <<CMD
: > /tmp/l2-serial.log
tail -f /tmp/l2-serial.log &
tp=\$!
RUST_LOG=info vgpu-vmm --vgpu-stub --kernel /l2/vmlinuz --initrd /l2/l2.cpio.gz --mem-mib 256 \\
    --timeout $((TIMEOUT - 30)) --cmdline "$L2_ARGS" --serial /tmp/l2-serial.log
rc=\$?
sleep 1; kill \$tp
res=\$(grep -a -o 'L2-PCI-RESULT.*' /tmp/l2-serial.log | tr -d '\r')
echo "L2-PCI-CHECK vmm_rc=\$rc \${res:-no result}"
[ "\$rc" = 0 ] && [ "\$res" = "L2-PCI-RESULT $EXPECT" ]
CMD

"$RIG/run-l1.sh" --timeout "$TIMEOUT" --script "$WORK/cmd.sh" \
    --add "$BIN:/bin/vgpu-vmm" --add "$KERNEL:/l2/vmlinuz" --add "$WORK/l2.cpio.gz:/l2/l2.cpio.gz" \
    ${EXTRA[@]+"${EXTRA[@]}"}
