// cudaGetDeviceProperties as a user calls it, built with `nvcc -cudart shared` against
// the toolkit's own cudaDeviceProp: prints the fields one per line (key=value), so a run
// on NVIDIA's libraries and one on vgpu's can be compared field by field (a layout
// mismatch would show as every later field wrong).
// usage: device_props
#include <cstdio>
#include <cstdlib>

#define P(f) printf(#f "=%lld\n", (long long)p.f)

int main() {
    cudaDeviceProp p;
    cudaError_t e = cudaGetDeviceProperties(&p, 0);
    if (e != cudaSuccess) {
        fprintf(stderr, "cudaGetDeviceProperties: %s\n", cudaGetErrorName(e));
        return 1;
    }
    fprintf(stderr, "name=%s\n", p.name);
    P(totalGlobalMem); P(sharedMemPerBlock); P(regsPerBlock); P(warpSize); P(memPitch);
    P(maxThreadsPerBlock); P(maxThreadsDim[0]); P(maxThreadsDim[1]); P(maxThreadsDim[2]);
    P(maxGridSize[0]); P(maxGridSize[1]); P(maxGridSize[2]); P(totalConstMem);
    P(major); P(minor); P(textureAlignment); P(texturePitchAlignment);
    P(multiProcessorCount); P(integrated); P(canMapHostMemory); P(surfaceAlignment);
    P(concurrentKernels); P(ECCEnabled); P(pciBusID); P(pciDeviceID); P(pciDomainID);
    P(tccDriver); P(asyncEngineCount); P(unifiedAddressing); P(memoryBusWidth);
    P(l2CacheSize); P(persistingL2CacheMaxSize); P(maxThreadsPerMultiProcessor);
    P(streamPrioritiesSupported); P(globalL1CacheSupported); P(localL1CacheSupported);
    P(sharedMemPerMultiprocessor); P(regsPerMultiprocessor); P(managedMemory);
    P(isMultiGpuBoard); P(multiGpuBoardGroupID); P(hostNativeAtomicSupported);
    P(pageableMemoryAccess); P(concurrentManagedAccess); P(computePreemptionSupported);
    P(canUseHostPointerForRegisteredMem); P(cooperativeLaunch); P(sharedMemPerBlockOptin);
    P(pageableMemoryAccessUsesHostPageTables); P(directManagedMemAccessFromHost);
    P(maxBlocksPerMultiProcessor); P(accessPolicyMaxWindowSize);
    P(reservedSharedMemPerBlock); P(hostRegisterSupported); P(memoryPoolsSupported);
    P(clusterLaunch); P(unifiedFunctionPointers); P(mpsEnabled);
    P(gpuPciDeviceID); P(gpuPciSubsystemID); P(hostNumaMultinodeIpcSupported);
    return 0;
}
