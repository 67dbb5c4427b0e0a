//! Realistic Arrow data for the main job and the benchmarks: TPC-H `lineitem`, built in
//! memory with `tpchgen-arrow` (16 columns: integers, decimals, dates, short and long
//! strings), generated in parallel, one part per thread.

use arrow_array::RecordBatch;
use arrow_schema::SchemaRef;
use tpchgen::generators::LineItemGenerator;
use tpchgen_arrow::LineItemArrow;

/// `lineitem` rows at scale 1 (at other scales about proportional: 6,001,215 at SF 1,
/// 600,572 at SF 0.1).
pub const LINEITEM_ROWS_SF1: u64 = 6_001_215;

/// About how many `lineitem` rows `scale` has.
pub fn estimated_lineitem_rows(scale: f64) -> u64 {
    (LINEITEM_ROWS_SF1 as f64 * scale.max(0.0)).round() as u64
}

/// The schema of `lineitem`.
pub fn lineitem_schema() -> SchemaRef {
    LineItemArrow::schema_ref()
}

/// TPC-H `lineitem` at `scale` (1.0 is about 6 million rows), in batches of at most
/// `batch_rows` rows, generated on all cores. Rows come in TPC-H order.
///
/// # Panics
/// Panics if `batch_rows` is 0 or `scale` is not positive.
pub fn lineitem(scale: f64, batch_rows: usize) -> Vec<RecordBatch> {
    lineitem_with_progress(scale, batch_rows, &|_| ())
}

/// [`lineitem`], calling `on_rows` (from the generating threads) with the row count of
/// every batch as it is built.
///
/// # Panics
/// Panics if `batch_rows` is 0 or `scale` is not positive.
pub fn lineitem_with_progress(
    scale: f64,
    batch_rows: usize,
    on_rows: &(dyn Fn(usize) + Sync),
) -> Vec<RecordBatch> {
    assert!(batch_rows > 0, "batch_rows must be positive");
    assert!(scale > 0.0, "scale must be positive");
    let parts = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .clamp(1, 64) as i32;
    // Small scales: one part, so batches are not split needlessly.
    let parts = if scale < 0.05 { 1 } else { parts };
    std::thread::scope(|scope| {
        let handles: Vec<_> = (1..=parts)
            .map(|part| {
                scope.spawn(move || {
                    LineItemArrow::new(LineItemGenerator::new(scale, part, parts))
                        .with_batch_size(batch_rows)
                        .map(|b| b.expect("tpchgen-arrow builds valid batches"))
                        .inspect(|b| on_rows(b.num_rows()))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("generator thread"))
            .collect()
    })
}

/// Bytes of host memory the Arrow buffers of `batches` hold: see
/// [`crate::footprint::arrow_bytes`] (every allocation counted once, however many
/// columns or batches share it).
pub fn batch_bytes(batches: &[RecordBatch]) -> usize {
    crate::footprint::arrow_bytes(batches)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn small_lineitem_has_the_tpch_schema() {
        let seen = AtomicUsize::new(0);
        let batches = lineitem_with_progress(0.001, 1000, &|rows| {
            seen.fetch_add(rows, Ordering::Relaxed);
        });
        assert!(!batches.is_empty());
        assert_eq!(batches[0].schema(), lineitem_schema());
        let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
        assert!(rows > 5000 && rows < 7000, "{rows} rows at SF 0.001");
        assert!(batches.iter().all(|b| b.num_rows() <= 1000));
        assert_eq!(seen.into_inner(), rows);
        let estimate = estimated_lineitem_rows(0.001) as f64;
        assert!((rows as f64 - estimate).abs() < estimate * 0.05, "{rows}");
    }
}
