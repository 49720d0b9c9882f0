# The guest-side checks of the vgpu stack, run in an L2 guest by `l2-vgpu.sh --guest`
# (busybox sh; vgpu.ko loaded, static guest tools in /bin). Prints one
# "L2-GUEST-CHECK ok|FAIL NAME" line per check and "L2-USER-OK" when all passed.
export PATH=/bin
fail=0
# Every tool run is bounded (generous for TCG: a stuck run fails its check instead of
# holding the guest until the outer timeout).
LIMIT=${CHECK_LIMIT:-300}
bounded() { busybox timeout -s KILL "$LIMIT" "$@"; }
check() { if [ "$2" = 1 ]; then echo "L2-GUEST-CHECK ok $1"; else echo "L2-GUEST-CHECK FAIL $1"; fail=1; fi; }
ok() { [ "$1" = 0 ] && echo 1 || echo 0; }
[ -c /dev/vgpu ] && node=1 || node=0
check devnode $node
# Every builtin kernel on VRAM and guest-RAM buffers, verified; channels' control pages
# are the backend's pages, SHMEM_MAPped into the BAR and mmapped by the process.
bounded vgpu-smoke > /tmp/smoke.out 2>&1; r=$?; busybox tail -n 3 /tmp/smoke.out; check smoke $(ok $r)
# Two processes of this VM at once, with different inputs.
bounded vgpu-smoke --seed 11 > /tmp/s1.out 2>&1 & p1=$!
bounded vgpu-smoke --seed 12 > /tmp/s2.out 2>&1 & p2=$!
wait $p1; r1=$?; wait $p2; r2=$?
for f in /tmp/s1.out /tmp/s2.out; do
    busybox tail -n 1 $f; grep -i -E 'fail|error' $f | busybox head -n 5
done
check "two_processes(rc=$r1,$r2)" $([ "$r1" = 0 ] && [ "$r2" = 0 ] && echo 1 || echo 0)
# Bad arguments, forged ids, another process's slots: errors, no leaks.
bounded vgpu-smoke --hostile > /tmp/hostile.out 2>&1; r=$?; busybox tail -n 2 /tmp/hostile.out
check hostile $(ok $r)
# CPU stores through a VRAM buffer's aperture while VRAM beyond this VM's share comes and
# goes beside it, so the backend moves the buffer's chunks under the stores (each move
# holds the chunk read-only: a store waits in vgpu-vmm and lands in the new copy).
# (A forwarded device has no aperture: there the CPU reaches VRAM by copies, no check.)
if [ "$(cat /sys/class/misc/vgpu/submission 2>/dev/null)" = forwarded ]; then
    echo "L2-GUEST-CHECK skip swap_cpu_stores (forwarded: no aperture)"
else
    bounded vgpu-smoke --swap 30 --swap-buffer-mib 16 --swap-pressure-mib 160 > /tmp/swap.out 2>&1; r=$?; busybox tail -n 3 /tmp/swap.out
    check swap_cpu_stores $(ok $r)
fi
# A C program on the guest libcuda.so.1 over /dev/vgpu (when the rig built it): memory,
# copies, sets, streams, events; its module load gets the GPU's own refusal (the sim runs
# no guest modules), which the library logs.
if [ -x /bin/cuda-program ]; then
    (export LD_LIBRARY_PATH=/lib/vgpu; bounded cuda-program > /tmp/cuda.out 2> /tmp/cuda.err); r=$?
    busybox tail -n 1 /tmp/cuda.out; busybox tail -n 3 /tmp/cuda.err
    grep -q "devvgpu_program ok module_load=CUDA_ERROR_NOT_SUPPORTED" /tmp/cuda.out \
        && grep -q "guest modules need the cuda GPU" /tmp/cuda.err && cuda=1 || cuda=0
    check "cuda_program(rc=$r)" $([ "$r" = 0 ] && echo $cuda || echo 0)
fi
# The runtime API (vgpu's libcudart.so.13 over its libcuda.so.1, nothing else on the
# library path): device, properties, memory, copies, a set, pinned memory, a stream with
# events.
if [ -x /bin/cuda-runtime-program ]; then
    (export LD_LIBRARY_PATH=/lib/vgpu; bounded cuda-runtime-program > /tmp/cudart.out 2> /tmp/cudart.err); r=$?
    busybox tail -n 1 /tmp/cudart.out; busybox tail -n 3 /tmp/cudart.err
    grep -q "devvgpu_runtime ok" /tmp/cudart.out && cudart=1 || cudart=0
    check "cuda_runtime_program(rc=$r)" $([ "$r" = 0 ] && echo $cudart || echo 0)
fi
# A process killed mid-submission leaves nothing behind.
vgpu-throttle --kernel-us 2000 --duration 60 > /tmp/t.out 2>&1 & tp=$!
sleep 2; kill -9 $tp; wait $tp 2>/dev/null
# The guest benchmark, as JSON lines (l2-driver.sh sets them beside an L1-native run).
bounded vgpu-guest-bench --json --quick --reps 5 > /tmp/bench.out 2>&1; r=$?
while read -r l; do echo "L2-BENCH $l"; done < /tmp/bench.out
check bench_quick $(ok $r)
bounded vgpu-smoke --stats > /tmp/stats.out 2>&1; cat /tmp/stats.out
grep -q 'contexts=0 channels=0 vram_bytes=0 mapped_guest_bytes=0 aperture_bytes=0' /tmp/stats.out && clean=1 || clean=0
check nothing_left_in_backend $clean
[ "$fail" = 0 ] && echo "L2-USER-OK"
