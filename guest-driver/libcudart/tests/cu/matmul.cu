// A CUDA runtime program as a user writes it: a matrix multiply launched with <<<>>>
// REPS times, timed with events, checked against the CPU, plus a __device__ counter
// set with cudaMemcpyToSymbol, bumped by the kernel, read by another kernel and by
// cudaMemcpyFromSymbol. Built with `nvcc -cudart shared` on a
// machine with the toolkit (ci/device/run.sh run libcuda), it runs unmodified against
// NVIDIA's libraries and against vgpu's guest libcudart.so/libcuda.so.1.
// usage: matmul [N] [REPS]
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(call)                                                                      \
    do {                                                                                 \
        cudaError_t e_ = (call);                                                         \
        if (e_ != cudaSuccess) {                                                         \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,                 \
                    cudaGetErrorName(e_));                                               \
            exit(1);                                                                     \
        }                                                                                \
    } while (0)

__device__ unsigned int calls;

__global__ void matmul(const float *a, const float *b, float *c, int n) {
    int row = blockIdx.y * blockDim.y + threadIdx.y;
    int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (row < n && col < n) {
        float s = 0;
        for (int k = 0; k < n; k++)
            s += a[row * n + k] * b[k * n + col];
        c[row * n + col] = s;
        if (row == 0 && col == 0)
            atomicAdd(&calls, 1u);
    }
}

__global__ void read_calls(unsigned int *out) { *out = calls; }

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 1024;
    int reps = argc > 2 ? atoi(argv[2]) : 20;
    size_t bytes = (size_t)n * n * sizeof(float);
    // Small integers: every sum is exact in float, so results compare bit for bit.
    std::vector<float> a(n * n), b(n * n), c(n * n);
    for (int i = 0; i < n * n; i++) {
        a[i] = (float)(i % 7) - 3;
        b[i] = (float)(i % 5) - 2;
    }
    float *da, *db, *dc;
    unsigned int *dcalls, got = 0;
    CHECK(cudaMalloc(&da, bytes));
    CHECK(cudaMalloc(&db, bytes));
    CHECK(cudaMalloc(&dc, bytes));
    CHECK(cudaMalloc(&dcalls, sizeof(unsigned int)));
    CHECK(cudaMemcpy(da, a.data(), bytes, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(db, b.data(), bytes, cudaMemcpyHostToDevice));
    const unsigned int first = 1000;
    CHECK(cudaMemcpyToSymbol(calls, &first, sizeof first));
    dim3 block(16, 16), grid((n + 15) / 16, (n + 15) / 16);
    matmul<<<grid, block>>>(da, db, dc, n); // warm-up (module load)
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    cudaEvent_t start, stop;
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&stop));
    CHECK(cudaEventRecord(start));
    for (int r = 0; r < reps; r++)
        matmul<<<grid, block>>>(da, db, dc, n);
    CHECK(cudaGetLastError());
    CHECK(cudaEventRecord(stop));
    CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    read_calls<<<1, 1>>>(dcalls);
    CHECK(cudaMemcpy(c.data(), dc, bytes, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(&got, dcalls, sizeof got, cudaMemcpyDeviceToHost));
    unsigned int by_symbol = 0;
    CHECK(cudaMemcpyFromSymbol(&by_symbol, calls, sizeof by_symbol));
    if (by_symbol != got) {
        fprintf(stderr, "calls: %u by symbol, %u by kernel\n", by_symbol, got);
        return 1;
    }
    double checksum = 0;
    for (int row = 0; row < n; row += 97)
        for (int col = 0; col < n; col++) {
            float s = 0;
            for (int k = 0; k < n; k++)
                s += a[row * n + k] * b[k * n + col];
            if (s != c[row * n + col]) {
                fprintf(stderr, "c[%d][%d] = %f, expected %f\n", row, col, c[row * n + col], s);
                return 1;
            }
        }
    for (int i = 0; i < n * n; i++)
        checksum += c[i];
    printf("matmul n=%d reps=%d checksum=%.0f calls=%u\n", n, reps, checksum, got);
    printf("matmul_time ms_per_kernel=%.4f\n", ms / reps);
    CHECK(cudaFree(da));
    CHECK(cudaFree(db));
    CHECK(cudaFree(dc));
    CHECK(cudaFree(dcalls));
    return got == first + (unsigned)(reps + 1) ? 0 : 1;
}
