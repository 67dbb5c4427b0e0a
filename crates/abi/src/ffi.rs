//! The `#[repr(C)]` structs of the Arrow C Device Data Interface, bound to the canonical
//! `abi.h` of Apache Arrow (see `include/arrow_c_device.h` for the C side).
//!
//! These are plain data: they own nothing by themselves and never call `release` on drop.
//! The owning wrappers ([`crate::DeviceArray`], [`crate::DeviceArrayStream`]) and the
//! exporters build on them.

use std::ffi::{c_char, c_int, c_void};

pub use crate::device_type::ArrowDeviceType;
pub use arrow_data::ffi::FFI_ArrowArray;
pub use arrow_schema::ffi::FFI_ArrowSchema;

/// `struct ArrowSchema` of the C data interface: arrow-rs's own definition, so schemas pass
/// between arrow-rs and devarrow unchanged (it releases itself on drop).
pub type ArrowSchema = FFI_ArrowSchema;

/// `struct ArrowArray` of the C data interface, with its fields public.
///
/// Layout-identical to arrow-rs's [`FFI_ArrowArray`] (whose fields are private); convert
/// between the two without copying with [`ArrowArray::into_ffi`] and
/// [`ArrowArray::from_ffi`]. Like the C struct it owns nothing by itself: dropping it does
/// **not** call `release` (wrap it in a [`crate::DeviceArray`] for that).
///
/// # Well-formed arrays
///
/// Every field is public, so safe code can put any address in `buffers`, `children`,
/// `dictionary` or `release`. The functions that follow those pointers
/// ([`ArrowArray::buffer`], [`ArrowArray::child`], [`ArrowArray::dictionary`],
/// [`crate::layout::validate_structure`], ...) are therefore `unsafe`, and require the
/// struct to be **well-formed**: filled by a producer following the C data interface (or
/// by devarrow's exporters), and not released, so that
///
/// - a non-NULL `buffers` points to `n_buffers` readable buffer pointers,
/// - a non-NULL `children` points to `n_children` readable pointers, each NULL or pointing
///   to an `ArrowArray` that is released or itself well-formed,
/// - a non-NULL `dictionary` points to an `ArrowArray` that is released or well-formed,
///
/// all of it living (and not mutated) at least as long as the borrow of the struct. This
/// says nothing about the buffers themselves (their sizes, contents or device), nor that
/// the counts match any schema: checking those is the job of [`crate::layout`].
#[repr(C)]
#[derive(Debug)]
pub struct ArrowArray {
    /// Logical length of the array (number of items).
    pub length: i64,
    /// Number of null items, or -1 if not computed.
    pub null_count: i64,
    /// Logical offset inside the array, in items.
    pub offset: i64,
    /// Number of physical buffers backing this array.
    pub n_buffers: i64,
    /// Number of children this array has.
    pub n_children: i64,
    /// `n_buffers` pointers to the buffers (on the array's device).
    pub buffers: *mut *const c_void,
    /// `n_children` pointers to the children (always in CPU memory).
    pub children: *mut *mut ArrowArray,
    /// The dictionary of a dictionary-encoded array, or NULL.
    pub dictionary: *mut ArrowArray,
    /// Release callback; NULL marks a released struct.
    pub release: Option<unsafe extern "C" fn(array: *mut ArrowArray)>,
    /// Opaque producer data.
    pub private_data: *mut c_void,
}

const _: () = {
    assert!(std::mem::size_of::<ArrowArray>() == 80);
    assert!(std::mem::size_of::<ArrowArray>() == std::mem::size_of::<FFI_ArrowArray>());
    assert!(std::mem::align_of::<ArrowArray>() == std::mem::align_of::<FFI_ArrowArray>());
    assert!(std::mem::size_of::<FFI_ArrowSchema>() == 72);
};

/// Whether `schema` is released (its `release` callback is NULL): its other fields must
/// not be read.
///
/// The same on every arrow-rs version devarrow accepts: arrow-rs 59 has the callback as a
/// public field, 60 behind a `release()` getter.
pub fn schema_is_released(schema: &ArrowSchema) -> bool {
    // `struct ArrowSchema` of the C data interface, field by field (arrow-rs's is the same
    // `#[repr(C)]` struct with private fields): only its `release` slot is read.
    #[repr(C)]
    struct Layout {
        format: *const c_char,
        name: *const c_char,
        metadata: *const c_char,
        flags: i64,
        n_children: i64,
        children: *mut *mut Layout,
        dictionary: *mut Layout,
        release: Option<unsafe extern "C" fn(schema: *mut Layout)>,
        private_data: *mut c_void,
    }
    const _: () = {
        assert!(std::mem::size_of::<Layout>() == std::mem::size_of::<FFI_ArrowSchema>());
        assert!(std::mem::align_of::<Layout>() == std::mem::align_of::<FFI_ArrowSchema>());
    };
    let raw = (schema as *const ArrowSchema).cast::<Layout>();
    // arrow-rs's `FFI_ArrowSchema` is the `#[repr(C)]` `struct ArrowSchema` of the C data
    // interface, whose layout `Layout` repeats (same size and alignment, checked above).
    // SAFETY: so, `raw` coming from a live reference, the read is in bounds and aligned;
    // a nullable function pointer has no invalid bit pattern.
    let release = unsafe { std::ptr::addr_of!((*raw).release).read() };
    release.is_none()
}

impl ArrowArray {
    /// A released (empty) array: every field zero, `release` NULL. The state a consumer
    /// allocates before asking a producer to fill it.
    pub const fn empty() -> Self {
        Self {
            length: 0,
            null_count: 0,
            offset: 0,
            n_buffers: 0,
            n_children: 0,
            buffers: std::ptr::null_mut(),
            children: std::ptr::null_mut(),
            dictionary: std::ptr::null_mut(),
            release: None,
            private_data: std::ptr::null_mut(),
        }
    }

    /// Whether this struct is released (its `release` callback is NULL).
    pub fn is_released(&self) -> bool {
        self.release.is_none()
    }

    /// Converts into arrow-rs's [`FFI_ArrowArray`] without copying; ownership (the duty to
    /// call `release`) moves with it.
    ///
    /// # Safety
    /// `self` must be released, or [well-formed](ArrowArray#well-formed-arrays) with a
    /// `release` callback that is sound to call once: arrow-rs's safe API follows the
    /// struct's pointers and its `Drop` calls `release`.
    pub unsafe fn into_ffi(self) -> FFI_ArrowArray {
        // The caller guarantees the pointers arrow-rs will follow are valid.
        // SAFETY: both types are #[repr(C)] with the ten fields of the C `struct ArrowArray`
        // in the same order (sizes and alignments are asserted above); the release callback
        // types differ only in the pointee type of their argument, which is ABI-identical.
        unsafe { std::mem::transmute::<ArrowArray, FFI_ArrowArray>(self) }
    }

    /// Converts from arrow-rs's [`FFI_ArrowArray`] without copying; ownership moves with it.
    pub fn from_ffi(array: FFI_ArrowArray) -> Self {
        // SAFETY: see `into_ffi`: the two layouts are the C `struct ArrowArray`.
        unsafe { std::mem::transmute::<FFI_ArrowArray, ArrowArray>(array) }
    }

    /// Buffer pointer `i`, or NULL when `buffers` is NULL or `i` is out of range.
    ///
    /// # Safety
    /// `self` must be [well-formed](ArrowArray#well-formed-arrays): filled by a producer
    /// following the C data interface and not released, so that a non-NULL `buffers` points
    /// to `n_buffers` pointers.
    pub unsafe fn buffer(&self, i: usize) -> *const c_void {
        if self.buffers.is_null() || i as i64 >= self.n_buffers {
            return std::ptr::null();
        }
        // SAFETY: the caller guarantees a well-formed struct, whose non-NULL `buffers`
        // points to `n_buffers` pointers; `i < n_buffers` was checked above.
        unsafe { *self.buffers.add(i) }
    }

    /// Child `i`, or `None` when `children` is NULL, `i` is out of range or the slot is NULL.
    ///
    /// The child may be released; check [`ArrowArray::is_released`] before following its
    /// own pointers.
    ///
    /// # Safety
    /// `self` must be [well-formed](ArrowArray#well-formed-arrays): filled by a producer
    /// following the C data interface and not released, so that a non-NULL `children`
    /// points to `n_children` pointers, each NULL or pointing to a live `ArrowArray`.
    pub unsafe fn child(&self, i: usize) -> Option<&ArrowArray> {
        if self.children.is_null() || i as i64 >= self.n_children {
            return None;
        }
        // SAFETY: the caller guarantees a well-formed struct: `children` points to
        // `n_children` pointers (and `i` is in range), each NULL or pointing to a valid
        // ArrowArray that lives as long as `self`.
        unsafe { (*self.children.add(i)).as_ref() }
    }

    /// The dictionary, if any. It may be released; check [`ArrowArray::is_released`]
    /// before following its own pointers.
    ///
    /// # Safety
    /// `self` must be [well-formed](ArrowArray#well-formed-arrays): filled by a producer
    /// following the C data interface and not released, so that a non-NULL `dictionary`
    /// points to a live `ArrowArray`.
    pub unsafe fn dictionary(&self) -> Option<&ArrowArray> {
        // SAFETY: the caller guarantees a well-formed struct, whose non-NULL `dictionary`
        // points to a valid ArrowArray that lives as long as `self`.
        unsafe { self.dictionary.as_ref() }
    }
}

/// `struct ArrowDeviceArray`: an `ArrowArray` whose buffers live on a device, with the
/// device's type and id and an optional synchronization event. 128 bytes.
#[repr(C)]
#[derive(Debug)]
pub struct ArrowDeviceArray {
    /// The array; only its buffers live on the device, the structs are in CPU memory.
    pub array: ArrowArray,
    /// The device id (e.g. the CUDA ordinal); -1 for the CPU.
    pub device_id: i64,
    /// The type of device the buffers live on.
    pub device_type: ArrowDeviceType,
    /// NULL, or a pointer to the device's event type (`cudaEvent_t*` for the CUDA types)
    /// the consumer must wait on before reading the buffers.
    pub sync_event: *mut c_void,
    /// Reserved for future expansion; must be zero.
    pub reserved: [i64; 3],
}

const _: () = {
    assert!(std::mem::size_of::<ArrowDeviceArray>() == 128);
    assert!(std::mem::offset_of!(ArrowDeviceArray, device_id) == 80);
    assert!(std::mem::offset_of!(ArrowDeviceArray, device_type) == 88);
    assert!(std::mem::offset_of!(ArrowDeviceArray, sync_event) == 96);
    assert!(std::mem::offset_of!(ArrowDeviceArray, reserved) == 104);
};

impl ArrowDeviceArray {
    /// A released, zeroed device array: what a consumer passes to a producer to fill.
    pub const fn empty() -> Self {
        Self {
            array: ArrowArray::empty(),
            device_id: 0,
            device_type: ArrowDeviceType(0),
            sync_event: std::ptr::null_mut(),
            reserved: [0; 3],
        }
    }

    /// Whether the embedded array is released.
    pub fn is_released(&self) -> bool {
        self.array.is_released()
    }
}

impl Default for ArrowDeviceArray {
    fn default() -> Self {
        Self::empty()
    }
}

/// `struct ArrowDeviceArrayStream`: a pull-style stream of device arrays of one device type.
#[repr(C)]
#[derive(Debug)]
pub struct ArrowDeviceArrayStream {
    /// The device type all arrays of the stream live on.
    pub device_type: ArrowDeviceType,
    /// Gets the stream's schema; 0 or an errno-compatible code.
    pub get_schema: Option<
        unsafe extern "C" fn(stream: *mut ArrowDeviceArrayStream, out: *mut ArrowSchema) -> c_int,
    >,
    /// Gets the next array (a released array marks the end); 0 or an errno-compatible code.
    pub get_next: Option<
        unsafe extern "C" fn(
            stream: *mut ArrowDeviceArrayStream,
            out: *mut ArrowDeviceArray,
        ) -> c_int,
    >,
    /// The description of the last error, valid until the next call on the stream.
    pub get_last_error:
        Option<unsafe extern "C" fn(stream: *mut ArrowDeviceArrayStream) -> *const c_char>,
    /// Release callback; NULL marks a released stream.
    pub release: Option<unsafe extern "C" fn(stream: *mut ArrowDeviceArrayStream)>,
    /// Opaque producer data.
    pub private_data: *mut c_void,
}

const _: () = assert!(std::mem::size_of::<ArrowDeviceArrayStream>() == 48);

impl ArrowDeviceArrayStream {
    /// A released, zeroed stream: what a consumer passes to a producer to fill.
    pub const fn empty() -> Self {
        Self {
            device_type: ArrowDeviceType(0),
            get_schema: None,
            get_next: None,
            get_last_error: None,
            release: None,
            private_data: std::ptr::null_mut(),
        }
    }

    /// Whether the stream is released.
    pub fn is_released(&self) -> bool {
        self.release.is_none()
    }
}

impl Default for ArrowDeviceArrayStream {
    fn default() -> Self {
        Self::empty()
    }
}

/// `struct ArrowAsyncTask`: one unit of data an async producer offers; the consumer calls
/// `extract_data` exactly once (with NULL `out` if it does not want the data).
#[repr(C)]
#[derive(Debug)]
pub struct ArrowAsyncTask {
    /// Moves the task's data into `out` (or just cleans up when `out` is NULL).
    pub extract_data: Option<
        unsafe extern "C" fn(task: *mut ArrowAsyncTask, out: *mut ArrowDeviceArray) -> c_int,
    >,
    /// Opaque producer data.
    pub private_data: *mut c_void,
}

/// `struct ArrowAsyncProducer` as in the canonical `abi.h`: no `release` member (the
/// producer frees it after calling the handler's `release`), `request` takes `int64_t`.
#[repr(C)]
#[derive(Debug)]
pub struct ArrowAsyncProducer {
    /// The device type of every array this producer offers.
    pub device_type: ArrowDeviceType,
    /// Asks for `n` (> 0) more tasks. Never calls the handler synchronously.
    pub request: Option<unsafe extern "C" fn(producer: *mut ArrowAsyncProducer, n: i64)>,
    /// Asks the producer to stop eventually; idempotent and thread-safe.
    pub cancel: Option<unsafe extern "C" fn(producer: *mut ArrowAsyncProducer)>,
    /// NULL, or metadata encoded like `ArrowSchema.metadata`, valid as long as the producer.
    pub additional_metadata: *const c_char,
    /// Opaque producer data.
    pub private_data: *mut c_void,
}

/// `struct ArrowAsyncDeviceStreamHandler`: the consumer-allocated callbacks an async
/// producer drives.
#[repr(C)]
#[derive(Debug)]
pub struct ArrowAsyncDeviceStreamHandler {
    /// Receives the stream's schema (the consumer moves it out); 0 or an errno code.
    pub on_schema: Option<
        unsafe extern "C" fn(
            handler: *mut ArrowAsyncDeviceStreamHandler,
            schema: *mut ArrowSchema,
        ) -> c_int,
    >,
    /// Receives the next task, or NULL at the end of the stream; 0 or an errno code.
    pub on_next_task: Option<
        unsafe extern "C" fn(
            handler: *mut ArrowAsyncDeviceStreamHandler,
            task: *mut ArrowAsyncTask,
            metadata: *const c_char,
        ) -> c_int,
    >,
    /// Receives a producer error; `release` follows.
    pub on_error: Option<
        unsafe extern "C" fn(
            handler: *mut ArrowAsyncDeviceStreamHandler,
            code: c_int,
            message: *const c_char,
            metadata: *const c_char,
        ),
    >,
    /// Releases the handler; the last call a producer makes on it.
    pub release: Option<unsafe extern "C" fn(handler: *mut ArrowAsyncDeviceStreamHandler)>,
    /// Set by the producer before `on_schema`.
    pub producer: *mut ArrowAsyncProducer,
    /// Opaque consumer data.
    pub private_data: *mut c_void,
}

const _: () = {
    assert!(std::mem::size_of::<ArrowAsyncTask>() == 16);
    assert!(std::mem::size_of::<ArrowAsyncProducer>() == 40);
    assert!(std::mem::size_of::<ArrowAsyncDeviceStreamHandler>() == 48);
};

impl Default for ArrowAsyncDeviceStreamHandler {
    fn default() -> Self {
        Self {
            on_schema: None,
            on_next_task: None,
            on_error: None,
            release: None,
            producer: std::ptr::null_mut(),
            private_data: std::ptr::null_mut(),
        }
    }
}
