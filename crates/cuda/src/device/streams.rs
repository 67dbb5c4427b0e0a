//! Ordering the device's stream with other streams: streams of its context
//! ([`CudaDevice::wait_for_stream`], [`CudaDevice::make_stream_wait`]) and raw streams of
//! other libraries ([`CudaDevice::make_raw_stream_wait`]).

use cudarc::driver::{sys, CudaStream};
use devarrow_abi::device::SyncEvent;

use crate::driver;
use crate::error::{CudaError, Result};

use super::CudaDevice;

impl CudaDevice {
    /// Makes the device's stream wait (on the GPU: the host is not blocked) for the work
    /// queued on `stream` so far: an event is recorded on `stream` and the device's
    /// stream waits on it. Copies, allocations and kernels devarrow enqueues afterwards
    /// run after that work (e.g. after the caller's kernel that wrote a buffer devarrow
    /// then exports or downloads). A no-op when `stream` is the device's stream.
    pub fn wait_for_stream(&self, stream: &CudaStream) -> Result<()> {
        self.check_same_context(stream)?;
        crate::memory::stream_waits_for(&self.stream, stream)
    }

    /// Makes `stream` wait (on the GPU: the host is not blocked) for the work queued on
    /// the device's stream so far: an event is recorded on the device's stream and
    /// `stream` waits on it. Work the caller enqueues on `stream` afterwards runs after
    /// devarrow's uploads and downloads so far. A no-op when `stream` is the device's
    /// stream.
    pub fn make_stream_wait(&self, stream: &CudaStream) -> Result<()> {
        self.check_same_context(stream)?;
        crate::memory::stream_waits_for(stream, &self.stream)
    }

    /// Makes a stream the caller created outside devarrow, given as a raw `CUstream`
    /// (a DLPack consumer's, a C++ or Python library's), wait on the GPU for `event`:
    /// work the caller enqueues on `stream` afterwards runs after the work before the
    /// event. The host is not blocked. `event` is typically the event of a
    /// `devarrow_bridge::DeviceBatch` on this device or one that [`Device::record_event`]
    /// returned; a NULL [`SyncEvent::as_sync_event_ptr`] (data
    /// ready as soon as it exists, as on the CPU) makes this a no-op. The device's context
    /// is made current first (and left current), so that the driver's special handles
    /// name its default streams. For a [`CudaStream`], use
    /// [`CudaSyncEvent::wait_on`](super::CudaSyncEvent::wait_on).
    ///
    /// This is `cuStreamWaitEvent(stream, *event, CU_EVENT_WAIT_DEFAULT)`; a failure is
    /// [`CudaError::Driver`] naming `cuStreamWaitEvent`.
    ///
    /// # Safety
    /// - `stream` must be a live stream of this device's (primary) context, or one of the
    ///   driver's special handles: `CU_STREAM_LEGACY` (`1`), `CU_STREAM_PER_THREAD`
    ///   (`2`) or NULL (the legacy default stream), which then name the default streams
    ///   of this device's context.
    /// - `event`'s pointer must be NULL or a `CUevent*` to a live event, as it is for
    ///   every event of a CUDA device ([`SyncEvent`]'s contract for the CUDA device
    ///   type; the driver lets a stream wait on an event of another device).
    ///
    /// devarrow cannot check the stream: the driver API has no call that validates a
    /// handle, and the real driver does not validate it either. A destroyed or garbage
    /// handle, or a stream of another context, is undefined behaviour: at best an error,
    /// often a crash inside the driver. What is checked: a NULL event pointer (nothing to
    /// wait for) and the driver's own answer.
    ///
    /// # Example
    ///
    /// ```
    /// use devarrow_abi::device::Device;
    /// use devarrow_cuda::{CudaDevice, CudaError};
    ///
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let device = match CudaDevice::open(0) {
    ///     Ok(device) => device,
    ///     Err(e @ (CudaError::NoDriver | CudaError::NoDevice)) => {
    /// #       assert!(std::env::var("DEVARROW_REQUIRE_GPU").as_deref() != Ok("1"), "{e}");
    ///         println!("no GPU here: {e}");
    ///         return Ok(());
    ///     }
    ///     Err(e) => return Err(e.into()),
    /// };
    /// let memory = device.allocate(4)?;
    /// // SAFETY: the array outlives the copy (the stream below is synchronized before the
    /// // end of the example), and `memory` holds 4 bytes of this device.
    /// unsafe { device.copy_to_device([1u8, 2, 3, 4].as_ptr(), memory.address(), 4)? };
    /// let ready = device.record_event()?;
    /// // A stream of another library, known only by its raw handle.
    /// let theirs = device.primary_context().new_stream()?;
    /// let raw = theirs.cu_stream();
    /// // SAFETY: `raw` is a live stream (`theirs` holds it) of the device's context, and
    /// // `ready` is an event of a CUDA device.
    /// unsafe { device.make_raw_stream_wait(raw, ready.as_ref())? };
    /// // Work enqueued on `raw` from here on sees the 4 bytes in `memory`.
    /// theirs.synchronize()?;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// [`Device::record_event`]: devarrow_abi::device::Device::record_event
    pub unsafe fn make_raw_stream_wait(
        &self,
        stream: sys::CUstream,
        event: &dyn SyncEvent,
    ) -> Result<()> {
        let event = event.as_sync_event_ptr();
        if event.is_null() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: a non-NULL pointer is a `CUevent*` to a live event, and `stream` a live
        // stream of the context bound above or a special handle (the caller's
        // guarantees).
        unsafe { driver::stream_wait_event(stream, *event.cast::<sys::CUevent>()) }
    }

    /// Refuses a stream of another context than the device's.
    fn check_same_context(&self, stream: &CudaStream) -> Result<()> {
        let ctx = stream.context();
        if ctx.ordinal() != self.device.id() {
            return Err(CudaError::DeviceMismatch {
                expected: self.device.id() as i64,
                found: ctx.ordinal() as i64,
            });
        }
        if ctx.cu_ctx() != self.device.cu_context() {
            return Err(CudaError::NotPrimaryContext {
                device: ctx.ordinal(),
            });
        }
        Ok(())
    }
}
