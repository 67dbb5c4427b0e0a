//! One call per crossing of the C boundary: a record batch in from a C producer's
//! (`ArrowDeviceArray*`, `ArrowSchema*`) pair ([`DeviceBatch::import_raw`]), and out into
//! a C consumer's storage ([`DeviceBatch::export_to`]).

use std::sync::Arc;

use devarrow_abi::device::Device;
use devarrow_abi::{
    move_schema_into, take_schema, ArrowDeviceArray, ArrowSchema, DeviceArray, Result,
};

use crate::batch::DeviceBatch;
use crate::export_options::ExportOptions;

impl DeviceBatch {
    /// Imports a record batch from a C producer's pair of structs in one call: both are
    /// moved out of the caller's storage first (marked released there), so each is
    /// released exactly once on every path. The schema when this returns; the array when
    /// the batch and its exports are dropped, or at once on any error: a NULL pointer, a
    /// released struct, a schema that does not parse, an array that does not match it or
    /// lives on another device ([`DeviceBatch::import`] says what is checked).
    ///
    /// # Safety
    /// Each pointer must be NULL or point to a valid, writable struct; an unreleased
    /// `array` must meet the contract of [`DeviceArray::try_new`] (in particular its
    /// buffers are device memory of the type and id it names, and `sync_event` is NULL or
    /// points to a live event of that device type).
    pub unsafe fn import_raw(
        device: Arc<dyn Device>,
        array: *mut ArrowDeviceArray,
        schema: *mut ArrowSchema,
    ) -> Result<DeviceBatch> {
        // Both are taken before either is checked: an error about one still releases the
        // other (by dropping it).
        // SAFETY: the caller's guarantee for `schema`.
        let schema = unsafe { take_schema(schema) };
        // SAFETY: the caller's guarantee for `array`.
        let array = unsafe { DeviceArray::from_raw(array) };
        let (array, schema) = (array?, schema?);
        Self::import_with_ffi_schema(device, array, &schema)
    }

    /// Exports the batch into a C consumer's storage in one call: the `ArrowDeviceArray`
    /// to `array_out`, its `ArrowSchema` to `schema_out` (see [`DeviceBatch::export_with`]).
    /// On error neither is written.
    ///
    /// # Safety
    /// `array_out` and `schema_out` must be valid for writes; what they held is
    /// overwritten without being released.
    pub unsafe fn export_to(
        &self,
        options: ExportOptions,
        array_out: *mut ArrowDeviceArray,
        schema_out: *mut ArrowSchema,
    ) -> Result<()> {
        if array_out.is_null() || schema_out.is_null() {
            return Err(devarrow_abi::Error::NullPointer {
                what: "export destination",
            });
        }
        let (array, schema) = self.export_with(options)?;
        // SAFETY: the caller guarantees both destinations are writable.
        unsafe {
            array.move_into(array_out);
            move_schema_into(schema, schema_out);
        }
        Ok(())
    }
}
