# L2 side of the rig fairness run (ci/rig/l2-fair.sh): VM 0 runs a throttle with 10 ms
# kernels, every other VM one with 1 ms kernels, for the same time. On the GPU's own
# round-robin the long kernels take most of the GPU; the fair scheduler splits it by VM
# weight (1:1).
export PATH=/bin
vm=$(sed -n 's/.*vgpu\.vm=\([0-9]*\).*/\1/p' /proc/cmdline)
# The short-kernel tenant keeps a deep queue so that a slow nested guest still saturates
# its share (a work-conserving scheduler gives an under-submitting VM's share away).
us=1000 depth=32
[ "$vm" = 0 ] && us=10000 depth=4
echo "L2-FAIR vm=$vm kernel_us=$us depth=$depth"
vgpu-throttle --kernel-us $us --depth $depth --duration ${FAIR_SECS:-45} && echo "L2-USER-OK"
