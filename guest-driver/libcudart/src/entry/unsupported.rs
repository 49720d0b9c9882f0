//! Runtime entry points the library does not cover: each exists, returns
//! `cudaErrorNotSupported` and logs its name once (a C caller's arguments are ignored,
//! which the C calling conventions allow).

use crate::errors::{unsupported, CudaError};

macro_rules! unsupported_entries {
    ($($name:ident),* $(,)?) => {
        $(
            #[no_mangle]
            pub extern "C" fn $name() -> CudaError {
                unsupported(stringify!($name))
            }
        )*
    };
}

unsupported_entries!(
    cudaDeviceGetLimit,
    cudaDeviceSetLimit,
    cudaDeviceGetCacheConfig,
    cudaDeviceSetCacheConfig,
    cudaDeviceCanAccessPeer,
    cudaDeviceEnablePeerAccess,
    cudaDeviceDisablePeerAccess,
    cudaDeviceGetPCIBusId,
    cudaDeviceGetStreamPriorityRange,
    cudaChooseDevice,
    cudaMallocManaged,
    cudaMallocPitch,
    cudaMallocArray,
    cudaMalloc3D,
    cudaMallocAsync,
    cudaFreeAsync,
    cudaHostRegister,
    cudaHostUnregister,
    cudaHostGetDevicePointer,
    cudaPointerGetAttributes,
    cudaMemcpy2D,
    cudaMemcpy2DAsync,
    cudaMemcpy3D,
    cudaMemcpyPeer,
    cudaMemcpyPeerAsync,
    cudaMemset2D,
    cudaMemPrefetchAsync,
    cudaMemAdvise,
    cudaFuncGetAttributes,
    cudaFuncSetAttribute,
    cudaFuncSetCacheConfig,
    cudaOccupancyMaxActiveBlocksPerMultiprocessor,
    cudaOccupancyMaxPotentialBlockSize,
    cudaLaunchCooperativeKernel,
    cudaLaunchHostFunc,
    cudaStreamAddCallback,
    cudaStreamBeginCapture,
    cudaStreamEndCapture,
    cudaStreamIsCapturing,
    cudaGraphCreate,
    cudaGraphInstantiate,
    cudaGraphLaunch,
    cudaGraphExecDestroy,
    cudaGraphDestroy,
    cudaIpcGetMemHandle,
    cudaIpcOpenMemHandle,
    cudaIpcCloseMemHandle,
    cudaGetDriverEntryPoint,
    cudaGetFuncBySymbol,
    cudaCreateTextureObject,
    cudaDestroyTextureObject,
    cudaCreateSurfaceObject,
    cudaProfilerStart,
    cudaProfilerStop,
);
