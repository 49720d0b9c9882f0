/* Runtime API without kernels, for a real guest over /dev/vgpu (the nested rig runs it in
 * L2 against the sim GPU, with nothing but vgpu's libcudart.so.13 and libcuda.so.1 on its
 * library path): the device and its properties, device memory, copies both ways and
 * device to device, a set, pinned memory, a stream with events around an async copy.
 * usage: devvgpu_runtime   (prints "devvgpu_runtime ok mib=<device memory> bytes=<N>") */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "check.h"

#define N (256u * 1024u)

static void expect(int ok, const char *what) {
    if (!ok) {
        fprintf(stderr, "devvgpu_runtime: %s\n", what);
        exit(1);
    }
}

int main(void) {
    size_t bytes = (size_t)N * 4, total;
    int count, runtime, driver;
    unsigned char props[4096];
    void *a, *b;
    uint32_t *h, *pinned;
    cudaStream_t s;
    cudaEvent_t start, stop;
    float ms;

    CHECK(cudaGetDeviceCount(&count));
    expect(count == 1, "one device");
    CHECK(cudaSetDevice(0));
    CHECK(cudaRuntimeGetVersion(&runtime));
    CHECK(cudaDriverGetVersion(&driver));
    /* CUDA 13's cudaDeviceProp: the name first, totalGlobalMem at byte 288. */
    memset(props, 0, sizeof props);
    CHECK(cudaGetDeviceProperties_v2(props, 0));
    memcpy(&total, props + 288, sizeof total);
    fprintf(stderr, "%.64s, %zu MiB, runtime %d, driver %d\n", (const char *)props,
            total >> 20, runtime, driver);
    expect(total >= bytes * 2, "device memory for two buffers");

    h = malloc(bytes);
    expect(h != NULL, "host memory");
    for (uint32_t i = 0; i < N; i++)
        h[i] = i * 2654435761u;
    CHECK(cudaMalloc(&a, bytes));
    CHECK(cudaMalloc(&b, bytes));
    CHECK(cudaMemcpy(a, h, bytes, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice));
    CHECK(cudaMallocHost((void **)&pinned, bytes));
    memset(pinned, 0, bytes);

    CHECK(cudaStreamCreate(&s));
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&stop));
    CHECK(cudaEventRecord(start, s));
    CHECK(cudaMemcpyAsync(pinned, b, bytes, cudaMemcpyDeviceToHost, s));
    CHECK(cudaEventRecord(stop, s));
    CHECK(cudaEventSynchronize(stop));
    CHECK(cudaStreamSynchronize(s));
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    expect(ms >= 0.0f, "elapsed time");
    expect(memcmp(pinned, h, bytes) == 0, "the async copy back");

    CHECK(cudaMemset(a, 0x5a, bytes));
    CHECK(cudaMemcpy(h, a, bytes, cudaMemcpyDeviceToHost));
    for (uint32_t i = 0; i < N; i++)
        expect(h[i] == 0x5a5a5a5au, "the set");
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaGetLastError());

    CHECK(cudaEventDestroy(start));
    CHECK(cudaEventDestroy(stop));
    CHECK(cudaStreamDestroy(s));
    CHECK(cudaFreeHost(pinned));
    CHECK(cudaFree(a));
    CHECK(cudaFree(b));
    free(h);
    printf("devvgpu_runtime ok mib=%zu bytes=%zu\n", total >> 20, bytes);
    return 0;
}
