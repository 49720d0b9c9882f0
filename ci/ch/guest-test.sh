#!/usr/bin/env bash
# A Debian guest under Cloud Hypervisor with vgpu.ko, attached to vgpu-backend through
# Cloud Hypervisor's generic vhost-user device (`--generic-vhost-user device_type=60`).
# Cloud Hypervisor needs a real /dev/kvm, so it runs in the nested rig's L1 (as vgpu-vmm
# does in ci/rig/l2-vgpu.sh, which this drives with --ch) next to the backend. By
# default the device is given `shmem=off` (no vhost-user SHMEM), so it runs forwarded
# (protocol.md §9.1); the guest must say so, then pass the rig's guest checks
# (ci/rig/l2-guest-checks.sh: smoke, two processes, hostile, a killed process, the quick
# bench, nothing left in the backend).
# --direct: the device offers vhost-user SHMEM (`shmem=on`, our patches 0004/0005), the
# backend's region 0 is a BAR, and the guest must run direct and pass the same checks
# plus CPU stores through the aperture while the backend moves VRAM under them
# (swap_cpu_stores: each move holds a chunk read-only, the vCPU waits in KVM_RUN's
# EFAULT retry of patch 0005, which gives up only after 10 s with no change of the
# guest's shared-memory mappings; "L2-CH-EFAULT vm=K waits=N" counts the waits). Stores
# rarely meet a moving chunk unless the backend holds them read-only longer:
# `-- --backend-args "--test-hold-read-only-ms 100"` (test-only; ci/test.sh does that).
# Ends with l2-vgpu.sh's verdict (its exit status; "L2-VGPU-CHECK vm=K ..." per VM).
# --migrate: instead of the guest checks, the guest runs verified GPU work
# (ci/rig/l2-migrate-checks.sh: vgpu-smoke back to back, a throttle across the move)
# while L1 live-migrates it to a second Cloud Hypervisor (local: `ch-remote
# send-migration local=on`, same backend); "L2-MIGRATE-CHECK vm=K ... downtime_ms=D".
#
# Usage: ci/ch/guest-test.sh [--vms N] [--direct | --migrate] [--no-build] [--ch BIN] [--timeout S] [-- l2-vgpu.sh args]
#   --vms N      guests at once, one backend (default 1)
#   --direct     direct mode (vhost-user shared memory), see above
#   --migrate    the live-migration test (ch-remote must be beside the cloud-hypervisor)
#   --no-build   use vgpu's binaries and vgpu.ko as built (Cloud Hypervisor still comes
#                from ci/ch/build.sh, which answers from its store when it can)
#   --ch BIN     this cloud-hypervisor instead of ci/ch/build.sh's
# Env: CARGO_TARGET_DIR (default <repo>/target); RIG_LOG (the backend's log filter)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
HERE="$ROOT/ci/ch"
VMS=1 BUILD=1 CH="" TIMEOUT=600 MIGRATE=0 DIRECT=0
EXTRA=()
die() { echo "ch-guest-test: $*" >&2; exit 1; }
while [ $# -gt 0 ]; do
    case "$1" in
        --vms) VMS="$2"; shift 2 ;;
        --migrate) MIGRATE=1; shift ;;
        --direct) DIRECT=1; shift ;;
        --no-build) BUILD=0; shift ;;
        --ch) CH="$2"; shift 2 ;;
        --timeout) TIMEOUT="$2"; shift 2 ;;
        --) shift; EXTRA+=("$@"); break ;;
        -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
        *) die "unknown argument: $1" ;;
    esac
done
[ "$DIRECT" = 0 ] || [ "$MIGRATE" = 0 ] || die "--direct or --migrate, not both"
START=$(date +%s)
if [ -z "$CH" ]; then
    eval "$("$HERE/build.sh" | grep -E '^CH=')"
fi
[ -x "$CH" ] || die "no cloud-hypervisor at $CH"
CHECKS="$ROOT/ci/rig/l2-guest-checks.sh"
MODE=()
# The submission mode the guest must report (guest-checks.sh reads it in the L2).
EXPECT="$(mktemp /tmp/vgpu-ch-expect.XXXXXX)"
trap 'rm -f "$EXPECT"' EXIT
echo forwarded >"$EXPECT"
if [ "$MIGRATE" = 1 ]; then
    CHECKS="$ROOT/ci/rig/l2-migrate-checks.sh"
    MODE=(--migrate)
elif [ "$DIRECT" = 1 ]; then
    echo direct >"$EXPECT"
    MODE=(--ch-shmem)
fi
echo "ch-guest-test: $("$CH" --version | head -n 1), $VMS VM(s), $(cat "$EXPECT")$([ "$MIGRATE" = 0 ] || echo ", live migration") (setup $(( $(date +%s) - START ))s)" >&2
"$ROOT/ci/rig/l2-vgpu.sh" --guest --ch "$CH" --vms "$VMS" --timeout "$TIMEOUT" ${MODE[@]+"${MODE[@]}"} \
    --l2-cmd "$HERE/guest-checks.sh" --add "$CHECKS:/l2-checks.sh" --add "$EXPECT:/ch-expect-mode" \
    $([ "$BUILD" = 1 ] || echo --no-build) ${EXTRA[@]+"${EXTRA[@]}"}
