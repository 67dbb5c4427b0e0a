//! [`DeviceArray`]: an owned `ArrowDeviceArray` that calls `release` exactly once.

use std::ffi::c_void;

use crate::error::{Error, Result};
use crate::ffi::{ArrowArray, ArrowDeviceArray, ArrowDeviceType, FFI_ArrowArray};

/// An owned, unreleased `ArrowDeviceArray`.
///
/// Dropping it calls the embedded array's `release` callback exactly once. Moving one in
/// from a raw pointer ([`DeviceArray::from_raw`]) marks the source released, as the
/// specification's "Moving an array" requires; moving one out ([`DeviceArray::move_into`],
/// [`DeviceArray::into_raw`]) hands the duty to release to the receiver.
///
/// # Invariant
///
/// A `DeviceArray` always holds an array that meets the contract of
/// [`DeviceArray::try_new`] (a C Device Data Interface array from a conforming producer):
/// safe code relies on it to follow the struct's pointers, read host-readable buffers
/// (after [`crate::layout`] has checked the layout against the schema), wait on
/// `sync_event` and call `release`. The constructors that cannot check it are `unsafe`.
///
/// # Example
///
/// A C consumer receives the struct; moving it back in marks the source released, so
/// `release` runs once, when the owner drops:
///
/// ```
/// use arrow_array::Int64Array;
/// use devarrow_abi::{cpu, ArrowDeviceArray, DeviceArray, Error};
///
/// # fn main() -> devarrow_abi::Result<()> {
/// let (array, _schema) = cpu::export_array(&Int64Array::from(vec![1, 2, 3]))?;
/// assert_eq!(array.array().length, 3);
/// assert_eq!(array.device_id(), -1); // the CPU
///
/// let mut c_struct = ArrowDeviceArray::empty();
/// // SAFETY: `c_struct` is valid for writes; it now owns the array.
/// unsafe { array.move_into(&mut c_struct) };
/// // SAFETY: `c_struct` holds an unreleased array from a conforming producer.
/// let owned = unsafe { DeviceArray::from_raw(&mut c_struct) }?;
/// assert!(c_struct.is_released()); // moved out: nothing left to release there
///
/// // A released struct is a typed error, not a second owner.
/// // SAFETY: `c_struct` is released.
/// let again = unsafe { DeviceArray::from_raw(&mut c_struct) };
/// assert!(matches!(again, Err(Error::Released { .. })));
/// drop(owned); // calls the producer's release, exactly once
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct DeviceArray {
    raw: ArrowDeviceArray,
}

// SAFETY: the release callbacks may run on any thread (contract of the unsafe `try_new`,
// as the C data interface allows), and the struct itself is plain data in CPU memory;
// arrow-rs makes the same promise for FFI_ArrowArray.
unsafe impl Send for DeviceArray {}
// SAFETY: `&DeviceArray` only reads plain fields; nothing mutates through a shared reference.
unsafe impl Sync for DeviceArray {}

impl DeviceArray {
    /// Takes ownership of a device array by value.
    ///
    /// Fails with [`Error::Released`] when the array is released (there is then nothing to
    /// own and nothing to release).
    ///
    /// # Safety
    /// `raw` must be released, or filled by a producer following the C Device Data
    /// Interface and not released since:
    /// - `raw.array` is [well-formed](ArrowArray#well-formed-arrays) (its `buffers`,
    ///   `children` and `dictionary` pointers valid for the counts it states);
    /// - its buffers live on the device `device_type`/`device_id` name and, for as long as
    ///   it is unreleased, hold at least the bytes the C data interface gives them for each
    ///   struct's (non-negative) `length` and `offset`, and, for the data buffer of a
    ///   variable-length type, up to its last offset;
    /// - if `device_type` has an event type, `sync_event` is NULL or points to a live event
    ///   of that type;
    /// - its `release` callbacks may be called once each, from any thread.
    ///
    /// The layout itself need not be right: buffer and child counts against a schema,
    /// negative or overflowing lengths and offsets, NULL buffers, non-monotonic offsets and
    /// a `sync_event` on a device without events are what importers check, with typed
    /// errors.
    pub unsafe fn try_new(raw: ArrowDeviceArray) -> Result<Self> {
        if raw.is_released() {
            return Err(Error::Released {
                what: "ArrowDeviceArray",
            });
        }
        Ok(Self { raw })
    }

    /// Moves the device array out of `ptr`, marking the source released (its `release` set
    /// to NULL without being called).
    ///
    /// # Safety
    /// `ptr` must be NULL or point to a valid, writable `ArrowDeviceArray` that meets the
    /// contract of [`DeviceArray::try_new`].
    pub unsafe fn from_raw(ptr: *mut ArrowDeviceArray) -> Result<Self> {
        if ptr.is_null() {
            return Err(Error::NullPointer {
                what: "ArrowDeviceArray",
            });
        }
        // SAFETY: the caller guarantees `ptr` is valid for reads and writes. Reading it
        // bitwise and then writing a released struct back is the spec's "move".
        let raw = unsafe { std::ptr::replace(ptr, ArrowDeviceArray::empty()) };
        // SAFETY: the caller guarantees the struct meets `try_new`'s contract.
        unsafe { Self::try_new(raw) }
    }

    /// Wraps an arrow-rs [`FFI_ArrowArray`] with its device placement. Every `reserved`
    /// word is zeroed.
    ///
    /// # Safety
    /// The placement must be true: the buffers of `array` live on the device
    /// `device_type`/`device_id` name (an `FFI_ArrowArray` made by arrow-rs from its own
    /// `ArrayData` has host memory: use [`crate::ArrowDeviceType::CPU`] and
    /// [`crate::cpu::CPU_DEVICE_ID`]), and `sync_event` is as [`DeviceArray::try_new`]
    /// requires (NULL, or for a device type with events a pointer to a live event).
    pub unsafe fn from_ffi(
        array: FFI_ArrowArray,
        device_type: ArrowDeviceType,
        device_id: i64,
        sync_event: *mut c_void,
    ) -> Result<Self> {
        // SAFETY: an `FFI_ArrowArray` is released or well-formed (arrow-rs builds it from
        // valid `ArrayData`, or its unsafe `from_raw` caller vouched for it), with buffers
        // sized for its structs; the caller guarantees the placement and the event.
        unsafe {
            Self::try_new(ArrowDeviceArray {
                array: ArrowArray::from_ffi(array),
                device_id,
                device_type,
                sync_event,
                reserved: [0; 3],
            })
        }
    }

    /// The device type the buffers live on.
    pub fn device_type(&self) -> ArrowDeviceType {
        self.raw.device_type
    }

    /// The device id (-1 for the CPU).
    pub fn device_id(&self) -> i64 {
        self.raw.device_id
    }

    /// The synchronization event (NULL when the data is ready).
    pub fn sync_event(&self) -> *mut c_void {
        self.raw.sync_event
    }

    /// The embedded `ArrowArray` (structs in CPU memory, buffers on the device). It is
    /// [well-formed](ArrowArray#well-formed-arrays) and unreleased, as
    /// [`DeviceArray::try_new`] requires, so its pointers may be followed.
    pub fn array(&self) -> &ArrowArray {
        &self.raw.array
    }

    /// The whole C struct.
    pub fn as_raw(&self) -> &ArrowDeviceArray {
        &self.raw
    }

    /// Gives up ownership: the returned struct is unreleased and whoever holds it must
    /// release it (or move it to C, which will).
    pub fn into_raw(self) -> ArrowDeviceArray {
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: `this` is never used or dropped again, so reading `raw` out moves it.
        unsafe { std::ptr::read(&this.raw) }
    }

    /// Moves the device array into the consumer-allocated struct at `out` (overwriting it
    /// without releasing what was there, as a consumer hands over a released struct).
    ///
    /// # Safety
    /// `out` must be valid for writes of an `ArrowDeviceArray`.
    pub unsafe fn move_into(self, out: *mut ArrowDeviceArray) {
        // SAFETY: the caller guarantees `out` is valid for writes.
        unsafe { std::ptr::write(out, self.into_raw()) }
    }

    /// Splits into arrow-rs's [`FFI_ArrowArray`] (which owns the release from now on) and the
    /// device placement `(device_type, device_id, sync_event)`.
    pub fn into_ffi(self) -> (FFI_ArrowArray, ArrowDeviceType, i64, *mut c_void) {
        let raw = self.into_raw();
        (
            // SAFETY: a DeviceArray holds a well-formed, unreleased array whose release
            // may be called once (the contract of `try_new`); ownership moves to arrow-rs.
            unsafe { raw.array.into_ffi() },
            raw.device_type,
            raw.device_id,
            raw.sync_event,
        )
    }
}

impl Drop for DeviceArray {
    fn drop(&mut self) {
        if let Some(release) = self.raw.array.release {
            // SAFETY: the struct is unreleased and owned by us, and its release may be called
            // once (contract of `try_new`); the callback is the producer's and receives a
            // pointer to the (moved) struct, as the spec allows.
            unsafe { release(&mut self.raw.array) };
            // A conforming producer marks it released; make sure regardless.
            self.raw.array.release = None;
        }
    }
}
