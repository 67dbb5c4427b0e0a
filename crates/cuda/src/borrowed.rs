//! [`BorrowedSlice`]: device memory that someone else owns (a device-resident batch's
//! buffer), seen as a cudarc [`CudaSlice`] / [`CudaView`] on a caller's stream, for the
//! caller's own kernels and copies.
//!
//! The soundness argument is on the type.

use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::ops::{Deref, RangeBounds};
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaSlice, CudaStream, CudaView, LaunchArgs, PushKernelArg};

use crate::context::{self, ContextGuard};
use crate::device::event::CudaSyncEvent;
use crate::error::{CudaError, Result};
use crate::native::DeviceNative;

/// What orders the release of borrowed memory after the last use of a view: called once,
/// when the view drops, with an event recorded after every use enqueued on the view's
/// stream. `Err`: the release could not be ordered; the drop then waits on the host.
pub type AfterUse<'a> = Box<dyn FnOnce(CudaSyncEvent) -> Result<()> + Send + 'a>;

/// Device memory owned by someone else, borrowed for `'a` and seen as a cudarc
/// [`CudaSlice<T>`] (read only) of a caller's stream: pass it to kernels
/// (`launch_builder(..).arg(&view)`), copy from it (`stream.memcpy_dtov(&*view)`), take
/// sub-views ([`BorrowedSlice::slice`]).
///
/// Made by `devarrow-bridge` for the buffers of a device-resident batch
/// (`ColumnBuffer::cuda_view`, `DeviceColumn::cuda_values`). Dropping it never frees the
/// memory; it orders the owner's eventual release after the work the caller enqueued on
/// the view's stream.
///
/// Use it on its stream ([`BorrowedSlice::stream`]): the data is ready there, and the
/// owner waits for the work there. Work on other streams is covered only through
/// cudarc's event tracking (when enabled on the stream's `CudaContext`, cudarc's
/// default); without it, order such work before the view drops (e.g. make the view's
/// stream wait on it).
///
/// # Why a view never frees
///
/// cudarc has no public constructor of a [`CudaView`] over an address: views borrow a
/// [`CudaSlice`], and a `CudaSlice` frees its memory when dropped. A `BorrowedSlice`
/// therefore holds a `CudaSlice` made with cudarc's
/// [`CudaStream::upgrade_device_ptr`] inside a [`ManuallyDrop`], and its `Drop` gives the
/// slice up with [`CudaSlice::leak`] instead of dropping it: `leak` frees nothing (it
/// releases the slice's events and its stream reference, and returns the address). The
/// slice is never handed out by value: only `&CudaSlice<T>` (through `Deref`) and views
/// that borrow it, so no other code can drop it, leak it, or swap it for another one
/// (that would need `&mut`).
///
/// # Why the memory outlives every use
///
/// - While the `BorrowedSlice` lives, the owner's memory is kept alive by a borrow (the
///   lifetime `'a`, e.g. of a `DeviceBatch`): the owner cannot be dropped.
/// - Work that uses the view is asynchronous and may outlive the view. When the view
///   drops, an event is recorded on its stream after every use enqueued there (and,
///   where cudarc's event tracking is on, `leak` first makes the stream wait for the
///   uses cudarc recorded on other streams), and handed to the owner's `after_use`
///   callback, which orders the release of the memory after it (the stream that will
///   free the memory waits on the event; or the owner waits for it before releasing a
///   foreign array). If no event can be recorded, or the callback cannot order the
///   release, the drop blocks the host until the stream's work is done instead.
/// - Before the first use, the stream waits (on the GPU) for the event that marks the
///   memory as written (`ready`).
/// - Memory its owner writes and frees in order on the view's own stream
///   ([`BorrowedSlice::in_stream_order`]) needs neither event: stream order puts the
///   view's uses after the writes and the free after the uses.
///
/// # Example
///
/// Someone's buffer (a [`DeviceBuffer`](crate::DeviceBuffer) written, and freed, in order
/// on the device's stream) read on the caller's own stream through cudarc: the caller's
/// stream waits for the write (`ready`), and the owner's stream for the caller's reads
/// (`after_use`) before the free. `devarrow-bridge` makes such views of a device batch's
/// columns (`DeviceColumn::cuda_values`), so most callers never call `new` themselves.
///
/// ```
/// use devarrow_cuda::{BorrowedSlice, CudaDevice, CudaError, CudaMemory, CudaSyncEvent, DeviceBuffer};
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
/// // The owner's memory and stream.
/// let owner_stream = device.stream().clone();
/// let owner = DeviceBuffer::from_host(&owner_stream, &[10i32, 20, 30, 40])?;
/// let written = CudaSyncEvent::record(&owner_stream)?;
///
/// // The caller's stream, and the view on it.
/// let stream = device.primary_context().new_stream()?;
/// let after_use = Box::new(move |used: CudaSyncEvent| used.wait_on(&owner_stream));
/// // SAFETY: `owner` holds 4 `i32`s (256-byte aligned) of the device's context, not
/// // written while the view lives and dropped after it; its free, in order on
/// // `owner_stream`, waits for the event `after_use` gets; `written` is a live event.
/// let view = unsafe {
///     BorrowedSlice::<i32>::new(&stream, owner.device_ptr(), 4, Some(written.cu_event()), after_use)
/// }?;
///
/// // cudarc's copies and kernels take the view, or sub-views of it.
/// assert_eq!(stream.clone_dtoh(&*view)?, [10, 20, 30, 40]);
/// assert_eq!(stream.clone_dtoh(&view.slice(1..3))?, [20, 30]);
///
/// drop(view); // never frees: orders the owner's free after the reads above
/// drop(owner);
/// # Ok(())
/// # }
/// ```
pub struct BorrowedSlice<'a, T> {
    /// Never dropped: given up with `CudaSlice::leak` (which frees nothing) in `Drop`.
    slice: ManuallyDrop<CudaSlice<T>>,
    /// The slice's address (cudarc gives it only through calls that record events).
    ptr: u64,
    /// How the owner's release is ordered after the view's uses (taken in `Drop`).
    release: Mutex<Option<Release<'a>>>,
    _borrow: PhantomData<&'a [T]>,
}

/// How the release of a view's memory is ordered after its uses.
enum Release<'a> {
    /// By the owner's callback, given an event recorded after the uses.
    AfterUse(AfterUse<'a>),
    /// By stream order: the owner frees the memory in order on the view's own stream.
    InStreamOrder,
}

impl<T> std::fmt::Debug for BorrowedSlice<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BorrowedSlice")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.slice.len())
            .field("stream", &self.slice.stream().cu_stream())
            .finish()
    }
}

impl<'a, T: DeviceNative> BorrowedSlice<'a, T> {
    /// Views the `len` elements at device address `ptr` as a slice of `stream`.
    ///
    /// First makes `stream` wait (on the GPU) for `ready` (the event after which the
    /// memory holds its data; `None` when it already does). The per-thread default stream
    /// is refused ([`CudaError::InvalidArgument`]): the view may drop on another thread.
    ///
    /// # Safety
    /// - `ptr` must be the address of `len * size_of::<T>()` bytes (`ptr` aligned for
    ///   `T`) that kernels of `stream`'s context can read;
    /// - the memory must stay allocated, and unwritten, for `'a`; after that, until the
    ///   event passed to `after_use` has completed, or, when `after_use` returns an
    ///   error or is never called, until the work queued on `stream` before the view
    ///   dropped has completed;
    /// - `ready`, when given, must be a live `CUevent` of `stream`'s device.
    pub unsafe fn new(
        stream: &Arc<CudaStream>,
        ptr: u64,
        len: usize,
        ready: Option<sys::CUevent>,
        after_use: AfterUse<'a>,
    ) -> Result<Self> {
        // SAFETY: the caller's guarantees, as `view` requires them for `AfterUse`.
        unsafe { Self::view(stream, ptr, len, ready, Release::AfterUse(after_use)) }
    }

    /// Views the `len` elements at device address `ptr` as a slice of `stream`, memory
    /// that its owner wrote, and frees, in order on `stream` itself: no event is waited
    /// for, and none recorded when the view drops (stream order puts the owner's free
    /// after every use enqueued on `stream`). As [`BorrowedSlice::new`] otherwise.
    ///
    /// # Safety
    /// - `ptr` as for [`BorrowedSlice::new`];
    /// - the work that wrote the memory is enqueued on `stream` before this call (or
    ///   ordered before it), and the memory stays allocated and unwritten for `'a`, and
    ///   after that until it is freed in order on `stream` (after every use the caller
    ///   enqueued there; uses on other streams the caller orders before the view drops).
    pub unsafe fn in_stream_order(stream: &Arc<CudaStream>, ptr: u64, len: usize) -> Result<Self> {
        // SAFETY: the caller's guarantees; no `ready` event.
        unsafe { Self::view(stream, ptr, len, None, Release::InStreamOrder) }
    }

    /// # Safety
    /// As [`BorrowedSlice::new`] for [`Release::AfterUse`], as
    /// [`BorrowedSlice::in_stream_order`] for [`Release::InStreamOrder`].
    unsafe fn view(
        stream: &Arc<CudaStream>,
        ptr: u64,
        len: usize,
        ready: Option<sys::CUevent>,
        release: Release<'a>,
    ) -> Result<Self> {
        context::check_keepable(stream, "a view of device memory")?;
        let element = size_of::<T>();
        let bytes = len.checked_mul(element).ok_or_else(|| {
            CudaError::InvalidArgument(format!("{len} {} elements overflow", T::NAME))
        })?;
        if !ptr.is_multiple_of(align_of::<T>() as u64) {
            return Err(CudaError::NotViewable {
                address: ptr,
                bytes,
                element: T::NAME,
                size: element,
                align: align_of::<T>(),
            });
        }
        if let Some(event) = ready.filter(|e| !e.is_null()) {
            // SAFETY: the caller's guarantee: a live event of the stream's device.
            unsafe { context::stream_wait_event(stream, event) }?;
        }
        // cudarc's `bind_to_thread` (called by `upgrade_device_ptr` to create the slice's
        // events where event tracking is on) fails with, and clears, an error stored on
        // the context by an earlier drop; `upgrade_device_ptr` then panics (`unwrap`).
        // Report that error here instead, as cudarc's own calls would.
        stream
            .context()
            .check_err()
            .map_err(|source| CudaError::Driver {
                call: "an earlier cudarc call (an error stored on the stream's context)",
                source,
            })?;
        let upgraded = std::panic::catch_unwind(AssertUnwindSafe(|| {
            // The slice would free the memory if dropped: it never is (`ManuallyDrop`,
            // given up with `leak` in `Drop`, see the module documentation).
            // SAFETY: `ptr` holds `len` elements of `T` (the caller's guarantee), every
            // bit pattern of which is a valid `T` (`DeviceNative`); never freed (above).
            unsafe { stream.upgrade_device_ptr::<T>(ptr, len) }
        }));
        let slice = upgraded.map_err(|_| {
            CudaError::InvalidArgument(
                "cudarc could not create the events of a view (cuEventCreate failed)".into(),
            )
        })?;
        Ok(Self {
            slice: ManuallyDrop::new(slice),
            ptr,
            release: Mutex::new(Some(release)),
            _borrow: PhantomData,
        })
    }
}

impl<'a, T> BorrowedSlice<'a, T> {
    /// The number of elements.
    pub fn len(&self) -> usize {
        self.slice.len()
    }

    /// Whether the view is empty.
    pub fn is_empty(&self) -> bool {
        self.slice.len() == 0
    }

    /// The device address of the first element.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// The stream the view belongs to (the caller's): the data is ready on it, and the
    /// owner of the memory waits for the work enqueued on it.
    pub fn stream(&self) -> &Arc<CudaStream> {
        self.slice.stream()
    }

    /// The whole view as a cudarc [`CudaView`].
    pub fn as_view(&self) -> CudaView<'_, T> {
        self.slice.as_view()
    }

    /// A sub-view (cudarc's [`CudaSlice::slice`]; panics when the range is out of
    /// bounds, as slicing does).
    pub fn slice(&self, range: impl RangeBounds<usize>) -> CudaView<'_, T> {
        self.slice.slice(range)
    }

    /// A sub-view, `None` when the range is out of bounds.
    pub fn try_slice(&self, range: impl RangeBounds<usize>) -> Option<CudaView<'_, T>> {
        self.slice.try_slice(range)
    }
}

impl<T> Deref for BorrowedSlice<'_, T> {
    type Target = CudaSlice<T>;

    /// The slice, shared: usable wherever cudarc takes `&CudaSlice<T>` (kernel
    /// arguments, copies from device memory, views). There is deliberately no `DerefMut`:
    /// the memory is read only, and the slice must stay the one `Drop` gives up.
    fn deref(&self) -> &CudaSlice<T> {
        &self.slice
    }
}

// SAFETY: pushes exactly what cudarc pushes for `&CudaSlice<T>` (the address of the
// slice's `CUdeviceptr` field, which lives as long as the borrow `'b` of the view, and
// cudarc's event bookkeeping for reads), by delegating to that implementation.
unsafe impl<'a, 'b: 'a, 'c, T> PushKernelArg<&'b BorrowedSlice<'c, T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b BorrowedSlice<'c, T>) -> &mut Self {
        let slice: &'b CudaSlice<T> = &arg.slice;
        self.arg(slice)
    }
}

impl<T> Drop for BorrowedSlice<'_, T> {
    fn drop(&mut self) {
        // SAFETY: taken exactly once, here; the field is never used afterwards.
        let slice = unsafe { ManuallyDrop::take(&mut self.slice) };
        let stream = slice.stream().clone();
        // Drops run on any thread: leave its current context as it was.
        let _bound = ContextGuard::enter(stream.context());
        // Frees nothing. Where cudarc tracks events, `stream` first waits for the uses
        // cudarc recorded on other streams.
        let _address = slice.leak();
        let release = self
            .release
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let ordered = match release {
            Some(Release::AfterUse(after_use)) => {
                CudaSyncEvent::record(&stream).and_then(after_use)
            }
            // The owner frees the memory in order on `stream`, after the uses.
            Some(Release::InStreamOrder) => Ok(()),
            None => Err(CudaError::InvalidArgument("no release order".into())),
        };
        if ordered.is_err() {
            // The owner cannot wait for the work on `stream`: let it finish before the
            // borrow ends. (If this fails too, the context is unusable and runs nothing.)
            let _ = context::sync_stream(&stream);
        }
    }
}
