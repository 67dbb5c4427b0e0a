//! [`CudaDevice`]: one CUDA device and its own stream as a
//! [`devarrow_abi::device::Device`], so the bridge (`devarrow-bridge`, written once
//! against that trait) moves record batches to and from the GPU.
//!
//! - device memory: [`DeviceBuffer`], stream-ordered on the device's stream and freed in
//!   stream order when the last reference drops;
//! - staging memory: [`PinnedHostBuffer`] (page-locked, not write-combined), so copies are
//!   true asynchronous DMA;
//! - copies: `cuMemcpyHtoDAsync` / `cuMemcpyDtoHAsync` on the stream; a list of copies in
//!   one `cuMemcpyBatchAsync` where [`CudaDeviceOptions::batch_copies`] asks for it and
//!   the driver has it;
//! - pageable host memory page-locked for direct DMA (`cuMemHostRegister`) where
//!   [`CudaDeviceOptions::register_pageable`] asks for it ([`crate::HostRegistration`]);
//! - copies of a list and registrations fall back (one copy each, staging) on any driver
//!   error that is not sticky ([`crate::is_sticky_error`]), remembered per device: what
//!   drivers without the feature and restricted runtimes (gVisor's nvproxy) answer;
//! - events: a `CUevent` (`CU_EVENT_DISABLE_TIMING`, plus `CU_EVENT_BLOCKING_SYNC` with
//!   [`HostWait::Block`]; devarrow's own `event::Event`) recorded on the stream, exported as
//!   `ArrowDeviceArray.sync_event` = a pointer **to** the `CUevent`, as the C Device Data
//!   Interface requires for `ARROW_DEVICE_CUDA`.

use std::any::Any;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaEvent, CudaStream};
use devarrow_abi::device::{
    Device, DeviceKernels, DeviceMemory, DeviceToHost, HostRegistration, HostToDevice, RowIntegers,
    StagingMemory, SyncEvent, Validity,
};
use devarrow_abi::pinned_registry::PinnedRegistry;
use devarrow_abi::ArrowDeviceType;

use crate::context::{self, ContextGuard, DropInContext};
use crate::driver;
use crate::error::{CudaError, DriverResultExt, Result};
use crate::event::Event;
use crate::host_register::{self, Registered};
use crate::kernels::{self, CopySegment};
use crate::memory::{CudaMemory as _, DeviceBuffer, PinnedHostBuffer};
use crate::primary_context::PrimaryContext;

/// A CUDA device with its own non-blocking stream ([`CudaDevice::open`],
/// [`CudaDevice::new`]) or the caller's ([`CudaDevice::on_stream`]), as a
/// [`devarrow_abi::device::Device`].
///
/// Every copy, allocation and event of the device is enqueued on that one stream, in call
/// order. [`CudaDevice::wait_for_stream`] and [`CudaDevice::make_stream_wait`] order it
/// against another stream of the caller with an event, without blocking the host. Memory it allocates outlives it (each allocation holds the stream), so a
/// `DeviceBatch` exported from it stays valid after the device is dropped.
///
/// Cheap to share behind an `Arc`; usable from any thread (every call binds the device's
/// primary context on the calling thread first).
///
/// # Example
///
/// The [`Device`] calls `devarrow-bridge`'s `Transfer` makes, here by hand: allocate,
/// copy each way on the device's stream, record an event (a `CUevent`, what an export's
/// `sync_event` points to) and wait for it.
///
/// ```
/// use devarrow_abi::device::Device;
/// use devarrow_cuda::{CudaDevice, CudaDeviceOptions, CudaError, HostWait};
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
/// let device = device.with_options(CudaDeviceOptions::default().host_wait(HostWait::Block));
/// let memory = device.allocate(4)?;
/// let input = [1u8, 2, 3, 4];
/// let mut output = [0u8; 4];
/// // SAFETY: `input` and `output` outlive the copies (we wait for the event below), and
/// // `memory` holds 4 bytes of this device.
/// unsafe {
///     device.copy_to_device(input.as_ptr(), memory.address(), 4)?;
///     device.copy_to_host(memory.address(), output.as_mut_ptr(), 4)?;
/// }
/// device.record_event()?.wait_host()?; // blocks without spinning (HostWait::Block)
/// assert_eq!(output, input);
/// assert_eq!(device.copy_count(), 2);
/// assert!(device.memory_stats().live_buffers >= 1);
/// # Ok(())
/// # }
/// ```
pub struct CudaDevice {
    device: PrimaryContext,
    stream: DropInContext<Arc<CudaStream>>,
    copies: AtomicU64,
    descriptors: Mutex<DescriptorStaging>,
    /// Staging buffers given back by dropped [`PinnedStaging`]s, for the next
    /// [`Device::allocate_staging`].
    staging: Arc<StagingCache>,
    options: CudaDeviceOptions,
    events: Arc<EventPool>,
    /// Whether `cuMemcpyBatchAsync` is there: [`BATCH_UNKNOWN`] until first needed.
    batch_copy: AtomicU8,
    /// `cuMemcpyBatchAsync` calls made.
    batched_calls: AtomicU64,
    /// Whether the driver refused a registration for the device rather than the range
    /// (see [`CudaDevice::register_host`]): none is tried again.
    registration_unsupported: AtomicBool,
    /// Page ranges this device registered (`cuMemHostRegister` calls that succeeded).
    ranges_registered: AtomicU64,
    /// Registrations the driver refused (the range was staged instead).
    registrations_refused: AtomicU64,
}

/// Per pair of contexts (their `cuCtxGetId`s: this device's, the source memory's):
/// whether copies go device to device (`cuDeviceCanAccessPeer` said so and peer access
/// from the first to the second was enabled), asked once per pair for the process
/// ([`Device::copy_from_peer`]): peer access belongs to the context, which every
/// `CudaDevice` of its device shares, so a second enable (another `CudaDevice` of the
/// same device) would be `CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED`. A context made anew
/// after a reset has a new id, and is asked again.
static PEER_ACCESS: Mutex<Option<std::collections::HashMap<(u64, u64), bool>>> = Mutex::new(None);

/// [`CudaDevice::batch_copy`]: not yet known, there, not there.
const BATCH_UNKNOWN: u8 = 0;
const BATCH_AVAILABLE: u8 = 1;
const BATCH_UNAVAILABLE: u8 = 2;

/// `CU_STREAM_LEGACY`, the legacy default stream's other handle (NULL is the first).
const LEGACY_STREAM: usize = 0x1;

/// Which way a batch of copies goes (for the driver's location hints).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    ToDevice,
    ToHost,
}

/// How the host waits for the GPU ([`CudaDeviceOptions::host_wait`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HostWait {
    /// The driver's default: the waiting thread spins (and yields), for the lowest
    /// latency at the cost of a busy core.
    #[default]
    Spin,
    /// The waiting thread blocks (`CU_EVENT_BLOCKING_SYNC`, with
    /// `CU_EVENT_DISABLE_TIMING` like every event of the device): no busy core while the
    /// pipeline waits on a staging chunk, at some wake-up latency.
    Block,
}

/// The choices of a [`CudaDevice`] that a GPU run decides (see `docs/gpu-results.md`):
/// exercised on the emulated driver, their defaults to be chosen by the transfer bench
/// on a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct CudaDeviceOptions {
    /// How host waits on the device's events block ([`HostWait::Spin`] by default).
    pub host_wait: HostWait,
    /// Whether the events recorded on the device's stream (one per staging chunk and per
    /// batch) come back to a pool for reuse when dropped, instead of a `cuEventCreate`
    /// and `cuEventDestroy` each (on by default).
    pub reuse_events: bool,
    /// Whether the device's copies of a list (`Device::copy_batch_to_device` and
    /// `copy_batch_to_host`: the direct copies of a transfer, from pinned runs and
    /// registered buffers) go to the driver in one `cuMemcpyBatchAsync` call (CUDA 12.8)
    /// instead of one `cuMemcpyHtoDAsync` / `cuMemcpyDtoHAsync` each: fewer driver
    /// calls for batches of many buffers.
    ///
    /// Used only where the driver has it (the symbol is looked up once per device; any
    /// error of the call that leaves the context usable, that is not
    /// [sticky](crate::is_sticky_error), also counts as "not there", remembered per
    /// device: `CUDA_ERROR_NOT_SUPPORTED` from a driver without it, and the
    /// `CUDA_ERROR_NOT_PERMITTED` or `CUDA_ERROR_OPERATING_SYSTEM` of restricted runtimes
    /// such as gVisor's nvproxy) and the device's stream is not the legacy
    /// default stream (which the call does not accept, see [`CudaDevice::on_stream`]);
    /// elsewhere the copies go one by one, as with the option off.
    /// [`CudaDevice::batched_copy_calls`] counts the calls made.
    ///
    /// **On by default**: on an NVIDIA H200 (2026-11-28, `docs/gpu-results.md`) the main
    /// job with it was faster in every cell, device to host by 18-40%; off where the
    /// driver lacks the call, as above.
    pub batch_copies: bool,
    /// Pageable host buffers of at least this many bytes are page-locked in place
    /// (`cuMemHostRegister` of the whole pages inside them, `CU_MEMHOSTREGISTER_PORTABLE`)
    /// for the copies of a transfer that moves them, which then DMA those pages directly
    /// instead of packing them into pinned staging memory first (uploads) or unpacking
    /// them from it (downloads); they are unregistered once those copies have
    /// completed. `None`: never (**the default**, until a GPU run weighs the cost of
    /// registering, which grows with the size, against the staging copy it saves).
    ///
    /// Only whole pages are locked: the partial pages at a buffer's ends may hold other
    /// allocations, whose copies must not turn direct for as long as devarrow's
    /// registration lasts; those few bytes are staged with the batch's small buffers.
    /// A buffer the driver refuses to lock (read-only mappings, the memlock limit,
    /// pages locked by someone else) is staged as before; a refusal that is not about
    /// the range (any other error that is not [sticky](crate::is_sticky_error): the
    /// `CUDA_ERROR_NOT_SUPPORTED` of a driver, the `CUDA_ERROR_OPERATING_SYSTEM` or
    /// `CUDA_ERROR_NOT_PERMITTED` of a sandbox) also switches registration off for the
    /// device ([`CudaDevice::host_registration_disabled`]); devarrow never unregisters
    /// memory it did not register (see [`crate::HostRegistration`]); a refusal is a
    /// failing driver call, which compute-sanitizer reports. A transfer asks only for
    /// ranges of at least its `TransferOptions::direct_min_bytes` as well.
    pub register_pageable: Option<usize>,
}

impl Default for CudaDeviceOptions {
    fn default() -> Self {
        Self {
            host_wait: HostWait::Spin,
            reuse_events: true,
            batch_copies: true,
            register_pageable: None,
        }
    }
}

impl CudaDeviceOptions {
    /// The options with [`CudaDeviceOptions::host_wait`] set to `wait`.
    pub fn host_wait(mut self, wait: HostWait) -> Self {
        self.host_wait = wait;
        self
    }

    /// The options with [`CudaDeviceOptions::reuse_events`] set to `reuse`.
    pub fn reuse_events(mut self, reuse: bool) -> Self {
        self.reuse_events = reuse;
        self
    }

    /// The options with [`CudaDeviceOptions::batch_copies`] set to `batch`.
    pub fn batch_copies(mut self, batch: bool) -> Self {
        self.batch_copies = batch;
        self
    }

    /// The options with [`CudaDeviceOptions::register_pageable`] set to `min_bytes`.
    pub fn register_pageable(mut self, min_bytes: Option<usize>) -> Self {
        self.register_pageable = min_bytes;
        self
    }

    /// The `CU_EVENT_*` bits of the device's sync events: never timed (cheaper to
    /// record), blocking the waiting host thread with [`HostWait::Block`]. Both bits at
    /// once are beyond cudarc's `CUevent_flags` enum, hence devarrow's own
    /// `Event` (a raw `cuEventCreate`).
    fn event_flags(&self) -> std::ffi::c_uint {
        let disable_timing = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as std::ffi::c_uint;
        match self.host_wait {
            HostWait::Spin => disable_timing,
            HostWait::Block => {
                disable_timing | sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as std::ffi::c_uint
            }
        }
    }
}

/// Events of one device, for reuse: an event whose [`CudaSyncEvent`] dropped has no
/// consumer left (a wait enqueued on it captured its state when it was enqueued), so it
/// may be recorded again.
#[derive(Debug, Default)]
struct EventPool {
    free: Mutex<Vec<Event>>,
    created: AtomicU64,
}

/// At most this many idle events are kept per device.
const MAX_IDLE_EVENTS: usize = 256;

/// The pinned memory for descriptor tables a [`CudaDevice`] starts with (2,730
/// descriptors of [`Device::copy_on_device`]).
const DESCRIPTOR_STAGING_BYTES: usize = 64 << 10;

/// The pinned host memory the descriptor tables of [`Device::copy_on_device`] are
/// uploaded from (reused by every call), and the event after its last upload: the next
/// call overwrites it only once that upload has completed.
#[derive(Default)]
struct DescriptorStaging {
    buffer: Option<PinnedHostBuffer>,
    uploaded: Option<CudaEvent>,
}

impl Drop for DescriptorStaging {
    fn drop(&mut self) {
        // The last upload may still read the pinned buffer: let it finish first.
        if let Some(event) = self.uploaded.take() {
            if let Ok(_bound) = ContextGuard::enter(event.context()) {
                // SAFETY: the event is live (we own it) and its context is bound.
                let _ = unsafe { driver::event_synchronize(event.cu_event()) };
            }
        }
    }
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("device", &self.device)
            .field("stream", &self.stream.cu_stream())
            .field("copies", &self.copies.load(Ordering::Relaxed))
            .finish()
    }
}

impl CudaDevice {
    /// Opens CUDA device `id` (on its primary context) with a new non-blocking stream.
    ///
    /// Fails with [`CudaError::NoDriver`] when libcuda is missing, [`CudaError::NoDevice`]
    /// when there is no device, [`CudaError::InvalidDeviceId`] when `id` is out of range;
    /// never panics.
    pub fn open(id: usize) -> Result<Self> {
        Self::new(PrimaryContext::open(id)?)
    }

    /// Wraps an opened device, creating the device's own non-blocking stream.
    pub fn new(device: PrimaryContext) -> Result<Self> {
        let stream = device.new_stream()?;
        Ok(Self::with(device, stream))
    }

    /// A device on the caller's stream: every allocation, copy, event, export and import
    /// of this device (and of the `Transfer`s, streams and batches of `devarrow-bridge`
    /// made on it) is enqueued on `stream`, in order with the caller's own work there.
    ///
    /// The device is the stream's (its context's ordinal). The stream must belong to
    /// that device's **primary** context, the one devarrow works in (cudarc's
    /// [`CudaContext::new`](cudarc::driver::CudaContext::new) and the CUDA runtime use
    /// it); any other context is [`CudaError::NotPrimaryContext`]. The per-thread default
    /// stream is refused ([`CudaError::InvalidArgument`]): devarrow frees memory on the
    /// device's stream from whichever thread drops it. The legacy default stream is
    /// accepted.
    ///
    /// What devarrow can check about a caller's stream is its context, and only for a
    /// live stream (here from the cudarc stream's context; for a raw handle,
    /// `cuStreamGetCtx` would tell it). It cannot tell a live stream from a garbage or
    /// destroyed handle: NVIDIA's driver dereferences stream handles without validating
    /// them, so such a handle crashes the process at the first call, in devarrow or
    /// anywhere else, rather than returning an error. cudarc's [`CudaStream`], which owns
    /// its handle and keeps it alive while the `Arc` lives, rules that out here; a stream
    /// built around a raw handle (an FFI caller's) must be live for as long as the
    /// device is used.
    ///
    /// The device holds the stream (its `Arc`), and so does every allocation made on it.
    pub fn on_stream(stream: Arc<CudaStream>) -> Result<Self> {
        context::check_keepable(&stream, "CudaDevice::on_stream")?;
        let device = PrimaryContext::of_stream(&stream)?;
        if stream.context().cu_ctx() != device.cu_context() {
            return Err(CudaError::NotPrimaryContext {
                device: device.id(),
            });
        }
        Ok(Self::with(device, stream))
    }

    fn with(device: PrimaryContext, stream: Arc<CudaStream>) -> Self {
        // The descriptor tables' pinned memory, allocated now rather than by the first
        // copy on the device (an import, a download of an imported batch): that
        // `cuMemHostAlloc` orders every stream of the device after the work enqueued
        // before it (an implicit synchronization), which at open is normally nothing,
        // and in the middle of a pipeline another library's work. Where it fails, the
        // first copy allocates it.
        let descriptors = DescriptorStaging {
            buffer: PinnedHostBuffer::alloc(&device, DESCRIPTOR_STAGING_BYTES).ok(),
            uploaded: None,
        };
        Self {
            device,
            stream: DropInContext::new(stream),
            copies: AtomicU64::new(0),
            descriptors: Mutex::new(descriptors),
            staging: Arc::default(),
            options: CudaDeviceOptions::default(),
            events: Arc::default(),
            batch_copy: AtomicU8::new(BATCH_UNKNOWN),
            batched_calls: AtomicU64::new(0),
            registration_unsupported: AtomicBool::new(false),
            ranges_registered: AtomicU64::new(0),
            registrations_refused: AtomicU64::new(0),
        }
    }

    /// The device with `options` (set before the device is shared: events already
    /// pooled are dropped).
    pub fn with_options(mut self, options: CudaDeviceOptions) -> Self {
        self.options = options;
        self.events = Arc::default();
        self
    }

    /// The device's options.
    pub fn options(&self) -> CudaDeviceOptions {
        self.options
    }

    /// How many events the device has created (`cuEventCreate`) for its sync events so
    /// far: with [`CudaDeviceOptions::reuse_events`], about as many as are alive at once.
    pub fn events_created(&self) -> u64 {
        self.events.created.load(Ordering::Relaxed)
    }

    /// devarrow's accounting of the device memory it allocated on this device (all
    /// [`CudaDevice`]s and streams of it together): [`crate::memory_stats`].
    pub fn memory_stats(&self) -> crate::MemoryStats {
        crate::memory_stats(self.device.id())
    }

    /// How many `cuMemcpyBatchAsync` calls the device has made
    /// ([`CudaDeviceOptions::batch_copies`]).
    pub fn batched_copy_calls(&self) -> u64 {
        self.batched_calls.load(Ordering::Relaxed)
    }

    /// Whether the driver has `cuMemcpyBatchAsync` for this device: `None` until the
    /// device first needed to know (a batch of copies with
    /// [`CudaDeviceOptions::batch_copies`] on).
    pub fn batch_copies_available(&self) -> Option<bool> {
        match self.batch_copy.load(Ordering::Acquire) {
            BATCH_AVAILABLE => Some(true),
            BATCH_UNAVAILABLE => Some(false),
            _ => None,
        }
    }

    /// How many page ranges the device has registered with `cuMemHostRegister`
    /// ([`CudaDeviceOptions::register_pageable`]; a range another registration already
    /// held is not counted), and how many registrations the driver refused (those
    /// ranges were staged).
    pub fn host_registrations(&self) -> (u64, u64) {
        (
            self.ranges_registered.load(Ordering::Relaxed),
            self.registrations_refused.load(Ordering::Relaxed),
        )
    }

    /// Whether the driver refused `cuMemHostRegister` on this device in a way that is not
    /// about one range (not supported, or refused by a restricted runtime: see
    /// [`CudaDeviceOptions::register_pageable`]): devarrow then stages every pageable
    /// buffer without asking again.
    pub fn host_registration_disabled(&self) -> bool {
        self.registration_unsupported.load(Ordering::Relaxed)
    }

    /// Whether a list of copies goes to `cuMemcpyBatchAsync`: asked for, the stream not
    /// the legacy default stream, and the symbol in the driver (looked up once).
    fn batch_copy_usable(&self) -> bool {
        if !self.options.batch_copies {
            return false;
        }
        let stream = self.stream.cu_stream() as usize;
        if stream == 0 || stream == LEGACY_STREAM {
            return false;
        }
        match self.batch_copy.load(Ordering::Acquire) {
            BATCH_AVAILABLE => true,
            BATCH_UNAVAILABLE => false,
            _ => {
                let present = driver::memcpy_batch_async_present();
                let state = if present {
                    BATCH_AVAILABLE
                } else {
                    BATCH_UNAVAILABLE
                };
                self.batch_copy.store(state, Ordering::Release);
                present
            }
        }
    }

    /// Enqueues `copies` (`(dst, src, len)` unified addresses, none empty or NULL) in one
    /// `cuMemcpyBatchAsync` where [`CudaDevice::batch_copy_usable`]: `Ok(true)` when they
    /// were, `Ok(false)` when the caller must copy them one by one (too few to batch, not
    /// asked for, or the driver does not have it: then remembered).
    ///
    /// # Safety
    /// Every source readable and every destination writable for its length until the
    /// copies complete, no destination overlapping another copy; the context bound.
    unsafe fn try_batch(&self, copies: &[(u64, u64, usize)], direction: Direction) -> Result<bool> {
        if copies.len() < 2 || !self.batch_copy_usable() {
            return Ok(false);
        }
        let mut dsts: Vec<sys::CUdeviceptr> = copies.iter().map(|c| c.0).collect();
        let mut srcs: Vec<sys::CUdeviceptr> = copies.iter().map(|c| c.1).collect();
        let mut sizes: Vec<usize> = copies.iter().map(|c| c.2).collect();
        let host = sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST,
            id: 0,
        };
        let device = sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: self.device.id() as i32,
        };
        let locations = match direction {
            Direction::ToDevice => (host, device),
            Direction::ToHost => (device, host),
        };
        // SAFETY: the symbol is there (`batch_copy_usable`); the ranges are the caller's
        // guarantee; the stream is the device's, a created stream (not the legacy one,
        // checked above) of the context the caller bound.
        let batched = unsafe {
            driver::memcpy_batch_async(
                &mut dsts,
                &mut srcs,
                &mut sizes,
                locations,
                self.stream.cu_stream(),
            )
        };
        match batched {
            Ok(()) => {
                self.batched_calls.fetch_add(1, Ordering::Relaxed);
                Ok(true)
            }
            Err(e) if e.allows_fallback() => {
                // Not usable here after all, whatever code says so: a driver that
                // exports the symbol but does not implement it (NOT_SUPPORTED,
                // NOT_FOUND), a sandbox that refuses it (NOT_PERMITTED, OPERATING_SYSTEM
                // under gVisor's nvproxy), ...: any error that leaves the context
                // usable. Copy one by one, from now on. The batch enqueued nothing (and
                // had it enqueued a part, copying the same sources to the same
                // destinations again writes the same bytes).
                self.batch_copy.store(BATCH_UNAVAILABLE, Ordering::Release);
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// What a list of copies does first: counts them, drops the empty ones, refuses NULL
    /// pointers, and binds the context. `(dst, src, len)` of the copies left.
    fn begin_batch(
        &self,
        copies: impl ExactSizeIterator<Item = (u64, u64, usize)>,
        towards: &str,
    ) -> Result<Vec<(u64, u64, usize)>> {
        self.copies
            .fetch_add(copies.len() as u64, Ordering::Relaxed);
        let copies: Vec<_> = copies.filter(|c| c.2 > 0).collect();
        if copies.iter().any(|c| c.0 == 0 || c.1 == 0) {
            return Err(CudaError::InvalidArgument(format!(
                "a batch of copies to the {towards} with a NULL pointer"
            )));
        }
        if !copies.is_empty() {
            self.bind()?;
        }
        Ok(copies)
    }

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
    /// [`CudaSyncEvent::wait_on`].
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

    /// The CUDA device.
    pub fn primary_context(&self) -> &PrimaryContext {
        &self.device
    }

    /// The stream every copy and event of this device is enqueued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn bind(&self) -> Result<()> {
        self.device.bind_to_thread()
    }

    /// What every host-device copy does first: counts it, refuses NULL pointers, and
    /// binds the context. `Ok(false)`: nothing to copy (`len == 0`).
    fn begin_copy(&self, null_pointer: bool, len: usize, towards: &str) -> Result<bool> {
        self.copies.fetch_add(1, Ordering::Relaxed);
        if len == 0 {
            return Ok(false);
        }
        if null_pointer {
            return Err(CudaError::InvalidArgument(format!(
                "copy of {len} bytes to the {towards} with a NULL pointer"
            )));
        }
        self.bind()?;
        Ok(true)
    }
}

/// Device memory of a [`CudaDevice`]: a [`DeviceBuffer`] seen through
/// [`devarrow_abi::device::DeviceMemory`] (the address is the `CUdeviceptr`).
#[derive(Debug)]
pub struct TransferMemory {
    buffer: DeviceBuffer,
    len: usize,
}

impl TransferMemory {
    /// The underlying device buffer.
    pub fn buffer(&self) -> &DeviceBuffer {
        &self.buffer
    }
}

// SAFETY: the address is the device allocation the value owns (freed in stream order
// on drop), fixed at allocation.
unsafe impl DeviceMemory for TransferMemory {
    fn address(&self) -> *mut c_void {
        self.buffer.device_ptr() as *mut c_void
    }
    fn len(&self) -> usize {
        self.len
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Pinned host staging memory of a [`CudaDevice`], registered (while it lives) in
/// the process-wide registry [`CudaDevice::is_pinned`] answers from.
///
/// Dropped, its buffer goes back to the device's cache (up to 128 MiB per device), and the next [`Device::allocate_staging`] of the same size
/// takes it (zeroed again) instead of allocating: `cuMemHostAlloc` is an implicit
/// synchronization (NVIDIA's programming guide: it orders every stream of the device
/// after the work enqueued before it, other libraries' work included), and
/// `cuMemFreeHost` may block the host until the whole device is idle (AMD documents that
/// for `hipHostFree`; the emulated driver does it), so a new `Transfer` or stream per
/// batch or file must not make them every time. The memory must be unused by pending copies when the value
/// drops, as for any staging memory.
#[derive(Debug)]
pub struct PinnedStaging {
    buffer: Option<PinnedHostBuffer>,
    cache: Arc<StagingCache>,
}

impl PinnedStaging {
    fn new(buffer: PinnedHostBuffer, cache: Arc<StagingCache>) -> Self {
        CUDA_PINNED.register(buffer.as_slice().as_ptr(), buffer.as_slice().len());
        Self {
            buffer: Some(buffer),
            cache,
        }
    }

    /// The underlying pinned buffer.
    pub fn buffer(&self) -> &PinnedHostBuffer {
        self.buffer.as_ref().expect("until dropped")
    }

    fn buffer_mut(&mut self) -> &mut PinnedHostBuffer {
        self.buffer.as_mut().expect("until dropped")
    }
}

impl Drop for PinnedStaging {
    fn drop(&mut self) {
        if let Some(buffer) = self.buffer.take() {
            CUDA_PINNED.unregister(buffer.as_slice().as_ptr());
            self.cache.give_back(buffer);
        }
    }
}

/// At most this many bytes of idle staging memory are kept per [`CudaDevice`] (two
/// `Transfer`s' worth of the default 64 MiB of staging).
const MAX_IDLE_STAGING_BYTES: usize = 128 << 20;

/// The idle staging buffers of a [`CudaDevice`] (see [`PinnedStaging`]): freed when the
/// device and every staging buffer taken from it are gone.
#[derive(Debug, Default)]
struct StagingCache {
    idle: Mutex<Vec<PinnedHostBuffer>>,
}

impl StagingCache {
    /// An idle buffer of exactly `len` bytes, zeroed, if one is kept (the one given back
    /// last).
    fn take(&self, len: usize) -> Option<PinnedHostBuffer> {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let at = idle.iter().rposition(|b| b.len() == len)?;
        let mut buffer = idle.remove(at);
        drop(idle);
        buffer.as_mut_slice().fill(0);
        Some(buffer)
    }

    /// Keeps `buffer` for reuse, freeing (`cuMemFreeHost`) the buffers given back
    /// longest ago beyond [`MAX_IDLE_STAGING_BYTES`] (`buffer` itself when it is larger).
    fn give_back(&self, buffer: PinnedHostBuffer) {
        if buffer.len() == 0 {
            return;
        }
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        idle.push(buffer);
        let mut kept: usize = idle.iter().map(PinnedHostBuffer::len).sum();
        let mut evicted = Vec::new();
        while kept > MAX_IDLE_STAGING_BYTES {
            let oldest = idle.remove(0);
            kept -= oldest.len();
            evicted.push(oldest);
        }
        drop(idle);
        drop(evicted);
    }
}

/// Every live [`PinnedStaging`] of the process. Pinned memory is allocated
/// `CU_MEMHOSTALLOC_PORTABLE`, so any context (any [`CudaDevice`]) can DMA it.
static CUDA_PINNED: PinnedRegistry = PinnedRegistry::new();

/// The memory type (`CU_MEMORYTYPE_*`, 0 when the driver does not know the address)
/// and the buffer id (0 when unknown) of `addr`, in one `cuPointerGetAttributes` call.
/// Unlike `cuPointerGetAttribute`, it answers pageable memory with zeros and
/// `CUDA_SUCCESS`, so asking about ordinary memory raises no driver error (which
/// `compute-sanitizer` would report in every user's run).
fn pointer_type_and_buffer(addr: usize) -> (u32, u64) {
    driver::pointer_memory_type_and_buffer_id(addr).unwrap_or((0, 0))
}

/// Whether the driver reports `first..=last` as inside one page-locked host allocation
/// (`cuMemHostAlloc` or `cuMemHostRegister`, of any library): both ends are
/// `CU_MEMORYTYPE_HOST` with the same nonzero buffer id (one allocation). Pageable memory
/// is not: the driver reports it as unregistered (type 0), HMM systems included. One
/// `cuPointerGetAttributes` per end, which never fails for an address it does not know
/// (`cuMemHostGetFlags`, used before, fails on registered memory: a driver error in
/// normal operation, which compute-sanitizer reports).
fn driver_reports_pinned(first: usize, last: usize) -> bool {
    let host = sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32;
    let (first_type, first_buffer) = pointer_type_and_buffer(first);
    if first_type != host || first_buffer == 0 {
        return false;
    }
    pointer_type_and_buffer(last) == (first_type, first_buffer)
}

// SAFETY: both slices cover the one pinned allocation the value owns, never reallocated.
unsafe impl StagingMemory for PinnedStaging {
    fn as_mut_slice(&mut self) -> &mut [u8] {
        self.buffer_mut().as_mut_slice()
    }
    fn as_slice(&self) -> &[u8] {
        self.buffer().as_slice()
    }
}

/// A `CUevent` recorded on a [`CudaDevice`]'s stream.
///
/// [`SyncEvent::as_sync_event_ptr`] points to a heap copy of the `CUevent` handle that
/// lives (and stays at the same address) as long as this value, and the event itself is
/// destroyed only when this value drops.
#[derive(Debug)]
pub struct CudaSyncEvent {
    /// Where `sync_event` points: the handle, boxed so its address never changes.
    handle: Box<sys::CUevent>,
    /// Always `Some` until dropped (destroyed with its context bound, unless recycled).
    event: Option<Event>,
    /// Where the event goes back to when this value drops (else it is destroyed).
    recycle: Option<Arc<EventPool>>,
}

impl Drop for CudaSyncEvent {
    fn drop(&mut self) {
        let (Some(event), Some(pool)) = (self.event.take(), self.recycle.take()) else {
            return;
        };
        let mut free = pool.free.lock().unwrap_or_else(|e| e.into_inner());
        if free.len() < MAX_IDLE_EVENTS {
            free.push(event);
        }
    }
}

// SAFETY: `handle` is a copy of the CUevent handle owned by `event` (which is Send and
// Sync); CUDA event handles may be used from any thread, and the box is never
// written after construction.
unsafe impl Send for CudaSyncEvent {}
// SAFETY: as above; shared access only reads the handle and calls thread-safe driver
// functions.
unsafe impl Sync for CudaSyncEvent {}

impl CudaSyncEvent {
    /// Records a new event (`CU_EVENT_DISABLE_TIMING`) on `stream`, after all the work
    /// queued there so far.
    pub fn record(stream: &CudaStream) -> Result<Self> {
        let event = Event::create(
            stream.context(),
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as std::ffi::c_uint,
        )?;
        event.record(stream)?;
        Ok(Self {
            handle: Box::new(event.cu_event()),
            event: Some(event),
            recycle: None,
        })
    }

    fn event(&self) -> &Event {
        self.event.as_ref().expect("present until dropped")
    }

    /// Makes `stream` wait (on the GPU, without blocking the host) for this event: work
    /// queued on `stream` afterwards runs after the work before the event.
    pub fn wait_on(&self, stream: &CudaStream) -> Result<()> {
        // SAFETY: the event is live: we own it.
        unsafe { context::stream_wait_event(stream, self.cu_event()) }
    }

    /// The `CUevent` handle (do not destroy it).
    pub fn cu_event(&self) -> sys::CUevent {
        *self.handle
    }

    /// Whether the work before the event has completed (`cuEventQuery`), without waiting.
    pub fn is_complete(&self) -> Result<bool> {
        self.event().is_complete()
    }
}

// SAFETY: `wait_host` is `cuEventSynchronize` on an event recorded after the work; the
// pointer is the boxed `CUevent` handle of the event the value owns.
unsafe impl SyncEvent for CudaSyncEvent {
    fn as_sync_event_ptr(&self) -> *mut c_void {
        (&*self.handle as *const sys::CUevent).cast_mut().cast()
    }
    fn wait_host(&self) -> devarrow_abi::Result<()> {
        self.event().synchronize()?;
        Ok(())
    }
}

// SAFETY: allocations are `cuMemAlloc(Async)` of the size asked for (256-byte aligned),
// staging is pinned memory of at least that size, and every copy and event is enqueued
// on the device's one stream in call order; `is_pinned` asks the driver.
unsafe impl Device for CudaDevice {
    fn device_type(&self) -> ArrowDeviceType {
        ArrowDeviceType::CUDA
    }

    fn device_id(&self) -> i64 {
        self.device.id() as i64
    }

    /// Allocates `len` bytes of device memory, stream-ordered on the device's stream (at
    /// least one byte is allocated, so even an empty allocation has a real device
    /// address; `len()` reports `len`). CUDA allocations are 256-byte aligned.
    fn allocate(&self, len: usize) -> devarrow_abi::Result<Arc<dyn DeviceMemory>> {
        let buffer = DeviceBuffer::alloc(&self.stream, len.max(1))?;
        Ok(Arc::new(TransferMemory { buffer, len }))
    }

    /// The PTX kernels of `kernels/convert.ptx` on the device's stream (see
    /// [`DeviceKernels for CudaDevice`](#impl-DeviceKernels-for-CudaDevice)).
    fn kernels(&self) -> Option<&dyn DeviceKernels> {
        Some(self)
    }

    /// Pinned memory (`cuMemHostAlloc`), zeroed: an idle buffer of `len` bytes from the
    /// device's cache when there is one (see [`PinnedStaging`]), else a new allocation.
    fn allocate_staging(&self, len: usize) -> devarrow_abi::Result<Box<dyn StagingMemory>> {
        let buffer = match self.staging.take(len) {
            Some(buffer) => buffer,
            None => PinnedHostBuffer::alloc(&self.device, len)?,
        };
        Ok(Box::new(PinnedStaging::new(buffer, self.staging.clone())))
    }

    unsafe fn copy_to_device(
        &self,
        src: *const u8,
        dst: *mut c_void,
        len: usize,
    ) -> devarrow_abi::Result<()> {
        if !self.begin_copy(src.is_null() || dst.is_null(), len, "device")? {
            return Ok(());
        }
        // SAFETY: the caller guarantees `src` is readable for `len` bytes until the copy
        // completes and `dst` is device memory of `len` bytes; the stream belongs to the
        // context bound above.
        unsafe {
            driver::memcpy_htod_async(
                dst as sys::CUdeviceptr,
                src.cast(),
                len,
                self.stream.cu_stream(),
            )
        }?;
        Ok(())
    }

    unsafe fn copy_to_host(
        &self,
        src: *const c_void,
        dst: *mut u8,
        len: usize,
    ) -> devarrow_abi::Result<()> {
        if !self.begin_copy(src.is_null() || dst.is_null(), len, "host")? {
            return Ok(());
        }
        // SAFETY: the caller guarantees `dst` is writable for `len` bytes (and not read)
        // until the copy completes and `src` is device memory of `len` bytes; the stream
        // belongs to the context bound above.
        unsafe {
            driver::memcpy_dtoh_async(
                dst.cast(),
                src as sys::CUdeviceptr,
                len,
                self.stream.cu_stream(),
            )
        }?;
        Ok(())
    }

    /// One `cuMemcpyBatchAsync` where [`CudaDeviceOptions::batch_copies`] asks for it
    /// and the driver has it (see there), else one `cuMemcpyHtoDAsync` per copy.
    unsafe fn copy_batch_to_device(&self, copies: &[HostToDevice]) -> devarrow_abi::Result<()> {
        let copies = self.begin_batch(
            copies
                .iter()
                .map(|c| (c.dst as sys::CUdeviceptr, c.src as sys::CUdeviceptr, c.len)),
            "device",
        )?;
        // SAFETY: the caller guarantees every source readable until the copies complete,
        // every destination device memory of its length, none overlapping another; the
        // context is bound (`begin_batch`).
        if unsafe { self.try_batch(&copies, Direction::ToDevice) }? {
            return Ok(());
        }
        for &(dst, src, len) in &copies {
            // SAFETY: as above, copy by copy, on the device's stream.
            unsafe {
                driver::memcpy_htod_async(dst, src as *const c_void, len, self.stream.cu_stream())
            }?;
        }
        Ok(())
    }

    /// As [`CudaDevice::copy_batch_to_device`], the other way (`cuMemcpyDtoHAsync` per
    /// copy where not batched).
    unsafe fn copy_batch_to_host(&self, copies: &[DeviceToHost]) -> devarrow_abi::Result<()> {
        let copies = self.begin_batch(
            copies
                .iter()
                .map(|c| (c.dst as sys::CUdeviceptr, c.src as sys::CUdeviceptr, c.len)),
            "host",
        )?;
        // SAFETY: the caller guarantees every destination writable (and not read) until
        // the copies complete, every source device memory of its length, no destination
        // overlapping another; the context is bound (`begin_batch`).
        if unsafe { self.try_batch(&copies, Direction::ToHost) }? {
            return Ok(());
        }
        for &(dst, src, len) in &copies {
            // SAFETY: as above, copy by copy, on the device's stream.
            unsafe {
                driver::memcpy_dtoh_async(dst as *mut c_void, src, len, self.stream.cu_stream())
            }?;
        }
        Ok(())
    }

    /// One `dvx_batched_copy` launch on the device's stream for all `copies` (cut into
    /// pieces by [`kernels::plan_batched_copy`]). The descriptor table is written to
    /// reused pinned memory, uploaded with `cuMemcpyHtoDAsync` into a stream-ordered
    /// device table (freed in stream order after the kernel): nothing blocks the host,
    /// unless the previous call's upload has not yet run.
    unsafe fn copy_on_device(
        &self,
        copies: &[devarrow_abi::device::DeviceCopy],
    ) -> devarrow_abi::Result<()> {
        let segments: Vec<CopySegment> = copies
            .iter()
            .filter(|c| c.len > 0)
            .map(|c| CopySegment {
                src: c.src as u64,
                dst: c.dst as u64,
                len: c.len as u64,
            })
            .collect();
        if segments.is_empty() {
            return Ok(());
        }
        if segments.iter().any(|s| s.src == 0 || s.dst == 0) {
            return Err(CudaError::InvalidArgument(
                "copy on the device with a NULL pointer".into(),
            )
            .into());
        }
        self.bind()?;
        let pieces = kernels::plan_batched_copy(&self.stream, &segments)?;
        let bytes = std::mem::size_of_val(&pieces[..]);
        let mut staging = self.descriptors.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(event) = staging.uploaded.take() {
            context::sync_event(&event)?;
        }
        // 64 KiB (2,730 descriptors) from the start, doubling past that: regrowing frees
        // and allocates pinned memory, which stalls every stream of the device.
        if staging.buffer.as_ref().is_none_or(|b| b.len() < bytes) {
            staging.buffer = None;
            staging.buffer = Some(PinnedHostBuffer::alloc(
                &self.device,
                bytes.next_power_of_two().max(DESCRIPTOR_STAGING_BYTES),
            )?);
        }
        let host = staging.buffer.as_mut().expect("allocated above");
        for (out, piece) in host.as_mut_slice().chunks_exact_mut(24).zip(&pieces) {
            out[0..8].copy_from_slice(&piece.src.to_ne_bytes());
            out[8..16].copy_from_slice(&piece.dst.to_ne_bytes());
            out[16..24].copy_from_slice(&piece.len.to_ne_bytes());
        }
        let table = DeviceBuffer::alloc(&self.stream, bytes)?;
        // SAFETY: `host` is pinned memory of at least `bytes` bytes that is not written
        // again before the event recorded next has completed (see above); `table` is a
        // fresh device allocation of `bytes` bytes on this stream; the context is bound.
        unsafe {
            driver::memcpy_htod_async(
                table.device_ptr(),
                host.as_slice().as_ptr().cast(),
                bytes,
                self.stream.cu_stream(),
            )
        }?;
        let recorded = self
            .device
            .context()
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .call("cuEventCreate")
            .and_then(|event| {
                event.record(&self.stream).call("cuEventRecord")?;
                Ok(event)
            });
        match recorded {
            Ok(event) => staging.uploaded = Some(event),
            Err(e) => {
                // Without an event the pinned table must not be reused before the upload
                // ran: wait for it here.
                let _ = context::sync_stream(&self.stream);
                return Err(e.into());
            }
        }
        drop(staging);
        // SAFETY: the table holds `pieces.len()` descriptors (uploaded before the launch
        // in stream order) and is freed in stream order after it (dropped below); the
        // ranges are the caller's guarantee.
        unsafe {
            kernels::launch_batched_copy(&self.stream, table.device_ptr(), pieces.len() as u64)
        }?;
        drop(table);
        Ok(())
    }

    /// One `cuMemcpyPeerAsync` on the device's stream from another CUDA device's memory
    /// (`cuMemcpyAsync` from this device's own), where `cuDeviceCanAccessPeer` says this
    /// device can access the peer's memory; the first copy between two contexts enables
    /// peer access from this device's context to the source memory's (its
    /// `CU_POINTER_ATTRIBUTE_CONTEXT`), remembered for the process per pair of contexts.
    /// `Ok(false)` for a peer without access, or a device of another type: the caller
    /// stages the copy.
    unsafe fn copy_from_peer(
        &self,
        from: &dyn Device,
        src: *const c_void,
        dst: *mut c_void,
        len: usize,
    ) -> devarrow_abi::Result<bool> {
        if from.device_type() != ArrowDeviceType::CUDA {
            return Ok(false);
        }
        if len == 0 {
            return Ok(true);
        }
        if src.is_null() || dst.is_null() {
            return Err(CudaError::InvalidArgument(format!(
                "peer copy of {len} bytes with a NULL pointer"
            ))
            .into());
        }
        self.bind()?;
        let stream = self.stream.cu_stream();
        let peer = from.device_id();
        if peer == self.device_id() {
            // SAFETY: the caller guarantees both ranges, device memory of this device,
            // until the copy completes; the stream belongs to the context bound above.
            unsafe {
                driver::memcpy_async(
                    dst as sys::CUdeviceptr,
                    src as sys::CUdeviceptr,
                    len,
                    stream,
                )
            }?;
            return Ok(true);
        }
        let src_ctx = driver::pointer_context(src as usize)?;
        let pair = (
            driver::ctx_get_id(self.device.cu_context())?,
            driver::ctx_get_id(src_ctx)?,
        );
        let mut peers = PEER_ACCESS.lock().unwrap_or_else(|e| e.into_inner());
        let known = peers
            .get_or_insert_with(Default::default)
            .get(&pair)
            .copied();
        let direct = match known {
            Some(direct) => direct,
            None => {
                let own = driver::device_get(self.device.id() as i32)?;
                let other = driver::device_get(
                    i32::try_from(peer)
                        .map_err(|_| CudaError::InvalidArgument(format!("device id {peer}")))?,
                )?;
                let can = driver::device_can_access_peer(own, other)?;
                if can {
                    // SAFETY: `src_ctx` owns live memory (the source), so it is live; our
                    // context is current (bound above).
                    unsafe { driver::ctx_enable_peer_access(src_ctx) }?;
                }
                peers.get_or_insert_with(Default::default).insert(pair, can);
                can
            }
        };
        drop(peers);
        if !direct {
            return Ok(false);
        }
        // SAFETY: the caller guarantees `src` (memory of `src_ctx`) readable and `dst`
        // (memory of our context) writable for `len` bytes until the copy completes; the
        // stream belongs to our context, bound above.
        unsafe {
            driver::memcpy_peer_async(
                dst as sys::CUdeviceptr,
                self.device.cu_context(),
                src as sys::CUdeviceptr,
                src_ctx,
                len,
                stream,
            )
        }?;
        Ok(true)
    }

    /// [`CudaDevice::open`] of `device_id` with this device's options.
    fn peer_device(&self, device_id: i64) -> devarrow_abi::Result<Option<Arc<dyn Device>>> {
        let id = usize::try_from(device_id).map_err(|_| {
            CudaError::InvalidArgument(format!("no CUDA device has the id {device_id}"))
        })?;
        let device = CudaDevice::open(id)?.with_options(self.options);
        Ok(Some(Arc::new(device)))
    }

    fn record_event(&self) -> devarrow_abi::Result<Arc<dyn SyncEvent>> {
        let pooled = if self.options.reuse_events {
            self.events
                .free
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .pop()
        } else {
            None
        };
        let event = match pooled {
            Some(event) => event,
            None => {
                self.events.created.fetch_add(1, Ordering::Relaxed);
                // The event is made in devarrow's own `CudaContext` value of the primary
                // context (the stream's may be the caller's, with its own stored errors).
                Event::create(self.device.context(), self.options.event_flags())?
            }
        };
        event.record(&self.stream)?;
        Ok(Arc::new(CudaSyncEvent {
            handle: Box::new(event.cu_event()),
            event: Some(event),
            recycle: self.options.reuse_events.then(|| self.events.clone()),
        }))
    }

    unsafe fn wait_sync_event(&self, sync_event: *mut c_void) -> devarrow_abi::Result<()> {
        if sync_event.is_null() {
            return Ok(());
        }
        // SAFETY: the caller guarantees a non-NULL `sync_event` points to a live CUevent
        // (the C Device interface's `CUevent*` for ARROW_DEVICE_CUDA).
        let event = unsafe { *sync_event.cast::<sys::CUevent>() };
        // SAFETY: the event is live (see above); waiting enqueues a dependency on our
        // stream and does not block the host.
        unsafe { context::stream_wait_event(&self.stream, event) }?;
        Ok(())
    }

    fn synchronize(&self) -> devarrow_abi::Result<()> {
        context::sync_stream(&self.stream)?;
        Ok(())
    }

    fn copy_count(&self) -> u64 {
        self.copies.load(Ordering::Relaxed)
    }

    /// [`CudaDeviceOptions::register_pageable`], unless the driver said registering is
    /// not supported here.
    fn host_registration_min_bytes(&self) -> Option<usize> {
        self.options
            .register_pageable
            .filter(|_| !self.registration_unsupported.load(Ordering::Relaxed))
    }

    /// Registers the whole pages inside the range
    /// ([`whole_pages`](devarrow_abi::device::whole_pages): `cuMemHostRegister`,
    /// portable), or takes one more use of devarrow's registration
    /// that holds them (see [`crate::HostRegistration`]), when
    /// [`CudaDeviceOptions::register_pageable`] asks for ranges this large. `Ok(None)` for
    /// ranges below it or holding no whole page, devarrow's own staging memory (pinned
    /// already), pages partly shared with a registration of devarrow that does not hold
    /// them, pages whose first or last the driver reports
    /// page-locked (by someone else: used as it is, not asked to register), and ranges
    /// the driver refuses to lock: locked by someone else in between
    /// (`CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`, used as it is), not lockable
    /// (`CUDA_ERROR_INVALID_VALUE`: a read-only mapping, say), beyond the memlock limit
    /// (`CUDA_ERROR_OUT_OF_MEMORY`), or any other error that leaves the context usable
    /// (not [sticky](crate::is_sticky_error), nor saying the context is gone:
    /// `CUDA_ERROR_NOT_SUPPORTED`, and the `CUDA_ERROR_OPERATING_SYSTEM` or
    /// `CUDA_ERROR_NOT_PERMITTED` of restricted runtimes; then never tried again on this
    /// device). A sticky error, or one saying the context is gone, is returned
    /// ([`CudaError::Driver`]).
    unsafe fn register_host(
        &self,
        ptr: *const u8,
        len: usize,
    ) -> devarrow_abi::Result<Option<Box<dyn HostRegistration>>> {
        let Some(min) = self.host_registration_min_bytes() else {
            return Ok(None);
        };
        if len == 0 || len < min || ptr.is_null() || CUDA_PINNED.contains(ptr, len) {
            return Ok(None);
        }
        self.bind()?;
        // Memory the driver reports page-locked at either end is someone else's (devarrow's
        // own registrations are found in its table first): not asked to register.
        let host = sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32;
        let locked = |first: usize, last: usize| {
            pointer_type_and_buffer(first).0 == host || pointer_type_and_buffer(last).0 == host
        };
        // SAFETY: the caller guarantees the range stays allocated until the registration
        // drops, and drops it only after the copies using it have completed; the context
        // is bound.
        match unsafe { host_register::register(self.device.context(), ptr, len, locked) } {
            Ok(Registered::Yes(registration, new)) => {
                if new {
                    self.ranges_registered.fetch_add(1, Ordering::Relaxed);
                }
                Ok(Some(Box::new(registration)))
            }
            Ok(Registered::Skipped) => Ok(None),
            Err(e) => {
                use sys::CUresult::*;
                match e.driver_result() {
                    Some(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED) => Ok(None),
                    // About this range: others may still lock.
                    Some(CUDA_ERROR_INVALID_VALUE | CUDA_ERROR_OUT_OF_MEMORY) => {
                        self.registrations_refused.fetch_add(1, Ordering::Relaxed);
                        Ok(None)
                    }
                    // About the device or the runtime: not asked again.
                    _ if e.allows_fallback() => {
                        self.registration_unsupported.store(true, Ordering::Relaxed);
                        self.registrations_refused.fetch_add(1, Ordering::Relaxed);
                        Ok(None)
                    }
                    _ => Err(e.into()),
                }
            }
        }
    }

    /// `true` for ranges inside one live staging allocation of any `CudaDevice`
    /// (a registry lookup, no driver call); `false` for ranges reaching into pages
    /// devarrow registered ([`CudaDeviceOptions::register_pageable`]); otherwise asks the
    /// driver whether the first
    /// and the last byte lie in one `cuMemHostAlloc`ed allocation (`cuPointerGetAttributes`
    /// memory type and buffer id, `cuMemHostGetFlags`), which also finds memory other
    /// libraries pinned. Any doubt (a failed query) answers `false`.
    fn is_pinned(&self, ptr: *const u8, len: usize) -> bool {
        if CUDA_PINNED.contains(ptr, len) {
            return true;
        }
        // Pages devarrow registered for a transfer are unregistered when its copies are
        // done: a copy from them must take a use of the registration
        // (`register_host`), not rely on it.
        if len == 0 || ptr.is_null() || host_register::overlaps_registered(ptr, len) {
            return false;
        }
        if self.bind().is_err() {
            return false;
        }
        let first = ptr as usize;
        first
            .checked_add(len - 1)
            .is_some_and(|last| driver_reports_pinned(first, last))
    }
}

/// Refuses an address that is not a multiple of `align` (kernels load and store their
/// elements at natural alignment; a misaligned access would be a sticky fault).
fn check_aligned(what: &str, address: u64, align: u64) -> Result<()> {
    if !address.is_multiple_of(align) {
        return Err(CudaError::InvalidArgument(format!(
            "{what} at {address:#x} is not {align}-byte aligned"
        )));
    }
    Ok(())
}

/// Checks the alignment of row integers (address and stride, by their width) and gives
/// `(address, stride, wide)`.
fn row_integers(what: &str, rows: RowIntegers) -> Result<(u64, u64, bool)> {
    let width = if rows.wide { 8 } else { 4 };
    check_aligned(what, rows.address as u64, width)?;
    if !rows.stride.is_multiple_of(width) {
        return Err(CudaError::InvalidArgument(format!(
            "{what}: a stride of {} bytes for {width}-byte integers",
            rows.stride
        )));
    }
    Ok((rows.address as u64, rows.stride, rows.wide))
}

// SAFETY: each method enqueues on the device's stream the kernels of
// `kernels/convert.ptx` (`count_set_bits`: validity.ptx's, `gather_view_bytes`:
// copy.ptx's batched copy after convert.ptx's descriptors) that do what its documentation
// says (checked against `CpuKernels` in tests/ptx_kernels.rs and tests/gpu.rs), reading
// and writing only the ranges it names plus temporary buffers of their own (freed in
// stream order). Misaligned addresses (past the natural alignment of each element) and
// unsupported widths are refused with an error before anything is enqueued.
unsafe impl DeviceKernels for CudaDevice {
    unsafe fn row_sizes(
        &self,
        sizes: RowIntegers,
        validity: Validity,
        n: u64,
        out: *mut c_void,
    ) -> devarrow_abi::Result<()> {
        let (src, stride, wide) = if n > 0 {
            row_integers("row sizes", sizes)?
        } else {
            (0, 0, false)
        };
        check_aligned("row sizes output", out as u64, 8)?;
        self.bind()?;
        // SAFETY: the ranges are the caller's guarantee, the alignment checked above.
        unsafe {
            kernels::launch_row_sizes(
                &self.stream,
                src,
                stride,
                wide,
                validity.address as u64,
                validity.bit_offset,
                n,
                out as u64,
            )
        }?;
        Ok(())
    }

    unsafe fn inclusive_scan_i64(&self, data: *mut c_void, n: u64) -> devarrow_abi::Result<()> {
        if n == 0 {
            return Ok(());
        }
        check_aligned("scan data", data as u64, 8)?;
        self.bind()?;
        // SAFETY: the caller's guarantee, the alignment checked above.
        unsafe { kernels::inclusive_scan_i64(&self.stream, data as u64, n) }?;
        Ok(())
    }

    unsafe fn gather_view_bytes(
        &self,
        views: *const c_void,
        validity: Validity,
        n: u64,
        buffers: *const c_void,
        offsets: *const c_void,
        out: *mut c_void,
    ) -> devarrow_abi::Result<()> {
        if n == 0 {
            return Ok(());
        }
        check_aligned("views", views as u64, 4)?;
        check_aligned("offsets", offsets as u64, 8)?;
        self.bind()?;
        let bytes = n
            .checked_mul(24)
            .ok_or_else(|| CudaError::InvalidArgument(format!("{n} views overflow")))?;
        let table = DeviceBuffer::alloc(&self.stream, bytes as usize)?;
        // `table` holds `n` descriptors (256-byte aligned) and is freed in stream order
        // after the copy (dropped below); the other ranges are the caller's guarantee.
        // The descriptors' sources are the views' bytes (inline ones: the view's own
        // address + 4; others inside the caller's buffers) and their destinations the
        // disjoint ranges `out[offsets[i]..offsets[i] + len]`.
        // SAFETY: the ranges just described, for every call of the block.
        unsafe {
            kernels::launch_view_segments(
                &self.stream,
                views as u64,
                validity.address as u64,
                validity.bit_offset,
                n,
                buffers as u64,
                offsets as u64,
                out as u64,
                table.device_ptr(),
            )?;
            // at most 2^31 - 1 descriptors per launch
            const MAX: u64 = (1 << 31) - 1;
            let mut first = 0;
            while first < n {
                let count = (n - first).min(MAX);
                kernels::launch_batched_copy(&self.stream, table.device_ptr() + first * 24, count)?;
                first += count;
            }
        }
        drop(table);
        Ok(())
    }

    unsafe fn narrow_i64_to_i32(
        &self,
        src: *const c_void,
        n: u64,
        dst: *mut c_void,
    ) -> devarrow_abi::Result<()> {
        if n == 0 {
            return Ok(());
        }
        check_aligned("int64 source", src as u64, 8)?;
        check_aligned("int32 destination", dst as u64, 4)?;
        self.bind()?;
        // SAFETY: the caller's guarantee, the alignment checked above.
        unsafe { kernels::launch_narrow_i64_i32(&self.stream, src as u64, n, dst as u64) }?;
        Ok(())
    }

    unsafe fn widen_decimals(
        &self,
        src: *const c_void,
        width: u64,
        n: u64,
        dst: *mut c_void,
    ) -> devarrow_abi::Result<()> {
        if n == 0 {
            return Ok(());
        }
        if width != 4 && width != 8 {
            return Err(CudaError::InvalidArgument(format!(
                "decimals of {width} bytes; 4 or 8 are widened"
            ))
            .into());
        }
        check_aligned("decimal source", src as u64, width)?;
        check_aligned("decimal128 destination", dst as u64, 8)?;
        self.bind()?;
        // SAFETY: the caller's guarantee, width and alignment checked above.
        unsafe { kernels::launch_widen_decimals(&self.stream, src as u64, width, n, dst as u64) }?;
        Ok(())
    }

    unsafe fn fill_offsets_i32(
        &self,
        dst: *mut c_void,
        n: u64,
        step: u32,
    ) -> devarrow_abi::Result<()> {
        if n == 0 {
            return Ok(());
        }
        check_aligned("int32 offsets", dst as u64, 4)?;
        self.bind()?;
        // SAFETY: the caller's guarantee, the alignment checked above.
        unsafe { kernels::launch_fill_offsets_i32(&self.stream, dst as u64, n, step) }?;
        Ok(())
    }

    unsafe fn compare_list_offsets(
        &self,
        offsets: RowIntegers,
        n: u64,
        expected: *const c_void,
        mismatch: *mut c_void,
    ) -> devarrow_abi::Result<()> {
        if n == 0 {
            return Ok(());
        }
        let (address, stride, wide) = row_integers("list offsets", offsets)?;
        check_aligned("expected offsets", expected as u64, 8)?;
        check_aligned("mismatch flag", mismatch as u64, 4)?;
        self.bind()?;
        // SAFETY: the caller's guarantee, the alignment checked above.
        unsafe {
            kernels::launch_compare_list_offsets(
                &self.stream,
                address,
                stride,
                wide,
                n,
                expected as u64,
                mismatch as u64,
            )
        }?;
        Ok(())
    }

    unsafe fn gather_list_values(
        &self,
        child: *const c_void,
        width: u64,
        child_offset: u64,
        offsets: RowIntegers,
        n: u64,
        new_offsets: *const c_void,
        dst: *mut c_void,
    ) -> devarrow_abi::Result<()> {
        let (address, stride, wide) = if n > 0 {
            row_integers("list offsets", offsets)?
        } else {
            (0, 0, false)
        };
        check_aligned("new offsets", new_offsets as u64, 8)?;
        self.bind()?;
        // SAFETY: the caller's guarantee, the alignment checked above (values move in
        // units the kernel picks from the addresses and the width).
        unsafe {
            kernels::launch_gather_list_values(
                &self.stream,
                child as u64,
                width,
                child_offset,
                address,
                stride,
                wide,
                n,
                new_offsets as u64,
                dst as u64,
            )
        }?;
        Ok(())
    }

    unsafe fn gather_list_bits(
        &self,
        bits: *const c_void,
        bit_offset: u64,
        offsets: RowIntegers,
        n: u64,
        new_offsets: *const c_void,
        dst: *mut c_void,
    ) -> devarrow_abi::Result<()> {
        let (address, stride, wide) = if n > 0 {
            row_integers("list offsets", offsets)?
        } else {
            (0, 0, false)
        };
        check_aligned("new offsets", new_offsets as u64, 8)?;
        check_aligned("bit gather destination", dst as u64, 4)?;
        self.bind()?;
        // SAFETY: the caller's guarantee, the alignment checked above.
        unsafe {
            kernels::launch_gather_list_bits(
                &self.stream,
                bits as u64,
                bit_offset,
                address,
                stride,
                wide,
                n,
                new_offsets as u64,
                dst as u64,
            )
        }?;
        Ok(())
    }

    unsafe fn offsets_to_views(
        &self,
        offsets: RowIntegers,
        data: *const c_void,
        indices: *const c_void,
        n: u64,
        views: *mut c_void,
    ) -> devarrow_abi::Result<()> {
        let (address, stride, wide) = if n > 0 {
            row_integers("offsets", offsets)?
        } else {
            (0, 0, false)
        };
        check_aligned("indices", indices as u64, 4)?;
        check_aligned("views", views as u64, 16)?;
        self.bind()?;
        // SAFETY: the caller's guarantee, the alignment checked above.
        unsafe {
            kernels::launch_offsets_to_views(
                &self.stream,
                address,
                stride,
                wide,
                data as u64,
                indices as u64,
                n,
                views as u64,
            )
        }?;
        Ok(())
    }

    unsafe fn count_set_bits(
        &self,
        bitmap: *const c_void,
        bit_offset: u64,
        len: u64,
        out: *mut c_void,
    ) -> devarrow_abi::Result<()> {
        check_aligned("bit count", out as u64, 8)?;
        self.bind()?;
        // dvx_count_set_bits adds to the counter: zero it first, in stream order.
        // SAFETY: `out` is writable for 8 bytes (the caller's guarantee).
        unsafe { driver::memset_d8_async(out as u64, 0, 8, self.stream.cu_stream()) }?;
        // SAFETY: the caller's guarantee, the alignment checked above.
        unsafe {
            kernels::launch_count_set_bits(&self.stream, bitmap as u64, bit_offset, len, out as u64)
        }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_without_a_gpu_is_a_typed_error_not_a_panic() {
        match CudaDevice::open(0) {
            Ok(dev) => {
                assert_eq!(dev.device_type(), ArrowDeviceType::CUDA);
                assert_eq!(dev.device_id(), 0);
                assert_eq!(dev.copy_count(), 0);
            }
            Err(e) => {
                assert!(
                    matches!(e, CudaError::NoDriver | CudaError::NoDevice),
                    "unexpected error {e:?}"
                );
                if !crate::driver_available() {
                    assert!(matches!(e, CudaError::NoDriver), "{e:?}");
                }
                let abi: devarrow_abi::Error = e.into();
                assert!(
                    matches!(abi, devarrow_abi::Error::Device { device: "CUDA", .. }),
                    "{abi:?}"
                );
            }
        }
        match CudaDevice::open(usize::MAX / 2) {
            Ok(_) => panic!("an out-of-range device id opened"),
            Err(e) => assert!(
                matches!(
                    e,
                    CudaError::NoDriver | CudaError::NoDevice | CudaError::InvalidDeviceId { .. }
                ),
                "unexpected error {e:?}"
            ),
        }
    }

    #[test]
    fn the_device_is_usable_as_a_trait_object() {
        fn assert_device<T: Device + 'static>() {}
        assert_device::<CudaDevice>();
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<CudaSyncEvent>();
        assert_send_sync::<TransferMemory>();
    }
}
