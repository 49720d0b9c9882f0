/* vmm_probe: what identity addressing (host-shim/src/cuda/identity.rs) relies on in the
 * CUDA VMM API, measured on the machine it runs on: whether address reservations land
 * at the address asked for (1 TiB-aligned hints from 4 TiB up; a small reservation's
 * hint), whether two mappings of one physical allocation alias, host-located physical
 * memory, and what creating, mapping and moving a 2 MiB granule costs.
 * Prints `name value` lines.
 *
 * Build and run (on the device machine): nvcc -O2 -o vmm_probe vmm_probe.c -lcuda && ./vmm_probe
 */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CK(x)                                                                          \
    do {                                                                               \
        CUresult r_ = (x);                                                             \
        if (r_ != CUDA_SUCCESS) {                                                      \
            const char *s_ = "?";                                                      \
            cuGetErrorName(r_, &s_);                                                   \
            fprintf(stderr, "%s: %s (line %d)\n", #x, s_, __LINE__);                   \
            exit(1);                                                                   \
        }                                                                              \
    } while (0)

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

int main(void) {
    const size_t G = 2 << 20;
    const int N = 4096; /* 8 GiB of granules */
    CUdevice d;
    CUcontext c;
    CK(cuInit(0));
    CK(cuDeviceGet(&d, 0));
    CK(cuCtxCreate(&c, NULL, 0, d));
    CUdeviceptr block;
    CK(cuMemAlloc(&block, 1 << 30)); /* the process's own memory, as a worker has */

    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    CUmemAccessDesc acc;
    acc.location = prop.location;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    size_t gran = 0;
    CK(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    printf("granularity_bytes %zu\n", gran);

    /* Hints: a 32 GiB window (identity.rs's WINDOW) at every 1 TiB from 4 TiB. */
    int honoured = 0, asked = 0;
    for (unsigned long long t = 4; t < 128; t++) {
        CUdeviceptr p = 0;
        unsigned long long hint = t << 40;
        asked++;
        if (cuMemAddressReserve(&p, 32ULL << 30, G, hint, 0) == CUDA_SUCCESS) {
            honoured += p == hint;
            cuMemAddressFree(p, 32ULL << 30);
        }
    }
    printf("window_hints_honoured %d of %d\n", honoured, asked);
    CUdeviceptr small = 0;
    CK(cuMemAddressReserve(&small, 16 << 20, G, 5ULL << 40, 0));
    printf("small_reservation_hint_honoured %d\n", small == (5ULL << 40));
    CK(cuMemAddressFree(small, 16 << 20));

    /* Granules: create, map back to back with access each (as cuda/vram.rs does). */
    CUmemGenericAllocationHandle *h = calloc(N, sizeof *h);
    CUdeviceptr pool;
    CK(cuMemAddressReserve(&pool, (size_t)N * G, G, 0, 0));
    double t0 = now_us();
    for (int i = 0; i < N; i++)
        CK(cuMemCreate(&h[i], G, &prop, 0));
    double t1 = now_us();
    for (int i = 0; i < N; i++) {
        CK(cuMemMap(pool + (size_t)i * G, G, 0, h[i], 0));
        CK(cuMemSetAccess(pool + (size_t)i * G, G, &acc, 1));
    }
    double t2 = now_us();
    printf("granule_create_us %.1f\n", (t1 - t0) / N);
    printf("granule_map_with_access_us %.1f\n", (t2 - t1) / N);

    /* A mirror: a second mapping of granules at a hinted window; aliasing; a move. */
    CUdeviceptr mir = 0;
    CK(cuMemAddressReserve(&mir, 32ULL << 30, G, 6ULL << 40, 0));
    for (int i = 0; i < 8; i++) {
        CK(cuMemMap(mir + i * G, G, 0, h[100 + i], 0));
        CK(cuMemSetAccess(mir + i * G, G, &acc, 1));
    }
    unsigned int v = 0xabcd1234, got = 0;
    CK(cuMemcpyHtoD(pool + 103 * G + 4096, &v, 4));
    CK(cuMemcpyDtoH(&got, mir + 3 * G + 4096, 4));
    printf("mirror_aliases %d\n", got == v);
    double t3 = now_us();
    for (int k = 0; k < 100; k++) {
        CK(cuMemUnmap(mir, G));
        CK(cuMemMap(mir, G, 0, h[200 + k], 0));
        CK(cuMemSetAccess(mir, G, &acc, 1));
    }
    printf("mirror_move_us %.1f\n", (now_us() - t3) / 100);

    /* Host-located physical memory at a mirror's address (CUDA >= 12.2). */
    CUmemAllocationProp hp = prop;
    hp.location.type = CU_MEM_LOCATION_TYPE_HOST;
    CUmemGenericAllocationHandle hh;
    int host_ok = 0;
    if (cuMemCreate(&hh, G, &hp, 0) == CUDA_SUCCESS) {
        CK(cuMemUnmap(mir, G));
        CK(cuMemMap(mir, G, 0, hh, 0));
        CK(cuMemSetAccess(mir, G, &acc, 1));
        got = 0;
        CK(cuMemcpyHtoD(mir + 8, &v, 4));
        CK(cuMemcpyDtoH(&got, mir + 8, 4));
        host_ok = got == v;
    }
    printf("host_located_mirror_works %d\n", host_ok);
    return 0;
}
