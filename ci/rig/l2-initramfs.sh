#!/usr/bin/env bash
# Build a tiny busybox initramfs for an L2 guest booted by vgpu-vmm inside the rig's L1.
# Its /init prints "L2-UP uptime=<s> cpus=<n>", runs /l2-cmd.sh if present, then
# reboots (with `reboot=k` on the L2 command line: an i8042 reset, which ends vgpu-vmm).
#
# Usage: ci/rig/l2-initramfs.sh [--out FILE] [--add SRC:DST]...
# Prints the path of the initramfs (default ci/cache/rig/l2.cpio.gz) on its last line.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUT="$ROOT/ci/cache/rig/l2.cpio.gz"
ADDS=()
die() { echo "l2-initramfs: $*" >&2; exit 1; }
while [ $# -gt 0 ]; do
    case "$1" in
        --out) [ $# -ge 2 ] || die "--out needs FILE"; OUT="$2"; shift 2 ;;
        --add) [ $# -ge 2 ] || die "--add needs SRC:DST"; ADDS+=("$2"); shift 2 ;;
        -h|--help) sed -n '2,7p' "$0"; exit 0 ;;
        *) die "unknown argument: $1" ;;
    esac
done
BUSYBOX="$(command -v busybox || true)"
[ -n "$BUSYBOX" ] || die "busybox missing (apt-get install busybox-static)"
file -L "$BUSYBOX" 2>/dev/null | grep -q "statically linked" || die "$BUSYBOX is not static"

STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE"/{bin,sbin,proc,sys,dev,tmp}
cp "$BUSYBOX" "$STAGE/bin/busybox"
for a in sh echo cat mount reboot poweroff grep cut sleep uname dmesg ls; do
    ln -s busybox "$STAGE/bin/$a"
done
cat > "$STAGE/init" <<'INIT'
#!/bin/sh
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
exec 0</dev/console 1>/dev/console 2>&1
read -r up _ < /proc/uptime
echo "L2-UP uptime=${up}s cpus=$(grep -c ^processor /proc/cpuinfo) kernel=$(uname -r)"
[ -f /l2-cmd.sh ] && sh /l2-cmd.sh
echo "L2-DONE"
reboot -f
INIT
chmod 0755 "$STAGE/init"
for spec in ${ADDS[@]+"${ADDS[@]}"}; do
    src="${spec%%:*}"; dst="/${spec#*:}"; dst="${dst#//}"
    [ -e "$src" ] || die "--add: no such file: $src"
    mkdir -p "$STAGE$(dirname "/$dst")"
    cp -aL "$src" "$STAGE/$dst"
done
mkdir -p "$(dirname "$OUT")"
(cd "$STAGE" && find . -mindepth 1 | LC_ALL=C sort | cpio -o -H newc --quiet -R 0:0) | gzip -9 > "$OUT"
echo "l2-initramfs: $OUT ($(du -h "$OUT" | cut -f1))" >&2
echo "$OUT"
