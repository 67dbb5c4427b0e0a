//! Moving an `ArrowSchema` across the C boundary, the counterpart of
//! [`DeviceArray::from_raw`](crate::DeviceArray::from_raw) and
//! [`DeviceArray::move_into`](crate::DeviceArray::move_into) for schemas.
//!
//! [`ArrowSchema`] is arrow-rs's `FFI_ArrowSchema` (the C struct, 72 bytes), re-exported so
//! that users need no `arrow-schema` dependency of their own.
//!
//! # Example
//!
//! Export an arrow-rs schema (`ArrowSchema::try_from`), move it into storage a C consumer
//! owns ([`move_schema_into`]), take it back out ([`take_schema`]) and read it
//! ([`import_schema`]); the struct left behind is released, so taking it twice is an
//! error, never a double free.
//!
//! ```
//! use arrow_schema::{DataType, Field, Schema};
//! use devarrow_abi::schema::{import_data_type, import_schema};
//! use devarrow_abi::{move_schema_into, take_schema, ArrowSchema, Error};
//!
//! # fn main() -> devarrow_abi::Result<()> {
//! let schema = Schema::new(vec![
//!     Field::new("id", DataType::Int64, false),
//!     Field::new("tags", DataType::new_list(DataType::Utf8, true), true),
//! ]);
//!
//! // Export, and hand it to C (a struct on our stack stands for the consumer's).
//! let exported = ArrowSchema::try_from(&schema)?;
//! let mut c_struct = ArrowSchema::empty();
//! // SAFETY: `c_struct` is valid for writes.
//! unsafe { move_schema_into(exported, &mut c_struct) };
//!
//! // Take it back (the consumer's struct is marked released) and read it.
//! // SAFETY: `c_struct` is a valid ArrowSchema.
//! let taken = unsafe { take_schema(&mut c_struct) }?;
//! assert_eq!(import_schema(&taken)?, schema);
//! assert!(matches!(import_data_type(&taken)?, DataType::Struct(fields) if fields.len() == 2));
//!
//! // Taking it again: released, a typed error.
//! // SAFETY: as above.
//! let again = unsafe { take_schema(&mut c_struct) };
//! assert!(matches!(again, Err(Error::Released { .. })));
//! # Ok(())
//! # }
//! ```

use std::panic::{catch_unwind, AssertUnwindSafe};

use arrow_schema::{ArrowError, DataType, Field, Schema};

use crate::error::{Error, Result};
use crate::ffi::{schema_is_released, ArrowSchema};
use crate::panic::{drop_payload, panic_message};

/// Fails with [`Error::Released`] for a released schema (whose fields must not be read).
pub fn check_schema(schema: &ArrowSchema) -> Result<()> {
    if schema_is_released(schema) {
        return Err(Error::Released {
            what: "ArrowSchema",
        });
    }
    Ok(())
}

/// Runs arrow-rs's reading of a foreign schema, turning an error *or a panic* into
/// [`Error::Schema`]: arrow-rs asserts, rather than failing, on a NULL or non-UTF-8
/// `format` or `name`, and on a nested format whose children are missing (`"+l"` with
/// `n_children` 0). Those are a producer's mistakes that cost no memory safety, so they
/// are typed errors here, never a panic into the caller (or across a C boundary).
fn read_schema<T>(
    schema: &ArrowSchema,
    read: impl FnOnce(&ArrowSchema) -> std::result::Result<T, ArrowError>,
) -> Result<T> {
    check_schema(schema)?;
    match catch_unwind(AssertUnwindSafe(|| read(schema))) {
        Ok(result) => result.map_err(Error::Schema),
        Err(payload) => {
            let message = format!(
                "arrow-rs cannot read the ArrowSchema: {}",
                panic_message(&*payload)
            );
            drop_payload(payload);
            Err(Error::Schema(ArrowError::CDataInterface(message)))
        }
    }
}

/// Reads a foreign record batch schema (a struct schema; its metadata kept). A released
/// schema is [`Error::Released`]; one arrow-rs cannot read is [`Error::Schema`] (also
/// where arrow-rs itself would panic; see [`import_data_type`]).
pub fn import_schema(schema: &ArrowSchema) -> Result<Schema> {
    read_schema(schema, |s| Schema::try_from(s))
}

/// Reads a foreign schema as a field (name, type, nullability, metadata); errors as
/// [`import_schema`].
pub fn import_field(schema: &ArrowSchema) -> Result<Field> {
    read_schema(schema, |s| Field::try_from(s))
}

/// Reads a foreign schema's data type; errors as [`import_schema`].
///
/// Fuzzing found that arrow-rs's `TryFrom<&FFI_ArrowSchema>` panics on a NULL or
/// non-UTF-8 format string and on a list format without a child, so every schema
/// devarrow reads from a producer goes through these three functions.
pub fn import_data_type(schema: &ArrowSchema) -> Result<DataType> {
    read_schema(schema, |s| DataType::try_from(s))
}

/// Moves the schema out of `ptr`, marking the source released (its `release` set to NULL
/// without being called), as the C data interface's "move" does. The schema returned
/// releases itself when dropped. A NULL pointer is [`Error::NullPointer`]; a released
/// schema is [`Error::Released`] (nothing to release).
///
/// # Safety
/// `ptr` must be NULL or point to a valid, writable `ArrowSchema`, released or not.
pub unsafe fn take_schema(ptr: *mut ArrowSchema) -> Result<ArrowSchema> {
    if ptr.is_null() {
        return Err(Error::NullPointer {
            what: "ArrowSchema",
        });
    }
    // SAFETY: the caller guarantees `ptr` is valid for reads and writes; arrow-rs's
    // `from_raw` reads it bitwise and writes a released struct back.
    let schema = unsafe { ArrowSchema::from_raw(ptr) };
    check_schema(&schema)?;
    Ok(schema)
}

/// Moves `schema` into the consumer's storage at `out`: from then on the consumer owns it
/// and calls its `release`. Whatever `out` held is overwritten without being released.
///
/// # Safety
/// `out` must be valid for writes of an `ArrowSchema`.
pub unsafe fn move_schema_into(schema: ArrowSchema, out: *mut ArrowSchema) {
    // SAFETY: the caller guarantees `out` is writable; the move hands ownership over.
    unsafe { std::ptr::write(out, schema) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_schema::{DataType, Field};

    #[test]
    fn a_schema_moves_out_and_back_in() {
        let field = Field::new("x", DataType::Int32, true);
        let mut c_side = ArrowSchema::empty();
        // SAFETY: `c_side` is writable.
        unsafe { move_schema_into(ArrowSchema::try_from(&field).unwrap(), &mut c_side) };
        // SAFETY: `c_side` holds the schema moved in above.
        let taken = unsafe { take_schema(&mut c_side) }.unwrap();
        assert_eq!(Field::try_from(&taken).unwrap(), field);
        // The source is released now: taking it again is an error, and nothing leaks.
        // SAFETY: `c_side` is a valid (released) schema.
        let again = unsafe { take_schema(&mut c_side) }.unwrap_err();
        assert!(matches!(again, Error::Released { .. }), "{again}");
        // SAFETY: NULL is allowed.
        let null = unsafe { take_schema(std::ptr::null_mut()) }.unwrap_err();
        assert!(matches!(null, Error::NullPointer { .. }), "{null}");
    }
}
