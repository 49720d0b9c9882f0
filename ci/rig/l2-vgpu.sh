#!/usr/bin/env bash
# vgpu end to end in the nested rig: inside L1, start `vgpu-backend` (sim GPU) serving
# N VMs, boot N L2 Linux guests at once, each under its own `vgpu-vmm --vgpu-socket`, and
# check in every L2 that
#   - the PCI core enumerates the vgpu function (1af4:107c) and virtio_pci probes it as
#     virtio device 60 (sysfs; L2 has no lspci);
#   - with --driver KO: vgpu.ko binds, features are negotiated (virtio status 0xf) and
#     /dev/vgpu appears;
#   - with --exit-cost BIN: the exit costs seen from L2 (ci/rig/exit-cost.c);
#   - with --l2-cmd FILE: FILE (run as `sh FILE` in L2) prints "L2-USER-OK";
#   - --guest: all of the guest stack — builds vgpu.ko, the static guest tools
#     (vgpu-smoke, vgpu-throttle, vgpu-guest-bench) and exit-cost, and runs
#     ci/rig/l2-guest-checks.sh in every L2 (unless --l2-cmd names another script).
#   - --migrate: a second vgpu-backend runs beside the first; once every L2 printed
#     "L2-MIGRATE-READY" its VM is live-migrated (vgpu-migrate) from its vgpu-vmm to a
#     `vgpu-vmm --incoming` on the second backend, and the L2 result is read from the
#     destination's serial log; with --guest the L2 script is ci/rig/l2-migrate-checks.sh.
#     --migrate-via tcp sends it over TCP (127.0.0.1 in L1) instead of a unix socket.
#   - --restart-backend: once every L2 printed "L2-RECONNECT-READY", vgpu-backend is
#     SIGKILLed and a new one started on the same sockets (vgpu-vmm reconnects); with
#     --guest the L2 script is then ci/rig/l2-reconnect-checks.sh. --hang-backend S does
#     the same but SIGSTOPs the backend for S seconds first (a hung backend: requests
#     time out, vgpu-vmm closes the connection), and checks every VMM logged a timeout.
#   - --ch BIN: every L2 runs under Cloud Hypervisor (BIN, a glibc build: ci/ch/build.sh;
#     its libraries ride along) instead of vgpu-vmm, attached with
#     `--generic-vhost-user device_type=60`; the L2 powers off when done (Cloud
#     Hypervisor restarts a guest that reboots). Not with a backend restart. With
#     --migrate: a local live migration (`ch-remote send-migration local=on`, BIN's
#     ch-remote beside it) to a second cloud-hypervisor in L1 that attaches the same
#     backend socket (the configuration travels with the VM; no second backend).
#     The device runs forwarded (`shmem=off`) unless --ch-shmem is given.
#   - --ch-shmem: with --ch, the generic device offers vhost-user shared memory
#     (`shmem=on`, our ci/ch/patches), so the guest runs direct through its BAR. Not
#     with --migrate (a device with shared memory does not migrate).
#   - --qemu BIN: every L2 runs under that QEMU (a glibc build with vhost-user shared
#     memory: ci/qemu/build.sh; its libraries and firmware ride along) with
#     `-accel kvm`, attached with `vhost-user-device-pci,virtio-id=60`, so the guest
#     runs direct through QEMU's BAR as under vgpu-vmm. Not with --migrate or a backend
#     restart.
# Each L2 prints "L2-VGPU-RESULT ...", each VM's line "L2-VGPU-CHECK vm=K ..." appears on
# L1's console, and the backend must exit cleanly on SIGTERM afterwards. For information:
# "L2-VGPU-READONLY spells=N longest_ms=M past_1s=K" (how long the backend held moving VRAM
# chunks read-only under the guests' CPU views) and, with --ch, "L2-CH-EFAULT vm=K waits=N
# past_1s=K" (guest stores that met such a chunk and waited in Cloud Hypervisor).
#
# Usage: ci/rig/l2-vgpu.sh [--vms N] [--guest] [--restart-backend] [--hang-backend S] [--driver vgpu.ko] [--exit-cost BIN] [--l2-cmd FILE]
#                          [--add SRC:DST]... [--vcpus N] [--ch BIN [--ch-shmem]] [--qemu BIN] [--no-build] [--timeout S]
#                          [-- run-l1.sh args]
#   --add puts extra files into every L2's initramfs (e.g. guest tools).
#   --backend-args 'ARGS'  more vgpu-backend options (its API socket is /tmp/vgpu/api.sock)
#   --l1-monitor FILE      runs `sh FILE` in L1 while the VMs run (vgpuctl is there); its
#                          output goes to L1's console and its exit status must be 0
# Each L2's kernel command line carries `vgpu.vm=K`, so one L2 script can play per-VM roles.
# Env: CARGO_TARGET_DIR (default <repo>/target)
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
RIG="$ROOT/ci/rig"
VMS=1
GUEST=0
BACKEND_ARGS=""
MONITOR=""
VCPUS=1
DRIVER=""
EXITCOST=""
L2CMD=""
BUILD=1
RESTART=0
HANG=0
MIGRATE=0
MIGRATE_VIA=unix
CH=""
CH_SHMEM=off
QEMU_BIN=""
TIMEOUT=420
# Log filter of the backends and VMMs in L1 (RUST_LOG syntax), and how many of the
# backends' last log lines the summary shows.
RIG_LOG="${RIG_LOG:-info}"
RIG_LOG_LINES="${RIG_LOG_LINES:-25}"
# How many lines of each log a failure or the watchdog prints.
RIG_DUMP_LINES="${RIG_DUMP_LINES:-60}"
# More cloud-hypervisor options with --ch (e.g. "--seccomp log").
RIG_CH_ARGS="${RIG_CH_ARGS:-}"
# A probe with --ch --migrate: 1 kills the destination cloud-hypervisor as soon as the
# source accepted the migration, so that it fails (the step then fails too).
RIG_CH_MIGRATE_ABORT="${RIG_CH_MIGRATE_ABORT:-0}"
ADDS=()
EXTRA=()
die() { echo "l2-vgpu: $*" >&2; exit 1; }
while [ $# -gt 0 ]; do
    case "$1" in
        --vms) VMS="$2"; shift 2 ;;
        --vcpus) VCPUS="$2"; shift 2 ;;
        --driver) DRIVER="$2"; shift 2 ;;
        --guest) GUEST=1; shift ;;
        --restart-backend) RESTART=1; shift ;;
        --migrate) MIGRATE=1; shift ;;
        --migrate-via) MIGRATE=1; MIGRATE_VIA="$2"; shift 2 ;;
        --hang-backend) RESTART=1; HANG="$2"; shift 2 ;;
        --exit-cost) EXITCOST="$2"; shift 2 ;;
        --l2-cmd) L2CMD="$2"; shift 2 ;;
        --add) ADDS+=(--add "$2"); shift 2 ;;
        --backend-args) BACKEND_ARGS="$2"; shift 2 ;;
        --l1-monitor) MONITOR="$2"; shift 2 ;;
        --ch) CH="$2"; shift 2 ;;
        --ch-shmem) CH_SHMEM=on; shift ;;
        --qemu) QEMU_BIN="$2"; shift 2 ;;
        --no-build) BUILD=0; shift ;;
        --timeout) TIMEOUT="$2"; shift 2 ;;
        --) shift; EXTRA+=("$@"); break ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) die "unknown argument: $1" ;;
    esac
done
case "$VMS" in [1-8]) ;; *) die "--vms must be 1..8" ;; esac
if [ -n "$CH" ]; then
    [ -x "$CH" ] || die "--ch: no such program: $CH"
    [ "$RESTART" = 0 ] || die "--ch runs no backend restart yet"
    CH_REMOTE="$(dirname "$CH")/ch-remote"
    [ "$MIGRATE" = 0 ] || [ -x "$CH_REMOTE" ] || die "--ch --migrate: no ch-remote beside $CH"
    [ "$MIGRATE_VIA" = unix ] || die "--ch --migrate: a local migration goes through a unix socket"
    [ "$CH_SHMEM" = off ] || [ "$MIGRATE" = 0 ] || die "--ch-shmem: a device with shared memory does not migrate"
else
    [ "$CH_SHMEM" = off ] || die "--ch-shmem needs --ch"
fi
if [ -n "$QEMU_BIN" ]; then
    [ -x "$QEMU_BIN" ] || die "--qemu: no such program: $QEMU_BIN"
    [ -z "$CH" ] || die "--qemu or --ch, not both"
    [ "$MIGRATE" = 0 ] && [ "$RESTART" = 0 ] || die "--qemu runs neither --migrate nor a backend restart yet"
fi

. "$ROOT/ci/lib.sh"
rig_kernel
if [ "$BUILD" = 1 ]; then
    musl_build -p vgpu-vmm -p vgpu-backend --bin vgpu-vmm --bin vgpu-migrate --bin vgpu-backend \
        --bin vgpuctl
    if [ "$GUEST" = 1 ]; then
        musl_build_guest_tools
        build_guest_driver
        build_guest_cuda
        gcc -O2 -static -o "$TARGET_DIR/exit-cost" "$RIG/exit-cost.c" >&2
    fi
fi
for b in vgpu-vmm vgpu-backend; do
    [ -x "$MUSL/$b" ] || die "no static $b at $MUSL (drop --no-build)"
done

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
if [ "$GUEST" = 1 ]; then
    DRIVER="${DRIVER:-$ROOT/guest-driver/kernel/vgpu.ko}"
    # (exit-cost knows vgpu-vmm's BAR layout, not Cloud Hypervisor's.)
    [ -n "$CH$QEMU_BIN" ] || EXITCOST="${EXITCOST:-$TARGET_DIR/exit-cost}"
    if [ "$MIGRATE" = 1 ]; then
        L2CMD="${L2CMD:-$RIG/l2-migrate-checks.sh}"
    elif [ "$RESTART" = 1 ]; then
        L2CMD="${L2CMD:-$RIG/l2-reconnect-checks.sh}"
    else
        L2CMD="${L2CMD:-$RIG/l2-guest-checks.sh}"
    fi
    add_guest_tools "$WORK" ADDS
    add_guest_cuda ADDS
fi
[ -z "$DRIVER" ] || modinfo -F vermagic "$DRIVER" | grep -q "^$KVER " \
    || die "$DRIVER is not built for $KVER"

l2_adds=(--add "$WORK/l2-cmd.sh:/l2-cmd.sh")
add_virtio_mods l2_adds
[ -z "$DRIVER" ] || l2_adds+=(--add "$DRIVER:/mods/vgpu.ko")
[ -z "$EXITCOST" ] || l2_adds+=(--add "$EXITCOST:/bin/exit-cost")
[ -z "$L2CMD" ] || l2_adds+=(--add "$L2CMD:/l2-user.sh")
l2_adds+=(${ADDS[@]+"${ADDS[@]}"})

{ echo "VIRTIO_MODS='$VIRTIO_MODS' L2_END='$([ -n "$CH" ] && echo poweroff || echo reboot)'"; cat <<'L2'
pci=0 dev=""
for d in /sys/bus/pci/devices/*; do
    if [ "$(cat "$d/vendor")" = 0x1af4 ] && [ "$(cat "$d/device")" = 0x107c ]; then
        pci=1 dev="$d"
    fi
done
# Exit costs before a driver claims BAR0 (the kernel's strict /dev/mem rules refuse
# mapping a claimed region); sysfs enables memory decoding without a driver.
if [ -x /bin/exit-cost ] && [ -n "$dev" ]; then
    echo 1 > "$dev/enable"
    /bin/exit-cost "$dev" 2000
    echo 0 > "$dev/enable"
fi
for m in $VIRTIO_MODS; do busybox insmod "/mods/$m.ko" || echo "L2-INSMOD-FAIL $m"; done
[ -z "$dev" ] || { echo "L2-VGPU-PCI ${dev##*/} class=$(cat "$dev/class") irq=$(cat "$dev/irq")"; busybox head -3 "$dev/resource"; }
virtio=0 vdev=""
for v in /sys/bus/virtio/devices/*; do
    [ -e "$v/device" ] || continue
    if [ "$(cat "$v/device")" = 0x003c ]; then virtio=1 vdev="$v"; fi
done
driver=none
if [ -f /mods/vgpu.ko ]; then
    driver=fail
    if busybox insmod /mods/vgpu.ko; then
        st=$(cat "$vdev/status" 2>/dev/null)
        echo "L2-VGPU-DRIVER status=$st features=$(cat "$vdev/features" 2>/dev/null)"
        [ -c /dev/vgpu ] || busybox mdev -s
        [ "$st" = 0x0000000f ] && [ -c /dev/vgpu ] && driver=ok
    fi
fi
user=none
if [ -f /l2-user.sh ]; then
    user=fail
    sh /l2-user.sh > /tmp/user.log 2>&1
    cat /tmp/user.log
    busybox grep -q '^L2-USER-OK' /tmp/user.log && user=ok
fi
dmesg | busybox grep -i -E 'vgpu|virtio' | busybox tail -20
echo "L2-VGPU-RESULT pci=$pci virtio=$virtio driver=$driver user=$user"
# Cloud Hypervisor runs a rebooting guest again: power off instead (ACPI), which ends it.
[ "$L2_END" != poweroff ] || busybox poweroff -f
L2
} > "$WORK/l2-cmd.sh"
"$RIG/l2-initramfs.sh" --out "$WORK/l2.cpio.gz" "${l2_adds[@]}" >/dev/null

EXPECT="pci=1 virtio=1 driver=$([ -n "$DRIVER" ] && echo ok || echo none) user=$([ -n "$L2CMD" ] && echo ok || echo none)"
L2_ARGS="console=ttyS0 reboot=k panic=1 pci=conf1 quiet i8042.noaux i8042.nokbd i8042.nomux i8042.nopnp"
# Under Cloud Hypervisor: its ACPI tables describe the PCI segment; a panic halts (a reboot
# would run the guest again), the step's watchdog ends it.
CH_L2_ARGS="console=ttyS0 quiet i8042.noaux i8042.nokbd i8042.nomux i8042.nopnp"
VMM_NAME=$([ -n "$CH" ] && echo cloud-hypervisor || { [ -n "$QEMU_BIN" ] && echo qemu-system-x86_64; } || echo vgpu-vmm)

cat > "$WORK/cmd.sh" <<CMD
mkdir -p /tmp/vgpu
# Diagnostics: every log of this run stays in L1 and dies with it, so a failing or hung
# step prints them here, on L1's console (which run-l1.sh streams and keeps).
rig_threads() {
    # Each vgpu process's threads: state, kernel wait channel and stack.
    for p in \$(pidof vgpu-vmm cloud-hypervisor qemu-system-x86_64 vgpu-backend 2>/dev/null); do
        echo "---- pid \$p: \$(tr '\\0' ' ' < /proc/\$p/cmdline 2>/dev/null | cut -c1-160)"
        for t in /proc/\$p/task/*; do
            echo "  tid \${t##*/} \$(cat \$t/comm 2>/dev/null) state=\$(cut -d' ' -f3 \$t/stat 2>/dev/null) wchan=\$(cat \$t/wchan 2>/dev/null)"
            sed 's/^/      /' \$t/stack 2>/dev/null | head -n 12
        done
    done
}
rig_dump() {
    echo "==== RIG-DUMP: \$1"
    for f in /tmp/backend.log /tmp/backendB.log /tmp/vmm-*.log /tmp/migrate-*.out /tmp/l2-*.log; do
        [ -f "\$f" ] || continue
        echo "==== \$f (last $RIG_DUMP_LINES lines)"
        tr -d '\r' < "\$f" | grep -a -v '^\$' | tail -n $RIG_DUMP_LINES
    done
    echo "==== RIG-DUMP end"
}
# Ends the step a minute before run-l1.sh kills L1 (whose timeout is $TIMEOUT s): prints where
# every vgpu thread waits and every log, then kills the VMMs and backends so that the
# waits below return and the step fails with the logs on the console.
# (L1's own boot already took part of that time: under load, tens of seconds.)
read -r up0 _ < /proc/uptime
wd=\$(( $((TIMEOUT - 60)) - \${up0%.*} ))
[ "\$wd" -gt 30 ] || wd=30
(
    sleep \$wd
    echo "RIG-WATCHDOG: the step did not end within \${wd}s"
    rig_threads
    rig_dump watchdog
    : > /tmp/rig-failed
    kill -KILL \$(pidof vgpu-vmm cloud-hypervisor vgpu-backend) 2>/dev/null
    pkill -KILL -f /rig/monitor.sh 2>/dev/null
) &
wdog=\$!
# Fails fast: a VMM that ends with an error or a backend that dies (other than the one
# a restart step kills on purpose) ends the whole step at once.
rig_fail() {
    echo "RIG-FAIL: \$1"
    rig_threads
    rig_dump "\$1"
    : > /tmp/rig-failed
    kill -KILL \$(pidof vgpu-vmm cloud-hypervisor vgpu-backend) 2>/dev/null
}
vms=""
for k in \$(seq 0 $((VMS - 1))); do vms="\$vms --vm vm\$k"; done
start_backend() {
    RUST_LOG=$RIG_LOG vgpu-backend --socket-dir /tmp/vgpu --api-socket /tmp/vgpu/api.sock \\
        --vram-mib 256 --vm-swap-mib 256 --sim-idle-sleep-us 5000 $BACKEND_ARGS \$vms >> /tmp/backend.log 2>&1 &
}
start_backend
bp=\$!
for i in \$(seq 1 100); do [ -S /tmp/vgpu/vm$((VMS - 1)).sock ] && break; sleep 0.1; done
rs="" mig="" bp2=""
if [ "$MIGRATE" = 1 ] && [ -n "$CH" ]; then
    # Per VM, once the L2 is ready: a second cloud-hypervisor receiving, and the source
    # sending it the VM locally (guest RAM by fd, the device state through the backend:
    # SET_DEVICE_STATE_FD at the source's snapshot and in the destination's device
    # constructor). The destination writes the same serial file (truncating it): the
    # loops it ran are those past the copy taken when the source said it was done.
    (
        for k in \$(seq 0 $((VMS - 1))); do
            for i in \$(seq 1 $((TIMEOUT * 5))); do
                grep -a -q L2-MIGRATE-READY /tmp/l2-\$k.log 2>/dev/null && break
                sleep 0.2
            done
            # A few loops on the source first.
            sleep 5
            cp /tmp/l2-\$k.log /tmp/l2-\$k.before.log
            (
                timeout -s KILL $((TIMEOUT - 60)) cloud-hypervisor -v $RIG_CH_ARGS \
                    --api-socket path=/tmp/vmm-\$k.dst.api > /tmp/vmm-\$k.dst.log 2>&1
                # (The abort probe's kill is no failure for the fail-fast monitor.)
                r=\$?; echo \$r > /tmp/vmm-\$k.dst.rc\$([ "$RIG_CH_MIGRATE_ABORT" = 1 ] && echo .killed); exit \$r
            ) &
            echo \$! > /tmp/dst-\$k.pid
            for i in \$(seq 1 100); do [ -S /tmp/vmm-\$k.dst.api ] && break; sleep 0.1; done
            ch-remote --api-socket /tmp/vmm-\$k.dst.api receive-migration \
                receiver_url=unix:/tmp/mig-\$k.sock > /tmp/receive-\$k.out 2>&1 &
            rp=\$!
            for i in \$(seq 1 100); do [ -S /tmp/mig-\$k.sock ] && break; sleep 0.1; done
            read -r m0 _ < /proc/uptime
            ch-remote --api-socket /tmp/vmm-\$k.api send-migration \
                destination_url=unix:/tmp/mig-\$k.sock,local=on > /tmp/migrate-\$k.out 2>&1
            src=\$?
            if [ "$RIG_CH_MIGRATE_ABORT" = 1 ]; then
                for p in \$(pidof cloud-hypervisor); do
                    grep -q dst.api /proc/\$p/cmdline && kill -KILL \$p && echo "L2-MIGRATE vm=\$k destination killed"
                done
            fi
            # The API answers at once; the migration runs on in the source VMM.
            for i in \$(seq 1 $((TIMEOUT * 5))); do
                grep -a -q -E "Migration (completed|failed)" /tmp/vmm-\$k.log && break
                sleep 0.2
            done
            read -r m1 _ < /proc/uptime
            cp /tmp/l2-\$k.log /tmp/l2-\$k.atmove.log
            wait \$rp; rrc=\$?
            line=\$(grep -a -o -E "Migration (completed|failed).*" /tmp/vmm-\$k.log | head -n 1)
            echo "L2-MIGRATE vm=\$k send_rc=\$src receive_rc=\$rrc outcome_after=\$(awk -v a=\$m0 -v b=\$m1 'BEGIN{printf "%.2f", b-a}')s: \$line"
            grep -a -i -E "device state|migrat" /tmp/backend.log | tail -n 6 | sed "s/^/L2-MIGRATE vm=\$k backend: /"
            if [ "\$src" = 0 ] && [ "\$rrc" = 0 ] && echo "\$line" | grep -q completed; then
                echo 0 > /tmp/migrate-\$k.rc
            else
                echo 1 > /tmp/migrate-\$k.rc
            fi
        done
        for k in \$(seq 0 $((VMS - 1))); do
            wait \$(cat /tmp/dst-\$k.pid 2>/dev/null || echo 0); echo \$? > /tmp/dst-\$k.rc
        done
    ) &
    mig=\$!
elif [ "$MIGRATE" = 1 ]; then
    # The destination's backend, and per VM: once the L2 is ready, a vgpu-vmm waiting on
    # an incoming address, and vgpu-migrate asking the source VMM to send the VM there.
    mkdir -p /tmp/vgpuB
    RUST_LOG=$RIG_LOG vgpu-backend --socket-dir /tmp/vgpuB --api-socket /tmp/vgpuB/api.sock \
        --vram-mib 256 --vm-swap-mib 256 --sim-idle-sleep-us 5000 $BACKEND_ARGS \$vms > /tmp/backendB.log 2>&1 &
    bp2=\$!
    for i in \$(seq 1 100); do [ -S /tmp/vgpuB/vm$((VMS - 1)).sock ] && break; sleep 0.1; done
    (
        for k in \$(seq 0 $((VMS - 1))); do
            for i in \$(seq 1 $((TIMEOUT * 5))); do
                grep -a -q L2-MIGRATE-READY /tmp/l2-\$k.log 2>/dev/null && break
                sleep 0.2
            done
            : > /tmp/l2-\$k.dst.log
            if [ "$MIGRATE_VIA" = tcp ]; then
                # Between hosts: TCP (here over L1's loopback interface).
                ip link set lo up 2>/dev/null || ifconfig lo 127.0.0.1 up
                to=tcp:127.0.0.1:\$((4700 + k))
            else
                to=unix:/tmp/mig-\$k.sock
            fi
            (
                RUST_LOG=$RIG_LOG vgpu-vmm --incoming \$to --vgpu-socket /tmp/vgpuB/vm\$k.sock \
                    --timeout $((TIMEOUT - 60)) --serial /tmp/l2-\$k.dst.log > /tmp/vmm-\$k.dst.log 2>&1
                r=\$?; echo \$r > /tmp/vmm-\$k.dst.rc; exit \$r
            ) &
            echo \$! > /tmp/dst-\$k.pid
            for i in \$(seq 1 100); do
                grep -a -q "waiting for a migration" /tmp/vmm-\$k.dst.log 2>/dev/null && break
                sleep 0.1
            done
            vgpu-migrate --api /tmp/vmm-\$k.api --to \$to > /tmp/migrate-\$k.out 2>&1
            echo \$? > /tmp/migrate-\$k.rc
            sed "s/^/L2-MIGRATE vm=\$k /" /tmp/migrate-\$k.out
            # The guest's progress after the move, on L1's console while the VM runs.
            (
                dpid=\$(cat /tmp/dst-\$k.pid); seen=0 i=0
                while kill -0 \$dpid 2>/dev/null; do
                    sleep 5; i=\$((i + 1))
                    if [ \$((i % 6)) = 1 ] && [ -x /bin/vgpuctl ]; then
                        vgpuctl --socket /tmp/vgpuB/api.sock --json vm stats vm\$k 2>&1 \
                            | tr -d ' \n' | grep -o '"channels":\[[^]]*\]' | sed "s/^/L2-AFTER vm=\$k backend: /"
                    fi
                    n=\$(grep -a -c 'L2-LOOP' /tmp/l2-\$k.dst.log)
                    if [ "\$n" != "\$seen" ]; then
                        grep -a 'L2-LOOP' /tmp/l2-\$k.dst.log | tail -n \$((n - seen)) | sed "s/^/L2-AFTER vm=\$k /"
                        seen=\$n
                    fi
                done
            ) &
        done
        # The destination VMMs are this subshell's children.
        for k in \$(seq 0 $((VMS - 1))); do
            wait \$(cat /tmp/dst-\$k.pid 2>/dev/null || echo 0); echo \$? > /tmp/dst-\$k.rc
        done
    ) &
    mig=\$!
fi
if [ "$RESTART" = 1 ]; then
    # Kill the backend once every L2 is ready, then start a new one; this subshell owns
    # the new backend and leaves its exit status in /tmp/backend2.rc.
    (
        for i in \$(seq 1 $((TIMEOUT * 5))); do
            n=0
            for k in \$(seq 0 $((VMS - 1))); do grep -a -q L2-RECONNECT-READY /tmp/l2-\$k.log && n=\$((n + 1)); done
            [ "\$n" = $VMS ] && break
            sleep 0.2
        done
        if [ "$HANG" != 0 ]; then
            kill -STOP \$bp
            echo "L2-VGPU-BACKEND-STOPPED pid=\$bp for ${HANG}s"
            sleep $HANG
        fi
        kill -KILL \$bp
        echo "L2-VGPU-BACKEND-KILLED pid=\$bp"
        sleep 2
        start_backend
        echo \$! > /tmp/backend2.pid
        echo "L2-VGPU-BACKEND-RESTARTED pid=\$!"
        wait \$!
        echo \$? > /tmp/backend2.rc
    ) &
    rs=\$!
fi
read -r t0 _ < /proc/uptime
pids=""
for k in \$(seq 0 $((VMS - 1))); do
    : > /tmp/l2-\$k.log
    (
        if [ -n "$CH" ]; then
            # Shared guest memory (vhost-user maps it); the device's two queues at the
            # size the device offers (protocol/src/device.rs: NUM_QUEUES, QUEUE_SIZE).
            timeout -s KILL $((TIMEOUT - 60)) cloud-hypervisor -v $RIG_CH_ARGS --kernel /l2/vmlinuz \\
                --initramfs /l2/l2.cpio.gz --cmdline "$CH_L2_ARGS vgpu.vm=\$k" \\
                --cpus boot=$VCPUS --memory size=256M,shared=on \\
                --generic-vhost-user "socket=/tmp/vgpu/vm\$k.sock,device_type=60,queue_sizes=[256,256],shmem=$CH_SHMEM,id=vgpu\$k" \\
                --serial file=/tmp/l2-\$k.log --console off --api-socket path=/tmp/vmm-\$k.api \\
                > /tmp/vmm-\$k.log 2>&1
        elif [ -n "$QEMU_BIN" ]; then
            # Shared guest memory (vhost-user maps it); -no-reboot: the guest's reboot
            # ends QEMU, as it ends vgpu-vmm.
            timeout -s KILL $((TIMEOUT - 60)) qemu-system-x86_64 -accel kvm -cpu host \\
                -smp $VCPUS -m 256M -machine pc,memory-backend=mem \\
                -object memory-backend-memfd,id=mem,size=256M,share=on \\
                -nodefaults -display none -no-reboot -monitor none \\
                -serial file:/tmp/l2-\$k.log -L /usr/share/seabios -L /usr/share/qemu \\
                -kernel /l2/vmlinuz -initrd /l2/l2.cpio.gz -append "$L2_ARGS vgpu.vm=\$k" \\
                -chardev socket,id=c0,path=/tmp/vgpu/vm\$k.sock \\
                -device vhost-user-device-pci,chardev=c0,virtio-id=60,num_vqs=2,vq_size=256,config_size=32 \\
                > /tmp/vmm-\$k.log 2>&1
        else
            RUST_LOG=$RIG_LOG vgpu-vmm --vgpu-socket /tmp/vgpu/vm\$k.sock --kernel /l2/vmlinuz \\
                --initrd /l2/l2.cpio.gz --mem-mib 256 --vcpus $VCPUS --timeout $((TIMEOUT - 60)) \\
                --cmdline "$L2_ARGS vgpu.vm=\$k" --serial /tmp/l2-\$k.log --api-socket /tmp/vmm-\$k.api \
                > /tmp/vmm-\$k.log 2>&1
        fi
        r=\$?; echo \$r > /tmp/vmm-\$k.rc; exit \$r
    ) &
    pids="\$pids \$!"
done
# The fail-fast monitor (see rig_fail): VMM exit codes and the backends' lives.
(
    while [ ! -f /tmp/rig-done ] && [ ! -f /tmp/rig-failed ]; do
        sleep 1
        for f in /tmp/vmm-*.rc; do
            [ -f "\$f" ] || continue
            r=\$(cat "\$f")
            if [ -n "\$r" ] && [ "\$r" != 0 ] && [ ! -f /tmp/rig-done ]; then
                rig_fail "\${f%.rc} exited with status \$r"; exit 0
            fi
        done
        if [ "$RESTART" = 0 ] && ! kill -0 \$bp 2>/dev/null && [ ! -f /tmp/rig-done ]; then
            rig_fail "vgpu-backend died"; exit 0
        fi
        if [ -f /tmp/backend2.pid ] && ! kill -0 \$(cat /tmp/backend2.pid) 2>/dev/null && [ ! -f /tmp/rig-done ]; then
            rig_fail "the restarted vgpu-backend died"; exit 0
        fi
        if [ -n "\$bp2" ] && ! kill -0 \$bp2 2>/dev/null && [ ! -f /tmp/rig-done ]; then
            rig_fail "the destination vgpu-backend died"; exit 0
        fi
    done
) &
fmon=\$!
mon=""
if [ -f /rig/monitor.sh ]; then
    VGPU_API_SOCKET=/tmp/vgpu/api.sock sh /rig/monitor.sh \$pids &
    mon=\$!
fi
ok=1 k=0
for p in \$pids; do
    wait \$p; rc=\$?
    log=/tmp/l2-\$k.log
    if [ "$MIGRATE" = 1 ]; then
        # The source VMM ended (0: the VM moved); the guest goes on in the destination.
        [ -z "\$mig" ] || wait \$mig; mig=""
        mrc=\$(cat /tmp/migrate-\$k.rc 2>/dev/null || echo none)
        drc=\$(cat /tmp/dst-\$k.rc 2>/dev/null || echo none)
        if [ -n "$CH" ]; then
            grep -a -q 'Migration completed' /tmp/vmm-\$k.log && moved=1 || moved=0
            echo "==== L2 vm\$k serial before the move"; tr -d '\r' < /tmp/l2-\$k.before.log | grep -a -v '^\$' | tail -n 20
            echo "==== cloud-hypervisor vm\$k source"; grep -a -v unregistered /tmp/vmm-\$k.log | tail -n 20
            echo "==== cloud-hypervisor vm\$k destination"; grep -a -v unregistered /tmp/vmm-\$k.dst.log | tail -n 30
            at=\$(grep -a -c 'L2-LOOP [0-9]* ok' /tmp/l2-\$k.atmove.log 2>/dev/null)
            after=\$(( \$(grep -a -c 'L2-LOOP [0-9]* ok' /tmp/l2-\$k.log) - \${at:-0} ))
            down=\$(grep -a -o 'downtime of [0-9]*ms' /tmp/vmm-\$k.log | head -n 1 | grep -o '[0-9]*')
            log=/tmp/l2-\$k.log
        else
            grep -q 'guest ended (MigratedOut)' /tmp/vmm-\$k.log && moved=1 || moved=0
            echo "==== L2 vm\$k serial before the move"; tr -d '\r' < /tmp/l2-\$k.log | grep -a -v '^\$' | tail -n 20
            echo "==== vgpu-vmm vm\$k destination"; head -n 40 /tmp/vmm-\$k.dst.log
            after=\$(grep -a -c 'L2-LOOP [0-9]* ok' /tmp/l2-\$k.dst.log)
            down=""
            log=/tmp/l2-\$k.dst.log
        fi
        echo "L2-MIGRATE-CHECK vm=\$k migrate_rc=\$mrc source_left=\$moved destination_rc=\$drc loops_after_move=\$after\${down:+ downtime_ms=\$down}"
        [ "\$mrc" = 0 ] && [ "\$moved" = 1 ] && [ "\$drc" = 0 ] && [ "\$after" -gt 0 ] || ok=0
        rc=\$drc
    fi
    read -r t1 _ < /proc/uptime
    res=\$(grep -a -o 'L2-VGPU-RESULT.*' \$log | tr -d '\r')
    up=\$(grep -a -o 'L2-UP uptime=[0-9.]*' /tmp/l2-\$k.log | cut -d= -f2)
    echo "==== L2 vm\$k serial"; tr -d '\r' < \$log | grep -a -v '^\$'
    echo "==== $VMM_NAME vm\$k"; tail -n 15 /tmp/vmm-\$k.log
    if [ -n "$CH" ]; then
        # Patch 0005's waits: a guest store that met a chunk the backend held read-only.
        echo "L2-CH-EFAULT vm=\$k waits=\$(grep -a -c 'vCPU access waited' /tmp/vmm-\$k.log) past_1s=\$(grep -a -c 'vCPU access faulting' /tmp/vmm-\$k.log)"
    fi
    echo "L2-VGPU-CHECK vm=\$k vmm_rc=\$rc l2_uptime_at_init=\${up:-none} done_after=\$(awk -v a=\$t0 -v b=\$t1 'BEGIN{printf "%.1f", b-a}')s \${res:-no result}"
    [ "\$rc" = 0 ] && [ "\$res" = "L2-VGPU-RESULT $EXPECT" ] || ok=0
    if [ "$HANG" != 0 ]; then
        grep -q 'did not answer in time' /tmp/vmm-\$k.log && to=1 || to=0
        echo "L2-VGPU-HANG vm=\$k vmm_saw_timeout=\$to"
        [ "\$to" = 1 ] || ok=0
    fi
    k=\$((k + 1))
done
: > /tmp/rig-done
wait \$fmon
[ ! -f /tmp/rig-failed ] || ok=0
if [ -n "\$mon" ]; then wait \$mon; mrc=\$?; echo "L2-VGPU-MONITOR rc=\$mrc"; [ "\$mrc" = 0 ] || ok=0; fi
if [ -n "\$rs" ]; then
    wait \$bp
    if [ -f /tmp/backend2.pid ]; then kill -TERM \$(cat /tmp/backend2.pid); fi
    wait \$rs
    brc=\$(cat /tmp/backend2.rc 2>/dev/null || echo none)
else
    kill -TERM \$bp; wait \$bp; brc=\$?
fi
if [ -n "\$bp2" ]; then
    kill -TERM \$bp2; wait \$bp2; b2=\$?
    echo "==== vgpu-backend (destination)"; tail -n $RIG_LOG_LINES /tmp/backendB.log
    echo "L2-VGPU-BACKEND destination rc=\$b2"
    [ "\$b2" = 0 ] || ok=0
fi
echo "==== vgpu-backend"; tail -n $RIG_LOG_LINES /tmp/backend.log
# How long the backend held moving chunks' CPU views read-only (each spell is logged).
echo "L2-VGPU-READONLY spells=\$(grep -a -c 'read-only for the move' /tmp/backend.log) longest_ms=\$(grep -a -o 'after [0-9]* ms read-only' /tmp/backend.log | awk '\$2 > m { m = \$2 } END { print m + 0 }') past_1s=\$(grep -a 'writable again' /tmp/backend.log | grep -a -c WARN)"
echo "L2-VGPU-BACKEND rc=\$brc"
[ "\$brc" = 0 ] || ok=0
kill \$wdog 2>/dev/null
if [ "\$ok" != 1 ] && [ ! -f /tmp/rig-failed ]; then rig_dump "the step failed"; fi
[ "\$ok" = 1 ]
CMD

l1_adds=()
if [ -n "$CH" ]; then
    # A glibc program: its libraries and loader at the paths it names.
    l1_adds+=(--add "$CH:/bin/cloud-hypervisor")
    libs="$(ldd "$CH" | grep -o '/[^ ]*')"
    if [ "$MIGRATE" = 1 ]; then
        l1_adds+=(--add "$CH_REMOTE:/bin/ch-remote")
        libs="$(printf '%s\n' "$libs" $(ldd "$CH_REMOTE" | grep -o '/[^ ]*') | sort -u)"
    fi
    for lib in $libs; do l1_adds+=(--add "$lib:$lib"); done
fi
if [ -n "$QEMU_BIN" ]; then
    # Likewise (stripped: L1's initramfs is unpacked into its RAM), plus the firmware a
    # pc machine loads to boot a kernel.
    strip -o "$WORK/qemu-system-x86_64" "$QEMU_BIN"
    l1_adds+=(--add "$WORK/qemu-system-x86_64:/bin/qemu-system-x86_64")
    for lib in $(ldd "$QEMU_BIN" | grep -o '/[^ ]*'); do l1_adds+=(--add "$lib:$lib"); done
    for f in /usr/share/seabios/bios-256k.bin /usr/share/qemu/linuxboot_dma.bin \
             /usr/share/qemu/kvmvapic.bin; do
        l1_adds+=(--add "$f:$f")
    done
fi
[ -z "$MONITOR" ] || l1_adds+=(--add "$MONITOR:/rig/monitor.sh")
[ ! -x "$MUSL/vgpuctl" ] || l1_adds+=(--add "$MUSL/vgpuctl:/bin/vgpuctl")
"$RIG/run-l1.sh" --timeout "$TIMEOUT" --script "$WORK/cmd.sh" ${l1_adds[@]+"${l1_adds[@]}"} \
    --add "$MUSL/vgpu-vmm:/bin/vgpu-vmm" --add "$MUSL/vgpu-backend:/bin/vgpu-backend" \
    --add "$MUSL/vgpu-migrate:/bin/vgpu-migrate" \
    --add "$KERNEL:/l2/vmlinuz" --add "$WORK/l2.cpio.gz:/l2/l2.cpio.gz" \
    ${EXTRA[@]+"${EXTRA[@]}"}
