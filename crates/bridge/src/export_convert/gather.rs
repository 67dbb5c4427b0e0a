//! The children of list views not in order, gathered into list order on the device
//! ([`Converter::gather`]): fixed-width, boolean, string and binary values (offsets or
//! views) and structs of them, with their validity.

use std::ffi::c_void;

use arrow_schema::DataType;
use devarrow_abi::device::{RowIntegers, Validity};
use devarrow_abi::export_tree::ArrayNode;
use devarrow_abi::{Error, Result};

use super::{all, at, Converter, Read, Step, DIALECT};

/// The rows of list views whose child is gathered into list order.
#[derive(Debug, Clone, Copy)]
pub(super) struct Gather {
    /// The views' offsets (from the list's first row).
    pub view_offsets: RowIntegers,
    /// The rows.
    pub n: u64,
    /// The rows' new offsets (`n + 1` `int64`s, non-decreasing, null rows empty).
    pub new_offsets: *const c_void,
    /// The values gathered (the last new offset).
    pub total: u64,
}

impl<'a> Converter<'a> {
    /// A child of list views put in list order: the values the views of `rows` reach,
    /// one after another (`rows.total` of them, offset 0), for fixed-width, boolean,
    /// string and binary (offsets or views) children and structs of them; their validity
    /// gathered too. `extra` is added to every child index (a struct's offset, for its
    /// fields). Other children are [`Error::NotConvertible`].
    pub(super) fn gather(
        &mut self,
        path: &str,
        data_type: &DataType,
        mut child: ArrayNode,
        extra: u64,
        rows: Gather,
    ) -> Result<Step<'a, ArrayNode>> {
        let base = extra + child.offset as u64;
        let total = rows.total;
        let words = total.div_ceil(32);
        let cannot = |what: &str| Error::NotConvertible {
            path: path.into(),
            data_type: data_type.to_string(),
            dialect: DIALECT,
            reason: format!(
                "the list views over it are not in order, and {what} (fixed-width, boolean, \
                 string and binary children, and structs of them, are gathered)"
            ),
        };
        let has_validity = !matches!(
            data_type,
            DataType::Null | DataType::Union(..) | DataType::RunEndEncoded(..)
        );
        let validity = match child.buffers.first() {
            Some(&bits) if has_validity && !bits.is_null() => {
                let out = self.allocate(4 * words)?;
                let kernels = self.kernels(path, data_type)?;
                // SAFETY: the child's bitmap covers every index the valid views reach
                // (checked at import, or written by devarrow's upload); `out` holds
                // `words` words.
                unsafe {
                    kernels.gather_list_bits(
                        bits,
                        base,
                        rows.view_offsets,
                        rows.n,
                        rows.new_offsets,
                        out,
                    )?
                };
                out.cast_const()
            }
            _ => std::ptr::null(),
        };
        let value_width = match data_type {
            DataType::Boolean => Some(0),
            DataType::Utf8View | DataType::BinaryView => Some(16),
            dt if dt.is_primitive() => dt.primitive_width().map(|w| w as u64),
            DataType::FixedSizeBinary(w) => Some(*w as u64),
            _ => None,
        };
        // The buffers gathered, and the children (a struct's fields gathered).
        let gathered: Step<'a, (Vec<*const c_void>, Option<Vec<ArrayNode>>)> =
            match (data_type, value_width) {
                (DataType::Struct(fields), _) => {
                    let children = std::mem::take(&mut child.children);
                    all(
                        self,
                        fields.iter().zip(children),
                        |converter, (field, c)| {
                            converter.gather(
                                &format!("{path}.{}", field.name()),
                                field.data_type(),
                                c,
                                base,
                                rows,
                            )
                        },
                    )?
                    .map(move |children| (vec![validity], Some(children)))
                }
                (_, Some(0)) => {
                    let out = self.allocate(4 * words)?;
                    let kernels = self.kernels(path, data_type)?;
                    // SAFETY: as for the validity, the values' bits.
                    unsafe {
                        kernels.gather_list_bits(
                            child.buffers[1],
                            base,
                            rows.view_offsets,
                            rows.n,
                            rows.new_offsets,
                            out,
                        )?
                    };
                    Step::Done((vec![validity, out], None))
                }
                (_, Some(width)) => {
                    let out = self.allocate(width * total)?;
                    let kernels = self.kernels(path, data_type)?;
                    // SAFETY: the child's values cover every index the valid views reach;
                    // `out` holds `total` values.
                    unsafe {
                        kernels.gather_list_values(
                            child.buffers[1],
                            width,
                            base,
                            rows.view_offsets,
                            rows.n,
                            rows.new_offsets,
                            out,
                        )?
                    };
                    // views keep their variadic buffers (and their sizes) as they are
                    let mut buffers = vec![validity, out.cast_const()];
                    buffers.extend_from_slice(&child.buffers[2..]);
                    Step::Done((buffers, None))
                }
                (
                    DataType::Utf8 | DataType::Binary | DataType::LargeUtf8 | DataType::LargeBinary,
                    _,
                ) => self
                    .gather_strings(path, data_type, &child, base, rows, validity)?
                    .map(move |(data, offsets)| {
                        (
                            vec![validity, offsets.cast_const(), data.cast_const()],
                            None,
                        )
                    }),
                _ => {
                    return Err(cannot(&format!(
                        "gathering a {data_type} on the device is not supported"
                    )))
                }
            };
        Ok(gathered.map(move |(buffers, children)| {
            child.buffers = buffers;
            if let Some(children) = children {
                child.children = children;
            }
            child.length = total as i64;
            child.offset = 0;
            child.null_count = if validity.is_null() { 0 } else { -1 };
            child
        }))
    }

    /// The strings (or binaries) of a child with offsets at the indices list views reach,
    /// in list order: their views (`DeviceKernels::offsets_to_views` over an index map,
    /// itself a gather of `0, 1, 2, ...`), then the bytes gathered as a view column's are.
    /// Gives the new data and offsets (`int32` for `Utf8`/`Binary`, `int64` for the large
    /// types). Rounds: the end of the child's data; the bytes gathered.
    fn gather_strings(
        &mut self,
        path: &str,
        data_type: &DataType,
        child: &ArrayNode,
        base: u64,
        rows: Gather,
        validity: *const c_void,
    ) -> Result<Step<'a, (*mut c_void, *mut c_void)>> {
        let large = matches!(data_type, DataType::LargeUtf8 | DataType::LargeBinary);
        let width = if large { 8 } else { 4 };
        // the physical indices of the child's values: every index gathered is below it
        let reach = child.offset as u64 + child.length as u64;
        let end = Read {
            address: at(child.buffers[1], width * reach),
            width,
        };
        let (path, data_type) = (path.to_string(), data_type.clone());
        let (child_offsets, child_data) = (child.buffers[1], child.buffers[2]);
        Ok(Step::read(vec![end], move |converter, values| {
            let end = values[0];
            if reach > i32::MAX as u64 || end > u32::MAX as i64 {
                return Err(converter.refuse(
                    &path,
                    &data_type,
                    "the list views over it are not in order, and it is too large to gather \
                     (2^31 values or 4 GiB): export slices of the batch",
                ));
            }
            let total = rows.total;
            let iota = converter.allocate(4 * reach)?;
            let indices = converter.allocate(4 * total)?;
            let views = converter.allocate(16 * total)?;
            let offsets = converter.allocate(8 * (total + 1))?;
            let table = converter.allocate(8)?;
            let kernels = converter.kernels(&path, &data_type)?;
            // `iota` holds `reach` int32s, `indices` one per gathered value, `views` 16
            // bytes each, `offsets` total + 1 int64s, `table` the data's address; the
            // child's offsets cover every index below `reach` and its data their bytes.
            // SAFETY: the ranges just described, for every call of the block.
            unsafe {
                kernels.fill_offsets_i32(iota, reach, 1)?;
                kernels.gather_list_values(
                    iota,
                    4,
                    base,
                    rows.view_offsets,
                    rows.n,
                    rows.new_offsets,
                    indices,
                )?;
                let child_offsets = RowIntegers {
                    address: child_offsets,
                    stride: width,
                    wide: large,
                };
                kernels.offsets_to_views(child_offsets, child_data, indices, total, views)?;
                let sizes = RowIntegers {
                    address: views,
                    stride: 16,
                    wide: false,
                };
                kernels.row_sizes(sizes, Validity::new(validity, 0), total, offsets)?;
                kernels.inclusive_scan_i64(offsets, total + 1)?;
                converter
                    .copy_bytes_to_device((child_data as u64).to_le_bytes().to_vec(), table)?;
            }
            Ok(Step::read(
                vec![Read::i64(at(offsets, 8 * total))],
                move |converter, values| {
                    let bytes = values[0].max(0) as u64;
                    if !large && bytes > i32::MAX as u64 {
                        return Err(converter.refuse(
                            &path,
                            &data_type,
                            "gathered, its values pass int32 offsets: export slices of the batch",
                        ));
                    }
                    let data = converter.allocate(bytes)?;
                    let narrow = if large {
                        None
                    } else {
                        Some(converter.allocate(4 * (total + 1))?)
                    };
                    let kernels = converter.kernels(&path, &data_type)?;
                    let validity = Validity::new(validity, 0);
                    // The views made above (one variadic buffer, the child's data, its
                    // address in `table`), `offsets` their scan, `data` its `bytes`;
                    // narrowed, total + 1 int64s, each at most `bytes` (which fits), to as
                    // many int32s.
                    // SAFETY: the ranges just described.
                    unsafe {
                        match narrow {
                            Some(narrow) => kernels.gather_view_bytes_narrowed(
                                views, validity, total, table, offsets, data, narrow,
                            )?,
                            None => kernels
                                .gather_view_bytes(views, validity, total, table, offsets, data)?,
                        }
                    };
                    Ok(Step::Done((data, narrow.unwrap_or(offsets))))
                },
            ))
        }))
    }
}
