//! Exporting device-resident Arrow data as an `ArrowDeviceArray` with a CUDA sync event.

use std::ffi::c_void;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use arrow_data::ffi::FFI_ArrowArray;
use arrow_data::ArrayData;
use arrow_schema::DataType;
use cudarc::driver::{sys, CudaContext, CudaEvent, CudaStream};
use devarrow_abi::{ArrowArray, ArrowDeviceArray, ArrowDeviceType, DeviceArray};

use crate::context::{ContextGuard, DropInContext};
use crate::error::{CudaError, DriverResultExt, Result};

/// What the exported array's `private_data` owns: arrow-rs's export of the `ArrayData`
/// (whose buffers own the device memory) and the sync event.
struct ExportPrivate {
    /// arrow-rs's `FFI_ArrowArray` of the data (moved in; released in `drop`).
    inner: ArrowArray,
    /// The `CUevent` handle; `sync_event` points here (unless exported without one).
    event_handle: sys::CUevent,
    /// Destroys the event when dropped (binding its context); `None` for an export
    /// without a sync event.
    _event: Option<DropInContext<CudaEvent>>,
    /// The context of the buffers (bound while they drop).
    context: Arc<CudaContext>,
}

impl Drop for ExportPrivate {
    fn drop(&mut self) {
        if let Some(release) = self.inner.release {
            // SAFETY: `inner` is arrow-rs's unreleased export, owned by us; its release
            // frees the ArrayData clone (and so, with the last reference, the device
            // buffers, each binding its own context).
            unsafe { release(&mut self.inner) };
            self.inner.release = None;
        }
    }
}

/// The `release` callback of exported CUDA arrays. Callable from any thread; never
/// unwinds into C.
unsafe extern "C" fn release_exported(array: *mut ArrowArray) {
    let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: the C data interface calls release with a pointer to the (possibly
        // moved) struct we produced, or we get NULL and do nothing.
        let Some(array) = (unsafe { array.as_mut() }) else {
            return;
        };
        if array.release.is_none() {
            return;
        }
        let private = array.private_data.cast::<ExportPrivate>();
        array.private_data = std::ptr::null_mut();
        array.release = None;
        if !private.is_null() {
            // SAFETY: `private_data` was set from Box::into_raw in `export_array_data` and
            // is reclaimed exactly once (release is now NULL).
            let private = unsafe { Box::from_raw(private) };
            // The consumer may release on any thread, one busy with another device or
            // context: bind the event's context for the drops (each buffer binds its own
            // too), then make the caller's current context current again.
            let _bound = ContextGuard::enter(&private.context);
            drop(private);
        }
    }));
    // A panic cannot cross the C boundary; the resources of a panicking release leak.
    let _ = result;
}

/// Checks that arrow-rs can export `data` without reading any buffer on the host.
/// `device_view_sizes`: view arrays carry their variadic sizes in device memory
/// ([`export_with_device_view_sizes`]); otherwise they are refused.
fn check_exportable(data: &ArrayData, path: &str, device_view_sizes: bool) -> Result<()> {
    if let Some(nulls) = data.nulls() {
        if nulls.offset() != data.offset() {
            return Err(CudaError::InvalidArgument(format!(
                "{path}: the validity bitmap offset ({}) differs from the array offset ({}); \
                 arrow-rs would realign it on the host",
                nulls.offset(),
                data.offset()
            )));
        }
    }
    if is_view(data.data_type()) && !device_view_sizes {
        return Err(CudaError::InvalidArgument(format!(
            "{path}: view types are not exported from CUDA memory (arrow-rs puts the \
             variadic buffer sizes in host memory)"
        )));
    }
    for (i, child) in data.child_data().iter().enumerate() {
        check_exportable(child, &format!("{path}.children[{i}]"), device_view_sizes)?;
    }
    Ok(())
}

fn is_view(data_type: &DataType) -> bool {
    matches!(data_type, DataType::Utf8View | DataType::BinaryView)
}

/// Drops the host sizes buffer arrow-rs appends to every view array of the export
/// (`n_buffers` one less), so that the array's own last buffer, its variadic sizes in
/// device memory, is the one the C data interface reads as the sizes.
///
/// # Safety
/// `array` is arrow-rs's live export of `data` (the same tree of children and
/// dictionaries), not yet handed to anyone.
unsafe fn use_device_view_sizes(data: &ArrayData, array: &mut ArrowArray) {
    if is_view(data.data_type()) {
        array.n_buffers -= 1;
    }
    let dictionary = matches!(data.data_type(), DataType::Dictionary(..));
    for (i, child) in data.child_data().iter().enumerate() {
        // SAFETY: arrow-rs exports each child of `data` as a child of `array`, in order,
        // and the values of a dictionary as its `dictionary`; all are live structs owned
        // by the export (the caller's guarantee).
        unsafe {
            let target = if dictionary {
                array.dictionary
            } else {
                *array.children.add(i)
            };
            if let Some(target) = target.as_mut() {
                use_device_view_sizes(child, target);
            }
        }
    }
}

/// [`export_array_data`] for `data` whose view arrays (`Utf8View`, `BinaryView`) each carry
/// one more buffer than arrow-rs knows of, last: the sizes of their variadic buffers as
/// `i64`s in device memory. The export's view arrays point to that buffer as their sizes
/// (arrow-rs would write them to host memory), as the C device data interface requires.
///
/// # Safety
/// Every view array of `data` has that last buffer, with one `i64` per other variadic
/// buffer, equal to its length in bytes.
pub(crate) unsafe fn export_with_device_view_sizes(
    data: ArrayData,
    device_type: ArrowDeviceType,
    stream: &Arc<CudaStream>,
) -> Result<DeviceArray> {
    export(data, device_type, stream, true, SyncEventKind::Recorded)
}

/// [`export_with_device_view_sizes`] with a NULL `sync_event`: the data is ready, in
/// stream order, on `stream`.
///
/// # Safety
/// As [`export_with_device_view_sizes`]; and the consumer enqueues its work on the
/// buffers only on `stream`, after this call (stream order then puts it after the work
/// that wrote them), and the buffers are freed in order on `stream` only.
pub(crate) unsafe fn export_in_stream_order(
    data: ArrayData,
    stream: &Arc<CudaStream>,
) -> Result<DeviceArray> {
    export(
        data,
        ArrowDeviceType::CUDA,
        stream,
        true,
        SyncEventKind::InStreamOrder,
    )
}

/// What an export's `sync_event` is.
#[derive(Clone, Copy, PartialEq, Eq)]
enum SyncEventKind {
    /// An event recorded on the stream at export.
    Recorded,
    /// NULL: the consumer works in order on the export's own stream.
    InStreamOrder,
}

/// Exports `data`, whose buffers live in CUDA memory of `device_type`
/// (`ARROW_DEVICE_CUDA`, `ARROW_DEVICE_CUDA_HOST` or `ARROW_DEVICE_CUDA_MANAGED`) on the
/// device of `stream`, as an [`ArrowDeviceArray`] (wrapped in a [`DeviceArray`]):
///
/// - an event is recorded on `stream` now, so every piece of work already enqueued on
///   `stream` (the work that writes the data) is ordered before it; `sync_event` points
///   to that `CUevent`;
/// - `device_id` is the stream's device;
/// - the `ArrayData` (so its buffers, e.g. [`crate::DeviceBuffer`]s wrapped with
///   `into_arrow_buffer`) and the event stay alive until the consumer calls `release`,
///   which may happen on any thread and binds the right context itself.
///
/// Build `data` without host reads: `ArrayData::builder(..).build_unchecked()` with
/// an explicit `null_count` (compute it with [`crate::kernels::count_set_bits`]) and the
/// validity bitmap at the array's own offset. Data that arrow-rs could only export by
/// reading buffers on the host is refused with [`CudaError::InvalidArgument`].
///
/// # Release contract (devarrow as exporter)
///
/// The C Device interface does not say who orders the consumer's work before `release`.
/// devarrow's release frees each buffer in stream order on the stream it was allocated on
/// (`cuMemFreeAsync`, usually `stream`), with no dependency on any consumer stream, which
/// it does not know; a stream-ordered pool may hand that memory to the next allocation on
/// that stream at once. So a consumer must call `release` only once its device work that
/// reads the buffers has **completed** (its stream synchronized, or an event recorded
/// after that work waited for), not merely enqueued. devarrow's own importers do
/// ([`crate::ImportedArray`], the bridge's `DeviceBatch::import`).
pub fn export_array_data(
    data: ArrayData,
    device_type: ArrowDeviceType,
    stream: &Arc<CudaStream>,
) -> Result<DeviceArray> {
    export(data, device_type, stream, false, SyncEventKind::Recorded)
}

fn export(
    data: ArrayData,
    device_type: ArrowDeviceType,
    stream: &Arc<CudaStream>,
    device_view_sizes: bool,
    sync: SyncEventKind,
) -> Result<DeviceArray> {
    if !device_type.is_cuda() {
        return Err(CudaError::UnsupportedDeviceType {
            found: device_type,
            expected: "ARROW_DEVICE_CUDA, ARROW_DEVICE_CUDA_HOST or ARROW_DEVICE_CUDA_MANAGED",
        });
    }
    check_exportable(&data, "array", device_view_sizes)?;
    let ctx = stream.context();
    let event = match sync {
        SyncEventKind::Recorded => {
            // An event for ordering only (the consumer waits on it): timing off, as
            // NVIDIA advises for events used with cuStreamWaitEvent and cuEventQuery.
            let event = ctx
                .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .call("cuEventCreate")?;
            event.record(stream).call("cuEventRecord")?;
            Some(event)
        }
        SyncEventKind::InStreamOrder => None,
    };
    let mut inner = ArrowArray::from_ffi(FFI_ArrowArray::new(&data));
    if device_view_sizes {
        // SAFETY: `inner` is arrow-rs's export of `data`, owned here alone.
        unsafe { use_device_view_sizes(&data, &mut inner) };
    }
    drop(data);
    let private = Box::into_raw(Box::new(ExportPrivate {
        event_handle: event
            .as_ref()
            .map_or(std::ptr::null_mut(), |e| e.cu_event()),
        inner,
        _event: event.map(DropInContext::new),
        context: ctx.clone(),
    }));
    // SAFETY: `private` is a live, uniquely owned Box; we only read plain fields of the
    // inner struct and take the address of `event_handle`, which is stable until the
    // Box is freed in `release_exported`.
    let (root, sync_event) = unsafe {
        let p = &mut *private;
        (
            ArrowArray {
                length: p.inner.length,
                null_count: p.inner.null_count,
                offset: p.inner.offset,
                n_buffers: p.inner.n_buffers,
                n_children: p.inner.n_children,
                buffers: p.inner.buffers,
                children: p.inner.children,
                dictionary: p.inner.dictionary,
                release: Some(release_exported),
                private_data: private.cast::<c_void>(),
            },
            match sync {
                SyncEventKind::Recorded => {
                    (&mut p.event_handle as *mut sys::CUevent).cast::<c_void>()
                }
                SyncEventKind::InStreamOrder => std::ptr::null_mut(),
            },
        )
    };
    let raw = ArrowDeviceArray {
        array: root,
        device_id: ctx.ordinal() as i64,
        device_type,
        sync_event,
        reserved: [0; 3],
    };
    // `try_new` only fails on a released struct, and `root.release` is set. The buffers are
    // the CUDA memory of `device_type` on the stream's device this function requires
    // (device memory gets into an `ArrayData` only through the unsafe `into_arrow_buffer`).
    // `root` is arrow-rs's export of `data` (well-formed, buffers sized for its structs)
    // with our release, callable once from any thread.
    // SAFETY: as above; `sync_event` points to the event just recorded, alive in
    // `private` until release, or is NULL (the caller's promise of stream order).
    Ok(unsafe { DeviceArray::try_new(raw) }?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_buffer::{Buffer, NullBuffer};

    /// The export of a view array built as `CudaArray::from_views` builds it (its sizes
    /// as one more buffer, last) points to that buffer as its variadic sizes, and drops
    /// arrow-rs's own host copy: `n_buffers` counts validity, views, the data buffers
    /// and the sizes, as the C data interface says. Host memory stands in for the device
    /// here (nothing is read but the struct).
    #[test]
    fn view_exports_point_to_their_own_sizes_buffer() {
        let views = Buffer::from_vec(vec![0u128; 3]);
        let blocks = [
            Buffer::from_vec(vec![0u8; 40]),
            Buffer::from_vec(vec![0u8; 24]),
        ];
        let sizes = Buffer::from_vec(vec![40i64, 24]);
        let sizes_ptr = sizes.as_ptr();
        let child = ArrayData::builder(DataType::Utf8View)
            .len(3)
            .buffers(vec![views, blocks[0].clone(), blocks[1].clone(), sizes])
            .nulls(Some(NullBuffer::from(vec![true, false, true])));
        // SAFETY: never read as an array: only exported and its C struct inspected.
        let child = unsafe { child.build_unchecked() };
        let fields = arrow_schema::Fields::from(vec![arrow_schema::Field::new(
            "s",
            DataType::Utf8View,
            true,
        )]);
        // SAFETY: a struct of that one child; nothing is read.
        let data = unsafe {
            ArrayData::builder(DataType::Struct(fields))
                .len(3)
                .child_data(vec![child.clone()])
                .build_unchecked()
        };
        assert!(check_exportable(&data, "array", false).is_err());
        assert!(check_exportable(&data, "array", true).is_ok());
        let mut root = ArrowArray::from_ffi(FFI_ArrowArray::new(&data));
        // SAFETY: `root` is arrow-rs's export of `data`, owned here.
        unsafe { use_device_view_sizes(&data, &mut root) };
        assert_eq!(root.n_buffers, 1, "the struct's validity only");
        // SAFETY: the export has one child, a live struct with `n_buffers` pointers.
        let (n, last, block) = unsafe {
            let c = &**root.children;
            (
                c.n_buffers,
                *c.buffers.add(c.n_buffers as usize - 1),
                *c.buffers.add(2),
            )
        };
        assert_eq!(n, 5, "validity, views, two blocks, their sizes");
        assert_eq!(last.cast::<u8>(), sizes_ptr, "the array's own sizes buffer");
        assert_eq!(block.cast::<u8>(), blocks[0].as_ptr());
        // SAFETY: released once, as arrow-rs's export (its own release).
        unsafe { root.release.expect("an exported array")(&mut root) };
    }

    #[test]
    fn host_realigning_exports_are_refused_before_any_cuda_call() {
        // A validity bitmap whose offset differs from the array's would be realigned by
        // arrow-rs on the host; the check runs before the event is created, so it works
        // without a GPU.
        let nulls = NullBuffer::from(vec![true, false, true, true, false, true, true, true, true]);
        let data = ArrayData::builder(DataType::Int8)
            .len(9)
            .add_buffer(Buffer::from(vec![0u8; 9]))
            .nulls(Some(nulls))
            .build()
            .unwrap()
            .slice(1, 8);
        // slicing keeps the offsets equal: exportable
        assert!(check_exportable(&data, "array", false).is_ok());
        let view = ArrayData::new_empty(&DataType::Utf8View);
        assert!(matches!(
            check_exportable(&view, "array", false),
            Err(CudaError::InvalidArgument(_))
        ));
    }
}
