//! The generic tree exporter: the owner lives until every exported struct is released,
//! children moved out by a consumer outlive their parent, and release runs once each.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use devarrow_abi::export::{export_tree, ArrayNode};
use devarrow_abi::{ArrowArray, ArrowDeviceType};

struct Owner(Arc<AtomicUsize>);

impl Drop for Owner {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

fn tree() -> ArrayNode {
    let leaf = |len| ArrayNode {
        length: len,
        buffers: vec![std::ptr::null(), 0x1000 as *const _],
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

#[test]
fn owner_dropped_once_after_release() {
    let drops = Arc::new(AtomicUsize::new(0));
    let array = export_tree(
        tree(),
        Arc::new(Owner(drops.clone())),
        ArrowDeviceType::CUDA,
        0,
        std::ptr::null_mut(),
    )
    .unwrap();
    let raw = array.as_raw();
    assert_eq!(
        (raw.device_type, raw.device_id, raw.reserved),
        (ArrowDeviceType::CUDA, 0, [0; 3])
    );
    assert_eq!(raw.array.n_children, 2);
    assert_eq!(raw.array.child(1).unwrap().buffer(1) as usize, 0x1000);
    assert_eq!(raw.array.dictionary().unwrap().length, 2);
    assert_eq!(drops.load(Ordering::SeqCst), 0);
    drop(array);
    assert_eq!(drops.load(Ordering::SeqCst), 1);
}

#[test]
fn a_child_moved_out_outlives_its_parent() {
    let drops = Arc::new(AtomicUsize::new(0));
    let array = export_tree(
        tree(),
        Arc::new(Owner(drops.clone())),
        ArrowDeviceType::CPU,
        -1,
        std::ptr::null_mut(),
    )
    .unwrap();
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
