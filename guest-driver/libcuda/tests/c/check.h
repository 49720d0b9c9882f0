/* What every test program does on an error: say which call failed and how. */
#ifndef VGPU_CHECK_H
#define VGPU_CHECK_H
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#ifdef USE_CUDA_H
#include <cuda.h>
#else
#include "cuda_subset.h"
#endif

static inline const char *err_name(CUresult r) {
    const char *s = "?";
    cuGetErrorName(r, &s);
    return s;
}

#define CHECK(call)                                                                    \
    do {                                                                               \
        CUresult r_ = (call);                                                          \
        if (r_ != CUDA_SUCCESS) {                                                      \
            fprintf(stderr, "%s:%d: %s: %s (%d)\n", __FILE__, __LINE__, #call,          \
                    err_name(r_), (int)r_);                                            \
            exit(1);                                                                   \
        }                                                                              \
    } while (0)

/* Expects `call` to fail with `want`. */
#define EXPECT(call, want)                                                             \
    do {                                                                               \
        CUresult r_ = (call);                                                          \
        if (r_ != (want)) {                                                            \
            fprintf(stderr, "%s:%d: %s: got %s (%d), expected %d\n", __FILE__,          \
                    __LINE__, #call, err_name(r_), (int)r_, (int)(want));              \
            exit(1);                                                                   \
        }                                                                              \
    } while (0)

/* CLOCK_MONOTONIC in seconds (the benchmark programs' timer). */
static inline double now_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* The first device's primary context, current on this thread. */
static inline CUcontext setup(void) {
    CUdevice dev;
    CUcontext ctx;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(cuCtxSetCurrent(ctx));
    return ctx;
}
#endif
