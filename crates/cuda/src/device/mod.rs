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
//!
//! Files: this one (`CudaDevice`, its options and its own methods; its pool policy and
//! copy count), `copies.rs` (`impl Device`: allocations, staging, copies, events;
//! [`TransferMemory`], [`PinnedStaging`]), which delegates to `batch.rs` (lists of copies
//! in one `cuMemcpyBatchAsync`), `on_device.rs` (copies on the device, `dvx_batched_copy`)
//! and `peer.rs` (copies from a peer device); `streams.rs` (ordering the device's stream
//! with other streams), `kernels.rs` (`impl DeviceKernels`) and `event.rs`
//! ([`CudaSyncEvent`]), as `devarrow_abi`'s `device/` is split.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaEvent, CudaStream};
use devarrow_abi::device::{CopyCounter, MemoryPoolPolicy};

use crate::context::{self, ContextGuard, DropInContext};
use crate::driver;
use crate::error::{CudaError, Result};
use crate::memory::PinnedHostBuffer;
use crate::primary_context::PrimaryContext;

mod arena;
mod batch;
mod copies;
pub(crate) mod event;
mod kernels;
mod on_device;
mod peer;
mod streams;

use arena::PinnedArena;
pub use arena::{PinnedStats, DEFAULT_PINNED_RESERVE_BYTES};
pub use copies::{PinnedStaging, TransferMemory};
pub use event::CudaSyncEvent;
use event::EventPool;

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
/// use devarrow_abi::device::{CopyCounter, Device};
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
///
/// [`Device`]: devarrow_abi::device::Device
pub struct CudaDevice {
    device: PrimaryContext,
    stream: DropInContext<Arc<CudaStream>>,
    copies: AtomicU64,
    descriptors: Mutex<DescriptorStaging>,
    /// The pinned memory of the device's context that staging and download blocks are
    /// handed out from ([`CudaDevice::reserve_pinned`]).
    pinned: Arc<PinnedArena>,
    /// Staging handed out as pageable memory: the reserved pinned memory had no room.
    pageable_staging: AtomicU64,
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
///
/// ```
/// use devarrow_cuda::{CudaDeviceOptions, HostWait};
///
/// // Building options needs no GPU; `CudaDevice::with_options` applies them.
/// let options = CudaDeviceOptions::default()
///     .host_wait(HostWait::Block)
///     .register_pageable(Some(4 << 20))
///     .batch_copies(false);
/// assert_eq!(options.host_wait, HostWait::Block);
/// assert_eq!(options.register_pageable, Some(4 << 20));
/// assert!(!options.batch_copies);
/// ```
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
    /// **On by default**, on one run's evidence, which does not decide it: the only GPU
    /// run (an NVIDIA H200, 2026-11-28, at `9615f3d`, when it was off by default;
    /// `docs/gpu-results.md`) ran the main job with it once. Against that run's defaults
    /// it gained 40% device to host at 64K rows and 14% at 1M rows (13-14% host to
    /// device), but the same command with the defaults again (the chart step) was faster
    /// device to host at 1M rows (10.77 against 10.34 GB/s): the gains are of the size of
    /// the run-to-run spread, and whether that driver has `cuMemcpyBatchAsync` at all is
    /// not in its logs. Nothing since has run on a GPU. Off where the driver lacks the
    /// call, as above.
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

/// The descriptors a table of [`Device::copy_on_device`] holds at least (64 KiB), where
/// the kernels could not say how many warps are resident.
const MIN_DESCRIPTORS: usize = 2730;

/// The pinned host memory the descriptor tables of [`Device::copy_on_device`] are
/// uploaded from: [`DescriptorStaging::SLOTS`] slots of `capacity` descriptors each,
/// allocated when the device is made and never regrown (a plan of more descriptors is
/// launched in several tables), and the event after each slot's last upload: a slot is
/// overwritten only once that upload has completed.
struct DescriptorStaging {
    buffer: Option<PinnedHostBuffer>,
    /// Descriptors per slot: one wave of `dvx_batched_copy`'s resident warps, the most
    /// pieces a plan of up to a quarter that many segments has.
    capacity: usize,
    /// The slot the next table goes to.
    next: usize,
    uploaded: [Option<CudaEvent>; DescriptorStaging::SLOTS],
}

impl DescriptorStaging {
    /// Two slots: a call's table is written while the previous call's may still be
    /// waiting to upload behind other work of the stream.
    const SLOTS: usize = 2;
}

impl Drop for DescriptorStaging {
    fn drop(&mut self) {
        // The last uploads may still read the pinned buffer: let them finish first.
        for event in self.uploaded.iter_mut().filter_map(Option::take) {
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
        // devarrow's kernels, loaded now (once per context) rather than by the first
        // launch: with lazy loading, the driver's default since CUDA 12.2, loading a
        // kernel "might require context synchronization" (CUDA C++ Programming Guide,
        // "Lazy Loading", "Potential Hazards"), which in the middle of a pipeline would
        // wait for another library's work. Where it fails, the first launch loads them
        // and reports the error.
        let kernels = crate::kernels::Kernels::for_context(device.context()).ok();
        // The descriptor tables' pinned memory, allocated now rather than by the first
        // copy on the device (an import, a download of an imported batch): that
        // `cuMemHostAlloc` orders every stream of the device after the work enqueued
        // before it (an implicit synchronization), which at open is normally nothing,
        // and in the middle of a pipeline another library's work. Sized for one wave
        // of the copy kernel's resident warps per table, the most pieces a plan has
        // unless it copies more segments than a quarter of that: such plans take
        // several tables, so it never regrows. Where it fails, the first copy allocates
        // it.
        let capacity = kernels
            .as_ref()
            .map_or(MIN_DESCRIPTORS, |k| k.batched_copy_warps() as usize)
            .max(MIN_DESCRIPTORS);
        let descriptors = DescriptorStaging {
            buffer: PinnedHostBuffer::alloc(
                &device,
                DescriptorStaging::SLOTS
                    * capacity
                    * std::mem::size_of::<crate::kernels::CopySegment>(),
            )
            .ok(),
            capacity,
            next: 0,
            uploaded: [None, None],
        };
        // The context's pinned memory for staging and downloads: reserved now when no
        // other `CudaDevice` of the context holds it (see `arena.rs`).
        let pinned = PinnedArena::for_context(&device);
        Self {
            device,
            stream: DropInContext::new(stream),
            copies: AtomicU64::new(0),
            descriptors: Mutex::new(descriptors),
            pinned,
            pageable_staging: AtomicU64::new(0),
            options: CudaDeviceOptions::default(),
            events: Arc::default(),
            batch_copy: AtomicU8::new(BATCH_UNKNOWN),
            batched_calls: AtomicU64::new(0),
            registration_unsupported: AtomicBool::new(false),
            ranges_registered: AtomicU64::new(0),
            registrations_refused: AtomicU64::new(0),
        }
    }

    /// An explicit warm-up: makes sure the pinned memory of the device's context (which
    /// every `CudaDevice` of the context shares) has a free range of at least `bytes`,
    /// allocating a slab of that size where it has not (`cuMemHostAlloc`, zeroed once).
    /// Returns the bytes allocated (0: it had room).
    ///
    /// Staging ([`Device::allocate_staging`](devarrow_abi::device::Device::allocate_staging)) and the pinned blocks downloads land in
    /// (`devarrow_bridge`'s `TransferOptions::pinned_host_bytes`) are handed out from
    /// that memory with no driver call, and given back to it with none; the first
    /// `CudaDevice` of a context reserves [`DEFAULT_PINNED_RESERVE_BYTES`], and nothing
    /// else ever allocates pinned memory for them: beyond the reserve, staging is pageable
    /// memory and downloads land in pageable memory. Allocating pinned memory is an
    /// implicit synchronization of the device (work enqueued afterwards on any stream
    /// waits for all work enqueued before, other libraries' included): call this at
    /// set-up (devarrow_bridge's `Transfer::prepare` does, for its staging).
    pub fn reserve_pinned(&self, bytes: usize) -> Result<usize> {
        self.pinned.reserve(bytes)
    }

    /// An explicit trim: gives back to the driver (`cuMemFreeHost`, which may wait for
    /// the whole device) every slab of the context's pinned memory that no block is
    /// taken from, the one reserved at open included; returns the bytes freed. Without
    /// it, the slabs are freed when the last `CudaDevice` of the context and the last
    /// block taken from them are gone.
    pub fn trim_pinned(&self) -> usize {
        self.pinned.trim()
    }

    /// How much pinned memory the device's context holds for staging and downloads,
    /// and how much of it is in use ([`CudaDevice::reserve_pinned`]).
    pub fn pinned_stats(&self) -> PinnedStats {
        self.pinned.stats()
    }

    /// How many staging allocations this device handed out as pageable memory because
    /// the reserved pinned memory had no room for them
    /// ([`CudaDevice::reserve_pinned`]).
    pub fn pageable_staging(&self) -> u64 {
        self.pageable_staging.load(Ordering::Relaxed)
    }

    /// Descriptors per table of [`Device::copy_on_device`](devarrow_abi::device::Device::copy_on_device) (one kernel launch each):
    /// about one wave of the copy kernel's resident warps, fixed when the device was made.
    pub fn descriptors_per_table(&self) -> usize {
        self.descriptors
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .capacity
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

impl CopyCounter for CudaDevice {
    fn copy_count(&self) -> u64 {
        self.copies.load(Ordering::Relaxed)
    }
}

impl MemoryPoolPolicy for CudaDevice {
    /// The release threshold of devarrow's pool of the device
    /// ([`crate::pool::set_policy`]), for every handle on the device.
    fn retain_freed_memory(&self, bytes: Option<usize>) -> devarrow_abi::Result<()> {
        let device = self.primary_context();
        if !device.supports_memory_pools() {
            return Ok(());
        }
        self.bind()?;
        let ctx = device.context();
        let mut policy = crate::pool::policy(ctx.ordinal());
        policy.release_threshold = bytes.map(|b| b as u64);
        crate::pool::set_policy(ctx, policy)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use devarrow_abi::device::{CopyCounter, Device};
    use devarrow_abi::ArrowDeviceType;

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
