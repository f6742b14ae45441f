//! TMA tensor maps: a [`TensorMapSpec`] from the kernel table and a device address from the plan,
//! encoded by the driver (`cuTensorMapEncodeTiled`) into the 128 bytes a kernel takes by value.
//! Every address is fixed once the allocation exists, so the maps are encoded when the graphs
//! are captured and never again.

use cudarc::driver::sys::{
    self, CUtensorMap, CUtensorMapDataType, CUtensorMapFloatOOBfill, CUtensorMapInterleave,
    CUtensorMapL2promotion, CUtensorMapSwizzle,
};
use cudarc::driver::DeviceRepr;
use kiln_ir::artifact::TensorMapSpec;
use kiln_ir::DType;

/// An encoded tensor map, passed to a kernel by value.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct TensorMap(CUtensorMap);

// SAFETY: a plain 128-byte, 128-aligned value that the kernel reads as its `.param .b8 [128]`.
unsafe impl DeviceRepr for TensorMap {}

impl TensorMap {
    /// The map's bytes (what the kernel receives).
    pub fn bytes(&self) -> [u64; 16] {
        self.0.opaque
    }
}

/// Encodes the tensor map `spec` describes over the matrix at device address `address`.
pub fn encode(spec: &TensorMapSpec, address: u64) -> Result<TensorMap, String> {
    spec.check()?;
    if !address.is_multiple_of(16) {
        return Err(format!("address {address:#x} is not 16-byte aligned"));
    }
    let dtype = match spec.dtype {
        DType::F16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        DType::BF16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        _ => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
    };
    let swizzle = match spec.swizzle_bytes {
        32 => CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_32B,
        64 => CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_64B,
        128 => CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
        _ => CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE,
    };
    let unit = [1u32; 4];
    let mut map = CUtensorMap { opaque: [0; 16] };
    // SAFETY: every array outlives the call and holds 4 (strides: 3) entries; the driver
    // only writes `map`. The address is not dereferenced here.
    let status = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            dtype,
            4,
            address as *mut std::ffi::c_void,
            spec.dims.as_ptr(),
            spec.strides.as_ptr(),
            spec.box_dims.as_ptr(),
            unit.as_ptr(),
            CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle,
            CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    match status {
        sys::CUresult::CUDA_SUCCESS => Ok(TensorMap(map)),
        e => Err(format!("the driver refuses the tensor map {spec:?}: {e:?}")),
    }
}
