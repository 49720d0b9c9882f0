# Guest side of ci/qemu/guest-test.sh (busybox sh, run as /l2-cmd.sh by the
# l2-initramfs /init on every boot). Loads virtio_pci and vgpu.ko, reports the device and
# its submission mode, then serves commands typed on the serial console, one a line:
#   checks       the rig's guest checks (ci/rig/l2-guest-checks.sh): smoke, two
#                processes, hostile, a killed process, the quick bench, a clean backend
#   smoke        vgpu-smoke once (after a backend restart: a new process works again)
#   reload       rmmod vgpu, insmod it again (a driver reset: RESET_DEVICE, vrings
#                stopped and started again), then vgpu-smoke
#   throttle S   vgpu-throttle with 1 ms kernels for S seconds (the fairness run)
#   bench        vgpu-guest-bench --json --submit-only (round trips, submission rate)
#   halt         power off
# Every command ends with "QG-END <cmd> rc=<status>".
export PATH=/bin
for m in $VIRTIO_MODS; do busybox insmod "/mods/$m.ko" || echo "QG-INSMOD-FAIL $m"; done
busybox insmod /mods/vgpu.ko || echo "QG-INSMOD-FAIL vgpu"
[ -c /dev/vgpu ] || busybox mdev -s
vdev=""
for v in /sys/bus/virtio/devices/*; do
    [ -e "$v/device" ] || continue
    [ "$(cat "$v/device")" = 0x003c ] && vdev="$v"
done
mode=$(cat /sys/class/misc/vgpu/submission 2>/dev/null || echo none)
echo "QG-BOOT submission=$mode status=$(cat "$vdev/status" 2>/dev/null) features=$(cat "$vdev/features" 2>/dev/null)"
dmesg | busybox grep -i -E 'vgpu' | busybox tail -5
echo "QG-READY"
while read -r cmd arg; do
    case "$cmd" in
        checks) sh /l2-guest-checks.sh > /tmp/checks.log 2>&1; r=$?
                cat /tmp/checks.log
                busybox grep -q '^L2-USER-OK' /tmp/checks.log || r=1 ;;
        smoke) vgpu-smoke > /tmp/smoke.log 2>&1; r=$?; busybox tail -n 2 /tmp/smoke.log ;;
        reload) r=1
                if busybox rmmod vgpu && busybox insmod /mods/vgpu.ko; then
                    [ -c /dev/vgpu ] || busybox mdev -s
                    echo "QG-RELOADED submission=$(cat /sys/class/misc/vgpu/submission)"
                    vgpu-smoke > /tmp/smoke.log 2>&1; r=$?; busybox tail -n 1 /tmp/smoke.log
                fi ;;
        bench) vgpu-guest-bench --json --submit-only --samples 300; r=$? ;;
        throttle) vgpu-throttle --kernel-us 1000 --depth 32 --duration "${arg:-20}"; r=$? ;;
        halt) echo "QG-END halt rc=0"; busybox poweroff -f ;;
        "") continue ;;
        *) echo "QG-UNKNOWN $cmd"; r=1 ;;
    esac
    echo "QG-END $cmd rc=$r"
done
