//! Importing a foreign CUDA `ArrowDeviceArray` zero-copy.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use arrow_buffer::alloc::Allocation;
use cudarc::driver::{sys, CudaStream};
use devarrow_abi::{ArrowArray, ArrowDeviceArray, ArrowDeviceType, DeviceArray};

use crate::context::{self, ContextGuard, DropInContext};
use crate::driver;
use crate::error::{CudaError, Result};
use crate::memory::ForeignBuffer;

/// Owns the imported array; its drop is where the producer's `release` runs.
struct ImportShared {
    array: DeviceArray,
    stream: DropInContext<Arc<CudaStream>>,
    event: sys::CUevent,
    host_synchronized: AtomicBool,
}

// SAFETY: `event` is a CUDA event handle, which the driver lets any thread use; the rest
// is Send (DeviceArray, Arc<CudaStream>, AtomicBool).
unsafe impl Send for ImportShared {}
// SAFETY: shared access only reads the handle and calls thread-safe driver functions.
unsafe impl Sync for ImportShared {}

impl Drop for ImportShared {
    fn drop(&mut self) {
        // Work the consumer enqueued on its stream may still read the buffers: let it
        // finish before the producer frees them. (Work on other streams must be ordered
        // before the last view is dropped.) `array` is released right after, when the
        // fields drop.
        // Bound through a guard: the last view may drop on a thread busy with another
        // context. (If synchronizing fails, the context is broken and runs nothing more.)
        if let Ok(_bound) = ContextGuard::enter(self.stream.context()) {
            // SAFETY: the stream is live (we hold it) and its context is bound.
            let _ = unsafe { driver::stream_synchronize(self.stream.cu_stream()) };
        }
    }
}

/// A foreign `ArrowDeviceArray` of `ARROW_DEVICE_CUDA`, `ARROW_DEVICE_CUDA_HOST` or
/// `ARROW_DEVICE_CUDA_MANAGED`, imported zero-copy for a consumer stream.
///
/// Importing makes the consumer stream wait on the producer's `sync_event`
/// (`cuStreamWaitEvent`: no host blocking); a NULL `sync_event` means the data is
/// already safe to read. Work enqueued on that stream afterwards sees the data.
///
/// Cheap to clone. The producer's `release` runs when the last clone **and** the last
/// buffer view ([`ImportedArray::buffer`]) is dropped, after the consumer stream's
/// queued work has finished: the drop blocks the host on `cuStreamSynchronize` of the
/// consumer stream. That is the importer's side of the release contract (see
/// [`crate::export_array_data`]): a producer may free in stream order on its own stream,
/// which knows nothing of ours, and reuse the memory there at once, so our reads must be
/// complete, not only enqueued, when `release` runs. Buffer views carry the producer's event: using one on
/// another stream (a kernel of [`crate::kernels`], [`ForeignBuffer::to_host`]) makes that
/// stream wait on it too; work on other streams must still be finished before the last
/// view is dropped.
///
/// The struct tree (`array()`, its `child(i)` and `dictionary()`) is in host memory and
/// may be walked freely; buffer contents may not be read on the host unless the device
/// type is host-accessible and [`ImportedArray::synchronize_host`] has returned.
///
/// # Example
///
/// A producer's export imported on the consumer's stream, and one of its buffers read
/// back there:
///
/// ```
/// use arrow_data::ArrayData;
/// use arrow_schema::DataType;
/// use devarrow_abi::ArrowDeviceType;
/// use devarrow_cuda::{export_array_data, CudaDevice, CudaError, DeviceBuffer, ImportedArray};
///
/// # fn main() -> devarrow_cuda::Result<()> {
/// let device = match CudaDevice::open(0) {
///     Ok(device) => device,
///     Err(e @ (CudaError::NoDriver | CudaError::NoDevice)) => {
/// #       assert!(std::env::var("DEVARROW_REQUIRE_GPU").as_deref() != Ok("1"), "{e}");
///         println!("no GPU here: {e}");
///         return Ok(());
///     }
///     Err(e) => return Err(e),
/// };
/// // The producer: three u16 values on its own stream, exported with a sync event.
/// let producer = device.primary_context().new_stream()?;
/// let values = DeviceBuffer::from_host(&producer, &[7u16, 8, 9])?;
/// // SAFETY: device memory that only travels inside the exported array.
/// let buffer = unsafe { values.into_arrow_buffer() };
/// // SAFETY: 3 values of 2 bytes, no nulls: the layout of a UInt16 array of length 3.
/// let data = unsafe {
///     ArrayData::builder(DataType::UInt16).len(3).null_count(0).add_buffer(buffer).build_unchecked()
/// };
/// let exported = export_array_data(data, ArrowDeviceType::CUDA, &producer)?;
///
/// // The consumer: its stream waits on the producer's event (no host wait).
/// let consumer = device.primary_context().new_stream()?;
/// let imported = ImportedArray::import(exported, &consumer)?;
/// assert_eq!(imported.array().length, 3);
/// // SAFETY: buffer 1 of a UInt16 array of 3 values holds 6 bytes.
/// let view = unsafe { imported.buffer(imported.array(), 1, 6) }.expect("a values buffer");
/// assert_eq!(view.to_host(&consumer)?, [7, 0, 8, 0, 9, 0]);
/// drop(view);
/// drop(imported); // the producer's release runs once, after the consumer's reads
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct ImportedArray {
    shared: Arc<ImportShared>,
}

impl std::fmt::Debug for ImportedArray {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImportedArray")
            .field("device_type", &self.device_type())
            .field("device_id", &self.device_id())
            .field("length", &self.array().length)
            .field("sync_event", &self.shared.event)
            .finish()
    }
}

impl ImportedArray {
    /// Imports `array` for consumption on `stream`.
    ///
    /// Fails (releasing `array`) when the device type is not a CUDA type, when CUDA
    /// device memory lives on another device than the stream's, or when `stream` is the
    /// per-thread default stream (the last view, dropped on any thread, synchronizes
    /// `stream` before the producer's release runs).
    pub fn import(array: DeviceArray, stream: &Arc<CudaStream>) -> Result<Self> {
        let device_type = array.device_type();
        if !device_type.is_cuda() {
            return Err(CudaError::UnsupportedDeviceType {
                found: device_type,
                expected: "ARROW_DEVICE_CUDA, ARROW_DEVICE_CUDA_HOST or ARROW_DEVICE_CUDA_MANAGED",
            });
        }
        context::check_keepable(stream, "ImportedArray::import")?;
        let ctx = stream.context();
        let ordinal = ctx.ordinal() as i64;
        if device_type == ArrowDeviceType::CUDA && array.device_id() != ordinal {
            return Err(CudaError::DeviceMismatch {
                expected: ordinal,
                found: array.device_id(),
            });
        }
        let sync_event = array.sync_event();
        let event: sys::CUevent = if sync_event.is_null() {
            std::ptr::null_mut()
        } else {
            // We hold the array (unreleased) for as long as we use the event.
            // SAFETY: a DeviceArray's non-NULL `sync_event` points to a live event of its
            // device type (contract of `DeviceArray::try_new`): for the CUDA types a
            // `cudaEvent_t` (== `CUevent`), kept alive by the producer until release.
            unsafe { *sync_event.cast::<sys::CUevent>() }
        };
        if !event.is_null() {
            // SAFETY: the event is the producer's live event (see above).
            unsafe { context::stream_wait_event(stream, event) }?;
        }
        Ok(Self {
            shared: Arc::new(ImportShared {
                array,
                stream: DropInContext::new(stream.clone()),
                event,
                host_synchronized: AtomicBool::new(event.is_null()),
            }),
        })
    }

    /// Moves the device array out of `ptr` (marking it released) and imports it.
    ///
    /// # Safety
    /// `ptr` must be NULL or point to a valid, writable `ArrowDeviceArray` whose contents
    /// follow the C Device data interface (the contract of
    /// [`DeviceArray::try_new`](devarrow_abi::DeviceArray::try_new)).
    pub unsafe fn import_raw(ptr: *mut ArrowDeviceArray, stream: &Arc<CudaStream>) -> Result<Self> {
        // SAFETY: the caller's guarantee is exactly `from_raw`'s.
        let array = unsafe { DeviceArray::from_raw(ptr) }?;
        Self::import(array, stream)
    }

    /// The root `ArrowArray` (walk `child(i)` and `dictionary()` from here).
    pub fn array(&self) -> &ArrowArray {
        self.shared.array.array()
    }

    /// The whole imported device array.
    pub fn device_array(&self) -> &DeviceArray {
        &self.shared.array
    }

    /// The device type of every buffer.
    pub fn device_type(&self) -> ArrowDeviceType {
        self.shared.array.device_type()
    }

    /// The producer's device id.
    pub fn device_id(&self) -> i64 {
        self.shared.array.device_id()
    }

    /// The consumer stream the import waits on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.shared.stream
    }

    /// The producer's event (NULL when `sync_event` was NULL).
    pub fn sync_event(&self) -> sys::CUevent {
        self.shared.event
    }

    /// Blocks the host until the producer's event has completed, after which
    /// `ARROW_DEVICE_CUDA_HOST` buffers, and `ARROW_DEVICE_CUDA_MANAGED` buffers on devices
    /// with concurrent managed access, may be read from the host (views made afterwards
    /// have [`ForeignBuffer::host_slice`]).
    pub fn synchronize_host(&self) -> Result<()> {
        if !self.shared.event.is_null() {
            context::bind(self.shared.stream.context())?;
            // SAFETY: the producer's event stays alive until release, which cannot run
            // while we hold `shared`.
            unsafe { driver::event_synchronize(self.shared.event) }?;
        }
        self.shared.host_synchronized.store(true, Ordering::Release);
        Ok(())
    }

    /// Whether the host may read this device type's memory while kernels of the context
    /// may run: pinned memory always; managed memory only on devices with concurrent
    /// managed access (elsewhere a host access while any kernel runs faults).
    fn host_may_read(&self) -> bool {
        match self.device_type() {
            ArrowDeviceType::CUDA_HOST => true,
            ArrowDeviceType::CUDA_MANAGED => {
                let dev = self.shared.stream.context().cu_device();
                driver::device_get_attribute(
                    dev,
                    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS,
                )
                .is_ok_and(|v| v > 0)
            }
            _ => false,
        }
    }

    /// Whether the producer's work is known complete (no event, or
    /// [`ImportedArray::synchronize_host`] returned).
    pub fn is_host_synchronized(&self) -> bool {
        self.shared.host_synchronized.load(Ordering::Acquire)
    }

    /// What keeps the import alive (and the producer's release pending): hand it to
    /// anything that must hold the buffers, e.g. arrow-rs `Buffer::from_custom_allocation`.
    pub fn owner(&self) -> Arc<dyn Allocation> {
        self.shared.clone()
    }

    /// A view of the first `len` bytes of buffer `index` of `node`, holding the import;
    /// `None` when that buffer pointer is NULL (or `index >= n_buffers`).
    ///
    /// # Safety
    /// `node` must be [`ImportedArray::array`] or reachable from it through children and
    /// dictionaries, and the buffer must hold at least `len` bytes (which the caller
    /// derives from the schema, `length` and `offset`).
    pub unsafe fn buffer(
        &self,
        node: &ArrowArray,
        index: usize,
        len: usize,
    ) -> Option<ForeignBuffer> {
        // SAFETY: `node` is the imported DeviceArray's array or reachable from it (caller's
        // guarantee), hence well-formed (contract of `DeviceArray::try_new`).
        let ptr = unsafe { node.buffer(index) };
        if ptr.is_null() {
            return None;
        }
        // SAFETY: the buffer belongs to the imported array (caller's guarantee), kept
        // unreleased by the owner while the view lives; the data is immutable; host
        // readability follows the synchronization state; the event lives until release.
        Some(unsafe {
            ForeignBuffer::new(
                ptr as u64,
                len,
                self.device_type(),
                self.device_id(),
                self.is_host_synchronized() && self.host_may_read(),
                self.owner(),
            )
            .with_ready_event(self.shared.event)
        })
    }
}
