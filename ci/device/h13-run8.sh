#!/usr/bin/env bash
# Device run 8 of 2026-11-24 (issue 13): the guest's wait with naps capped at 100 µs;
# the sgemm kernel inside vgpu against native's under Nsight Compute (time, SM clock,
# registers, occupancy, L2), the two SASS side by side, and the operand pointers vgpu
# launches with. Carried in B: vgpu-bench (stripped), native.cu, kernels.cu, this script.
set -u
B=${B:-.devbin/h13r8}
O=${OUT:-/tmp/out}
mkdir -p "$O"
R="$O/run8.txt"
nvcc -O2 -DVGPU_KERNELS_CU='"kernels.cu"' -I$B -o /tmp/cn $B/native.cu -lcuda 2>&1 | tail -3
nvcc -O2 -fmad=false -gencode arch=compute_90,code=sm_90 -DVGPU_KERNELS_CU='"kernels.cu"' -I$B \
  -o /tmp/cn90 $B/native.cu -lcuda 2>&1 | tail -3
W="--large --only workloads --workloads sgemm,hotspot"
for round in 1 2; do
  echo "== vgpu (wait fix), round $round" | tee -a "$R"
  VGPU_NVRTC_DUMP=$O/vgpu-sm90.cubin \
  RUST_LOG=info,vgpu_host_shim::cuda::frontend=trace,vgpu_host_shim::cuda::driver=trace timeout 150 \
    $B/vgpu-bench --json cuda --gpu cuda --baseline /tmp/cn --vram-mib 8192 $W --reps 3 \
    > "$O/vgpu-$round.json" 2> "$O/vgpu.log"; echo "rc $?" | tee -a "$R"
  grep -E "_ms\"|ratio" "$O/vgpu-$round.json" | cut -c1-150 | tee -a "$R"
  grep -oE "entry ran [0-9]{6,} ns" "$O/vgpu.log" | awk '{printf "%.3f ", $3/1e6} END {print ""}' | tee -a "$R"
  grep -E "launch Sgemm" "$O/vgpu.log" | head -2 | cut -c1-300 | tee -a "$R"
done
echo "== resources" | tee -a "$R"
cuobjdump -res-usage "$O/vgpu-sm90.cubin" 2>&1 | grep -A1 sgemm | tee -a "$R"
cuobjdump -res-usage /tmp/cn90 2>&1 | grep -A1 sgemm | tee -a "$R"
cuobjdump -res-usage /tmp/cn 2>&1 | grep -A1 sgemm | tee -a "$R"
cuobjdump -sass "$O/vgpu-sm90.cubin" | awk '/Function : vgpu_sgemm/,/\.\.\.\.\.\.\.\.\.\./' | sed 's@/\*[0-9a-f]*\*/@@; s@ */\* 0x[0-9a-f]* \*/@@' > /tmp/sass-vgpu.txt
cuobjdump -sass /tmp/cn90 | awk '/Function : vgpu_sgemm/,/\.\.\.\.\.\.\.\.\.\./' | sed 's@/\*[0-9a-f]*\*/@@; s@ */\* 0x[0-9a-f]* \*/@@' > /tmp/sass-cn90.txt
wc -l /tmp/sass-vgpu.txt /tmp/sass-cn90.txt | tee -a "$R"
diff /tmp/sass-vgpu.txt /tmp/sass-cn90.txt > "$O/sass-diff.txt"; echo "sass diff lines: $(wc -l < $O/sass-diff.txt)" | tee -a "$R"
M=gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,launch__registers_per_thread,launch__occupancy_limit_registers,sm__warps_active.avg.pct_of_peak_sustained_active,lts__t_sector_hit_rate.pct,dram__bytes_read.sum,smsp__inst_executed.sum,launch__shared_mem_per_block_static,launch__grid_size,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,lts__t_sectors_srcunit_tex_op_read.sum,launch__func_cache_config,sm__cycles_active.avg
echo "== ncu native (nvcc default)" | tee -a "$R"
timeout 120 ncu --clock-control none --cache-control none -k vgpu_sgemm -c 2 --metrics $M \
  /tmp/cn --large --only workloads --workloads sgemm > "$O/ncu.txt" 2>&1; echo "rc $?" | tee -a "$R"
echo "== ncu native sm_90 -fmad=false" >> "$O/ncu.txt"
timeout 120 ncu --clock-control none --cache-control none -k vgpu_sgemm -c 2 --metrics $M \
  /tmp/cn90 --large --only workloads --workloads sgemm >> "$O/ncu.txt" 2>&1; echo "rc $?" | tee -a "$R"
echo "== ncu vgpu" | tee -a "$R"
echo "== ncu vgpu" >> "$O/ncu.txt"
timeout 200 ncu --clock-control none --cache-control none -k vgpu_sgemm -c 2 --metrics $M \
  $B/vgpu-bench cuda --gpu cuda --vram-mib 8192 --large --only workloads --workloads sgemm --reps 1 \
  >> "$O/ncu.txt" 2>&1; echo "rc $?" | tee -a "$R"
grep -E "==|vgpu_sgemm|gpu__time|per_second|registers_per|warps_active|hit_rate|inst_executed|bank_conf|dram__bytes|sm__cycles_active" "$O/ncu.txt" | tee -a "$R"
