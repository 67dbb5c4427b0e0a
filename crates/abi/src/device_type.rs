//! `ArrowDeviceType`: where the buffers of an `ArrowDeviceArray` live.

use std::fmt;

/// The C `ArrowDeviceType` (`typedef int32_t ArrowDeviceType;`).
///
/// A transparent newtype over `i32`, so any value a foreign producer writes is carried
/// through unchanged: the 15 values the specification names have associated constants
/// (their numbers are DLPack's `DLDeviceType`), and any other value is kept as it is and
/// displayed as `UNKNOWN(n)` rather than rejected or lost.
///
/// ```
/// use devarrow_abi::ArrowDeviceType;
///
/// assert_eq!(ArrowDeviceType::CUDA.0, 2); // DLPack's kDLCUDA
/// assert_eq!(ArrowDeviceType::CUDA.to_string(), "ARROW_DEVICE_CUDA");
/// assert!(ArrowDeviceType::CUDA_HOST.is_host_accessible());
/// assert!(!ArrowDeviceType::CUDA.is_host_accessible());
/// // A value the specification does not name is carried through, not rejected.
/// assert_eq!(ArrowDeviceType::from(99).to_string(), "UNKNOWN(99)");
/// ```
#[repr(transparent)]
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct ArrowDeviceType(pub i32);

impl ArrowDeviceType {
    /// CPU memory; the same as using `ArrowArray` directly.
    pub const CPU: Self = Self(1);
    /// CUDA device memory (`cudaMalloc`).
    pub const CUDA: Self = Self(2);
    /// Pinned CUDA host memory (`cudaMallocHost`).
    pub const CUDA_HOST: Self = Self(3);
    /// OpenCL device.
    pub const OPENCL: Self = Self(4);
    /// Vulkan buffer.
    pub const VULKAN: Self = Self(7);
    /// Metal (Apple GPU).
    pub const METAL: Self = Self(8);
    /// Verilog simulator buffer.
    pub const VPI: Self = Self(9);
    /// ROCm (AMD GPU).
    pub const ROCM: Self = Self(10);
    /// Pinned ROCm host memory (`hipMallocHost`).
    pub const ROCM_HOST: Self = Self(11);
    /// Reserved for extension devices; producer-defined semantics.
    pub const EXT_DEV: Self = Self(12);
    /// CUDA managed (unified) memory (`cudaMallocManaged`).
    pub const CUDA_MANAGED: Self = Self(13);
    /// oneAPI unified shared memory.
    pub const ONEAPI: Self = Self(14);
    /// WebGPU.
    pub const WEBGPU: Self = Self(15);
    /// Qualcomm Hexagon DSP.
    pub const HEXAGON: Self = Self(16);
    /// Microsoft Maia.
    pub const MAIA: Self = Self(17);

    /// Every device type the specification (and the canonical `abi.h`) names.
    pub const ALL: [Self; 15] = [
        Self::CPU,
        Self::CUDA,
        Self::CUDA_HOST,
        Self::OPENCL,
        Self::VULKAN,
        Self::METAL,
        Self::VPI,
        Self::ROCM,
        Self::ROCM_HOST,
        Self::EXT_DEV,
        Self::CUDA_MANAGED,
        Self::ONEAPI,
        Self::WEBGPU,
        Self::HEXAGON,
        Self::MAIA,
    ];

    /// The C macro name without its `ARROW_DEVICE_` prefix, or `None` for a value the
    /// specification does not name.
    pub const fn name(self) -> Option<&'static str> {
        Some(match self.0 {
            1 => "CPU",
            2 => "CUDA",
            3 => "CUDA_HOST",
            4 => "OPENCL",
            7 => "VULKAN",
            8 => "METAL",
            9 => "VPI",
            10 => "ROCM",
            11 => "ROCM_HOST",
            12 => "EXT_DEV",
            13 => "CUDA_MANAGED",
            14 => "ONEAPI",
            15 => "WEBGPU",
            16 => "HEXAGON",
            17 => "MAIA",
            _ => return None,
        })
    }

    /// Whether the specification names this value.
    pub const fn is_known(self) -> bool {
        self.name().is_some()
    }

    /// Whether memory of this type can be dereferenced by the host CPU (once any
    /// `sync_event` has been waited on): `CPU`, `CUDA_HOST`, `ROCM_HOST` and `CUDA_MANAGED`.
    pub const fn is_host_accessible(self) -> bool {
        matches!(self.0, 1 | 3 | 11 | 13)
    }

    /// Whether this is one of the CUDA device types, whose `sync_event` is a `cudaEvent_t*`.
    pub const fn is_cuda(self) -> bool {
        matches!(self.0, 2 | 3 | 13)
    }
}

impl From<i32> for ArrowDeviceType {
    fn from(v: i32) -> Self {
        Self(v)
    }
}

impl From<ArrowDeviceType> for i32 {
    fn from(v: ArrowDeviceType) -> Self {
        v.0
    }
}

impl fmt::Display for ArrowDeviceType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(n) => write!(f, "ARROW_DEVICE_{n}"),
            None => write!(f, "UNKNOWN({})", self.0),
        }
    }
}

impl fmt::Debug for ArrowDeviceType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self} ({})", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_match_dlpack() {
        let numbers: Vec<i32> = ArrowDeviceType::ALL.iter().map(|d| d.0).collect();
        assert_eq!(
            numbers,
            [1, 2, 3, 4, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]
        );
        assert!(ArrowDeviceType::ALL.iter().all(|d| d.is_known()));
    }

    #[test]
    fn unknown_values_are_carried() {
        let d = ArrowDeviceType::from(42);
        assert!(!d.is_known());
        assert_eq!(i32::from(d), 42);
        assert_eq!(d.to_string(), "UNKNOWN(42)");
        assert_eq!(ArrowDeviceType::CUDA.to_string(), "ARROW_DEVICE_CUDA");
        assert_eq!(
            format!("{:?}", ArrowDeviceType::MAIA),
            "ARROW_DEVICE_MAIA (17)"
        );
    }
}
