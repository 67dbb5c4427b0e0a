//! [`CudaArray`]: an Arrow array built from cudarc slices (the output of a caller's
//! kernel), checked against its data type, exportable as an `ArrowDeviceArray`.

use std::ptr::NonNull;
use std::sync::Arc;

use arrow_buffer::{BooleanBuffer, Buffer, NullBuffer};
use arrow_data::ArrayData;
use arrow_schema::{DataType, FieldRef, Fields, UnionFields, UnionMode};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use devarrow_abi::{ArrowDeviceType, DeviceArray};

use crate::context::{self, DropInContext, InContext};
use crate::error::{CudaError, DriverResultExt, Result};
use crate::export::{export_in_stream_order, export_with_device_view_sizes};
use crate::kernels;
use crate::memory::{stream_waits_for, CudaMemory};
use crate::native::DeviceNative;

impl<T> InContext for CudaSlice<T> {
    fn bound_context(&self) -> &CudaContext {
        self.context()
    }
}

/// A cudarc slice owned by an arrow-rs `Buffer`: dropped (cudarc frees it, in order on
/// its stream) with the last reference to the buffer, with its context bound.
struct SliceOwner<T> {
    _slice: DropInContext<CudaSlice<T>>,
}

// SAFETY: the slice owns its device memory alone; cudarc makes `CudaSlice` Send and
// Sync, and dropping it (freeing the memory) binds its context first, from any thread.
unsafe impl<T> Send for SliceOwner<T> {}
// SAFETY: nothing is reached through a shared reference (the owner is only dropped).
unsafe impl<T> Sync for SliceOwner<T> {}
impl<T> std::panic::RefUnwindSafe for SliceOwner<T> {}

/// The slice's memory as an arrow-rs `Buffer` that owns the slice.
///
/// # Safety
/// The `Buffer` points to device memory: it must never be read on the host, only its
/// address and length used (as the export does).
unsafe fn device_buffer<T: 'static>(slice: CudaSlice<T>, ptr: u64) -> Buffer {
    let bytes = slice.num_bytes();
    let ptr = NonNull::new(ptr as *mut u8).unwrap_or(NonNull::<u64>::dangling().cast());
    // SAFETY: `ptr..ptr + bytes` is the slice's allocation, alive as long as the owner
    // (moved into the Arc) lives; the caller promises never to read it on the host.
    unsafe {
        Buffer::from_custom_allocation(
            ptr,
            bytes,
            Arc::new(SliceOwner {
                _slice: DropInContext::new(slice),
            }),
        )
    }
}

/// The address of `slice` for reads on `stream`: where cudarc tracks events, `stream`
/// first waits for the slice's last write on another stream.
fn address_for_reads<T>(slice: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    let (ptr, _record_read) = slice.device_ptr(stream);
    ptr
}

/// A validity bitmap slice, as the counting kernel takes memory.
struct Bitmap {
    ptr: u64,
    len: usize,
    device: i64,
}

impl CudaMemory for Bitmap {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn device_type(&self) -> ArrowDeviceType {
        ArrowDeviceType::CUDA
    }
    fn device_id(&self) -> i64 {
        self.device
    }
}

/// An Arrow array whose buffers are cudarc slices in CUDA device memory: the values
/// (`CudaSlice<T>`, one element per row; a bitmap for booleans; 16-byte views and their
/// variadic buffers for `Utf8View` and `BinaryView`) and optionally a validity bitmap
/// (`CudaSlice<u8>`, bit `i` set when row `i` is valid, LSB first).
///
/// Built by [`CudaArray::from_values`] and [`CudaArray::with_validity`] (fixed-width
/// types), [`CudaArray::from_bits`] (booleans) and [`CudaArray::from_views`] (views),
/// which check the slices against the data type (typed errors:
/// [`CudaError::TypeMismatch`], [`CudaError::BufferTooShort`],
/// [`CudaError::DeviceMismatch`]). The array owns the
/// slices; they are freed (by cudarc, in order on their stream) when the array, or the
/// consumer of its export, releases them.
///
/// Exported with [`CudaArray::export`] (one array) or [`CudaArray::export_struct`] (a
/// struct array, i.e. a record batch, of several), with a sync event recorded on the
/// values' stream: write the slices on that stream (or order the writes before it; where
/// cudarc tracks events, writes on other streams are waited for). `devarrow-bridge`'s
/// `DeviceBatch::from_cuda_arrays` imports such a batch, which its `Transfer` downloads.
///
/// # Example
///
/// A cudarc slice (say, a kernel's output) as an Arrow `Int64` array, exported:
///
/// ```
/// use arrow_schema::DataType;
/// use devarrow_cuda::{CudaArray, CudaDevice, CudaError};
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
/// let stream = device.primary_context().new_stream()?;
/// let driver_error = |source| CudaError::Driver { call: "cuMemcpyHtoDAsync", source };
/// let values = stream.clone_htod(&[10i64, 20, 30]).map_err(driver_error)?;
///
/// let array = CudaArray::from_values(DataType::Int64, values)?;
/// assert_eq!((array.len(), array.null_count()), (3, 0));
/// let exported = array.export()?; // sync_event: recorded on `stream`
/// assert_eq!(exported.array().length, 3);
///
/// // A slice of the wrong element type is a typed error, not a reinterpretation.
/// let floats = stream.clone_htod(&[1.5f32]).map_err(driver_error)?;
/// let wrong = CudaArray::from_values(DataType::Int64, floats);
/// assert!(matches!(wrong, Err(CudaError::TypeMismatch { .. })));
///
/// // Booleans from a bitmap (a kernel's packed flags): true, false, true; the second
/// // row null.
/// let bits = stream.clone_htod(&[0b101u8]).map_err(driver_error)?;
/// let valid = stream.clone_htod(&[0b101u8]).map_err(driver_error)?;
/// let flags = CudaArray::from_bits(3, bits, Some((valid, Some(1))))?;
/// assert_eq!((flags.data_type(), flags.null_count()), (&DataType::Boolean, 1));
/// # Ok(())
/// # }
/// ```
pub struct CudaArray {
    /// Buffers in device memory, owning the slices: never read on the host.
    data: ArrayData,
    stream: Arc<CudaStream>,
    /// Whether every slice of the array belongs to `stream` (so is written, and freed,
    /// in order there).
    one_stream: bool,
}

impl std::fmt::Debug for CudaArray {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaArray")
            .field("data_type", self.data.data_type())
            .field("len", &self.data.len())
            .field("null_count", &self.data.null_count())
            .field("device", &self.stream.context().ordinal())
            .finish()
    }
}

impl CudaArray {
    /// An array of `data_type` without nulls whose values are `values` (one element per
    /// row). The slice is consumed (and freed on error).
    ///
    /// `T` must fit `data_type` ([`DeviceNative::fits`]): otherwise
    /// [`CudaError::TypeMismatch`]. The per-thread default stream is refused
    /// ([`CudaError::InvalidArgument`]): the slice is freed on its stream from whichever
    /// thread releases the array.
    pub fn from_values<T: DeviceNative>(data_type: DataType, values: CudaSlice<T>) -> Result<Self> {
        Self::build(data_type, values, None)
    }

    /// An array of `data_type` whose values are `values` and whose validity bitmap is
    /// `validity` (at least `ceil(len / 8)` bytes, else [`CudaError::BufferTooShort`]; on
    /// the values' device, else [`CudaError::DeviceMismatch`]).
    ///
    /// `null_count`: the number of unset bits among the first `len`; `None` counts them
    /// on the GPU (on the values' stream, after the bitmap is written), which blocks the
    /// host until counted. A count above `len` is [`CudaError::InvalidArgument`].
    pub fn with_validity<T: DeviceNative>(
        data_type: DataType,
        values: CudaSlice<T>,
        validity: CudaSlice<u8>,
        null_count: Option<usize>,
    ) -> Result<Self> {
        Self::build(data_type, values, Some((validity, null_count)))
    }

    fn build<T: DeviceNative>(
        data_type: DataType,
        values: CudaSlice<T>,
        validity: Option<(CudaSlice<u8>, Option<usize>)>,
    ) -> Result<Self> {
        if !T::fits(&data_type) || matches!(data_type, DataType::Dictionary(_, _)) {
            return Err(CudaError::TypeMismatch {
                data_type,
                native: T::NAME,
            });
        }
        let stream = values.stream().clone();
        context::check_keepable(&stream, "CudaArray")?;
        let len = values.len();
        let one_stream = on_stream(&stream, validity.as_ref().map(|v| &v.0));
        let values_ptr = address_for_reads(&values, &stream);
        let nulls = nulls(&stream, len, validity)?;
        // SAFETY: the buffer is only exported (address and length), never read.
        let values = unsafe { device_buffer(values, values_ptr) };
        // SAFETY: a fixed-width array of `len` rows: one values buffer of `len` elements
        // of the type's width (`T` fits the type), and a bitmap of at least `len` bits
        // with its null count (checked by `nulls`); `build_unchecked` reads no buffer.
        let data = unsafe {
            ArrayData::builder(data_type)
                .len(len)
                .nulls(nulls)
                .add_buffer(values)
                .build_unchecked()
        };
        Ok(Self {
            data,
            stream,
            one_stream,
        })
    }

    /// A `Boolean` array of `len` rows whose values are the first `len` bits of `bits`
    /// (bit `i` LSB first for row `i`; at least `ceil(len / 8)` bytes, else
    /// [`CudaError::BufferTooShort`]), with an optional validity bitmap and null count as
    /// for [`CudaArray::with_validity`]. The per-thread default stream is refused.
    pub fn from_bits(
        len: usize,
        bits: CudaSlice<u8>,
        validity: Option<(CudaSlice<u8>, Option<usize>)>,
    ) -> Result<Self> {
        let stream = bits.stream().clone();
        context::check_keepable(&stream, "CudaArray")?;
        if bits.len() < len.div_ceil(8) {
            return Err(CudaError::BufferTooShort {
                buffer: "values",
                bytes: bits.len(),
                needed: len.div_ceil(8),
            });
        }
        let one_stream = on_stream(&stream, validity.as_ref().map(|v| &v.0));
        let bits_ptr = address_for_reads(&bits, &stream);
        let nulls = nulls(&stream, len, validity)?;
        // SAFETY: the buffer is only exported (address and length), never read.
        let bits = unsafe { device_buffer(bits, bits_ptr) };
        // SAFETY: a Boolean array of `len` rows: a values bitmap of at least `len` bits
        // (checked above) and a validity bitmap with its null count (checked by `nulls`);
        // `build_unchecked` reads no buffer.
        let data = unsafe {
            ArrayData::builder(DataType::Boolean)
                .len(len)
                .nulls(nulls)
                .add_buffer(bits)
                .build_unchecked()
        };
        Ok(Self {
            data,
            stream,
            one_stream,
        })
    }

    /// A `Utf8View` or `BinaryView` array (else [`CudaError::TypeMismatch`]) of one row
    /// per view of `views` (16 bytes each: a length, then the value itself up to 12
    /// bytes, or its first 4 bytes, the index of a buffer of `data` and the offset of
    /// the value in it), with the variadic buffers `data` and an optional validity bitmap
    /// and null count as for [`CudaArray::with_validity`].
    ///
    /// The export carries the sizes of `data`'s buffers in device memory as the C device
    /// data interface requires: they are written on the views' stream here
    /// (`cuMemsetD32Async`, no host wait).
    ///
    /// # Safety
    /// Nothing reads the views here. Every view of a valid row must be well formed for
    /// `data`: a value of more than 12 bytes lies inside the buffer its view names, its
    /// prefix is its first 4 bytes, and for `Utf8View` every value is UTF-8. A consumer
    /// that reads the array on the host (a download) trusts it.
    pub unsafe fn from_views(
        data_type: DataType,
        views: CudaSlice<u128>,
        data: Vec<CudaSlice<u8>>,
        validity: Option<(CudaSlice<u8>, Option<usize>)>,
    ) -> Result<Self> {
        if !matches!(data_type, DataType::Utf8View | DataType::BinaryView) {
            return Err(CudaError::TypeMismatch {
                data_type,
                native: "u128 views",
            });
        }
        let stream = views.stream().clone();
        context::check_keepable(&stream, "CudaArray")?;
        let ctx = stream.context().clone();
        let len = views.len();
        let one_stream = on_stream(&stream, validity.as_ref().map(|v| &v.0))
            && data.iter().all(|d| on_stream(&stream, Some(d)));
        let views_ptr = address_for_reads(&views, &stream);
        let nulls = nulls(&stream, len, validity)?;
        let mut buffers = Vec::with_capacity(data.len() + 2);
        // SAFETY: the buffer is only exported (address and length), never read.
        buffers.push(unsafe { device_buffer(views, views_ptr) });
        let sizes: Vec<i64> = data.iter().map(|d| d.len() as i64).collect();
        for buffer in data {
            same_context(&ctx, buffer.context())?;
            stream_waits_for(&stream, buffer.stream())?;
            let ptr = address_for_reads(&buffer, &stream);
            // SAFETY: the buffer is only exported (address and length), never read.
            buffers.push(unsafe { device_buffer(buffer, ptr) });
        }
        let on_device = stream
            .alloc_zeros::<i64>(sizes.len().max(1))
            .call("cuMemAllocAsync")?;
        let sizes_ptr = address_for_reads(&on_device, &stream);
        context::bind(&ctx)?;
        for (i, size) in sizes.iter().enumerate() {
            let (low, high) = (*size as u64 as u32, (*size as u64 >> 32) as u32);
            for (word, value) in [(0u64, low), (4, high)] {
                if value != 0 {
                    // SAFETY: `on_device` holds `sizes.len()` i64s on this context, alive
                    // (owned by the array) until the memset on its stream completes.
                    unsafe {
                        crate::driver::memset_d32_async(
                            sizes_ptr + 8 * i as u64 + word,
                            value,
                            1,
                            stream.cu_stream(),
                        )
                    }?;
                }
            }
        }
        // SAFETY: the buffer is only exported (address and length), never read.
        let sizes_buffer = unsafe { device_buffer(on_device, sizes_ptr) };
        // `slice_with_length` checks the bounds only, reads nothing.
        buffers.push(sizes_buffer.slice_with_length(0, 8 * sizes.len()));
        // The export points to the sizes (`export_with_device_view_sizes`); the views are
        // the caller's promise.
        // SAFETY: `len` views, the variadic buffers, their sizes on the device, a bitmap
        // with its null count (checked by `nulls`); `build_unchecked` reads no buffer.
        let data = unsafe {
            ArrayData::builder(data_type)
                .len(len)
                .nulls(nulls)
                .buffers(buffers)
                .build_unchecked()
        };
        Ok(Self {
            data,
            stream,
            one_stream,
        })
    }

    /// A `Utf8` or `Binary` array of `i32` offsets, or a `LargeUtf8` or `LargeBinary`
    /// array of `i64` offsets (else [`CudaError::TypeMismatch`]), of `offsets.len() - 1`
    /// rows (at least one offset, else [`CudaError::InvalidArgument`]) whose values are
    /// the ranges of `data` the offsets delimit, with an optional validity bitmap and
    /// null count as for [`CudaArray::with_validity`]. The per-thread default stream is
    /// refused. The slices are consumed.
    ///
    /// # Safety
    /// Nothing reads the offsets here. They must be as Arrow requires, once written on
    /// the offsets' stream: non-decreasing, the first at least 0, the last at most
    /// `data.len()`, and for `Utf8` and `LargeUtf8` every value UTF-8. A consumer that
    /// reads the array on the host (a download) trusts them.
    pub unsafe fn from_offsets<O: DeviceNative>(
        data_type: DataType,
        offsets: CudaSlice<O>,
        data: CudaSlice<u8>,
        validity: Option<(CudaSlice<u8>, Option<usize>)>,
    ) -> Result<Self> {
        let width = match data_type {
            DataType::Utf8 | DataType::Binary => "i32",
            DataType::LargeUtf8 | DataType::LargeBinary => "i64",
            _ => "",
        };
        if O::NAME != width {
            return Err(CudaError::TypeMismatch {
                data_type,
                native: O::NAME,
            });
        }
        let Some(len) = offsets.len().checked_sub(1) else {
            return Err(CudaError::InvalidArgument(
                "an offsets buffer of no offset (a string array has rows + 1)".into(),
            ));
        };
        let stream = offsets.stream().clone();
        context::check_keepable(&stream, "CudaArray")?;
        same_context(stream.context(), data.context())?;
        stream_waits_for(&stream, data.stream())?;
        let one_stream =
            on_stream(&stream, Some(&data)) && on_stream(&stream, validity.as_ref().map(|v| &v.0));
        let offsets_ptr = address_for_reads(&offsets, &stream);
        let data_ptr = address_for_reads(&data, &stream);
        let nulls = nulls(&stream, len, validity)?;
        // SAFETY: the buffers are only exported (address and length), never read.
        let (offsets, data) = unsafe {
            (
                device_buffer(offsets, offsets_ptr),
                device_buffer(data, data_ptr),
            )
        };
        // SAFETY: `len + 1` offsets of the type's width (checked above) into `data`, as
        // the caller promises, and a bitmap with its null count (checked by `nulls`);
        // `build_unchecked` reads no buffer.
        let data = unsafe {
            ArrayData::builder(data_type)
                .len(len)
                .nulls(nulls)
                .add_buffer(offsets)
                .add_buffer(data)
                .build_unchecked()
        };
        Ok(Self {
            data,
            stream,
            one_stream,
        })
    }

    /// A `Struct` array of `fields` whose children are `children` (one per field, of its
    /// type, with as many rows as each other, at least one child; a child with nulls
    /// only under a nullable field), with an optional validity bitmap and null count as
    /// for [`CudaArray::with_validity`]: else [`CudaError::InvalidArgument`]. The
    /// children's stream work is ordered before the first child's stream, whose exports
    /// record the event. The arrays are consumed.
    pub fn from_struct(
        fields: Fields,
        children: Vec<CudaArray>,
        validity: Option<(CudaSlice<u8>, Option<usize>)>,
    ) -> Result<Self> {
        let one_stream = children.first().is_some_and(|first| {
            children.iter().all(|c| c.is_in_order_on(&first.stream))
                && on_stream(&first.stream, validity.as_ref().map(|v| &v.0))
        });
        let (data, stream) = Self::struct_data(fields, children)?;
        if let Some((bits, _)) = &validity {
            same_context(stream.context(), bits.context())?;
        }
        let nulls = nulls(&stream, data.len(), validity)?;
        let data = data.into_builder().nulls(nulls);
        // SAFETY: the struct `struct_data` checked (children of the fields' types and one
        // length), with a bitmap of at least its length and its null count (checked by
        // `nulls`); `build_unchecked` reads no buffer.
        let data = unsafe { data.build_unchecked() };
        Ok(Self {
            data,
            stream,
            one_stream,
        })
    }

    /// A `FixedSizeList` array of `field` items, `size` of them a row (at least 1), whose
    /// items are `values` (`size` times the rows, of the field's type; nulls only under a
    /// nullable field), with an optional validity bitmap and null count as for
    /// [`CudaArray::with_validity`]: else [`CudaError::InvalidArgument`] or
    /// [`CudaError::TypeMismatch`]. The values' stream work is ordered before the
    /// bitmap's and the array's stream (the values'). The arrays are consumed.
    pub fn from_fixed_size_list(
        field: FieldRef,
        size: usize,
        values: CudaArray,
        validity: Option<(CudaSlice<u8>, Option<usize>)>,
    ) -> Result<Self> {
        if field.data_type() != values.data_type() {
            return Err(CudaError::TypeMismatch {
                data_type: values.data_type().clone(),
                native: "the list field's type",
            });
        }
        let width = i32::try_from(size).ok().filter(|&s| s > 0).ok_or_else(|| {
            CudaError::InvalidArgument(format!("a list size of {size} (1 to i32::MAX)"))
        })?;
        if !values.len().is_multiple_of(size) {
            return Err(CudaError::InvalidArgument(format!(
                "{} values are no whole number of lists of {size}",
                values.len()
            )));
        }
        if !field.is_nullable() && values.null_count() > 0 {
            return Err(CudaError::InvalidArgument(format!(
                "the list items are not nullable but have {} nulls",
                values.null_count()
            )));
        }
        let len = values.len() / size;
        let stream = values.stream.clone();
        let one_stream = values.one_stream && on_stream(&stream, validity.as_ref().map(|v| &v.0));
        if let Some((bits, _)) = &validity {
            same_context(stream.context(), bits.context())?;
        }
        let nulls = nulls(&stream, len, validity)?;
        // SAFETY: `len` rows of `size` items each: the values hold `len * size` items of
        // the field's type (checked above), and a bitmap of at least `len` bits with its
        // null count (checked by `nulls`); `build_unchecked` reads no buffer.
        let data = unsafe {
            ArrayData::builder(DataType::FixedSizeList(field, width))
                .len(len)
                .nulls(nulls)
                .child_data(vec![values.data])
                .build_unchecked()
        };
        Ok(Self {
            data,
            stream,
            one_stream,
        })
    }

    /// A variable-size list array of `data_type`: a `List` or `Map` of `i32` offsets, or
    /// a `LargeList` of `i64` offsets (else [`CudaError::TypeMismatch`]), of
    /// `offsets.len() - 1` rows (at least one offset, else
    /// [`CudaError::InvalidArgument`]) whose items are the ranges of `values` (of the
    /// list field's type, else [`CudaError::TypeMismatch`]; nulls only under a nullable
    /// field, else [`CudaError::InvalidArgument`]) the offsets delimit, with an optional
    /// validity bitmap and null count as for [`CudaArray::with_validity`]. The values'
    /// stream work is ordered before the offsets' stream, the array's (its exports
    /// record the event there); the per-thread default stream is refused. The slices and
    /// the values are consumed.
    ///
    /// # Safety
    /// Nothing reads the offsets here. They must be as Arrow requires, once written on
    /// the offsets' stream: non-decreasing, the first at least 0, the last at most
    /// `values.len()`. A consumer that reads the array on the host (a download) trusts
    /// them.
    pub unsafe fn from_list<O: DeviceNative>(
        data_type: DataType,
        offsets: CudaSlice<O>,
        values: CudaArray,
        validity: Option<(CudaSlice<u8>, Option<usize>)>,
    ) -> Result<Self> {
        let (field, width) = match &data_type {
            DataType::List(field) | DataType::Map(field, _) => (Some(field), "i32"),
            DataType::LargeList(field) => (Some(field), "i64"),
            _ => (None, ""),
        };
        let Some(field) = field.filter(|_| O::NAME == width) else {
            return Err(CudaError::TypeMismatch {
                data_type,
                native: O::NAME,
            });
        };
        if field.data_type() != values.data_type() {
            return Err(CudaError::TypeMismatch {
                data_type: values.data_type().clone(),
                native: "the list field's type",
            });
        }
        if !field.is_nullable() && values.null_count() > 0 {
            return Err(CudaError::InvalidArgument(format!(
                "the list items are not nullable but have {} nulls",
                values.null_count()
            )));
        }
        let Some(len) = offsets.len().checked_sub(1) else {
            return Err(CudaError::InvalidArgument(
                "an offsets buffer of no offset (a list array has rows + 1)".into(),
            ));
        };
        let stream = offsets.stream().clone();
        context::check_keepable(&stream, "CudaArray")?;
        same_context(stream.context(), values.stream.context())?;
        stream_waits_for(&stream, &values.stream)?;
        let one_stream = values.one_stream
            && values.is_in_order_on(&stream)
            && on_stream(&stream, validity.as_ref().map(|v| &v.0));
        let offsets_ptr = address_for_reads(&offsets, &stream);
        let nulls = nulls(&stream, len, validity)?;
        // SAFETY: the buffer is only exported (address and length), never read.
        let offsets = unsafe { device_buffer(offsets, offsets_ptr) };
        // SAFETY: `len + 1` offsets of the type's width (checked above) into the values
        // (of the field's type, checked above), as the caller promises, and a bitmap with
        // its null count (checked by `nulls`); `build_unchecked` reads no buffer.
        let data = unsafe {
            ArrayData::builder(data_type)
                .len(len)
                .nulls(nulls)
                .add_buffer(offsets)
                .child_data(vec![values.data])
                .build_unchecked()
        };
        Ok(Self {
            data,
            stream,
            one_stream,
        })
    }

    /// A `Union` array of `fields` in `mode` whose rows are `type_ids` (one `i8` a row,
    /// a type id of `fields`), with `offsets` for a dense union (one `i32` a row, into
    /// the child of its row's type; `None` for a sparse one, whose children have as many
    /// rows as the union) over `children` (one per field, in the fields' order, of its
    /// type): else [`CudaError::InvalidArgument`] or [`CudaError::TypeMismatch`]. A
    /// union has no validity bitmap. The children's stream work is ordered before the
    /// type ids' stream, the array's (its exports record the event there). The slices
    /// and the children are consumed.
    ///
    /// # Safety
    /// Nothing reads the type ids or the offsets here. Every type id must be one of the
    /// fields', and a dense union's offsets at least 0 and less than the length of the
    /// child of their row's type. A consumer that reads the array on the host (a
    /// download) trusts them.
    pub unsafe fn from_union(
        fields: UnionFields,
        mode: UnionMode,
        type_ids: CudaSlice<i8>,
        offsets: Option<CudaSlice<i32>>,
        children: Vec<CudaArray>,
    ) -> Result<Self> {
        let len = type_ids.len();
        if fields.len() != children.len() {
            return Err(CudaError::InvalidArgument(format!(
                "{} union fields for {} children",
                fields.len(),
                children.len()
            )));
        }
        for ((_, field), child) in fields.iter().zip(&children) {
            if field.data_type() != child.data_type() {
                return Err(CudaError::TypeMismatch {
                    data_type: child.data_type().clone(),
                    native: "the union field's type",
                });
            }
            if mode == UnionMode::Sparse && child.len() != len {
                return Err(CudaError::InvalidArgument(format!(
                    "a sparse union of {len} rows with a child of {}",
                    child.len()
                )));
            }
        }
        match (mode, &offsets) {
            (UnionMode::Sparse, None) => {}
            (UnionMode::Dense, Some(offsets)) if offsets.len() == len => {}
            _ => {
                return Err(CudaError::InvalidArgument(format!(
                    "a {mode:?} union of {len} rows with {:?} offsets",
                    offsets.as_ref().map(|o| o.len())
                )))
            }
        }
        let stream = type_ids.stream().clone();
        context::check_keepable(&stream, "CudaArray")?;
        let mut one_stream = on_stream(&stream, offsets.as_ref());
        let mut child_data = Vec::with_capacity(children.len());
        for child in children {
            same_context(stream.context(), child.stream.context())?;
            stream_waits_for(&stream, &child.stream)?;
            one_stream &= child.is_in_order_on(&stream);
            child_data.push(child.data);
        }
        let type_ids_ptr = address_for_reads(&type_ids, &stream);
        // SAFETY: the buffer is only exported (address and length), never read.
        let mut buffers = vec![unsafe { device_buffer(type_ids, type_ids_ptr) }];
        if let Some(offsets) = offsets {
            same_context(stream.context(), offsets.context())?;
            let ptr = address_for_reads(&offsets, &stream);
            // SAFETY: as above.
            buffers.push(unsafe { device_buffer(offsets, ptr) });
        }
        // SAFETY: `len` type ids (and offsets) of the union's layout, children of the
        // fields' types (checked above; a sparse union's of `len` rows), the ids and
        // offsets as the caller promises; `build_unchecked` reads no buffer.
        let data = unsafe {
            ArrayData::builder(DataType::Union(fields, mode))
                .len(len)
                .buffers(buffers)
                .child_data(child_data)
                .build_unchecked()
        };
        Ok(Self {
            data,
            stream,
            one_stream,
        })
    }

    /// A `Dictionary` array whose keys are `keys` (an array of an integer type, else
    /// [`CudaError::TypeMismatch`]; its validity is the dictionary's) and whose values
    /// are `values` (an array of any type of this constructor's), both of one context
    /// (else [`CudaError::DeviceMismatch`] or [`CudaError::InvalidArgument`]). The
    /// values' stream work is ordered before the keys' stream, whose exports record the
    /// event. The arrays are consumed.
    ///
    /// # Safety
    /// Nothing reads the keys here: every valid row's key must be at least 0 and less
    /// than `values.len()`. A consumer that reads the array on the host (a download)
    /// trusts them.
    pub unsafe fn from_dictionary(keys: CudaArray, values: CudaArray) -> Result<Self> {
        let key_type = keys.data_type().clone();
        if !key_type.is_dictionary_key_type() {
            return Err(CudaError::TypeMismatch {
                data_type: key_type,
                native: "dictionary keys (an integer type)",
            });
        }
        let stream = keys.stream.clone();
        same_context(stream.context(), values.stream.context())?;
        stream_waits_for(&stream, &values.stream)?;
        let one_stream = keys.one_stream && values.one_stream && values.is_in_order_on(&stream);
        let data_type =
            DataType::Dictionary(Box::new(key_type), Box::new(values.data_type().clone()));
        let keys = keys.data;
        // The keys' buffers and bitmap (their null count) as the keys array holds them, at
        // its offset (0: the constructors build arrays at 0), the values as the dictionary.
        // SAFETY: so built; the keys' range is the caller's promise; `build_unchecked`
        // reads no buffer.
        let data = unsafe {
            ArrayData::builder(data_type)
                .len(keys.len())
                .offset(keys.offset())
                .nulls(keys.nulls().cloned())
                .buffers(keys.buffers().to_vec())
                .child_data(vec![values.data])
                .build_unchecked()
        };
        Ok(Self {
            data,
            stream,
            one_stream,
        })
    }

    /// The data type.
    pub fn data_type(&self) -> &DataType {
        self.data.data_type()
    }

    /// The number of rows.
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// Whether there are no rows.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// The number of nulls.
    pub fn null_count(&self) -> usize {
        self.data.null_count()
    }

    /// The values' stream: exports record their event there.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The CUDA device (ordinal).
    pub fn device_id(&self) -> usize {
        self.stream.context().ordinal()
    }

    /// Exports the array as an `ArrowDeviceArray` (`ARROW_DEVICE_CUDA`, the slices'
    /// device) whose `sync_event` is recorded now on the values' stream; the slices are
    /// freed when the consumer releases it.
    pub fn export(self) -> Result<DeviceArray> {
        // SAFETY: the only view arrays of a `CudaArray` are `from_views`', whose last
        // buffer is their variadic sizes on the device.
        unsafe { export_with_device_view_sizes(self.data, ArrowDeviceType::CUDA, &self.stream) }
    }

    /// Exports `columns` as one struct array (a record batch) with `fields`: one field
    /// per column, of the column's data type, not
    /// nullable only for columns without nulls; all columns of the same length and
    /// context, at least one. The sync event is recorded on the first column's stream,
    /// after waiting (on the GPU) for the work queued so far on the other columns'
    /// streams.
    pub fn export_struct(fields: Fields, columns: Vec<CudaArray>) -> Result<DeviceArray> {
        let (data, stream) = Self::struct_data(fields, columns)?;
        // SAFETY: the only view arrays of a `CudaArray` are `from_views`', whose last
        // buffer is their variadic sizes on the device.
        unsafe { export_with_device_view_sizes(data, ArrowDeviceType::CUDA, &stream) }
    }

    /// Whether every slice of the array belongs to `stream`: written there (as the
    /// array's slices must be, see [`CudaArray::export`]) and freed in order there when
    /// the array, or its export, is released.
    pub fn is_in_order_on(&self, stream: &CudaStream) -> bool {
        self.one_stream && self.stream.cu_stream() == stream.cu_stream()
    }

    /// [`CudaArray::export_struct`] with a NULL `sync_event`, for a consumer that works
    /// in order on the columns' one stream: no event is created, recorded, waited for
    /// or destroyed. Every column must be [in order](CudaArray::is_in_order_on) on the
    /// first column's stream, else [`CudaError::InvalidArgument`] (and the columns are
    /// freed).
    ///
    /// # Safety
    /// The consumer enqueues its device work on the buffers only on that stream, after
    /// this call (stream order puts it after the writes, and the frees at release after
    /// it), or orders it after work it enqueues there (an event it records there itself).
    pub unsafe fn export_struct_in_stream_order(
        fields: Fields,
        columns: Vec<CudaArray>,
    ) -> Result<DeviceArray> {
        if let Some(first) = columns.first() {
            if let Some(other) = columns.iter().find(|c| !c.is_in_order_on(&first.stream)) {
                return Err(CudaError::InvalidArgument(format!(
                    "a {} column with memory of another stream than the first column's \
                     (export it with its sync event instead)",
                    other.data_type()
                )));
            }
        }
        let (data, stream) = Self::struct_data(fields, columns)?;
        // SAFETY: as in `export_struct`; every buffer belongs to `stream` (checked above),
        // the only stream the consumer uses (the caller's promise).
        unsafe { export_in_stream_order(data, &stream) }
    }

    /// The struct array of `columns`, and the first column's stream (which waited for
    /// the others').
    fn struct_data(
        fields: Fields,
        columns: Vec<CudaArray>,
    ) -> Result<(ArrayData, Arc<CudaStream>)> {
        let Some(first) = columns.first() else {
            return Err(CudaError::InvalidArgument(
                "a struct array of no column (at least one is needed)".into(),
            ));
        };
        let (len, stream) = (first.len(), first.stream.clone());
        if fields.len() != columns.len() {
            return Err(CudaError::InvalidArgument(format!(
                "{} fields for {} columns",
                fields.len(),
                columns.len()
            )));
        }
        let mut children = Vec::with_capacity(columns.len());
        for (field, column) in fields.iter().zip(columns) {
            if field.data_type() != column.data_type() {
                return Err(CudaError::InvalidArgument(format!(
                    "column {:?}: the field is {} but the column {}",
                    field.name(),
                    field.data_type(),
                    column.data_type()
                )));
            }
            if column.len() != len {
                return Err(CudaError::InvalidArgument(format!(
                    "column {:?} has {} rows, the first {len}",
                    field.name(),
                    column.len()
                )));
            }
            if !field.is_nullable() && column.null_count() > 0 {
                return Err(CudaError::InvalidArgument(format!(
                    "column {:?} is not nullable but has {} nulls",
                    field.name(),
                    column.null_count()
                )));
            }
            let ctx = column.stream.context();
            if ctx.cu_ctx() != stream.context().cu_ctx() {
                return Err(CudaError::DeviceMismatch {
                    expected: stream.context().ordinal() as i64,
                    found: ctx.ordinal() as i64,
                });
            }
            stream_waits_for(&stream, &column.stream)?;
            children.push(column.data);
        }
        // SAFETY: a struct array of `len` rows without nulls whose children (checked
        // above) all have `len` rows and the fields' types; no buffer is read.
        let data = unsafe {
            ArrayData::builder(DataType::Struct(fields))
                .len(len)
                .child_data(children)
                .build_unchecked()
        };
        Ok((data, stream))
    }
}

/// Whether `slice`, if any, belongs to `stream`.
fn on_stream<T>(stream: &CudaStream, slice: Option<&CudaSlice<T>>) -> bool {
    slice.is_none_or(|s| s.stream().cu_stream() == stream.cu_stream())
}

/// The validity bitmap of an array of `len` rows on `stream`, as arrow-rs holds it: at
/// least `ceil(len / 8)` bytes on the stream's context, with its null count (`None`:
/// counted on the GPU, which blocks the host until counted).
fn nulls(
    stream: &Arc<CudaStream>,
    len: usize,
    validity: Option<(CudaSlice<u8>, Option<usize>)>,
) -> Result<Option<NullBuffer>> {
    let Some((validity, null_count)) = validity else {
        return Ok(None);
    };
    let ctx = stream.context();
    let needed = len.div_ceil(8);
    if validity.len() < needed {
        return Err(CudaError::BufferTooShort {
            buffer: "validity",
            bytes: validity.len(),
            needed,
        });
    }
    same_context(ctx, validity.context())?;
    if let Some(n) = null_count.filter(|&n| n > len) {
        return Err(CudaError::InvalidArgument(format!(
            "a null count of {n} for {len} rows"
        )));
    }
    // The export's event is recorded on the values' stream: order the bitmap's writes
    // before it.
    stream_waits_for(stream, validity.stream())?;
    let bitmap_ptr = address_for_reads(&validity, stream);
    let null_count = match null_count {
        Some(n) => n,
        None => {
            let bitmap = Bitmap {
                ptr: bitmap_ptr,
                len: validity.len(),
                device: ctx.ordinal() as i64,
            };
            len - kernels::count_set_bits(stream, &bitmap, 0, len)? as usize
        }
    };
    // SAFETY: the buffer is only exported (address and length), never read.
    let bits = unsafe { device_buffer(validity, bitmap_ptr) };
    // `BooleanBuffer::new` checks the length only (8 bits per byte), reads nothing.
    let bits = BooleanBuffer::new(bits, 0, len);
    // SAFETY: `null_count` is the number of unset bits among the first `len` (counted
    // above, or the caller's count, which arrow-rs never checks here: the buffer is not
    // read on the host).
    Ok(Some(unsafe { NullBuffer::new_unchecked(bits, null_count) }))
}

/// Checks that a slice (a bitmap, a variadic buffer) belongs to the values' context.
fn same_context(values: &CudaContext, other: &CudaContext) -> Result<()> {
    if other.ordinal() != values.ordinal() {
        return Err(CudaError::DeviceMismatch {
            expected: values.ordinal() as i64,
            found: other.ordinal() as i64,
        });
    }
    if other.cu_ctx() != values.cu_ctx() {
        return Err(CudaError::InvalidArgument(
            "a slice belongs to another CUDA context than the values".into(),
        ));
    }
    Ok(())
}
