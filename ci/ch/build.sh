#!/usr/bin/env bash
# Build Cloud Hypervisor (`cloud-hypervisor` and `ch-remote`) from the release source kept
# in ci/ch/source (upstream `git archive` tarballs, checked against SHA256SUMS) with the
# patches in ci/ch/patches, and its one git dependency, micro_http, patched in from the
# tarball beside it, so that only the crate registry is needed. The `vhost` crate it pins
# is patched too (ci/ch/patches/vhost: the crate from the registry, checked against
# Cloud Hypervisor's Cargo.lock, with our patches, patched in from a local path).
# Cached under ${XDG_CACHE_HOME:-~/.cache}/vgpu/ch: the patched source (unpacked again
# when the tarballs or patches change), one cargo target directory for every source (a
# change rebuilds only the crates it touches), and the finished binaries by the hash of
# the tarballs, the patches and this script: a second run prints them at once.
#
# Usage: ci/ch/build.sh [--force]
#   --force   rebuild even if the store has binaries for this source, patches and script
# Env: VGPU_CH_STORE  the cache (default ${XDG_CACHE_HOME:-~/.cache}/vgpu/ch)
#      CH_JOBS        cargo's -j (default: cargo's own)
# Prints, on its last lines:
#   CH=<path of cloud-hypervisor>
#   CH_REMOTE=<path of ch-remote>
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
SRC="$HERE/source"
STORE="${VGPU_CH_STORE:-${XDG_CACHE_HOME:-$HOME/.cache}/vgpu/ch}"
FORCE=0
die() { echo "ch-build: $*" >&2; exit 1; }
log() { echo "ch-build: $*" >&2; }
while [ $# -gt 0 ]; do
    case "$1" in
        --force) FORCE=1; shift ;;
        -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
        *) die "unknown argument: $1" ;;
    esac
done

(cd "$SRC" && sha256sum --quiet -c SHA256SUMS) || die "ci/ch/source does not match its SHA256SUMS"
CH_TAR="$(ls "$SRC"/cloud-hypervisor-v*.tar.xz)"
HTTP_TAR="$(ls "$SRC"/micro-http-*.tar.xz)"
VERSION="$(basename "$CH_TAR" .tar.xz)"; VERSION="${VERSION#cloud-hypervisor-}"
PATCHES=("$HERE"/patches/*.patch)
VHOST_PATCHES=("$HERE"/patches/vhost/*.patch)
SRC_STAMP="$(cat "$SRC/SHA256SUMS" "${PATCHES[@]}" "${VHOST_PATCHES[@]}" | sha256sum | cut -c1-16)"
KEY="$VERSION-$(cat "$SRC/SHA256SUMS" "${PATCHES[@]}" "${VHOST_PATCHES[@]}" "$0" | sha256sum | cut -c1-16)"
BIN_DIR="$STORE/bin-$KEY"

print_result() {
    echo "CH=$BIN_DIR/cloud-hypervisor"
    echo "CH_REMOTE=$BIN_DIR/ch-remote"
}
if [ "$FORCE" = 0 ] && [ -x "$BIN_DIR/cloud-hypervisor" ] && [ -x "$BIN_DIR/ch-remote" ] \
    && "$BIN_DIR/cloud-hypervisor" --version >/dev/null 2>&1; then
    log "from the store: $BIN_DIR ($("$BIN_DIR/cloud-hypervisor" --version | head -n 1))"
    print_result
    exit 0
fi

command -v cargo >/dev/null || die "no cargo"
START=$(date +%s)
WORK="$STORE/src"
mkdir -p "$STORE"
if [ "$(cat "$WORK/.stamp" 2>/dev/null)" != "$SRC_STAMP" ]; then
    log "unpacking $VERSION and applying ${#PATCHES[@]} patch(es), ${#VHOST_PATCHES[@]} to vhost"
    rm -rf "$WORK"; mkdir -p "$WORK"
    # -m: every file new, so that cargo rebuilds what a changed patch touches.
    tar -xmf "$CH_TAR" -C "$WORK"
    tar -xmf "$HTTP_TAR" -C "$WORK"
    mv "$WORK"/cloud-hypervisor-v* "$WORK/cloud-hypervisor"
    mv "$WORK"/micro-http-* "$WORK/micro-http"
    for p in "${PATCHES[@]}"; do
        patch -d "$WORK/cloud-hypervisor" -p1 -s -f <"$p" \
            || die "$(basename "$p") does not apply to $VERSION"
    done
    # vhost: the version Cloud Hypervisor's lock pins, from the registry (cargo fetch
    # brings it when the cache lacks it), checked against the lock's checksum.
    lock="$WORK/cloud-hypervisor/Cargo.lock"
    vhost_ver="$(grep -A1 '^name = "vhost"$' "$lock" | sed -n 's/^version = "\(.*\)"$/\1/p')"
    vhost_sum="$(grep -A3 '^name = "vhost"$' "$lock" | sed -n 's/^checksum = "\(.*\)"$/\1/p')"
    [ -n "$vhost_ver" ] && [ -n "$vhost_sum" ] || die "no vhost in $VERSION's Cargo.lock"
    crate_glob="${CARGO_HOME:-$HOME/.cargo}/registry/cache/*/vhost-$vhost_ver.crate"
    # `|| true`: no match is an answer here, not an error (pipefail would end the script
    # without a word on a machine whose registry cache lacks the crate).
    # shellcheck disable=SC2086
    crate="$(ls $crate_glob 2>/dev/null | head -n 1 || true)"
    if [ -z "$crate" ]; then
        # Fetched through a scratch package that needs only it: Cloud Hypervisor's own
        # workspace cannot resolve before its git dependency is patched to a local path.
        log "fetching vhost $vhost_ver (not in cargo's cache)"
        scratch="$(mktemp -d)"
        mkdir -p "$scratch/src"
        : >"$scratch/src/lib.rs"
        printf '[package]\nname = "fetch-vhost"\nversion = "0.0.0"\nedition = "2021"\n\n[dependencies]\nvhost = "=%s"\n' \
            "$vhost_ver" >"$scratch/Cargo.toml"
        (cd "$scratch" && cargo fetch >&2) || { rm -rf "$scratch"; die "cargo fetch of vhost $vhost_ver failed"; }
        rm -rf "$scratch"
        # shellcheck disable=SC2086
        crate="$(ls $crate_glob 2>/dev/null | head -n 1 || true)"
    fi
    [ -n "$crate" ] || die "vhost $vhost_ver is not in cargo's registry cache"
    echo "$vhost_sum  $crate" | sha256sum --quiet -c - || die "$crate does not match $VERSION's Cargo.lock"
    tar -xzmf "$crate" -C "$WORK"
    mv "$WORK/vhost-$vhost_ver" "$WORK/vhost"
    for p in "${VHOST_PATCHES[@]}"; do
        patch -d "$WORK/vhost" -p1 -s -f <"$p" \
            || die "$(basename "$p") does not apply to vhost $vhost_ver"
    done
    # micro_http is a git dependency upstream: the same commit from a local path.
    cat >>"$WORK/cloud-hypervisor/Cargo.toml" <<'EOF'

[patch."https://github.com/firecracker-microvm/micro-http"]
micro_http = { path = "../micro-http" }

[patch.crates-io]
vhost = { path = "../vhost" }
EOF
    echo "$SRC_STAMP" >"$WORK/.stamp"
fi

# Upstream's release profile is LTO with one codegen unit (slow on a small machine); a test
# VMM does not need it. Everything else is as upstream builds it (default features: kvm,
# io_uring).
log "cargo build --release cloud-hypervisor $VERSION (log: $STORE/build.log)"
(cd "$WORK/cloud-hypervisor" && CARGO_TARGET_DIR="$STORE/target" \
    CARGO_PROFILE_RELEASE_LTO=false CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16 \
    cargo build --release -p cloud-hypervisor --bins ${CH_JOBS:+-j "$CH_JOBS"}) \
    >"$STORE/build.log" 2>&1 || { tail -n 30 "$STORE/build.log" >&2; die "cargo build failed"; }
log "built in $(( $(date +%s) - START ))s"

tmp="$(mktemp -d "$STORE/.new.XXXXXX")"
cp "$STORE/target/release/cloud-hypervisor" "$STORE/target/release/ch-remote" "$tmp/"
"$tmp/cloud-hypervisor" --version >/dev/null || die "the built cloud-hypervisor does not run"
rm -rf "$BIN_DIR"
mv -T "$tmp" "$BIN_DIR"
log "stored as $BIN_DIR ($("$BIN_DIR/cloud-hypervisor" --version | head -n 1))"
print_result
