//! The CPU device: arrow-rs arrays and record batches as `ArrowDeviceArray`s with
//! `ARROW_DEVICE_CPU`, `device_id` -1 and a NULL `sync_event`, zero-copy both ways.
//!
//! A record batch travels as a struct array whose top-level schema carries the batch's
//! metadata (spec: "Record batches").

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use arrow_array::ffi::from_ffi_and_data_type;
use arrow_array::{make_array, Array, ArrayRef, RecordBatch, RecordBatchOptions, StructArray};
use arrow_data::ffi::FFI_ArrowArray;
use arrow_data::ArrayData;
use arrow_schema::ffi::FFI_ArrowSchema;
use arrow_schema::{ArrowError, DataType, Field, SchemaRef};

use crate::device_array::DeviceArray;
use crate::empty_offsets;
use crate::error::{Error, Result};
use crate::ffi::ArrowDeviceType;
use crate::layout;

/// The `device_id` of CPU arrays.
pub const CPU_DEVICE_ID: i64 = -1;

/// Exports arrow-rs array data as a CPU device array, zero-copy (the buffers are shared
/// with `data` and kept alive until `release`).
pub fn export_array_data(data: &ArrayData) -> DeviceArray {
    // SAFETY: arrow-rs's `ArrayData` lives in host memory, so the CPU placement with no
    // sync event is true.
    unsafe {
        DeviceArray::from_ffi(
            FFI_ArrowArray::new(data),
            ArrowDeviceType::CPU,
            CPU_DEVICE_ID,
            std::ptr::null_mut(),
        )
    }
    .expect("FFI_ArrowArray::new always returns an unreleased array")
}

/// Exports an arrow-rs array and the schema of its type as a CPU device array.
pub fn export_array(array: &dyn Array) -> Result<(DeviceArray, FFI_ArrowSchema)> {
    let data = array.to_data();
    let schema = FFI_ArrowSchema::try_from(data.data_type())?;
    Ok((export_array_data(&data), schema))
}

/// Exports an array with its field (name, nullability, metadata such as extension types).
pub fn export_field_array(
    field: &Field,
    array: &dyn Array,
) -> Result<(DeviceArray, FFI_ArrowSchema)> {
    if field.data_type() != array.data_type() {
        return Err(Error::InvalidArgument(format!(
            "field {:?} is {} but the array is {}",
            field.name(),
            field.data_type(),
            array.data_type()
        )));
    }
    let schema = FFI_ArrowSchema::try_from(field)?;
    Ok((export_array_data(&array.to_data()), schema))
}

/// Exports a record batch as a CPU struct array plus its schema (metadata included).
pub fn export_record_batch(batch: &RecordBatch) -> Result<(DeviceArray, FFI_ArrowSchema)> {
    let schema = FFI_ArrowSchema::try_from(batch.schema().as_ref())?;
    Ok((export_batch_array(batch), schema))
}

/// Exports only the struct array of a record batch (no schema): what a stream sends after
/// its schema.
pub fn export_batch_array(batch: &RecordBatch) -> DeviceArray {
    export_array_data(&StructArray::from(batch.clone()).into_data())
}

fn check_cpu(array: &DeviceArray) -> Result<()> {
    if array.device_type() != ArrowDeviceType::CPU {
        return Err(Error::UnsupportedDevice {
            found: array.device_type(),
            accepted: ArrowDeviceType::CPU.to_string(),
        });
    }
    if !array.sync_event().is_null() {
        return Err(Error::UnexpectedSyncEvent {
            device_type: array.device_type(),
        });
    }
    Ok(())
}

/// Imports a CPU device array of type `data_type`, zero-copy, after validating it.
///
/// The array is consumed: on success its release runs when the last arrow-rs buffer
/// sharing it drops; on error it is released before returning.
pub fn import_array_as(array: DeviceArray, data_type: &DataType) -> Result<ArrayRef> {
    Ok(make_array(import_data_as(array, data_type, Checks::Full)?))
}

/// What an import checks of the values once the structure holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Checks {
    /// arrow-rs's `validate_full`: UTF-8 included.
    Full,
    /// The same but that strings are UTF-8 ([`import_record_batch_trusting_utf8`]).
    TrustUtf8,
}

/// [`import_array_as`], as `ArrayData` (validated in full, or but for UTF-8).
fn import_data_as(array: DeviceArray, data_type: &DataType, checks: Checks) -> Result<ArrayData> {
    check_cpu(&array)?;
    // `validate_host_import` checks the structs before reading any offset, and refuses
    // unaligned buffers that arrow-rs reads in place, as aligned integers (a typed error;
    // the bridge's import copies them and accepts them).
    // SAFETY: a DeviceArray's array is well-formed, its buffers on its device and sized as
    // the C data interface says for the structs (contract of the unsafe
    // `DeviceArray::try_new`); CPU buffers are host-readable.
    unsafe { layout::validate_host_import(array.array(), data_type, "array")? };
    // Empty arrays whose offsets are NULL get a zero offset arrow-rs can read (see
    // `layout`, "NULL offsets of empty arrays").
    // SAFETY: the array is well-formed, unreleased and structurally valid for `data_type`
    // (validated above); it is moved into the shadow or returned as it is.
    let root = unsafe { empty_offsets::shadow(array.into_raw().array, data_type) };
    // SAFETY: `root` is unreleased, well-formed and ours; arrow-rs releases it once.
    let ffi = unsafe { root.into_ffi() };
    let data_type = data_type.clone();
    // arrow-rs asserts on some malformed input; a panic must not escape. The FFI array is
    // moved into arrow-rs and released by it (also while unwinding).
    // The normalization and the full validation too: arrow-rs's `ArrayData::new_empty`
    // panics on some types a schema can name (fuzzing found one that got past the layout
    // checks, now refused there; this keeps any other from escaping).
    let data = catch_unwind(AssertUnwindSafe(move || {
        // SAFETY: the structure and the offsets were validated against `data_type` above,
        // so arrow-rs reads only buffer ranges that `DeviceArray::try_new`'s contract
        // guarantees (buffers as large as the C data interface requires).
        let data = unsafe { from_ffi_and_data_type(ffi, data_type) }?;
        let data = normalize_empty(data);
        match checks {
            Checks::Full => data.validate_full()?,
            Checks::TrustUtf8 => validate_imported_but_utf8(&data)?,
        }
        Ok::<_, arrow_schema::ArrowError>(data)
    }))
    .map_err(Error::from_panic)??;
    Ok(data)
}

/// arrow-rs's `validate_full` of `data` and its children, node by node, but for the
/// UTF-8 of strings: `Utf8`/`LargeUtf8` are checked as `Binary`/`LargeBinary` (every
/// offset non-negative, monotonic, inside the data), `Utf8View` as `BinaryView` (each
/// view's buffer index, offset and length inside its buffer). Every other check
/// (dictionary keys, union type ids, list and run-end offsets, ...) is made as
/// `validate_full` makes it: what passes is safe to read as bytes, and a `str` read of
/// its strings is sound only where the strings are known to be UTF-8
/// ([`import_record_batch_trusting_utf8`]).
pub fn validate_full_but_utf8(data: &ArrayData) -> std::result::Result<(), ArrowError> {
    data.validate()?;
    data.validate_nulls()?;
    let as_binary = match data.data_type() {
        DataType::Utf8 => Some(DataType::Binary),
        DataType::LargeUtf8 => Some(DataType::LargeBinary),
        DataType::Utf8View => Some(DataType::BinaryView),
        _ => None,
    };
    match as_binary {
        Some(binary) => {
            let as_binary = data.clone().into_builder().data_type(binary);
            // SAFETY: the same buffers read as the binary type of the same layout (the same
            // offsets or views and data buffers); only validated, then dropped.
            unsafe { as_binary.build_unchecked() }.validate_values()?;
        }
        None => data.validate_values()?,
    }
    data.child_data()
        .iter()
        .try_for_each(validate_full_but_utf8)
}

/// [`validate_full_but_utf8`] of data imported from a C array that
/// `layout::validate_host_import` accepted, less what that already checked. The end
/// offsets of `Utf8`, `Binary`, lists and maps are not walked a second time: every one was
/// checked non-negative and monotonic there, and the last no further than the child's
/// length. arrow-rs sizes a string's data buffer by its last offset. Walking them again
/// took 14% of a Python upload's host time on the CPU device (105 MB of `lineitem`).
fn validate_imported_but_utf8(data: &ArrayData) -> std::result::Result<(), ArrowError> {
    data.validate()?;
    data.validate_nulls()?;
    match data.data_type() {
        data_type if layout::has_end_offsets(data_type) => {}
        DataType::Utf8View => {
            let as_binary = data.clone().into_builder().data_type(DataType::BinaryView);
            // SAFETY: the same buffers read as the binary type of the same layout (the same
            // views and data buffers); only validated, then dropped.
            unsafe { as_binary.build_unchecked() }.validate_values()?;
        }
        _ => data.validate_values()?,
    }
    data.child_data()
        .iter()
        .try_for_each(validate_imported_but_utf8)
}

/// Replaces every zero-length node of `data` with a canonical empty array.
///
/// A zero-length variable-length array may legally carry a nonzero first offset (an
/// empty slice exports that way), but arrow-rs imports its values buffer as empty when the
/// C `offset` is 0 and then rejects the offsets. Nothing of a zero-length node is visible,
/// so replacing it loses nothing.
fn normalize_empty(data: ArrayData) -> ArrayData {
    if data.is_empty() {
        return ArrayData::new_empty(data.data_type());
    }
    let children = data.child_data();
    if !children
        .iter()
        .any(|c| c.is_empty() || !c.child_data().is_empty())
    {
        return data;
    }
    let children: Vec<ArrayData> = children.iter().cloned().map(normalize_empty).collect();
    // SAFETY: only zero-length children are replaced, by valid empty arrays of the same
    // type; lengths, offsets and buffers of every node are unchanged otherwise, and the
    // result is validated in full by the caller.
    unsafe { data.into_builder().child_data(children).build_unchecked() }
}

/// Fails with [`Error::Released`] for a released schema (whose fields must not be read).
pub fn check_schema(schema: &FFI_ArrowSchema) -> Result<()> {
    crate::schema::check_schema(schema)
}

/// Imports a CPU device array with its schema, zero-copy, after validating it against
/// the schema. The array is consumed (released on error).
pub fn import_array(array: DeviceArray, schema: &FFI_ArrowSchema) -> Result<ArrayRef> {
    let data_type = crate::schema::import_data_type(schema)?;
    import_array_as(array, &data_type)
}

/// Imports a CPU device array with its schema as a field (name, nullability, metadata)
/// and an array.
pub fn import_field_array(
    array: DeviceArray,
    schema: &FFI_ArrowSchema,
) -> Result<(Field, ArrayRef)> {
    let field = crate::schema::import_field(schema)?;
    let array = import_array_as(array, field.data_type())?;
    Ok((field, array))
}

/// Imports a CPU struct array with its schema as a record batch (schema metadata kept).
/// The array is consumed (released on error).
pub fn import_record_batch(array: DeviceArray, schema: &FFI_ArrowSchema) -> Result<RecordBatch> {
    let schema = crate::schema::import_schema(schema)?;
    import_record_batch_with_schema(array, Arc::new(schema))
}

/// Imports a CPU struct array as a record batch of a schema already known (as in a stream).
pub fn import_record_batch_with_schema(
    array: DeviceArray,
    schema: SchemaRef,
) -> Result<RecordBatch> {
    let struct_type = DataType::Struct(schema.fields().clone());
    let data = import_data_as(array, &struct_type, Checks::Full)?;
    struct_data_to_batch(data, schema)
}

/// [`import_record_batch`] with every check but one: that the bytes of strings
/// (`Utf8`, `LargeUtf8`, `Utf8View`) are UTF-8. Structure, offsets, views, dictionary
/// keys and union type ids are checked as there: a malformed array is still a typed
/// error, and nothing reads outside its buffers. The UTF-8 check reads every string's
/// bytes, and it is most of an import's cost (1 to 2 ns per string): skip it where the
/// data only moves as bytes, to a device and to C consumers, as arrow-rs's `from_ffi`
/// and pyarrow's import do (pyarrow checks UTF-8 in `validate(full=True)` only).
///
/// # Safety
/// The strings are UTF-8, or no code reads the batch's strings as `str` (arrow-rs's
/// `StringArray::value` and every kernel over strings assume UTF-8): the batch is only
/// copied, exported or handed back to the producer's side as bytes.
pub unsafe fn import_record_batch_trusting_utf8(
    array: DeviceArray,
    schema: &FFI_ArrowSchema,
) -> Result<RecordBatch> {
    let schema = Arc::new(crate::schema::import_schema(schema)?);
    let struct_type = DataType::Struct(schema.fields().clone());
    let data = import_data_as(array, &struct_type, Checks::TrustUtf8)?;
    struct_data_to_batch(data, schema)
}

/// [`struct_array_to_batch`] of struct data imported (and validated in full) as the
/// struct type of `schema`: its children become the columns as they are (sliced to the
/// struct's rows where it is a slice), with no `StructArray` built in between, and of the
/// checks of `RecordBatch::try_new` only the one the import has not made already: that
/// non-nullable fields hold no nulls.
fn struct_data_to_batch(data: ArrayData, schema: SchemaRef) -> Result<RecordBatch> {
    if data.null_count() > 0 {
        return Err(top_level_nulls(data.null_count()));
    }
    let (offset, len) = (data.offset(), data.len());
    let (.., children) = data.into_parts();
    let columns: Vec<ArrayRef> = children
        .into_iter()
        .map(|child| match offset != 0 || child.len() != len {
            true => make_array(crate::slice_data(&child, offset, len)),
            false => make_array(child),
        })
        .collect();
    if columns.len() != schema.fields().len() {
        return Err(Error::InvalidArgument(format!(
            "{} columns for a schema of {} fields",
            columns.len(),
            schema.fields().len()
        )));
    }
    for (column, field) in columns.iter().zip(schema.fields()) {
        if !field.is_nullable() && column.null_count() > 0 {
            return Err(Error::Arrow(ArrowError::InvalidArgumentError(format!(
                "Column '{}' is declared as non-nullable but contains null values",
                field.name()
            ))));
        }
    }
    // SAFETY: one column per field, each of its field's type (imported as the schema's
    // struct type and validated in full), `len` rows each (sliced to the struct's rows),
    // no nulls where a field is not nullable (checked above).
    Ok(unsafe { RecordBatch::new_unchecked(schema, columns, len) })
}

fn top_level_nulls(count: usize) -> Error {
    Error::InvalidArgument(format!(
        "a record batch cannot have top-level nulls, but the struct array has {count}"
    ))
}

/// Turns an imported struct array into a record batch of `schema`.
pub fn struct_array_to_batch(array: ArrayRef, schema: SchemaRef) -> Result<RecordBatch> {
    if array.null_count() > 0 {
        return Err(top_level_nulls(array.null_count()));
    }
    let struct_array = array
        .as_any()
        .downcast_ref::<StructArray>()
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "expected a struct array, got {}",
                array.data_type()
            ))
        })?;
    let options = RecordBatchOptions::new().with_row_count(Some(struct_array.len()));
    Ok(RecordBatch::try_new_with_options(
        schema,
        struct_array.columns().to_vec(),
        &options,
    )?)
}
