# The live-migration checks, run in an L2 guest by `l2-vgpu.sh --guest --migrate`
# (busybox sh; vgpu.ko loaded, static guest tools in /bin). Once the guest is ready it
# prints L2-MIGRATE-READY; L1 then sends the VM from its vgpu-vmm + vgpu-backend pair to
# a second pair while this script keeps running GPU work that verifies its results
# (vgpu-smoke, back to back, for MIGRATE_SECS of guest time). Every run's verdict goes
# straight to the console, so the lines after the move appear in the destination VMM's
# serial log. Prints "L2-USER-OK" when every run passed.
export PATH=/bin
MIGRATE_SECS=${MIGRATE_SECS:-75}
# Every wait here is bounded: a smoke run takes a few seconds even under TCG.
SMOKE_LIMIT=${SMOKE_LIMIT:-120}
smoke() { busybox timeout -s KILL "$SMOKE_LIMIT" vgpu-smoke "$@"; }
# The driver's view of its rings and requests, for a failure's report.
rings() { cat /sys/class/misc/vgpu/rings 2>/dev/null; dmesg | busybox tail -n 15; }
fail=0
if smoke > /tmp/smoke0.out 2>&1; then
    echo "L2-GUEST-CHECK ok smoke_before"
else
    echo "L2-GUEST-CHECK FAIL smoke_before"; busybox grep -a FAIL /tmp/smoke0.out; busybox tail -n 2 /tmp/smoke0.out; fail=1
fi
# A process whose channel lives across the move: kernels of 2 ms for the whole window.
vgpu-throttle --kernel-us 2000 --duration "$MIGRATE_SECS" > /tmp/throttle.out 2>&1 & thr=$!
echo "L2-MIGRATE-READY" > /dev/console
read -r now _ < /proc/uptime; end=$(( ${now%.*} + MIGRATE_SECS ))
n=0 bad=0
while :; do
    read -r now _ < /proc/uptime
    [ "${now%.*}" -lt "$end" ] || break
    if smoke > /tmp/smoke.out 2>&1; then
        n=$((n + 1)); echo "L2-LOOP $n ok t=$now" > /dev/console
    else
        bad=$((bad + 1)); echo "L2-LOOP FAIL t=$now" > /dev/console
        { busybox grep -a FAIL /tmp/smoke.out; busybox tail -n 2 /tmp/smoke.out; } > /dev/console
        rings > /dev/console
    fi
done
# Bounded: a throttle whose channel stopped on the move would wait forever.
i=0
while kill -0 $thr 2>/dev/null && [ $i -lt 120 ]; do sleep 1; i=$((i + 1)); done
if kill -0 $thr 2>/dev/null; then
    echo "L2-GUEST-CHECK throttle still running ${i}s after its end: killed" > /dev/console
    busybox tail -n 5 /tmp/throttle.out > /dev/console
    kill -9 $thr
fi
wait $thr; r=$?
busybox tail -n 2 /tmp/throttle.out
if [ "$r" = 0 ]; then echo "L2-GUEST-CHECK ok throttle_across_the_move"; else echo "L2-GUEST-CHECK FAIL throttle_across_the_move rc=$r"; fail=1; fi
echo "L2-MIGRATE-LOOPS ok=$n fail=$bad"
[ "$bad" = 0 ] && [ "$n" -gt 0 ] || fail=1
# Splats from the driver's load on (as l2-reconnect-checks.sh: the boot's "Speculative
# Return Stack Overflow: WARNING" notice is no splat), and no device reset: the device
# goes on across the move.
dmesg | busybox sed -n '/vgpu: loading out-of-tree module/,$p' \
    | busybox grep -E 'Oops|BUG:|WARNING: CPU|Call Trace|general protection|resetting the device|timed out' > /tmp/bad
if [ -s /tmp/bad ]; then
    echo "L2-GUEST-CHECK FAIL kernel_log_clean"; busybox head -n 20 /tmp/bad; fail=1
else
    echo "L2-GUEST-CHECK ok kernel_log_clean"
fi
[ "$fail" = 0 ] && echo "L2-USER-OK"
