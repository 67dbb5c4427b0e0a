//! The generic tree exporter: the owner lives until every exported struct is released,
//! children moved out by a consumer outlive their parent, and release runs once each.

use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use devarrow_abi::export_tree::{export_tree, ArrayNode};
use devarrow_abi::{ArrowArray, ArrowDeviceType, DeviceArray};

/// Keeps the values of the exported tree alive, and counts its drops.
struct Owner {
    drops: Arc<AtomicUsize>,
    values: Box<[i64]>,
}

impl Owner {
    fn new(drops: &Arc<AtomicUsize>) -> Self {
        Self {
            drops: drops.clone(),
            values: vec![1, 2, 3].into_boxed_slice(),
        }
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        self.drops.fetch_add(1, Ordering::SeqCst);
    }
}

/// A struct of two int64 children and a dictionary; `values` (3 int64s or NULL) is the
/// values buffer of every leaf.
fn tree(values: *const c_void) -> ArrayNode {
    let leaf = |len| ArrayNode {
        length: len,
        buffers: vec![std::ptr::null(), values],
        ..Default::default()
    };
    ArrayNode {
        length: 3,
        buffers: vec![std::ptr::null()],
        children: vec![leaf(3), leaf(3)],
        dictionary: Some(Box::new(leaf(2))),
        ..Default::default()
    }
}

/// Exports `tree` on the CPU with the host values of a fresh [`Owner`].
fn export_on_cpu(drops: &Arc<AtomicUsize>) -> (DeviceArray, *const c_void) {
    let owner = Owner::new(drops);
    let values = owner.values.as_ptr().cast::<c_void>();
    // SAFETY: the only non-NULL buffer address is `values`: host memory (CPU) of 3 int64s,
    // as much as the longest leaf needs, kept alive by the owner; no sync event.
    let array = unsafe {
        export_tree(
            tree(values),
            Arc::new(owner),
            ArrowDeviceType::CPU,
            -1,
            std::ptr::null_mut(),
        )
    }
    .unwrap();
    (array, values)
}

#[test]
fn device_placement_is_carried() {
    let drops = Arc::new(AtomicUsize::new(0));
    // SAFETY: every buffer address is NULL and there is no sync event, so nothing claims
    // device memory that is not there.
    let array = unsafe {
        export_tree(
            tree(std::ptr::null()),
            Arc::new(Owner::new(&drops)),
            ArrowDeviceType::CUDA,
            0,
            std::ptr::null_mut(),
        )
    }
    .unwrap();
    let raw = array.as_raw();
    assert_eq!(
        (raw.device_type, raw.device_id, raw.reserved),
        (ArrowDeviceType::CUDA, 0, [0; 3])
    );
    drop(array);
    assert_eq!(drops.load(Ordering::SeqCst), 1);
}

#[test]
fn owner_dropped_once_after_release() {
    let drops = Arc::new(AtomicUsize::new(0));
    let (array, values) = export_on_cpu(&drops);
    let raw = &array.as_raw().array;
    assert_eq!(raw.n_children, 2);
    // SAFETY: the array of a DeviceArray is well-formed, and so are its unreleased
    // children (both exported by `export_tree`).
    let (child, dictionary) = unsafe { (raw.child(1).unwrap(), raw.dictionary().unwrap()) };
    // SAFETY: as above.
    assert_eq!(unsafe { child.buffer(1) }, values);
    assert_eq!(dictionary.length, 2);
    assert_eq!(drops.load(Ordering::SeqCst), 0);
    drop(array);
    assert_eq!(drops.load(Ordering::SeqCst), 1);
}

#[test]
fn a_child_moved_out_outlives_its_parent() {
    let drops = Arc::new(AtomicUsize::new(0));
    let (array, _) = export_on_cpu(&drops);
    // Move child 0 out, as a consumer may.
    // SAFETY: the exported array has two valid children.
    let child_ptr = unsafe { *array.array().children };
    // SAFETY: the child is a valid, unreleased ArrowArray owned by the export.
    let mut moved: ArrowArray = unsafe { std::ptr::replace(child_ptr, ArrowArray::empty()) };
    drop(array);
    assert_eq!(
        drops.load(Ordering::SeqCst),
        0,
        "the moved child keeps the owner alive"
    );
    assert_eq!(moved.length, 3);
    // SAFETY: `moved` is unreleased and ours.
    unsafe { (moved.release.unwrap())(&mut moved) };
    assert!(moved.is_released());
    assert_eq!(drops.load(Ordering::SeqCst), 1);
}
