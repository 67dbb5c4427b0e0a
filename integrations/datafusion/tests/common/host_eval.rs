//! Test-side device operators (a registered factory, as an engine would add one):
//! filters and projections evaluated by DataFusion on the host inside a region, so that
//! the region's plumbing is tested apart from devarrow's device kernels. Shared by
//! `tests/region.rs` (CPU device) and `tests/gpu.rs` (CUDA).
#![allow(dead_code)]

use std::collections::BTreeSet;
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arrow_array::{Array, ArrayRef, FixedSizeBinaryArray, RecordBatch, UInt8Array};
use arrow_buffer::Buffer;
use arrow_schema::{Field, Schema};
use datafusion::common::cast::as_boolean_array;
use datafusion::execution::runtime_env::RuntimeEnvBuilder;
use datafusion::execution::session_state::SessionStateBuilder;
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::prelude::{SessionConfig, SessionContext};
use devarrow::bridge::{Transfer, TransferOptions};
use devarrow_datafusion::compute::Unsupported;
use devarrow_datafusion::config::{DevarrowConfig, DevicePlacement, DevicePool};
use devarrow_datafusion::frame::{DeviceFrame, FrameColumn};
use devarrow_datafusion::region::{DeviceOperator, OperatorContext, RegionBatch};
use devarrow_datafusion::rule::{DeviceOperatorFactory, DeviceOperatorRegistry};
use devarrow_datafusion::{BoxError, DevicePlacementRule};

use crate::common::register_lineitem;

/// Counts operators running at once (the per-device limit's test).
#[derive(Debug, Default)]
pub struct Running {
    pub now: AtomicUsize,
    pub most: AtomicUsize,
    /// The devices (`cpu`, `cuda:N`) operators ran on.
    pub devices: Mutex<BTreeSet<String>>,
}

/// Filters and projections evaluated by DataFusion on the host, inside a region: the
/// frame comes down, the expression runs, the result goes up again. Slow, and exactly
/// DataFusion's results: what the region's plumbing must preserve.
#[derive(Debug, Default)]
pub struct HostEvalFactory {
    /// Sleeps this long in every operator call.
    pub delay: Duration,
    pub running: Arc<Running>,
    /// Device memory each projection's output holds beyond its columns (a scratch column
    /// uploaded with them, then projected away: its batch stays alive with the frame),
    /// about this many bytes per batch: a computed column that the region must reserve.
    pub scratch_bytes: usize,
}

#[derive(Debug)]
struct HostEval {
    name: &'static str,
    node: Arc<dyn ExecutionPlan>,
    delay: Duration,
    running: Arc<Running>,
    scratch_bytes: usize,
}

impl DeviceOperatorFactory for HostEvalFactory {
    fn device_operator(
        &self,
        node: &Arc<dyn ExecutionPlan>,
    ) -> Option<Result<Arc<dyn DeviceOperator>, Unsupported>> {
        let name = if let Some(filter) = node.downcast_ref::<FilterExec>() {
            if filter.fetch().is_some() {
                return Some(Err(Unsupported("a filter with a fetch".into())));
            }
            "DeviceFilterExec"
        } else if node.downcast_ref::<ProjectionExec>().is_some() {
            "DeviceProjectionExec"
        } else {
            return None;
        };
        if node
            .schema()
            .fields()
            .iter()
            .any(|f| f.name() == "no_device")
        {
            return Some(Err(Unsupported(
                "column `no_device` has no device operator".into(),
            )));
        }
        Some(Ok(Arc::new(HostEval {
            name,
            node: node.clone(),
            delay: self.delay,
            running: self.running.clone(),
            scratch_bytes: self.scratch_bytes,
        })))
    }
}

impl DeviceOperator for HostEval {
    fn name(&self) -> &'static str {
        self.name
    }

    fn fmt_params(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "host-evaluated")
    }

    fn apply(&self, frame: DeviceFrame, cx: &OperatorContext<'_>) -> Result<RegionBatch, BoxError> {
        let now = self.running.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.running.most.fetch_max(now, Ordering::SeqCst);
        self.running
            .devices
            .lock()
            .unwrap()
            .insert(cx.device.id().to_string());
        std::thread::sleep(self.delay);
        let result = self.eval(frame, cx);
        self.running.now.fetch_sub(1, Ordering::SeqCst);
        result
    }
}

impl HostEval {
    fn eval(&self, frame: DeviceFrame, cx: &OperatorContext<'_>) -> Result<RegionBatch, BoxError> {
        let device = cx.device.device().clone();
        let mut transfer = Transfer::new(device.clone(), TransferOptions::default());
        let host = frame.download(&mut transfer)?;
        if let Some(filter) = self.node.downcast_ref::<FilterExec>() {
            // A pending selection, as devarrow's own filter leaves one.
            let mask = filter
                .predicate()
                .evaluate(&host)?
                .into_array(host.num_rows())?;
            let mask = as_boolean_array(&mask)?;
            let selection: UInt8Array = mask
                .iter()
                .map(|v| Some(u8::from(v == Some(true))))
                .collect();
            let selection =
                RecordBatch::try_from_iter([("selection", Arc::new(selection) as ArrayRef)])?;
            let selection = FrameColumn::single(transfer.to_device(&selection)?)?;
            let up = DeviceFrame::from_batch(transfer.to_device(&host)?);
            let up = up.with_selection(selection)?;
            let up = match filter.projection() {
                Some(p) => up.project(p)?,
                None => up,
            };
            return Ok(RegionBatch::Device(up));
        }
        let projection = self
            .node
            .downcast_ref::<ProjectionExec>()
            .expect("a projection");
        let columns = projection
            .projection_expr()
            .iter()
            .map(|e| {
                e.expr
                    .evaluate(&host)
                    .and_then(|v| v.into_array(host.num_rows()))
            })
            .collect::<datafusion::common::Result<Vec<_>>>()?;
        let out = RecordBatch::try_new(projection.schema(), columns)?;
        if self.scratch_bytes == 0 || out.num_rows() == 0 {
            return Ok(RegionBatch::Device(DeviceFrame::from_batch(
                transfer.to_device(&out)?,
            )));
        }
        let width = self.scratch_bytes.div_ceil(out.num_rows());
        let scratch = FixedSizeBinaryArray::new(
            width as i32,
            Buffer::from_vec(vec![0u8; width * out.num_rows()]),
            None,
        );
        let mut fields = out.schema().fields().to_vec();
        fields.push(Arc::new(Field::new(
            "scratch",
            scratch.data_type().clone(),
            false,
        )));
        let mut columns = out.columns().to_vec();
        columns.push(Arc::new(scratch));
        let padded = RecordBatch::try_new(Arc::new(Schema::new(fields)), columns)?;
        let frame = DeviceFrame::from_batch(transfer.to_device(&padded)?);
        let kept: Vec<usize> = (0..out.num_columns()).collect();
        Ok(RegionBatch::Device(frame.project(&kept)?))
    }
}

/// A session whose rule asks `factory` and runs regions on `pools` (or the session's
/// `devarrow.devices` when `None`), with `memory_limit` bytes of memory pool if given.
pub fn session_with(
    factory: HostEvalFactory,
    pools: Option<Vec<Arc<DevicePool>>>,
    memory_limit: Option<usize>,
    partitions: Vec<Vec<RecordBatch>>,
) -> SessionContext {
    let mut registry = DeviceOperatorRegistry::empty();
    registry.register(Arc::new(factory));
    let mut rule = DevicePlacementRule::new(registry);
    if let Some(pools) = pools {
        rule = rule.with_placement(DevicePlacement::Pools(pools));
    }
    let config = SessionConfig::new()
        .with_target_partitions(partitions.len().max(1))
        .with_option_extension(DevarrowConfig::default());
    let mut builder = SessionStateBuilder::new()
        .with_config(config)
        .with_default_features()
        .with_physical_optimizer_rule(Arc::new(rule));
    if let Some(limit) = memory_limit {
        let runtime = RuntimeEnvBuilder::new()
            .with_memory_limit(limit, 1.0)
            .build_arc()
            .unwrap();
        builder = builder.with_runtime_env(runtime);
    }
    let ctx = SessionContext::new_with_state(builder.build());
    register_lineitem(&ctx, partitions);
    ctx
}
