// vgpu builtin kernels for the `cuda` GPU, compiled by NVRTC at start (and by nvcc for the
// native baseline, bench/cuda-native). Results must be bit-identical to the sim's
// (host-shim/src/kernels.rs): every f32 operation is an explicitly rounded __fmul_rn /
// __fadd_rn in the sim's order, so no multiply-add is ever contracted.

typedef unsigned long long u64;
typedef unsigned int u32;

__device__ __forceinline__ u64 vgpu_globaltimer() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// The fence signal: a kernel that ends a GP entry also writes the entry's REF itself
// (`*ref = value`) once every block is done, instead of a cuStreamWriteValue32 after it (a
// driver call of ~0.8 us per GP entry on the H100: a fifth of an empty kernel's launch).
// Each block's first thread, after the block's barrier, counts the block done on `count`
// (the channel's own word in device memory, 0 between kernels) with an acquire-release
// atomic at GPU scope; the last block resets it and stores REF with release semantics at
// system scope, so a host that reads REF reads every block's writes after it (release is
// cumulative over what the barriers and the counter's acquires ordered before it; the
// last-block pattern of CUDA's threadFenceReduction sample, without its per-block
// system-wide fence). The next kernel of the stream starts only after this one has ended,
// so one word per channel suffices. `ref` is null when the kernel signals nothing (the
// native baseline's launches; grids too large to be worth it: the front end then issues
// the write itself).
//
// The prior write: the REF write the stream's work before this kernel still owes (a kernel
// whose grid was too large to signal itself ended just before this one, which starts only
// after it: stream order). One thread stores it as the kernel starts, with release
// semantics at system scope (cumulative over the earlier kernel's writes, which happen
// before this kernel in stream order), where a stream write between the two kernels would
// cost the GPU ~2.4 us (native CUDA's saxpy loop with a REF write after each kernel ran
// 3.3 % slower on the H100, 2026-11-28). `vgpu_prior_ref` is null when nothing is owed.
// The stencil has no prologue: it runs slower with the write than behind a stream write
// (device.rs, `prior_in_kernel`).
#define VGPU_SIGNAL_PARAMS                                                                  \
    u32 *vgpu_ref = 0, u32 vgpu_ref_value = 0, u32 *vgpu_ref_count = 0,                     \
        u32 *vgpu_prior_ref = 0, u32 vgpu_prior_value = 0
#define VGPU_SIGNAL , VGPU_SIGNAL_PARAMS
#define VGPU_PRIOR vgpu_prior(vgpu_prior_ref, vgpu_prior_value)

__device__ __forceinline__ void vgpu_prior(u32* ref, u32 value) {
    if (ref == 0) return;
    if ((blockIdx.x | blockIdx.y | blockIdx.z | threadIdx.x | threadIdx.y | threadIdx.z) != 0) return;
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(ref), "r"(value) : "memory");
}

__device__ __forceinline__ void vgpu_signal(u32* ref, u32 value, u32* count) {
    if (ref == 0) return;
    __syncthreads();
    if (threadIdx.x != 0 || threadIdx.y != 0 || threadIdx.z != 0) return;
    u32 blocks = gridDim.x * gridDim.y * gridDim.z;
    if (blocks > 1) {
        u32 done;
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;"
                     : "=r"(done)
                     : "l"(count)
                     : "memory");
        if (done != blocks - 1) return;
        asm volatile("st.relaxed.gpu.global.u32 [%0], 0;" ::"l"(count) : "memory");
    }
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(ref), "r"(value) : "memory");
}

extern "C" __global__ void vgpu_empty(VGPU_SIGNAL_PARAMS) {
    VGPU_PRIOR;
    vgpu_signal(vgpu_ref, vgpu_ref_value, vgpu_ref_count);
}

// Each thread spins for `ns` nanoseconds of the GPU clock; launched with enough blocks to
// fill every SM, it occupies the whole GPU.
extern "C" __global__ void vgpu_spin(u64 ns VGPU_SIGNAL) {
    VGPU_PRIOR;
    u64 start = vgpu_globaltimer();
    while (vgpu_globaltimer() - start < ns) {
    }
    vgpu_signal(vgpu_ref, vgpu_ref_value, vgpu_ref_count);
}

// Writes the GPU clock minus `offset` (so it reads as host CLOCK_MONOTONIC).
extern "C" __global__ void vgpu_timestamp(u64* dst, u64 offset VGPU_SIGNAL) {
    VGPU_PRIOR;
    *dst = vgpu_globaltimer() - offset;
    vgpu_signal(vgpu_ref, vgpu_ref_value, vgpu_ref_count);
}

// Byte i of the fill is byte (i % 4) of the little-endian pattern.
extern "C" __global__ void vgpu_memset(unsigned char* dst, u64 len, u32 pattern VGPU_SIGNAL) {
    VGPU_PRIOR;
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 w = (u64)blockIdx.x * blockDim.x + threadIdx.x; w * 4 < len; w += stride) {
        u64 i = w * 4;
        if (i + 4 <= len && ((u64)(dst + i) & 3) == 0) {
            *(u32*)(dst + i) = pattern;
        } else {
            for (u64 j = i; j < i + 4 && j < len; j++) {
                dst[j] = (unsigned char)(pattern >> (8 * (j & 3)));
            }
        }
    }
    vgpu_signal(vgpu_ref, vgpu_ref_value, vgpu_ref_count);
}

extern "C" __global__ void vgpu_saxpy(const float* x, float* y, u64 n, float a VGPU_SIGNAL) {
    VGPU_PRIOR;
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        y[i] = __fadd_rn(y[i], __fmul_rn(a, x[i]));
    }
    vgpu_signal(vgpu_ref, vgpu_ref_value, vgpu_ref_count);
}

// C = alpha*A*B + beta*C, row-major; each dot product summed in f32 over p = 0..k in order.
// 64x64 tiles of C per block of 256 threads, 4x4 elements per thread, K in steps of 16.
#define TM 64
#define TN 64
#define TK 16
extern "C" __global__ void __launch_bounds__(256) vgpu_sgemm(const float* A, const float* B,
                                                             float* C, u32 m, u32 n, u32 k,
                                                             float alpha,
                                                             float beta VGPU_SIGNAL) {
    VGPU_PRIOR;
    __shared__ float As[TK][TM + 1];
    __shared__ float Bs[TK][TN];
    u32 tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    // 32-bit indices: the protocol caps m, n and k at 2^16 (MAX_DIM), so every index of
    // an element inside a matrix is below 2^32, and out-of-range ones are never formed
    // into an address. 64-bit address arithmetic made the loop ~11 % slower with both
    // NVRTC and nvcc (1024^3 on the H100, 2026-11-28).
    u32 row0 = blockIdx.y * TM, col0 = blockIdx.x * TN;
    float acc[4][4];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = 0.0f;
    for (u32 p0 = 0; p0 < k; p0 += TK) {
        // Load A tile (TM x TK) and B tile (TK x TN): 1024 elements each, 4 per thread.
        for (int l = 0; l < 4; l++) {
            u32 e = threadIdx.x + 256 * l;
            u32 ar = e / TK, ac = e % TK;
            u32 gr = row0 + ar, gc = p0 + ac;
            As[ac][ar] = (gr < m && gc < k) ? A[gr * k + gc] : 0.0f;
            u32 br = e / TN, bc = e % TN;
            u32 hr = p0 + br, hc = col0 + bc;
            Bs[br][bc] = (hr < k && hc < n) ? B[hr * n + hc] : 0.0f;
        }
        __syncthreads();
        // Full tiles with a fixed trip count, unrolled: NVRTC left the variable-count loop
        // rolled (40 registers, 8.1 ms a 4096^3 kernel on the H100) where nvcc's build ran
        // 7.8 ms; unrolled, both compilers give 64 registers and ~7.5 ms (issue 13, device
        // run 9). Each acc[i][j] still sums over p = 0..k-1 in order, as the reference.
        if (k - p0 >= TK) {
#pragma unroll
            for (u32 p = 0; p < TK; p++) {
                float av[4], bv[4];
                for (int i = 0; i < 4; i++) av[i] = As[p][ty + 16 * i];
                for (int j = 0; j < 4; j++) bv[j] = Bs[p][tx + 16 * j];
                for (int i = 0; i < 4; i++)
                    for (int j = 0; j < 4; j++) acc[i][j] = __fadd_rn(acc[i][j], __fmul_rn(av[i], bv[j]));
            }
        } else {
            for (u32 p = 0; p < k - p0; p++) {
                float av[4], bv[4];
                for (int i = 0; i < 4; i++) av[i] = As[p][ty + 16 * i];
                for (int j = 0; j < 4; j++) bv[j] = Bs[p][tx + 16 * j];
                for (int i = 0; i < 4; i++)
                    for (int j = 0; j < 4; j++) acc[i][j] = __fadd_rn(acc[i][j], __fmul_rn(av[i], bv[j]));
            }
        }
        __syncthreads();
    }
    for (int i = 0; i < 4; i++) {
        u32 r = row0 + ty + 16 * i;
        if (r >= m) continue;
        for (int j = 0; j < 4; j++) {
            u32 c = col0 + tx + 16 * j;
            if (c >= n) continue;
            float* cp = &C[r * n + c];
            *cp = __fadd_rn(__fmul_rn(alpha, acc[i][j]), __fmul_rn(beta, *cp));
        }
    }
    vgpu_signal(vgpu_ref, vgpu_ref_value, vgpu_ref_count);
}

// In-order f64 sum, as the sim: one thread does the adds; the other threads of the block
// stage the data through shared memory so the single adder never waits on DRAM.
#define RB 1024
extern "C" __global__ void vgpu_reduce_sum(const float* src, u64 n, float* dst VGPU_SIGNAL) {
    VGPU_PRIOR;
    __shared__ float buf[2][RB];
    double sum = 0.0;
    u64 tiles = (n + RB - 1) / RB;
    if (tiles > 0) {
        u64 i = threadIdx.x;
        if (i < n) buf[0][threadIdx.x] = src[i];
    }
    __syncthreads();
    for (u64 t = 0; t < tiles; t++) {
        u64 next = (t + 1) * RB + threadIdx.x;
        if (t + 1 < tiles && next < n) buf[(t + 1) & 1][threadIdx.x] = src[next];
        if (threadIdx.x == 0) {
            u64 cnt = n - t * RB < RB ? n - t * RB : RB;
            const float* b = buf[t & 1];
            for (u64 j = 0; j < cnt; j++) sum = __dadd_rn(sum, (double)b[j]);
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) *dst = __double2float_rn(sum);
    vgpu_signal(vgpu_ref, vgpu_ref_value, vgpu_ref_count);
}

// FNV-1a 64, in byte order: one thread hashes (it is sequential by definition) while the
// block stages the next tile through shared memory, so the hasher never waits on memory
// (which may be host memory across the PCIe/C2C link).
#define CB 8192
extern "C" __global__ void vgpu_checksum(const unsigned char* src, u64 len, u64* dst VGPU_SIGNAL) {
    VGPU_PRIOR;
    __shared__ unsigned char buf[2][CB];
    u64 h = 0xcbf29ce484222325ULL;
    u64 tiles = (len + CB - 1) / CB;
    for (u64 j = threadIdx.x; j < CB && j < len; j += blockDim.x) buf[0][j] = src[j];
    __syncthreads();
    for (u64 t = 0; t < tiles; t++) {
        u64 base = (t + 1) * CB;
        if (t + 1 < tiles) {
            for (u64 j = threadIdx.x; j < CB && base + j < len; j += blockDim.x)
                buf[(t + 1) & 1][j] = src[base + j];
        }
        if (threadIdx.x == 0) {
            u64 cnt = len - t * CB < CB ? len - t * CB : CB;
            const unsigned char* b = buf[t & 1];
            for (u64 j = 0; j < cnt; j++) {
                h ^= b[j];
                h *= 0x100000001b3ULL;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) *dst = h;
    vgpu_signal(vgpu_ref, vgpu_ref_value, vgpu_ref_count);
}

// dst = cc*c + cn*(((n + s) + e) + w), edges clamped. src and dst never overlap here (the
// front end stages an overlapping source first).
extern "C" __global__ void vgpu_stencil2d(const float* src, float* dst, u32 width, u32 height,
                                          float cc, float cn VGPU_SIGNAL) {
    // No VGPU_PRIOR: the front end writes what is owed before this kernel (device.rs,
    // `prior_in_kernel`).
    u32 x = blockIdx.x * blockDim.x + threadIdx.x;
    u32 y = blockIdx.y * blockDim.y + threadIdx.y;
    // No early return: every thread reaches the signal's barrier.
    if (x < width && y < height) {
        u64 w = width;
        u32 yn = y == 0 ? 0 : y - 1, ys = y + 1 < height ? y + 1 : height - 1;
        u32 xw = x == 0 ? 0 : x - 1, xe = x + 1 < width ? x + 1 : width - 1;
        float c = src[y * w + x];
        float sum = __fadd_rn(
            __fadd_rn(__fadd_rn(src[yn * w + x], src[ys * w + x]), src[y * w + xe]),
            src[y * w + xw]);
        dst[y * w + x] = __fadd_rn(__fmul_rn(cc, c), __fmul_rn(cn, sum));
    }
    vgpu_signal(vgpu_ref, vgpu_ref_value, vgpu_ref_count);
}
