//! Typed access to the device memory of a [`DeviceBatch`]: each column
//! ([`DeviceBatch::column`]) as a [`DeviceColumn`], with its data type, length, offset,
//! null count, its buffers ([`ColumnBuffer`]: address, length in bytes, device), its
//! children and its dictionary, for engines that run their own kernels on a column
//! instead of walking an exported `ArrowDeviceArray`.
//!
//! Both borrow the batch, which keeps the memory alive: a packed batch's allocation or an
//! imported batch's foreign array (unreleased). Nothing here reads device memory. With
//! the `cuda` feature, buffers of a CUDA batch become cudarc views on a caller's stream
//! (`ColumnBuffer::cuda_view`, `DeviceColumn::cuda_values`, in `crate::cuda`).
//!
//! The arrays are those of the C data interface, as [`DeviceBatch::export`] would export
//! them: a buffer's address is where the C struct's `buffers[i]` points and its length
//! the bytes from there that items `[0, offset + length)` address; an array's children
//! and dictionary have their own `offset` and `length`, to which the parent's offset
//! applies as the C data interface says (e.g. for struct children). Columns of a packed
//! batch have offset 0 at every level; a column of an imported batch whose root struct
//! has an offset gets that offset added to its own (so `offset()` and `len()` always
//! describe the column's rows).

use std::ffi::c_void;

use arrow_schema::DataType;
use devarrow_abi::layout::BufferRole;
use devarrow_abi::ArrowDeviceType;

use crate::batch::{DeviceBatch, Storage};
use crate::foreign::{buffer_role, ForeignNode};
use crate::plan::Node;

/// One array of a batch's tree: planned (packed) or imported (foreign).
#[derive(Debug, Clone, Copy)]
enum NodeRef<'a> {
    Packed(&'a Node),
    Foreign(&'a ForeignNode),
}

/// A column of a device-resident batch (or a child or dictionary of one), borrowing the
/// batch: its data type, rows, null count and device buffers.
///
/// The arrays are those of the C data interface, as [`DeviceBatch::export`] would export
/// them: a buffer's address is where the C struct's `buffers[i]` points and its length
/// the bytes from there that items `[0, offset + length)` address; an array's children
/// and dictionary have their own `offset` and `length`, to which the parent's offset
/// applies as the C data interface says (e.g. for struct children). Columns of a packed
/// batch have offset 0 at every level; a column of an imported batch whose root struct
/// has an offset gets that offset added to its own (so `offset()` and `len()` always
/// describe the column's rows).
#[derive(Debug, Clone, Copy)]
pub struct DeviceColumn<'a> {
    batch: &'a DeviceBatch,
    node: NodeRef<'a>,
    offset: usize,
    len: usize,
    /// Whether `offset` and `len` are the node's own (not narrowed by a sliced root).
    whole: bool,
}

/// One buffer of a [`DeviceColumn`], borrowing the batch: where it lies on which device
/// and how many bytes it spans. Never read here.
#[derive(Debug, Clone, Copy)]
pub struct ColumnBuffer<'a> {
    pub(crate) batch: &'a DeviceBatch,
    pub(crate) address: usize,
    pub(crate) len: usize,
    index: usize,
    role: BufferRole,
}

impl DeviceBatch {
    /// The number of columns.
    pub fn num_columns(&self) -> usize {
        self.schema.fields().len()
    }

    /// Column `i` (as [`RecordBatch::column`](arrow_array::RecordBatch::column) numbers
    /// them), `None` when out of range.
    ///
    /// ```
    /// use std::sync::Arc;
    ///
    /// use arrow_array::{ArrayRef, Int64Array, RecordBatch, StringArray};
    /// use arrow_schema::DataType;
    /// use devarrow_abi::device::CpuDevice;
    /// use devarrow_abi::layout::BufferRole;
    /// use devarrow_bridge::{Transfer, TransferOptions};
    ///
    /// # fn main() -> devarrow_abi::Result<()> {
    /// let batch = RecordBatch::try_from_iter([
    ///     ("id", Arc::new(Int64Array::from(vec![Some(1), None, Some(3)])) as ArrayRef),
    ///     ("name", Arc::new(StringArray::from(vec!["x", "yy", "zzz"])) as ArrayRef),
    /// ])?;
    /// let mut transfer = Transfer::new(Arc::new(CpuDevice::new()), TransferOptions::default());
    /// let on_device = transfer.to_device(&batch)?;
    ///
    /// let id = on_device.column(0).expect("two columns");
    /// assert_eq!((id.data_type(), id.len(), id.null_count()), (&DataType::Int64, 3, Some(1)));
    /// let values = id.values().expect("a values buffer");
    /// assert_eq!(values.len(), 3 * 8); // exactly the rows' bytes
    ///
    /// let name = on_device.column_by_name("name").expect("a column named name");
    /// let roles: Vec<_> = name.buffers().iter().flatten().map(|b| b.role()).collect();
    /// assert_eq!(roles, [BufferRole::Offsets, BufferRole::Data]); // no nulls: no bitmap
    /// assert!(on_device.column(2).is_none());
    /// # Ok(())
    /// # }
    /// ```
    pub fn column(&self, i: usize) -> Option<DeviceColumn<'_>> {
        match &self.storage {
            Storage::Packed { root, .. } => root.children.get(i).map(|node| DeviceColumn {
                batch: self,
                node: NodeRef::Packed(node),
                offset: node.offset,
                len: node.len,
                whole: true,
            }),
            Storage::Foreign(foreign) => {
                let root = foreign.root();
                root.children.get(i).map(|node| {
                    // The root's offset applies to its children (C data interface).
                    let offset = node.offset + root.offset;
                    DeviceColumn {
                        batch: self,
                        node: NodeRef::Foreign(node),
                        offset,
                        len: root.length,
                        whole: offset == node.offset && root.length == node.length,
                    }
                })
            }
        }
    }

    /// The column of the field named `name`, `None` when there is none.
    pub fn column_by_name(&self, name: &str) -> Option<DeviceColumn<'_>> {
        let (i, _) = self.schema.column_with_name(name)?;
        self.column(i)
    }

    /// Every column, in schema order.
    pub fn columns(&self) -> Vec<DeviceColumn<'_>> {
        (0..self.num_columns())
            .filter_map(|i| self.column(i))
            .collect()
    }
}

impl<'a> DeviceColumn<'a> {
    fn own(batch: &'a DeviceBatch, node: NodeRef<'a>) -> Self {
        let (offset, len) = match node {
            NodeRef::Packed(n) => (n.offset, n.len),
            NodeRef::Foreign(n) => (n.offset, n.length),
        };
        Self {
            batch,
            node,
            offset,
            len,
            whole: true,
        }
    }

    /// The batch the column belongs to.
    pub fn batch(&self) -> &'a DeviceBatch {
        self.batch
    }

    /// The Arrow data type.
    pub fn data_type(&self) -> &'a DataType {
        match self.node {
            NodeRef::Packed(n) => &n.data_type,
            NodeRef::Foreign(n) => &n.data_type,
        }
    }

    /// The number of items (rows).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no items.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The offset of the first item in the buffers (in items; bits for bitmaps), as the
    /// C data interface's `offset`.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The number of null items, `None` when unknown (a producer's `null_count` of -1, or
    /// a column narrowed by its batch's offset that has nulls somewhere).
    pub fn null_count(&self) -> Option<usize> {
        let count = match self.node {
            NodeRef::Packed(n) => n.null_count,
            NodeRef::Foreign(n) => usize::try_from(n.null_count).ok(),
        };
        match count {
            Some(0) => Some(0),
            count if self.whole => count,
            _ => None,
        }
    }

    /// The device type of the buffers (for an imported batch, the foreign array's:
    /// `ARROW_DEVICE_CUDA_HOST` for pinned memory, say).
    pub fn device_type(&self) -> ArrowDeviceType {
        self.batch.buffers_placement().0
    }

    /// The device id of the buffers.
    pub fn device_id(&self) -> i64 {
        self.batch.buffers_placement().1
    }

    /// The number of buffers (the C data interface's `n_buffers`, variadic buffers of
    /// view types included).
    pub fn n_buffers(&self) -> usize {
        match self.node {
            NodeRef::Packed(n) => n.buffers.len(),
            NodeRef::Foreign(n) => n.buffers.len(),
        }
    }

    /// Buffer `i` in C data interface order, `None` when it is NULL (a validity bitmap
    /// of an array without nulls, say) or `i >= n_buffers()`.
    ///
    /// The variadic buffers of an imported view column span their whole size where the
    /// import read it: every buffer's, unless the column has more variadic buffers than
    /// the batch's rows reach (a slice of a column of many small blocks); then only the
    /// buffers those rows' views point into have theirs, and the others span 0 bytes (the
    /// sizes buffer holds them all, on the device).
    pub fn buffer(&self, i: usize) -> Option<ColumnBuffer<'a>> {
        let n = self.n_buffers();
        let role = buffer_role(self.data_type(), i, n);
        let (address, len) = match (self.node, &self.batch.storage) {
            (NodeRef::Packed(node), Storage::Packed { memory, .. }) => {
                let placement = (*node.buffers.get(i)?)?;
                (memory.address() as usize + placement.offset, placement.len)
            }
            (NodeRef::Foreign(node), _) => {
                let address = *node.buffers.get(i)?;
                if address == 0 {
                    return None;
                }
                (address, node.buffer_len(i, self.offset + self.len))
            }
            _ => return None,
        };
        Some(ColumnBuffer {
            batch: self.batch,
            address,
            len,
            index: i,
            role,
        })
    }

    /// Every buffer in C data interface order (`None`: a NULL buffer).
    pub fn buffers(&self) -> Vec<Option<ColumnBuffer<'a>>> {
        (0..self.n_buffers()).map(|i| self.buffer(i)).collect()
    }

    /// The validity bitmap (bit `offset() + i` for item `i`), `None` when the array has
    /// none (no nulls, or a type without one).
    pub fn validity(&self) -> Option<ColumnBuffer<'a>> {
        self.buffer(0).filter(|b| b.role() == BufferRole::Validity)
    }

    /// The buffer of fixed-width values (dictionary keys for a dictionary array), `None`
    /// for other types.
    pub fn values(&self) -> Option<ColumnBuffer<'a>> {
        (0..self.n_buffers())
            .find(|&i| buffer_role(self.data_type(), i, self.n_buffers()) == BufferRole::Values)
            .and_then(|i| self.buffer(i))
    }

    /// The number of children.
    pub fn num_children(&self) -> usize {
        match self.node {
            NodeRef::Packed(n) => n.children.len(),
            NodeRef::Foreign(n) => n.children.len(),
        }
    }

    /// Child `i` (with its own offset and length), `None` when out of range.
    pub fn child(&self, i: usize) -> Option<DeviceColumn<'a>> {
        let node = match self.node {
            NodeRef::Packed(n) => NodeRef::Packed(n.children.get(i)?),
            NodeRef::Foreign(n) => NodeRef::Foreign(n.children.get(i)?),
        };
        Some(Self::own(self.batch, node))
    }

    /// Every child, in order.
    pub fn children(&self) -> Vec<DeviceColumn<'a>> {
        (0..self.num_children())
            .filter_map(|i| self.child(i))
            .collect()
    }

    /// The dictionary of a dictionary-encoded array (with its own offset and length).
    pub fn dictionary(&self) -> Option<DeviceColumn<'a>> {
        let node = match self.node {
            NodeRef::Packed(n) => NodeRef::Packed(n.dictionary.as_deref()?),
            NodeRef::Foreign(n) => NodeRef::Foreign(n.dictionary.as_deref()?),
        };
        Some(Self::own(self.batch, node))
    }
}

impl<'a> ColumnBuffer<'a> {
    /// The batch the buffer belongs to.
    pub fn batch(&self) -> &'a DeviceBatch {
        self.batch
    }

    /// The address of the first byte on the device (what the C struct's `buffers[i]`
    /// holds). Not dereferenceable on the host unless the device type is host memory.
    pub fn as_ptr(&self) -> *const c_void {
        self.address as *const c_void
    }

    /// The address as an integer (a `CUdeviceptr` on CUDA).
    pub fn address(&self) -> u64 {
        self.address as u64
    }

    /// The length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer spans no byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The buffer's index in the array's buffers.
    pub fn index(&self) -> usize {
        self.index
    }

    /// What the buffer holds.
    pub fn role(&self) -> BufferRole {
        self.role
    }

    /// The device type of the memory.
    pub fn device_type(&self) -> ArrowDeviceType {
        self.batch.buffers_placement().0
    }

    /// The device id of the memory.
    pub fn device_id(&self) -> i64 {
        self.batch.buffers_placement().1
    }
}
