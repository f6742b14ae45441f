//! Kernel launches through the driver's extended launch (`cuLaunchKernelEx`), which can carry
//! the programmatic-stream-serialization attribute: the launched kernel may start as soon as
//! every block of the kernel before it has run `griddepcontrol.launch_dependents`, and its own
//! `griddepcontrol.wait` holds it until that kernel has completed. Artifacts of format 9 and
//! later put both instructions in every kernel (`kiln_kernels::ptx`), so every step may launch
//! this way; stream capture keeps the dependency as a programmatic edge of the graph.

use std::ffi::c_void;

use cudarc::driver::sys::{self, CUlaunchAttribute, CUlaunchAttributeID, CUlaunchConfig};
use cudarc::driver::{CudaFunction, CudaStream, DriverError, LaunchConfig};

use super::TensorMap;

/// One kernel argument's value, as the kernel's parameter takes it.
pub(super) enum ArgValue {
    U64(u64),
    U32(u32),
    F32(f32),
    Map(TensorMap),
}

impl ArgValue {
    /// The address of the value, as `kernelParams` lists it.
    fn param(&mut self) -> *mut c_void {
        match self {
            ArgValue::U64(v) => (v as *mut u64).cast(),
            ArgValue::U32(v) => (v as *mut u32).cast(),
            ArgValue::F32(v) => (v as *mut f32).cast(),
            ArgValue::Map(m) => (m as *mut TensorMap).cast(),
        }
    }
}

/// Launches `function` on `stream` with `args`; `early` launches it as a programmatic
/// dependent of the kernel before it in the stream.
///
/// # Safety
/// `args` must hold one value of the kernel's type per parameter, in order, every address in it
/// valid for what the kernel does with it; with `early`, the kernel must wait
/// (`griddepcontrol.wait`) before it reads anything an earlier kernel writes.
pub(super) unsafe fn launch(
    stream: &CudaStream,
    function: &CudaFunction,
    cfg: LaunchConfig,
    args: &mut [ArgValue],
    early: bool,
) -> Result<(), DriverError> {
    stream.context().bind_to_thread()?;
    let mut params: Vec<*mut c_void> = args.iter_mut().map(ArgValue::param).collect();
    // SAFETY: `CUlaunchAttribute` is plain data (an id, padding and a union of integers) for
    // which all zeros is a valid value; the fields the driver reads are set below.
    let mut attribute: CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attribute.id = CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attribute.value.programmaticStreamSerializationAllowed = 1;
    let config = CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: &mut attribute,
        numAttrs: u32::from(early),
    };
    // SAFETY: the caller vouches for the arguments (see above); `config`, its attribute and the
    // parameter addresses outlive the call, which copies them.
    unsafe {
        sys::cuLaunchKernelEx(
            &config,
            function.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
}
