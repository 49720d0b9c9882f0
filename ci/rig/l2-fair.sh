#!/usr/bin/env bash
# Two-VM fairness with real guests in the nested rig: VM 0's process runs 10 ms kernels,
# VM 1's 1 ms kernels, both saturating the GPU, under a given scheduler policy; L1
# samples the VMs' GPU shares through the control API (ci/rig/fair/). Prints
# "FAIR-RESULT policy=P both_busy_samples=N vm0_mean_share=S".
#
# Usage: ci/rig/l2-fair.sh [--policy fair|none|timeslice] [--sched-args 'FLAGS']
#                          [--expect 'LO HI'] [--secs S] [--no-build] [-- run-l1.sh args]
#   --sched-args  more scheduler flags of vgpu-backend, e.g. "--sched-unshadow-cap 1"
set -euo pipefail
RIG="$(cd "$(dirname "$0")" && pwd)"
POLICY=fair SCHED_ARGS="" EXPECT="" SECS=45 BUILD=() EXTRA=()
while [ $# -gt 0 ]; do
    case "$1" in
        --policy) POLICY="$2"; shift 2 ;;
        --sched-args) SCHED_ARGS="$2"; shift 2 ;;
        --expect) EXPECT="$2"; shift 2 ;;
        --secs) SECS="$2"; shift 2 ;;
        --no-build) BUILD=(--no-build); shift ;;
        --) shift; EXTRA=(-- "$@"); break ;;
        -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
        *) echo "l2-fair: unknown argument: $1" >&2; exit 1 ;;
    esac
done
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
{ echo "FAIR_SECS=$SECS"; cat "$RIG/fair/l2-tenant.sh"; } > "$WORK/l2.sh"
{ echo "FAIR_EXPECT='$EXPECT'"; cat "$RIG/fair/l1-monitor.sh"; } > "$WORK/l1.sh"
"$RIG/l2-vgpu.sh" --guest --vms 2 ${BUILD[@]+"${BUILD[@]}"} --timeout 900 \
    --backend-args "--sched-policy $POLICY $SCHED_ARGS" --l2-cmd "$WORK/l2.sh" --l1-monitor "$WORK/l1.sh" \
    ${EXTRA[@]+"${EXTRA[@]}"}
