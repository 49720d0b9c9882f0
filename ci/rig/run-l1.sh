#!/usr/bin/env bash
# Boot the rig's L1 (built by build-l1.sh) under QEMU TCG with nested SVM, run a command
# inside it and report its result. Exit status: the command's (0 = success), 124 on
# timeout, 1 when L1 never printed its markers.
#
# Usage: ci/rig/run-l1.sh [options] [-- extra qemu args]
#   --cmd 'SHELL CODE'  run this (busybox sh) inside L1 (default: status check of /dev/kvm)
#   --script FILE       run this script inside L1
#   --add SRC:DST       also put SRC at DST in L1, for this run only (repeatable)
#   --timeout S         wall-clock limit for the whole boot+command (default 120)
#   --log FILE          serial log (default ci/cache/rig/logs/l1-<time>.log; kept always
#                       when given, otherwise removed on success unless --keep-log)
#   --keep-log          keep the default log on success too
#   --kernel F, --initrd F   images (default ci/cache/rig/vmlinuz, ci/cache/rig/l1.cpio.gz)
#   --mem MiB (2048), --smp N (1), --append 'KERNEL ARGS' (added to the command line)
#   --quiet             do not stream the serial console to stdout
#   --shell             interactive: boot L1 to a shell on this terminal (no timeout)
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
CACHE="$ROOT/ci/cache/rig"
KERNEL="$CACHE/vmlinuz"
INITRD="$CACHE/l1.cpio.gz"
TIMEOUT=120
LOG=""
KEEP_LOG=0
MEM=2048
SMP=1
APPEND=""
QUIET=0
SHELL_MODE=0
CMD=""
SCRIPT=""
ADDS=()
QEMU_EXTRA=()

die() { echo "run-l1: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
    case "$1" in
        --cmd) [ $# -ge 2 ] || die "--cmd needs an argument"; CMD="$2"; shift 2 ;;
        --script) [ $# -ge 2 ] || die "--script needs FILE"; SCRIPT="$2"; shift 2 ;;
        --add) [ $# -ge 2 ] || die "--add needs SRC:DST"; ADDS+=("$2"); shift 2 ;;
        --timeout) [ $# -ge 2 ] || die "--timeout needs seconds"; TIMEOUT="$2"; shift 2 ;;
        --log) [ $# -ge 2 ] || die "--log needs FILE"; LOG="$2"; KEEP_LOG=1; shift 2 ;;
        --keep-log) KEEP_LOG=1; shift ;;
        --kernel) [ $# -ge 2 ] || die "--kernel needs FILE"; KERNEL="$2"; shift 2 ;;
        --initrd) [ $# -ge 2 ] || die "--initrd needs FILE"; INITRD="$2"; shift 2 ;;
        --mem) [ $# -ge 2 ] || die "--mem needs MiB"; MEM="$2"; shift 2 ;;
        --smp) [ $# -ge 2 ] || die "--smp needs N"; SMP="$2"; shift 2 ;;
        --append) [ $# -ge 2 ] || die "--append needs ARGS"; APPEND="$2"; shift 2 ;;
        --quiet) QUIET=1; shift ;;
        --shell) SHELL_MODE=1; shift ;;
        --) shift; QEMU_EXTRA+=("$@"); break ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) die "unknown argument: $1" ;;
    esac
done
[ -z "$CMD" ] || [ -z "$SCRIPT" ] || die "--cmd and --script are exclusive"
{ [ -f "$KERNEL" ] && [ -f "$INITRD" ]; } || die "no L1 image: run ci/rig/build-l1.sh first"
command -v qemu-system-x86_64 >/dev/null || die "qemu-system-x86_64 missing (build-l1.sh installs it)"
[[ "$TIMEOUT" =~ ^[0-9]+$ ]] || die "--timeout wants whole seconds"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/rig-l1.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

# Per-run files go into a second cpio archive appended to the initramfs: the kernel
# unpacks concatenated archives in order, so no rebuild and no command-line size limit.
RUN_INITRD="$INITRD"
if [ -n "$CMD" ] || [ -n "$SCRIPT" ] || [ ${#ADDS[@]} -gt 0 ]; then
    mkdir -p "$WORK/overlay/rig"
    if [ -n "$SCRIPT" ]; then
        cp "$SCRIPT" "$WORK/overlay/rig/cmd.sh"
    elif [ -n "$CMD" ]; then
        printf '%s\n' "$CMD" > "$WORK/overlay/rig/cmd.sh"
    fi
    for spec in ${ADDS[@]+"${ADDS[@]}"}; do
        src="${spec%%:*}"; dst="${spec#*:}"
        if [ "$src" = "$spec" ] || [ -z "$dst" ]; then die "--add wants SRC:DST, got '$spec'"; fi
        [ -e "$src" ] || die "--add: no such file: $src"
        dst="/${dst#/}"
        mkdir -p "$WORK/overlay$(dirname "$dst")"
        if [ -d "$src" ]; then
            mkdir -p "$WORK/overlay$dst"; cp -a "$src/." "$WORK/overlay$dst/"
        else
            cp -L "$src" "$WORK/overlay$dst"
        fi
    done
    RUN_INITRD="$WORK/initrd.cpio.gz"
    cp "$INITRD" "$RUN_INITRD"
    (cd "$WORK/overlay" && find . -mindepth 1 | LC_ALL=C sort | cpio -o -H newc --quiet -R 0:0) \
        | gzip -1 >> "$RUN_INITRD"
fi

# shellcheck disable=SC2054  # the commas are QEMU's, not array separators
QEMU=(qemu-system-x86_64 -accel tcg -cpu EPYC,+svm,+npt -m "$MEM" -smp "$SMP"
      -nographic -no-reboot -nic none
      -kernel "$KERNEL" -initrd "$RUN_INITRD")

if [ "$SHELL_MODE" = 1 ]; then
    "${QEMU[@]}" -append "console=ttyS0 panic=-1 quiet rig.shell=1 $APPEND" \
        ${QEMU_EXTRA[@]+"${QEMU_EXTRA[@]}"}
    exit $?
fi

if [ -z "$LOG" ]; then
    mkdir -p "$CACHE/logs"
    LOG="$CACHE/logs/l1-$(date +%Y%m%d-%H%M%S)-$$.log"
fi
mkdir -p "$(dirname "$LOG")"
: > "$LOG"

# L1's tick. QEMU's TCG can leave L1's one-shot local APIC timer interrupt pending in the
# IRR without ever delivering it (seen with KVM guests running in L1: L1 halted in its
# idle loop with IF=1, vector 0xec in the IRR, PPR 0x10): every L1 timer then waits
# forever and the whole L1, its VMMs and their guests with it, freezes. A periodic tick
# (no high-resolution timers, no dynamic ticks) re-arms the APIC timer by itself, and each
# expiry makes QEMU look at the pending interrupts again, so a stuck one is taken at the
# next tick (4 ms). RIG_L1_TICK=dynamic keeps the kernel's default (to reproduce).
case "${RIG_L1_TICK:-periodic}" in
    periodic) TICK_ARGS="highres=off nohz=off" ;;
    dynamic) TICK_ARGS="" ;;
    *) die "RIG_L1_TICK must be periodic or dynamic" ;;
esac

now() { date +%s.%N; }
t0="$(now)"
# A monitor socket, so that an L1 that stops answering can be asked where it is: shortly
# before the timeout the CPU's registers and local APIC are printed and an NMI is sent,
# which (unknown_nmi_panic) makes L1's kernel print its backtrace on the console.
MON="$WORK/monitor.sock"
timeout -k 5 "$TIMEOUT" "${QEMU[@]}" \
    -append "console=ttyS0 panic=-1 quiet unknown_nmi_panic=1 $TICK_ARGS $APPEND" \
    -monitor "unix:$MON,server=on,wait=off" \
    ${QEMU_EXTRA[@]+"${QEMU_EXTRA[@]}"} </dev/null >"$LOG" 2>&1 &
qpid=$!
monitor() {
    python3 - "$MON" "$@" <<'PY' 2>&1 || true
import socket, sys, time
s = socket.socket(socket.AF_UNIX)
s.settimeout(5)
s.connect(sys.argv[1])
s.settimeout(0.5)
def drain():
    out = b""
    try:
        while True:
            b = s.recv(65536)
            if not b:
                break
            out += b
    except OSError:
        pass
    return out.decode(errors="replace")
drain()
for cmd in sys.argv[2:]:
    s.sendall(cmd.encode() + b"\n")
    time.sleep(1)
    print(f"(qemu) {cmd}\n{drain()}")
PY
}
# Seconds before the timeout at which a still-running L1 is examined.
DIAG_BEFORE="${RIG_DIAG_BEFORE:-20}"
tpid=""
if [ "$QUIET" = 0 ]; then
    tail -n +1 -f --pid="$qpid" "$LOG" &
    tpid=$!
fi
t_ready=""
# QEMU's CPU time (utime + stime, clock ticks), for the stall check below.
qemu_ticks() {
    local p
    p=$(pgrep -P "$qpid" | head -n 1)
    [ -n "$p" ] && sed 's/.*) //' "/proc/$p/stat" 2>/dev/null | awk '{print $12 + $13}'
}
# Whether `info lapic` shows an interrupt in the IRR that the PPR lets through: a CPU that
# is halted with it has lost a wake-up.
lapic_stuck() {
    awk 'function hex(s,  i, n) { n = 0; s = tolower(substr(s, 3))
             for (i = 1; i <= length(s); i++) n = n * 16 + index("0123456789abcdef", substr(s, i, 1)) - 1
             return n }
         /^IRR/ { for (i = 2; i <= NF; i++) if ($i ~ /^[0-9]+$/) irr[$i] = 1 }
         /PPR 0x/ { for (i = 1; i < NF; i++) if ($i == "PPR") ppr = hex($(i + 1)) }
         END { for (v in irr) if (int(v / 16) > int(ppr / 16)) { print v; found = 1; exit }
               exit !found }'
}
diagnosed=0 stalls=0 tick=0 last_cpu=""
while kill -0 "$qpid" 2>/dev/null; do
    if [ -z "$t_ready" ] && grep -aq "RIG-READY" "$LOG"; then t_ready="$(now)"; fi
    tick=$((tick + 1))
    # Every 15 s: an L1 that used (almost) no CPU since the last look may be the TCG lost
    # wake-up (see TICK_ARGS above). If its local APIC holds a deliverable interrupt, a
    # keyboard interrupt makes QEMU look at the IRR again and L1 goes on; it is counted
    # and reported, never hidden.
    if [ $((tick % 150)) = 0 ] && cpu="$(qemu_ticks)" && [ -n "$cpu" ]; then
        if [ -n "$last_cpu" ] && [ $((cpu - last_cpu)) -lt 5 ]; then
            lapic="$(monitor "info lapic")"
            if vec="$(printf '%s\n' "$lapic" | tr -d '\r' | lapic_stuck)"; then
                stalls=$((stalls + 1))
                echo "run-l1: L1 stalled (QEMU used $((cpu - last_cpu)) ticks in 15 s) with vector $vec pending in its IRR: QEMU TCG lost wake-up $stalls; sending a keyboard interrupt" >&2
                { echo "RIG-L1-STALL $stalls vector=$vec"; printf '%s\n' "$lapic"; } >> "$LOG.monitor"
                monitor "sendkey shift" > /dev/null
            fi
        fi
        last_cpu="$cpu"
    fi
    if [ "$diagnosed" = 0 ] && [ "$TIMEOUT" -gt $((DIAG_BEFORE * 2)) ] \
        && awk -v a="$t0" -v b="$(now)" -v l=$((TIMEOUT - DIAG_BEFORE)) 'BEGIN {exit !(b - a > l)}'; then
        diagnosed=1
        echo "run-l1: L1 still running ${DIAG_BEFORE}s before the timeout: its CPU state, then an NMI" >&2
        monitor "info registers" "info lapic" "nmi" | tee -a "$LOG.monitor" >&2
    fi
    sleep 0.1
done
[ ! -f "$LOG.monitor" ] || cat "$LOG.monitor" >> "$LOG"; rm -f "$LOG.monitor"
[ "$stalls" = 0 ] || echo "run-l1: L1 stalled $stalls time(s) on a lost interrupt and went on after a keyboard interrupt (QEMU TCG; see ci/rig/README.md)" >&2
qrc=0
wait "$qpid" || qrc=$?
t1="$(now)"
[ -z "$tpid" ] || wait "$tpid" || true
if [ -z "$t_ready" ] && grep -aq "RIG-READY" "$LOG"; then t_ready="$t1"; fi

guest_up="$(grep -a -o 'RIG-READY uptime=[0-9.]*' "$LOG" | head -n1 | cut -d= -f2 || true)"
exit_line="$(grep -a -o 'RIG-EXIT=[0-9]*' "$LOG" | tail -n1 || true)"
total="$(awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.1f", b - a}')"
if [ -n "$t_ready" ]; then
    boot="$(awk -v a="$t0" -v b="$t_ready" 'BEGIN {printf "%.1f", b - a}')"
    echo "run-l1: L1 boot time ${boot}s wall to RIG-READY (guest uptime ${guest_up:-?}s); total ${total}s" >&2
else
    echo "run-l1: L1 never printed RIG-READY (total ${total}s)" >&2
fi

rc=0
if [ "$qrc" = 124 ] || [ "$qrc" = 137 ]; then
    echo "run-l1: timed out after ${TIMEOUT}s" >&2
    rc=124
elif [ -z "$exit_line" ]; then
    echo "run-l1: no RIG-EXIT marker (qemu exit status $qrc)" >&2
    rc=1
else
    rc="${exit_line#RIG-EXIT=}"
    [ "$rc" -le 255 ] 2>/dev/null || rc=1
    [ "$rc" = 0 ] || echo "run-l1: command in L1 failed: $exit_line" >&2
fi

if [ "$rc" = 0 ] && [ "$KEEP_LOG" = 0 ]; then
    rm -f "$LOG"
else
    echo "run-l1: serial log: $LOG" >&2
fi
exit "$rc"
