// cuda-native: the baseline for `vgpu-bench cuda`. The same builtin kernels
// (host-shim/src/cuda/kernels.cu), the same launch geometry and the same workload sizes
// as the cuda suite, launched directly on one CUDA stream of this process, with the data
// in device memory ("device") and in mapped pinned host memory ("pinned", where vgpu's
// cuda GPU keeps guest VRAM). Prints `name value unit` lines.
//
// Build (on the device machine): nvcc -O2 -fmad=false -o cuda-native native.cu -lcuda
// (host-located VMM allocations need the driver API; the rest uses the runtime API).
// -fmad=false as vgpu's NVRTC build of kernels.cu (bit-exact results), so both sides run
// the same machine code; nvcc's default fuses multiplies and adds (at the standard sizes
// the H100 timed both builds alike: 2026-11-27, docs/bench-logs/cuda-ref-fmad-pause-*).
// The fairness baseline forks two processes before CUDA is initialised.

// -DVGPU_KERNELS_CU='"path"' when the file is not in its place in the tree.
#ifndef VGPU_KERNELS_CU
#define VGPU_KERNELS_CU "../../host-shim/src/cuda/kernels.cu"
#endif
#include VGPU_KERNELS_CU

#include <cuda.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>
#include <vector>

#define CK(x)                                                                    \
    do {                                                                         \
        cudaError_t e_ = (x);                                                    \
        if (e_ != cudaSuccess) {                                                 \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x,            \
                    cudaGetErrorString(e_));                                     \
            exit(1);                                                             \
        }                                                                        \
    } while (0)

static u64 now_ns() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (u64)ts.tv_sec * 1000000000ull + ts.tv_nsec;
}

static int spin_blocks() {
    int sms = 0, thr = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    CK(cudaDeviceGetAttribute(&thr, cudaDevAttrMaxThreadsPerMultiProcessor, 0));
    return sms * std::max(1, thr / 1024);
}

static unsigned blocks(u64 n) { return (unsigned)std::min<u64>(std::max<u64>((n + 255) / 256, 1), 8192); }

// Inputs: every buffer holds the workloads' xorshift data in [-1, 1), as vgpu's workloads
// upload (the GPU runs sgemm 1024^3 on zeros ~8 % faster than on these: H100, 2026-11-27,
// 0.299 against 0.324 ms); `--fill zero` gives the old zeroed buffers.
// Experiment flags (device run 7, issue 13): `--one-block` carves every device buffer out
// of one cudaMalloc block at 2 MiB aligned offsets, as vgpu's VRAM is one block;
// `--vmm` is `--one-block` with the block made as vgpu's VRAM is: a physical 2 MiB
// allocation per granule (cuMemCreate), mapped back to back in one reserved range;
// `--idle-ms N` idles N ms before each timed loop (vgpu's workloads run their CPU
// reference between timed loops, so the GPU idles).
static cudaStream_t S;
static bool g_random = true, g_one_block = false, g_vmm = false;
static unsigned g_idle_ms = 0;
static char* g_block = nullptr;
static size_t g_block_len = 0, g_block_top = 0;
static int g_block_live = 0;
static u64 g_rng = 2;

static void fill_random(void* p, size_t n) {
    std::vector<float> h(n / 4);
    for (auto& v : h) {
        u64 x = g_rng;
        x ^= x >> 12; x ^= x << 25; x ^= x >> 27;
        g_rng = x;
        v = (float)((x * 0x2545f4914f6cdd1dull) >> 40) / (float)(1u << 24) * 2.0f - 1.0f;
    }
    CK(cudaMemcpy(p, h.data(), h.size() * 4, cudaMemcpyDefault));
    if (n % 4) CK(cudaMemset((char*)p + h.size() * 4, 0, n % 4));
}

static void settle() {
    if (g_idle_ms) usleep(g_idle_ms * 1000u);
}

// `--mark-each` (an experiment, issue 34): after each kernel of the saxpy, sgemm and
// hotspot loops, what vgpu's front end puts in the stream per GP entry: the fence's REF
// write (cuStreamWriteValue32 into mapped host memory) and an untimed event;
// `--mark-each ref` or `--mark-each event` puts only the one; `--mark-each timed` only an
// event with timing (what vgpu's completion marks are: the scheduler's timeline reads
// their times), `--mark-each ref+timed` both.
static bool g_mark_each = false, g_mark_ref = true, g_mark_event = true, g_mark_timed = false;
static cudaEvent_t g_marks[64];
static CUdeviceptr g_ref_dev = 0;
static void mark(int i) {
    if (!g_mark_each) return;
    if (!g_ref_dev) {
        u32* ref;
        CK(cudaHostAlloc(&ref, 4, cudaHostAllocMapped));
        CK(cudaHostGetDevicePointer((void**)&g_ref_dev, ref, 0));
        for (auto& e : g_marks)
            CK(cudaEventCreateWithFlags(&e, g_mark_timed ? cudaEventDefault : cudaEventDisableTiming));
    }
    if (g_mark_ref && cuStreamWriteValue32(S, g_ref_dev, (cuuint32_t)i, 0) != CUDA_SUCCESS) {
        fprintf(stderr, "cuStreamWriteValue32 failed\n");
        exit(1);
    }
    if (g_mark_event) CK(cudaEventRecord(g_marks[i % 64], S));
}

// `--prior-ref` (an experiment, issue 34): each saxpy and sgemm kernel after its loop's
// first stores the kernel before it's REF as it starts (one thread, a release store at
// system scope into mapped host memory), as vgpu's kernels do for the REF write of a
// predecessor too large to signal itself (kernels.cu, "The prior write").
static bool g_prior_ref = false;
static u32* g_prior_dev = nullptr;
static u32* prior(int i) {
    if (!g_prior_ref || i == 0) return nullptr;
    if (!g_prior_dev) {
        u32* ref;
        CK(cudaHostAlloc(&ref, 4, cudaHostAllocMapped));
        CK(cudaHostGetDevicePointer((void**)&g_prior_dev, ref, 0));
    }
    return g_prior_dev;
}

struct Mem {
    bool pinned;
    void* alloc(size_t n) {
        void* p;
        if (pinned) {
            CK(cudaHostAlloc(&p, n, cudaHostAllocMapped | cudaHostAllocPortable));
        } else if (g_one_block) {
            size_t len = (n + (2u << 20) - 1) & ~(size_t)((2u << 20) - 1);
            if (g_block_top + len > g_block_len) {
                fprintf(stderr, "one block: %zu bytes do not fit\n", n);
                exit(1);
            }
            p = g_block + g_block_top;
            g_block_top += len;
            g_block_live++;
        } else {
            CK(cudaMalloc(&p, n));
        }
        if (g_random) fill_random(p, n);
        else CK(cudaMemset(p, 0, n));
        return p;
    }
    void free(void* p) {
        if (pinned) cudaFreeHost(p);
        else if (g_one_block) { if (--g_block_live == 0) g_block_top = 0; }
        else cudaFree(p);
    }
};

static double ms_since(u64 t0) { return (now_ns() - t0) / 1e6; }

// Each workload: set up (untimed), then time the launches + synchronize, best of reps.
static double best(int reps, double (*f)(Mem&, bool), Mem& m, bool quick) {
    f(m, quick);
    double b = 1e300;
    for (int i = 0; i < reps; i++) b = std::min(b, f(m, quick));
    return b;
}

// --large: the issue's realistic sizes (saxpy 2^28, sgemm 4096^3, stencil 8192^2).
static bool g_large = false;

static double w_throttle(Mem&, bool quick) {
    int n = quick ? 32 : 200;
    u64 ns = quick ? 20000 : 1000000;
    int sb = spin_blocks();
    u64 t0 = now_ns();
    for (int i = 0; i < n; i++) vgpu_spin<<<sb, 1024, 0, S>>>(ns);
    CK(cudaStreamSynchronize(S));
    return ms_since(t0);
}

static double w_saxpy(Mem& m, bool quick) {
    u64 n = quick ? 4099 : g_large ? (1ull << 28) : (1ull << 24);
    int it = quick ? 8 : 50;
    float *x = (float*)m.alloc(n * 4), *y = (float*)m.alloc(n * 4);
    settle();
    u64 t0 = now_ns();
    for (int i = 0; i < it; i++) {
        vgpu_saxpy<<<blocks(n), 256, 0, S>>>(x, y, n, 0.5f, nullptr, 0u, nullptr, prior(i),
                                             (u32)(i - 1));
        mark(i);
    }
    CK(cudaStreamSynchronize(S));
    double r = ms_since(t0);
    m.free(x); m.free(y);
    return r;
}

static double w_sgemm(Mem& m, bool quick) {
    unsigned big = g_large ? 4096 : 1024;
    unsigned M = quick ? 33 : big, N = quick ? 17 : big, K = quick ? 29 : big;
    int it = quick ? 3 : 2;
    float *a = (float*)m.alloc((size_t)M * K * 4), *b = (float*)m.alloc((size_t)K * N * 4),
          *c = (float*)m.alloc((size_t)M * N * 4);
    dim3 grid((N + 63) / 64, (M + 63) / 64);
    settle();
    u64 t0 = now_ns();
    for (int i = 0; i < it; i++) {
        vgpu_sgemm<<<grid, 256, 0, S>>>(a, b, c, M, N, K, 1.0f, 0.5f, nullptr, 0u, nullptr,
                                        prior(i), (u32)(i - 1));
        mark(i);
    }
    CK(cudaStreamSynchronize(S));
    double r = ms_since(t0);
    m.free(a); m.free(b); m.free(c);
    return r;
}

static double w_hotspot(Mem& m, bool quick) {
    unsigned side = g_large ? 8192 : 4096;
    unsigned W = quick ? 37 : side, H = quick ? 23 : side;
    int it = quick ? 9 : 20;
    float* buf[2] = {(float*)m.alloc((size_t)W * H * 4), (float*)m.alloc((size_t)W * H * 4)};
    dim3 grid((W + 31) / 32, (H + 7) / 8), blk(32, 8);
    settle();
    u64 t0 = now_ns();
    for (int i = 0; i < it; i++) {
        vgpu_stencil2d<<<grid, blk, 0, S>>>(buf[i % 2], buf[(i + 1) % 2], W, H, 0.6f, 0.1f);
        mark(i);
    }
    CK(cudaStreamSynchronize(S));
    double r = ms_since(t0);
    m.free(buf[0]); m.free(buf[1]);
    return r;
}

static double w_reduction(Mem& m, bool quick) {
    u64 n = quick ? 10000 : (1ull << 23);
    int it = quick ? 6 : 4;
    float* src = (float*)m.alloc(n * 4);
    char* res = (char*)m.alloc(16 * it);
    settle();
    u64 t0 = now_ns();
    for (int i = 0; i < it; i++) {
        u64 skip = i % 4;
        vgpu_reduce_sum<<<1, 1024, 0, S>>>(src + skip, n - skip, (float*)(res + 16 * i));
        vgpu_checksum<<<1, 1024, 0, S>>>((const unsigned char*)(src + skip), (n - skip) * 4,
                                      (u64*)(res + 16 * i + 8));
    }
    CK(cudaStreamSynchronize(S));
    double r = ms_since(t0);
    m.free(src); m.free(res);
    return r;
}

// Host (guest RAM on the vgpu side) → VRAM → VRAM → host copies, then a checksum.
static double w_copy_heavy(Mem& m, bool quick) {
    size_t len = quick ? (200 << 10) + 12 : (64u << 20);
    size_t chunk = quick ? (64 << 10) : (4 << 20);
    int it = quick ? 4 : 4;
    Mem host{true};
    char *src = (char*)host.alloc(len), *dst = (char*)host.alloc(len), *res = (char*)host.alloc(8 * it);
    char *va = (char*)m.alloc(len), *vb = (char*)m.alloc(len);
    settle();
    u64 t0 = now_ns();
    for (int i = 0; i < it; i++) {
        for (size_t o = 0; o < len; o += chunk)
            CK(cudaMemcpyAsync(va + o, src + o, std::min(chunk, len - o), cudaMemcpyDefault, S));
        for (size_t o = 0; o < len; o += chunk)
            CK(cudaMemcpyAsync(vb + o, va + o, std::min(chunk, len - o), cudaMemcpyDefault, S));
        for (size_t o = 0; o < len; o += chunk)
            CK(cudaMemcpyAsync(dst + o, vb + o, std::min(chunk, len - o), cudaMemcpyDefault, S));
        vgpu_checksum<<<1, 1024, 0, S>>>((const unsigned char*)vb, len, (u64*)(res + 8 * i));
    }
    CK(cudaStreamSynchronize(S));
    double r = ms_since(t0);
    host.free(src); host.free(dst); host.free(res);
    m.free(va); m.free(vb);
    return r;
}

static u64 g_offset;

static void calibrate() {
    u64* d;
    CK(cudaMalloc(&d, 8));
    u64 best = ~0ull;
    for (int i = 0; i < 20; i++) {
        u64 t0 = now_ns();
        vgpu_timestamp<<<1, 1, 0, S>>>(d, 0);
        CK(cudaStreamSynchronize(S));
        u64 t1 = now_ns();
        u64 g;
        CK(cudaMemcpy(&g, d, 8, cudaMemcpyDeviceToHost));
        if (t1 - t0 < best) { best = t1 - t0; g_offset = g - (t0 + (t1 - t0) / 2); }
    }
    cudaFree(d);
}

static void latency(int samples) {
    u64* ts;
    CK(cudaHostAlloc(&ts, 8, cudaHostAllocMapped));
    std::vector<double> v, call;
    for (int i = 0; i < samples + 100; i++) {
        u64 t = now_ns();
        vgpu_timestamp<<<1, 1, 0, S>>>(ts, g_offset);
        u64 t_call = now_ns();
        CK(cudaStreamSynchronize(S));
        if (i >= 100) {
            v.push_back(((double)(*(volatile u64*)ts) - (double)t) / 1e3);
            call.push_back((double)(t_call - t) / 1e3);
        }
    }
    std::sort(v.begin(), v.end());
    std::sort(call.begin(), call.end());
    printf("launch_to_kernel_start_p50_us %.3f us\n", v[v.size() / 2]);
    printf("launch_to_kernel_start_p99_us %.3f us\n", v[v.size() * 99 / 100]);
    // The launch call alone (what the front end's launch of the same kernel compares to).
    printf("launch_call_p50_us %.3f us\n", call[call.size() / 2]);
    // Launch + synchronize round trip.
    std::vector<double> rt;
    for (int i = 0; i < samples; i++) {
        u64 t = now_ns();
        vgpu_empty<<<1, 1, 0, S>>>();
        CK(cudaStreamSynchronize(S));
        rt.push_back((now_ns() - t) / 1e3);
    }
    std::sort(rt.begin(), rt.end());
    printf("launch_sync_roundtrip_p50_us %.3f us\n", rt[rt.size() / 2]);
    cudaFreeHost(ts);
}

static void b2b(int n) {
    vgpu_empty<<<1, 1, 0, S>>>();
    CK(cudaStreamSynchronize(S));
    u64 t0 = now_ns();
    for (int i = 0; i < n; i++) vgpu_empty<<<1, 1, 0, S>>>();
    CK(cudaStreamSynchronize(S));
    printf("b2b_empty_kernels_per_s %.1f kernels/s\n", n / ((now_ns() - t0) / 1e9));
    // What vgpu's front end issues per GP entry: the launch, then the fence's REF write
    // (cuStreamWriteValue32 into mapped host memory).
    u32* ref;
    CK(cudaHostAlloc(&ref, 4, cudaHostAllocMapped));
    CUdeviceptr ref_dev;
    CK(cudaHostGetDevicePointer((void**)&ref_dev, ref, 0));
    t0 = now_ns();
    for (int i = 0; i < n; i++) {
        vgpu_empty<<<1, 1, 0, S>>>();
        if (cuStreamWriteValue32(S, ref_dev, (cuuint32_t)i, 0) != CUDA_SUCCESS) {
            fprintf(stderr, "cuStreamWriteValue32 failed\n");
            exit(1);
        }
    }
    CK(cudaStreamSynchronize(S));
    printf("b2b_with_ref_write_kernels_per_s %.1f kernels/s\n", n / ((now_ns() - t0) / 1e9));
    // What vgpu's front end issues per GP entry of one-block kernels: the kernel writes
    // its entry's REF itself (kernels.cu's fence signal), and a completion mark (an
    // untimed event) after every 32 entries.
    u32* count;
    CK(cudaMalloc(&count, 4));
    CK(cudaMemset(count, 0, 4));
    cudaEvent_t marks[64];
    for (auto& e : marks) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    CK(cudaStreamSynchronize(S));
    t0 = now_ns();
    for (int i = 0; i < n; i++) {
        vgpu_empty<<<1, 1, 0, S>>>((u32*)ref_dev, (u32)i, count);
        if (i % 32 == 31) CK(cudaEventRecord(marks[(i / 32) % 64], S));
    }
    CK(cudaStreamSynchronize(S));
    printf("b2b_with_signal_kernels_per_s %.1f kernels/s\n", n / ((now_ns() - t0) / 1e9));
    t0 = now_ns();
    for (int i = 0; i < n; i++) {
        vgpu_empty<<<1, 1, 0, S>>>();
        if (i % 32 == 31) CK(cudaEventRecord(marks[(i / 32) % 64], S));
    }
    CK(cudaStreamSynchronize(S));
    printf("b2b_with_marks_kernels_per_s %.1f kernels/s\n", n / ((now_ns() - t0) / 1e9));
    for (auto& e : marks) cudaEventDestroy(e);
    cudaFree(count);
    CK(cudaFreeHost(ref));
}

// Fixed work filling every SM: a spin on the clock would count time its context spends
// switched out as work done, so the time-slicing baseline needs kernels of fixed work.
__global__ void fixed_work(u64 iters, float* sink) {
    float x = threadIdx.x;
    for (u64 i = 0; i < iters; i++) x = x * 0.9999f + 0.5f;
    if (x == 12345.0f) *sink = x;
}

static double work_ms(cudaStream_t s, u64 iters, float* sink) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    CK(cudaEventRecord(a, s));
    fixed_work<<<spin_blocks(), 1024, 0, s>>>(iters, sink);
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    return ms;
}

// Iterations for a kernel of `target_ms` when it has the GPU to itself.
static u64 calibrate_work(double target_ms) {
    cudaStream_t s;
    CK(cudaStreamCreate(&s));
    float* sink;
    CK(cudaMalloc(&sink, 4));
    work_ms(s, 1000, sink);
    u64 it = 100000;
    for (int round = 0; round < 4; round++) {
        double ms = work_ms(s, it, sink);
        it = (u64)(it * target_ms / ms);
    }
    return it;
}

// One tenant process: back-to-back fixed-work kernels, two in flight, for `secs`.
static void tenant(u64 iters, double secs, u64* out) {
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    float* sink;
    CK(cudaMalloc(&sink, 4));
    int sb = spin_blocks();
    cudaEvent_t ev[2];
    CK(cudaEventCreateWithFlags(&ev[0], cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&ev[1], cudaEventDisableTiming));
    fixed_work<<<sb, 1024, 0, s>>>(iters, sink);
    CK(cudaStreamSynchronize(s));
    u64 end = now_ns() + (u64)(secs * 1e9);
    u64 done = 0;
    for (int i = 0; i < 2; i++) { fixed_work<<<sb, 1024, 0, s>>>(iters, sink); CK(cudaEventRecord(ev[i], s)); }
    int k = 0;
    while (now_ns() < end) {
        CK(cudaEventSynchronize(ev[k]));
        done++;
        fixed_work<<<sb, 1024, 0, s>>>(iters, sink);
        CK(cudaEventRecord(ev[k], s));
        k ^= 1;
    }
    *out = done;
}

static void fairness(double secs) {
    u64* shared = (u64*)mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    double lens_ms[2] = {10.0, 1.0};
    // Calibrate in a child of its own: this process must not initialise CUDA before fork.
    pid_t c = fork();
    if (c == 0) {
        shared[2] = calibrate_work(lens_ms[0]);
        shared[3] = calibrate_work(lens_ms[1]);
        _exit(0);
    }
    waitpid(c, nullptr, 0);
    pid_t kids[2];
    for (int i = 0; i < 2; i++) {
        kids[i] = fork();
        if (kids[i] == 0) {
            tenant(shared[2 + i], secs, &shared[i]);
            _exit(0);
        }
    }
    for (int i = 0; i < 2; i++) waitpid(kids[i], nullptr, 0);
    printf("fairness_two_procs_10ms_share %.2f %%\n", shared[0] * lens_ms[0] / (secs * 1e3) * 100);
    printf("fairness_two_procs_1ms_share %.2f %%\n", shared[1] * lens_ms[1] / (secs * 1e3) * 100);
}

#define CU(x)                                                                    \
    do {                                                                         \
        CUresult r_ = (x);                                                       \
        if (r_ != CUDA_SUCCESS) {                                                \
            const char* s_ = "?";                                                \
            cuGetErrorName(r_, &s_);                                             \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s_);         \
            exit(1);                                                             \
        }                                                                        \
    } while (0)

// VMM API: pinned memory on device 0, and read-write access to it from device 0.
static CUmemAllocationProp device_memory_prop() {
    CUmemAllocationProp p = {};
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = 0;
    return p;
}
static CUmemAccessDesc device_rw_access() {
    CUmemAccessDesc a = {};
    a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a.location.id = 0;
    a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    return a;
}

// What vgpu's eviction would cost with VRAM in device memory (VMM API): 64 MiB in 2 MiB
// chunks at a fixed VA, each copied by the copy engine into a host-located allocation
// (CU_MEM_LOCATION_TYPE_HOST) and remapped at the same VA; against a plain device→host copy
// of the same size; a kernel reads the range bit-exactly before and after; and the read
// bandwidth of a kernel over resident vs evicted memory.
static void vram_swap() {
    const size_t CH = 2 << 20, LEN = 64 << 20, NCH = LEN / CH;
    CUdevice dev;
    CU(cuDeviceGet(&dev, 0));
    CUmemAllocationProp dp = device_memory_prop();
    CUmemAllocationProp hp = dp;
    hp.location.type = CU_MEM_LOCATION_TYPE_HOST;
    hp.location.id = 0;
    CUmemAccessDesc acc = device_rw_access();
    CUdeviceptr va, tmp;
    CU(cuMemAddressReserve(&va, LEN, CH, 0, 0));
    CU(cuMemAddressReserve(&tmp, CH, CH, 0, 0));
    std::vector<CUmemGenericAllocationHandle> dh(NCH), hh(NCH);
    for (size_t i = 0; i < NCH; i++) {
        CU(cuMemCreate(&dh[i], CH, &dp, 0));
        CU(cuMemMap(va + i * CH, CH, 0, dh[i], 0));
        CU(cuMemCreate(&hh[i], CH, &hp, 0));
    }
    CU(cuMemSetAccess(va, LEN, &acc, 1));
    vgpu_memset<<<blocks(LEN / 4), 256, 0, S>>>((unsigned char*)va, LEN, 0x9e3779b9u);
    u64* sums;
    CK(cudaHostAlloc(&sums, 16, cudaHostAllocMapped));
    vgpu_checksum<<<1, 1024, 0, S>>>((const unsigned char*)va, LEN, &sums[0]);
    CK(cudaStreamSynchronize(S));
    // Plain copy of the same size into pinned host memory.
    void* pinned;
    CK(cudaHostAlloc(&pinned, LEN, 0));
    double plain = 1e9;  // the best of 5
    for (int i = 0; i < 5; i++) {
        u64 t0 = now_ns();
        CK(cudaMemcpyAsync(pinned, (void*)va, LEN, cudaMemcpyDeviceToHost, S));
        CK(cudaStreamSynchronize(S));
        plain = std::min(plain, (now_ns() - t0) / 1e9);
    }
    double plain_in = 1e9;  // and back (the swap-in direction), the same bytes
    for (int i = 0; i < 5; i++) {
        u64 t0 = now_ns();
        CK(cudaMemcpyAsync((void*)va, pinned, LEN, cudaMemcpyHostToDevice, S));
        CK(cudaStreamSynchronize(S));
        plain_in = std::min(plain_in, (now_ns() - t0) / 1e9);
    }
    // Eviction: copy each chunk through a temporary mapping of its host allocation, then
    // remap the host allocation at the chunk's own VA.
    std::vector<double> pause;
    u64 e0 = now_ns();
    for (size_t i = 0; i < NCH; i++) {
        u64 c0 = now_ns();
        CU(cuMemMap(tmp, CH, 0, hh[i], 0));
        CU(cuMemSetAccess(tmp, CH, &acc, 1));
        CU(cuMemcpyDtoDAsync(tmp, va + i * CH, CH, S));
        CK(cudaStreamSynchronize(S));
        CU(cuMemUnmap(tmp, CH));
        CU(cuMemUnmap(va + i * CH, CH));
        CU(cuMemMap(va + i * CH, CH, 0, hh[i], 0));
        CU(cuMemSetAccess(va + i * CH, CH, &acc, 1));
        pause.push_back((now_ns() - c0) / 1e3);
    }
    double evict = (now_ns() - e0) / 1e9;
    vgpu_checksum<<<1, 1024, 0, S>>>((const unsigned char*)va, LEN, &sums[1]);
    CK(cudaStreamSynchronize(S));
    // Kernel read bandwidth: saxpy over 64 MiB evicted (host-located) vs a resident copy.
    float* res;
    CK(cudaMalloc(&res, LEN));
    CK(cudaMemset(res, 0, LEN));
    u64 n = LEN / 4;
    u64 r0 = now_ns();
    for (int i = 0; i < 10; i++) vgpu_saxpy<<<blocks(n), 256, 0, S>>>((float*)va, res, n, 1.0f);
    CK(cudaStreamSynchronize(S));
    double host_rd = (now_ns() - r0) / 1e9;
    float* res2;
    CK(cudaMalloc(&res2, LEN));
    r0 = now_ns();
    for (int i = 0; i < 10; i++) vgpu_saxpy<<<blocks(n), 256, 0, S>>>(res, res2, n, 1.0f);
    CK(cudaStreamSynchronize(S));
    double dev_rd = (now_ns() - r0) / 1e9;
    std::sort(pause.begin(), pause.end());
    printf("swap_plain_dtoh_64mib_gb_per_s %.2f GB/s\n", LEN / plain / 1e9);
    printf("swap_plain_htod_64mib_gb_per_s %.2f GB/s\n", LEN / plain_in / 1e9);
    printf("swap_evict_64mib_gb_per_s %.2f GB/s\n", LEN / evict / 1e9);
    printf("swap_evict_64mib_ms %.3f ms\n", evict * 1e3);
    printf("swap_evict_chunk_pause_p50_us %.1f us\n", pause[pause.size() / 2]);
    printf("swap_evicted_equals_resident %d bool\n", sums[0] == sums[1] ? 1 : 0);
    printf("swap_saxpy_64mib_evicted_ms %.3f ms\n", host_rd * 100);
    printf("swap_saxpy_64mib_resident_ms %.3f ms\n", dev_rd * 100);
}

// Where saxpy's loop goes on the GPU (`--only loop-overhead`, issue 34): the standard
// saxpy loop (2^24 x 50) between two TIMESTAMP kernels, 15 times: the GPU span from the
// first stamp to the last (what the VM's `loop_vm_saxpy_*_gpu_span_us` compares to), and
// the loop with a stamp before every saxpy: how long each step takes on the GPU.
static double median_of(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}
static void loop_overhead(bool quick) {
    u64 n = quick ? 4099 : (1ull << 24);
    int it = quick ? 8 : 50, loops = quick ? 3 : 15;
    Mem m{false};
    float *x = (float*)m.alloc(n * 4), *y = (float*)m.alloc(n * 4);
    u64* ts;
    CK(cudaHostAlloc(&ts, 8 * (it + 2), cudaHostAllocMapped));
    volatile u64* vts = ts;
    std::vector<double> wall, span, step;
    for (int l = 0; l <= loops; l++) {
        u64 t0 = now_ns();
        vgpu_timestamp<<<1, 1, 0, S>>>(ts, 0);
        for (int i = 0; i < it; i++)
            vgpu_saxpy<<<blocks(n), 256, 0, S>>>(x, y, n, 0.5f, nullptr, 0u, nullptr, prior(i),
                                                 (u32)(i - 1));
        vgpu_timestamp<<<1, 1, 0, S>>>(ts + 1, 0, nullptr, 0u, nullptr, prior(it), (u32)it);
        CK(cudaStreamSynchronize(S));
        if (l == 0) continue;  // warm-up
        wall.push_back((now_ns() - t0) / 1e3);
        span.push_back((vts[1] - vts[0]) / 1e3);
    }
    for (int l = 0; l <= loops; l++) {
        for (int i = 0; i < it; i++) {
            // With --prior-ref each stamp stores the REF its preceding saxpy owes, as
            // the first kernel of vgpu's next GP entry does.
            vgpu_timestamp<<<1, 1, 0, S>>>(ts + i, 0, nullptr, 0u, nullptr, prior(i), (u32)i);
            vgpu_saxpy<<<blocks(n), 256, 0, S>>>(x, y, n, 0.5f);
        }
        vgpu_timestamp<<<1, 1, 0, S>>>(ts + it, 0, nullptr, 0u, nullptr, prior(it), (u32)it);
        CK(cudaStreamSynchronize(S));
        if (l == 0) continue;
        for (int i = 0; i < it; i++) step.push_back((vts[i + 1] - vts[i]) / 1e3);
    }
    std::sort(step.begin(), step.end());
    printf("loop_saxpy_wall_us %.2f us\n", median_of(wall));
    printf("loop_saxpy_gpu_span_us %.2f us\n", median_of(span));
    printf("loop_saxpy_step_p10_us %.3f us\n", step[step.size() / 10]);
    printf("loop_saxpy_step_p50_us %.3f us\n", step[step.size() / 2]);
    printf("loop_saxpy_step_p90_us %.3f us\n", step[step.size() * 9 / 10]);
    printf("loop_saxpy_step_max_us %.3f us\n", step.back());
    CK(cudaFreeHost(ts));
    m.free(x);
    m.free(y);
}

// `--only a,b`: run only the named sections (the names `vgpu-bench cuda --only` takes).
static const char* g_only = nullptr;
static const char* g_workloads = nullptr;
static bool listed(const char* list, const char* section) {
    if (!list) return true;
    size_t n = strlen(section);
    for (const char* p = list; *p;) {
        const char* e = strchr(p, ',');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        if (len == n && !strncmp(p, section, n)) return true;
        if (!e) break;
        p = e + 1;
    }
    return false;
}
static bool runs(const char* section) { return listed(g_only, section); }

int main(int argc, char** argv) {
    bool quick = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick")) quick = true;
        else if (!strcmp(argv[i], "--large")) g_large = true;
        else if (!strcmp(argv[i], "--only") && i + 1 < argc) g_only = argv[++i];
        else if (!strcmp(argv[i], "--workloads") && i + 1 < argc) g_workloads = argv[++i];
        else if (!strcmp(argv[i], "--fill") && i + 1 < argc) g_random = strcmp(argv[++i], "zero") != 0;
        else if (!strcmp(argv[i], "--one-block")) g_one_block = true;
        else if (!strcmp(argv[i], "--vmm")) g_one_block = g_vmm = true;
        else if (!strcmp(argv[i], "--mark-each")) {
            g_mark_each = true;
            if (i + 1 < argc && !strcmp(argv[i + 1], "ref")) g_mark_event = false, i++;
            else if (i + 1 < argc && !strcmp(argv[i + 1], "event")) g_mark_ref = false, i++;
            else if (i + 1 < argc && !strcmp(argv[i + 1], "timed"))
                g_mark_ref = false, g_mark_timed = true, i++;
            else if (i + 1 < argc && !strcmp(argv[i + 1], "ref+timed")) g_mark_timed = true, i++;
        }
        else if (!strcmp(argv[i], "--idle-ms") && i + 1 < argc) g_idle_ms = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--prior-ref")) g_prior_ref = true;
    }
    // Before this process touches CUDA: children initialise their own.
    if (runs("fairness")) fairness(quick ? 0.5 : 4.0);
    CK(cudaSetDevice(0));
    CK(cudaStreamCreateWithFlags(&S, cudaStreamNonBlocking));
    calibrate();
    if (g_vmm) {
        const size_t CH = 2 << 20;
        g_block_len = (size_t)1 << 30;
        CUmemAllocationProp dp = device_memory_prop();
        CUmemAccessDesc acc = device_rw_access();
        CUdeviceptr va;
        CU(cuMemAddressReserve(&va, g_block_len, CH, 0, 0));
        for (size_t off = 0; off < g_block_len; off += CH) {
            CUmemGenericAllocationHandle h;
            CU(cuMemCreate(&h, CH, &dp, 0));
            CU(cuMemMap(va + off, CH, 0, h, 0));
        }
        CU(cuMemSetAccess(va, g_block_len, &acc, 1));
        g_block = (char*)va;
    } else if (g_one_block) {
        g_block_len = (size_t)8 << 30;  // vgpu-bench cuda --vram-mib 8192
        CK(cudaMalloc((void**)&g_block, g_block_len));
    }
    int reps = quick ? 1 : 3;
    struct { const char* name; double (*f)(Mem&, bool); } ws[] = {
        {"throttle", w_throttle}, {"saxpy", w_saxpy}, {"sgemm", w_sgemm},
        {"hotspot", w_hotspot}, {"reduction", w_reduction}, {"copy_heavy", w_copy_heavy},
    };
    for (auto& w : ws) {
        if (!runs("workloads")) break;
        if (!listed(g_workloads, w.name)) continue;
        // At the large sizes only device memory (pinned host memory is the old layout).
        for (int pinned = 0; pinned < (g_large ? 1 : 2); pinned++) {
            Mem m{pinned == 1};
            printf("%s_%s_ms %.3f ms\n", w.name, pinned ? "pinned" : "device", best(reps, w.f, m, quick));
            fflush(stdout);
        }
    }
    calibrate();  // the GPU clock drifts from the host's by µs per second
    if (runs("latency")) latency(quick ? 200 : 2000);
    if (runs("b2b")) b2b(quick ? 500 : 20000);
    if (runs("swap")) vram_swap();
    if (runs("loop-overhead")) loop_overhead(quick);
    return 0;
}
