#!/usr/bin/env bash
# Extract the uncompressed vmlinux (ELF) from a bzImage, using the payload fields of its
# setup header (boot protocol >= 2.08). vgpu-vmm boots it directly, which saves the guest
# the in-guest decompression (seconds at nested-TCG speed).
#
# Usage: ci/rig/l2-vmlinux.sh BZIMAGE OUT
set -euo pipefail
[ $# -eq 2 ] || { sed -n '2,6p' "$0"; exit 2; }
IN="$1"; OUT="$2"
die() { echo "l2-vmlinux: $*" >&2; exit 1; }
[ -f "$IN" ] || die "no such file: $IN"
u8() { od -An -t u1 -j "$1" -N 1 "$IN" | tr -d ' '; }
u32() { od -An -t u4 -j "$1" -N 4 "$IN" | tr -d ' '; }
[ "$(od -An -c -j 514 -N 4 "$IN" | tr -d ' ')" = HdrS ] || die "$IN is not a bzImage"
setup_sects="$(u8 497)"; [ "$setup_sects" != 0 ] || setup_sects=4
off=$(( (setup_sects + 1) * 512 + $(u32 584) ))
len="$(u32 588)"
magic="$(od -An -t x1 -j "$off" -N 4 "$IN" | tr -d ' ')"
case "$magic" in
    1f8b*) dec=(gzip -dc) ;;
    fd377a58) dec=(xz -dc) ;;
    28b52ffd) dec=(zstd -qdc) ;;
    5d0000*) dec=(xz -dc --format=lzma) ;;
    425a68*) dec=(bzip2 -dc) ;;
    894c5a4f) dec=(lzop -dc) ;;
    02214c18) dec=(lz4 -dc) ;;
    *) die "unknown payload compression (magic $magic)" ;;
esac
# Trailing bytes (the decompressed size) make some decompressors complain: ignore that
# and check the result instead.
tail -c +"$((off + 1))" "$IN" | head -c "$len" | "${dec[@]}" > "$OUT.tmp" 2>/dev/null || true
[ "$(head -c 4 "$OUT.tmp" | od -An -c | tr -d ' ')" = '177ELF' ] || { rm -f "$OUT.tmp"; die "extraction failed"; }
mv "$OUT.tmp" "$OUT"
echo "l2-vmlinux: $OUT ($(du -h "$OUT" | cut -f1), ${dec[0]})" >&2
