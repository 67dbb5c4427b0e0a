//! Exact null counts (`ExportOptions::exact_null_counts`): the nodes whose null count is
//! unknown (-1) are counted on the device from their validity bitmaps, all in one
//! readback once the walk is done, and the counts written into the tree.

use std::ffi::c_void;

use arrow_schema::DataType;
use devarrow_abi::export_tree::ArrayNode;
use devarrow_abi::Result;

use super::{at, at_mut, Converter};

/// `null_count` of a node whose count is pending: `-(2 + slot)`.
fn pending(slot: usize) -> i64 {
    -2 - slot as i64
}

impl Converter<'_> {
    /// Marks a node with an unknown null count (and a validity bitmap) for counting; a
    /// node without a bitmap has none, a null array as many as its rows.
    pub(super) fn schedule_null_count(&mut self, data_type: &DataType, node: &mut ArrayNode) {
        if node.null_count >= 0 {
            return;
        }
        match data_type {
            DataType::Null => node.null_count = node.length,
            DataType::Union(..) | DataType::RunEndEncoded(..) => {}
            _ => match node.buffers.first() {
                Some(bitmap) if !bitmap.is_null() => {
                    node.null_count = pending(self.counts.len());
                    self.counts
                        .push((*bitmap, node.offset as u64, node.length as u64));
                }
                _ => node.null_count = 0,
            },
        }
    }

    /// Counts the scheduled null counts (one readback) and writes them into the tree.
    pub(super) fn resolve_null_counts(&mut self, root: &mut ArrayNode) -> Result<()> {
        if self.counts.is_empty() {
            return Ok(());
        }
        let out = self.allocate(8 * self.counts.len() as u64)?;
        let counts = std::mem::take(&mut self.counts);
        let kernels = self.kernels("(null counts)", &DataType::Null)?;
        for (slot, &(bitmap, bit_offset, len)) in counts.iter().enumerate() {
            // SAFETY: each bitmap covers its node's `offset + length` bits (the batch's
            // own buffers); `out` holds one u64 per slot.
            unsafe {
                kernels.count_set_bits(bitmap, bit_offset, len, at_mut(out, 8 * slot as u64))?
            };
        }
        let addresses: Vec<_> = (0..counts.len()).map(|s| at(out, 8 * s as u64)).collect();
        let set = self.read_i64s(&addresses)?;
        fn patch(node: &mut ArrayNode, counts: &[(*const c_void, u64, u64)], set: &[i64]) {
            if node.null_count <= -2 {
                let slot = (-2 - node.null_count) as usize;
                node.null_count = counts[slot].2 as i64 - set[slot];
            }
            for child in &mut node.children {
                patch(child, counts, set);
            }
            if let Some(d) = &mut node.dictionary {
                patch(d, counts, set);
            }
        }
        patch(root, &counts, &set);
        Ok(())
    }
}
