/* A CUDA runtime program as `nvcc -cudart shared` builds it, with nvcc's generated host
 * code written out by hand (machines without the toolkit cannot generate it): at start
 * the module's fatbin, its kernels (by their host stubs) and its __device__ variable are
 * registered; `kernel<<<g, b, 0, s>>>(args)` is __cudaPushCallConfiguration followed by
 * the kernel's stub, which pops the configuration and calls cudaLaunchKernel. The fatbin
 * holds the PTX of MODULE.ptx in one uncompressed PTX entry.
 * usage: runtime_program MODULE.ptx [N] */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "check.h"

/* --- what nvcc generates ---------------------------------------------------------- */
static struct { unsigned magic, version; const void *data; void *filename; } fatbin_wrapper;
static void **fatbin_handle;
static uint32_t vgpu_test_counter; /* the host shadow of the __device__ variable */

/* CUDA 12/13's stub: the kernel looked up once into a static, launched by handle. */
static void vadd_stub(const uint32_t *a, const uint32_t *b, uint32_t *c, unsigned n) {
    static void *handle;
    static int looked_up;
    if (!looked_up) {
        __cudaGetKernel(&handle, (const void *)vadd_stub);
        looked_up = 1;
    }
    void *args[] = {&a, &b, &c, &n};
    dim3 g, bl;
    size_t shm;
    cudaStream_t s;
    if (__cudaPopCallConfiguration(&g, &bl, &shm, &s) != cudaSuccess)
        return;
    __cudaLaunchKernel(handle, g, bl, args, shm, s);
}

/* The legacy stub (__NV_LEGACY_LAUNCH): cudaLaunchKernel by the stub's address. */

static void set_global_stub(unsigned v) {
    void *args[] = {&v};
    dim3 g, bl;
    size_t shm;
    cudaStream_t s;
    if (__cudaPopCallConfiguration(&g, &bl, &shm, &s) != cudaSuccess)
        return;
    cudaLaunchKernel((const void *)set_global_stub, g, bl, args, shm, s);
}

static void copy_stub(uint32_t *dst, const uint32_t *src, unsigned n) {
    void *args[] = {&dst, &src, &n};
    dim3 g, bl;
    size_t shm;
    cudaStream_t s;
    if (__cudaPopCallConfiguration(&g, &bl, &shm, &s) != cudaSuccess)
        return;
    cudaLaunchKernel((const void *)copy_stub, g, bl, args, shm, s);
}

static void unregistered_stub(void) {}

/* The fatbin: {magic, version, header size, body size}, then one PTX entry. */
static void *make_fatbin(const char *ptx_path) {
    FILE *f = fopen(ptx_path, "rb");
    if (!f) {
        perror(ptx_path);
        exit(2);
    }
    fseek(f, 0, SEEK_END);
    size_t n = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    size_t padded = (n + 1 + 7) / 8 * 8;
    uint8_t *fb = calloc(1, 16 + 64 + padded);
    uint32_t magic = 0xba55ed50u, hsize = 64;
    uint16_t version = 1, header = 16, kind = 1;
    uint64_t body = 64 + padded, payload = padded;
    memcpy(fb, &magic, 4);
    memcpy(fb + 4, &version, 2);
    memcpy(fb + 6, &header, 2);
    memcpy(fb + 8, &body, 8);
    memcpy(fb + 16, &kind, 2);
    memcpy(fb + 20, &hsize, 4);
    memcpy(fb + 24, &payload, 8);
    if (fread(fb + 16 + 64, 1, n, f) != n)
        exit(2);
    fclose(f);
    return fb;
}

static void register_module(const char *ptx_path) {
    fatbin_wrapper.magic = 0x466243b1u;
    fatbin_wrapper.version = 1;
    fatbin_wrapper.data = make_fatbin(ptx_path);
    fatbin_handle = __cudaRegisterFatBinary(&fatbin_wrapper);
    __cudaRegisterFunction(fatbin_handle, (const char *)vadd_stub, (char *)"vgpu_test_vadd_u32",
                           "vgpu_test_vadd_u32", -1, 0, 0, 0, 0, 0);
    __cudaRegisterFunction(fatbin_handle, (const char *)set_global_stub,
                           (char *)"vgpu_test_set_global", "vgpu_test_set_global", -1, 0, 0,
                           0, 0, 0);
    __cudaRegisterFunction(fatbin_handle, (const char *)copy_stub, (char *)"vgpu_test_copy_u32",
                           "vgpu_test_copy_u32", -1, 0, 0, 0, 0, 0);
    __cudaRegisterVar(fatbin_handle, (char *)&vgpu_test_counter, (char *)"vgpu_test_counter",
                      "vgpu_test_counter", 0, 4, 0, 0);
    __cudaRegisterFatBinaryEnd(fatbin_handle);
}

/* --- the program as its author wrote it --------------------------------------------- */
int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODULE.ptx [N]\n", argv[0]);
        return 2;
    }
    register_module(argv[1]);
    unsigned n = argc > 2 ? (unsigned)strtoul(argv[2], 0, 0) : 1u << 20;
    size_t bytes = (size_t)n * 4;
    int count, version;
    CHECK(cudaGetDeviceCount(&count));
    CHECK(cudaSetDevice(0));
    CHECK(cudaRuntimeGetVersion(&version));
    if (cudaSetDevice(1) != cudaErrorInvalidDevice || cudaGetLastError() != cudaErrorInvalidDevice)
        return 1;
    if (cudaGetLastError() != cudaSuccess)
        return 1;

    uint32_t *ha, *hb, *hc, *a, *b, *c, got = 0;
    CHECK(cudaMallocHost((void **)&ha, bytes));
    hb = malloc(bytes);
    hc = malloc(bytes);
    for (unsigned i = 0; i < n; i++) {
        ha[i] = i * 7u;
        hb[i] = 1000000u - i;
    }
    CHECK(cudaMalloc((void **)&a, bytes));
    CHECK(cudaMalloc((void **)&b, bytes));
    CHECK(cudaMalloc((void **)&c, bytes));
    CHECK(cudaMemset(c, 0xff, bytes));
    CHECK(cudaMemcpy(a, ha, bytes, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(b, hb, bytes, cudaMemcpyDefault));

    cudaStream_t s;
    cudaEvent_t start, stop;
    CHECK(cudaStreamCreate(&s));
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&stop));
    CHECK(cudaEventRecord(start, s));
    /* vadd<<<(n + 255) / 256, 256, 0, s>>>(a, b, c, n); */
    dim3 grid = {(n + 255) / 256, 1, 1}, block = {256, 1, 1};
    if (__cudaPushCallConfiguration(grid, block, 0, s) == 0)
        vadd_stub(a, b, c, n);
    CHECK(cudaGetLastError());
    CHECK(cudaEventRecord(stop, s));
    CHECK(cudaStreamSynchronize(s));
    CHECK(cudaEventSynchronize(stop));
    float ms = -1;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    CHECK(cudaMemcpyAsync(hc, c, bytes, cudaMemcpyDeviceToHost, s));
    CHECK(cudaStreamSynchronize(s));
    unsigned long long sum = 0;
    for (unsigned i = 0; i < n; i++) {
        if (hc[i] != ha[i] + hb[i]) {
            fprintf(stderr, "c[%u] = %u, expected %u\n", i, hc[i], ha[i] + hb[i]);
            return 1;
        }
        sum += hc[i];
    }

    /* The __device__ variable: set by one kernel, read by another through its address. */
    uint32_t *counter;
    CHECK(cudaGetSymbolAddress((void **)&counter, &vgpu_test_counter));
    dim3 one = {1, 1, 1}, warp = {32, 1, 1};
    if (__cudaPushCallConfiguration(one, one, 0, 0) == 0)
        set_global_stub(4242);
    if (__cudaPushCallConfiguration(one, warp, 0, 0) == 0)
        copy_stub(c, counter, 1);
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaMemcpy(&got, c, 4, cudaMemcpyDeviceToHost));
    if (got != 4242) {
        fprintf(stderr, "the __device__ variable read %u, expected 4242\n", got);
        return 1;
    }
    /* The variable by symbol: read out, written in, read by the next kernel. */
    uint32_t sym = 0, put = 777;
    CHECK(cudaMemcpyFromSymbol(&sym, &vgpu_test_counter, 4, 0, cudaMemcpyDeviceToHost));
    if (sym != 4242) {
        fprintf(stderr, "cudaMemcpyFromSymbol read %u, expected 4242\n", sym);
        return 1;
    }
    CHECK(cudaMemcpyToSymbol(&vgpu_test_counter, &put, 4, 0, cudaMemcpyHostToDevice));
    if (__cudaPushCallConfiguration(one, warp, 0, 0) == 0)
        copy_stub(c, counter, 1);
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaMemcpy(&got, c, 4, cudaMemcpyDeviceToHost));
    if (got != 777) {
        fprintf(stderr, "after cudaMemcpyToSymbol a kernel read %u, expected 777\n", got);
        return 1;
    }
    /* Past the variable's end: refused. */
    if (cudaMemcpyToSymbol(&vgpu_test_counter, &put, 4, 2, cudaMemcpyHostToDevice) ==
        cudaSuccess) {
        fprintf(stderr, "cudaMemcpyToSymbol past the end succeeded\n");
        return 1;
    }
    (void)cudaGetLastError();

    /* A stub nvcc never registered: the launch fails, and cudaGetLastError says why. */
    if (cudaLaunchKernel((const void *)unregistered_stub, one, one, 0, 0, 0) !=
        cudaErrorInvalidDeviceFunction)
        return 1;
    if (cudaGetLastError() != cudaErrorInvalidDeviceFunction)
        return 1;
    /* CUDA 13's cudaDeviceProp: major at byte 360, minor at 364, multiProcessorCount at
     * 384, 1008 bytes in all (nothing may be written beyond). */
    unsigned char props[4096];
    int major, minor, sms;
    memset(props, 0xa5, sizeof props);
    CHECK(cudaGetDeviceProperties_v2(props, 0));
    memcpy(&major, props + 360, 4);
    memcpy(&minor, props + 364, 4);
    memcpy(&sms, props + 384, 4);
    for (unsigned int i = 1008; i < sizeof props; i++)
        if (props[i] != 0xa5) {
            fprintf(stderr, "cudaGetDeviceProperties wrote byte %u\n", i);
            return 1;
        }

    CHECK(cudaEventDestroy(start));
    CHECK(cudaEventDestroy(stop));
    CHECK(cudaStreamDestroy(s));
    CHECK(cudaFree(a));
    CHECK(cudaFree(b));
    CHECK(cudaFree(c));
    CHECK(cudaFreeHost(ha));
    CHECK(cudaDeviceReset());
    __cudaUnregisterFatBinary(fatbin_handle);
    printf("runtime_program n=%u sum=%llu global=%u symbol=%u cc=%d.%d sms=%d\n", n, sum,
           sym, got, major, minor, sms);
    return 0;
}
