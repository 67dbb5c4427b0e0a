//! Counting the releases of arrays devarrow hands out or takes in.

use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use devarrow_abi::{ArrowArray, DeviceArray};

struct Counted {
    release: unsafe extern "C" fn(*mut ArrowArray),
    private_data: *mut c_void,
    count: Arc<AtomicUsize>,
}

unsafe extern "C" fn counting_release(array: *mut ArrowArray) {
    // SAFETY: installed by `count` on an unreleased array whose private data is a
    // Box<Counted>; the original release and private data are restored before chaining.
    unsafe {
        let array = &mut *array;
        if array.private_data.is_null() {
            eprintln!("devarrow-fuzz: an array was released twice");
            std::process::abort();
        }
        let counted = Box::from_raw(array.private_data.cast::<Counted>());
        array.private_data = counted.private_data;
        array.release = Some(counted.release);
        (counted.release)(array);
        counted.count.fetch_add(1, Ordering::SeqCst);
    }
}

/// The release counts of every array counted so far.
#[derive(Debug, Default)]
pub struct Ledger {
    counts: Mutex<Vec<Arc<AtomicUsize>>>,
}

impl Ledger {
    /// Wraps the release callback of `array` so its calls are counted here.
    pub fn count(&self, array: DeviceArray) -> DeviceArray {
        let count = Arc::new(AtomicUsize::new(0));
        let mut raw = array.into_raw();
        let counted = Box::new(Counted {
            release: raw.array.release.expect("unreleased"),
            private_data: raw.array.private_data,
            count: count.clone(),
        });
        raw.array.private_data = Box::into_raw(counted).cast();
        raw.array.release = Some(counting_release);
        self.counts.lock().unwrap().push(count);
        // SAFETY: `raw` came from a DeviceArray; only its release was wrapped, and
        // `counting_release` chains to the original once.
        unsafe { DeviceArray::try_new(raw) }.expect("unreleased")
    }

    /// A counter of its own (for arrays counted elsewhere, e.g. generated trees).
    pub fn push(&self, count: Arc<AtomicUsize>) {
        self.counts.lock().unwrap().push(count);
    }

    /// Asserts that every array counted was released exactly once.
    pub fn assert_all_released_once(&self, what: &str) {
        for (i, c) in self.counts.lock().unwrap().iter().enumerate() {
            let n = c.load(Ordering::SeqCst);
            assert_eq!(n, 1, "{what}: array {i} was released {n} times");
        }
    }

    /// How many arrays were counted.
    pub fn len(&self) -> usize {
        self.counts.lock().unwrap().len()
    }

    /// Whether none were.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
