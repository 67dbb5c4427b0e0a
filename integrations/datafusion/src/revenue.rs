//! The TPC-H step of the example, the bench and the tests: `revenue =
//! l_extendedprice * (1 - l_discount)` per row, appended to the batch. On CUDA it is a
//! PTX kernel (`kernels/revenue.ptx`, loaded with devarrow's kernel loading into the
//! device's context and launched on its stream); on the CPU device the same arithmetic on
//! the host (the CPU device's memory is host memory).
//!
//! Both take `Decimal128` columns of precision 18 or less (their values fit in 64
//! bits: TPC-H's `Decimal128(15, 2)`) without nulls, and give the exact product as a
//! `Decimal128(38, s)`, `s` the sum of the scales, as DataFusion's own
//! `l_extendedprice * (1 - l_discount)` is.

use std::sync::Arc;

use arrow_array::{Decimal128Array, RecordBatch};
use arrow_schema::{DataType, Field, Schema};
use devarrow::abi::ArrowDeviceType;
use devarrow::bridge::{DeviceBatch, DeviceColumn};

use crate::error::BoxError;
use crate::step::{DeviceStep, StepContext};

/// The step's registered name.
pub const STEP_NAME: &str = "tpch.revenue";

/// The kernel's PTX (`revenue_decimal128`).
pub const REVENUE_PTX: &str = include_str!("../kernels/revenue.ptx");

/// The price column.
pub const PRICE: &str = "l_extendedprice";
/// The discount column.
pub const DISCOUNT: &str = "l_discount";
/// The appended column.
pub const REVENUE: &str = "revenue";

/// The scale of the inputs the step is declared for (TPC-H's).
const INPUT_SCALE: i8 = 2;

/// The appended column: `Decimal128(38, 4)` for TPC-H's scale-2 inputs.
pub fn revenue_field() -> Field {
    Field::new(REVENUE, DataType::Decimal128(38, 2 * INPUT_SCALE), false)
}

/// The step: uploads `l_extendedprice` and `l_discount`, appends `revenue`.
pub fn revenue_step() -> DeviceStep {
    DeviceStep::new(STEP_NAME, run)
        .with_inputs([PRICE, DISCOUNT])
        .appending(vec![revenue_field()])
}

/// Checks one input column: `Decimal128(p <= 18, 2)` without nulls.
fn check_input(column: &DeviceColumn<'_>, name: &str) -> Result<(), BoxError> {
    match column.data_type() {
        DataType::Decimal128(precision, INPUT_SCALE) if *precision <= 18 => {}
        other => {
            return Err(format!(
                "{name} is {other}; the revenue step takes Decimal128(p <= 18, {INPUT_SCALE})"
            )
            .into())
        }
    }
    if column.null_count() != Some(0) && column.validity().is_some() {
        return Err(format!("{name} has nulls; the revenue step takes none").into());
    }
    Ok(())
}

fn run(batch: DeviceBatch, cx: &StepContext<'_>) -> Result<DeviceBatch, BoxError> {
    let price = batch.column_by_name(PRICE).ok_or("no l_extendedprice")?;
    let discount = batch.column_by_name(DISCOUNT).ok_or("no l_discount")?;
    check_input(&price, PRICE)?;
    check_input(&discount, DISCOUNT)?;
    let one = 10i64.pow(INPUT_SCALE as u32);
    #[cfg(feature = "cuda")]
    if let Some(cuda) = cx.device.cuda() {
        return cuda_revenue(&batch, &price, &discount, one, cuda, cx);
    }
    if cx.device.device().device_type() == ArrowDeviceType::CPU {
        return cpu_revenue(&batch, &price, &discount, one, cx);
    }
    Err(format!("no revenue kernel for device {}", cx.device.id()).into())
}

/// The values of a `Decimal128` column on the CPU device, read in place.
fn cpu_values<'a>(column: &DeviceColumn<'a>) -> Result<&'a [i128], BoxError> {
    let values = column.values().ok_or("no values buffer")?;
    let (offset, len) = (column.offset(), column.len());
    let needed = (offset + len) * size_of::<i128>();
    if values.len() < needed {
        return Err(format!("values buffer of {} bytes, {needed} needed", values.len()).into());
    }
    let ptr = values.as_ptr().cast::<i128>();
    if !ptr.is_aligned() {
        return Err("values buffer not aligned for i128".into());
    }
    // The buffer is CPU-device memory, which is host memory (the caller checked the
    // device type), owned by the batch that `column` borrows for 'a; the batch's event
    // was waited for, so its upload has completed.
    // SAFETY: so it lives and is not written for 'a; it holds `offset + len` aligned
    // i128s (checked above).
    Ok(unsafe { std::slice::from_raw_parts(ptr.add(offset), len) })
}

fn cpu_revenue(
    batch: &DeviceBatch,
    price: &DeviceColumn<'_>,
    discount: &DeviceColumn<'_>,
    one: i64,
    cx: &StepContext<'_>,
) -> Result<DeviceBatch, BoxError> {
    batch.event().wait_host()?;
    let (price, discount) = (cpu_values(price)?, cpu_values(discount)?);
    let revenue = Decimal128Array::from_iter_values(
        price
            .iter()
            .zip(discount)
            .map(|(&p, &d)| p * (one as i128 - d)),
    )
    .with_precision_and_scale(38, 2 * INPUT_SCALE)?;
    let schema = Arc::new(Schema::new(vec![revenue_field()]));
    let out = RecordBatch::try_new(schema.clone(), vec![Arc::new(revenue)])?;
    let (array, _ffi_schema) = devarrow::abi::cpu::export_record_batch(&out)?;
    Ok(DeviceBatch::import(
        cx.device.device().clone(),
        array,
        schema,
    )?)
}

#[cfg(feature = "cuda")]
fn cuda_revenue(
    batch: &DeviceBatch,
    price: &DeviceColumn<'_>,
    discount: &DeviceColumn<'_>,
    one: i64,
    cuda: &Arc<devarrow::cuda::CudaDevice>,
    cx: &StepContext<'_>,
) -> Result<DeviceBatch, BoxError> {
    use devarrow::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
    use devarrow::cuda::CudaArray;

    let stream = cuda.stream();
    let function = kernel(cuda)?;
    let n = batch.num_rows();
    // Views borrowing the batch, ordered after its upload on this stream.
    let price = price.cuda_values::<i128>(stream)?;
    let discount = discount.cuda_values::<i128>(stream)?;
    let mut out = stream.alloc_zeros::<i128>(n)?;
    let n64 = n as u64;
    let mut launch = stream.launch_builder(&function);
    launch
        .arg(&price)
        .arg(&discount)
        .arg(&mut out)
        .arg(&n64)
        .arg(&one);
    let blocks = n.div_ceil(256).clamp(1, 1024) as u32;
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    if n > 0 {
        // `revenue_decimal128` takes (u64 price, u64 discount, u64 out, u64 n, s64 one)
        // and reads n i128s of `price` and `discount` and writes n of `out`.
        // SAFETY: those arguments, all holding n; the views keep the batch alive until
        // their drop, which orders the batch's release after this kernel on the stream.
        unsafe { launch.launch(cfg) }?;
    }
    drop((price, discount));
    let revenue = CudaArray::from_values(DataType::Decimal128(38, 2 * INPUT_SCALE), out)?;
    let schema = Arc::new(Schema::new(vec![revenue_field()]));
    Ok(DeviceBatch::from_cuda_arrays(
        cx.device.device().clone(),
        schema,
        vec![revenue],
    )?)
}

/// The kernel in `cuda`'s context, loaded once per context.
#[cfg(feature = "cuda")]
fn kernel(
    cuda: &devarrow::cuda::CudaDevice,
) -> Result<devarrow::cuda::cudarc::driver::CudaFunction, BoxError> {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};

    use devarrow::cuda::cudarc::driver::CudaModule;

    static MODULES: OnceLock<Mutex<HashMap<usize, Arc<CudaModule>>>> = OnceLock::new();
    let context = cuda.primary_context().context();
    // The context's address identifies it while it lives; the primary context of a
    // device lives as long as the process holds it (the module map holds it too).
    let key = Arc::as_ptr(context) as usize;
    let mut modules = MODULES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let module = match modules.get(&key) {
        Some(module) => module.clone(),
        None => {
            let module = devarrow::cuda::kernels::load_module(context, "revenue.ptx", REVENUE_PTX)?;
            modules.insert(key, module.clone());
            module
        }
    };
    drop(modules);
    // cuModuleGetFunction needs the module's context current on this thread.
    context.bind_to_thread()?;
    Ok(module.load_function("revenue_decimal128")?)
}
