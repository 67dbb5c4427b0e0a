//! A user kernel on a column of a device-resident batch, through cudarc, on the engine's
//! own stream:
//!
//! 1. the engine has its own CUDA context and stream (cudarc); devarrow works on that
//!    stream (`CudaDevice::on_stream`), so its copies are ordered with the engine's work;
//! 2. a record batch is uploaded (`Transfer::to_device`);
//! 3. column `x` is taken as a cudarc view (`DeviceColumn::cuda_values`), borrowing the
//!    batch, and a user kernel (PTX, loaded with cudarc) adds 1 to every value into a
//!    cudarc slice;
//! 4. that slice (with the column's validity bitmap) becomes an Arrow array
//!    (`CudaArray`), a device batch (`DeviceBatch::from_cuda_arrays`), and is downloaded
//!    and checked.
//!
//! Without a usable GPU it shows the columns of a batch on the CPU device, says why the
//! kernel is skipped, and exits successfully.
//!
//! Run with `cargo run --example user_kernel`.

use std::error::Error;
use std::sync::Arc;

use arrow_array::{Array, ArrayRef, Int32Array, RecordBatch, StringArray};
use arrow_schema::{DataType, Field, Schema};
use devarrow::abi::device::CpuDevice;
use devarrow::bridge::{DeviceBatch, DeviceColumn, Transfer, TransferOptions};
use devarrow::cuda::cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
use devarrow::cuda::cudarc::nvrtc::Ptx;
use devarrow::cuda::{CudaArray, CudaDevice, PrimaryContext};

/// `dst[i] = src[i] + 1` for `i < n` (i32, wrapping), grid-stride.
const ADD_ONE_PTX: &str = include_str!("add_one.ptx");

/// The column the kernel runs on.
const COLUMN: &str = "x";

fn input_batch() -> Result<RecordBatch, Box<dyn Error>> {
    let rows = 10_000;
    let x = Int32Array::from_iter((0..rows).map(|i| (i % 10 != 3).then_some(i * 7 - 1000)));
    let name = StringArray::from_iter_values((0..rows).map(|i| format!("row {i}")));
    Ok(RecordBatch::try_from_iter([
        ("name", Arc::new(name) as ArrayRef),
        (COLUMN, Arc::new(x) as ArrayRef),
    ])?)
}

/// Prints what devarrow tells about a column and its buffers.
fn describe(column: &DeviceColumn<'_>) {
    println!(
        "column {COLUMN}: {} x {} rows (offset {}, {:?} nulls) on {} {}",
        column.data_type(),
        column.len(),
        column.offset(),
        column.null_count(),
        column.device_type(),
        column.device_id()
    );
    for (i, buffer) in column.buffers().iter().enumerate() {
        match buffer {
            Some(b) => println!(
                "  buffer {i} ({}): {} bytes at {:#x}",
                b.role().name(),
                b.len(),
                b.address()
            ),
            None => println!("  buffer {i}: NULL"),
        }
    }
}

fn main() -> Result<(), Box<dyn Error>> {
    let batch = input_batch()?;
    // Without a usable GPU (no driver, no device), cudarc must not be called at all.
    if let Err(e) = PrimaryContext::open(0) {
        println!("no usable CUDA device ({e}): the columns on the CPU device instead");
        let mut transfer = Transfer::new(Arc::new(CpuDevice::new()), TransferOptions::default());
        let on_cpu = transfer.to_device(&batch)?;
        describe(&on_cpu.column_by_name(COLUMN).ok_or("no column")?);
        println!("skipping the CUDA kernel: {e}");
        return Ok(());
    }

    // 1. The engine's own context and stream; devarrow works on that stream.
    let ctx = CudaContext::new(0)?;
    let stream = ctx.new_stream()?;
    let device = Arc::new(CudaDevice::on_stream(stream.clone())?);
    let mut transfer = Transfer::new(device.clone(), TransferOptions::default());

    // 2. Upload (asynchronous: ordered on the engine's stream).
    let on_device = transfer.to_device(&batch)?;
    let column = on_device.column_by_name(COLUMN).ok_or("no column")?;
    describe(&column);

    // 3. The column as a cudarc view (borrowing the batch, never freeing its memory),
    //    and the user kernel on it, on the engine's stream.
    let input = column.cuda_values::<i32>(&stream)?;
    let module = ctx.load_module(Ptx::from_src(ADD_ONE_PTX))?;
    let add_one = module.load_function("add_one_i32")?;
    let n = input.len() as u64;
    let mut output = stream.alloc_zeros::<i32>(input.len())?;
    let mut launch = stream.launch_builder(&add_one);
    launch.arg(&input).arg(&mut output).arg(&n);
    let cfg = LaunchConfig {
        grid_dim: (16, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `add_one_i32` takes (u64 src, u64 dst, u64 n) and reads n i32s of `input`
    // and writes n of `output`, which both hold n; the view keeps the batch alive, and its
    // drop orders the batch's release after this kernel.
    unsafe { launch.launch(cfg) }?;
    // The nulls stay where they were: a copy of the column's validity bitmap.
    let validity = match column.cuda_validity(&stream)? {
        Some(bits) => Some(stream.clone_dtod(&*bits)?),
        None => None,
    };
    drop(input);

    // 4. The kernel's output as an Arrow array and a device batch, downloaded.
    let result = match validity {
        Some(bits) => CudaArray::with_validity(DataType::Int32, output, bits, column.null_count())?,
        None => CudaArray::from_values(DataType::Int32, output)?,
    };
    let schema = Arc::new(Schema::new(vec![Field::new(
        "x_plus_one",
        DataType::Int32,
        true,
    )]));
    let computed = DeviceBatch::from_cuda_arrays(device.clone(), schema, vec![result])?;
    let back = transfer.to_host(&computed)?;

    let original = batch
        .column_by_name(COLUMN)
        .and_then(|c| c.as_any().downcast_ref::<Int32Array>())
        .ok_or("no int32 column")?;
    let expected = Int32Array::from_iter(original.iter().map(|v| v.map(|v| v.wrapping_add(1))));
    if back.column(0).as_ref() != &expected as &dyn Array {
        return Err("the kernel's output differs from x + 1".into());
    }
    println!(
        "x + 1 computed on {} by a user kernel: {} rows, {} nulls, first values {:?}",
        device.primary_context().name(),
        back.num_rows(),
        back.column(0).null_count(),
        expected.iter().take(5).collect::<Vec<_>>()
    );
    Ok(())
}
