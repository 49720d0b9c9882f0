# The reconnect checks, run in an L2 guest by `l2-vgpu.sh --guest --restart-backend`
# (busybox sh; vgpu.ko loaded, static guest tools in /bin). L1 SIGKILLs vgpu-backend once
# every L2 printed L2-RECONNECT-READY and starts a new one on the same sockets; vgpu-vmm
# reconnects and asks the driver for a reset (DEVICE_NEEDS_RESET + configuration
# interrupt). Here: the process that held the device when the backend died ends with an
# error by itself (no hang), vgpu-smoke passes again on the new backend, and the kernel
# log has no oops, BUG or WARN splat. Prints "L2-GUEST-CHECK ok|FAIL NAME" per check and
# "L2-USER-OK" when all passed.
export PATH=/bin
fail=0
# Each result also goes straight to the console (l2-vgpu.sh shows this script's output
# only when it ends: a guest stuck here would show nothing), with the kernel log's tail
# after a failure.
check() {
    if [ "$2" = 1 ]; then echo "L2-GUEST-CHECK ok $1"; else echo "L2-GUEST-CHECK FAIL $1"; fail=1; fi
    echo "L2-PROGRESS $1=$2" > /dev/console
    [ "$2" = 1 ] || dmesg | busybox tail -n 30 > /dev/console
}
ok() { [ "$1" = 0 ] && echo 1 || echo 0; }
# Liveness bound for each wait below (TCG is slow; never a performance target).
PATIENCE=400

vgpu-smoke > /tmp/smoke1.out 2>&1; r=$?; busybox tail -n 2 /tmp/smoke1.out
check smoke_before $(ok $r)
# A process with channels and GPU work in flight while the backend dies.
vgpu-throttle --kernel-us 2000 --duration 3000 > /tmp/old.out 2>&1 & old=$!
sleep 2
# Straight to the console: l2-vgpu.sh shows this script's output only when it ends.
echo "L2-RECONNECT-READY" > /dev/console
# A process that sends requests while the backend is away (killed, or stopped with
# `--hang-backend`: then its request times out and the driver resets the device).
vgpu-smoke > /tmp/outage.out 2>&1 & outage=$!
# A prober asks for the VM's counts every second until an answer fails. With a hung
# backend its request is the one that times out and makes the driver reset the device
# (so vgpu-vmm's own reset meets the hung backend), whatever the processes above are
# doing then: one spinning on a fence of a stopped GPU sends no request, and the
# outage process may have ended before the backend stopped (the other guest became
# ready later, and L1 stops the backend only once all are).
(
    i=0
    while [ $i -lt $PATIENCE ] && vgpu-smoke --stats > /dev/null 2>&1; do sleep 1; i=$((i + 1)); done
) & prober=$!
# Waits up to PATIENCE s for process $1 to end by itself: 0 if it did (its exit status in
# $rc), else kills it and returns 1.
ended() {
    i=0
    while kill -0 $1 2>/dev/null && [ $i -lt $PATIENCE ]; do sleep 1; i=$((i + 1)); done
    if kill -0 $1 2>/dev/null; then
        kill -9 $1; wait $1 2>/dev/null
        return 1
    fi
    wait $1; rc=$?
    return 0
}
# It must end by itself with an error (an ioctl's -ENODEV or SIGBUS on its zapped
# channel page), never hang.
if ended $old; then
    busybox tail -n 2 /tmp/old.out
    echo "old process rc=$rc"
    check old_process_ended_with_an_error $([ "$rc" != 0 ] && echo 1 || echo 0)
else
    check old_process_ended_with_an_error 0
fi
# The outage process must end by itself too (any result: it may have run before the
# backend went away).
if ended $outage; then
    busybox tail -n 1 /tmp/outage.out
    check "requests_during_outage_end(rc=$rc)" 1
else
    check requests_during_outage_end 0
fi
if ended $prober; then
    check prober_saw_the_outage 1
else
    check prober_saw_the_outage 0
fi
# New processes work once the device is back (the first tries may find no backend yet).
i=0 r=1
while [ $i -lt $PATIENCE ]; do
    if [ -c /dev/vgpu ] && vgpu-smoke > /tmp/smoke2.out 2>&1; then r=0; break; fi
    sleep 2; i=$((i + 2))
done
busybox tail -n 2 /tmp/smoke2.out
check smoke_after_reconnect $(ok $r)
vgpu-smoke --seed 21 > /tmp/smoke3.out 2>&1; r=$?; busybox tail -n 1 /tmp/smoke3.out
check smoke_again $(ok $r)
dmesg | grep -c 'resetting the device' > /tmp/resets
check "device_reset_seen($(cat /tmp/resets))" $([ "$(cat /tmp/resets)" -ge 1 ] && echo 1 || echo 0)
# Splats only: a WARN_ON prints "WARNING: CPU: ..." (the boot's CPU-vulnerability notice
# "Speculative Return Stack Overflow: WARNING: ..." is no splat). From the driver's load
# on: under TCG on a busy host the guest's boot alone can trip the soft-lockup watchdog.
dmesg | busybox sed -n '/vgpu: loading out-of-tree module/,$p' \
    | grep -E 'Oops|BUG:|WARNING: CPU|Call Trace|general protection|refcount_t|list_(add|del) corruption' > /tmp/bad
busybox head -n 20 /tmp/bad
check dmesg_clean $([ -s /tmp/bad ] && echo 0 || echo 1)
[ "$fail" = 0 ] && echo "L2-USER-OK"
