#!/usr/bin/env bash
# Direct submission under QEMU (KVM) against under vgpu-vmm, side by side, in ONE L1 boot
# of the nested rig: one vgpu-backend (sim GPU, as l2-vgpu.sh starts it) serves three VMs,
# `qemu`, `vmm` and `fwd`; in each round an L2 boots under our QEMU (`-accel kvm`,
# `vhost-user-device-pci`, shared memfd memory: the command line of `l2-vgpu.sh --qemu`,
# plus `-name debug-threads=on` so that its vCPU thread can be told apart), then an L2 under `vgpu-vmm --vgpu-socket`, then one under the same
# QEMU with `shmem=off` (forwarded; --no-forwarded leaves it out), one after the other
# (A B C A B C ...: the machine's load drifts between L1 boots by 2x, so only runs in the
# same L1, interleaved, compare). Each L2 loads vgpu.ko, must come up **direct** (`fwd`:
# **forwarded**), and runs the quick submission bench (`vgpu-guest-bench --json --quick --submit-only`: submit ->
# fence seen p50/p99 over 50 empty kernels, the submission rate of 1,000 empty kernels
# published back to back and waited for once, and the same round trip with GP_PUT sent as a
# request) --bench-runs times. The script prints per boot and bench run:
#   QV-RUN round=R vmm=qemu|vmm|fwd run=I rate=... p50=... p99=... api_p50=...
# then per VMM the median over all its runs, and the ratios of the medians:
#   QV-MEDIAN vmm=... runs=N rate=... p50=... p99=... api_p50=... boot_s=... clocksource=...
#   QV-RATIO rate=... p50=... p99=... api_p50=...   (QEMU direct's median / vgpu-vmm's)
#   QV-RATIO-FWD rate=... p50=...                    (QEMU direct's median / QEMU forwarded's)
# and where L1's one CPU went while each L2's benches ran (shares of that time, medians
# over the boots: the guest's vCPU thread, the VMM's other threads, the backend, idle):
#   QV-CPU-MEDIAN vmm=... boots=N window_s=... vcpu=... vmm_other=... backend=... l1_idle=...
# and L1's KVM exit counters (debugfs) per second of that time:
#   QV-KVM-MEDIAN vmm=... boots=N per_s: exits=... halt_exits=... io_exits=... mmio_exits=... ...
#   QV-HIST-TOTAL vmm=... kvm_exit|kvm_msr|kvm_mmu_zap_all_fast per_s: KEY=...
#     (exit reasons, MSRs, and whole-VM page-table zaps by process: tracepoint histograms)
# Exit status 0 when every boot came up in its mode and every bench run produced its figures
# (the ratio is printed, not judged: this is a measurement, not a CI step).
#
# Usage: ci/rig/l2-qemu-vs-vmm.sh --qemu BIN [--rounds N] [--bench-runs B] [--no-forwarded] [--no-build]
#                                 [--timeout S] [--log FILE] [-- run-l1.sh args]
#   --qemu BIN        our QEMU (ci/qemu/build.sh prints QEMU=...; a glibc build whose
#                     libraries and firmware ride along into L1)
#   --rounds N        rounds of (QEMU, vgpu-vmm[, QEMU forwarded]) boots (default 4)
#   --bench-runs B    bench runs per L2 boot (default 5)
#   --log FILE        keep L1's serial log there (default: a temporary file, printed on
#                     failure)
# Env: CARGO_TARGET_DIR (default <repo>/target); RIG_SIM_IDLE_SLEEP_US (5000, as l2-vgpu.sh)
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
RIG="$ROOT/ci/rig"
QEMU_BIN=""
ROUNDS=4
RUNS=5
BUILD=1
TIMEOUT=""
LOG=""
EXTRA=()
FWD=1
SIM_IDLE="${RIG_SIM_IDLE_SLEEP_US:-5000}"
die() { echo "l2-qemu-vs-vmm: $*" >&2; exit 1; }
while [ $# -gt 0 ]; do
    case "$1" in
        --qemu) QEMU_BIN="$2"; shift 2 ;;
        --rounds) ROUNDS="$2"; shift 2 ;;
        --bench-runs) RUNS="$2"; shift 2 ;;
        --no-build) BUILD=0; shift ;;
        --no-forwarded) FWD=0; shift ;;
        --timeout) TIMEOUT="$2"; shift 2 ;;
        --log) LOG="$2"; shift 2 ;;
        --) shift; EXTRA+=("$@"); break ;;
        -h|--help) sed -n '2,38p' "$0"; exit 0 ;;
        *) die "unknown argument: $1" ;;
    esac
done
[ -n "$QEMU_BIN" ] || die "--qemu BIN is required (ci/qemu/build.sh prints it)"
[ -x "$QEMU_BIN" ] || die "--qemu: no such program: $QEMU_BIN"
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || die "--rounds wants a positive number"
[[ "$RUNS" =~ ^[1-9][0-9]*$ ]] || die "--bench-runs wants a positive number"
# An L2 boot and its bench take 15-40 s under load; L1's boot up to a minute.
PER_BOOT=150
KINDS="qemu vmm$([ "$FWD" = 0 ] || echo " fwd")"
TIMEOUT="${TIMEOUT:-$((120 + ROUNDS * (2 + FWD) * 60))}"

. "$ROOT/ci/lib.sh"
rig_kernel
if [ "$BUILD" = 1 ]; then
    musl_build -p vgpu-vmm -p vgpu-backend --bin vgpu-vmm --bin vgpu-backend
    musl_build_guest_tools
    build_guest_driver
fi
for b in vgpu-vmm vgpu-backend vgpu-guest-bench; do
    [ -x "$MUSL/$b" ] || die "no static $b at $MUSL (drop --no-build)"
done
DRIVER="$ROOT/guest-driver/kernel/vgpu.ko"
[ -f "$DRIVER" ] || die "no $DRIVER (drop --no-build)"
modinfo -F vermagic "$DRIVER" | grep -q "^$KVER " || die "$DRIVER is not built for $KVER"

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

# --- L2: the modules, vgpu.ko, the bench; /init runs l2-cmd.sh, then reboots ----------
{ echo "VIRTIO_MODS='$VIRTIO_MODS' RUNS=$RUNS"; cat <<'L2'
for m in $VIRTIO_MODS; do busybox insmod "/mods/$m.ko" || echo "QV-L2-FAIL insmod $m"; done
busybox insmod /mods/vgpu.ko || echo "QV-L2-FAIL insmod vgpu"
[ -c /dev/vgpu ] || busybox mdev -s
echo "QV-MODE $(cat /sys/class/misc/vgpu/submission 2>/dev/null || echo none)"
# What the guest's clock reads cost differs between VMMs (a clocksource without a vDSO
# read traps): the bench times itself with that clock.
echo "QV-CLOCK $(cat /sys/devices/system/clocksource/clocksource0/current_clocksource 2>/dev/null)"
echo "QV-BENCH-BEGIN"
i=1
while [ "$i" -le "$RUNS" ]; do
    busybox timeout -s KILL 60 /bin/vgpu-guest-bench --json --quick --submit-only > /tmp/b.out 2>&1
    r=$?
    while read -r l; do echo "QV-BENCH run=$i $l"; done < /tmp/b.out
    echo "QV-BENCH-RC run=$i rc=$r"
    i=$((i + 1))
done
# L1 samples its CPU accounts at this marker: the VMM must still be there.
echo "QV-BENCH-END"
sleep 2
L2
} > "$WORK/l2-cmd.sh"
l2_adds=(--add "$WORK/l2-cmd.sh:/l2-cmd.sh" --add "$DRIVER:/mods/vgpu.ko")
add_virtio_mods l2_adds
strip -o "$WORK/vgpu-guest-bench" "$MUSL/vgpu-guest-bench"
l2_adds+=(--add "$WORK/vgpu-guest-bench:/bin/vgpu-guest-bench")
"$RIG/l2-initramfs.sh" --out "$WORK/l2.cpio.gz" "${l2_adds[@]}" >/dev/null

# --- L1: one backend, the rounds ------------------------------------------------------
L2_ARGS="console=ttyS0 reboot=k panic=1 pci=conf1 quiet i8042.noaux i8042.nokbd i8042.nomux i8042.nopnp"
cat > "$WORK/cmd.sh" <<CMD
mkdir -p /tmp/vgpu
RUST_LOG=info vgpu-backend --socket-dir /tmp/vgpu --api-socket /tmp/vgpu/api.sock \\
    --vram-mib 256 --vm-swap-mib 256 --sim-idle-sleep-us $SIM_IDLE --vm qemu --vm vmm --vm fwd \\
    > /tmp/backend.log 2>&1 &
bp=\$!
for i in \$(seq 1 100); do [ -S /tmp/vgpu/vmm.sock ] && break; sleep 0.1; done
ok=1
# KVM's exit counters (global; one L2 runs at a time).
mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null
KVM_STATS="exits halt_exits io_exits mmio_exits irq_exits irq_window_exits request_irq_exits signal_exits insn_emulation hypercalls halt_wakeup halt_attempted_poll halt_successful_poll halt_poll_success_ns halt_poll_fail_ns pf_taken"
# And why KVM exits: histograms of the exit reasons, of the MSRs accessed by exits and of
# KVM's zaps of all of a VM's page tables (kvm_exit, kvm_msr and
# kvm_mmu_zap_all_fast tracepoints), taken over the same window.
TR=/sys/kernel/debug/tracing/events
HISTS="kvm/kvm_exit:exit_reason kvm/kvm_msr:ecx.hex,write kvmmmu/kvm_mmu_zap_all_fast:common_pid.execname"
hist() {
    # hist on|off
    p=\$([ "\$1" = on ] || echo '!')
    for h in \$HISTS; do
        [ ! -w \$TR/\${h%%:*}/trigger ] || echo "\${p}hist:keys=\${h#*:}:sort=hitcount" > \$TR/\${h%%:*}/trigger
    done
}
kvm_sample() {
    for n in \$KVM_STATS; do echo -n "\$(cat /sys/kernel/debug/kvm/\$n 2>/dev/null || echo 0) "; done
}
cpu_sample() {
    # uptime, then CPU ticks of: the VMM's vCPU thread (the guest's own time is counted
    # there), the VMM's other threads, the backend, L1's idle time.
    read -r up _ < /proc/uptime
    vmp=\$(pidof qemu-system-x86_64 vgpu-vmm | cut -d' ' -f1)
    vc=0 vo=0
    for t in /proc/\$vmp/task/*; do
        s=\$(sed 's/.*) //' \$t/stat 2>/dev/null | awk '{print \$12 + \$13}')
        case "\$(cat \$t/comm 2>/dev/null)" in "CPU "*|vcpu*) vc=\$((vc + \${s:-0})) ;; *) vo=\$((vo + \${s:-0})) ;; esac
    done
    bk=\$(sed 's/.*) //' /proc/\$bp/stat | awk '{print \$12 + \$13}')
    echo "\$up \$vc \$vo \$bk \$(awk '/^cpu /{print \$5}' /proc/stat) \$(kvm_sample)"
}
boot() {
    # boot ROUND KIND: one L2 under that VMM on its VM's socket, to its end (a reboot).
    log=/tmp/l2-\$1-\$2.log
    : > \$log
    want=direct shmem=on
    [ "\$2" != fwd ] || want=forwarded shmem=off
    read -r a _ < /proc/uptime
    (
    if [ "\$2" != vmm ]; then
        timeout -s KILL $PER_BOOT qemu-system-x86_64 -name qv,debug-threads=on -accel kvm -cpu host \\
            -smp 1 -m 256M -machine pc,memory-backend=mem \\
            -object memory-backend-memfd,id=mem,size=256M,share=on \\
            -nodefaults -display none -no-reboot -monitor none \\
            -serial file:\$log -L /usr/share/seabios -L /usr/share/qemu \\
            -kernel /l2/vmlinuz -initrd /l2/l2.cpio.gz -append "$L2_ARGS" \\
            -chardev socket,id=c0,path=/tmp/vgpu/\$2.sock \\
            -device vhost-user-device-pci,chardev=c0,virtio-id=60,num_vqs=2,vq_size=256,config_size=32,shmem=\$shmem \\
            > /tmp/vmm-\$1-\$2.out 2>&1
    else
        RUST_LOG=info timeout -s KILL $PER_BOOT vgpu-vmm --vgpu-socket /tmp/vgpu/vmm.sock \\
            --kernel /l2/vmlinuz --initrd /l2/l2.cpio.gz --mem-mib 256 --vcpus 1 \\
            --timeout $((PER_BOOT - 10)) --cmdline "$L2_ARGS" --serial \$log \\
            > /tmp/vmm-\$1-\$2.out 2>&1
    fi
    ) &
    vp=\$!
    # Where L1's one CPU went while the benches ran (sampled at the L2's markers).
    c0="" c1=""
    while kill -0 \$vp 2>/dev/null; do
        if [ -z "\$c0" ] && grep -a -q QV-BENCH-BEGIN \$log; then c0=\$(cpu_sample); hist on; fi
        if [ -n "\$c0" ] && [ -z "\$c1" ] && grep -a -q QV-BENCH-END \$log; then
            c1=\$(cpu_sample)
            for h in \$HISTS; do
                e=\${h%%:*}
                grep -a '^{' \$TR/\$e/hist 2>/dev/null | tr -s ' ' | sed "s/^/QV-HIST round=\$1 vmm=\$2 \${e#*/} /"
            done
            hist off
        fi
        sleep 0.2
    done
    wait \$vp
    rc=\$?
    if [ -n "\$c1" ]; then
        # Two samples of 5 + S fields each (S = the KVM counters).
        echo "\$c0 \$c1" | awk -v r=\$1 -v k=\$2 -v names="\$KVM_STATS" '{ h = NF / 2; w = \$(h + 1) - \$1
            printf "QV-CPU round=%s vmm=%s window_s=%.2f vcpu_s=%.2f vmm_other_s=%.2f backend_s=%.2f l1_idle_s=%.2f\\n",
                r, k, w, (\$(h + 2) - \$2) / 100, (\$(h + 3) - \$3) / 100, (\$(h + 4) - \$4) / 100, (\$(h + 5) - \$5) / 100
            split(names, nm, " "); line = ""
            for (i = 6; i <= h; i++) line = line " " nm[i - 5] "=" (\$(h + i) - \$i)
            printf "QV-KVM round=%s vmm=%s window_s=%.2f%s\\n", r, k, w, line }'
    fi
    read -r b _ < /proc/uptime
    secs=\$(awk -v a=\$a -v b=\$b 'BEGIN{printf "%.1f", b-a}')
    mode=\$(tr -d '\r' < \$log | grep -a -o 'QV-MODE [a-z]*' | cut -d' ' -f2)
    echo "QV-BOOT round=\$1 vmm=\$2 vmm_rc=\$rc secs=\$secs mode=\${mode:-none}"
    tr -d '\r' < \$log | grep -a -E '^QV-(BENCH|CLOCK)' | sed "s/^/QV round=\$1 vmm=\$2 /"
    nrc=\$(tr -d '\r' < \$log | grep -a -c 'QV-BENCH-RC run=[0-9]* rc=0')
    if [ "\$rc" != 0 ] || [ "\$mode" != "\$want" ] || [ "\$nrc" != $RUNS ]; then
        ok=0
        echo "QV-FAIL round=\$1 vmm=\$2 (vmm_rc=\$rc mode=\${mode:-none} bench_ok=\$nrc/$RUNS)"
        tr -d '\r' < \$log | grep -a -v '^\$' | tail -n 30
        tail -n 20 /tmp/vmm-\$1-\$2.out
    fi
}
for r in \$(seq 1 $ROUNDS); do
    for kind in $KINDS; do boot \$r \$kind; done
done
# Each VM's backend counters (SHMEM_MAP traffic, shadow switches) for the record.
if [ -x /bin/vgpuctl ]; then
    for v in $KINDS; do
        echo "QV-STATS vm=\$v \$(vgpuctl --socket /tmp/vgpu/api.sock --json vm stats \$v 2>&1 | tr -d ' \n' | cut -c1-600)"
    done
fi
kill -TERM \$bp; wait \$bp; brc=\$?
echo "QV-BACKEND rc=\$brc"
[ "\$brc" = 0 ] || { ok=0; tail -n 30 /tmp/backend.log; }
[ "\$ok" = 1 ]
CMD

# QEMU: stripped (L1's initramfs is unpacked into its RAM), its libraries at the paths it
# names, and the firmware a pc machine loads to boot a kernel.
strip -o "$WORK/qemu-system-x86_64" "$QEMU_BIN"
l1_adds=(--add "$WORK/qemu-system-x86_64:/bin/qemu-system-x86_64")
for lib in $(ldd "$QEMU_BIN" | grep -o '/[^ ]*'); do l1_adds+=(--add "$lib:$lib"); done
for f in /usr/share/seabios/bios-256k.bin /usr/share/qemu/linuxboot_dma.bin \
         /usr/share/qemu/kvmvapic.bin; do
    l1_adds+=(--add "$f:$f")
done
[ ! -x "$MUSL/vgpuctl" ] || l1_adds+=(--add "$MUSL/vgpuctl:/bin/vgpuctl")
LOG="${LOG:-$WORK/l1.log}"
rc=0
"$RIG/run-l1.sh" --timeout "$TIMEOUT" --log "$LOG" --script "$WORK/cmd.sh" "${l1_adds[@]}" \
    --add "$MUSL/vgpu-vmm:/bin/vgpu-vmm" --add "$MUSL/vgpu-backend:/bin/vgpu-backend" \
    --add "$KERNEL:/l2/vmlinuz" --add "$WORK/l2.cpio.gz:/l2/l2.cpio.gz" \
    ${EXTRA[@]+"${EXTRA[@]}"} || rc=$?

# --- the figures: per run, per VMM's median, the ratio ----------------------------------
python3 - "$LOG" <<'PY' || rc=1
import json, re, statistics, sys
runs, boots, clocks, cpu, kvm, hists = [], {}, {}, {}, {}, {}

def numbers(text):
    """`key=value ...` as a dict of floats."""
    return {k: float(v) for k, v in (kv.split("=") for kv in text.split())}

for line in open(sys.argv[1], errors="replace"):
    line = line.strip("\r\n")
    m = re.search(r"QV-BOOT round=(\d+) vmm=(\w+) vmm_rc=\d+ secs=([\d.]+)", line)
    if m:
        boots.setdefault(m[2], []).append(float(m[3]))
    for tag, into in (("QV-CPU", cpu), ("QV-KVM", kvm)):
        m = re.search(tag + r" round=\d+ vmm=(\w+) (.*)", line)
        if m:
            into.setdefault(m[1], []).append(numbers(m[2]))
    m = re.search(r"QV-HIST round=\d+ vmm=(\w+) (\w+) \{ (.*) \} hitcount: (\d+)", line)
    if m:
        h = hists.setdefault(m[1], {}).setdefault(m[2], {})
        key = re.sub(r"\[\s*\d+\]", "", m[3])  # a process's pid differs per boot
        h[key] = h.get(key, 0) + int(m[4])
    m = re.search(r"QV round=\d+ vmm=(\w+) QV-CLOCK (\S*)", line)
    if m:
        clocks.setdefault(m[1], set()).add(m[2])
    m = re.search(r"QV round=(\d+) vmm=(\w+) QV-BENCH run=(\d+) (\{.*\})", line)
    if not m:
        continue
    try:
        fig = json.loads(m[4])
    except ValueError:
        continue
    key = (int(m[1]), m[2], int(m[3]))
    if not runs or runs[-1][0] != key:
        runs.append((key, {}))
    # The bench names its figures after the transport (`..._devvgpu`).
    n = fig["name"]
    key_name = ("api_p50" if n == "round_trip_p50_api_remoting" else
                "api_p99" if n == "round_trip_p99_api_remoting" else
                "rate" if n.startswith("submit_rate_") else
                "p50" if n.startswith("round_trip_p50_") else
                "p99" if n.startswith("round_trip_p99_") else None)
    if key_name:
        runs[-1][1][key_name] = fig["value"]
names = [(k, k) for k in ("rate", "p50", "p99", "api_p50")]
med = {}
for (rnd, vmm, run), f in runs:
    if all(n in f for _, n in names):
        print(f"QV-RUN round={rnd} vmm={vmm} run={run} " +
              " ".join(f"{k}={f[n]:.1f}" for k, n in names))
for vmm in ("qemu", "vmm", "fwd"):
    got = [f for (_, v, _), f in runs if v == vmm and all(n in f for _, n in names)]
    if not got:
        if vmm != "fwd" or vmm in boots:
            print(f"QV-MEDIAN vmm={vmm} runs=0")
        continue
    med[vmm] = {k: statistics.median(f[n] for f in got) for k, n in names}
    b = statistics.median(boots.get(vmm, [0]))
    print(f"QV-MEDIAN vmm={vmm} runs={len(got)} " +
          " ".join(f"{k}={v:.1f}" for k, v in med[vmm].items()) + f" boot_s={b:.1f}" +
          f" clocksource={','.join(sorted(clocks.get(vmm, ['?'])))}")
# L1's one CPU during the benches, as shares of the window (medians over the boots).
for vmm, c in cpu.items():
    print(f"QV-CPU-MEDIAN vmm={vmm} boots={len(c)} window_s=" +
          f"{statistics.median(x['window_s'] for x in c):.1f} " + " ".join(
              f"{k[:-2]}={statistics.median(x[k] / x['window_s'] for x in c):.2f}"
              for k in ("vcpu_s", "vmm_other_s", "backend_s", "l1_idle_s")))
# KVM exits in L1 per second of the benches (medians over the boots).
for vmm, c in kvm.items():
    print(f"QV-KVM-MEDIAN vmm={vmm} boots={len(c)} per_s: " + " ".join(
        f"{k}={statistics.median(x[k] / x['window_s'] for x in c):.0f}"
        for k in c[0] if k != "window_s"))
# The exit reasons (SVM exit codes) and MSRs behind them, per second of the benches.
SVM = {0x60: "INTR", 0x64: "VINTR", 0x72: "CPUID", 0x77: "PAUSE", 0x78: "HLT", 0x7b: "IOIO",
       0x7c: "MSR", 0x400: "NPF", 0x81: "VMMCALL", 0x6e: "RDTSC", 0x87: "RDTSCP"}
for vmm, by in hists.items():
    secs = sum(x["window_s"] for x in cpu.get(vmm, [])) or 1
    for ev, h in by.items():
        top = sorted(h.items(), key=lambda kv: -kv[1])[:8]
        def label(k):
            m = re.match(r"exit_reason:\s*(\d+)", k)
            return SVM.get(int(m[1]), hex(int(m[1]))) if m else re.sub(r"\s+", "", k)
        print(f"QV-HIST-TOTAL vmm={vmm} {ev} per_s: " +
              " ".join(f"{label(k)}={v / secs:.0f}" for k, v in top))
def ratio(tag, a, b, what):
    print(f"{tag} " + " ".join(
        f"{k}={med[a][k] / med[b][k]:.2f}" for k, _ in names if med[b][k]) + f"   ({what})")
if "qemu" in med and "vmm" in med:
    ratio("QV-RATIO", "qemu", "vmm", "QEMU direct's median / vgpu-vmm's")
else:
    sys.exit(1)
if "fwd" in med:
    ratio("QV-RATIO-FWD", "qemu", "fwd", "QEMU direct's median / QEMU forwarded's")
elif "fwd" in boots:
    sys.exit(1)
PY
[ "$rc" = 0 ] || echo "l2-qemu-vs-vmm: failed; L1's serial log: $LOG" >&2
if [ "$rc" != 0 ] && [ "$LOG" = "$WORK/l1.log" ]; then
    cp "$LOG" "${TMPDIR:-/tmp}/l2-qemu-vs-vmm-$$.log" && echo "l2-qemu-vs-vmm: kept as ${TMPDIR:-/tmp}/l2-qemu-vs-vmm-$$.log" >&2
fi
exit "$rc"
