//! NULL offsets of empty arrays for arrow-rs's importer (see [`crate::layout`], "NULL
//! offsets of empty arrays"): devarrow accepts a zero-length array of a type with offsets
//! whose offsets buffer is NULL, arrow-rs's importer (60) refuses it. [`shadow`] gives
//! arrow-rs a copy of the tree's structs (never the producer's memory, which is not
//! written) in which each such array points to a zero offset instead, and whose release
//! releases the producer's array.

use std::ffi::c_void;

use arrow_schema::DataType;

use crate::ffi::ArrowArray;
use crate::layout::{child_types, has_end_offsets};

/// One zero offset, aligned for either offset width: the offsets of an empty array.
static ZERO_OFFSET: i64 = 0;

/// Whether `array` (validated against `data_type`) is an empty array of a type with
/// offsets whose offsets buffer is NULL.
///
/// # Safety
/// `array` must be well-formed.
unsafe fn has_null_offsets(array: &ArrowArray, data_type: &DataType) -> bool {
    // SAFETY: well-formed (contract of this function).
    has_end_offsets(data_type) && array.length == 0 && unsafe { array.buffer(1) }.is_null()
}

/// Whether `array` or any array under it [`has_null_offsets`].
///
/// # Safety
/// `array` must be well-formed and structurally valid for `data_type`
/// ([`crate::layout::validate_structure`]).
pub(crate) unsafe fn any_null_offsets(array: &ArrowArray, data_type: &DataType) -> bool {
    // SAFETY: (all calls) well-formed and structurally valid, as are its children and
    // its dictionary (contract of this function).
    unsafe {
        has_null_offsets(array, data_type)
            || child_types(data_type)
                .into_iter()
                .enumerate()
                .any(|(i, dt)| array.child(i).is_some_and(|c| any_null_offsets(c, dt)))
            || match (data_type, array.dictionary()) {
                (DataType::Dictionary(_, values), Some(d)) => any_null_offsets(d, values),
                _ => false,
            }
    }
}

/// The allocations of a shadow tree, freed with it.
#[derive(Default)]
struct Allocations {
    nodes: Vec<*mut ArrowArray>,
    buffers: Vec<*mut [*const c_void]>,
    children: Vec<*mut [*mut ArrowArray]>,
}

impl Drop for Allocations {
    fn drop(&mut self) {
        // SAFETY: every pointer came from `Box::into_raw` in `copy_node` and is freed
        // once, here; arrow-rs is done with the tree (the root's release runs this).
        unsafe {
            for &node in &self.nodes {
                drop(Box::from_raw(node));
            }
            for &buffers in &self.buffers {
                drop(Box::from_raw(buffers));
            }
            for &children in &self.children {
                drop(Box::from_raw(children));
            }
        }
    }
}

/// The private data of a shadow root: the producer's root (released with the shadow) and
/// the shadow's own structs.
struct Shadow {
    original: ArrowArray,
    _allocations: Allocations,
}

impl Drop for Shadow {
    fn drop(&mut self) {
        if let Some(release) = self.original.release {
            // SAFETY: the producer's root, unreleased and owned by this shadow: released
            // once, here.
            unsafe { release(&mut self.original) };
            self.original.release = None;
        }
    }
}

/// Releases a shadow root made by [`shadow`].
unsafe extern "C" fn release_shadow(array: *mut ArrowArray) {
    crate::boundary::swallow_panic("while releasing an array", || {
        if array.is_null() {
            return;
        }
        // SAFETY: `array` is the shadow root (arrow-rs calls its release once); its
        // private data is the `Box<Shadow>` made by `shadow`.
        unsafe {
            let shadow = (*array).private_data as *mut Shadow;
            (*array).release = None;
            (*array).private_data = std::ptr::null_mut();
            if !shadow.is_null() {
                drop(Box::from_raw(shadow));
            }
        }
    });
}

/// Marks a shadow child released (arrow-rs never releases children; the spec has only
/// the root's release called).
unsafe extern "C" fn release_child(array: *mut ArrowArray) {
    if !array.is_null() {
        // SAFETY: a shadow child, ours.
        unsafe { (*array).release = None };
    }
}

/// Copies `array` (not its root's release or private data) into shadow structs: each
/// array that [`has_null_offsets`] gets offset 0 and [`ZERO_OFFSET`] as its offsets.
///
/// # Safety
/// As for [`any_null_offsets`].
unsafe fn copy_node(
    array: &ArrowArray,
    data_type: &DataType,
    allocations: &mut Allocations,
) -> ArrowArray {
    let n_buffers = array.n_buffers.max(0) as usize;
    let buffer = |i: usize| {
        // SAFETY: well-formed (contract of this function).
        unsafe { array.buffer(i) }
    };
    let mut buffers: Vec<*const c_void> = (0..n_buffers).map(buffer).collect();
    let mut offset = array.offset;
    // SAFETY: as above.
    if unsafe { has_null_offsets(array, data_type) } {
        buffers[1] = std::ptr::from_ref(&ZERO_OFFSET).cast();
        // Empty: nothing addresses it, so its offset is free; 0 makes the one offset the
        // whole buffer arrow-rs reads.
        offset = 0;
    }
    let types = child_types(data_type);
    let children: Vec<*mut ArrowArray> = types
        .iter()
        .enumerate()
        .map(|(i, dt)| {
            // SAFETY: structurally valid: child `i` exists for each child type.
            let child = unsafe { array.child(i) }.expect("validated child");
            // SAFETY: as above, for the child.
            let mut copy = unsafe { copy_node(child, dt, allocations) };
            copy.release = Some(release_child);
            let copy = Box::into_raw(Box::new(copy));
            allocations.nodes.push(copy);
            copy
        })
        .collect();
    // SAFETY: well-formed (contract of this function).
    let original_dictionary = unsafe { array.dictionary() };
    let dictionary = match (data_type, original_dictionary) {
        (DataType::Dictionary(_, values), Some(d)) => {
            // SAFETY: as above, for the dictionary.
            let mut copy = unsafe { copy_node(d, values, allocations) };
            copy.release = Some(release_child);
            let copy = Box::into_raw(Box::new(copy));
            allocations.nodes.push(copy);
            copy
        }
        _ => std::ptr::null_mut(),
    };
    let buffers = Box::into_raw(buffers.into_boxed_slice());
    allocations.buffers.push(buffers);
    let children = Box::into_raw(children.into_boxed_slice());
    allocations.children.push(children);
    ArrowArray {
        length: array.length,
        null_count: array.null_count,
        offset,
        n_buffers: array.n_buffers,
        n_children: array.n_children,
        buffers: buffers.cast(),
        children: children.cast(),
        dictionary,
        release: None,
        private_data: std::ptr::null_mut(),
    }
}

/// `root` (owned, unreleased), or when an array in it [`has_null_offsets`] a shadow of
/// it whose release releases `root`.
///
/// # Safety
/// `root` must be well-formed, unreleased and structurally valid for `data_type`
/// ([`crate::layout::validate_structure`]); it is consumed.
pub(crate) unsafe fn shadow(root: ArrowArray, data_type: &DataType) -> ArrowArray {
    // SAFETY: the caller's guarantees.
    if !unsafe { any_null_offsets(&root, data_type) } {
        return root;
    }
    let mut allocations = Allocations::default();
    // SAFETY: the caller's guarantees.
    let mut copy = unsafe { copy_node(&root, data_type, &mut allocations) };
    copy.release = Some(release_shadow);
    copy.private_data = Box::into_raw(Box::new(Shadow {
        original: root,
        _allocations: allocations,
    }))
    .cast();
    copy
}
