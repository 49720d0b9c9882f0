# The guest side of ci/ch/guest-test.sh (busybox sh in an L2 under Cloud Hypervisor,
# vgpu.ko loaded): the device must run in the mode the test gave it (/ch-expect-mode):
# forwarded (`shmem=off`: the guest sees no shared-memory region and acks
# VIRTIO_VGPU_F_FORWARDED) or direct (`guest-test.sh --direct`: region 0 is a BAR),
# then the rig's checks run (/l2-checks.sh: ci/rig/l2-guest-checks.sh, or with
# `guest-test.sh --migrate` ci/rig/l2-migrate-checks.sh). Prints "L2-USER-OK" when all passed.
export PATH=/bin
want=$(cat /ch-expect-mode 2>/dev/null || echo forwarded)
mode=$(cat /sys/class/misc/vgpu/submission 2>/dev/null || echo none)
echo "CH-GUEST submission=$mode"
if [ "$mode" != "$want" ]; then
    echo "L2-GUEST-CHECK FAIL submission_$want ($mode)"
    exit 1
fi
echo "L2-GUEST-CHECK ok submission_$want"
exec sh /l2-checks.sh
