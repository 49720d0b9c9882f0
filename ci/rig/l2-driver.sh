#!/usr/bin/env bash
# Boot an L2 Linux under vgpu-vmm inside the rig's L1 with the guest driver vgpu.ko and
# the static guest tools (vgpu-smoke, vgpu-throttle, vgpu-guest-bench) in its initramfs; load
# the virtio modules and vgpu.ko, run a command in L2, print its result.
#
# --backend real (default): vgpu-backend runs in L1 (sim GPU) and vgpu-vmm connects to
# it (--vgpu-socket). Default L2 command: vgpu-smoke (every builtin kernel on VRAM and
# guest-RAM buffers, verified), then two vgpu-smoke processes at once, then
# vgpu-smoke --hostile (bad arguments, forged ids, another process's slots), then the
# VM's GPU objects must all be gone again (GET_STATS: no context, channel, VRAM, mapping).
#
# --backend stub (vgpu-vmm --vgpu-stub, whose device never answers requests): /dev/vgpu
# appears after probe (shared-memory region found, queues set up), a request times out
# with ETIMEDOUT instead of hanging (twice: the ring copes with abandoned requests),
# `vgpu-smoke --hostile` gets the right errno for every argument the driver refuses on its
# own, and `rmmod vgpu` works afterwards.
#   Success: "L2-DRIVER-RESULT rc=0" and vgpu-vmm exits 0.
#
# Usage: ci/rig/l2-driver.sh [--backend real|stub] [--no-build] [--timeout S]
#            [--vmm-args 'ARGS'] [--insmod-args 'PARAMS']
#            [--l2-cmd 'SH CODE' | --l2-script FILE] [--l1-pre 'SH CODE'] [-- run-l1.sh args]
#   --vmm-args   device options of vgpu-vmm (default per --backend)
#   --insmod-args  vgpu.ko parameters (default: request_timeout_ms=2000 reset_on_timeout=0 for the stub:
#                it never answers, so no reset would help; none for the real backend)
#   --l2-cmd/--l2-script  what runs in L2 after the modules are loaded (busybox sh);
#                its exit status is the result (e.g. --l2-cmd vgpu-smoke)
#   --l1-pre     shell code run in L1 before vgpu-vmm starts (e.g. start a backend)
# Env: CARGO_TARGET_DIR (default <repo>/target), KVER (default: the rig kernel's version)
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
RIG="$ROOT/ci/rig"
BUILD=1
TIMEOUT=480
BACKEND=real
VMM_ARGS=""
INSMOD_ARGS=""
# The sim GPU's longest idle sleep (µs), in L1's backend and in L1's native run alike: a
# shorter one starves L2's vCPU of L1's single emulated CPU.
IDLE_US=5000
L2_CMD=""
L2_SCRIPT=""
L1_PRE=""
EXTRA=()
die() { echo "l2-driver: $*" >&2; exit 1; }
while [ $# -gt 0 ]; do
    case "$1" in
        --backend) BACKEND="$2"; shift 2 ;;
        --no-build) BUILD=0; shift ;;
        --timeout) TIMEOUT="$2"; shift 2 ;;
        --vmm-args) VMM_ARGS="$2"; shift 2 ;;
        --insmod-args) INSMOD_ARGS="$2"; shift 2 ;;
        --l2-cmd) L2_CMD="$2"; shift 2 ;;
        --l2-script) L2_SCRIPT="$2"; shift 2 ;;
        --l1-pre) L1_PRE="$2"; shift 2 ;;
        --) shift; EXTRA+=("$@"); break ;;
        -h|--help) sed -n '2,32p' "$0"; exit 0 ;;
        *) die "unknown argument: $1" ;;
    esac
done
[ -z "$L2_CMD" ] || [ -z "$L2_SCRIPT" ] || die "--l2-cmd and --l2-script are exclusive"
case "$BACKEND" in
    stub) VMM_ARGS="${VMM_ARGS:---vgpu-stub}"; INSMOD_ARGS="${INSMOD_ARGS:-request_timeout_ms=2000 reset_on_timeout=0}" ;;
    real) VMM_ARGS="${VMM_ARGS:---vgpu-socket /tmp/vgpu/vm1.sock}"
          L1_PRE="mkdir -p /tmp/vgpu
RUST_LOG=warn vgpu-backend --socket-dir /tmp/vgpu --vm vm1 --vram-mib 256 --sim-idle-sleep-us $IDLE_US > /tmp/backend.log 2>&1 &
for i in \$(seq 1 100); do [ -S /tmp/vgpu/vm1.sock ] && break; sleep 0.1; done
$L1_PRE" ;;
    *) die "--backend real|stub" ;;
esac

. "$ROOT/ci/lib.sh"
rig_kernel "${KVER:-}"

if [ "$BUILD" = 1 ]; then
    # Host programs for L1 (vgpu-bench: the native baseline of the guest suite).
    musl_build -p vgpu-vmm -p vgpu-backend -p vgpu-bench \
        --bin vgpu-vmm --bin vgpu-backend --bin vgpu-bench
    musl_build_guest_tools
    build_guest_driver
fi
KO="$ROOT/guest-driver/kernel/vgpu.ko"
[ -f "$KO" ] || die "no $KO (drop --no-build)"
[ -x "$MUSL/vgpu-vmm" ] || die "no static vgpu-vmm in $MUSL (drop --no-build)"
modinfo -F vermagic "$KO" | grep -q "^$KVER " || die "$KO is not built for $KVER"

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

[ "$BACKEND" != real ] || strip -o "$WORK/vgpu-backend" "$MUSL/vgpu-backend"
[ "$BACKEND" != real ] || strip -o "$WORK/vgpu-bench" "$MUSL/vgpu-bench"
l2_adds=(--add "$WORK/l2-cmd.sh:/l2-cmd.sh" --add "$KO:/mods/vgpu.ko")
add_guest_tools "$WORK" l2_adds
add_virtio_mods l2_adds

if [ -n "$L2_SCRIPT" ]; then
    cp "$L2_SCRIPT" "$WORK/user.sh"
elif [ -n "$L2_CMD" ]; then
    printf '%s\n' "$L2_CMD" > "$WORK/user.sh"
elif [ "$BACKEND" = real ]; then
    # The same guest checks as l2-vgpu.sh --guest (exit status 0 iff all passed).
    cp "$RIG/l2-guest-checks.sh" "$WORK/user.sh"
else
    # The stub check: probe, node, bounded timeouts, rmmod.
    cat > "$WORK/user.sh" <<'STUB'
fail=0
check() { if [ "$2" = 1 ]; then echo "L2-DRIVER-CHECK ok $1"; else echo "L2-DRIVER-CHECK FAIL $1"; fail=1; fi; }
[ -c /dev/vgpu ] && node=1 || node=0
check devnode $node
dmesg | grep -q '/dev/vgpu: protocol' && probe=1 || probe=0
check probe_shm_region $probe
for i in 1 2; do
    t0=$(busybox date +%s)
    vgpu-smoke > /tmp/smoke.out 2>&1; rc=$?
    t1=$(busybox date +%s)
    cat /tmp/smoke.out
    # Must fail (nobody answers) with a timeout, within bounds (timeout 2 s).
    grep -q 'timed out' /tmp/smoke.out && to=1 || to=0
    [ "$rc" != 0 ] && [ "$to" = 1 ] && [ $((t1 - t0)) -le 30 ] && ok=1 || ok=0
    check "request_timeout_$i(rc=$rc,${t0}..${t1})" $ok
done
# Arguments the driver refuses by itself; checks that need answers are skipped.
vgpu-smoke --hostile > /tmp/hostile.out 2>&1; rc=$?
cat /tmp/hostile.out
check "hostile_driver_checks(rc=$rc)" $([ "$rc" = 0 ] && echo 1 || echo 0)
busybox rmmod vgpu && rm_ok=1 || rm_ok=0
check rmmod $rm_ok
[ -e /dev/vgpu ] && gone=0 || gone=1
check devnode_removed $gone
dmesg | grep -i vgpu
exit $fail
STUB
fi

{ echo "VIRTIO_MODS='$VIRTIO_MODS'"; echo "INSMOD_ARGS='$INSMOD_ARGS'"; cat <<'L2'
for m in $VIRTIO_MODS; do
    busybox insmod "/mods/$m.ko" || echo "L2-INSMOD-FAIL $m"
done
busybox insmod /mods/vgpu.ko $INSMOD_ARGS || echo "L2-INSMOD-FAIL vgpu"
for v in /sys/bus/virtio/devices/*; do
    [ -e "$v/device" ] || continue
    echo "L2-VIRTIO ${v##*/} device=$(cat "$v/device") driver=$(basename "$(readlink "$v/driver" 2>/dev/null)" 2>/dev/null)"
done
for d in /sys/bus/pci/devices/*; do
    [ "$(cat "$d/device" 2>/dev/null)" = 0x107c ] && echo "L2-PCI ${d##*/} irq=$(cat "$d/irq")"
done
export PATH=/bin
sh /user.sh
echo "L2-DRIVER-RESULT rc=$?"
L2
} > "$WORK/l2-cmd.sh"
l2_adds+=(--add "$WORK/user.sh:/user.sh")
"$RIG/l2-initramfs.sh" --out "$WORK/l2.cpio.gz" "${l2_adds[@]}" >/dev/null

L2_ARGS="console=ttyS0 reboot=k panic=1 pci=conf1 i8042.noaux i8042.nokbd i8042.nomux i8042.nopnp"
cat > "$WORK/cmd.sh" <<CMD
$L1_PRE
: > /tmp/l2-serial.log
tail -f /tmp/l2-serial.log &
tp=\$!
RUST_LOG=warn vgpu-vmm $VMM_ARGS --kernel /l2/vmlinuz --initrd /l2/l2.cpio.gz --mem-mib 256 \\
    --timeout $((TIMEOUT - 40)) --cmdline "$L2_ARGS" --serial /tmp/l2-serial.log
rc=\$?
sleep 1; kill \$tp
res=\$(grep -a -o 'L2-DRIVER-RESULT.*' /tmp/l2-serial.log | tr -d '\r')
echo "L2-DRIVER vmm_rc=\$rc \${res:-no result}"
[ -f /tmp/backend.log ] && tail -20 /tmp/backend.log
if [ -x /bin/vgpu-bench ]; then
    # The same workloads natively in L1 (in-process sim), for the L2-vs-L1 ratio.
    vgpu-bench --json --quick guest --native --reps 5 --sim-idle-sleep-us $IDLE_US 2>&1 | while read -r l; do echo "L1-BENCH \$l"; done
fi
[ "\$rc" = 0 ] && [ "\$res" = "L2-DRIVER-RESULT rc=0" ]
CMD

"$RIG/run-l1.sh" --timeout "$TIMEOUT" --script "$WORK/cmd.sh" \
    --add "$MUSL/vgpu-vmm:/bin/vgpu-vmm" --add "$KERNEL:/l2/vmlinuz" \
    $([ "$BACKEND" = real ] && echo --add "$WORK/vgpu-backend:/bin/vgpu-backend" \
        --add "$WORK/vgpu-bench:/bin/vgpu-bench") \
    --add "$WORK/l2.cpio.gz:/l2/l2.cpio.gz" ${EXTRA[@]+"${EXTRA[@]}"} | tee "$WORK/l1.out"
rc=${PIPESTATUS[0]}
# Workload times in L2 (through /dev/vgpu, the backend in L1) against the same work
# natively in L1, from the figures printed above.
python3 - "$WORK/l1.out" <<'PY' || true
import json, re, sys
side = {"L2-BENCH": {}, "L1-BENCH": {}}
for line in open(sys.argv[1], errors="replace"):
    m = re.search(r"(L[12]-BENCH) (\{.*\})", line)
    if m:
        try:
            f = json.loads(m.group(2))
        except ValueError:
            continue
        side[m.group(1)][f["name"].rsplit("_", 1)[0]] = (f["value"], f["unit"])
l2, l1 = side["L2-BENCH"], side["L1-BENCH"]
for k in sorted(set(l2) & set(l1)):
    (a, u), (b, _) = l2[k], l1[k]
    if b > 0:
        print(f"L2-DRIVER-BENCH {k} l2={a:.3f}{u} l1_native={b:.3f}{u} ratio={a / b:.2f}")
PY
exit "$rc"
