//! The CUDA side of device batches (feature `cuda`): columns of a CUDA batch as cudarc
//! views on the caller's stream ([`ColumnBuffer::cuda_view`],
//! [`DeviceColumn::cuda_values`], [`DeviceColumn::cuda_validity`]), and batches made of
//! cudarc slices ([`DeviceBatch::from_cuda_arrays`]).
//!
//! # Views
//!
//! A view ([`BorrowedSlice`]) borrows the batch, so the memory outlives it, and never
//! frees it (see `devarrow_cuda::BorrowedSlice`). Making one makes the caller's stream
//! wait (on the GPU) for the batch's event; dropping one orders the release of the
//! batch's memory after the work the caller enqueued on that stream, without blocking
//! the host:
//! - a packed batch (from [`Transfer::to_device`](crate::Transfer::to_device)): its
//!   memory is freed in order on the stream it was allocated on (the `CudaDevice`'s),
//!   which is made to wait on an event recorded on the caller's stream when the view
//!   drops;
//! - an imported batch: the foreign array is released only after that event has
//!   completed (the batch's drop waits for it).
//!
//! Memory of a packed batch belongs to its device's primary context: the view's stream
//! must be of that context ([`CudaError::NotPrimaryContext`]), and of the batch's device
//! ([`CudaError::DeviceMismatch`]).

use std::sync::Arc;

use arrow_schema::SchemaRef;
use devarrow_abi::device::Device;
use devarrow_abi::ArrowDeviceType;
use devarrow_cuda::cudarc::driver::{sys, CudaStream};
use devarrow_cuda::{
    AfterUse, BorrowedSlice, CudaArray, CudaError, DeviceNative, PrimaryContext, TransferMemory,
};

use crate::batch::{DeviceBatch, Storage};
use crate::column::{ColumnBuffer, DeviceColumn};
use crate::foreign::{Foreign, ViewUse};

type Result<T> = devarrow_cuda::Result<T>;

impl<'a> ColumnBuffer<'a> {
    /// The whole buffer as a cudarc slice of `T` on `stream` ([`BorrowedSlice`]: pass it
    /// to kernels, copy from it, take sub-views), borrowing the batch.
    ///
    /// `stream` first waits (on the GPU) for the batch's event. The buffer must lie in
    /// CUDA memory (`ARROW_DEVICE_CUDA`, `_HOST` or `_MANAGED`) of a batch on a CUDA
    /// device ([`CudaError::UnsupportedDeviceType`]), the stream on that device
    /// ([`CudaError::DeviceMismatch`]; for a packed batch in its primary context,
    /// [`CudaError::NotPrimaryContext`]), and the buffer's address aligned for `T` and
    /// its length a multiple of `T`'s size ([`CudaError::NotViewable`]). Any `T` is
    /// accepted: the bytes of a validity bitmap as `u8`, of `Utf8` offsets as `i32`;
    /// [`DeviceColumn::cuda_values`] checks the element type against the column's.
    pub fn cuda_view<T: DeviceNative>(
        &self,
        stream: &Arc<CudaStream>,
    ) -> Result<BorrowedSlice<'a, T>> {
        let size = size_of::<T>();
        if !self.len.is_multiple_of(size) {
            return Err(CudaError::NotViewable {
                address: self.address(),
                bytes: self.len,
                element: T::NAME,
                size,
                align: align_of::<T>(),
            });
        }
        view(self.batch, self.address(), self.len / size, stream)
    }
}

impl<'a> DeviceColumn<'a> {
    /// The column's values as a cudarc slice of `T` on `stream`: `len()` elements from
    /// the first item (the column's `offset()` applied), borrowing the batch. `T` must
    /// fit the data type ([`DeviceNative::fits`]: `i32` for `Int32`, `Date32`, ...;
    /// dictionary keys for a dictionary array), else [`CudaError::TypeMismatch`]. Nulls
    /// hold unspecified values: see [`DeviceColumn::cuda_validity`].
    ///
    /// Otherwise as [`ColumnBuffer::cuda_view`].
    pub fn cuda_values<T: DeviceNative>(
        &self,
        stream: &Arc<CudaStream>,
    ) -> Result<BorrowedSlice<'a, T>> {
        let data_type = self.data_type();
        let values = self.values().filter(|_| T::fits(data_type));
        let Some(values) = values else {
            return Err(CudaError::TypeMismatch {
                data_type: data_type.clone(),
                native: T::NAME,
            });
        };
        let size = size_of::<T>();
        let (start, end) = (self.offset(), self.offset() + self.len());
        if end.saturating_mul(size) > values.len() {
            return Err(CudaError::BufferTooShort {
                buffer: "values",
                bytes: values.len(),
                needed: end.saturating_mul(size),
            });
        }
        view(
            self.batch(),
            values.address() + (start * size) as u64,
            self.len(),
            stream,
        )
    }

    /// The validity bitmap's bytes as a cudarc slice of `u8` on `stream` (bit
    /// `offset() + i`, LSB first, for item `i`; bytes from the buffer's start), `None`
    /// when the column has no bitmap (no nulls). As [`ColumnBuffer::cuda_view`].
    pub fn cuda_validity(&self, stream: &Arc<CudaStream>) -> Result<Option<BorrowedSlice<'a, u8>>> {
        self.validity().map(|v| v.cuda_view(stream)).transpose()
    }
}

/// `len` elements of `T` at `address`, memory of `batch`, viewed on `stream`.
fn view<'a, T: DeviceNative>(
    batch: &'a DeviceBatch,
    address: u64,
    len: usize,
    stream: &Arc<CudaStream>,
) -> Result<BorrowedSlice<'a, T>> {
    let device = batch.device();
    if device.device_type() != ArrowDeviceType::CUDA {
        return Err(CudaError::UnsupportedDeviceType {
            found: device.device_type(),
            expected: "a batch on a CUDA device",
        });
    }
    let ctx = stream.context();
    if ctx.ordinal() as i64 != device.device_id() {
        return Err(CudaError::DeviceMismatch {
            expected: ctx.ordinal() as i64,
            found: device.device_id(),
        });
    }
    // The batch's event is recorded on its device's stream (as `Device::record_event`
    // records): a view on that very stream needs no wait for it, and where the memory is
    // freed in order there too, no event after its uses either.
    let key = (ctx.cu_ctx() as usize, stream.cu_stream() as usize);
    let on_batch_stream = device.stream_handles() == Some(key);
    let in_stream_order = on_batch_stream
        && match &batch.storage {
            Storage::Packed { memory, .. } => memory
                .as_any()
                .downcast_ref::<TransferMemory>()
                .is_some_and(|m| {
                    let frees_on = m.buffer().stream();
                    (
                        frees_on.context().cu_ctx() as usize,
                        frees_on.cu_stream() as usize,
                    ) == key
                }),
            Storage::Foreign(foreign) => foreign.in_order_on == Some(key),
        };
    if in_stream_order {
        // The memory is freed in order on `stream` (a packed batch's on the stream it was
        // allocated on, an imported array of this process's own by its producer, both
        // `stream`), so after every use enqueued there.
        // SAFETY: the range lies in the borrowed batch's CUDA memory (as below), written
        // by work ordered before the batch's event, recorded on `stream`; freed as above.
        return unsafe { BorrowedSlice::in_stream_order(stream, address, len) };
    }
    let after_use: AfterUse<'a> = match &batch.storage {
        Storage::Packed { memory, .. } => {
            match memory.as_any().downcast_ref::<TransferMemory>() {
                Some(memory) => {
                    // Freed in order on the stream it was allocated on: make that stream
                    // wait for the caller's work.
                    let frees_on = memory.buffer().stream().clone();
                    if frees_on.context().cu_ctx() != ctx.cu_ctx() {
                        return Err(CudaError::NotPrimaryContext {
                            device: ctx.ordinal(),
                        });
                    }
                    Box::new(move |event| event.wait_on(&frees_on))
                }
                None => {
                    // Memory of another CUDA device implementation: its release cannot be
                    // ordered here, so the view's drop waits on the host instead.
                    if PrimaryContext::open(ctx.ordinal())?.cu_context() != ctx.cu_ctx() {
                        return Err(CudaError::NotPrimaryContext {
                            device: ctx.ordinal(),
                        });
                    }
                    Box::new(|_| {
                        Err(CudaError::Unsupported(
                            "ordering the release of this device's memory",
                        ))
                    })
                }
            }
        }
        Storage::Foreign(foreign) => {
            let foreign = foreign.clone();
            let kept = stream.clone();
            let key = (ctx.cu_ctx() as usize, stream.cu_stream() as usize);
            Box::new(move |event| {
                foreign.add_view_use(ViewUse {
                    _stream: kept,
                    key,
                    event: Arc::new(event),
                });
                Ok(())
            })
        }
    };
    let sync_event = batch.event().as_sync_event_ptr();
    let ready = (!sync_event.is_null()).then(|| {
        // SAFETY: the batch's event was recorded by its device, a CUDA device (checked
        // above), whose sync events point to a live `CUevent` as long as the event
        // lives (`SyncEvent`'s contract), which the borrowed batch holds.
        unsafe { *sync_event.cast::<sys::CUevent>() }
    });
    // Why `BorrowedSlice::new`'s contract holds: `address` holds `len` elements of `T`
    // inside a buffer of the batch (the callers check the range against the buffer's
    // length, computed from the batch's own layout: the plan of a packed batch, the
    // validated structure of an imported one), in CUDA memory of the stream's device
    // (checked above; for a packed batch, of the stream's very context). The batch,
    // borrowed for `'a`, keeps it allocated and unwritten (device batches are immutable).
    // After `'a`: a packed batch's memory is freed in stream order on `frees_on`, which
    // `after_use` makes wait on the event first; an imported batch's foreign array is
    // released by `Foreign`'s drop only after it has waited for every event `after_use`
    // recorded; where `after_use` fails, the view's drop waits for its stream on the host.
    // SAFETY: the range lies in the borrowed batch's CUDA memory and outlives every use
    // of the view (above); `ready` is the batch's live `CUevent`.
    unsafe { BorrowedSlice::new(stream, address, len, ready, after_use) }
}

impl DeviceBatch {
    /// A batch of `schema` on `device` (a CUDA device of the arrays' device) made of
    /// `columns`, arrays built from cudarc slices (one per field, in order): exported as
    /// one struct array with a sync event on the first column's stream
    /// ([`CudaArray::export_struct`]), then imported ([`DeviceBatch::import`]), zero-copy.
    /// A [`Transfer`](crate::Transfer) on `device` then downloads it.
    ///
    /// The slices are freed (by cudarc, on their streams) when the batch and its
    /// exports are dropped.
    pub fn from_cuda_arrays(
        device: Arc<dyn Device>,
        schema: SchemaRef,
        columns: Vec<CudaArray>,
    ) -> Result<DeviceBatch> {
        // The device's stream, when every column is written and freed in order there.
        let in_order = device.stream_handles().filter(|&key| {
            !columns.is_empty()
                && columns.iter().all(|c| {
                    let stream = c.stream();
                    c.is_in_order_on(stream)
                        && (
                            stream.context().cu_ctx() as usize,
                            stream.cu_stream() as usize,
                        ) == key
                })
        });
        let Some(key) = in_order else {
            let array = CudaArray::export_struct(schema.fields().clone(), columns)?;
            return Ok(DeviceBatch::import(device, array, schema)?);
        };
        // Every column is written, and freed, in order on the device's own stream, where
        // the import below (and the batch's every copy) enqueues its work: no sync event.
        // The batch imported here uses the buffers on that stream only (its copies; views
        // of other streams wait for the batch's event, recorded on it, and are waited for
        // before the release).
        let fields = schema.fields().clone();
        // SAFETY: the consumer works on the columns' one stream only (above).
        let array = unsafe { CudaArray::export_struct_in_stream_order(fields, columns) }?;
        let (mut foreign, event) = Foreign::import(&device, array, &schema)?;
        foreign.in_order_on = Some(key);
        Ok(DeviceBatch::of_foreign(device, foreign, event, schema))
    }
}
