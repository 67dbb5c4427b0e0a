//! The device step of a [`DeviceExec`](crate::DeviceExec) ([`DeviceStep`]), the device it
//! runs on ([`ExecDevice`]) and the registry of steps by name ([`StepRegistry`]) that a
//! codec looks them up in on each executor.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, RwLock};

use arrow_schema::{Field, Fields, Schema, SchemaRef};
use devarrow::abi::device::{CpuDevice, Device};
use devarrow::bridge::DeviceBatch;
use devarrow::{select_device, DeviceRequest};

use crate::error::{BoxError, DeviceExecError};

/// What a step sees besides its batch: where it runs.
#[derive(Debug)]
pub struct StepContext<'a> {
    /// The partition of the plan.
    pub partition: usize,
    /// The batch of that partition (0-based).
    pub batch: usize,
    /// The device the batch is on, and its CUDA handle when it is a CUDA device.
    pub device: &'a ExecDevice,
}

/// The code of a step: the uploaded batch in, a batch on the same device out (the
/// step's declared columns, one row per input row). On CUDA it enqueues its kernels on
/// the device's stream ([`ExecDevice::cuda`], `CudaDevice::stream`), with the device's
/// context current on the calling thread; the download waits for them.
pub type StepFn =
    dyn Fn(DeviceBatch, &StepContext<'_>) -> Result<DeviceBatch, BoxError> + Send + Sync;

/// What a step's output is.
#[derive(Debug, Clone, PartialEq)]
pub enum StepOutput {
    /// The step returns these columns, which the plan appends to its input's columns
    /// (downloading only them): the input's columns pass untouched, so the input's
    /// orderings, equivalences, partitioning and column statistics stay valid on them.
    Append(Fields),
    /// The step returns batches of this schema, which is the plan's output. The plan
    /// claims of the input only what the step declares it keeps ([`Preserves`]): by
    /// default nothing (no ordering, an unknown partitioning of the same count, unknown
    /// column statistics), even when the schema is the input's.
    Replace(SchemaRef),
}

/// What a step declares it keeps of its input, and so what a
/// [`DeviceExec`](crate::DeviceExec) claims of its child's properties (DataFusion's
/// optimizer trusts these claims: `EnforceSorting` drops a sort an ordering satisfies,
/// `EnforceDistribution` a repartition a partitioning satisfies). A step that rewrites a
/// sort or hash-key column must not declare it kept.
///
/// Columns match by name (and type) between the input and the output. An appending step
/// ([`StepOutput::Append`]) leaves every input column untouched by construction.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Preserves {
    order: bool,
    partitioning: bool,
    untouched: Vec<String>,
}

impl Preserves {
    /// The input's orderings hold on the output ([`DeviceStep::preserves_order`]).
    pub fn order(&self) -> bool {
        self.order
    }

    /// The input's partitioning holds on the output
    /// ([`DeviceStep::preserves_partitioning`]).
    pub fn partitioning(&self) -> bool {
        self.partitioning
    }

    /// The columns passed on with the input's values ([`DeviceStep::leaves_untouched`]).
    pub fn untouched(&self) -> &[String] {
        &self.untouched
    }
}

/// How the columns of a step's input reach its plan's output: pairs of (input index,
/// output index) for each kind of claim.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct KeptColumns {
    /// Columns with the input's values, row for row: equivalences, orderings,
    /// partitioning and column statistics hold on them.
    pub untouched: Vec<(usize, usize)>,
    /// Columns on which the input's orderings hold.
    pub order: Vec<(usize, usize)>,
    /// Columns on which the input's partitioning holds.
    pub partitioning: Vec<(usize, usize)>,
}

/// A user-given step on the device: a name (what a serialized plan carries), the input
/// columns to upload, the output, what it keeps of its input ([`Preserves`]), and the
/// code.
///
/// # Example
///
/// A step appending `twice = 2 * x`, computed on devarrow's CPU device (whose memory
/// is host memory: here the batch is downloaded, computed on and imported back; a CUDA
/// step launches a kernel on [`ExecDevice::cuda`]'s stream instead):
///
/// ```
/// use std::sync::Arc;
///
/// use arrow_array::{Array, Int64Array, RecordBatch};
/// use arrow_schema::{DataType, Field, Schema};
/// use datafusion::datasource::memory::MemorySourceConfig;
/// use datafusion::physical_plan::collect;
/// use datafusion::prelude::SessionContext;
/// use devarrow::bridge::{DeviceBatch, Transfer, TransferOptions};
/// use devarrow_datafusion::{DeviceExec, DeviceStep, ExecDevice};
///
/// # fn main() -> datafusion::common::Result<()> {
/// let twice = Field::new("twice", DataType::Int64, false);
/// let out_schema = Arc::new(Schema::new(vec![twice.clone()]));
/// let step = DeviceStep::new("example.twice", move |batch, cx| {
///     let device = cx.device.device().clone();
///     let host = Transfer::new(device.clone(), TransferOptions::default()).to_host(&batch)?;
///     let x = host.column(0).as_any().downcast_ref::<Int64Array>().ok_or("x is Int64")?;
///     let doubled: Int64Array = x.iter().map(|v| v.map(|v| 2 * v)).collect();
///     let out = RecordBatch::try_new(out_schema.clone(), vec![Arc::new(doubled)])?;
///     let (array, _schema) = devarrow::abi::cpu::export_record_batch(&out)?;
///     Ok(DeviceBatch::import(device, array, out_schema.clone())?)
/// })
/// .with_inputs(["x"]) // only x goes up
/// .appending(vec![twice]); // only `twice` comes down; x, y stay untouched
///
/// let schema = Arc::new(Schema::new(vec![
///     Field::new("x", DataType::Int64, false),
///     Field::new("y", DataType::Int64, false),
/// ]));
/// let batch = RecordBatch::try_new(
///     schema.clone(),
///     vec![Arc::new(Int64Array::from(vec![1, 2, 3])), Arc::new(Int64Array::from(vec![7, 8, 9]))],
/// )?;
/// let input = MemorySourceConfig::try_new_exec(&[vec![batch]], schema, None)?;
/// let plan = Arc::new(DeviceExec::try_new(input, Arc::new(step), ExecDevice::cpu())?);
/// let out = tokio::runtime::Runtime::new()?
///     .block_on(collect(plan, SessionContext::new().task_ctx()))?;
/// let twice = out[0].column_by_name("twice").unwrap();
/// assert_eq!(twice.as_any().downcast_ref::<Int64Array>().unwrap().values(), &[2, 4, 6]);
/// assert_eq!(out[0].num_columns(), 3);
/// # Ok(())
/// # }
/// ```
///
/// A step that replaces the batch claims nothing of its input's ordering, partitioning
/// or statistics unless it declares it: `DeviceStep::new("clamp", code)
/// .leaves_untouched(["id"])` keeps `id`'s ordering and hash partitioning.
#[derive(Clone)]
pub struct DeviceStep {
    name: String,
    inputs: Option<Vec<String>>,
    output: Option<StepOutput>,
    preserves: Preserves,
    run: Arc<StepFn>,
}

impl fmt::Debug for DeviceStep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceStep")
            .field("name", &self.name)
            .field("inputs", &self.inputs)
            .field("output", &self.output)
            .field("preserves", &self.preserves)
            .finish_non_exhaustive()
    }
}

impl DeviceStep {
    /// A step named `name` running `run` on every batch. By default it gets every column
    /// and returns batches of the input's schema ([`StepOutput::Replace`] with the
    /// input's schema); see [`DeviceStep::with_inputs`] and [`DeviceStep::appending`].
    ///
    /// `name` is what a serialized plan carries: letters, digits, `_`, `-`, `.`, `:`.
    ///
    /// # Panics
    /// If `name` is empty or holds another character (a programming error).
    pub fn new(
        name: impl Into<String>,
        run: impl Fn(DeviceBatch, &StepContext<'_>) -> Result<DeviceBatch, BoxError>
            + Send
            + Sync
            + 'static,
    ) -> Self {
        let name = name.into();
        assert!(
            !name.is_empty()
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_-.:".contains(c)),
            "a device step's name is letters, digits, `_`, `-`, `.` and `:`: {name:?}"
        );
        Self {
            name,
            inputs: None,
            output: None,
            preserves: Preserves::default(),
            run: Arc::new(run),
        }
    }

    /// Uploads only these columns of the input (in this order): the step sees a batch of
    /// them.
    pub fn with_inputs<I: Into<String>>(mut self, columns: impl IntoIterator<Item = I>) -> Self {
        self.inputs = Some(columns.into_iter().map(Into::into).collect());
        self
    }

    /// The step returns `fields`, appended to the input's columns
    /// ([`StepOutput::Append`]).
    pub fn appending(mut self, fields: impl Into<Fields>) -> Self {
        self.output = Some(StepOutput::Append(fields.into()));
        self
    }

    /// The step returns batches of `schema` ([`StepOutput::Replace`]).
    pub fn replacing(mut self, schema: SchemaRef) -> Self {
        self.output = Some(StepOutput::Replace(schema));
        self
    }

    /// Declares that the input's orderings hold on the step's output: every column of
    /// the input's sort keys is in the output (same name and type), left as it is or
    /// rewritten in an order-preserving way. The plan then claims the input's orderings
    /// and `maintains_input_order` (when the output keeps the input's columns at their
    /// indices). Without it a replacing step claims no ordering.
    pub fn preserves_order(mut self) -> Self {
        self.preserves.order = true;
        self
    }

    /// Declares that the input's partitioning holds on the step's output: the columns of
    /// the input's partitioning keys are in the output (same name and type) with their
    /// values unchanged. Without it a replacing step's partitioning is
    /// `UnknownPartitioning` of the input's partition count.
    pub fn preserves_partitioning(mut self) -> Self {
        self.preserves.partitioning = true;
        self
    }

    /// Declares that the step returns these input columns (same name and type) with the
    /// input's values, row for row: the plan keeps the input's equivalences, orderings
    /// and partitioning on them, and their column statistics. For a replacing step they
    /// must be uploaded ([`DeviceStep::with_inputs`]) and in its output schema.
    pub fn leaves_untouched<I: Into<String>>(
        mut self,
        columns: impl IntoIterator<Item = I>,
    ) -> Self {
        self.preserves
            .untouched
            .extend(columns.into_iter().map(Into::into));
        self
    }

    /// What the step declares it keeps of its input.
    pub fn preserves(&self) -> &Preserves {
        &self.preserves
    }

    /// The step's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The input columns it uploads (`None`: all).
    pub fn inputs(&self) -> Option<&[String]> {
        self.inputs.as_deref()
    }

    /// Runs the step's code (what [`DeviceExec`](crate::DeviceExec) does with each
    /// batch; a step may run another's).
    pub fn run(&self, batch: DeviceBatch, cx: &StepContext<'_>) -> Result<DeviceBatch, BoxError> {
        (self.run)(batch, cx)
    }

    fn input_error(&self, reason: String) -> DeviceExecError {
        DeviceExecError::Input {
            step: self.name.clone(),
            reason,
        }
    }

    /// The indices of the uploaded columns in `input` (`None`: all of them).
    pub(crate) fn upload_projection(
        &self,
        input: &Schema,
    ) -> Result<Option<Vec<usize>>, DeviceExecError> {
        let Some(names) = &self.inputs else {
            return Ok(None);
        };
        names
            .iter()
            .map(|name| {
                input.index_of(name).map_err(|_| {
                    self.input_error(format!(
                        "no column `{name}` in the input's columns {:?}",
                        input.fields().iter().map(|f| f.name()).collect::<Vec<_>>()
                    ))
                })
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }

    /// The output, resolved against the input's schema.
    pub(crate) fn output(&self, input: &SchemaRef) -> StepOutput {
        self.output
            .clone()
            .unwrap_or_else(|| StepOutput::Replace(input.clone()))
    }

    /// The plan's output schema for `input`, and the schema the step's batches must
    /// have.
    pub(crate) fn schemas(
        &self,
        input: &SchemaRef,
    ) -> Result<(SchemaRef, SchemaRef), DeviceExecError> {
        match self.output(input) {
            StepOutput::Append(fields) => {
                let mut all: Vec<Arc<Field>> = input.fields().iter().cloned().collect();
                for field in fields.iter() {
                    if input.index_of(field.name()).is_ok() {
                        return Err(self.input_error(format!(
                            "it appends column `{}`, which the input has already",
                            field.name()
                        )));
                    }
                    all.push(field.clone());
                }
                let output = Arc::new(Schema::new_with_metadata(all, input.metadata().clone()));
                Ok((output, Arc::new(Schema::new(fields))))
            }
            StepOutput::Replace(schema) => Ok((schema.clone(), schema)),
        }
    }

    /// How the input's columns reach `output` (the plan's output schema for `input`),
    /// from what the step declares.
    pub(crate) fn kept_columns(
        &self,
        input: &SchemaRef,
        output: &Schema,
    ) -> Result<KeptColumns, DeviceExecError> {
        if let StepOutput::Append(_) = self.output(input) {
            // The input's columns come first, as they were.
            let all: Vec<_> = (0..input.fields().len()).map(|i| (i, i)).collect();
            return Ok(KeptColumns {
                untouched: all.clone(),
                order: all.clone(),
                partitioning: all,
            });
        }
        // An input column's index in the output: same name, same type.
        let in_output = |i: usize| {
            let field = input.field(i);
            output
                .index_of(field.name())
                .ok()
                .filter(|&o| output.field(o).data_type() == field.data_type())
        };
        let mut untouched = Vec::new();
        for name in &self.preserves.untouched {
            let i = input.index_of(name).map_err(|_| {
                self.input_error(format!(
                    "it leaves `{name}` untouched, which the input lacks"
                ))
            })?;
            let o = in_output(i).ok_or_else(|| {
                self.input_error(format!(
                    "it leaves `{name}` untouched, which its output lacks (or has of another type)"
                ))
            })?;
            if self
                .inputs
                .as_ref()
                .is_some_and(|inputs| !inputs.contains(name))
            {
                return Err(self.input_error(format!(
                    "it leaves `{name}` untouched but does not upload it"
                )));
            }
            if !untouched.contains(&(i, o)) {
                untouched.push((i, o));
            }
        }
        let same_named: Vec<_> = (0..input.fields().len())
            .filter_map(|i| in_output(i).map(|o| (i, o)))
            .collect();
        Ok(KeptColumns {
            order: if self.preserves.order {
                same_named.clone()
            } else {
                untouched.clone()
            },
            partitioning: if self.preserves.partitioning {
                same_named
            } else {
                untouched.clone()
            },
            untouched,
        })
    }
}

/// The device a [`DeviceExec`](crate::DeviceExec) runs on: devarrow's device, its CUDA
/// handle when it is one, and its name (`cpu`, `cuda:N`).
#[derive(Debug, Clone)]
pub struct ExecDevice {
    device: Arc<dyn Device>,
    #[cfg(feature = "cuda")]
    cuda: Option<Arc<devarrow::cuda::CudaDevice>>,
    id: String,
}

impl ExecDevice {
    /// Opens the device named by a device string of devarrow's grammar (one device:
    /// `cpu`, `cuda:N`, `cuda`, `auto`; see `devarrow::DeviceSpec`).
    pub fn open(spec: &str) -> Result<Self, DeviceExecError> {
        let error = |reason: String| DeviceExecError::Device {
            spec: spec.to_string(),
            reason,
        };
        let request: DeviceRequest = spec.parse().map_err(|e| error(format!("{e}")))?;
        let selected = select_device(request).map_err(|e| error(e.to_string()))?;
        Ok(Self {
            device: selected.device,
            #[cfg(feature = "cuda")]
            cuda: selected.cuda,
            id: selected.id,
        })
    }

    /// The CPU device (a new one).
    pub fn cpu() -> Self {
        Self::from_cpu(Arc::new(CpuDevice::new()))
    }

    /// This CPU device.
    pub fn from_cpu(device: Arc<CpuDevice>) -> Self {
        Self {
            device,
            #[cfg(feature = "cuda")]
            cuda: None,
            id: "cpu".into(),
        }
    }

    /// This CUDA device.
    #[cfg(feature = "cuda")]
    pub fn from_cuda(device: Arc<devarrow::cuda::CudaDevice>) -> Self {
        Self {
            id: format!("cuda:{}", device.primary_context().id()),
            device: device.clone(),
            cuda: Some(device),
        }
    }

    /// Another handle of the same device: on CUDA with a stream of its own (made now),
    /// on the CPU device the same device.
    ///
    /// # Errors
    /// [`DeviceExecError::Device`] when CUDA refuses a new stream.
    pub fn another_stream(&self) -> Result<Self, DeviceExecError> {
        #[cfg(feature = "cuda")]
        if let Some(cuda) = &self.cuda {
            let error = |e: devarrow::cuda::CudaError| DeviceExecError::Device {
                spec: self.id.clone(),
                reason: e.to_string(),
            };
            let stream = cuda.primary_context().new_stream().map_err(error)?;
            let device = devarrow::cuda::CudaDevice::on_stream(stream).map_err(error)?;
            return Ok(Self::from_cuda(Arc::new(device)));
        }
        Ok(self.clone())
    }

    /// devarrow's device.
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }

    /// The CUDA device, when it is one: its stream (`stream()`) is where a step enqueues
    /// its kernels, its context (`primary_context()`) where it loads them.
    #[cfg(feature = "cuda")]
    pub fn cuda(&self) -> Option<&Arc<devarrow::cuda::CudaDevice>> {
        self.cuda.as_ref()
    }

    /// `cpu` or `cuda:N`.
    pub fn id(&self) -> &str {
        &self.id
    }
}

/// The device steps of a process, by name: what a codec rebuilds a shipped
/// [`DeviceExec`](crate::DeviceExec) with (each Ballista executor registers the same
/// names, each with code for its own device).
#[derive(Debug, Default)]
pub struct StepRegistry {
    steps: RwLock<BTreeMap<String, Arc<DeviceStep>>>,
}

impl StepRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `step` under its name, replacing a step of that name; returns it.
    pub fn register(&self, step: DeviceStep) -> Arc<DeviceStep> {
        let step = Arc::new(step);
        self.steps
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(step.name().to_string(), step.clone());
        step
    }

    /// The step named `name`.
    pub fn get(&self, name: &str) -> Result<Arc<DeviceStep>, DeviceExecError> {
        let steps = self.steps.read().unwrap_or_else(|e| e.into_inner());
        steps
            .get(name)
            .cloned()
            .ok_or_else(|| DeviceExecError::UnknownStep {
                name: name.to_string(),
                registered: steps.keys().cloned().collect::<Vec<_>>().join(", "),
            })
    }
}
