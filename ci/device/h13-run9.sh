#!/usr/bin/env bash
# Device run 9 of 2026-11-24 (issue 13): is the sgemm gap the compiler's? NVRTC gives
# vgpu_sgemm 40 registers (70 % warps active, 8.07 ms a kernel under ncu), nvcc 48 (sm_90)
# or 62 (its default compute_75 PTX, JIT at load; 7.78 ms). vgpu loads nvcc's fatbin of
# the same kernels.cu (VGPU_KERNELS_IMAGE), and kernels.cu variants of the sgemm inner loop
# are run on both sides (VGPU_KERNELS_CU for vgpu's NVRTC, -DVGPU_KERNELS_CU for native):
# k0 as in the tree, kA full tiles unrolled, kB unroll 4, kC no unroll, kD kA with
# __launch_bounds__(256, 4). Carried in B: vgpu-bench, native.cu, k*.cu, this script.
set -u
B=${B:-.devbin/h13r9}
O=${OUT:-/tmp/out}
mkdir -p "$O"
R="$O/run9.txt"
nvcc --version | tail -2 | tee -a "$R"
ls -la /usr/local/cuda/lib64/libnvrtc.so* 2>&1 | head -3 | tee -a "$R"
W="--large --only workloads --workloads sgemm --reps 3"
vg() {  # name, extra env...
  local name=$1; shift
  env "$@" RUST_LOG=info,vgpu_host_shim::cuda::frontend=trace timeout 120 \
    $B/vgpu-bench --json cuda --gpu cuda --vram-mib 8192 $W --baseline /tmp/cn-k0 \
    > "$O/vg-$name.json" 2> /tmp/vg-$name.log; echo "rc $?"
  echo "-- vgpu $name: $(grep -E 'NVRTC|kernels (compiled|loaded)' /tmp/vg-$name.log | head -2 | sed 's/.*cuda: //' | tr '\n' ';')"
  grep -E "sgemm_(vgpu_native|vm)_ms|sgemm_vm_vs_cuda|cuda_native_sgemm" "$O/vg-$name.json" | sed 's/.*"name":"\([^"]*\)","value":\([0-9.]*\).*/  \1 \2/'
  echo "  entries: $(grep -oE 'entry ran [0-9]{7,} ns' /tmp/vg-$name.log | awk '{printf "%.3f ", $3/1e6}')"
}
for v in k0 kA kB kC kD; do
  nvcc -O2 -DVGPU_KERNELS_CU="\"$v.cu\"" -I$B -o /tmp/cn-$v $B/native.cu -lcuda 2>&1 | tail -3
  nvcc -O2 -cubin -fmad=false -arch=sm_90 -o /tmp/$v-nvcc90.cubin $B/$v.cu 2>&1 | tail -3
done
nvcc -fatbin -fmad=false -o /tmp/k0.fatbin $B/k0.cu
{
  for v in k0 kA kB kC kD; do
    echo "== $v"
    echo "native nvcc default: $(/tmp/cn-$v --large --only workloads --workloads sgemm | tr '\n' ' ')"
    echo "nvcc sm_90 $(cuobjdump -res-usage /tmp/$v-nvcc90.cubin | grep -A1 sgemm | tail -1)"
    vg $v VGPU_KERNELS_CU=$B/$v.cu VGPU_NVRTC_DUMP=/tmp/$v-nvrtc.cubin
    echo "nvrtc sm_90 $(cuobjdump -res-usage /tmp/$v-nvrtc.cubin | grep -A1 sgemm | tail -1)"
  done
  echo "== vgpu with nvcc's fatbin of k0 (default target, JIT at load)"
  vg fatbin VGPU_KERNELS_IMAGE=/tmp/k0.fatbin
  echo "== again: native k0, kA"
  for v in k0 kA; do echo "native $v: $(/tmp/cn-$v --large --only workloads --workloads sgemm | tr '\n' ' ')"; done
} 2>&1 | tee -a "$R"
