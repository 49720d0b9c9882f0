# The guest side of ci/ch/guest-test.sh (busybox sh in an L2 under Cloud Hypervisor,
# vgpu.ko loaded): the device must run forwarded (Cloud Hypervisor has no vhost-user
# SHMEM, so the guest sees no shared-memory region and acks VIRTIO_VGPU_F_FORWARDED),
# then the rig's checks run (/l2-checks.sh: ci/rig/l2-guest-checks.sh, or with
# `guest-test.sh --migrate` ci/rig/l2-migrate-checks.sh). Prints "L2-USER-OK" when all passed.
export PATH=/bin
mode=$(cat /sys/class/misc/vgpu/submission 2>/dev/null || echo none)
echo "CH-GUEST submission=$mode"
if [ "$mode" != forwarded ]; then
    echo "L2-GUEST-CHECK FAIL submission_forwarded ($mode)"
    exit 1
fi
echo "L2-GUEST-CHECK ok submission_forwarded"
exec sh /l2-checks.sh
