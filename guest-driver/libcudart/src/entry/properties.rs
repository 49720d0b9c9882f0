//! `cudaGetDeviceProperties`: the device's properties in CUDA 13's `cudaDeviceProp`
//! layout, each field from the driver's `cuDeviceGetAttribute` (as NVIDIA's runtime
//! builds it). A field whose attribute the driver does not answer is 0; texture and
//! surface limits are 0 (vgpu has no arrays).

use std::ffi::{c_char, c_int, c_uint};

use crate::cu::Driver;
use crate::errors::{check, guard, CudaError, INVALID_DEVICE, INVALID_VALUE};
use crate::registry::ready;

/// `struct cudaDeviceProp` of CUDA 13.0's `driver_types.h`, field for field.
#[repr(C)]
#[allow(non_snake_case)]
pub struct CudaDeviceProp {
    pub name: [c_char; 256],
    pub uuid: [u8; 16],
    pub luid: [c_char; 8],
    pub luidDeviceNodeMask: c_uint,
    pub totalGlobalMem: usize,
    pub sharedMemPerBlock: usize,
    pub regsPerBlock: c_int,
    pub warpSize: c_int,
    pub memPitch: usize,
    pub maxThreadsPerBlock: c_int,
    pub maxThreadsDim: [c_int; 3],
    pub maxGridSize: [c_int; 3],
    pub totalConstMem: usize,
    pub major: c_int,
    pub minor: c_int,
    pub textureAlignment: usize,
    pub texturePitchAlignment: usize,
    pub multiProcessorCount: c_int,
    pub integrated: c_int,
    pub canMapHostMemory: c_int,
    /// maxTexture1D through maxSurfaceCubemapLayered: 39 ints.
    pub textures: [c_int; 39],
    pub surfaceAlignment: usize,
    pub concurrentKernels: c_int,
    pub ECCEnabled: c_int,
    pub pciBusID: c_int,
    pub pciDeviceID: c_int,
    pub pciDomainID: c_int,
    pub tccDriver: c_int,
    pub asyncEngineCount: c_int,
    pub unifiedAddressing: c_int,
    pub memoryBusWidth: c_int,
    pub l2CacheSize: c_int,
    pub persistingL2CacheMaxSize: c_int,
    pub maxThreadsPerMultiProcessor: c_int,
    pub streamPrioritiesSupported: c_int,
    pub globalL1CacheSupported: c_int,
    pub localL1CacheSupported: c_int,
    pub sharedMemPerMultiprocessor: usize,
    pub regsPerMultiprocessor: c_int,
    pub managedMemory: c_int,
    pub isMultiGpuBoard: c_int,
    pub multiGpuBoardGroupID: c_int,
    pub hostNativeAtomicSupported: c_int,
    pub pageableMemoryAccess: c_int,
    pub concurrentManagedAccess: c_int,
    pub computePreemptionSupported: c_int,
    pub canUseHostPointerForRegisteredMem: c_int,
    pub cooperativeLaunch: c_int,
    pub sharedMemPerBlockOptin: usize,
    pub pageableMemoryAccessUsesHostPageTables: c_int,
    pub directManagedMemAccessFromHost: c_int,
    pub maxBlocksPerMultiProcessor: c_int,
    pub accessPolicyMaxWindowSize: c_int,
    pub reservedSharedMemPerBlock: usize,
    pub hostRegisterSupported: c_int,
    pub sparseCudaArraySupported: c_int,
    pub hostRegisterReadOnlySupported: c_int,
    pub timelineSemaphoreInteropSupported: c_int,
    pub memoryPoolsSupported: c_int,
    pub gpuDirectRDMASupported: c_int,
    pub gpuDirectRDMAFlushWritesOptions: c_uint,
    pub gpuDirectRDMAWritesOrdering: c_int,
    pub memoryPoolSupportedHandleTypes: c_uint,
    pub deferredMappingCudaArraySupported: c_int,
    pub ipcEventSupported: c_int,
    pub clusterLaunch: c_int,
    pub unifiedFunctionPointers: c_int,
    pub deviceNumaConfig: c_int,
    pub deviceNumaId: c_int,
    pub mpsEnabled: c_int,
    pub hostNumaId: c_int,
    pub gpuPciDeviceID: c_uint,
    pub gpuPciSubsystemID: c_uint,
    pub hostNumaMultinodeIpcSupported: c_int,
    pub reserved: [c_int; 56],
}

/// Attribute `a` of device 0 from the driver; 0 where it has none.
fn attr(d: &Driver, a: c_int) -> c_int {
    let mut v = 0;
    // SAFETY: a driver entry point with a result pointer.
    match unsafe { (d.device_attribute)(&mut v, a, 0) } {
        0 => v,
        _ => 0,
    }
}

fn fill(d: &Driver, p: &mut CudaDeviceProp) -> Result<(), CudaError> {
    // SAFETY: driver entry points with result pointers of the sizes they say.
    check(unsafe { (d.device_name)(p.name.as_mut_ptr(), p.name.len() as c_int, 0) })?;
    // SAFETY: as above.
    check(unsafe { (d.device_total_mem)(&mut p.totalGlobalMem, 0) })?;
    let a = |n| attr(d, n);
    let z = |n| a(n).max(0) as usize;
    p.sharedMemPerBlock = z(8);
    p.regsPerBlock = a(12);
    p.warpSize = a(10);
    p.memPitch = z(11);
    p.maxThreadsPerBlock = a(1);
    p.maxThreadsDim = [a(2), a(3), a(4)];
    p.maxGridSize = [a(5), a(6), a(7)];
    p.totalConstMem = z(9);
    p.major = a(75);
    p.minor = a(76);
    p.textureAlignment = z(14);
    p.texturePitchAlignment = z(51);
    p.multiProcessorCount = a(16);
    p.integrated = a(18);
    p.canMapHostMemory = a(19);
    p.surfaceAlignment = z(30);
    p.concurrentKernels = a(31);
    p.ECCEnabled = a(32);
    p.pciBusID = a(33);
    p.pciDeviceID = a(34);
    p.pciDomainID = a(50);
    p.tccDriver = a(35);
    p.asyncEngineCount = a(40);
    p.unifiedAddressing = a(41);
    p.memoryBusWidth = a(37);
    p.l2CacheSize = a(38);
    p.persistingL2CacheMaxSize = a(108);
    p.maxThreadsPerMultiProcessor = a(39);
    p.streamPrioritiesSupported = a(78);
    p.globalL1CacheSupported = a(79);
    p.localL1CacheSupported = a(80);
    p.sharedMemPerMultiprocessor = z(81);
    p.regsPerMultiprocessor = a(82);
    p.managedMemory = a(83);
    p.isMultiGpuBoard = a(84);
    p.multiGpuBoardGroupID = a(85);
    p.hostNativeAtomicSupported = a(86);
    p.pageableMemoryAccess = a(88);
    p.concurrentManagedAccess = a(89);
    p.computePreemptionSupported = a(90);
    p.canUseHostPointerForRegisteredMem = a(91);
    p.cooperativeLaunch = a(95);
    p.sharedMemPerBlockOptin = z(97);
    p.pageableMemoryAccessUsesHostPageTables = a(100);
    p.directManagedMemAccessFromHost = a(101);
    p.maxBlocksPerMultiProcessor = a(106);
    p.accessPolicyMaxWindowSize = a(109);
    p.reservedSharedMemPerBlock = z(111);
    p.hostRegisterSupported = a(99);
    p.sparseCudaArraySupported = a(112);
    p.hostRegisterReadOnlySupported = a(113);
    p.timelineSemaphoreInteropSupported = a(114);
    p.memoryPoolsSupported = a(115);
    p.gpuDirectRDMASupported = a(116);
    p.gpuDirectRDMAFlushWritesOptions = a(117) as c_uint;
    p.gpuDirectRDMAWritesOrdering = a(118);
    p.memoryPoolSupportedHandleTypes = a(119) as c_uint;
    p.deferredMappingCudaArraySupported = a(121);
    p.ipcEventSupported = a(125);
    p.clusterLaunch = a(120);
    p.unifiedFunctionPointers = a(129);
    p.deviceNumaConfig = a(130);
    p.deviceNumaId = a(131);
    p.mpsEnabled = a(133);
    p.hostNumaId = a(134);
    p.gpuPciDeviceID = a(139) as c_uint;
    p.gpuPciSubsystemID = a(140) as c_uint;
    p.hostNumaMultinodeIpcSupported = a(143);
    Ok(())
}

#[no_mangle]
pub extern "C" fn cudaGetDeviceProperties(prop: *mut CudaDeviceProp, dev: c_int) -> CudaError {
    guard("cudaGetDeviceProperties", || {
        if dev != 0 {
            return Err(INVALID_DEVICE);
        }
        if prop.is_null() {
            return Err(INVALID_VALUE);
        }
        let d = ready()?;
        // SAFETY: all-zero bytes are a valid `CudaDeviceProp` (integers and arrays).
        let mut p: CudaDeviceProp = unsafe { std::mem::zeroed() };
        fill(d, &mut p)?;
        // SAFETY: `prop` is non-NULL and points at the caller's `cudaDeviceProp`.
        unsafe { prop.write_unaligned(p) };
        Ok(())
    })
}

/// CUDA 12's name of the same call (`cuda_runtime_api.h` maps one onto the other).
#[no_mangle]
pub extern "C" fn cudaGetDeviceProperties_v2(prop: *mut CudaDeviceProp, dev: c_int) -> CudaError {
    cudaGetDeviceProperties(prop, dev)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    /// Offsets of CUDA 13.0's `cudaDeviceProp` on x86-64 (the header's layout, computed
    /// from its field list: a wrong field shifts every one after it).
    #[test]
    fn the_layout_is_cuda_13s() {
        assert_eq!(offset_of!(CudaDeviceProp, totalGlobalMem), 288);
        assert_eq!(offset_of!(CudaDeviceProp, major), 360);
        assert_eq!(offset_of!(CudaDeviceProp, multiProcessorCount), 384);
        assert_eq!(offset_of!(CudaDeviceProp, textures), 396);
        assert_eq!(offset_of!(CudaDeviceProp, surfaceAlignment), 552);
        assert_eq!(offset_of!(CudaDeviceProp, l2CacheSize), 596);
        assert_eq!(offset_of!(CudaDeviceProp, sharedMemPerMultiprocessor), 624);
        assert_eq!(offset_of!(CudaDeviceProp, reserved), 784);
        assert_eq!(size_of::<CudaDeviceProp>(), 1008);
    }
}
