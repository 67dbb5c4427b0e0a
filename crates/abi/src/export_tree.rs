//! Exporting an array tree whose buffers live anywhere (device memory included) as an
//! `ArrowDeviceArray`, without arrow-rs ever seeing the buffers.
//!
//! The producer describes the tree with [`ArrayNode`]s (buffer addresses on the device)
//! and hands over an owner that keeps the memory, and the sync event, alive. Every
//! exported struct, children included, has its own `release` (a consumer may move
//! children out, as the C data interface allows); the owner is dropped when the last of
//! them is released.
//!
//! # Example
//!
//! A `Utf8` array `["dev", "arrow", ""]` whose buffers (offsets and bytes) belong to an
//! owner the producer hands over: host memory here (`ARROW_DEVICE_CPU`), device memory and
//! its sync event on a GPU. The consumer imports it zero-copy; the owner is dropped when
//! the consumer releases the array.
//!
//! ```
//! use std::sync::Arc;
//!
//! use arrow_array::{cast::AsArray, Array};
//! use arrow_schema::DataType;
//! use devarrow_abi::export_tree::{export_tree, ArrayNode, Owner};
//! use devarrow_abi::{cpu, ArrowDeviceType};
//!
//! # fn main() -> devarrow_abi::Result<()> {
//! let memory = Arc::new((vec![0i32, 3, 8, 8], b"devarrow".to_vec()));
//! let root = ArrayNode {
//!     length: 3,
//!     null_count: 0,
//!     // validity (none: NULL), offsets, bytes: the C data interface's order for Utf8
//!     buffers: vec![std::ptr::null(), memory.0.as_ptr().cast(), memory.1.as_ptr().cast()],
//!     ..ArrayNode::default()
//! };
//! let owner_alive = Arc::downgrade(&memory);
//!
//! // SAFETY: the buffers are host memory (the CPU device) kept alive by the owner, with
//! // the 4 offsets and 8 bytes a Utf8 array of 3 items needs; the CPU has no sync event.
//! let array = unsafe {
//!     export_tree(root, memory as Owner, ArrowDeviceType::CPU, -1, std::ptr::null_mut())
//! }?;
//!
//! let strings = cpu::import_array_as(array, &DataType::Utf8)?; // checked, zero-copy
//! assert_eq!(strings.as_string::<i32>().value(1), "arrow");
//! assert!(owner_alive.upgrade().is_some());
//! drop(strings); // the last release drops the owner, and with it the memory
//! assert!(owner_alive.upgrade().is_none());
//! # Ok(())
//! # }
//! ```

use std::any::Any;
use std::ffi::c_void;
use std::sync::Arc;

use crate::boundary::swallow_panic;
use crate::device_array::DeviceArray;
use crate::error::Result;
use crate::ffi::{ArrowArray, ArrowDeviceArray, ArrowDeviceType};

/// One array of a tree to export.
#[derive(Debug, Clone, Default)]
pub struct ArrayNode {
    /// Logical length.
    pub length: i64,
    /// Null count (-1 if unknown).
    pub null_count: i64,
    /// Logical offset.
    pub offset: i64,
    /// Buffer addresses in C data interface order (NULL allowed where the spec allows).
    pub buffers: Vec<*const c_void>,
    /// Children.
    pub children: Vec<ArrayNode>,
    /// Dictionary of a dictionary-encoded array.
    pub dictionary: Option<Box<ArrayNode>>,
}

/// What keeps the exported memory alive: anything, dropped after the last release.
pub type Owner = Arc<dyn Any + Send + Sync>;

struct NodePrivate {
    buffers: Box<[*const c_void]>,
    children: Box<[*mut ArrowArray]>,
    dictionary: *mut ArrowArray,
    _owner: Owner,
}

fn export_node(node: ArrayNode, owner: &Owner) -> ArrowArray {
    let children: Box<[*mut ArrowArray]> = node
        .children
        .into_iter()
        .map(|c| Box::into_raw(Box::new(export_node(c, owner))))
        .collect();
    let dictionary = node.dictionary.map_or(std::ptr::null_mut(), |d| {
        Box::into_raw(Box::new(export_node(*d, owner)))
    });
    let mut private = Box::new(NodePrivate {
        buffers: node.buffers.into_boxed_slice(),
        children,
        dictionary,
        _owner: owner.clone(),
    });
    ArrowArray {
        length: node.length,
        null_count: node.null_count,
        offset: node.offset,
        n_buffers: private.buffers.len() as i64,
        n_children: private.children.len() as i64,
        buffers: private.buffers.as_mut_ptr(),
        children: private.children.as_mut_ptr(),
        dictionary,
        release: Some(release_node),
        private_data: Box::into_raw(private).cast(),
    }
}

unsafe extern "C" fn release_node(array: *mut ArrowArray) {
    swallow_panic("in ArrowArray.release", || {
        // SAFETY: called by a consumer on a struct we exported (or a moved copy of it).
        let Some(array) = (unsafe { array.as_mut() }) else {
            return;
        };
        if array.release.is_none() || array.private_data.is_null() {
            return;
        }
        // SAFETY: private_data is the Box<NodePrivate> made by `export_node`, freed only here.
        let private = unsafe { Box::from_raw(array.private_data.cast::<NodePrivate>()) };
        for &child in private
            .children
            .iter()
            .chain(std::iter::once(&private.dictionary))
        {
            if child.is_null() {
                continue;
            }
            // SAFETY: each child was boxed by `export_node`; if a consumer moved it out it
            // is marked released here and its new owner releases the moved copy.
            let mut child = unsafe { Box::from_raw(child) };
            if let Some(release) = child.release {
                // SAFETY: the child is unreleased and ours.
                unsafe { release(&mut *child) };
            }
        }
        array.release = None;
        array.private_data = std::ptr::null_mut();
    })
}

/// Exports `root` as a device array on `device_type`/`device_id` with `sync_event`; the
/// `owner` (memory, event, ...) is kept alive until every exported struct is released.
///
/// The structs are built here, so they are well-formed whatever `root` holds; the counts
/// need not fit any schema (importers check that). The buffer addresses, though, are
/// taken on trust.
///
/// # Safety
/// As [`DeviceArray::try_new`] requires of the buffers and the event:
/// - every non-NULL buffer address of `root` (children and dictionaries included) points to
///   memory on the device `device_type`/`device_id` name, kept alive by `owner`, holding
///   at least the bytes the C data interface gives it for its node's (non-negative)
///   `length` and `offset` and, for the data buffer of a variable-length type, up to its
///   last offset;
/// - if `device_type` has an event type, `sync_event` is NULL or points to a live event
///   of that type, kept alive by `owner`.
pub unsafe fn export_tree(
    root: ArrayNode,
    owner: Owner,
    device_type: ArrowDeviceType,
    device_id: i64,
    sync_event: *mut c_void,
) -> Result<DeviceArray> {
    let raw = ArrowDeviceArray {
        array: export_node(root, &owner),
        device_id,
        device_type,
        sync_event,
        reserved: [0; 3],
    };
    // SAFETY: `export_node` builds well-formed structs (pointer arrays boxed with the
    // counts it states, each child and dictionary exported the same way) whose `release`
    // may run once from any thread; the caller guarantees the buffers and the event.
    unsafe { DeviceArray::try_new(raw) }
}
