//! What DataFusion's statistics say a plan moves across the link: the estimates the
//! rule places joins by ([`crate::rule`]), and a device join checks again when its
//! partition has read its build side (`DeviceHashJoinExec`'s run-time placement).

use std::sync::Arc;

use arrow_schema::SchemaRef;
use datafusion::physical_plan::statistics::{StatisticsArgs, StatisticsContext};
use datafusion::physical_plan::ExecutionPlan;

/// A build side this small stays with its join on the device whatever the statistics
/// say: its upload costs less than ending a region for a host join (a download, then
/// an upload for the operators above), and the estimates of small inputs are rough.
pub(crate) const SMALL_BUILD_SIDE: usize = 1 << 20;

/// The bytes `plan`'s output would move across the link by DataFusion's statistics (its
/// row count, exact or estimated, times [`row_bytes`]); `None` where they do not say.
pub(crate) fn link_bytes(plan: &Arc<dyn ExecutionPlan>) -> Option<usize> {
    let stats = StatisticsContext::new()
        .compute(plan.as_ref(), &StatisticsArgs::new())
        .ok()?;
    let rows = *stats.num_rows.get_value()?;
    Some(rows.saturating_mul(row_bytes(&plan.schema())))
}

/// An estimate of the bytes a row of `schema` moves across the link: fixed-width
/// values at their width, booleans as a byte, strings and binaries as 32 (a view and
/// some bytes), anything else as 32.
pub(crate) fn row_bytes(schema: &SchemaRef) -> usize {
    schema
        .fields()
        .iter()
        .map(|f| match f.data_type() {
            arrow_schema::DataType::Boolean => 1,
            dt => crate::compute::fixed_width(dt).map_or(32, |w| w as usize),
        })
        .sum()
}
