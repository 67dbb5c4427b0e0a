//! Validation of an imported `ArrowArray` against the data type of its schema.
//!
//! Two levels, so device data can be checked without touching the device:
//! - [`validate_structure`] reads only the structs (which live in CPU memory even for
//!   device arrays): buffer and child counts, the dictionary, `length`, `offset` and
//!   `null_count`, and NULL buffers where the layout needs bytes whose size is known from
//!   the structs alone. Works for any device type.
//! - [`validate_host_offsets`] additionally reads offset buffers (so only for memory the
//!   host can read): offsets must be non-negative, monotonic, and within their child.
//!
//! - [`validate_in_place_alignment`] checks the alignment of the few buffers arrow-rs's
//!   importer reads in place (string offsets, view sizes): found by fuzzing (an unaligned
//!   `LargeUtf8` offsets buffer was a misaligned `i64` read inside arrow-rs).
//!
//! After these pass, arrow-rs can import the array without reading out of bounds, and its
//! `validate_full` checks the rest (UTF-8, dictionary keys, union type ids, ...).
//!
//! # NULL offsets of empty arrays
//!
//! A zero-length array of a type with offsets (`Utf8`, `Binary`, their large forms,
//! `List`, `LargeList`, `Map`) may come with a NULL offsets buffer (and a NULL data
//! buffer): nanoarrow's CUDA copy of a 0-row column does so. devarrow **accepts** it as
//! an empty array: the C data interface lets a buffer pointer be NULL when the buffer's
//! size would be 0, and the columnar format's `length + 1` offsets of an empty array
//! were agreed to be optional (apache/arrow#14805 and #36494, the mailing-list thread
//! linked from apache/arrow#40038); Arrow C++ reads such an array as empty (its
//! importer, `bridge.cc`, substitutes a zero offset for the NULL buffer, as seen in issue
//! #25; older versions refused it) and its validation has allowed missing offsets of
//! empty arrays since ARROW-7008. arrow-rs's importer (60,
//! `arrow-array/src/ffi.rs`) sizes the buffer at `length + offset + 1` offsets and
//! refuses the NULL pointer; devarrow's CPU import ([`crate::cpu`]) hands arrow-rs a
//! zero offset in its place, and the bridge's device import reads nothing of it. The
//! buffer is taken as empty only when `length` is 0 (the array addresses no item,
//! whatever its `offset`); with rows, a NULL offsets buffer stays an
//! [`Error::NullBuffer`].
//!
//! Both are `unsafe`: they follow the struct's pointers, which must be those of a
//! [well-formed](crate::ArrowArray#well-formed-arrays) array (one from a producer following
//! the C data interface). The array in a [`crate::DeviceArray`] always is.

use std::ffi::c_void;

use arrow_schema::{DataType, UnionMode};

use crate::error::{Error, Result};
use crate::ffi::ArrowArray;

/// What a buffer of a layout holds; used in error messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BufferRole {
    /// The validity bitmap (may be NULL when there are no nulls).
    Validity,
    /// Fixed-width values (bits for Boolean).
    Values,
    /// 32- or 64-bit offsets into a child or a data buffer.
    Offsets,
    /// List-view sizes.
    Sizes,
    /// Variable-length bytes.
    Data,
    /// Union type ids.
    TypeIds,
    /// 16-byte views of a view type.
    Views,
    /// The int64 lengths of a view type's variadic buffers.
    VariadicSizes,
}

impl BufferRole {
    /// A lower-case name for messages.
    pub fn name(self) -> &'static str {
        match self {
            BufferRole::Validity => "validity",
            BufferRole::Values => "values",
            BufferRole::Offsets => "offsets",
            BufferRole::Sizes => "sizes",
            BufferRole::Data => "data",
            BufferRole::TypeIds => "type ids",
            BufferRole::Views => "views",
            BufferRole::VariadicSizes => "variadic buffer sizes",
        }
    }
}

/// The fixed buffers the C data interface gives an array of `data_type` (views and their
/// variadic buffers: the fixed part only).
pub fn buffer_roles(data_type: &DataType) -> Vec<BufferRole> {
    roles(data_type).to_vec()
}

/// [`buffer_roles`] without an allocation (the validators run it for every node).
fn roles(data_type: &DataType) -> &'static [BufferRole] {
    use BufferRole::*;
    match data_type {
        DataType::Null | DataType::RunEndEncoded(_, _) => &[],
        DataType::Struct(_) | DataType::FixedSizeList(_, _) => &[Validity],
        DataType::Utf8 | DataType::Binary | DataType::LargeUtf8 | DataType::LargeBinary => {
            &[Validity, Offsets, Data]
        }
        DataType::Utf8View | DataType::BinaryView => &[Validity, Views],
        DataType::List(_) | DataType::LargeList(_) | DataType::Map(_, _) => &[Validity, Offsets],
        DataType::ListView(_) | DataType::LargeListView(_) => &[Validity, Offsets, Sizes],
        DataType::Union(_, UnionMode::Sparse) => &[TypeIds],
        DataType::Union(_, UnionMode::Dense) => &[TypeIds, Offsets],
        DataType::Dictionary(key, _) => roles(key),
        _ => &[Validity, Values],
    }
}

/// The bit width of the values buffer of a fixed-width type, if it is one.
pub fn fixed_bit_width(data_type: &DataType) -> Option<usize> {
    Some(match data_type {
        DataType::Boolean => 1,
        DataType::FixedSizeBinary(n) => usize::try_from(*n).ok()?.checked_mul(8)?,
        dt => dt.primitive_width()? * 8,
    })
}

/// The width in bytes of the offsets (and list-view sizes) of a variable-length type: 8
/// for the `Large` types, else 4.
pub fn offset_width(data_type: &DataType) -> usize {
    match data_type {
        DataType::LargeUtf8
        | DataType::LargeBinary
        | DataType::LargeList(_)
        | DataType::LargeListView(_) => 8,
        _ => 4,
    }
}

/// Whether `data_type` has an offsets buffer of `offset + length + 1` offsets into a data
/// buffer (strings, binaries) or into its child (lists, maps): the offsets that bound
/// what a slice reaches.
pub fn has_end_offsets(data_type: &DataType) -> bool {
    matches!(
        data_type,
        DataType::Utf8
            | DataType::Binary
            | DataType::LargeUtf8
            | DataType::LargeBinary
            | DataType::List(_)
            | DataType::LargeList(_)
            | DataType::Map(_, _)
    )
}

/// The children the C data interface gives an array of `data_type`, with their types.
pub fn child_types(data_type: &DataType) -> Vec<&DataType> {
    child_type_iter(data_type).collect()
}

/// The types of the children of an array of `data_type`, without allocating: the
/// validators ask for them at every node (a `Vec` per node was a visible part of
/// importing a 100-column batch).
fn child_type_iter(data_type: &DataType) -> impl ExactSizeIterator<Item = &DataType> + '_ {
    let (one, two): (Option<&DataType>, Option<&DataType>) = match data_type {
        DataType::List(f)
        | DataType::LargeList(f)
        | DataType::ListView(f)
        | DataType::LargeListView(f)
        | DataType::FixedSizeList(f, _)
        | DataType::Map(f, _) => (Some(f.data_type()), None),
        DataType::RunEndEncoded(r, v) => (Some(r.data_type()), Some(v.data_type())),
        _ => (None, None),
    };
    let fields: &[arrow_schema::FieldRef] = match data_type {
        DataType::Struct(fields) => fields,
        _ => &[],
    };
    let union = match data_type {
        DataType::Union(fields, _) => Some(fields),
        _ => None,
    };
    ChildTypes {
        pairs: one.into_iter().chain(two),
        fields: fields.iter(),
        union: union.map(|u| (u, 0)),
    }
}

/// [`child_type_iter`]'s iterator: at most one of its sources has items.
struct ChildTypes<'a> {
    pairs:
        std::iter::Chain<std::option::IntoIter<&'a DataType>, std::option::IntoIter<&'a DataType>>,
    fields: std::slice::Iter<'a, arrow_schema::FieldRef>,
    union: Option<(&'a arrow_schema::UnionFields, usize)>,
}

impl<'a> Iterator for ChildTypes<'a> {
    type Item = &'a DataType;

    fn next(&mut self) -> Option<&'a DataType> {
        if let Some(t) = self.pairs.next() {
            return Some(t);
        }
        if let Some(f) = self.fields.next() {
            return Some(f.data_type());
        }
        let (union, at) = self.union.as_mut()?;
        // A union has at most 128 children: stepping to the next from the start is cheap.
        let (_, field) = union.iter().nth(*at)?;
        *at += 1;
        Some(field.data_type())
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let union = self.union.map_or(0, |(u, at)| u.len() - at);
        let n = self.pairs.clone().count() + self.fields.len() + union;
        (n, Some(n))
    }
}

impl ExactSizeIterator for ChildTypes<'_> {}

/// Where a node is in the tree, for error messages: built as the validators descend and
/// formatted only when an error names it (a `String` per node cost more than the checks).
#[derive(Clone, Copy)]
enum NodePath<'a> {
    Root(&'a str),
    Child(&'a NodePath<'a>, usize),
    Dictionary(&'a NodePath<'a>),
}

impl NodePath<'_> {
    fn child(&self, i: usize) -> NodePath<'_> {
        NodePath::Child(self, i)
    }

    fn dictionary(&self) -> NodePath<'_> {
        NodePath::Dictionary(self)
    }
}

impl std::fmt::Display for NodePath<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NodePath::Root(name) => f.write_str(name),
            NodePath::Child(parent, i) => write!(f, "{parent}.children[{i}]"),
            NodePath::Dictionary(parent) => write!(f, "{parent}.dictionary"),
        }
    }
}

/// Types a schema can name but the C data interface gives no layout (arrow-rs's schema
/// import accepts them): a negative fixed size (`"w:-1"`, `"+w:-1"`), dictionary keys
/// that are not integers (any format with a `dictionary`, e.g. `"u"`), run ends that
/// are not 16-, 32- or 64-bit integers. Found by fuzzing: arrow-rs panicked on a
/// zero-length dictionary array with string keys (while devarrow normalized it), and
/// would have sized a key "data buffer" from unchecked offsets.
fn check_type(data_type: &DataType, path: &NodePath<'_>) -> Result<()> {
    let bad = |what: String| {
        Err(Error::Schema(arrow_schema::ArrowError::SchemaError(
            format!("{path}: {what}"),
        )))
    };
    match data_type {
        DataType::FixedSizeBinary(n) | DataType::FixedSizeList(_, n) if *n < 0 => {
            bad(format!("{data_type} has a negative size {n}"))
        }
        DataType::Dictionary(key, _) if !key.is_dictionary_key_type() => bad(format!(
            "dictionary keys of type {key} (the C data interface wants an integer type)"
        )),
        DataType::RunEndEncoded(run_ends, _)
            if !matches!(
                run_ends.data_type(),
                DataType::Int16 | DataType::Int32 | DataType::Int64
            ) =>
        {
            bad(format!(
                "run ends of type {} (must be int16, int32 or int64)",
                run_ends.data_type()
            ))
        }
        _ => Ok(()),
    }
}

/// Checks the structs of `array` against `data_type` without reading any buffer.
///
/// `path` names the array in error messages (e.g. `"array"`). A released array is reported
/// as [`Error::Released`].
///
/// # Safety
/// `array` must be released, or [well-formed](crate::ArrowArray#well-formed-arrays): filled
/// by a producer following the C data interface and not released, so that its `buffers`,
/// `children` and `dictionary` pointers are valid for the counts it states (whether those
/// counts fit `data_type` is what this checks). The array of a [`crate::DeviceArray`]
/// always is. The buffers are never read, so they may live on any device.
pub unsafe fn validate_structure(
    array: &ArrowArray,
    data_type: &DataType,
    path: &str,
) -> Result<()> {
    // SAFETY: the caller's guarantees, passed on (no buffer is read).
    unsafe { validate_tree(array, data_type, path, Reads::Nothing) }
}

/// What a validation pass checks at each node besides the structure.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Reads {
    /// The structs only ([`validate_structure`]): no buffer is read.
    Nothing,
    /// Also the offsets (read on the host: [`validate_host_offsets`]).
    Offsets,
    /// Also the offsets, and the alignment of what arrow-rs reads in place
    /// ([`validate_host_import`]).
    OffsetsAligned,
}

/// Validates the structure of `array` and its subtree, and (after a node's subtree, so
/// that every struct a check reads has been validated) what `reads` asks of each node:
/// one pass over the tree.
///
/// # Safety
/// `array` must be well-formed and unreleased (see [`validate_structure`]); with `reads`
/// other than [`Reads::Nothing`], its buffers must be host-readable and as large as the
/// C data interface says for the structs.
unsafe fn validate_node(
    array: &ArrowArray,
    data_type: &DataType,
    path: &NodePath<'_>,
    reads: Reads,
) -> Result<()> {
    let invalid = |field: &'static str, value: i64| Error::InvalidField {
        path: path.to_string(),
        field,
        value,
    };
    if array.length < 0 {
        return Err(invalid("length", array.length));
    }
    if array.offset < 0 {
        return Err(invalid("offset", array.offset));
    }
    if array.length.checked_add(array.offset).is_none() {
        return Err(invalid("offset", array.offset));
    }
    if array.null_count < -1 || array.null_count > array.length {
        return Err(invalid("null_count", array.null_count));
    }
    check_type(data_type, path)?;

    // Buffers.
    let roles = roles(data_type);
    let variadic = matches!(data_type, DataType::Utf8View | DataType::BinaryView);
    let count_ok = if variadic {
        array.n_buffers > roles.len() as i64
    } else {
        array.n_buffers == roles.len() as i64
    };
    if !count_ok {
        return Err(Error::BufferCount {
            path: path.to_string(),
            data_type: data_type.to_string(),
            expected: if variadic {
                format!("at least {}", roles.len() + 1)
            } else {
                roles.len().to_string()
            },
            found: array.n_buffers,
        });
    }
    if array.n_buffers > 0 && array.buffers.is_null() {
        return Err(Error::NullPointer {
            what: "ArrowArray.buffers",
        });
    }
    let end = (array.offset + array.length) as usize;
    let value_type = match data_type {
        DataType::Dictionary(key, _) => key.as_ref(),
        dt => dt,
    };
    for (index, role) in roles.iter().enumerate() {
        let bytes = match role {
            BufferRole::Validity => {
                if array.null_count <= 0 {
                    0
                } else {
                    end.div_ceil(8)
                }
            }
            BufferRole::Values => fixed_bit_width(value_type)
                .map(|bits| end.saturating_mul(bits).div_ceil(8))
                .unwrap_or(0),
            BufferRole::Offsets => match data_type {
                DataType::Union(_, _) => end.saturating_mul(4),
                DataType::ListView(_) | DataType::LargeListView(_) => {
                    end.saturating_mul(offset_width(data_type))
                }
                // An empty array's offsets may be NULL (see "NULL offsets of empty arrays").
                _ if array.length == 0 => 0,
                _ => end
                    .saturating_add(1)
                    .saturating_mul(offset_width(data_type)),
            },
            BufferRole::Sizes => end.saturating_mul(offset_width(data_type)),
            BufferRole::TypeIds => end,
            BufferRole::Views => end.saturating_mul(16),
            // Sized by the offsets; checked by `validate_host_offsets`.
            BufferRole::Data | BufferRole::VariadicSizes => 0,
        };
        // SAFETY: `array` is well-formed (contract of this function).
        if bytes > 0 && unsafe { array.buffer(index) }.is_null() {
            return Err(Error::NullBuffer {
                path: path.to_string(),
                index,
                role: role.name(),
                bytes,
            });
        }
    }
    if variadic {
        let sizes_index = array.n_buffers as usize - 1;
        // SAFETY: `array` is well-formed (contract of this function).
        if sizes_index > roles.len() && unsafe { array.buffer(sizes_index) }.is_null() {
            return Err(Error::NullBuffer {
                path: path.to_string(),
                index: sizes_index,
                role: BufferRole::VariadicSizes.name(),
                bytes: (sizes_index - roles.len()) * 8,
            });
        }
    }

    // Children.
    let children = child_type_iter(data_type);
    if array.n_children != children.len() as i64 {
        return Err(Error::ChildCount {
            path: path.to_string(),
            data_type: data_type.to_string(),
            expected: children.len(),
            found: array.n_children,
        });
    }
    for (i, child_type) in children.enumerate() {
        let child_path = path.child(i);
        // SAFETY: `array` is well-formed (contract of this function).
        let child = unsafe { array.child(i) }.ok_or_else(|| Error::NullPointer {
            what: "ArrowArray child",
        })?;
        if child.is_released() {
            return Err(Error::Released {
                what: "ArrowArray child",
            });
        }
        // SAFETY: an unreleased child of a well-formed array is well-formed (C data
        // interface), and it was checked unreleased just above.
        unsafe { validate_node(child, child_type, &child_path, reads)? };
        // Children that are indexed positionally must be long enough.
        let needed = match data_type {
            DataType::Struct(_) | DataType::Union(_, UnionMode::Sparse) => Some(end),
            DataType::FixedSizeList(_, n) => Some(end.saturating_mul(*n as usize)),
            _ => None,
        };
        if let Some(needed) = needed {
            if (child.length as usize) < needed {
                return Err(Error::InvalidField {
                    path: child_path.to_string(),
                    field: "length",
                    value: child.length,
                });
            }
        }
    }

    // Dictionary.
    // SAFETY: `array` is well-formed (contract of this function).
    match (data_type, unsafe { array.dictionary() }) {
        (DataType::Dictionary(_, value_type), Some(dict)) => {
            let dict_path = path.dictionary();
            if dict.is_released() {
                return Err(Error::Released {
                    what: "ArrowArray dictionary",
                });
            }
            // SAFETY: an unreleased dictionary of a well-formed array is well-formed (C
            // data interface), and it was checked unreleased just above.
            unsafe { validate_node(dict, value_type, &dict_path, reads)? };
        }
        (DataType::Dictionary(_, _), None) => {
            return Err(Error::Dictionary {
                path: path.to_string(),
                message: "dictionary-encoded array has no dictionary".into(),
            })
        }
        (_, Some(_)) => {
            return Err(Error::Dictionary {
                path: path.to_string(),
                message: format!("a {data_type} array must not have a dictionary"),
            })
        }
        (_, None) => {}
    }
    if reads == Reads::OffsetsAligned {
        // SAFETY: the node is well-formed and structurally valid (checked above).
        unsafe { check_node_alignment(array, data_type, path)? };
    }
    if reads != Reads::Nothing {
        // SAFETY: the node and its subtree are structurally valid (checked above); the
        // caller guarantees host-readable buffers of the sizes the C data interface says.
        unsafe { check_node_offsets(array, data_type, path)? };
    }
    Ok(())
}

/// Checks what [`validate_structure`] checks and, in the same pass, reads the offsets of every
/// variable-length array: they must be non-negative, monotonic, within the child for
/// lists, and the data buffer must be non-NULL when they address bytes.
///
/// # Safety
/// As for [`validate_structure`] (`array` released or well-formed), and the buffers must
/// be readable by the host CPU (CPU, `CUDA_HOST` or `CUDA_MANAGED` after synchronization)
/// and at least as large as the C data interface says for the structs.
pub unsafe fn validate_host_offsets(
    array: &ArrowArray,
    data_type: &DataType,
    path: &str,
) -> Result<()> {
    // SAFETY: the caller's guarantees, passed on.
    unsafe { validate_tree(array, data_type, path, Reads::Offsets) }
}

/// What [`validate_host_offsets`] and then [`validate_in_place_alignment`] check, in one
/// pass over the tree: what arrow-rs's C data importer needs of a host array before it
/// reads it.
///
/// # Safety
/// As for [`validate_host_offsets`].
pub unsafe fn validate_host_import(
    array: &ArrowArray,
    data_type: &DataType,
    path: &str,
) -> Result<()> {
    // SAFETY: the caller's guarantees, passed on.
    unsafe { validate_tree(array, data_type, path, Reads::OffsetsAligned) }
}

/// [`validate_node`] of the root, after checking it is not released.
///
/// # Safety
/// As for [`validate_structure`]; with `reads` other than [`Reads::Nothing`], as for
/// [`validate_host_offsets`].
unsafe fn validate_tree(
    array: &ArrowArray,
    data_type: &DataType,
    path: &str,
    reads: Reads,
) -> Result<()> {
    if array.is_released() {
        return Err(Error::Released { what: "ArrowArray" });
    }
    // SAFETY: the caller guarantees an unreleased array is well-formed, and the buffers
    // host-readable where `reads` reads them.
    unsafe { validate_node(array, data_type, &NodePath::Root(path), reads) }
}

/// Reads offset `i` (4 or 8 bytes wide, native-endian, possibly unaligned).
///
/// # Safety
/// `ptr` must be valid for reads of `(i + 1) * width` bytes.
unsafe fn offset_at(ptr: *const c_void, width: usize, i: usize) -> i64 {
    if width == 4 {
        // SAFETY: the caller guarantees the range is readable; `read_unaligned` needs no
        // alignment from a foreign producer.
        unsafe { (ptr as *const i32).add(i).read_unaligned() as i64 }
    } else {
        // SAFETY: as above, for 8-byte offsets.
        unsafe { (ptr as *const i64).add(i).read_unaligned() }
    }
}

/// The first `i` in `0..len` where item `start + i + 1` of `ptr` is less than item
/// `start + i`, or `None` where the items never decrease. Runs of 1,024 pairs are compared
/// without a branch (so that the compiler vectorizes them: this check reads every offset
/// of every imported host batch, and an element-by-element loop that stops at the first
/// decrease cost Python's uploads about a tenth of their host time), and only a run with a
/// decrease is searched again.
///
/// # Safety
/// Items `start..=start + len` of `ptr` must be readable (at any alignment).
unsafe fn first_decrease<T: Copy + PartialOrd>(
    ptr: *const T,
    start: usize,
    len: usize,
) -> Option<usize> {
    const RUN: usize = 1024;
    // SAFETY: (every read below) the caller guarantees items `start..=start + len`.
    let at = |k: usize| unsafe { ptr.add(start + k).read_unaligned() };
    let mut i = 0;
    while i < len {
        let end = (i + RUN).min(len);
        let mut decreased = false;
        for k in i..end {
            decreased |= at(k + 1) < at(k);
        }
        if decreased {
            return (i..end).find(|&k| at(k + 1) < at(k));
        }
        i = end;
    }
    None
}

/// Checks the offsets of `array` alone (not its children): non-negative, monotonic,
/// within the child for lists, and the data buffer non-NULL when they address bytes.
///
/// # Safety
/// `array` and its subtree must be well-formed, unreleased and structurally valid for
/// `data_type` (as [`validate_node`] checked), with host-readable buffers of the sizes
/// the C data interface gives them.
unsafe fn check_node_offsets(
    array: &ArrowArray,
    data_type: &DataType,
    path: &NodePath<'_>,
) -> Result<()> {
    let bad = |message: String| Error::InvalidOffsets {
        path: path.to_string(),
        message,
    };
    let start = array.offset as usize;
    let len = array.length as usize;
    match data_type {
        dt if has_end_offsets(dt) => {
            let width = offset_width(data_type);
            // SAFETY: `array` is well-formed (contract of this function).
            let ptr = unsafe { array.buffer(1) };
            if ptr.is_null() {
                // An empty array (validate_structure allows NULL offsets only then): it
                // addresses nothing.
                return Ok(());
            }
            // SAFETY: (for all reads below) the offsets buffer is non-NULL, and the caller
            // guarantees it holds offset + length + 1 items, as the C data interface sizes
            // it (for a DeviceArray: `try_new`'s contract).
            let first = unsafe { offset_at(ptr, width, start) };
            if first < 0 {
                return Err(bad(format!("first offset {first} is negative")));
            }
            // SAFETY: see above: items `start..=start + len` are readable.
            let decrease = unsafe {
                if width == 4 {
                    first_decrease(ptr as *const i32, start, len)
                } else {
                    first_decrease(ptr as *const i64, start, len)
                }
            };
            if let Some(i) = decrease {
                // SAFETY: see above; `start + i + 1 <= offset + length`.
                let (a, b) = unsafe {
                    (
                        offset_at(ptr, width, start + i),
                        offset_at(ptr, width, start + i + 1),
                    )
                };
                return Err(bad(format!("offsets decrease at item {i}: {a} then {b}")));
            }
            // SAFETY: see above.
            let last = unsafe { offset_at(ptr, width, start + len) };
            match data_type {
                DataType::List(_) | DataType::LargeList(_) | DataType::Map(_, _) => {
                    // SAFETY: `array` is well-formed (contract of this function).
                    let child = unsafe { array.child(0) }.expect("checked by validate_structure");
                    if last > child.length {
                        return Err(bad(format!(
                            "last offset {last} is past the end of the child (length {})",
                            child.length
                        )));
                    }
                }
                _ => {
                    // SAFETY: `array` is well-formed (contract of this function).
                    if last > first && unsafe { array.buffer(2) }.is_null() {
                        return Err(Error::NullBuffer {
                            path: path.to_string(),
                            index: 2,
                            role: BufferRole::Data.name(),
                            bytes: last as usize,
                        });
                    }
                }
            }
        }
        DataType::ListView(_) | DataType::LargeListView(_) => {
            let width = offset_width(data_type);
            // SAFETY: `array` is well-formed (contract of this function).
            let child_len = unsafe { array.child(0) }.map(|c| c.length).unwrap_or(0);
            for i in 0..len {
                // SAFETY: `array` is well-formed, and its offsets and sizes buffers hold
                // offset + length items (checked non-NULL).
                let (o, s) = unsafe {
                    (
                        offset_at(array.buffer(1), width, start + i),
                        offset_at(array.buffer(2), width, start + i),
                    )
                };
                if o < 0 || s < 0 || o.checked_add(s).is_none_or(|e| e > child_len) {
                    return Err(bad(format!(
                        "list view {i} (offset {o}, size {s}) is outside the child (length {child_len})"
                    )));
                }
            }
        }
        DataType::Utf8View | DataType::BinaryView => {
            let n_variadic = array.n_buffers as usize - 3;
            // SAFETY: `array` is well-formed (contract of this function).
            let sizes_ptr = unsafe { array.buffer(array.n_buffers as usize - 1) };
            for i in 0..n_variadic {
                // SAFETY: the variadic sizes buffer holds one int64 per variadic buffer.
                let s = unsafe { offset_at(sizes_ptr, 8, i) };
                if s < 0 {
                    return Err(bad(format!("variadic buffer {i} has negative size {s}")));
                }
                // SAFETY: `array` is well-formed (contract of this function).
                if s > 0 && unsafe { array.buffer(2 + i) }.is_null() {
                    return Err(Error::NullBuffer {
                        path: path.to_string(),
                        index: 2 + i,
                        role: BufferRole::Data.name(),
                        bytes: s as usize,
                    });
                }
            }
        }
        _ => {}
    }
    Ok(())
}

/// Checks that the buffers arrow-rs's C data importer reads *in place* are aligned for
/// the integers it reads there: the offsets of `Utf8`/`Binary` (4 bytes) and
/// `LargeUtf8`/`LargeBinary` (8 bytes), whose last offset sizes the data buffer, and the
/// variadic buffer sizes of `Utf8View`/`BinaryView` (8 bytes). arrow-rs dereferences those
/// as `i32`/`i64` pointers, so an unaligned one (which the C data interface allows a
/// producer to hand over, and a consumer to refuse) would be undefined behaviour there.
/// Every other buffer arrow-rs copies into aligned memory before it reads it. Reads no
/// buffer.
///
/// # Safety
/// As for [`validate_structure`], which must have passed for `data_type`.
pub unsafe fn validate_in_place_alignment(
    array: &ArrowArray,
    data_type: &DataType,
    path: &str,
) -> Result<()> {
    // SAFETY: the caller's guarantees, passed on.
    unsafe { check_alignment_node(array, data_type, &NodePath::Root(path)) }
}

/// # Safety
/// As for [`validate_in_place_alignment`].
unsafe fn check_alignment_node(
    array: &ArrowArray,
    data_type: &DataType,
    path: &NodePath<'_>,
) -> Result<()> {
    // SAFETY: the caller's guarantees, passed on.
    unsafe { check_node_alignment(array, data_type, path)? };
    for (i, child_type) in child_type_iter(data_type).enumerate() {
        // SAFETY: `array` is well-formed (contract of this function).
        let child = unsafe { array.child(i) }.expect("checked by validate_structure");
        // SAFETY: validate_structure checked the child unreleased (hence well-formed) and
        // valid for its type.
        unsafe { check_alignment_node(child, child_type, &path.child(i))? };
    }
    // SAFETY: `array` is well-formed (contract of this function).
    let dictionary = unsafe { array.dictionary() };
    if let (DataType::Dictionary(_, value_type), Some(dict)) = (data_type, dictionary) {
        // SAFETY: as for the children.
        unsafe { check_alignment_node(dict, value_type, &path.dictionary())? };
    }
    Ok(())
}

/// The alignment check of [`validate_in_place_alignment`] for `array` alone, not its
/// children.
///
/// # Safety
/// As for [`validate_in_place_alignment`].
unsafe fn check_node_alignment(
    array: &ArrowArray,
    data_type: &DataType,
    path: &NodePath<'_>,
) -> Result<()> {
    let misaligned = |index: usize, role: BufferRole, align: usize| {
        // SAFETY: `array` is well-formed (contract of this function).
        let address = unsafe { array.buffer(index) } as usize;
        if address.is_multiple_of(align) {
            return Ok(());
        }
        Err(Error::MisalignedBuffer {
            path: path.to_string(),
            index,
            role: role.name(),
            address,
            align,
        })
    };
    match data_type {
        DataType::Utf8 | DataType::Binary => misaligned(1, BufferRole::Offsets, 4)?,
        DataType::LargeUtf8 | DataType::LargeBinary => misaligned(1, BufferRole::Offsets, 8)?,
        DataType::Utf8View | DataType::BinaryView if array.n_buffers > 3 => {
            misaligned(array.n_buffers as usize - 1, BufferRole::VariadicSizes, 8)?
        }
        _ => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::first_decrease;

    #[test]
    fn the_first_decrease_is_found_in_every_run_and_at_its_edges() {
        let rising: Vec<i64> = (0..3000).collect();
        // SAFETY: (every call) items `start..=start + len` lie in the vector.
        assert_eq!(unsafe { first_decrease(rising.as_ptr(), 0, 2999) }, None);
        // SAFETY: as above.
        assert_eq!(unsafe { first_decrease(rising.as_ptr(), 5, 0) }, None);
        for at in [0usize, 1, 1022, 1023, 1024, 2047, 2048, 2998] {
            let mut v = rising.clone();
            v[at + 1] = v[at] - 1; // item at + 1 below item at
            let narrow: Vec<i32> = v.iter().map(|&x| x as i32).collect();
            // SAFETY: as above.
            unsafe {
                assert_eq!(first_decrease(v.as_ptr(), 0, 2999), Some(at), "at {at}");
                assert_eq!(
                    first_decrease(narrow.as_ptr(), 0, 2999),
                    Some(at),
                    "at {at}"
                );
                if at >= 3 {
                    // from an offset: the index counts from `start`
                    assert_eq!(first_decrease(v.as_ptr(), 3, 2996), Some(at - 3));
                }
                // a range that ends before the decrease sees none
                assert_eq!(first_decrease(v.as_ptr(), 0, at), None, "at {at}");
            }
        }
        // equal neighbours are not a decrease; an unaligned start reads the same
        let flat = [7i32; 2100];
        // SAFETY: as above.
        assert_eq!(unsafe { first_decrease(flat.as_ptr(), 0, 2099) }, None);
        let mut items: Vec<i32> = (0..41).collect();
        items[21] = 3; // item 21 below item 20
        let bytes: Vec<u8> = std::iter::once(0u8)
            .chain(items.iter().flat_map(|x| x.to_le_bytes()))
            .collect();
        let unaligned = bytes[1..].as_ptr() as *const i32;
        // SAFETY: the 164 bytes from byte 1 hold the 41 items, read unaligned.
        assert_eq!(unsafe { first_decrease(unaligned, 0, 40) }, Some(20));
    }
}
