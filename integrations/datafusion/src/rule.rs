//! [`DevicePlacementRule`]: the physical optimizer rule that moves plan nodes onto
//! devices, and the registry of device operators it asks ([`DeviceOperatorRegistry`]).
//!
//! First, a partial aggregate over a `UnionExec` becomes a union of the same partial
//! aggregate over each child (a union's partitions are its children's), so that each
//! child's region aggregates before its unload.
//!
//! Then, bottom up, for every node that a registered factory knows:
//! - when the factory makes a device operator of it, the node becomes a
//!   [`DeviceOperatorExec`] over its child on the device: a region's top when the child
//!   is a region (its unload removed: adjacent device nodes merge into one region, one
//!   load, N operators, one unload), else a new [`DeviceLoadExec`] over the host child;
//!   then a [`DeviceUnloadExec`] on top;
//! - when it cannot (a type with no device operator, an expression with no kernel), the
//!   node stays on the host under a [`HostOnlyExec`] that says why in `EXPLAIN`.
//!
//! A node of several children (a hash join) keeps the others as host children of its
//! device operator (a join's build side, read whole per partition): only the child the
//! operator names ([`DeviceOperator::device_child`], a join's probe side) joins or starts
//! the region.
//!
//! Then two passes over the regions: a join at the top of one goes back to the host where
//! it would move more bytes than the host join (unless `devarrow.always_place_joins`),
//! and with `devarrow.min_region_bytes` a region that would upload fewer bytes, by
//! DataFusion's statistics, goes back to the host whole; each says why in `EXPLAIN`.
//!
//! Nodes no factory knows (sorts, repartitions, scans, other joins) stay as they are. The rule
//! runs after DataFusion's own (add it last): it keeps every node's properties (a device
//! operator declares its host twin's), so the plan it returns satisfies the same
//! requirements. Devices are not chosen here but when a partition runs.
//!
//! ```
//! use datafusion::prelude::{SessionConfig, SessionContext};
//! use devarrow_datafusion::rule::device_session;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> datafusion::error::Result<()> {
//! let ctx = device_session(SessionConfig::new());
//! ctx.sql("SET devarrow.devices = 'cpu'").await?.collect().await?;
//! ctx.sql("CREATE TABLE t (a DECIMAL(15, 2), b INT) AS VALUES (1.50, 1), (2.25, 2), (3.00, 3)")
//!     .await?
//!     .collect()
//!     .await?;
//! let plan = ctx
//!     .sql("EXPLAIN SELECT a * 2 AS twice FROM t WHERE b > 1")
//!     .await?
//!     .collect()
//!     .await?;
//! let text = datafusion::arrow::util::pretty::pretty_format_batches(&plan)?.to_string();
//! assert!(text.contains("DeviceLoadExec") && text.contains("DeviceUnloadExec"), "{text}");
//! # Ok(())
//! # }
//! ```

use std::fmt;
use std::sync::Arc;

use arrow_schema::SchemaRef;
use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::{internal_err, Result, Statistics};
use datafusion::execution::session_state::SessionStateBuilder;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::execution_plan::{replace_children_if_necessary, CardinalityEffect};
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::statistics::{ChildStats, StatisticsArgs};
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties};
use datafusion::prelude::{SessionConfig, SessionContext};

use crate::compute::Unsupported;
use crate::config::{DevarrowConfig, DevicePlacement};
use crate::estimate::{link_bytes, row_bytes, SMALL_BUILD_SIDE};
use crate::region::ops::ProjectionOperator;
use crate::region::{
    host_twin, ops, DeviceLoadExec, DeviceOperator, DeviceOperatorExec, DeviceUnloadExec,
};

/// Makes device operators of plan nodes it knows.
pub trait DeviceOperatorFactory: fmt::Debug + Send + Sync {
    /// `None` when `node` is of a kind this factory does not replace; `Some(Err(why))`
    /// when it is, but this node cannot run on the device.
    fn device_operator(
        &self,
        node: &Arc<dyn ExecutionPlan>,
    ) -> Option<Result<Arc<dyn DeviceOperator>, Unsupported>>;
}

/// devarrow's own operators: `FilterExec`, `ProjectionExec`, `AggregateExec`
/// (`Partial`), `HashJoinExec` (`Inner`, `Left`, `Right`, `Full`, `LeftSemi`, `LeftAnti`,
/// `RightSemi`, `RightAnti`, `RightMark`).
#[derive(Debug, Default)]
pub struct BuiltinOperators;

impl DeviceOperatorFactory for BuiltinOperators {
    fn device_operator(
        &self,
        node: &Arc<dyn ExecutionPlan>,
    ) -> Option<Result<Arc<dyn DeviceOperator>, Unsupported>> {
        ops::device_operator(node)
    }
}

/// The device operator factories a rule asks, in order (the first that knows a node's
/// kind decides).
#[derive(Debug, Clone)]
pub struct DeviceOperatorRegistry {
    factories: Vec<Arc<dyn DeviceOperatorFactory>>,
}

impl Default for DeviceOperatorRegistry {
    /// devarrow's own operators ([`BuiltinOperators`]).
    fn default() -> Self {
        Self {
            factories: vec![Arc::new(BuiltinOperators)],
        }
    }
}

impl DeviceOperatorRegistry {
    /// No factory: nothing moves to a device.
    pub fn empty() -> Self {
        Self {
            factories: Vec::new(),
        }
    }

    /// Adds `factory`, asked before those registered earlier.
    pub fn register(&mut self, factory: Arc<dyn DeviceOperatorFactory>) -> &mut Self {
        self.factories.insert(0, factory);
        self
    }

    /// The device operator of `node` (see [`DeviceOperatorFactory::device_operator`]).
    pub fn device_operator(
        &self,
        node: &Arc<dyn ExecutionPlan>,
    ) -> Option<Result<Arc<dyn DeviceOperator>, Unsupported>> {
        self.factories
            .iter()
            .find_map(|factory| factory.device_operator(node))
    }
}

/// The rule: see the [module](self).
#[derive(Debug)]
pub struct DevicePlacementRule {
    registry: DeviceOperatorRegistry,
    placement: DevicePlacement,
}

impl Default for DevicePlacementRule {
    /// devarrow's operators, on the session's devices.
    fn default() -> Self {
        Self::new(DeviceOperatorRegistry::default())
    }
}

impl DevicePlacementRule {
    /// A rule asking `registry`, its regions on the session's devices
    /// (`devarrow.devices`, read when a partition runs).
    pub fn new(registry: DeviceOperatorRegistry) -> Self {
        Self {
            registry,
            placement: DevicePlacement::FromSession,
        }
    }

    /// This rule, its regions on `placement`'s devices.
    pub fn with_placement(mut self, placement: DevicePlacement) -> Self {
        self.placement = placement;
        self
    }

    /// Rewrites one node whose children are rewritten already.
    /// `distributed`: the plan's partitions may run as separate plans (Ballista's
    /// tasks, `Some` of the session's target partitions), so an operator whose
    /// partitions share state does not run as it is: a collected hash join is made
    /// `Partitioned` first, as Ballista's planner makes it ([`partitioned_join`]); any
    /// other such operator stays on the host.
    /// `weigh`: an operator with host children (a join's build side, uploaded whole)
    /// stays on the host where DataFusion's statistics say those weigh more than its
    /// device child (`devarrow.always_place_joins` turns it off).
    fn place(
        &self,
        node: Arc<dyn ExecutionPlan>,
        distributed: Option<usize>,
        weigh: bool,
    ) -> Result<Transformed<Arc<dyn ExecutionPlan>>> {
        if let Some(host_only) = node.downcast_ref::<HostOnlyExec>() {
            // The rule run again: one reason is enough.
            if host_only.input().downcast_ref::<HostOnlyExec>().is_some() {
                return Ok(Transformed::yes(host_only.input().clone()));
            }
        }
        let Some(operator) = self
            .registry
            .device_operator(&node)
            .or_else(|| picking_above_a_region(&node))
        else {
            return Ok(Transformed::no(node));
        };
        let operator = match operator {
            Ok(operator) if distributed.is_some() && operator.partitions_share_state() => {
                if let Some(join) = distributed.and_then(|n| partitioned_join(&node, n)) {
                    return Ok(Transformed::yes(
                        self.place(join?, distributed, weigh)?.data,
                    ));
                }
                let why = format!(
                    "its partitions share state ({}), and on Ballista each task runs its \
                     own copy of the plan (Ballista makes such a host join Partitioned; it \
                     cannot through a device node)",
                    operator.name()
                );
                return Ok(Transformed::yes(Arc::new(HostOnlyExec::new(node, why))));
            }
            Ok(_) if distributed.is_some() && reads_scalar_subquery(&node) => {
                // A filter's conjuncts that read no subquery still run on the device,
                // under a host filter of the others.
                let host = match split_at_subqueries(&node)? {
                    Some((device, host)) => {
                        let placed = self.place(device, distributed, weigh)?.data;
                        replace_children_if_necessary(host, vec![placed])?
                    }
                    None => node,
                };
                return Ok(Transformed::yes(Arc::new(HostOnlyExec::new(
                    host,
                    SUBQUERY_ON_BALLISTA.to_string(),
                ))));
            }
            Ok(operator) if weigh => match heavier_host_children(&node, operator.device_child()) {
                Some(why) => return Ok(Transformed::yes(Arc::new(HostOnlyExec::new(node, why)))),
                None => operator,
            },
            Ok(operator) => operator,
            Err(why) => {
                let annotated = HostOnlyExec::new(node, why.0);
                return Ok(Transformed::yes(Arc::new(annotated)));
            }
        };
        let children: Vec<Arc<dyn ExecutionPlan>> = node.children().into_iter().cloned().collect();
        let at = operator.device_child();
        let Some(child) = children.get(at) else {
            return Ok(Transformed::no(node));
        };
        let device_child: Arc<dyn ExecutionPlan> = match child.downcast_ref::<DeviceUnloadExec>() {
            Some(unload) if !ends_on_host(unload.input()) => unload.input().clone(),
            _ => Arc::new(DeviceLoadExec::with_placement(
                child.clone(),
                self.placement.clone(),
            )),
        };
        let mut twin_children = children.clone();
        twin_children[at] = host_twin(&device_child);
        let twin = replace_children_if_necessary(node.clone(), twin_children)?;
        let mut device_children = children;
        device_children[at] = device_child;
        let device: Arc<dyn ExecutionPlan> = Arc::new(DeviceOperatorExec::with_children(
            operator,
            device_children,
            twin,
        )?);
        Ok(Transformed::yes(Arc::new(DeviceUnloadExec::try_new(
            device,
        )?)))
    }
}

/// The second pass of the rule: the operators that may not end a region
/// (`DeviceOperator::may_end_a_region`: a join) at the top of one (looking through ones
/// that only pick columns) go back to the host, under a `HostOnlyExec` saying why, where
/// they would move more bytes across the link than the host version moves:
///
/// - the region starts with them (their device input is the load): it would upload
///   their input only to bring back their output, where the host moves nothing;
/// - their output rows are wider than their input's ([`row_bytes`]): an inner join with
///   unique build keys keeps or drops probe rows, never adds any, so a region that ends
///   in one brings back no more bytes than it would without it where its rows are not
///   wider (a selective join, TPC-H Q3's customer-orders join, brings back fewer).
///
/// A region left with no operator is no region. `devarrow.always_place_joins` turns this
/// pass off.
fn retract(node: Arc<dyn ExecutionPlan>) -> Result<Transformed<Arc<dyn ExecutionPlan>>> {
    if let Some(host_only) = node.downcast_ref::<HostOnlyExec>() {
        // A node retracted on an earlier run of the rule, retracted again.
        if host_only.input().downcast_ref::<HostOnlyExec>().is_some() {
            return Ok(Transformed::yes(host_only.input().clone()));
        }
    }
    let Some(unload) = node.downcast_ref::<DeviceUnloadExec>() else {
        return Ok(Transformed::no(node));
    };
    if let Some(host) = projections_alone(unload)? {
        return Ok(Transformed::yes(host));
    }
    // From the top down: the operators that only pick columns or may not end a region;
    // those down to the last that may not end it go back to the host.
    let mut given_back: Vec<(Arc<dyn ExecutionPlan>, DeviceOperatorExec)> = Vec::new();
    let mut top = unload.input().clone();
    while let Some(op) = top.downcast_ref::<DeviceOperatorExec>() {
        if !op.operator().only_picks() && op.operator().may_end_a_region() {
            break;
        }
        let (op, next) = (op.clone(), op.input().clone());
        given_back.push((top, op));
        top = next;
    }
    while given_back
        .last()
        .is_some_and(|(_, op)| op.operator().may_end_a_region())
    {
        given_back.pop();
    }
    let Some((_, deepest)) = given_back.last() else {
        return Ok(Transformed::no(node));
    };
    let below = deepest.input().clone();
    if below.downcast_ref::<DeviceLoadExec>().is_none()
        && row_bytes(&unload.schema()) <= row_bytes(&below.schema())
    {
        return Ok(Transformed::no(node));
    }
    // The region now ends below them; each goes back to the host over its children.
    let mut current: Arc<dyn ExecutionPlan> = match below.downcast_ref::<DeviceLoadExec>() {
        Some(load) => load.input().clone(),
        None => {
            // What is left of the region may be projections alone.
            let rest = DeviceUnloadExec::try_new(below)?;
            match projections_alone(&rest)? {
                Some(host) => host,
                None => Arc::new(rest),
            }
        }
    };
    for (node, op) in given_back.iter().rev() {
        let mut children: Vec<Arc<dyn ExecutionPlan>> =
            op.children().into_iter().cloned().collect();
        children[op.operator().device_child()] = current;
        let host = replace_children_if_necessary(host_twin(node), children)?;
        current = if op.operator().may_end_a_region() {
            host
        } else {
            Arc::new(HostOnlyExec::new(
                host,
                "its output would go straight back to the host, wider than its input (or \
                 its input uploaded for it alone): more bytes over the link than the host \
                 join moves",
            ))
        };
    }
    Ok(Transformed::yes(current))
}

/// Why a node whose device operator reads host children whole (a join's build side,
/// uploaded for the device) stays on the host: by DataFusion's statistics, the host
/// children's bytes (what the device's node uploads) are more than its child
/// `device_child`'s and its own output's together (what the host node would cost at
/// most: its probe side brought back from a region, its output taken up again by the
/// operators above). `None` where they are not (or the statistics say nothing).
fn heavier_host_children(node: &Arc<dyn ExecutionPlan>, device_child: usize) -> Option<String> {
    let children = node.children();
    if children.len() < 2 {
        return None;
    }
    let probe = link_bytes(children.get(device_child)?)?;
    let mut build = 0usize;
    for (i, child) in children.iter().enumerate() {
        if i != device_child {
            build = build.saturating_add(link_bytes(child)?);
        }
    }
    let output = link_bytes(node).unwrap_or(0);

    let mib = |b: usize| b as f64 / f64::from(1 << 20);
    (build > SMALL_BUILD_SIDE && build > probe.saturating_add(output)).then(|| {
        format!(
            "its build side (about {:.1} MiB by DataFusion's statistics) would cross the link, \
             more than its probe side and its output (about {:.1} and {:.1} MiB)",
            mib(build),
            mib(probe),
            mib(output)
        )
    })
}

/// The third pass of the rule, with `devarrow.min_region_bytes` (`min`): a region whose
/// uploads come to fewer bytes than `min` by DataFusion's statistics
/// ([`region_upload_bytes`]) goes back to the host whole, its host twin under a
/// `HostOnlyExec` saying why. A region whose statistics say nothing stays.
fn too_small(
    node: Arc<dyn ExecutionPlan>,
    min: usize,
) -> Result<Transformed<Arc<dyn ExecutionPlan>>> {
    let Some(unload) = node.downcast_ref::<DeviceUnloadExec>() else {
        return Ok(Transformed::no(node));
    };
    match region_upload_bytes(unload.input()) {
        Some(bytes) if bytes < min => {
            let mib = |b: usize| b as f64 / f64::from(1 << 20);
            let why = format!(
                "its region would upload about {:.1} MiB by DataFusion's statistics, under \
                 devarrow.min_region_bytes ({:.1} MiB): too little to earn back a region's \
                 fixed costs",
                mib(bytes),
                mib(min)
            );
            Ok(Transformed::yes(Arc::new(HostOnlyExec::new(
                host_twin(&node),
                why,
            ))))
        }
        _ => Ok(Transformed::no(node)),
    }
}

/// The bytes the region under `top` (a device node) uploads by DataFusion's statistics
/// ([`link_bytes`]): its loads' inputs and its operators' host children (a join's build
/// side); `None` where the statistics do not say for one of them.
fn region_upload_bytes(top: &Arc<dyn ExecutionPlan>) -> Option<usize> {
    if let Some(load) = top.downcast_ref::<DeviceLoadExec>() {
        return link_bytes(load.input());
    }
    let op = top.downcast_ref::<DeviceOperatorExec>()?;
    let at = op.operator().device_child();
    op.children()
        .into_iter()
        .enumerate()
        .try_fold(0usize, |total, (i, child)| {
            let bytes = if i == at {
                region_upload_bytes(child)?
            } else {
                link_bytes(child)?
            };
            Some(total.saturating_add(bytes))
        })
}

/// A region of projections alone (TPC-H Q14's and Q17's casts above their final
/// aggregates) back on the host, each projection under a `HostOnlyExec` saying why: it
/// would take its input up and its output down for work row by row that the host does
/// at memory speed, and nothing after it on the device gains from it. `None` for any
/// other region.
fn projections_alone(unload: &DeviceUnloadExec) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    let mut projections = Vec::new();
    let mut top = unload.input().clone();
    while let Some(op) = top.downcast_ref::<DeviceOperatorExec>() {
        if op.operator().name() != "DeviceProjectionExec" {
            return Ok(None);
        }
        let next = op.input().clone();
        projections.push(top);
        top = next;
    }
    let Some(load) = top.downcast_ref::<DeviceLoadExec>() else {
        return Ok(None);
    };
    if projections.is_empty() {
        return Ok(None);
    }
    let mut current = load.input().clone();
    for node in projections.iter().rev() {
        let host = replace_children_if_necessary(host_twin(node), vec![current])?;
        current = Arc::new(HostOnlyExec::new(
            host,
            "a region of projections alone would take its input up and its output down \
             for work row by row that the host does at memory speed",
        ));
    }
    Ok(Some(current))
}

/// A projection that only picks columns, over a region it can join (zero-copy: the
/// columns it drops are not downloaded).
fn picking_above_a_region(
    node: &Arc<dyn ExecutionPlan>,
) -> Option<Result<Arc<dyn DeviceOperator>, Unsupported>> {
    let projection = node.downcast_ref::<ProjectionExec>()?;
    if !ProjectionOperator::picks_only(projection) {
        return None;
    }
    let unload = projection.input().downcast_ref::<DeviceUnloadExec>()?;
    if ends_on_host(unload.input()) {
        return None;
    }
    Some(ProjectionOperator::try_new(projection).map(|op| Arc::new(op) as Arc<dyn DeviceOperator>))
}

/// Why a node that reads a scalar subquery's value stays on the host on Ballista.
const SUBQUERY_ON_BALLISTA: &str = "it reads a scalar subquery's value, which DataFusion's \
    protobuf decodes only inside its ScalarSubqueryExec, never inside a device node's bytes, \
    and on Ballista each task decodes its plan";

/// Whether one of `node`'s own expressions reads an uncorrelated scalar subquery's value
/// (DataFusion's `ScalarSubqueryExpr`, tied to its `ScalarSubqueryExec`): the device
/// computes with it, but the codec cannot carry it in a device node's bytes.
pub(crate) fn reads_scalar_subquery(node: &Arc<dyn ExecutionPlan>) -> bool {
    let mut found = false;
    let _ = node.apply_expressions(&mut |expr| {
        found |= expr_reads_scalar_subquery(expr);
        Ok(if found {
            TreeNodeRecursion::Stop
        } else {
            TreeNodeRecursion::Continue
        })
    });
    found
}

/// Whether `expr` reads an uncorrelated scalar subquery's value.
fn expr_reads_scalar_subquery(expr: &Arc<dyn PhysicalExpr>) -> bool {
    use datafusion::physical_expr::scalar_subquery::ScalarSubqueryExpr;
    let mut found = false;
    let _ = expr.apply(|e| {
        found |= e.downcast_ref::<ScalarSubqueryExpr>().is_some();
        Ok(if found {
            TreeNodeRecursion::Stop
        } else {
            TreeNodeRecursion::Continue
        })
    });
    found
}

/// A plan node.
type Plan = Arc<dyn ExecutionPlan>;

/// A `FilterExec` whose predicate ANDs conjuncts that read a scalar subquery with others
/// that do not, as two filters: the others over the input (for the device: it keeps no
/// subquery), then the subqueries' conjuncts over it with the filter's projection and
/// fetch (for the host). `None` for another node, or where every conjunct reads one.
/// The rows are the filter's: a row passes both exactly when it passes all conjuncts.
fn split_at_subqueries(node: &Arc<dyn ExecutionPlan>) -> Result<Option<(Plan, Plan)>> {
    use datafusion::physical_expr::utils::{conjunction, split_conjunction};
    use datafusion::physical_plan::filter::{FilterExec, FilterExecBuilder};
    let Some(filter) = node.downcast_ref::<FilterExec>() else {
        return Ok(None);
    };
    let (host, device): (Vec<_>, Vec<_>) = split_conjunction(filter.predicate())
        .into_iter()
        .cloned()
        .partition(expr_reads_scalar_subquery);
    if device.is_empty() {
        return Ok(None);
    }
    let below: Arc<dyn ExecutionPlan> = Arc::new(
        FilterExecBuilder::new(conjunction(device), filter.input().clone())
            .with_default_selectivity(filter.default_selectivity())
            .with_batch_size(filter.batch_size())
            .build()?,
    );
    let above: Arc<dyn ExecutionPlan> = Arc::new(
        FilterExecBuilder::from(filter)
            .with_predicate(conjunction(host))
            .with_input(below.clone())
            .build()?,
    );
    Ok(Some((below, above)))
}

/// Whether the session is Ballista's (its config has Ballista's `ballista` options): a
/// stage's partitions then run as tasks, each decoding its own copy of the plan.
fn on_ballista(config: &ConfigOptions) -> bool {
    config
        .extensions
        .iter()
        .any(|(prefix, _)| prefix == "ballista")
}

/// A collected hash join (`CollectLeft`) made `Partitioned` as Ballista's planner makes
/// one whose join type it cannot broadcast (a left semi, anti, mark or outer join: the
/// last partition emits build rows by what every partition matched): each side
/// hash-repartitioned on its keys into `partitions`. `None` for any other node, and for a
/// null-aware join (Ballista runs it as one task, which a device node would hide).
fn partitioned_join(
    node: &Arc<dyn ExecutionPlan>,
    partitions: usize,
) -> Option<Result<Arc<dyn ExecutionPlan>>> {
    use datafusion::physical_plan::joins::{HashJoinExec, PartitionMode};
    use datafusion::physical_plan::repartition::RepartitionExec;
    use datafusion::physical_plan::Partitioning;

    let join = node.downcast_ref::<HashJoinExec>()?;
    if *join.partition_mode() != PartitionMode::CollectLeft || join.null_aware {
        return None;
    }
    let repartitioned = |child: &Arc<dyn ExecutionPlan>, keys: Vec<Arc<dyn PhysicalExpr>>| {
        RepartitionExec::try_new(child.clone(), Partitioning::Hash(keys, partitions))
            .map(|r| Arc::new(r) as Arc<dyn ExecutionPlan>)
    };
    let build = join.on().iter().map(|(l, _)| l.clone()).collect();
    let probe = join.on().iter().map(|(_, r)| r.clone()).collect();
    Some((|| {
        let children = vec![
            repartitioned(join.left(), build)?,
            repartitioned(join.right(), probe)?,
        ];
        join.builder()
            .with_partition_mode(PartitionMode::Partitioned)
            .with_new_children(children)?
            .build_exec()
    })())
}

/// A partial aggregate over a `UnionExec`, as the union of the same partial aggregate
/// over each of its children: a partial aggregate works partition by partition, and a
/// union's partitions are its children's, so the partial states are the same, in the
/// same partitions (the final aggregate above merges them as before). Placed, each
/// child's region then aggregates before its unload, where a region over the union
/// would take every child's rows down and up again. `Transformed::no` for any other
/// node, and for a union whose children's column types differ from its own.
fn partial_aggregate_into_union(
    node: Arc<dyn ExecutionPlan>,
) -> Result<Transformed<Arc<dyn ExecutionPlan>>> {
    use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
    use datafusion::physical_plan::union::UnionExec;
    let Some(aggregate) = node.downcast_ref::<AggregateExec>() else {
        return Ok(Transformed::no(node));
    };
    let Some(union) = aggregate.input().downcast_ref::<UnionExec>() else {
        return Ok(Transformed::no(node));
    };
    let types = |schema: SchemaRef| -> Vec<_> {
        schema
            .fields()
            .iter()
            .map(|f| f.data_type().clone())
            .collect()
    };
    let want = types(union.schema());
    if *aggregate.mode() != AggregateMode::Partial
        || union
            .inputs()
            .iter()
            .any(|child| types(child.schema()) != want)
    {
        return Ok(Transformed::no(node));
    }
    let children = union
        .inputs()
        .iter()
        .map(|child| replace_children_if_necessary(node.clone(), vec![child.clone()]))
        .collect::<Result<Vec<_>>>()?;
    UnionExec::try_new(children).map(Transformed::yes)
}

/// Whether the region topped by `top` ends with a terminal operator (its output is on
/// the host: nothing can follow it on the device).
fn ends_on_host(top: &Arc<dyn ExecutionPlan>) -> bool {
    top.downcast_ref::<DeviceOperatorExec>()
        .is_some_and(|op| op.operator().is_terminal())
}

impl PhysicalOptimizerRule for DevicePlacementRule {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let options = config.extensions.get::<DevarrowConfig>();
        if !options.is_none_or(|c| c.enabled) {
            return Ok(plan);
        }
        let distributed = on_ballista(config).then_some(config.execution.target_partitions);
        let every_join = options.is_some_and(|c| c.always_place_joins);
        let plan = plan.transform_up(partial_aggregate_into_union)?.data;
        let placed = plan
            .transform_up(|node| self.place(node, distributed, !every_join))?
            .data;
        let placed = if every_join {
            placed
        } else {
            placed.transform_up(retract)?.data
        };
        match options.map_or(0, |c| c.min_region_bytes) {
            0 => Ok(placed),
            min => placed
                .transform_up(|node| too_small(node, min))
                .map(|t| t.data),
        }
    }

    fn name(&self) -> &str {
        "devarrow_device_placement"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// A session whose plans run on devices: `config` with devarrow's options
/// ([`DevarrowConfig`], unless it has them) and DataFusion's default rules followed by
/// [`DevicePlacementRule`].
pub fn device_session(config: SessionConfig) -> SessionContext {
    let config = if config
        .options()
        .extensions
        .get::<DevarrowConfig>()
        .is_some()
    {
        config
    } else {
        config.with_option_extension(DevarrowConfig::default())
    };
    let state = with_device_placement(
        SessionStateBuilder::new()
            .with_config(config)
            .with_default_features(),
    )
    .build();
    SessionContext::new_with_state(state)
}

/// `builder` with [`DevicePlacementRule`] after its physical optimizer rules.
pub fn with_device_placement(builder: SessionStateBuilder) -> SessionStateBuilder {
    builder.with_physical_optimizer_rule(Arc::new(DevicePlacementRule::default()))
}

/// A node the rule could not move to a device, with the reason (`EXPLAIN` shows it); it
/// passes its child's batches on untouched.
#[derive(Debug, Clone)]
pub struct HostOnlyExec {
    input: Arc<dyn ExecutionPlan>,
    reason: String,
}

impl HostOnlyExec {
    /// `input`, kept on the host because of `reason`.
    pub fn new(input: Arc<dyn ExecutionPlan>, reason: impl Into<String>) -> Self {
        Self {
            input,
            reason: reason.into(),
        }
    }

    /// Why the child stays on the host.
    pub fn reason(&self) -> &str {
        &self.reason
    }

    /// The node that stays on the host.
    pub fn input(&self) -> &Arc<dyn ExecutionPlan> {
        &self.input
    }
}

impl DisplayAs for HostOnlyExec {
    fn fmt_as(&self, t: DisplayFormatType, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match t {
            DisplayFormatType::Default | DisplayFormatType::Verbose => write!(
                f,
                "HostOnlyExec: {} stays on the host: {}",
                self.input.name(),
                self.reason
            ),
            DisplayFormatType::TreeRender => write!(f, "reason={}", self.reason),
        }
    }
}

impl ExecutionPlan for HostOnlyExec {
    fn name(&self) -> &str {
        "HostOnlyExec"
    }

    fn schema(&self) -> SchemaRef {
        self.input.schema()
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        self.input.properties()
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        vec![true]
    }

    fn benefits_from_input_partitioning(&self) -> Vec<bool> {
        vec![false]
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn with_new_children(
        self: Arc<Self>,
        mut children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        if children.len() != 1 {
            return internal_err!("HostOnlyExec takes one child");
        }
        Ok(Arc::new(Self::new(
            children.swap_remove(0),
            self.reason.clone(),
        )))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        self.input.execute(partition, context)
    }

    fn child_stats_requests(&self, partition: Option<usize>) -> Vec<ChildStats> {
        vec![ChildStats::At(partition)]
    }

    fn statistics_from_inputs(
        &self,
        input_stats: &[Arc<Statistics>],
        _args: &StatisticsArgs,
    ) -> Result<Arc<Statistics>> {
        Ok(input_stats[0].clone())
    }

    fn cardinality_effect(&self) -> CardinalityEffect {
        CardinalityEffect::Equal
    }
}
