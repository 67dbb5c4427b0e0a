//! Criterion benchmarks of the C Device Data Interface on the CPU device: export plus
//! validated import of a 100-column batch (CPU time per call), and the bridge's staged
//! transfer to the CPU device and back (the same code path CUDA uses).
//!
//! A 1,000-row slice of a 1,000,000-row view column of very many small variadic buffers,
//! imported from arrow-rs's C data interface and moved to the host on the CPU device
//! (`view_slice_import`).
//!
//! And on the benchmark device (CUDA device 0, or the CPU device with a printed note):
//! export of a 100-column [`DeviceBatch`](devarrow::bridge::DeviceBatch) as an
//! `ArrowDeviceArray` plus its import by a consumer (`ImportedArray::import` on CUDA,
//! making the consumer stream wait on the batch's event; the validated CPU import on the
//! CPU device), CPU time per call.

mod common;

use std::sync::Arc;

use arrow_array::{Array, ArrayRef, Int64Array, RecordBatch, StructArray};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use devarrow::abi::cpu;
use devarrow::abi::device::CpuDevice;
use devarrow::bridge::{Transfer, TransferOptions};

fn batch(columns: usize, rows: usize) -> RecordBatch {
    RecordBatch::try_from_iter((0..columns).map(|c| {
        let col: ArrayRef = Arc::new(Int64Array::from_iter(
            (0..rows as i64).map(|i| (i % 11 != 0).then_some(i ^ c as i64)),
        ));
        (format!("c{c}"), col)
    }))
    .expect("valid batch")
}

/// devarrow's CPU export plus validated import of a 100-column, 1,000-row batch, beside
/// its peer measured in the same run: arrow-rs's own `to_ffi` + `from_ffi` +
/// `validate_full` over the same batch (as a struct array, which is how a batch crosses
/// the C data interface), and the same without `validate_full`.
fn export_import(c: &mut Criterion) {
    let batch = batch(100, 1000);
    let mut group = c.benchmark_group("cpu/export+import/100 columns");
    group.bench_function("devarrow", |b| {
        b.iter(|| {
            let (array, schema) = cpu::export_record_batch(&batch).unwrap();
            cpu::import_record_batch(array, &schema).unwrap()
        })
    });
    for validate in [true, false] {
        let id = if validate {
            "arrow-rs to_ffi+from_ffi+validate_full"
        } else {
            "arrow-rs to_ffi+from_ffi"
        };
        group.bench_function(id, |b| {
            b.iter(|| {
                // From the batch, as devarrow's export starts: a batch crosses as the
                // data of its struct array.
                let data = StructArray::from(batch.clone()).into_data();
                let (array, schema) = arrow_array::ffi::to_ffi(&data).unwrap();
                // SAFETY: `array` and `schema` were exported by arrow-rs just above from
                // host data, and are consumed here once.
                let imported = unsafe { arrow_array::ffi::from_ffi(array, &schema) }.unwrap();
                if validate {
                    imported.validate_full().unwrap();
                }
                RecordBatch::from(StructArray::from(imported))
            })
        });
    }
    group.finish();
}

fn bridge(c: &mut Criterion) {
    let mut group = c.benchmark_group("cpu/bridge");
    for (columns, rows) in [(100, 1000), (4, 1 << 20)] {
        let batch = batch(columns, rows);
        let mut transfer = Transfer::new(Arc::new(CpuDevice::new()), TransferOptions::default());
        let on_device = transfer.to_device(&batch).unwrap();
        group.throughput(Throughput::Bytes(on_device.device_bytes() as u64));
        let shape = format!("{columns}x{rows}");
        group.bench_with_input(BenchmarkId::new("to_device", &shape), &batch, |b, batch| {
            b.iter(|| transfer.to_device(batch).unwrap())
        });
        group.bench_with_input(BenchmarkId::new("to_host", &shape), &on_device, |b, d| {
            b.iter(|| transfer.to_host(d).unwrap())
        });
    }
    group.finish();
}

fn device_export_import(c: &mut Criterion) {
    let dev = common::BenchDevice::open("ffi");
    let batch = batch(100, 1000);
    let mut transfer = Transfer::new(dev.device(), TransferOptions::default());
    let on_device = transfer.to_device(&batch).unwrap();
    on_device.event().wait_host().unwrap();
    let name = format!("{}/device export+import/100 columns", dev.label());
    match &dev {
        common::BenchDevice::Cuda(cuda) => {
            let consumer = cuda.primary_context().new_stream().unwrap();
            c.bench_function(&name, |b| {
                b.iter(|| {
                    let (array, schema) = on_device.export().unwrap();
                    let imported = devarrow::cuda::ImportedArray::import(array, &consumer);
                    (imported.unwrap(), schema)
                })
            });
        }
        common::BenchDevice::Cpu(_) => {
            c.bench_function(&name, |b| {
                b.iter(|| {
                    let (array, schema) = on_device.export().unwrap();
                    cpu::import_record_batch(array, &schema).unwrap()
                })
            });
        }
    }
}

/// `ExportOptions::for_libcudf` beside the plain export, on the benchmark device, each
/// followed by a device synchronize (so a conversion's kernels are timed):
/// - a batch that needs no conversion (int64 and utf8 columns): the libcudf export must
///   cost what the plain one does;
/// - a batch with a `Utf8View` column (mixed inline and long strings): the conversion
///   (sizes, scan, one gather of the bytes, narrowed offsets), beside its peer from the
///   same run, one device-to-device copy of the same number of bytes
///   (`Device::copy_on_device`), the least a pass that writes them can cost;
/// - a batch of 12 columns, views and large lists of views: two levels of sizes to read
///   back, the host waits of one export printed (one per level, not one per column).
fn libcudf_export(c: &mut Criterion) {
    use arrow_array::builder::StringViewBuilder;
    use devarrow::abi::device::DeviceCopy;
    use devarrow::bridge::ExportOptions;

    let dev = common::BenchDevice::open("ffi");
    let device = dev.device();
    let rows = common::scaled(1 << 20, common::scale(dev.is_gpu(), 0.05), 1024);
    let mut transfer = Transfer::new(device.clone(), TransferOptions::default());
    let mut group = c.benchmark_group(format!("{}/libcudf export", dev.label()));

    let plain_batch = RecordBatch::try_from_iter([
        (
            "id",
            Arc::new(Int64Array::from_iter_values(0..rows as i64)) as ArrayRef,
        ),
        (
            "name",
            Arc::new(arrow_array::StringArray::from_iter_values(
                (0..rows).map(|i| format!("name {i}")),
            )) as ArrayRef,
        ),
    ])
    .unwrap();
    let on_device = transfer.to_device(&plain_batch).unwrap();
    on_device.event().wait_host().unwrap();
    let shape = format!("nothing to convert/{rows} rows");
    for (id, options) in [
        ("plain export", ExportOptions::default()),
        ("for_libcudf", ExportOptions::for_libcudf()),
    ] {
        group.bench_function(BenchmarkId::new(id, &shape), |b| {
            b.iter(|| {
                let export = on_device.export_with(options).unwrap();
                device.synchronize().unwrap();
                export
            })
        });
    }

    let mut views = StringViewBuilder::new();
    for i in 0..rows {
        if i % 3 == 0 {
            views.append_value(format!("a string longer than inline, row {i}"));
        } else {
            views.append_value(format!("r{i}"));
        }
    }
    let view_batch =
        RecordBatch::try_from_iter([("s", Arc::new(views.finish()) as ArrayRef)]).unwrap();
    let string_bytes: usize = (0..rows)
        .map(|i| match i % 3 {
            0 => format!("a string longer than inline, row {i}").len(),
            _ => format!("r{i}").len(),
        })
        .sum();
    let on_device = transfer.to_device(&view_batch).unwrap();
    on_device.event().wait_host().unwrap();
    let shape = format!("utf8 view/{rows} rows");
    group.throughput(Throughput::Bytes(string_bytes as u64));
    for (id, options) in [
        ("plain export", ExportOptions::default()),
        ("for_libcudf", ExportOptions::for_libcudf()),
    ] {
        group.bench_function(BenchmarkId::new(id, &shape), |b| {
            b.iter(|| {
                let export = on_device.export_with(options).unwrap();
                device.synchronize().unwrap();
                export
            })
        });
    }
    let src = device.allocate(string_bytes).unwrap();
    let dst = device.allocate(string_bytes).unwrap();
    group.bench_function(
        BenchmarkId::new("peer: one device copy of the bytes", &shape),
        |b| {
            b.iter(|| {
                let copy = DeviceCopy {
                    src: src.address(),
                    dst: dst.address(),
                    len: string_bytes,
                };
                // SAFETY: both allocations hold `string_bytes` bytes of the device, distinct,
                // alive until the synchronize below.
                unsafe { device.copy_on_device(&[copy]) }.unwrap();
                device.synchronize().unwrap();
            })
        },
    );

    // Many columns over two levels of nesting: the conversions read their sizes back once
    // per level for the whole batch, not once per column (printed once, then timed).
    let columns = 12;
    let nested_rows = (rows / columns).max(1);
    let nested_batch = RecordBatch::try_from_iter((0..columns).map(|c| {
        // every third column a large list of two views per row
        let list = c % 3 == 2;
        let mut views = StringViewBuilder::new();
        for i in 0..if list { 2 * nested_rows } else { nested_rows } {
            views.append_value(format!("column {c}, a string longer than inline, row {i}"));
        }
        let views: ArrayRef = Arc::new(views.finish());
        let column: ArrayRef = if list {
            Arc::new(arrow_array::LargeListArray::new(
                Arc::new(arrow_schema::Field::new(
                    "item",
                    arrow_schema::DataType::Utf8View,
                    true,
                )),
                arrow_buffer::OffsetBuffer::from_lengths(std::iter::repeat_n(2, nested_rows)),
                views,
                None,
            ))
        } else {
            views
        };
        (format!("c{c}"), column)
    }))
    .unwrap();
    let on_device = transfer.to_device(&nested_batch).unwrap();
    on_device.event().wait_host().unwrap();
    let waits = host_waits_of_libcudf_export(&device, &on_device);
    println!(
        "[ffi] for_libcudf of {columns} columns ({} of them lists of views: two levels of \
         sizes to read back): {waits} host waits",
        columns / 3
    );
    let nested_bytes: usize = (0..columns)
        .map(|c| {
            let values = if c % 3 == 2 {
                2 * nested_rows
            } else {
                nested_rows
            };
            (0..values)
                .map(|i| format!("column {c}, a string longer than inline, row {i}").len())
                .sum::<usize>()
        })
        .sum();
    group.throughput(Throughput::Bytes(nested_bytes as u64));
    let shape = format!("{columns} columns, 2 levels/{nested_rows} rows");
    group.bench_function(BenchmarkId::new("for_libcudf", &shape), |b| {
        b.iter(|| {
            let export = on_device.export_with(ExportOptions::for_libcudf()).unwrap();
            device.synchronize().unwrap();
            export
        })
    });
    group.finish();
}

/// How many times the host waits for the device in `batch.export_with(for_libcudf)`: the
/// batch's plain export imported on a [`CountingWaits`] wrapper of `device`, whose export
/// then runs the conversions.
fn host_waits_of_libcudf_export(
    device: &Arc<dyn devarrow::abi::device::Device>,
    batch: &devarrow::bridge::DeviceBatch,
) -> u64 {
    use devarrow::bridge::{DeviceBatch, ExportOptions};
    let counting = Arc::new(CountingWaits {
        inner: device.clone(),
        waits: Arc::default(),
    });
    let (array, schema) = batch.export().unwrap();
    let imported = DeviceBatch::import_with_ffi_schema(counting.clone(), array, &schema).unwrap();
    let before = counting.waits.load(std::sync::atomic::Ordering::SeqCst);
    let export = imported.export_with(ExportOptions::for_libcudf()).unwrap();
    let waits = counting.waits.load(std::sync::atomic::Ordering::SeqCst) - before;
    drop(export);
    device.synchronize().unwrap();
    waits
}

/// A device counting the host's waits for it (on its events, and `synchronize`),
/// forwarding everything to `inner`.
#[derive(Debug)]
struct CountingWaits {
    inner: Arc<dyn devarrow::abi::device::Device>,
    waits: Arc<std::sync::atomic::AtomicU64>,
}

/// An event of [`CountingWaits`]: its host waits counted.
#[derive(Debug)]
struct CountedEvent {
    inner: Arc<dyn devarrow::abi::device::SyncEvent>,
    waits: Arc<std::sync::atomic::AtomicU64>,
}

// SAFETY: the inner event's pointer; waits on the inner event.
unsafe impl devarrow::abi::device::SyncEvent for CountedEvent {
    fn as_sync_event_ptr(&self) -> *mut std::ffi::c_void {
        self.inner.as_sync_event_ptr()
    }
    fn wait_host(&self) -> devarrow::abi::Result<()> {
        self.waits.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.wait_host()
    }
}

// SAFETY: every call forwarded to the inner device, whose guarantees these are.
unsafe impl devarrow::abi::device::Device for CountingWaits {
    fn device_type(&self) -> devarrow::abi::ArrowDeviceType {
        self.inner.device_type()
    }
    fn device_id(&self) -> i64 {
        self.inner.device_id()
    }
    fn allocate(
        &self,
        len: usize,
    ) -> devarrow::abi::Result<Arc<dyn devarrow::abi::device::DeviceMemory>> {
        self.inner.allocate(len)
    }
    fn allocate_staging(
        &self,
        len: usize,
    ) -> devarrow::abi::Result<Box<dyn devarrow::abi::device::StagingMemory>> {
        self.inner.allocate_staging(len)
    }
    unsafe fn copy_to_device(
        &self,
        src: *const u8,
        dst: *mut std::ffi::c_void,
        len: usize,
    ) -> devarrow::abi::Result<()> {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.copy_to_device(src, dst, len) }
    }
    unsafe fn copy_to_host(
        &self,
        src: *const std::ffi::c_void,
        dst: *mut u8,
        len: usize,
    ) -> devarrow::abi::Result<()> {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.copy_to_host(src, dst, len) }
    }
    unsafe fn copy_on_device(
        &self,
        copies: &[devarrow::abi::device::DeviceCopy],
    ) -> devarrow::abi::Result<()> {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.copy_on_device(copies) }
    }
    fn kernels(&self) -> Option<&dyn devarrow::abi::device::DeviceKernels> {
        self.inner.kernels()
    }
    fn record_event(&self) -> devarrow::abi::Result<Arc<dyn devarrow::abi::device::SyncEvent>> {
        Ok(Arc::new(CountedEvent {
            inner: self.inner.record_event()?,
            waits: self.waits.clone(),
        }))
    }
    unsafe fn wait_sync_event(
        &self,
        sync_event: *mut std::ffi::c_void,
    ) -> devarrow::abi::Result<()> {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.wait_sync_event(sync_event) }
    }
    fn synchronize(&self) -> devarrow::abi::Result<()> {
        self.waits.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.synchronize()
    }
    fn is_pinned(&self, ptr: *const u8, len: usize) -> bool {
        self.inner.is_pinned(ptr, len)
    }
    fn host_accessible(&self) -> bool {
        self.inner.host_accessible()
    }
}

/// Issue #32, goal 8: the import (`DeviceBatch::import_with_ffi_schema`, CPU device) and
/// download (`Transfer::to_host`) of a 1,000-row slice at row 500,003 of a
/// 1,000,000-row view column of very many small variadic buffers (arrow-rs's builders
/// with fixed blocks of 16 and 200 bytes, taken at random, concatenated from 1,000
/// batches: `devarrow_testing::slices::many_block_view_columns`), exported through
/// arrow-rs's C data interface. CPU time per call, the slice's own bytes (views and the
/// bytes they reference) as throughput; prints once per column what the download moved.
/// The bytes the import reads back are counted by the test
/// `a_slice_of_a_view_column_of_many_blocks_moves_only_its_bytes` (`docs/benchmarks.md`).
fn view_slice_import(c: &mut Criterion) {
    use criterion::BatchSize;
    use devarrow::abi::device::Device;
    use devarrow::bridge::DeviceBatch;
    use devarrow_testing::slices;

    // Not scaled: the point is a column of hundreds of thousands of buffers.
    let (rows, offset, len) = (1_000_000, 500_003, 1_000);
    let device: Arc<dyn Device> = Arc::new(CpuDevice::new());
    let mut transfer = Transfer::new(device.clone(), TransferOptions::default());
    let mut group = c.benchmark_group("cpu/import view slice/1000 rows of 1M");
    for (name, column) in slices::many_block_view_columns(rows) {
        if name.contains("blocks of 64") && !name.contains("taken") || name.contains("blocks of 40")
        {
            continue; // like their neighbours
        }
        let slice = slices::batch_of(&name, column.slice(offset, len));
        let logical = slices::logical_view_bytes(slice.column(0).as_ref());
        let (array, schema) = cpu::export_record_batch(&slice).unwrap();
        let imported = DeviceBatch::import_with_ffi_schema(device.clone(), array, &schema).unwrap();
        let before = transfer.stats().to_host.bytes;
        let back = transfer.to_host(&imported).unwrap();
        assert_eq!(back, slice);
        eprintln!(
            "{name} ({} buffers): the download moved {} bytes for a slice of {logical}",
            slices::data_buffers(&*column),
            transfer.stats().to_host.bytes - before,
        );
        group.throughput(Throughput::Bytes(logical));
        group.bench_function(BenchmarkId::new("import+to_host", &name), |b| {
            b.iter_batched(
                || cpu::export_record_batch(&slice).unwrap(),
                |(array, schema)| {
                    let imported =
                        DeviceBatch::import_with_ffi_schema(device.clone(), array, &schema)
                            .unwrap();
                    transfer.to_host(&imported).unwrap()
                },
                BatchSize::SmallInput,
            )
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = common::criterion_config();
    targets = export_import, bridge, device_export_import, libcudf_export, view_slice_import
}
criterion_main!(benches);
