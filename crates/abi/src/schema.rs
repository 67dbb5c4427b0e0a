//! Moving an `ArrowSchema` across the C boundary, the counterpart of
//! [`DeviceArray::from_raw`](crate::DeviceArray::from_raw) and
//! [`DeviceArray::move_into`](crate::DeviceArray::move_into) for schemas.
//!
//! [`ArrowSchema`] is arrow-rs's `FFI_ArrowSchema` (the C struct, 72 bytes), re-exported so
//! that users need no `arrow-schema` dependency of their own.

use crate::error::{Error, Result};
use crate::ffi::ArrowSchema;

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
    crate::cpu::check_schema(&schema)?;
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
