#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

/// The ABI layer, [`devarrow_abi`]: the C structs, owning wrappers, the CPU device and the
/// C and async device streams.
///
/// ```
/// use arrow_array::{Int32Array, RecordBatch};
/// use devarrow::abi::{cpu, ArrowDeviceType};
///
/// # fn main() -> devarrow::abi::Result<()> {
/// let batch = RecordBatch::try_from_iter([(
///     "x",
///     std::sync::Arc::new(Int32Array::from(vec![1, 2])) as arrow_array::ArrayRef,
/// )])?;
/// let (array, schema) = cpu::export_record_batch(&batch)?; // zero-copy, ARROW_DEVICE_CPU
/// assert_eq!(array.device_type(), ArrowDeviceType::CPU);
/// assert_eq!(cpu::import_record_batch(array, &schema)?, batch);
/// # Ok(())
/// # }
/// ```
pub use devarrow_abi as abi;

/// Record batches to a device and back, [`devarrow_bridge`].
///
/// ```
/// use std::sync::Arc;
///
/// use arrow_array::{ArrayRef, RecordBatch, StringArray};
/// use devarrow::bridge::{Transfer, TransferOptions};
/// use devarrow::{select_device, DeviceRequest};
///
/// # fn main() -> devarrow::abi::Result<()> {
/// let names: ArrayRef = Arc::new(StringArray::from(vec!["a", "bb", "ccc"]));
/// let batch = RecordBatch::try_from_iter([("name", names)])?;
/// let selected = select_device(DeviceRequest::Cpu).expect("the CPU device");
/// let mut transfer = Transfer::new(selected.device, TransferOptions::default());
/// let on_device = transfer.to_device(&batch)?;
/// assert_eq!(on_device.column(0).map(|c| c.len()), Some(3));
/// assert_eq!(transfer.to_host(&on_device)?, batch);
/// # Ok(())
/// # }
/// ```
pub use devarrow_bridge as bridge;

/// CUDA devices, memory, events and kernels, [`devarrow_cuda`] (feature `cuda`, on by
/// default; loaded at run time, so it builds and runs without a CUDA toolkit).
///
/// ```
/// match devarrow::cuda::device_count() {
///     Ok(n) => println!("{n} CUDA device(s)"),
///     Err(e) => println!("no CUDA here: {e}"), // a typed error, never a panic
/// }
/// ```
#[cfg(feature = "cuda")]
pub use devarrow_cuda as cuda;

pub use devarrow_bridge::select::{
    select_device, DeviceRequest, DeviceSpec, DeviceSpecError, SelectedDevice,
};

/// The git commit this build was made from (`unknown` outside a git checkout), so
/// measurements can name the code they measured.
///
/// ```
/// println!("devarrow {} at {}", env!("CARGO_PKG_VERSION"), devarrow::GIT_COMMIT);
/// assert!(!devarrow::GIT_COMMIT.is_empty());
/// ```
pub const GIT_COMMIT: &str = env!("DEVARROW_GIT_COMMIT");
