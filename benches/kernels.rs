//! Criterion benchmarks of every kernel of `devarrow::cuda::kernels` beside a
//! device-to-device `cuMemcpyDtoDAsync` of the same bytes (issue #5's target: each kernel
//! at least 80% of the D2D bandwidth), at 64 MiB and 256 MiB.
//!
//! The size `N` of a case is the larger of its input and output (`Throughput::Bytes(N)`):
//! `count_set_bits` reads an N-byte bitmap; `copy_bitmap` realigns one (bit offset 3) into
//! N bytes; `pack_bools` packs N one-byte booleans; `unpack_bits` writes N booleans;
//! `batched_copy(aligned)` copies N bytes in 4096 segments of mixed sizes whose sources
//! and destinations have the same alignment modulo 16; `batched_copy(misaligned)` the
//! same with every source 7 bytes further (the kernel's shifted path, which 15 of 16
//! source offsets take, e.g. sliced strings); `rebase_offsets_i32/i64` rebase N bytes of
//! offsets; `d2d` copies N bytes. Each sample ends with `cuStreamSynchronize`.
//!
//! Without a GPU it benchmarks the CPU reference implementations
//! (`devarrow_testing::kernel_oracles`, the GPU tests' oracles, which replay the
//! kernels' access patterns and are not meant to be fast) beside a host `memcpy`, at 1 and
//! 4 MiB, and says so. `DEVARROW_BENCH_KERNEL_MIB` (comma-separated MiB) overrides the
//! sizes.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::BenchDevice;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, Criterion, Throughput};
use devarrow::cuda::cudarc::driver::sys;
use devarrow::cuda::kernels::{self, CopySegment};
use devarrow::cuda::{CudaDevice, CudaMemory, CudaStream, DeviceBuffer};
use devarrow_testing::kernel_oracles as reference;

fn sizes(gpu: bool) -> Vec<usize> {
    match std::env::var("DEVARROW_BENCH_KERNEL_MIB") {
        Ok(v) => v
            .split(',')
            .map(|s| {
                s.trim()
                    .parse::<usize>()
                    .ok()
                    .filter(|&m| m > 0)
                    .unwrap_or_else(|| {
                        panic!("DEVARROW_BENCH_KERNEL_MIB={v:?}: want MiB, e.g. 64,256")
                    })
            })
            .collect(),
        Err(_) if gpu => vec![64, 256],
        Err(_) => vec![1, 4],
    }
}

/// 4096 segments covering `n` bytes, of pseudo-random sizes (a few bytes to a few
/// hundred KiB), as `(offset, len)`.
fn segment_layout(n: usize) -> Vec<(usize, usize)> {
    let count = 4096;
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let weights: Vec<u64> = (0..count)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            1 + (state % 1000).pow(2)
        })
        .collect();
    let sum: u64 = weights.iter().sum();
    let mut out = Vec::with_capacity(count);
    let mut at = 0;
    for (i, w) in weights.iter().enumerate() {
        let len = if i + 1 == count {
            n - at
        } else {
            (n as u128 * *w as u128 / sum as u128) as usize
        };
        out.push((at, len));
        at += len;
    }
    out
}

fn configure(group: &mut BenchmarkGroup<'_, criterion::measurement::WallTime>, n: usize) {
    group.warm_up_time(Duration::from_secs(1));
    group.measurement_time(Duration::from_secs(3));
    group.sample_size(20);
    group.throughput(Throughput::Bytes(n as u64));
}

fn sync(stream: &CudaStream) {
    stream.synchronize().expect("cuStreamSynchronize");
}

fn gpu_kernels(c: &mut Criterion, device: &CudaDevice) {
    let stream: Arc<CudaStream> = device.primary_context().new_stream().expect("stream");
    for mib in sizes(true) {
        let n = mib << 20;
        let alloc = |len: usize| {
            let mut b = DeviceBuffer::alloc(&stream, len).expect("device memory");
            b.memset(&stream, 0x5b).expect("memset");
            b
        };
        let src = alloc(n + 8);
        let dst = alloc(n + 8);
        let counter = alloc(8);
        sync(&stream);
        let (s, d) = (src.device_ptr(), dst.device_ptr());
        let bits = (n as u64) * 8;

        // (descriptor table, descriptors) of the 4096 segments, sources `shift` bytes on
        // (the buffers have 8 bytes to spare)
        let table = |shift: u64| {
            let segments: Vec<CopySegment> = segment_layout(n)
                .into_iter()
                .map(|(at, len)| CopySegment {
                    src: s + at as u64 + shift,
                    dst: d + at as u64,
                    len: len as u64,
                })
                .collect();
            let pieces = kernels::plan_batched_copy(&stream, &segments).expect("plan");
            let flat: Vec<u64> = pieces.iter().flat_map(|p| [p.src, p.dst, p.len]).collect();
            let table = DeviceBuffer::from_host(&stream, &flat).expect("descriptor table");
            (table, pieces.len() as u64)
        };
        let aligned = table(0);
        let misaligned = table(7);

        let mut group = c.benchmark_group(format!("kernels/cuda/{mib}MiB"));
        configure(&mut group, n);
        device.primary_context().bind_to_thread().expect("bind");
        group.bench_function("d2d", |b| {
            b.iter(|| {
                // SAFETY: both buffers hold `n + 8` bytes and live until after the
                // synchronize; the stream belongs to the bound context.
                unsafe { sys::cuMemcpyDtoDAsync_v2(d, s, n, stream.cu_stream()) }
                    .result()
                    .expect("cuMemcpyDtoDAsync");
                sync(&stream)
            })
        });
        // Every launch below: the ranges lie inside `src` (n + 8 bytes), `dst` (n + 8
        // bytes), `counter` (8 bytes) or the descriptor table (`pieces.len()` descriptors
        // into `src`/`dst`), all alive until after the synchronize that ends the sample;
        // sources and destinations do not overlap.
        group.bench_function("count_set_bits", |b| {
            b.iter(|| {
                // SAFETY: see "Every launch below" above.
                unsafe {
                    kernels::launch_count_set_bits(&stream, s, 0, bits, counter.device_ptr())
                }
                .expect("launch");
                sync(&stream)
            })
        });
        group.bench_function("copy_bitmap(offset 3)", |b| {
            b.iter(|| {
                // SAFETY: see "Every launch below" above.
                unsafe { kernels::launch_copy_bitmap(&stream, s, 3, bits, d) }.expect("launch");
                sync(&stream)
            })
        });
        group.bench_function("pack_bools", |b| {
            b.iter(|| {
                // SAFETY: see "Every launch below" above.
                unsafe { kernels::launch_pack_bools(&stream, s, n as u64, d) }.expect("launch");
                sync(&stream)
            })
        });
        group.bench_function("unpack_bits", |b| {
            b.iter(|| {
                // SAFETY: see "Every launch below" above.
                unsafe { kernels::launch_unpack_bits(&stream, s, 0, n as u64, d) }.expect("launch");
                sync(&stream)
            })
        });
        for (name, (table, pieces)) in [
            ("batched_copy(aligned)", &aligned),
            ("batched_copy(misaligned)", &misaligned),
        ] {
            group.bench_function(name, |b| {
                b.iter(|| {
                    // SAFETY: see "Every launch below" above.
                    unsafe { kernels::launch_batched_copy(&stream, table.device_ptr(), *pieces) }
                        .expect("launch");
                    sync(&stream)
                })
            });
        }
        group.bench_function("rebase_offsets_i32", |b| {
            b.iter(|| {
                // SAFETY: see "Every launch below" above.
                unsafe { kernels::launch_rebase_offsets_i32(&stream, s, n as u64 / 4, 7, d) }
                    .expect("launch");
                sync(&stream)
            })
        });
        group.bench_function("rebase_offsets_i64", |b| {
            b.iter(|| {
                // SAFETY: see "Every launch below" above.
                unsafe { kernels::launch_rebase_offsets_i64(&stream, s, n as u64 / 8, 7, d) }
                    .expect("launch");
                sync(&stream)
            })
        });
        group.finish();
        drop((src, dst, counter, aligned, misaligned));
        sync(&stream);
    }
}

fn cpu_references(c: &mut Criterion) {
    println!(
        "[kernels] no GPU: benchmarking the CPU reference implementations \
         (devarrow_testing::kernel_oracles) beside a memcpy; the GPU numbers need a GPU"
    );
    for mib in sizes(false) {
        let n = mib << 20;
        let src: Vec<u8> = (0..n + 8).map(|i| (i as u8).wrapping_mul(151)).collect();
        let bools: Vec<u8> = src.iter().map(|b| b & 1).collect();
        let offsets32: Vec<i32> = (0..n / 4).map(|i| i as i32 * 3).collect();
        let offsets64: Vec<i64> = (0..n / 8).map(|i| i as i64 * 3).collect();
        let layout = segment_layout(n);
        let mut out = vec![0u8; n + 8];
        let bits = n * 8;

        let mut group = c.benchmark_group(format!("kernels/cpu-reference/{mib}MiB"));
        configure(&mut group, n);
        group.bench_function("memcpy", |b| b.iter(|| out[..n].copy_from_slice(&src[..n])));
        group.bench_function("count_set_bits", |b| {
            b.iter(|| reference::count_set_bits(&src, 0, bits))
        });
        group.bench_function("copy_bitmap(offset 3)", |b| {
            b.iter(|| reference::copy_bitmap(&src, 3, bits))
        });
        group.bench_function("pack_bools", |b| {
            b.iter(|| reference::pack_bools(&bools[..n]))
        });
        group.bench_function("unpack_bits", |b| {
            b.iter(|| reference::unpack_bits(&src, 0, n))
        });
        for (name, shift) in [
            ("batched_copy(aligned)", 0),
            ("batched_copy(misaligned)", 7),
        ] {
            group.bench_function(name, |b| {
                b.iter(|| {
                    let srcs: Vec<&[u8]> = layout
                        .iter()
                        .map(|&(at, len)| &src[at + shift..at + shift + len])
                        .collect();
                    let mut rest = &mut out[..n];
                    let mut dsts: Vec<&mut [u8]> = Vec::with_capacity(layout.len());
                    for &(_, len) in &layout {
                        let (head, tail) = rest.split_at_mut(len);
                        dsts.push(head);
                        rest = tail;
                    }
                    reference::batched_copy(&srcs, &mut dsts)
                })
            });
        }
        group.bench_function("rebase_offsets_i32", |b| {
            b.iter(|| reference::rebase_offsets_i32(&offsets32, 7))
        });
        group.bench_function("rebase_offsets_i64", |b| {
            b.iter(|| reference::rebase_offsets_i64(&offsets64, 7))
        });
        group.finish();
    }
}

fn kernels_bench(c: &mut Criterion) {
    match BenchDevice::open("kernels") {
        BenchDevice::Cuda(device) => gpu_kernels(c, &device),
        BenchDevice::Cpu(_) => cpu_references(c),
    }
}

criterion_group! {
    name = benches;
    config = common::criterion_config();
    targets = kernels_bench
}
criterion_main!(benches);
