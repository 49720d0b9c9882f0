#!/usr/bin/env bash
# Build the L1 image of the nested test rig: a Debian kernel plus a busybox initramfs
# that loads kvm-amd, so that an L1 booted under QEMU TCG (-cpu EPYC,+svm,+npt) has a
# real /dev/kvm. Idempotent; everything is cached under ci/cache/rig.
#
# Usage: ci/rig/build-l1.sh [--add SRC:DST]... [--module NAME]... [--out FILE]
#                           [--no-headers] [--no-install]
#   --add SRC:DST   copy SRC (file or directory) to DST inside the initramfs (repeatable)
#   --module NAME   also load kernel module NAME (and its dependencies) in L1 (repeatable)
#   --out FILE      initramfs to write (default ci/cache/rig/l1.cpio.gz)
#   --no-headers    do not install the matching linux-headers package (used to build
#                   out-of-tree modules such as the guest driver)
#   --no-install    never call apt-get install (fail if a tool is missing)
# Env: RIG_KERNEL_PKG  kernel package to use (default: what linux-image-amd64 depends on)
# Prints the paths of the kernel and initramfs on its last two lines.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
RIG_DIR="$ROOT/ci/rig"
CACHE="$ROOT/ci/cache/rig"
OUT="$CACHE/l1.cpio.gz"
ADDS=()
MODULES=(irqbypass kvm ccp kvm-amd)
HEADERS=1
INSTALL=1

die() { echo "build-l1: $*" >&2; exit 1; }
log() { echo "build-l1: $*" >&2; }

while [ $# -gt 0 ]; do
    case "$1" in
        --add) [ $# -ge 2 ] || die "--add needs SRC:DST"; ADDS+=("$2"); shift 2 ;;
        --add=*) ADDS+=("${1#--add=}"); shift ;;
        --module) [ $# -ge 2 ] || die "--module needs NAME"; MODULES+=("$2"); shift 2 ;;
        --out) [ $# -ge 2 ] || die "--out needs FILE"; OUT="$2"; shift 2 ;;
        --no-headers) HEADERS=0; shift ;;
        --no-install) INSTALL=0; shift ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
        *) die "unknown argument: $1" ;;
    esac
done

mkdir -p "$CACHE/debs"
export DEBIAN_FRONTEND=noninteractive
APT_UPDATED=0
APT_LOG="$CACHE/apt.log"
apt_install() {
    log "apt-get install $* (log: $APT_LOG)"
    timeout 600 apt-get install -y -q --no-install-recommends "$@" >"$APT_LOG" 2>&1 \
        || { tail -n 20 "$APT_LOG" >&2; die "apt-get install $* failed"; }
}
apt_update() {
    if [ "$APT_UPDATED" = 0 ]; then
        log "apt-get update"
        timeout 300 apt-get update -qq
        APT_UPDATED=1
    fi
}

# --- 1. host packages ---------------------------------------------------------------
need_pkgs=()
for p in qemu-system-x86 busybox-static cpio kmod xz-utils zstd gzip file; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need_pkgs+=("$p")
done
if [ ${#need_pkgs[@]} -gt 0 ]; then
    [ "$INSTALL" = 1 ] || die "missing packages: ${need_pkgs[*]}"
    apt_update
    apt_install "${need_pkgs[@]}"
fi

# --- 2. guest kernel ----------------------------------------------------------------
KPKG="${RIG_KERNEL_PKG:-}"
if [ -z "$KPKG" ]; then
    resolve() { apt-cache depends linux-image-amd64 2>/dev/null \
        | awk '/Depends: linux-image-[0-9]/ {print $2; exit}'; }
    KPKG="$(resolve || true)"
    if [ -z "$KPKG" ]; then apt_update; KPKG="$(resolve || true)"; fi
    [ -n "$KPKG" ] || die "cannot resolve the dependency of linux-image-amd64"
fi
KVER="${KPKG#linux-image-}"          # e.g. 6.1.0-56-amd64
KROOT="$CACHE/kernel-$KVER"
if [ ! -f "$KROOT/.done" ]; then
    log "fetching $KPKG"
    rm -rf "$KROOT" "$CACHE/debs/$KPKG"
    mkdir -p "$CACHE/debs/$KPKG"
    fetch() { (cd "$CACHE/debs/$KPKG" && timeout 300 apt-get download -qq \
        -o APT::Sandbox::User=root "$KPKG" >&2); }
    fetch || { apt_update; fetch; }
    deb="$(ls "$CACHE/debs/$KPKG"/*.deb)"
    mkdir -p "$KROOT"
    dpkg -x "$deb" "$KROOT"
    # The package's postinst runs depmod; we do it on the unpacked tree.
    depmod -b "$KROOT" "$KVER"
    touch "$KROOT/.done"
fi
VMLINUZ="$KROOT/boot/vmlinuz-$KVER"
[ -f "$VMLINUZ" ] || die "no kernel image in $KROOT"
ln -sfn "kernel-$KVER/boot/vmlinuz-$KVER" "$CACHE/vmlinuz"

if [ "$HEADERS" = 1 ] && ! dpkg-query -W -f='${Status}' "linux-headers-$KVER" 2>/dev/null \
        | grep -q "install ok installed"; then
    if [ "$INSTALL" = 1 ]; then
        apt_update
        apt_install "linux-headers-$KVER"
    else
        log "warning: linux-headers-$KVER is not installed"
    fi
fi

# --- 3. initramfs -------------------------------------------------------------------
STAGE="$(mktemp -d "$CACHE/stage.XXXXXX")"
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE"/{bin,sbin,usr/bin,usr/sbin,etc,proc,sys,dev,tmp,run,root,rig,lib/modules/rig}

cp /bin/busybox "$STAGE/bin/busybox"
# Symlinks for every applet, at build time (no `busybox --install` at boot).
while read -r applet; do
    [ "$applet" = bin/busybox ] && continue
    [ -e "$STAGE/$applet" ] || ln -s /bin/busybox "$STAGE/$applet"
done < <(/bin/busybox --list-full)

# Modules in load order, dependencies first (from modules.dep via modprobe -d).
: > "$STAGE/etc/rig-modules"
declare -A seen=()
for m in "${MODULES[@]}"; do
    deps="$(modprobe -d "$KROOT" -S "$KVER" --show-depends "$m")" \
        || die "module $m not found for $KVER"
    while read -r kind path _; do
        [ "$kind" = insmod ] || continue          # "builtin X" needs nothing
        name="$(basename "$path")"
        name="${name%.xz}"; name="${name%.zst}"; name="${name%.gz}"
        [ -n "${seen[$name]:-}" ] && continue
        seen[$name]=1
        # busybox insmod cannot be trusted with compressed modules: decompress here.
        case "$path" in
            *.ko.xz) xz -dc "$path" > "$STAGE/lib/modules/rig/$name" ;;
            *.ko.zst) zstd -qdc "$path" > "$STAGE/lib/modules/rig/$name" ;;
            *.ko.gz) gzip -dc "$path" > "$STAGE/lib/modules/rig/$name" ;;
            *) cp "$path" "$STAGE/lib/modules/rig/$name" ;;
        esac
        echo "$name" >> "$STAGE/etc/rig-modules"
    done <<< "$deps"
done
log "modules: $(tr '\n' ' ' < "$STAGE/etc/rig-modules")"

install -m 0755 "$RIG_DIR/init" "$STAGE/init"
echo "$KVER" > "$STAGE/etc/rig-kernel"
echo "root:x:0:0:root:/root:/bin/sh" > "$STAGE/etc/passwd"
echo "root:x:0:" > "$STAGE/etc/group"

for spec in ${ADDS[@]+"${ADDS[@]}"}; do
    src="${spec%%:*}"; dst="${spec#*:}"
    if [ "$src" = "$spec" ] || [ -z "$dst" ]; then die "--add wants SRC:DST, got '$spec'"; fi
    [ -e "$src" ] || die "--add: no such file: $src"
    dst="/${dst#/}"
    mkdir -p "$STAGE$(dirname "$dst")"
    if [ -d "$src" ]; then
        mkdir -p "$STAGE$dst"; cp -a "$src/." "$STAGE$dst/"
    else
        cp -L "$src" "$STAGE$dst"
    fi
    log "added $src -> $dst"
done

mkdir -p "$(dirname "$OUT")"
(cd "$STAGE" && find . -mindepth 1 | LC_ALL=C sort | cpio -o -H newc --quiet -R 0:0) \
    | gzip -1 > "$OUT.tmp"
mv "$OUT.tmp" "$OUT"
log "initramfs $OUT ($(du -h "$OUT" | cut -f1)), kernel $KVER"
echo "$CACHE/vmlinuz"
echo "$OUT"
