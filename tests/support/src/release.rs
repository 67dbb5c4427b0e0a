//! Test support: counting release calls of exported arrays.

use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use devarrow_abi::{ArrowArray, DeviceArray};

struct Counted {
    release: unsafe extern "C" fn(*mut ArrowArray),
    private_data: *mut c_void,
    count: Arc<AtomicUsize>,
}

unsafe extern "C" fn counting_release(array: *mut ArrowArray) {
    // SAFETY: installed by `count_releases` on an unreleased array whose private data is a
    // Box<Counted>; the original release and private data are restored before chaining.
    unsafe {
        let array = &mut *array;
        let counted = Box::from_raw(array.private_data.cast::<Counted>());
        array.private_data = counted.private_data;
        array.release = Some(counted.release);
        (counted.release)(array);
        counted.count.fetch_add(1, Ordering::SeqCst);
    }
}

/// Wraps the release callback of `array` so calls are counted.
pub fn count_releases(array: DeviceArray) -> (DeviceArray, Arc<AtomicUsize>) {
    let count = Arc::new(AtomicUsize::new(0));
    let mut raw = array.into_raw();
    let counted = Box::new(Counted {
        release: raw.array.release.expect("unreleased"),
        private_data: raw.array.private_data,
        count: count.clone(),
    });
    raw.array.private_data = Box::into_raw(counted).cast();
    raw.array.release = Some(counting_release);
    // SAFETY: `raw` came from a DeviceArray (so it meets `try_new`'s contract); only its
    // release callback was wrapped, and `counting_release` chains to the original once.
    (unsafe { DeviceArray::try_new(raw) }.unwrap(), count)
}

/// The number of release calls so far.
pub fn releases(count: &Arc<AtomicUsize>) -> usize {
    count.load(Ordering::SeqCst)
}

/// The C layout of `ArrowSchema` (the C data interface's, as arrow-rs's `FFI_ArrowSchema`
/// whose fields are private), to wrap its `release`.
#[repr(C)]
struct CSchema {
    format: *const std::ffi::c_char,
    name: *const std::ffi::c_char,
    metadata: *const std::ffi::c_char,
    flags: i64,
    n_children: i64,
    children: *mut *mut CSchema,
    dictionary: *mut CSchema,
    release: Option<unsafe extern "C" fn(*mut CSchema)>,
    private_data: *mut c_void,
}

struct CountedSchema {
    release: unsafe extern "C" fn(*mut CSchema),
    private_data: *mut c_void,
    count: Arc<AtomicUsize>,
}

unsafe extern "C" fn counting_schema_release(schema: *mut CSchema) {
    // SAFETY: installed by `count_schema_releases` on an unreleased schema whose private
    // data is a Box<CountedSchema>; the original release and private data are restored
    // before chaining.
    unsafe {
        let schema = &mut *schema;
        let counted = Box::from_raw(schema.private_data.cast::<CountedSchema>());
        schema.private_data = counted.private_data;
        schema.release = Some(counted.release);
        (counted.release)(schema);
        counted.count.fetch_add(1, Ordering::SeqCst);
    }
}

/// Wraps the release callback of the (unreleased) schema at `schema` so calls are
/// counted.
///
/// # Safety
/// `schema` must point to a valid, unreleased `ArrowSchema`.
pub unsafe fn count_schema_releases(schema: *mut devarrow_abi::ArrowSchema) -> Arc<AtomicUsize> {
    let count = Arc::new(AtomicUsize::new(0));
    // SAFETY: `FFI_ArrowSchema` is `#[repr(C)]` with the C data interface's layout, which
    // `CSchema` spells out; the caller guarantees it is valid and unreleased.
    let raw = unsafe { &mut *schema.cast::<CSchema>() };
    let counted = Box::new(CountedSchema {
        release: raw.release.expect("unreleased"),
        private_data: raw.private_data,
        count: count.clone(),
    });
    raw.private_data = Box::into_raw(counted).cast();
    raw.release = Some(counting_schema_release);
    count
}
