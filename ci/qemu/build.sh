#!/usr/bin/env bash
# Build QEMU (x86_64-softmmu: KVM, TCG, vhost-user; nothing else) from Debian's source
# package, with the patches in ci/qemu/patches, so that it can attach vgpu-backend as a
# generic vhost-user device (virtio device ID 60). Idempotent; cached under ci/cache/qemu,
# and the finished binary also in a store outside the checkout, keyed by the source
# version and a hash of the patches and this script, so a clean clone on the same machine
# (or a CI that keeps the store) skips the ~16-minute build and the source download.
#
# Usage: ci/qemu/build.sh [--force] [--no-install]
#   --force        rebuild even if the cached binary matches the source and patches
#   --no-install   never call apt-get/pip (fail if something is missing)
# Env: QEMU_SUITES  Debian suites to try, in order (default "trixie-backports trixie"):
#                   the first whose source package can be downloaded is used.
#      VGPU_QEMU_STORE  the store (default ${XDG_CACHE_HOME:-~/.cache}/vgpu/qemu);
#                   --force neither reads it nor is stopped by it
# Prints, on its last lines:
#   QEMU=<path of qemu-system-x86_64>
#   QEMU_DEVICE=<the generic vhost-user PCI device's name in that QEMU>
#   QEMU_BIOS=<directory with bios-256k.bin>
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
HERE="$ROOT/ci/qemu"
CACHE="$ROOT/ci/cache/qemu"
SUITES="${QEMU_SUITES:-trixie-backports trixie}"
FORCE=0
INSTALL=1

STORE="${VGPU_QEMU_STORE:-${XDG_CACHE_HOME:-$HOME/.cache}/vgpu/qemu}"
# What a build depends on besides the source: every patch (the set applied depends on the
# source) and this script.
RECIPE="$(cat "$HERE"/patches/*.patch "$0" | sha256sum | cut -c1-16)"
die() { echo "qemu-build: $*" >&2; exit 1; }
log() { echo "qemu-build: $*" >&2; }

while [ $# -gt 0 ]; do
    case "$1" in
        --force) FORCE=1; shift ;;
        --no-install) INSTALL=0; shift ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
        *) die "unknown argument: $1" ;;
    esac
done

mkdir -p "$CACHE"
export DEBIAN_FRONTEND=noninteractive
APT_LOG="$CACHE/apt.log"
START=$(date +%s)

# --- 1. host packages ---------------------------------------------------------------
need=()
for p in dpkg-dev build-essential pkg-config ninja-build libglib2.0-dev libpixman-1-dev \
         flex bison device-tree-compiler libfdt-dev seabios python3-venv xz-utils; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
    [ "$INSTALL" = 1 ] || die "missing packages: ${need[*]}"
    log "apt-get install ${need[*]} (log: $APT_LOG)"
    timeout 300 apt-get update -qq >"$APT_LOG" 2>&1 || true
    timeout 900 apt-get install -y -q --no-install-recommends "${need[@]}" >>"$APT_LOG" 2>&1 \
        || { tail -n 20 "$APT_LOG" >&2; die "apt-get install failed"; }
fi

# --- 2. source package --------------------------------------------------------------
# A deb-src entry for the suites we try (the machines list binary packages of bookworm only).
SRC_LIST=/etc/apt/sources.list.d/vgpu-qemu-src.sources
want_src="Types: deb-src
URIs: http://deb.debian.org/debian
Suites: $SUITES
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg"
if [ "$(cat "$SRC_LIST" 2>/dev/null)" != "$want_src" ]; then
    [ "$INSTALL" = 1 ] || die "no deb-src entry $SRC_LIST"
    echo "$want_src" >"$SRC_LIST"
    log "apt-get update (deb-src: $SUITES)"
    timeout 300 apt-get update -qq >>"$APT_LOG" 2>&1 || die "apt-get update failed"
fi

# The store: a binary built from this source version with these patches and this script.
print_result() {
    echo "QEMU=$1"
    echo "QEMU_DEVICE=$2"
    echo "QEMU_BIOS=/usr/share/seabios"
}
from_store() {
    local dir="$STORE/$1-$RECIPE"
    [ -x "$dir/qemu-system-x86_64" ] && [ -f "$dir/device" ] || return 1
    "$dir/qemu-system-x86_64" -device help 2>/dev/null | grep -q "\"$(cat "$dir/device")\"" || return 1
    log "from the store: $dir ($1)"
    print_result "$dir/qemu-system-x86_64" "$(cat "$dir/device")"
    exit 0
}
if [ "$FORCE" = 0 ]; then
    # The version each suite offers, from the index alone (no download), in the order the
    # download below tries them: the first suite whose version is in the store answers; a
    # suite whose tarball is on the mirror but not in the store ends the search (the
    # download below would pick it: build it).
    for suite in $SUITES; do
        line="$(apt-get source --print-uris -qq "qemu/$suite" 2>/dev/null \
            | awk '$2 ~ /^qemu_.*\.orig\.tar\.xz$/' | head -n 1)" || true
        [ -n "$line" ] || continue
        ver="$(awk '{print $2}' <<<"$line")"; ver="${ver#qemu_}"; ver="${ver%.orig.tar.xz}"
        from_store "$ver" || true
        url="$(awk '{print $1}' <<<"$line" | tr -d "'")"
        if ! command -v curl >/dev/null || timeout 30 curl -sfIL -o /dev/null "$url"; then
            break
        fi
    done
fi

SRCDIR=""
if [ "$FORCE" = 0 ] && [ -f "$CACHE/source" ]; then
    SRCDIR="$(cat "$CACHE/source")"
    [ -d "$SRCDIR" ] || SRCDIR=""
fi
if [ -z "$SRCDIR" ]; then
    # The index of a suite can name a version whose files are not (yet) on the mirror:
    # try the suites in order and keep the first that downloads.
    for suite in $SUITES; do
        dl="$CACHE/dl-$suite"
        rm -rf "$dl"; mkdir -p "$dl"
        log "apt-get source qemu/$suite"
        if (cd "$dl" && timeout 600 apt-get source --download-only "qemu/$suite" >>"$APT_LOG" 2>&1); then
            orig="$(ls "$dl"/qemu_*.orig.tar.xz 2>/dev/null | head -n 1)"
            [ -n "$orig" ] || { log "  no orig tarball for $suite"; continue; }
            ver="$(basename "$orig" .orig.tar.xz)"; ver="${ver#qemu_}"
            log "  got qemu $ver from $suite; unpacking"
            rm -rf "$CACHE/src-$ver"; mkdir -p "$CACHE/src-$ver"
            tar -xf "$orig" -C "$CACHE/src-$ver" --strip-components=1
            SRCDIR="$CACHE/src-$ver"
            echo "$SRCDIR" >"$CACHE/source"
            rm -rf "$dl"
            break
        fi
        log "  qemu/$suite cannot be downloaded (see $APT_LOG)"
        rm -rf "$dl"
    done
    [ -n "$SRCDIR" ] || die "no QEMU source package could be downloaded from: $SUITES"
fi
VERSION="$(cat "$SRCDIR/VERSION")"
ORIGVER="$(basename "$SRCDIR")"; ORIGVER="${ORIGVER#src-}"   # as in qemu_<ORIGVER>.orig.tar.xz
[ "$FORCE" = 1 ] || from_store "$ORIGVER" || true

# --- 3. patches ---------------------------------------------------------------------
# 0001 names virtio device ID 60 (QEMU asserts on IDs it has no name for); 0003 keeps
# meson from unpacking edk2 images the "+ds" source does not have. QEMU before 10.1 has
# only a non-creatable vhost-user-device-pci (0002 makes it creatable); later ones have
# vhost-user-test-device-pci. 0004 (written against 10.0) makes the generic device wait
# for its chardev at realize and set the vhost device up again after a reconnect.
# 0005 and 0006 (written against 10.0, to the spec of QEMU 11.1's series) add vhost-user
# shared memory: GET_SHMEM_CONFIG, SHMEM_MAP/UNMAP and the device's shared-memory BAR,
# so that vgpu runs direct under this QEMU (docs/testing/rig.md). 0007 goes past that
# spec where vgpu-backend needs it: a map over existing mappings replaces them in one
# memory transaction (shadow switches, read-only views during VRAM moves), a guest store
# to a read-only mapping waits for its replacement, the ack follows the commit and every
# vCPU's TLB flush, and a TCG vCPU reads its TLB entries in the memory map they were
# filled from (a stale entry read in a newer map lost stores during VRAM moves).
# 0008 serves each region as vgpu-vmm does: one RAM region (one KVM memory slot) over a
# reserved window in which SHMEM_MAP places the backend's pages with mmap(MAP_FIXED) and
# SHMEM_UNMAP puts zero-page holes back, so that no map or unmap deletes a memory slot
# (on x86 KVM then drops all of the VM's page tables; docs/benchmarks/virt.md).
if grep -q '"vhost-user-test-device-pci"\|vhost-user-test-device-pci' "$SRCDIR"/hw/virtio/*.c; then
    DEVICE=vhost-user-test-device-pci
    PATCHES=(0001 0003)
else
    DEVICE=vhost-user-device-pci
    PATCHES=(0001 0002 0003 0004 0005 0006 0007 0008)
fi
PATCH_FILES=()
for p in "${PATCHES[@]}"; do PATCH_FILES+=("$(ls "$HERE/patches/$p"-*.patch)"); done
STAMP="$VERSION $(cat "${PATCH_FILES[@]}" "$0" | sha256sum | cut -c1-16)"
# The source keeps copies of the patches applied to it, in order: later patches change
# code of earlier ones (0006 that of 0004), so a patch alone cannot tell whether it is
# applied. Another set is taken off, last first, before this one goes on.
APPLIED="$SRCDIR/.vgpu-patches"
SERIES="$(cat "${PATCH_FILES[@]}" | sha256sum | cut -c1-16)"
if [ -d "$APPLIED" ] && [ "$(cat "$APPLIED/series" 2>/dev/null)" != "$SERIES" ]; then
    for f in $(ls -r "$APPLIED"/*.patch 2>/dev/null); do
        log "unpatch $(basename "$f")"
        patch -d "$SRCDIR" -p1 -R -s -f <"$f" \
            || die "cannot take $(basename "$f") off $SRCDIR (remove it for a fresh source)"
    done
    rm -rf "$APPLIED"
fi
if [ ! -d "$APPLIED" ]; then
    mkdir -p "$APPLIED"
    for f in "${PATCH_FILES[@]}"; do
        # A source patched before the copies were kept: independent patches only.
        if ! patch -d "$SRCDIR" -p1 -R --dry-run -s -f <"$f" >/dev/null 2>&1; then
            log "patch $(basename "$f")"
            patch -d "$SRCDIR" -p1 -s -f <"$f" || die "patch $(basename "$f") does not apply" \
                "to $VERSION (a source patched by an older set: remove $SRCDIR)"
        fi
        cp "$f" "$APPLIED/"
    done
    echo "$SERIES" >"$APPLIED/series"
fi

BUILD="$CACHE/build"
BIN="$BUILD/qemu-system-x86_64"
if [ "$FORCE" = 0 ] && [ -x "$BIN" ] && [ "$(cat "$CACHE/stamp" 2>/dev/null)" = "$STAMP" ]; then
    log "cached: $BIN ($VERSION)"
else
    # --- 4. meson + pycotap in a venv (bookworm's meson is too old) -----------------
    VENV="$CACHE/venv"
    if ! "$VENV/bin/python3" -c 'import mesonbuild, pycotap' 2>/dev/null; then
        [ "$INSTALL" = 1 ] || die "no venv with meson and pycotap at $VENV"
        log "venv: pip install meson pycotap"
        rm -rf "$VENV"
        python3 -m venv "$VENV"
        "$VENV/bin/pip" install -q 'meson>=1.5,<1.9' 'pycotap>=1.1' >>"$APT_LOG" 2>&1 \
            || { tail -n 20 "$APT_LOG" >&2; die "pip install failed"; }
    fi
    export PATH="$VENV/bin:$PATH"

    # --- 5. configure + build -------------------------------------------------------
    # Configured once per source tree; a changed patch only rebuilds what it touches.
    if [ "$FORCE" = 1 ] || [ ! -f "$BUILD/build.ninja" ] \
        || [ "$(cat "$CACHE/configured" 2>/dev/null)" != "$SRCDIR" ]; then
        rm -rf "$BUILD"; mkdir -p "$BUILD"
        log "configure $VERSION (log: $CACHE/build.log)"
        (cd "$BUILD" && "$SRCDIR/configure" --python="$VENV/bin/python3" \
            --target-list=x86_64-softmmu --without-default-features \
            --enable-kvm --enable-vhost-user --enable-tcg --disable-docs \
            --enable-fdt=system --disable-install-blobs --disable-download \
            --disable-werror) >"$CACHE/build.log" 2>&1 \
            || { tail -n 30 "$CACHE/build.log" >&2; die "configure failed"; }
        echo "$SRCDIR" >"$CACHE/configured"
    fi
    log "ninja ($(nproc) jobs)"
    (cd "$BUILD" && ninja qemu-system-x86_64) >>"$CACHE/build.log" 2>&1 \
        || { tail -n 30 "$CACHE/build.log" >&2; die "build failed"; }
    echo "$STAMP" >"$CACHE/stamp"
    log "built $BIN in $(( $(date +%s) - START ))s"
fi

"$BIN" -device help 2>/dev/null | grep -q "\"$DEVICE\"" \
    || die "$BIN has no device $DEVICE"
echo "$DEVICE" >"$CACHE/device"
# Into the store (a failure here costs only the next clone a build).
dst="$STORE/$ORIGVER-$RECIPE"
if [ ! -x "$dst/qemu-system-x86_64" ] && mkdir -p "$STORE" 2>/dev/null; then
    tmp="$(mktemp -d "$STORE/.new.XXXXXX")" \
        && cp "$BIN" "$tmp/qemu-system-x86_64" && echo "$DEVICE" >"$tmp/device" \
        && { mv -T "$tmp" "$dst" 2>/dev/null || rm -rf "$tmp"; } \
        && log "stored as $dst" || log "warning: could not store the binary in $STORE"
fi
print_result "$BIN" "$DEVICE"
