//! The kernels of `crates/cuda/kernels/*.ptx` executed by the PTX interpreter and compared byte for
//! byte with the `reference::naive` oracles — random inputs, many lengths, bit offsets,
//! source/destination alignments and launch geometries — with every source mapped
//! read-only and exactly (a read outside it faults), every destination mapped
//! write-only and exactly, and guard bytes around it that must stay untouched. Plus the
//! interpreter's own contract: PTX semantics of tricky instructions, collectives, parse
//! errors, faults, deadlocks and invalid launches.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use devarrow_cuda::kernels::{
    plan_pieces, split_segments, CopySegment, BLOCK_SIZE, COPY_PTX, VALIDITY_PTX,
};
use devarrow_emu::ptx::{Dims, ExecError, Fault, Memory, Module};
use devarrow_testing::kernel_oracles::{naive, SplitMix64};
use devarrow_testing::spin::TESTING_PTX;

// ---------------------------------------------------------------------------------------
// A test memory: a few regions at chosen device addresses
// ---------------------------------------------------------------------------------------

/// Where the test buffers live (distinct 4 GiB windows so they never touch).
const SRC: u64 = 0x1000_0000_0000;
const DST: u64 = 0x1001_0000_0000;
const TABLE: u64 = 0x1002_0000_0000;
const OUT: u64 = 0x1003_0000_0000;

/// Guard bytes mapped on both sides of every destination.
const GUARD: u64 = 16;
const GUARD_BYTE: u8 = 0xA5;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Access {
    Read,
    Write,
    ReadWrite,
}

struct Region {
    base: u64,
    data: Vec<AtomicU8>,
    access: Access,
}

/// Device memory made of regions; any access not entirely inside one region (with the
/// right access) is a [`Fault`].
struct TestMem {
    regions: Vec<Region>,
    atomics: Mutex<()>,
    start: Instant,
}

impl TestMem {
    fn new() -> Self {
        TestMem {
            regions: Vec::new(),
            atomics: Mutex::new(()),
            start: Instant::now(),
        }
    }

    fn map(&mut self, base: u64, bytes: &[u8], access: Access) {
        assert!(
            self.regions.iter().all(
                |r| base + bytes.len() as u64 <= r.base || base >= r.base + r.data.len() as u64
            ),
            "test regions overlap"
        );
        self.regions.push(Region {
            base,
            data: bytes.iter().map(|&b| AtomicU8::new(b)).collect(),
            access,
        });
    }

    /// Maps a write-only destination of `len` bytes at `base` with guard bytes around it.
    fn map_dst(&mut self, base: u64, len: u64) {
        self.map(base - GUARD, &[GUARD_BYTE; GUARD as usize], Access::Write);
        self.map(base, &vec![0x5Au8; len as usize], Access::Write);
        self.map(base + len, &[GUARD_BYTE; GUARD as usize], Access::Write);
    }

    fn bytes(&self, addr: u64, len: u64) -> Vec<u8> {
        (addr..addr + len)
            .map(|a| {
                let r = self
                    .regions
                    .iter()
                    .find(|r| a >= r.base && a < r.base + r.data.len() as u64)
                    .expect("test reads unmapped memory");
                r.data[(a - r.base) as usize].load(Ordering::Relaxed)
            })
            .collect()
    }

    /// The destination written at `base` and whether its guard bytes are untouched.
    fn dst(&self, base: u64, len: u64) -> (Vec<u8>, bool) {
        let before = self.bytes(base - GUARD, GUARD);
        let after = self.bytes(base + len, GUARD);
        let guards_ok = before.iter().chain(&after).all(|&b| b == GUARD_BYTE);
        (self.bytes(base, len), guards_ok)
    }

    fn find(&self, addr: u64, len: usize, write: bool) -> Result<&[AtomicU8], Fault> {
        let what = if write { "store" } else { "load" };
        for r in &self.regions {
            let Some(off) = addr.checked_sub(r.base) else {
                continue;
            };
            if off
                .checked_add(len as u64)
                .is_some_and(|e| e <= r.data.len() as u64)
            {
                let ok = match r.access {
                    Access::Read => !write,
                    Access::Write => write,
                    Access::ReadWrite => true,
                };
                if !ok {
                    return Err(Fault {
                        addr,
                        size: len,
                        kind: format!("{what} not permitted"),
                    });
                }
                return Ok(&r.data[off as usize..off as usize + len]);
            }
        }
        Err(Fault {
            addr,
            size: len,
            kind: format!("out-of-bounds {what}"),
        })
    }
}

impl Memory for TestMem {
    fn load(&self, addr: u64, buf: &mut [u8]) -> Result<(), Fault> {
        let src = self.find(addr, buf.len(), false)?;
        for (b, s) in buf.iter_mut().zip(src) {
            *b = s.load(Ordering::Relaxed);
        }
        Ok(())
    }

    fn store(&self, addr: u64, data: &[u8]) -> Result<(), Fault> {
        let dst = self.find(addr, data.len(), true)?;
        for (d, &s) in dst.iter().zip(data) {
            d.store(s, Ordering::Relaxed);
        }
        Ok(())
    }

    fn atomic_add_u64(&self, addr: u64, value: u64) -> Result<u64, Fault> {
        let _g = self.atomics.lock().unwrap();
        let cell = self.find(addr, 8, false).and(self.find(addr, 8, true))?;
        let old = u64::from_le_bytes(std::array::from_fn(|i| cell[i].load(Ordering::Relaxed)));
        for (c, b) in cell.iter().zip(old.wrapping_add(value).to_le_bytes()) {
            c.store(b, Ordering::Relaxed);
        }
        Ok(old)
    }

    fn atomic_add_u32(&self, addr: u64, value: u32) -> Result<u32, Fault> {
        let _g = self.atomics.lock().unwrap();
        let cell = self.find(addr, 4, false).and(self.find(addr, 4, true))?;
        let old = u32::from_le_bytes(std::array::from_fn(|i| cell[i].load(Ordering::Relaxed)));
        for (c, b) in cell.iter().zip(old.wrapping_add(value).to_le_bytes()) {
            c.store(b, Ordering::Relaxed);
        }
        Ok(old)
    }

    fn atomic_cas_u64(&self, addr: u64, expected: u64, new: u64) -> Result<u64, Fault> {
        let _g = self.atomics.lock().unwrap();
        let cell = self.find(addr, 8, false).and(self.find(addr, 8, true))?;
        let old = u64::from_le_bytes(std::array::from_fn(|i| cell[i].load(Ordering::Relaxed)));
        if old == expected {
            for (c, b) in cell.iter().zip(new.to_le_bytes()) {
                c.store(b, Ordering::Relaxed);
            }
        }
        Ok(old)
    }

    fn atomic_cas_u32(&self, addr: u64, expected: u32, new: u32) -> Result<u32, Fault> {
        let _g = self.atomics.lock().unwrap();
        let cell = self.find(addr, 4, false).and(self.find(addr, 4, true))?;
        let old = u32::from_le_bytes(std::array::from_fn(|i| cell[i].load(Ordering::Relaxed)));
        if old == expected {
            for (c, b) in cell.iter().zip(new.to_le_bytes()) {
                c.store(b, Ordering::Relaxed);
            }
        }
        Ok(old)
    }

    fn global_timer_ns(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }
}

// ---------------------------------------------------------------------------------------
// Modules, geometry, inputs
// ---------------------------------------------------------------------------------------

fn copy_module() -> &'static Module {
    static M: OnceLock<Module> = OnceLock::new();
    M.get_or_init(|| Module::parse(COPY_PTX).expect("copy.ptx parses"))
}

fn validity_module() -> &'static Module {
    static M: OnceLock<Module> = OnceLock::new();
    M.get_or_init(|| Module::parse(VALIDITY_PTX).expect("validity.ptx parses"))
}

fn testing_module() -> &'static Module {
    static M: OnceLock<Module> = OnceLock::new();
    M.get_or_init(|| Module::parse(TESTING_PTX).expect("testing.ptx parses"))
}

/// Multiprocessors of the emulated device the standard geometry is computed for.
const SMS: u64 = 4;

#[derive(Debug, Clone, Copy)]
struct Geo {
    grid: u32,
    block: u32,
}

/// The warps of the standard geometry's largest grid (`Kernels::batched_copy_warps`).
const STANDARD_WARPS: u64 = 8 * SMS * (BLOCK_SIZE as u64 / 32);

/// The launch geometry of `Kernels::config` (crates/cuda/src/kernels/cache.rs).
fn standard(items: u64) -> Geo {
    Geo {
        grid: items.div_ceil(BLOCK_SIZE as u64).clamp(1, 8 * SMS) as u32,
        block: BLOCK_SIZE,
    }
}

/// The standard geometry and one other valid one: a single block, an odd-sized grid,
/// blocks of 32 or of 1024 threads, or any multiple of 32 threads and a random grid.
fn geometries(items: u64, rng: &mut SplitMix64) -> [Geo; 2] {
    let alt = match rng.below(6) {
        0 => Geo {
            grid: 1,
            block: 256,
        },
        1 => Geo {
            grid: [3, 5, 7][rng.below(3) as usize],
            block: 256,
        },
        2 => Geo {
            grid: items.div_ceil(32).clamp(1, 8 * SMS) as u32,
            block: 32,
        },
        3 => Geo {
            grid: items.div_ceil(1024).clamp(1, 8 * SMS) as u32,
            block: 1024,
        },
        _ => {
            let block = 32 * (1 + rng.below(32) as u32);
            Geo {
                grid: items.div_ceil(block as u64).clamp(1, 1 + rng.below(40)) as u32,
                block,
            }
        }
    };
    [standard(items), alt]
}

fn run(
    m: &Module,
    name: &str,
    geo: Geo,
    params: &[Vec<u8>],
    mem: &TestMem,
) -> Result<(), ExecError> {
    let dims = Dims {
        grid: [geo.grid, 1, 1],
        block: [geo.block, 1, 1],
        shared_bytes: 0,
    };
    m.launch(name, dims, params, mem)
}

fn p64(v: u64) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}

fn p32(v: u32) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}

/// Lengths: every one up to 70, and around multiples of 8, 32, 128 and the block size.
fn lengths() -> Vec<u64> {
    let mut v: Vec<u64> = (1..=70).collect();
    v.extend([
        95, 96, 97, 127, 128, 129, 255, 256, 257, 511, 512, 513, 1000, 1023, 1024, 1025, 2047,
        2049, 4095, 4096, 4097, 8191, 8200, 10_001, 32_767, 32_768, 32_769, 65_541, 100_003,
    ]);
    v
}

// ---------------------------------------------------------------------------------------
// Validity kernels
// ---------------------------------------------------------------------------------------

/// Maps the bytes `[offset/8, ceil((offset+len)/8))` of `bitmap` (based at `addr`):
/// exactly the bytes the kernels may read.
fn map_bits(mem: &mut TestMem, bitmap: &[u8], addr: u64, offset: u64, len: u64) {
    let first = offset / 8;
    let end = (offset + len).div_ceil(8);
    mem.map(
        addr + first,
        &bitmap[first as usize..end as usize],
        Access::Read,
    );
}

fn count_set_bits(bitmap: &[u8], align: u64, offset: u64, len: u64, geo: Geo) -> u64 {
    let mut mem = TestMem::new();
    let addr = SRC + align;
    map_bits(&mut mem, bitmap, addr, offset, len);
    mem.map(OUT, &[0; 8], Access::ReadWrite);
    let params = [p64(addr), p64(offset), p64(len), p64(OUT)];
    run(validity_module(), "dvx_count_set_bits", geo, &params, &mem)
        .unwrap_or_else(|e| panic!("len {len} offset {offset} align {align} {geo:?}: {e}"));
    u64::from_le_bytes(mem.bytes(OUT, 8).try_into().unwrap())
}

fn check_count(rng: &mut SplitMix64, len: u64, offset: u64, align: u64, geo: Geo) {
    let bitmap = rng.bitmap((offset + len).div_ceil(8) as usize);
    let expected = naive::count_set_bits(&bitmap, offset as usize, len as usize);
    let got = count_set_bits(&bitmap, align, offset, len, geo);
    assert_eq!(
        got, expected,
        "len {len} offset {offset} align {align} {geo:?}"
    );
}

#[test]
fn count_set_bits_matches_naive() {
    let mut rng = SplitMix64(11);
    for len in lengths() {
        let items = len.div_ceil(128) + 1;
        for geo in geometries(items, &mut rng) {
            let offset = rng.below(300);
            let align = rng.below(16);
            check_count(&mut rng, len, offset, align, geo);
        }
    }
    for align in 0..16 {
        for offset in 0..20 {
            for len in [1, 7, 8, 9, 120, 121, 128, 129, 300] {
                check_count(
                    &mut rng,
                    len,
                    offset,
                    align,
                    standard(len.div_ceil(128) + 1),
                );
            }
        }
    }
    // grid-stride loops of the standard geometry (more chunks than threads)
    let len = (8 * SMS * 256 * 128) * 2 + 77;
    check_count(&mut rng, len, 5, 3, standard(len.div_ceil(128) + 1));
}

/// Runs a validity kernel with parameters `(src, offset, len, dst)` that reads bits
/// `[offset, offset + len)` of `src` and writes exactly `expected.len()` bytes at `dst`.
#[allow(clippy::too_many_arguments)]
fn check_from_bitmap(
    kernel: &str,
    src: &[u8],
    expected: &[u8],
    len: u64,
    offset: u64,
    sa: u64,
    da: u64,
    geo: Geo,
) {
    let mut mem = TestMem::new();
    map_bits(&mut mem, src, SRC + sa, offset, len);
    let out = expected.len() as u64;
    mem.map_dst(DST + da, out);
    let params = [p64(SRC + sa), p64(offset), p64(len), p64(DST + da)];
    let ctx = format!("{kernel}: len {len} offset {offset} sa {sa} da {da} {geo:?}");
    run(validity_module(), kernel, geo, &params, &mem).unwrap_or_else(|e| panic!("{ctx}: {e}"));
    let (got, guards) = mem.dst(DST + da, out);
    assert_eq!(got, expected, "{ctx}");
    assert!(guards, "{ctx}: wrote outside the destination");
}

fn check_copy_bitmap(rng: &mut SplitMix64, len: u64, offset: u64, sa: u64, da: u64, geo: Geo) {
    let src = rng.bitmap((offset + len).div_ceil(8) as usize);
    let expected = naive::copy_bitmap(&src, offset as usize, len as usize);
    check_from_bitmap("dvx_copy_bitmap", &src, &expected, len, offset, sa, da, geo);
}

#[test]
fn copy_bitmap_matches_naive() {
    let mut rng = SplitMix64(12);
    for len in lengths() {
        let items = len.div_ceil(8).div_ceil(16);
        for geo in geometries(items, &mut rng) {
            let offset = rng.below(300);
            let sa = rng.below(16);
            let da = [0, 0, 4, 1, 8, 15][rng.below(6) as usize];
            check_copy_bitmap(&mut rng, len, offset, sa, da, geo);
        }
    }
    for sa in 0..16 {
        for offset in 0..20 {
            for len in [1, 5, 8, 31, 33, 127, 129, 300, 1025] {
                let da = [0, 16, 3][((sa + offset) % 3) as usize];
                check_copy_bitmap(&mut rng, len, offset, sa, da, standard(len.div_ceil(128)));
            }
        }
    }
    let len = 8 * SMS * 256 * 128 * 2 + 13;
    check_copy_bitmap(&mut rng, len, 3, 5, 0, standard(len.div_ceil(128)));
}

fn check_unpack(rng: &mut SplitMix64, len: u64, offset: u64, sa: u64, da: u64, geo: Geo) {
    let src = rng.bitmap((offset + len).div_ceil(8) as usize);
    let expected = naive::unpack_bits(&src, offset as usize, len as usize);
    check_from_bitmap("dvx_unpack_bits", &src, &expected, len, offset, sa, da, geo);
}

#[test]
fn unpack_bits_matches_naive() {
    let mut rng = SplitMix64(13);
    for len in lengths() {
        for geo in geometries(len.div_ceil(32), &mut rng) {
            let offset = rng.below(300);
            let sa = rng.below(16);
            let da = [0, 0, 8, 3, 16, 1][rng.below(6) as usize];
            check_unpack(&mut rng, len, offset, sa, da, geo);
        }
    }
    for sa in 0..8 {
        for offset in 0..40 {
            for len in [1, 4, 31, 32, 33, 64, 65, 300] {
                let da = [0, 16, 5][((sa + offset) % 3) as usize];
                check_unpack(&mut rng, len, offset, sa, da, standard(len.div_ceil(32)));
            }
        }
    }
    let len = 8 * SMS * 256 * 32 * 2 + 45;
    check_unpack(&mut rng, len, 7, 2, 0, standard(len.div_ceil(32)));
}

fn bools(rng: &mut SplitMix64, len: usize) -> Vec<u8> {
    match rng.below(3) {
        0 => rng.bytes(len),
        1 => (0..len).map(|_| rng.below(2) as u8).collect(),
        _ => (0..len)
            .map(|_| [0u8, 1, 0x80, 0x10, 0x02, 0x40][rng.below(6) as usize])
            .collect(),
    }
}

fn check_pack(rng: &mut SplitMix64, len: u64, sa: u64, da: u64, geo: Geo) {
    let src = bools(rng, len as usize);
    let expected = naive::pack_bools(&src);
    let mut mem = TestMem::new();
    mem.map(SRC + sa, &src, Access::Read);
    let out = expected.len() as u64;
    mem.map_dst(DST + da, out);
    let params = [p64(SRC + sa), p64(len), p64(DST + da)];
    let ctx = format!("len {len} sa {sa} da {da} {geo:?}");
    run(validity_module(), "dvx_pack_bools", geo, &params, &mem)
        .unwrap_or_else(|e| panic!("{ctx}: {e}"));
    let (got, guards) = mem.dst(DST + da, out);
    assert_eq!(got, expected, "{ctx}");
    assert!(guards, "{ctx}: wrote outside the destination");
}

#[test]
fn pack_bools_matches_naive() {
    let mut rng = SplitMix64(14);
    for len in lengths() {
        for geo in geometries(len.div_ceil(32), &mut rng) {
            let (sa, da) =
                [(0, 0), (0, 2), (5, 0), (16, 4), (3, 1), (8, 12)][rng.below(6) as usize];
            check_pack(&mut rng, len, sa, da, geo);
        }
    }
    for sa in 0..16 {
        for da in 0..8 {
            for len in [1, 31, 32, 33, 64, 100] {
                check_pack(&mut rng, len, sa, da, standard(len.div_ceil(32)));
            }
        }
    }
    let len = 8 * SMS * 256 * 32 * 2 + 5;
    check_pack(&mut rng, len, 0, 0, standard(len.div_ceil(32)));
}

// ---------------------------------------------------------------------------------------
// Copy kernels
// ---------------------------------------------------------------------------------------

/// How [`check_batched`] cuts the segments into descriptors.
#[derive(Debug, Clone, Copy)]
enum Pieces {
    /// `plan_pieces` for the warps of the standard geometry (as `batched_copy` does).
    Planned,
    /// Pieces of at most this many bytes (any size: the kernel takes any descriptor).
    Max(u64),
}

/// One batched-copy launch over segments of the given (length, source alignment,
/// destination alignment), each in its own source and destination window.
fn check_batched(rng: &mut SplitMix64, segs: &[(u64, u64, u64)], alt_geo: bool) {
    check_batched_pieces(rng, segs, alt_geo, Pieces::Planned)
}

fn check_batched_pieces(
    rng: &mut SplitMix64,
    segs: &[(u64, u64, u64)],
    alt_geo: bool,
    cut: Pieces,
) {
    let mut mem = TestMem::new();
    let mut srcs = Vec::new();
    let mut descs = Vec::new();
    for (i, &(len, sa, da)) in segs.iter().enumerate() {
        let src = rng.bytes(len as usize);
        let s = SRC + (i as u64) * 0x10_0000 + sa;
        let d = DST + (i as u64) * 0x10_0000 + da;
        if len > 0 {
            mem.map(s, &src, Access::Read);
        }
        mem.map_dst(d, len);
        srcs.push(src);
        descs.push(CopySegment {
            src: s,
            dst: d,
            len,
        });
    }
    let pieces = match cut {
        Pieces::Planned => plan_pieces(&descs, STANDARD_WARPS),
        Pieces::Max(max) => split_segments(&descs, max),
    };
    if pieces.is_empty() {
        return;
    }
    let table: Vec<u8> = pieces
        .iter()
        .flat_map(|p| [p.src, p.dst, p.len])
        .flat_map(|v| v.to_le_bytes())
        .collect();
    mem.map(TABLE, &table, Access::Read);
    let n = pieces.len() as u64;
    let geo = if alt_geo {
        geometries(32 * n, rng)[1]
    } else {
        standard(32 * n)
    };
    let ctx = format!("{} segments {cut:?} {geo:?}", segs.len());
    run(
        copy_module(),
        "dvx_batched_copy",
        geo,
        &[p64(TABLE), p64(n)],
        &mem,
    )
    .unwrap_or_else(|e| panic!("{ctx}: {e}"));
    for (src, (seg, &(len, sa, da))) in srcs.iter().zip(descs.iter().zip(segs)) {
        let (got, guards) = mem.dst(seg.dst, len);
        assert!(
            got == *src,
            "{ctx}: segment len {len} sa {sa} da {da} differs"
        );
        assert!(
            guards,
            "{ctx}: segment len {len} sa {sa} da {da}: wrote outside"
        );
    }
}

#[test]
fn batched_copy_matches_memcpy() {
    let mut rng = SplitMix64(15);
    let mut lens: Vec<u64> = (0..=70).collect();
    lens.extend([
        127, 128, 129, 255, 256, 257, 1000, 4095, 4097, 16_383, 16_384, 16_385, 40_001,
    ]);
    // all lengths in one launch (warps striding over descriptors), random alignments
    for round in 0..6 {
        let segs: Vec<(u64, u64, u64)> = lens
            .iter()
            .map(|&l| (l, rng.below(32), rng.below(32)))
            .collect();
        check_batched(&mut rng, &segs, round % 2 == 1);
    }
    // every alignment pair (all word offsets and shifts of a shifted source), lengths
    // without a body, with partial rounds, and with full rounds and more
    for sa in 0..16 {
        for da in 0..16 {
            let segs: Vec<(u64, u64, u64)> = [1, 15, 16, 17, 47, 100, 2100, 4133]
                .iter()
                .map(|&l| (l, sa, da))
                .collect();
            check_batched(&mut rng, &segs, (sa + da) % 3 == 0);
        }
    }
    // descriptors of any size, not only planned ones: pieces that are not multiples of
    // 16 change the alignments from one piece to the next
    for max in [1000, 2048, 1984 * 3 + 5, 9999] {
        let segs: Vec<(u64, u64, u64)> = [1, 100, 4133, 20_000, 40_001]
            .iter()
            .map(|&l| (l, rng.below(16), rng.below(16)))
            .collect();
        check_batched_pieces(&mut rng, &segs, max % 2 == 1, Pieces::Max(max));
    }
    // many descriptors: more warps than the grid has
    let segs: Vec<(u64, u64, u64)> = (0..300)
        .map(|i| (i % 50 + 1, rng.below(16), rng.below(16)))
        .collect();
    check_batched(&mut rng, &segs, false);
}

fn check_rebase<const W: usize>(
    rng: &mut SplitMix64,
    n: u64,
    sa: u64,
    da: u64,
    in_place: bool,
    geo: Geo,
) {
    let bytes = n * W as u64;
    let src = rng.bytes(bytes as usize);
    let base = rng.next_u64();
    let expected: Vec<u8> = if W == 4 {
        let v: Vec<i32> = src
            .chunks(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        naive::rebase_offsets_i32(&v, base as i32)
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect()
    } else {
        let v: Vec<i64> = src
            .chunks(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        naive::rebase_offsets_i64(&v, base as i64)
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect()
    };
    let mut mem = TestMem::new();
    let (s, d) = if in_place {
        mem.map(
            DST + da - GUARD,
            &[GUARD_BYTE; GUARD as usize],
            Access::Write,
        );
        mem.map(DST + da, &src, Access::ReadWrite);
        mem.map(
            DST + da + bytes,
            &[GUARD_BYTE; GUARD as usize],
            Access::Write,
        );
        (DST + da, DST + da)
    } else {
        mem.map(SRC + sa, &src, Access::Read);
        mem.map_dst(DST + da, bytes);
        (SRC + sa, DST + da)
    };
    let (name, pbase) = if W == 4 {
        ("dvx_rebase_offsets_i32", p32(base as u32))
    } else {
        ("dvx_rebase_offsets_i64", p64(base))
    };
    let ctx = format!("{name} n {n} sa {sa} da {da} in_place {in_place} {geo:?}");
    run(
        copy_module(),
        name,
        geo,
        &[p64(s), p64(n), pbase, p64(d)],
        &mem,
    )
    .unwrap_or_else(|e| panic!("{ctx}: {e}"));
    let (got, guards) = mem.dst(d, bytes);
    assert!(got == expected, "{ctx}: differs");
    assert!(guards, "{ctx}: wrote outside the destination");
}

#[test]
fn rebase_offsets_match_naive() {
    let mut rng = SplitMix64(16);
    for n in lengths().into_iter().filter(|&n| n < 40_000) {
        for geo in geometries(n.div_ceil(4), &mut rng) {
            let (sa, da) = [
                (0, 0),
                (4, 4),
                (8, 8),
                (12, 12),
                (12, 0),
                (4, 8),
                (0, 12),
                (8, 4),
            ][rng.below(8) as usize];
            let in_place = rng.below(4) == 0 && sa == da;
            check_rebase::<4>(&mut rng, n, sa, da, in_place, geo);
        }
        for geo in geometries(n.div_ceil(2), &mut rng) {
            let (sa, da) = [(0, 0), (8, 8), (8, 0), (0, 8)][rng.below(4) as usize];
            let in_place = rng.below(4) == 0 && sa == da;
            check_rebase::<8>(&mut rng, n, sa, da, in_place, geo);
        }
    }
    for sa in [0, 4, 8, 12] {
        for da in [0, 4, 8, 12] {
            for n in [1, 2, 3, 4, 5, 7, 8, 9, 33, 100] {
                check_rebase::<4>(&mut rng, n, sa, da, false, standard(n.div_ceil(4)));
                check_rebase::<4>(&mut rng, n, sa, da, true, standard(n.div_ceil(4)));
                let (sa8, da8) = (sa & 8, da & 8);
                check_rebase::<8>(&mut rng, n, sa8, da8, false, standard(n.div_ceil(2)));
            }
        }
    }
    let n = 8 * SMS * 256 * 4 * 2 + 3;
    check_rebase::<4>(&mut rng, n, 4, 4, false, standard(n.div_ceil(4)));
    check_rebase::<4>(&mut rng, n, 4, 8, false, standard(n.div_ceil(4)));
    check_rebase::<8>(&mut rng, n, 8, 8, true, standard(n.div_ceil(2)));
    check_rebase::<8>(&mut rng, n, 0, 8, false, standard(n.div_ceil(2)));
}

// ---------------------------------------------------------------------------------------
// Testing kernel
// ---------------------------------------------------------------------------------------

#[test]
fn spin_fill_u32_spins_then_fills() {
    let mut rng = SplitMix64(17);
    for (n, geo) in [
        (
            0u64,
            Geo {
                grid: 1,
                block: 256,
            },
        ),
        (
            1,
            Geo {
                grid: 1,
                block: 256,
            },
        ),
        (
            255,
            Geo {
                grid: 1,
                block: 256,
            },
        ),
        (
            257,
            Geo {
                grid: 1,
                block: 256,
            },
        ),
        (
            1000,
            Geo {
                grid: 1,
                block: 256,
            },
        ),
        (5000, Geo { grid: 3, block: 32 }),
        (
            70,
            Geo {
                grid: 2,
                block: 1024,
            },
        ),
    ] {
        let value = rng.next_u64() as u32 | 0xFFFF_0000;
        let spin_ns = 200_000;
        let mut mem = TestMem::new();
        mem.map_dst(DST, 4 * n);
        let t0 = mem.global_timer_ns();
        let params = [p64(DST), p64(n), p32(value), p64(spin_ns)];
        run(testing_module(), "dvx_spin_fill_u32", geo, &params, &mem).unwrap();
        assert!(mem.global_timer_ns() - t0 >= spin_ns, "did not spin");
        let expected: Vec<u8> = (0..n)
            .flat_map(|i| value.wrapping_add(i as u32).to_le_bytes())
            .collect();
        let (got, guards) = mem.dst(DST, 4 * n);
        assert!(got == expected, "n {n} {geo:?}");
        assert!(guards);
    }
}

/// Where the gate kernel's flag lives in the test memory.
const GATE: u64 = 0x1004_0000_0000;

#[test]
fn gate_fill_u32_waits_for_its_flag_then_fills() {
    for (n, geo) in [
        (
            0u64,
            Geo {
                grid: 1,
                block: 256,
            },
        ),
        (
            1000,
            Geo {
                grid: 1,
                block: 256,
            },
        ),
        (5000, Geo { grid: 3, block: 32 }),
    ] {
        let mut mem = TestMem::new();
        mem.map(GATE, &[0; 4], Access::ReadWrite);
        mem.map_dst(DST, 4 * n);
        let params = [p64(GATE), p64(DST), p64(n), p32(11)];
        std::thread::scope(|s| {
            let opener = s.spawn(|| {
                std::thread::sleep(std::time::Duration::from_millis(100));
                // Nothing written while the flag is 0, however long it stays so.
                let (before, _) = mem.dst(DST, 4 * n);
                assert!(
                    before.iter().all(|&b| b == 0x5A),
                    "filled before the gate opened"
                );
                let at = Instant::now();
                mem.store(GATE, &1u32.to_le_bytes()).unwrap();
                at
            });
            run(testing_module(), "dvx_gate_fill_u32", geo, &params, &mem).unwrap();
            let ended = Instant::now();
            let opened = opener.join().unwrap();
            assert!(ended >= opened, "the kernel ended before its gate opened");
        });
        let expected: Vec<u8> = (0..n).flat_map(|i| (11 + i as u32).to_le_bytes()).collect();
        let (got, guards) = mem.dst(DST, 4 * n);
        assert!(got == expected, "n {n} {geo:?}");
        assert!(guards);
    }
}

// ---------------------------------------------------------------------------------------
// Interpreter semantics
// ---------------------------------------------------------------------------------------

/// Runs a kernel `k(u64 out)` of `body` (one thread unless `block` says otherwise) and
/// returns `words` u64s of `out`.
fn run_snippet(decls: &str, body: &str, block: u32, words: usize) -> Vec<u64> {
    let src = format!(
        ".version 7.0\n.target sm_70\n.address_size 64\n{decls}\n.visible .entry k(.param .u64 p_out)\n{{\n\
         .reg .pred %p<8>;\n.reg .b32 %r<64>;\n.reg .b64 %rd<64>;\n\
         ld.param.u64 %rd0, [p_out];\n{body}\nret;\n}}\n"
    );
    let m = Module::parse(&src).unwrap_or_else(|e| panic!("{e}\n{src}"));
    let mut mem = TestMem::new();
    mem.map(OUT, &vec![0; words * 8], Access::ReadWrite);
    let dims = Dims {
        grid: [1, 1, 1],
        block: [block, 1, 1],
        shared_bytes: 0,
    };
    m.launch("k", dims, &[p64(OUT)], &mem)
        .unwrap_or_else(|e| panic!("{e}"));
    mem.bytes(OUT, words as u64 * 8)
        .chunks(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

#[test]
fn integer_semantics_follow_the_ptx_isa() {
    // (instructions computing %rd1, expected %rd1)
    let cases: &[(&str, u64)] = &[
        ("mov.u32 %r1, 1; mov.u32 %r2, 32; shl.b32 %r3, %r1, %r2; cvt.u64.u32 %rd1, %r3;", 0),
        ("mov.u32 %r1, 3; shl.b32 %r3, %r1, 31; cvt.u64.u32 %rd1, %r3;", 0x8000_0000),
        ("mov.u32 %r1, 0x80000000; mov.u32 %r2, 32; shr.u32 %r3, %r1, %r2; cvt.u64.u32 %rd1, %r3;", 0),
        ("mov.u32 %r1, 0x80000000; mov.u32 %r2, 40; shr.s32 %r3, %r1, %r2; cvt.u64.u32 %rd1, %r3;", 0xFFFF_FFFF),
        ("mov.u32 %r1, 0x80000010; shr.s32 %r3, %r1, 4; cvt.u64.u32 %rd1, %r3;", 0xF800_0001),
        ("mov.u32 %r1, 0x80000010; shr.b32 %r3, %r1, 4; cvt.u64.u32 %rd1, %r3;", 0x0800_0001),
        ("mov.u64 %rd2, -1; mov.u32 %r2, 64; shr.u64 %rd1, %rd2, %r2;", 0),
        ("mov.u64 %rd2, -1; shl.b64 %rd1, %rd2, 70;", 0),
        ("mov.u64 %rd2, 0x8000000000000000; shr.s64 %rd1, %rd2, 100;", u64::MAX),
        ("mov.u64 %rd2, -16; shr.u64 %rd1, %rd2, 60;", 0xF),
        ("mov.u32 %r1, -1; mul.wide.u32 %rd1, %r1, %r1;", 0xFFFF_FFFE_0000_0001),
        ("mov.u32 %r1, -2; mov.u32 %r2, 3; mul.wide.s32 %rd1, %r1, %r2;", (-6i64) as u64),
        ("mov.u32 %r1, 0x10000; mul.lo.u32 %r3, %r1, %r1; cvt.u64.u32 %rd1, %r3;", 0),
        ("mov.u32 %r1, 0x10001; mul.hi.u32 %r3, %r1, %r1; cvt.u64.u32 %rd1, %r3;", 1),
        ("mov.u64 %rd2, 24; mul.lo.u64 %rd1, %rd2, -1;", (-24i64) as u64),
        ("mov.u32 %r1, 0xF0F0F0F0; bfe.u32 %r3, %r1, 4, 8; cvt.u64.u32 %rd1, %r3;", 0x0F),
        ("mov.u32 %r1, 0xF0F0F0F0; bfe.u32 %r3, %r1, 4, 0; cvt.u64.u32 %rd1, %r3;", 0),
        ("mov.u32 %r1, 0xF0F0F0F0; bfe.u32 %r3, %r1, 28, 8; cvt.u64.u32 %rd1, %r3;", 0xF),
        ("mov.u32 %r1, 0x00000F00; bfe.s32 %r3, %r1, 8, 4; cvt.u64.u32 %rd1, %r3;", 0xFFFF_FFFF),
        ("mov.u32 %r1, 0x80000000; bfe.s32 %r3, %r1, 28, 10; cvt.u64.u32 %rd1, %r3;", 0xFFFF_FFF8),
        ("mov.u32 %r1, 0x12345678; mov.u32 %r2, 0x9ABCDEF0; shf.r.clamp.b32 %r3, %r1, %r2, 8; cvt.u64.u32 %rd1, %r3;", 0xF012_3456),
        ("mov.u32 %r1, 0x12345678; mov.u32 %r2, 0x9ABCDEF0; shf.r.clamp.b32 %r3, %r1, %r2, 0; cvt.u64.u32 %rd1, %r3;", 0x1234_5678),
        ("mov.u32 %r1, 0x12345678; mov.u32 %r2, 0x9ABCDEF0; shf.r.clamp.b32 %r3, %r1, %r2, 32; cvt.u64.u32 %rd1, %r3;", 0x9ABC_DEF0),
        ("mov.u32 %r1, 0x12345678; mov.u32 %r2, 0x9ABCDEF0; shf.r.clamp.b32 %r3, %r1, %r2, 99; cvt.u64.u32 %rd1, %r3;", 0x9ABC_DEF0),
        ("mov.u32 %r1, 0x12345678; mov.u32 %r2, 0x9ABCDEF0; shf.r.wrap.b32 %r3, %r1, %r2, 40; cvt.u64.u32 %rd1, %r3;", 0xF012_3456),
        ("mov.u32 %r1, 0x12345678; mov.u32 %r2, 0x9ABCDEF0; shf.l.clamp.b32 %r3, %r1, %r2, 8; cvt.u64.u32 %rd1, %r3;", 0xBCDE_F012),
        ("mov.u32 %r1, 0x12345678; mov.u32 %r2, 0x9ABCDEF0; shf.l.clamp.b32 %r3, %r1, %r2, 33; cvt.u64.u32 %rd1, %r3;", 0x1234_5678),
        ("mov.u32 %r1, 0xF000000F; popc.b32 %r3, %r1; cvt.u64.u32 %rd1, %r3;", 8),
        ("mov.u64 %rd2, -1; popc.b64 %r3, %rd2; cvt.u64.u32 %rd1, %r3;", 64),
        ("mov.u32 %r1, 0x00010000; clz.b32 %r3, %r1; cvt.u64.u32 %rd1, %r3;", 15),
        ("mov.u32 %r1, 1; brev.b32 %r3, %r1; cvt.u64.u32 %rd1, %r3;", 0x8000_0000),
        ("mov.u32 %r1, -1; cvt.u64.u32 %rd1, %r1;", 0xFFFF_FFFF),
        ("mov.u32 %r1, -1; cvt.s64.s32 %rd1, %r1;", u64::MAX),
        ("mov.u32 %r1, 0x80; cvt.s32.s8 %r3, %r1; cvt.u64.u32 %rd1, %r3;", 0xFFFF_FF80),
        ("mov.u64 %rd2, 0x123456789; cvt.u32.u64 %r3, %rd2; cvt.u64.u32 %rd1, %r3;", 0x2345_6789),
        ("mov.u32 %r1, -5; mov.u32 %r2, 3; min.s32 %r3, %r1, %r2; cvt.s64.s32 %rd1, %r3;", (-5i64) as u64),
        ("mov.u32 %r1, -5; mov.u32 %r2, 3; min.u32 %r3, %r1, %r2; cvt.u64.u32 %rd1, %r3;", 3),
        ("mov.u64 %rd2, -5; max.s64 %rd1, %rd2, 0;", 0),
        ("mov.u64 %rd2, 40; min.s64 %rd1, %rd2, 32;", 32),
        ("mov.u64 %rd2, 7; neg.s64 %rd1, %rd2;", (-7i64) as u64),
        ("mov.u32 %r1, 0xF0; not.b32 %r3, %r1; cvt.u64.u32 %rd1, %r3;", 0xFFFF_FF0F),
        ("mov.u64 %rd2, 0x1234567; and.b64 %rd1, %rd2, -16;", 0x1234560),
        ("mov.u32 %r1, 7; or.b32 %r3, %r1, -16; cvt.u64.u32 %rd1, %r3;", 0xFFFF_FFF7),
        ("mov.u32 %r1, -1; mov.u32 %r2, 1; setp.lt.s32 %p1, %r1, %r2; selp.b32 %r3, 10, 20, %p1; cvt.u64.u32 %rd1, %r3;", 10),
        ("mov.u32 %r1, -1; mov.u32 %r2, 1; setp.lt.u32 %p1, %r1, %r2; selp.b32 %r3, 10, 20, %p1; cvt.u64.u32 %rd1, %r3;", 20),
        ("mov.u64 %rd2, 5; setp.ge.u64 %p1, %rd2, 5; setp.ne.u64 %p2, %rd2, 5; or.pred %p3, %p1, %p2; and.pred %p4, %p1, %p2; selp.b64 %rd3, 1, 0, %p3; selp.b64 %rd4, 2, 0, %p4; add.u64 %rd1, %rd3, %rd4;", 1),
        ("mov.u32 %r1, 3; setp.eq.u32 %p3, %r1, %r1; setp.gt.and.u32 %p1|%p2, %r1, 2, %p3; selp.b64 %rd3, 1, 0, %p1; selp.b64 %rd4, 2, 0, %p2; add.u64 %rd1, %rd3, %rd4;", 1),
        ("mov.u32 %r1, 0x11111111; mov.u32 %r2, 0x22222222; mov.b64 %rd1, {%r1, %r2};", 0x2222_2222_1111_1111),
        ("mov.u64 %rd2, 0x2222222211111111; mov.b64 {%r1, %r2}, %rd2; sub.u32 %r3, %r2, %r1; cvt.u64.u32 %rd1, %r3;", 0x1111_1111),
        ("mov.u32 %r1, -7; mov.u32 %r2, 2; div.s32 %r3, %r1, %r2; cvt.s64.s32 %rd1, %r3;", (-3i64) as u64),
        ("mov.u32 %r1, -7; mov.u32 %r2, 2; rem.s32 %r3, %r1, %r2; cvt.s64.s32 %rd1, %r3;", (-1i64) as u64),
        ("mov.u64 %rd2, 100; div.u64 %rd1, %rd2, 7;", 14),
        ("mov.u32 %r1, 6; mov.u32 %r2, 7; mad.lo.u32 %r3, %r1, %r2, 0x100; cvt.u64.u32 %rd1, %r3;", 0x12A),
        ("mov.u32 %r1, 0xAB; mov.u32 %r2, 0xFFFF0000; bfi.b32 %r3, %r1, %r2, 4, 8; cvt.u64.u32 %rd1, %r3;", 0xFFFF_0AB0),
        ("mov.u32 %r1, 0x00204081; mov.u32 %r2, 0xB; mul.lo.u32 %r3, %r2, %r1; and.b32 %r3, %r3, 0x01010101; cvt.u64.u32 %rd1, %r3;", 0x0100_0101),
        ("mov.u64 %rd2, 010; add.u64 %rd1, %rd2, 0x10;", 24),
        ("mov.u32 %r1, %tid.x; mov.u32 %r2, %ntid.x; mov.u32 %r3, %nctaid.x; add.u32 %r4, %r2, %r3; add.u32 %r4, %r4, %r1; cvt.u64.u32 %rd1, %r4;", 2),
    ];
    let body: String = cases
        .iter()
        .enumerate()
        .map(|(i, (code, _))| format!("{code}\nst.global.u64 [%rd0+{}], %rd1;\n", 8 * i))
        .collect();
    let got = run_snippet("", &body, 1, cases.len());
    for (i, ((code, expected), got)) in cases.iter().zip(got).enumerate() {
        assert_eq!(
            got, *expected,
            "case {i}: `{code}` gave {got:#x}, expected {expected:#x}"
        );
    }
}

#[test]
fn sign_extending_loads_and_calls() {
    let decls = ".func (.param .b64 r) f(.param .b64 a, .param .b32 b)\n{\n.reg .b64 %x<4>;\n.reg .b32 %y<2>;\n\
                 ld.param.u64 %x1, [a];\nld.param.u32 %y1, [b];\ncvt.u64.u32 %x2, %y1;\nadd.u64 %x3, %x1, %x2;\n\
                 st.param.b64 [r], %x3;\nret;\n}";
    let body = "mov.u32 %r1, 0xFF; st.global.u8 [%rd0], %r1; ld.global.s8 %r2, [%rd0]; cvt.s64.s32 %rd1, %r2;\n\
                st.global.u64 [%rd0], %rd1;\n\
                ld.global.u16 %r3, [%rd0+2]; cvt.u64.u32 %rd2, %r3; st.global.u64 [%rd0+8], %rd2;\n\
                ld.global.s32 %rd5, [%rd0+4]; st.global.u32 [%rd0+24], %rd5; ld.global.u32 %rd6, [%rd0+4];\n\
                sub.u64 %rd5, %rd5, %rd6; st.global.u64 [%rd0+32], %rd5;\n\
                { .param .b64 pa; .param .b32 pb; .param .b64 pr;\n\
                  mov.u64 %rd3, 1000; st.param.b64 [pa], %rd3; st.param.b32 [pb], 7;\n\
                  call (pr), f, (pa, pb); ld.param.b64 %rd4, [pr]; }\n\
                st.global.u64 [%rd0+16], %rd4;";
    let got = run_snippet(decls, body, 1, 5);
    // ld.s32 into a 64-bit register sign-extends, ld.u32 zero-extends; st.u32 of a
    // 64-bit register stores its low half
    assert_eq!(
        got,
        vec![u64::MAX, 0xFFFF, 1007, 0xFFFF_FFFF, 0xFFFF_FFFF_0000_0000]
    );
}

/// CUDA's `__shfl_*_sync(var, x, width)` definitions, to check the interpreter's
/// PTX-level `shfl.sync` (which follows the ISA's pseudocode) against.
fn cuda_shfl(mode: &str, vals: &[u32; 32], lane: usize, x: usize, width: usize) -> u32 {
    let seg = lane / width * width;
    let src = match mode {
        "down" if lane + x < seg + width => lane + x,
        "up" if lane >= seg + x => lane - x,
        "bfly" if (lane ^ x) < seg + width => lane ^ x,
        "idx" => seg + x % width,
        _ => lane,
    };
    vals[src]
}

#[test]
fn shfl_sync_modes_match_cuda() {
    for width in [32usize, 8, 4] {
        for (mode, x) in [
            ("down", 1usize),
            ("down", 3),
            ("up", 2),
            ("bfly", 5),
            ("bfly", 1),
            ("idx", 7),
        ] {
            let c = if mode == "up" {
                (32 - width) << 8
            } else {
                ((32 - width) << 8) | 0x1f
            };
            let body = format!(
                "mov.u32 %r1, %tid.x; mul.lo.u32 %r2, %r1, 7; add.u32 %r2, %r2, 100;\n\
                 shfl.sync.{mode}.b32 %r3|%p1, %r2, {x}, {c}, -1;\n\
                 cvt.u64.u32 %rd1, %r3; selp.b64 %rd2, 0x100000000, 0, %p1; or.b64 %rd1, %rd1, %rd2;\n\
                 mul.wide.u32 %rd3, %r1, 8; add.u64 %rd3, %rd0, %rd3; st.global.u64 [%rd3], %rd1;"
            );
            let got = run_snippet("", &body, 64, 64);
            for warp in 0..2 {
                let vals: [u32; 32] = std::array::from_fn(|l| ((warp * 32 + l) * 7 + 100) as u32);
                for lane in 0..32 {
                    let g = got[warp * 32 + lane];
                    let want = cuda_shfl(mode, &vals, lane, x, width);
                    assert_eq!(g as u32, want, "{mode} {x} width {width} lane {lane}");
                    let in_range = g >> 32 == 1;
                    if mode != "idx" {
                        assert_eq!(
                            in_range,
                            want != vals[lane] || x == 0,
                            "{mode} predicate lane {lane}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn vote_sync_modes_match_cuda() {
    // per lane: p1 = (some hash of tid) odd, p2 = tid < 40 (all of warp 0, part of warp
    // 1), p3 = true; votes over the full warp and over the even lanes
    let body = "mov.u32 %r1, %tid.x; mul.lo.u32 %r2, %r1, 0x9E3779B1; shr.u32 %r2, %r2, 7;\n\
         and.b32 %r2, %r2, 1; setp.ne.u32 %p1, %r2, 0; setp.lt.u32 %p2, %r1, 40; setp.eq.u32 %p3, %r1, %r1;\n\
         vote.sync.ballot.b32 %r10, %p1, 0xffffffff;\n\
         vote.sync.ballot.b32 %r11, !%p2, 0xffffffff;\n\
         vote.sync.any.pred %p4, %p1, 0xffffffff; selp.u32 %r12, 1, 0, %p4;\n\
         vote.sync.all.pred %p4, %p2, 0xffffffff; selp.u32 %r13, 1, 0, %p4;\n\
         vote.sync.uni.pred %p4, %p2, 0xffffffff; selp.u32 %r14, 1, 0, %p4;\n\
         vote.sync.all.pred %p4, %p3, -1; selp.u32 %r15, 1, 0, %p4;\n\
         vote.sync.any.pred %p4, !%p3, -1; selp.u32 %r16, 1, 0, %p4;\n\
         and.b32 %r3, %r1, 1; setp.ne.u32 %p5, %r3, 0; @%p5 bra ODD;\n\
         vote.sync.ballot.b32 %r17, %p1, 0x55555555;\n\
         vote.sync.uni.pred %p4, %p2, 0x55555555; selp.u32 %r18, 1, 0, %p4;\n\
         bra.uni DONE;\nODD:\nmov.u32 %r17, 0; mov.u32 %r18, 0;\nDONE:\n\
         mul.wide.u32 %rd3, %r1, 36; add.u64 %rd3, %rd0, %rd3;\n\
         st.global.u32 [%rd3], %r10; st.global.u32 [%rd3+4], %r11; st.global.u32 [%rd3+8], %r12;\n\
         st.global.u32 [%rd3+12], %r13; st.global.u32 [%rd3+16], %r14; st.global.u32 [%rd3+20], %r15;\n\
         st.global.u32 [%rd3+24], %r16; st.global.u32 [%rd3+28], %r17; st.global.u32 [%rd3+32], %r18;";
    let got = run_snippet("", body, 64, 64 * 9 / 2);
    let word = |tid: usize, i: usize| -> u32 {
        let at = tid * 36 + i * 4;
        (got[at / 8] >> (8 * (at % 8))) as u32
    };
    let p1 = |tid: usize| ((tid as u32).wrapping_mul(0x9E37_79B1) >> 7) & 1 != 0;
    let p2 = |tid: usize| tid < 40;
    let ballot = |warp: usize, mask: u32, f: &dyn Fn(usize) -> bool| -> u32 {
        (0..32)
            .filter(|&l| mask & (1 << l) != 0 && f(warp * 32 + l))
            .fold(0, |b, l| b | 1 << l)
    };
    for warp in 0..2 {
        let b1 = ballot(warp, !0, &p1);
        let b2 = ballot(warp, !0, &p2);
        let even = ballot(warp, 0x5555_5555, &p1);
        let even2 = ballot(warp, 0x5555_5555, &p2);
        for lane in 0..32 {
            let tid = warp * 32 + lane;
            assert_eq!(word(tid, 0), b1, "ballot, thread {tid}");
            assert_eq!(
                word(tid, 1),
                !b2,
                "ballot of a negated predicate, thread {tid}"
            );
            assert_eq!(word(tid, 2), (b1 != 0) as u32, "any, thread {tid}");
            assert_eq!(word(tid, 3), (b2 == !0) as u32, "all, thread {tid}");
            assert_eq!(
                word(tid, 4),
                (b2 == 0 || b2 == !0) as u32,
                "uni, thread {tid}"
            );
            assert_eq!(word(tid, 5), 1, "all of true, thread {tid}");
            assert_eq!(word(tid, 6), 0, "any of false, thread {tid}");
            let (ballot_even, uni_even) = if lane % 2 == 0 {
                (even, (even2 == 0 || even2 == 0x5555_5555) as u32)
            } else {
                (0, 0)
            };
            assert_eq!(
                word(tid, 7),
                ballot_even,
                "ballot over even lanes, thread {tid}"
            );
            assert_eq!(word(tid, 8), uni_even, "uni over even lanes, thread {tid}");
        }
    }
    // warp 1 is split by p2 (lanes 0..7 true): not uniform, neither all nor none
    assert_eq!(word(32, 4), 0);
    assert_eq!(word(0, 4), 1);
}

#[test]
fn bar_sync_orders_shared_memory_and_ignores_exited_threads() {
    let decls = ".shared .align 4 .b32 s_buf[128];";
    // threads >= 100 exit before the barrier; the others exchange values through shared
    // memory across warps
    let body = "mov.u32 %r1, %tid.x; setp.ge.u32 %p1, %r1, 100; @%p1 bra DONE;\n\
                mov.u32 %r2, s_buf; shl.b32 %r3, %r1, 2; add.u32 %r4, %r2, %r3;\n\
                mul.lo.u32 %r5, %r1, 3; st.shared.u32 [%r4], %r5;\n\
                bar.sync 0;\n\
                add.u32 %r6, %r1, 37; rem.u32 %r6, %r6, 100; shl.b32 %r6, %r6, 2; add.u32 %r6, %r2, %r6;\n\
                ld.shared.u32 %r7, [%r6]; cvt.u64.u32 %rd1, %r7;\n\
                mul.wide.u32 %rd3, %r1, 8; add.u64 %rd3, %rd0, %rd3; st.global.u64 [%rd3], %rd1;\n\
                DONE:";
    let got = run_snippet(decls, body, 128, 128);
    for t in 0..128 {
        let want = if t < 100 { ((t + 37) % 100) * 3 } else { 0 };
        assert_eq!(got[t as usize], want, "thread {t}");
    }
}

#[test]
fn dynamic_shared_memory_follows_static() {
    let src = ".version 7.0\n.target sm_70\n.address_size 64\n\
               .extern .shared .align 16 .b8 dyn[];\n\
               .visible .entry k(.param .u64 p_out)\n{\n.reg .b32 %r<8>;\n.reg .b64 %rd<8>;\n\
               .shared .align 8 .b64 stat[3];\n\
               ld.param.u64 %rd0, [p_out];\n\
               mov.u32 %r1, dyn; mov.u32 %r2, stat;\n\
               st.shared.u32 [dyn+60], 77; ld.shared.u32 %r3, [%r1+60];\n\
               st.global.u32 [%rd0], %r1; st.global.u32 [%rd0+4], %r2; st.global.u32 [%rd0+8], %r3;\n\
               ret;\n}\n";
    let m = Module::parse(src).unwrap();
    assert_eq!(m.static_shared_bytes(), 32);
    let mut mem = TestMem::new();
    mem.map(OUT, &[0; 12], Access::ReadWrite);
    let dims = |shared_bytes| Dims {
        grid: [2, 1, 1],
        block: [3, 1, 1],
        shared_bytes,
    };
    m.launch("k", dims(64), &[p64(OUT)], &mem).unwrap();
    let w: Vec<u32> = mem
        .bytes(OUT, 12)
        .chunks(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(w, vec![32, 0, 77]);
    // 60 bytes of dynamic shared memory: the u32 at dyn+60 is out of bounds
    match m.launch("k", dims(60), &[p64(OUT)], &mem) {
        Err(ExecError::Fault { fault, .. }) => {
            assert_eq!(fault.kind, "out-of-bounds shared store");
            assert_eq!((fault.addr, fault.size), (92, 4));
        }
        r => panic!("expected a fault, got {r:?}"),
    }
}

#[test]
fn three_dimensional_indices() {
    let src = ".version 7.0\n.target sm_70\n.address_size 64\n\
               .visible .entry k(.param .u64 p_out)\n{\n.reg .b32 %r<20>;\n.reg .b64 %rd<8>;\n\
               ld.param.u64 %rd0, [p_out];\n\
               mov.u32 %r1, %tid.x; mov.u32 %r2, %tid.y; mov.u32 %r3, %tid.z;\n\
               mov.u32 %r4, %ntid.x; mov.u32 %r5, %ntid.y; mov.u32 %r6, %ntid.z;\n\
               mov.u32 %r7, %ctaid.x; mov.u32 %r8, %ctaid.y; mov.u32 %r9, %ctaid.z;\n\
               mov.u32 %r10, %nctaid.x; mov.u32 %r11, %nctaid.y; mov.u32 %r12, %laneid; mov.u32 %r13, %warpid;\n\
               // linear block and thread ids\n\
               mad.lo.u32 %r14, %r9, %r11, %r8; mad.lo.u32 %r14, %r14, %r10, %r7;\n\
               mad.lo.u32 %r15, %r3, %r5, %r2; mad.lo.u32 %r15, %r15, %r4, %r1;\n\
               mul.lo.u32 %r16, %r4, %r5; mul.lo.u32 %r16, %r16, %r6;\n\
               mad.lo.u32 %r17, %r14, %r16, %r15;\n\
               // out[global] = laneid | warpid << 8 | linear thread << 16\n\
               shl.b32 %r18, %r13, 8; or.b32 %r18, %r18, %r12; shl.b32 %r19, %r15, 16; or.b32 %r18, %r18, %r19;\n\
               mul.wide.u32 %rd1, %r17, 4; add.u64 %rd1, %rd0, %rd1; st.global.u32 [%rd1], %r18;\n\
               ret;\n}\n";
    let m = Module::parse(src).unwrap();
    let (grid, block) = ([3u32, 2, 2], [5u32, 4, 3]);
    let per_block = 60u64;
    let total = 12 * per_block;
    let mut mem = TestMem::new();
    mem.map_dst(OUT, 4 * total);
    m.launch(
        "k",
        Dims {
            grid,
            block,
            shared_bytes: 0,
        },
        &[p64(OUT)],
        &mem,
    )
    .unwrap();
    let (got, guards) = mem.dst(OUT, 4 * total);
    assert!(guards);
    for (i, w) in got.chunks(4).enumerate() {
        let w = u32::from_le_bytes(w.try_into().unwrap());
        let t = (i as u64 % per_block) as u32;
        assert_eq!(w, (t % 32) | (t / 32) << 8 | t << 16, "thread {i}");
    }
}

#[test]
fn empty_inputs_do_nothing() {
    // lengths of 0 (the Rust side launches nothing then, but the kernels must cope);
    // the destination is empty, so any store hits a guard or faults
    let mut rng = SplitMix64(20);
    let geo = Geo {
        grid: 1,
        block: 256,
    };
    check_copy_bitmap(&mut rng, 0, 5, 3, 0, geo);
    check_unpack(&mut rng, 0, 5, 3, 0, geo);
    check_pack(&mut rng, 0, 0, 0, geo);
    check_rebase::<4>(&mut rng, 0, 4, 4, false, geo);
    check_rebase::<4>(&mut rng, 0, 4, 8, false, geo);
    check_rebase::<8>(&mut rng, 0, 8, 8, false, geo);
    let mut mem = TestMem::new();
    mem.map(TABLE, &[0; 24], Access::Read);
    run(
        copy_module(),
        "dvx_batched_copy",
        geo,
        &[p64(TABLE), p64(0)],
        &mem,
    )
    .unwrap();
}

#[test]
fn modules_are_shared_between_threads() {
    fn check<T: Send + Sync>() {}
    check::<Module>();
}

// ---------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------

fn kernel_src(body: &str) -> String {
    format!(
        ".version 7.0\n.target sm_70\n.address_size 64\n\
         .visible .entry k(.param .u64 p_a)\n{{\n.reg .pred %p<4>;\n.reg .b32 %r<8>;\n.reg .b64 %rd<8>;\n\
         ld.param.u64 %rd1, [p_a];\n{body}\nret;\n}}\n"
    )
}

fn parse_err(body: &str) -> (usize, String) {
    match Module::parse(&kernel_src(body)) {
        Err(e) => (e.line, e.message),
        Ok(_) => panic!("`{body}` parsed"),
    }
}

#[test]
fn parse_errors_name_the_line() {
    // the body starts on line 10
    let (line, msg) = parse_err("add.u64 %rd2, %rd1, 1;\nfrobnicate.u32 %r1, %r2;");
    assert_eq!(line, 11);
    assert!(msg.contains("frobnicate.u32"), "{msg}");
    let cases = [
        ("mov.u32 %r9, 1;", "undeclared"),
        ("bra NOWHERE;", "undefined label"),
        ("add.u32 %r1, %r2;", "operands"),
        ("add.u64 %rd2, %r1, 1;", "64-bit"),
        ("add.f32 %r1, %r2, %r3;", "unsupported instruction"),
        ("ld.global.u32 %r1, [%r2];", "64-bit"),
        ("ld.param.u64 %rd2, [p_a+4];", "outside parameter"),
        ("st.param.u64 [p_a], %rd1;", "read-only"),
        ("ld.local.u32 %r1, [%rd1];", "unsupported instruction"),
        ("call nothing;", "undeclared function"),
        ("@%r1 bra L;\nL:", "predicate"),
        ("shfl.sync.down.b32 %r1, %r2, 1, 31;", "operands"),
        ("vote.any.pred %p1, %p2;", "unsupported instruction"),
        (
            "vote.sync.ballot.pred %p1, %p2, -1;",
            "unsupported instruction",
        ),
        ("vote.sync.any.pred %r1, %p2, -1;", "predicate"),
        ("vote.sync.all.pred %p1, %p2;", "operands"),
        ("bar.sync 0, 64;", "thread count"),
        ("mov.u32 %r1, 0x1g;", "unsupported number"),
        ("mov.u32 %r1, 1.5;", "unsupported number"),
        ("L:\nL:", "twice"),
        ("/* never closed", "unterminated"),
        ("mov.u32 %r1, %r2", "expected `,` or `;`"),
    ];
    for (body, want) in cases {
        let (line, msg) = parse_err(body);
        assert!(msg.contains(want), "`{body}`: {msg}");
        assert!(line >= 10, "`{body}`: line {line}");
    }
    for src in [
        ".version 7.0\n.target sm_70\n.address_size 32\n",
        ".global .u32 g;\n",
        ".visible .entry k(.param .u64 a)\n{\nret;\n",
        ".visible .entry k(.param .u64 a)\n{\nret;\n}\n.visible .entry k()\n{\nret;\n}\n",
    ] {
        assert!(Module::parse(src).is_err(), "{src}");
    }
}

#[test]
fn parsing_never_panics_on_truncated_or_mangled_input() {
    let mut rng = SplitMix64(18);
    for src in [COPY_PTX, VALIDITY_PTX, TESTING_PTX] {
        let b = src.as_bytes();
        for _ in 0..150 {
            let cut = rng.below(b.len() as u64) as usize;
            let _ = Module::parse(&String::from_utf8_lossy(&b[..cut]));
            let mut m = b.to_vec();
            for _ in 0..3 {
                let i = rng.below(m.len() as u64) as usize;
                m[i] = b"{}[]();,.%@!<>+-0123456789abcxyz \n"[rng.below(34) as usize];
            }
            let _ = Module::parse(&String::from_utf8_lossy(&m));
        }
    }
}

fn fault_of(body: &str, mem: &TestMem, arg: u64, block: u32) -> (Fault, [u32; 3], String) {
    let m = Module::parse(&kernel_src(body)).unwrap_or_else(|e| panic!("{e}"));
    let dims = Dims {
        grid: [2, 1, 1],
        block: [block, 1, 1],
        shared_bytes: 0,
    };
    match m.launch("k", dims, &[p64(arg)], mem) {
        Err(ExecError::Fault {
            fault,
            thread,
            block,
            kernel,
            instruction,
        }) => {
            assert_eq!(kernel, "k");
            assert_eq!(block, [0, 0, 0], "the first faulting block is reported");
            (fault, thread, instruction)
        }
        r => panic!("expected a fault, got {r:?}"),
    }
}

#[test]
fn out_of_bounds_and_misaligned_accesses_fault() {
    let mut mem = TestMem::new();
    mem.map(OUT, &[0; 64], Access::ReadWrite);
    // thread 5 reads one u32 past the end of the region
    let (f, thread, inst) = fault_of(
        "mov.u32 %r1, %tid.x; mul.wide.u32 %rd2, %r1, 12; add.u64 %rd2, %rd1, %rd2;\n\
         ld.global.u32 %r2, [%rd2+4];",
        &mem,
        OUT,
        32,
    );
    assert_eq!(
        (f.kind.as_str(), f.addr, f.size),
        ("out-of-bounds load", OUT + 64, 4)
    );
    assert_eq!(thread, [5, 0, 0]);
    assert!(inst.starts_with("ld.global.u32 %r2, [%rd2+4]"), "{inst}");
    // misaligned scalar load (the interpreter checks, whatever the memory allows)
    let (f, thread, _) = fault_of("ld.global.u32 %r2, [%rd1+2];", &mem, OUT, 32);
    assert_eq!(
        (f.kind.as_str(), f.addr, f.size),
        ("misaligned load", OUT + 2, 4)
    );
    assert_eq!(thread, [0, 0, 0]);
    // a 16-byte vector store at an 8-aligned address
    let (f, _, inst) = fault_of(
        "mov.u32 %r1, 1; st.global.v4.u32 [%rd1+8], {%r1, %r1, %r1, %r1};",
        &mem,
        OUT,
        32,
    );
    assert_eq!(
        (f.kind.as_str(), f.addr, f.size),
        ("misaligned store", OUT + 8, 16)
    );
    assert!(inst.contains("st.global.v4.u32"), "{inst}");
    // a 64-bit store at a 4-aligned address, by a guarded-on thread only
    let (f, thread, _) = fault_of(
        "mov.u32 %r1, %tid.x; setp.eq.u32 %p1, %r1, 17; @%p1 st.global.u64 [%rd1+4], %rd1;",
        &mem,
        OUT,
        32,
    );
    assert_eq!(
        (f.kind.as_str(), f.size, thread),
        ("misaligned store", 8, [17, 0, 0])
    );
    // writes to a read-only region: the memory's fault is reported the same way
    let mut ro = TestMem::new();
    ro.map(SRC, &[0; 16], Access::Read);
    let (f, _, _) = fault_of("st.global.u8 [%rd1+3], %r1;", &ro, SRC, 32);
    assert_eq!(
        (f.kind.as_str(), f.addr, f.size),
        ("store not permitted", SRC + 3, 1)
    );
    // shared memory beyond the block's allocation
    let (f, _, _) = fault_of("mov.u32 %r1, 0; ld.shared.u32 %r2, [%r1];", &mem, OUT, 32);
    assert_eq!(f.kind, "out-of-bounds shared load");
}

#[test]
fn deadlocks_are_reported() {
    let mut mem = TestMem::new();
    mem.map(OUT, &[0; 8], Access::ReadWrite);
    let launch = |body: &str| {
        let m = Module::parse(&kernel_src(body)).unwrap_or_else(|e| panic!("{e}"));
        let dims = Dims {
            grid: [1, 1, 1],
            block: [64, 1, 1],
            shared_bytes: 0,
        };
        m.launch("k", dims, &[p64(OUT)], &mem)
    };
    // lanes 16..31 exit, lanes 0..15 wait forever in a full-warp shuffle
    let r = launch(
        "mov.u32 %r1, %tid.x; and.b32 %r2, %r1, 31; setp.ge.u32 %p1, %r2, 16; @%p1 bra END;\n\
         shfl.sync.down.b32 %r3, %r1, 1, 31, -1;\nEND:",
    );
    match r {
        Err(ExecError::Deadlock { kernel, detail }) => {
            assert_eq!(kernel, "k");
            assert!(detail.contains("shfl.sync"), "{detail}");
        }
        r => panic!("expected a deadlock, got {r:?}"),
    }
    // half the block at barrier 0, the other half at barrier 1
    let r = launch(
        "mov.u32 %r1, %tid.x; setp.ge.u32 %p1, %r1, 32; @%p1 bra B1;\nbar.sync 0;\nbra.uni END;\nB1:\nbar.sync 1;\nEND:",
    );
    assert!(matches!(r, Err(ExecError::Deadlock { .. })), "{r:?}");
    // a membermask without the executing lane
    let r = launch("mov.u32 %r1, %tid.x; shfl.sync.idx.b32 %r3, %r1, 0, 31, 2;");
    assert!(matches!(r, Err(ExecError::Deadlock { .. })), "{r:?}");
    let r = launch("setp.eq.u32 %p1, 0, 0; vote.sync.any.pred %p2, %p1, 2;");
    assert!(matches!(r, Err(ExecError::Deadlock { .. })), "{r:?}");
    // lanes 16..31 exit, lanes 0..15 wait forever in a full-warp vote
    let r = launch(
        "mov.u32 %r1, %tid.x; and.b32 %r2, %r1, 31; setp.ge.u32 %p1, %r2, 16; @%p1 bra END;\n\
         vote.sync.all.pred %p2, %p1, -1;\nEND:",
    );
    assert!(matches!(r, Err(ExecError::Deadlock { .. })), "{r:?}");
    // half a warp at a vote, the other half at a shuffle, with the same mask
    let r = launch(
        "mov.u32 %r1, %tid.x; and.b32 %r2, %r1, 31; setp.ge.u32 %p1, %r2, 16; @%p1 bra SH;\n\
         vote.sync.any.pred %p2, %p1, -1;\nbra.uni END;\nSH:\nshfl.sync.down.b32 %r3, %r1, 1, 31, -1;\nEND:",
    );
    match r {
        Err(ExecError::Deadlock { detail, .. }) => {
            assert!(detail.contains("different warp collectives"), "{detail}");
        }
        r => panic!("expected a deadlock, got {r:?}"),
    }
    // the same barrier reached by everyone is fine, also with exited threads
    launch("mov.u32 %r1, %tid.x; setp.ge.u32 %p1, %r1, 40; @%p1 bra END;\nbar.sync 0;\nbar.sync 0;\nEND:").unwrap();
}

#[test]
fn invalid_launches_are_rejected() {
    let m = copy_module();
    let mem = TestMem::new();
    let dims = Dims {
        grid: [1, 1, 1],
        block: [256, 1, 1],
        shared_bytes: 0,
    };
    let bad =
        |r: Result<(), ExecError>| assert!(matches!(r, Err(ExecError::InvalidLaunch(_))), "{r:?}");
    bad(m.launch("nope", dims, &[], &mem));
    bad(m.launch("dvx_batched_copy", dims, &[p64(0)], &mem));
    bad(m.launch("dvx_batched_copy", dims, &[p64(0), p32(0)], &mem));
    bad(m.launch(
        "dvx_rebase_offsets_i32",
        dims,
        &[p64(0), p64(0), p64(0), p64(0)],
        &mem,
    ));
    for (grid, block) in [
        ([0, 1, 1], [256, 1, 1]),
        ([1, 1, 1], [0, 1, 1]),
        ([1, 1, 1], [1025, 1, 1]),
        ([1, 1, 1], [64, 32, 1]),
    ] {
        bad(m.launch(
            "dvx_batched_copy",
            Dims {
                grid,
                block,
                shared_bytes: 0,
            },
            &[p64(0), p64(0)],
            &mem,
        ));
    }
    bad(m.launch(
        "dvx_batched_copy",
        Dims {
            shared_bytes: 1 << 20,
            ..dims
        },
        &[p64(0), p64(0)],
        &mem,
    ));
    assert_eq!(m.kernel("dvx_rebase_offsets_i32").unwrap()[2].size, 4);
    assert!(m.kernel("dvx_ld_word").is_none(), "a .func is not a kernel");
    assert_eq!(
        validity_module().kernel_names(),
        [
            "dvx_count_set_bits",
            "dvx_copy_bitmap",
            "dvx_unpack_bits",
            "dvx_pack_bools"
        ]
    );
}

// ---------------------------------------------------------------------------------------
// Large inputs and speed (run with
// `cargo test -p devarrow-emu --test ptx_kernels -- --ignored --nocapture`)
// ---------------------------------------------------------------------------------------

/// Launches with the geometry of a 132-multiprocessor GPU (H100), reporting speed.
fn timed(m: &Module, name: &str, items: u64, params: &[Vec<u8>], mem: &TestMem, workers: usize) {
    let grid = items.div_ceil(BLOCK_SIZE as u64).clamp(1, 8 * 132) as u32;
    let dims = Dims {
        grid: [grid, 1, 1],
        block: [BLOCK_SIZE, 1, 1],
        shared_bytes: 0,
    };
    let t = Instant::now();
    let s = m
        .launch_with_stats(name, dims, params, mem, workers)
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let dt = t.elapsed().as_secs_f64();
    println!(
        "{name:<24} workers {workers}: {dt:6.2} s, {:6} M instructions, {:4.0} M instructions/s",
        s.instructions / 1_000_000,
        s.instructions as f64 / dt / 1e6
    );
}

#[test]
#[ignore]
fn large_inputs_and_speed() {
    const MIB: u64 = 1 << 20;
    let mut rng = SplitMix64(19);
    let n = 64 * MIB;
    let data = rng.bytes(n as usize + 64);
    let workers = std::env::var("EMU_WORKERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    for (sa, da) in [(0u64, 0u64), (3, 0)] {
        let mut mem = TestMem::new();
        mem.map(SRC + sa, &data[..n as usize], Access::Read);
        mem.map(DST + da, &vec![0; n as usize], Access::Write);
        let pieces = plan_pieces(
            &[CopySegment {
                src: SRC + sa,
                dst: DST + da,
                len: n,
            }],
            132 * 64,
        );
        let table: Vec<u8> = pieces
            .iter()
            .flat_map(|p| [p.src, p.dst, p.len])
            .flat_map(|v| v.to_le_bytes())
            .collect();
        mem.map(TABLE, &table, Access::Read);
        let np = pieces.len() as u64;
        timed(
            copy_module(),
            "dvx_batched_copy",
            32 * np,
            &[p64(TABLE), p64(np)],
            &mem,
            workers,
        );
        assert!(
            mem.bytes(DST + da, n) == data[..n as usize],
            "batched copy sa {sa}"
        );
    }
    {
        let mut mem = TestMem::new();
        mem.map(SRC + 5, &data[..n as usize], Access::Read);
        mem.map(OUT, &[0; 8], Access::ReadWrite);
        let len = 8 * n - 20;
        timed(
            validity_module(),
            "dvx_count_set_bits",
            len.div_ceil(128) + 1,
            &[p64(SRC + 5), p64(3), p64(len), p64(OUT)],
            &mem,
            workers,
        );
        let got = u64::from_le_bytes(mem.bytes(OUT, 8).try_into().unwrap());
        assert_eq!(got, naive::count_set_bits(&data, 3, len as usize));
    }
    {
        let mut mem = TestMem::new();
        mem.map(SRC + 1, &data[..n as usize], Access::Read);
        let len = 8 * n - 30;
        let out = len.div_ceil(8);
        mem.map(DST, &vec![0; out as usize], Access::Write);
        timed(
            validity_module(),
            "dvx_copy_bitmap",
            out.div_ceil(16),
            &[p64(SRC + 1), p64(13), p64(len), p64(DST)],
            &mem,
            workers,
        );
        assert!(mem.bytes(DST, out) == naive::copy_bitmap(&data, 13, len as usize));
    }
    {
        let bits = 8 * n / 4;
        let mut mem = TestMem::new();
        mem.map(SRC, &data[..(bits / 8) as usize + 1], Access::Read);
        mem.map(DST, &vec![0; bits as usize], Access::Write);
        timed(
            validity_module(),
            "dvx_unpack_bits",
            bits.div_ceil(32),
            &[p64(SRC), p64(5), p64(bits), p64(DST)],
            &mem,
            workers,
        );
        assert!(mem.bytes(DST, bits) == naive::unpack_bits(&data, 5, bits as usize));
    }
    {
        let mut mem = TestMem::new();
        mem.map(SRC, &data[..n as usize], Access::Read);
        mem.map(DST, &vec![0; (n / 8) as usize], Access::Write);
        timed(
            validity_module(),
            "dvx_pack_bools",
            n.div_ceil(32),
            &[p64(SRC), p64(n), p64(DST)],
            &mem,
            workers,
        );
        assert!(mem.bytes(DST, n / 8) == naive::pack_bools(&data[..n as usize]));
    }
    for (sa, da) in [(4u64, 4u64), (0, 4)] {
        let cnt = n / 4;
        let mut mem = TestMem::new();
        mem.map(SRC + sa, &data[..n as usize], Access::Read);
        mem.map(DST + da, &vec![0; n as usize], Access::Write);
        timed(
            copy_module(),
            "dvx_rebase_offsets_i32",
            cnt.div_ceil(4),
            &[p64(SRC + sa), p64(cnt), p32(12345), p64(DST + da)],
            &mem,
            workers,
        );
        let v: Vec<i32> = data[..n as usize]
            .chunks(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let want: Vec<u8> = naive::rebase_offsets_i32(&v, 12345)
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert!(mem.bytes(DST + da, n) == want, "rebase sa {sa} da {da}");
    }
}

// ---------------------------------------------------------------------------------------
// Conversion kernels (convert.ptx) against devarrow_abi's CpuKernels
// ---------------------------------------------------------------------------------------

mod convert {
    use std::ffi::c_void;
    use std::sync::OnceLock;

    use devarrow_abi::device::{CpuKernels, DeviceKernels, RowIntegers, Validity};
    use devarrow_cuda::kernels::{BLOCK_SIZE, CONVERT_PTX};
    use devarrow_emu::ptx::Module;
    use devarrow_testing::kernel_oracles::SplitMix64;

    use super::{
        geometries, p32, p64, run, standard, Access, Geo, TestMem, GUARD, GUARD_BYTE, OUT, SMS,
        SRC, TABLE,
    };

    /// More windows for the conversion tests' buffers.
    const BITS: u64 = 0x1004_0000_0000;
    const AUX: u64 = 0x1005_0000_0000;
    const OFFS: u64 = 0x1006_0000_0000;
    const NARROW: u64 = 0x1008_0000_0000;
    const SUMS: u64 = 0x1007_0000_0000;

    fn module() -> &'static Module {
        static M: OnceLock<Module> = OnceLock::new();
        M.get_or_init(|| Module::parse(CONVERT_PTX).expect("convert.ptx parses"))
    }

    /// The one-wave geometry of the kernels whose work is read on the device, and
    /// another valid one.
    fn wave_geometries(items: u64, rng: &mut SplitMix64) -> [Geo; 2] {
        let wave = Geo {
            grid: (8 * SMS) as u32,
            block: BLOCK_SIZE,
        };
        [wave, geometries(items, rng)[1]]
    }

    fn bytes_of_i64(v: &[i64]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn p(b: &[u8]) -> *const c_void {
        b.as_ptr().cast()
    }

    fn pm(b: &mut [u8]) -> *mut c_void {
        b.as_mut_ptr().cast()
    }

    /// Maps `bytes` read-write at `base` with write-only guard bytes around them.
    fn map_rw(mem: &mut TestMem, base: u64, bytes: &[u8]) {
        mem.map(base - GUARD, &[GUARD_BYTE; GUARD as usize], Access::Write);
        mem.map(base, bytes, Access::ReadWrite);
        mem.map(
            base + bytes.len() as u64,
            &[GUARD_BYTE; GUARD as usize],
            Access::Write,
        );
    }

    fn map_read(mem: &mut TestMem, base: u64, bytes: &[u8]) {
        if !bytes.is_empty() {
            mem.map(base, bytes, Access::Read);
        }
    }

    /// The written range at `base` (asserting its guards are untouched).
    fn written(mem: &TestMem, base: u64, len: u64, what: &str) -> Vec<u8> {
        let (bytes, guards) = mem.dst(base, len);
        assert!(guards, "{what}: a guard byte was written");
        bytes
    }

    /// Offsets (n + 1 int64s) of rows of the given sizes (via CpuKernels' row_sizes and
    /// scan, as the bridge makes them).
    fn offsets_of(sizes: RowIntegers, validity: Validity, n: u64) -> Vec<i64> {
        let mut out = vec![0u8; 8 * (n as usize + 1)];
        // SAFETY: host buffers of the sizes the kernels read and write.
        unsafe {
            CpuKernels
                .row_sizes(sizes, validity, n, pm(&mut out))
                .unwrap();
            CpuKernels.inclusive_scan_i64(pm(&mut out), n + 1).unwrap();
        }
        out.chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    fn row_counts() -> Vec<u64> {
        vec![
            1, 2, 7, 31, 32, 33, 100, 255, 256, 257, 1023, 1024, 1025, 3001,
        ]
    }

    #[test]
    fn row_sizes_match_cpu_kernels() {
        let mut rng = SplitMix64(101);
        for n in [0u64].into_iter().chain(row_counts()) {
            for (stride, wide) in [
                (16u64, false),
                (4, false),
                (8, true),
                (12, false),
                (16, true),
            ] {
                for with_validity in [false, true] {
                    let width = if wide { 8 } else { 4 };
                    let len = if n == 0 { 0 } else { (n - 1) * stride + width };
                    let src = rng.bytes(len as usize);
                    let bit_offset = rng.below(40);
                    let bitmap = rng.bitmap((bit_offset + n).div_ceil(8) as usize + 1);
                    let host_validity = if with_validity {
                        Validity::new(p(&bitmap), bit_offset)
                    } else {
                        Validity::ALL_VALID
                    };
                    let mut expected = vec![0x5Au8; 8 * (n as usize + 1)];
                    // SAFETY: host buffers of the sizes read and written.
                    unsafe {
                        CpuKernels
                            .row_sizes(
                                RowIntegers {
                                    address: p(&src),
                                    stride,
                                    wide,
                                },
                                host_validity,
                                n,
                                pm(&mut expected),
                            )
                            .unwrap()
                    };
                    for geo in geometries(n + 1, &mut rng) {
                        let mut mem = TestMem::new();
                        let addr = SRC + width * rng.below(4);
                        map_read(&mut mem, addr, &src);
                        if with_validity {
                            super::map_bits(&mut mem, &bitmap, BITS, bit_offset, n);
                        }
                        mem.map_dst(OUT, 8 * (n + 1));
                        let params = [
                            p64(addr),
                            p64(stride),
                            p32(wide as u32),
                            p64(if with_validity { BITS } else { 0 }),
                            p64(bit_offset),
                            p64(n),
                            p64(OUT),
                        ];
                        let what = format!(
                            "n {n} stride {stride} wide {wide} validity {with_validity} {geo:?}"
                        );
                        run(module(), "dvx_row_sizes", geo, &params, &mem)
                            .unwrap_or_else(|e| panic!("{what}: {e}"));
                        assert_eq!(written(&mem, OUT, 8 * (n + 1), &what), expected, "{what}");
                    }
                }
            }
        }
    }

    /// The scan as the Rust side runs it (`kernels::inclusive_scan_i64`), with tiles of
    /// 4 * `block` items, the tile totals of level `level` at `SUMS + level << 32`.
    fn scan(mem: &TestMem, data: u64, n: u64, block: u32, level: u64, rng: &mut SplitMix64) {
        let tile = 4 * block as u64;
        let tiles = n.div_ceil(tile);
        let sums = if tiles > 1 { SUMS + (level << 32) } else { 0 };
        let geo = Geo {
            grid: tiles as u32,
            block,
        };
        run(
            module(),
            "dvx_scan_tiles_i64",
            geo,
            &[p64(data), p64(n), p64(sums)],
            mem,
        )
        .unwrap_or_else(|e| panic!("scan n {n} block {block}: {e}"));
        if tiles > 1 {
            scan(mem, sums, tiles, block, level + 1, rng);
            for geo in [standard(n - tile), geometries(n - tile, rng)[1]]
                .into_iter()
                .take(1)
            {
                run(
                    module(),
                    "dvx_add_tile_prefix_i64",
                    geo,
                    &[p64(data), p64(n), p64(sums), p64(tile)],
                    mem,
                )
                .unwrap_or_else(|e| panic!("tile prefix n {n} block {block}: {e}"));
            }
        }
    }

    fn check_scan(rng: &mut SplitMix64, n: u64, block: u32) {
        let values: Vec<i64> = (0..n)
            .map(|_| match rng.below(3) {
                0 => rng.next_u64() as i64, // wrapping sums
                _ => rng.below(1000) as i64 - 200,
            })
            .collect();
        let mut expected = bytes_of_i64(&values);
        // SAFETY: n host int64s.
        unsafe { CpuKernels.inclusive_scan_i64(pm(&mut expected), n).unwrap() };
        let mut mem = TestMem::new();
        map_rw(&mut mem, SRC, &bytes_of_i64(&values));
        let tile = 4 * block as u64;
        let (mut level, mut items) = (0u64, n);
        while items.div_ceil(tile) > 1 {
            items = items.div_ceil(tile);
            map_rw(
                &mut mem,
                SUMS + (level << 32),
                &vec![0x5A; 8 * items as usize],
            );
            level += 1;
        }
        scan(&mem, SRC, n, block, 0, rng);
        let what = format!("scan n {n} block {block}");
        assert_eq!(written(&mem, SRC, 8 * n, &what), expected, "{what}");
    }

    #[test]
    fn scan_matches_cpu_kernels() {
        let mut rng = SplitMix64(102);
        for n in [
            1u64,
            2,
            5,
            31,
            32,
            33,
            255,
            1023,
            1024,
            1025,
            2048,
            3 * 1024 + 7,
            20_000,
        ] {
            check_scan(&mut rng, n, BLOCK_SIZE);
        }
        // three levels with tiles of 128 items (blocks of 32 threads), and other blocks
        for n in [128 * 128 + 5, 129, 128 * 3] {
            check_scan(&mut rng, n, 32);
        }
        for n in [4 * 96 * 5 + 1, 4096 + 3] {
            check_scan(&mut rng, n, 96);
            check_scan(&mut rng, n, 1024);
        }
    }

    /// Views of `n` rows (inline, out-of-line, null rows with garbage), their bytes
    /// gathered by dvx_gather_views against CpuKernels: groups of 32 rows written lane
    /// by lane (`lane_bytes` 2^31, as devarrow launches it) and, with `lane_bytes` small,
    /// row by row (devarrow's path for groups of 2^31 bytes or more), or each as it
    /// comes (a random `lane_bytes`); with the offsets narrowed to int32s in the same pass,
    /// or not.
    fn check_views(rng: &mut SplitMix64, n: u64, nulls: bool) {
        const BUFFER: usize = 300;
        let buffers: Vec<Vec<u8>> = (0..3).map(|_| rng.bytes(BUFFER)).collect();
        let device_buffers: Vec<u64> = (0..3u64).map(|k| AUX + (k << 28) + rng.below(16)).collect();
        let bit_offset = rng.below(30);
        let bitmap = {
            let mut b = rng.bitmap((bit_offset + n).div_ceil(8) as usize);
            if !nulls {
                b.iter_mut().for_each(|x| *x = 0xFF);
            }
            b
        };
        let mut views = Vec::with_capacity(16 * n as usize);
        for i in 0..n {
            let bit = bit_offset + i;
            let valid = bitmap[(bit / 8) as usize] & (1 << (bit % 8)) != 0;
            let mut view = [0u8; 16];
            if !valid {
                view.copy_from_slice(&rng.bytes(16)); // never read past its length
            } else if rng.below(2) == 0 {
                let len = rng.below(13) as u32;
                view[..4].copy_from_slice(&len.to_le_bytes());
                view[4..].copy_from_slice(&rng.bytes(12));
            } else {
                let len = 13 + rng.below(60) as u32;
                let index = rng.below(3) as u32;
                let offset = rng.below((BUFFER as u64) - len as u64) as u32;
                view[..4].copy_from_slice(&len.to_le_bytes());
                view[4..8].copy_from_slice(&rng.bytes(4));
                view[8..12].copy_from_slice(&index.to_le_bytes());
                view[12..].copy_from_slice(&offset.to_le_bytes());
            }
            views.extend_from_slice(&view);
        }
        let validity = if nulls {
            Validity::new(p(&bitmap), bit_offset)
        } else {
            Validity::ALL_VALID
        };
        let offsets = offsets_of(
            RowIntegers {
                address: p(&views),
                stride: 16,
                wide: false,
            },
            validity,
            n,
        );
        let total = offsets[n as usize] as u64;
        let host_buffers: Vec<u64> = buffers.iter().map(|b| b.as_ptr() as u64).collect();
        let mut expected = vec![0x5Au8; total as usize];
        let offsets_bytes = bytes_of_i64(&offsets);
        // SAFETY: host copies of every buffer the gather reads, `expected` holds `total`.
        unsafe {
            CpuKernels
                .gather_view_bytes(
                    p(&views),
                    validity,
                    n,
                    host_buffers.as_ptr().cast(),
                    p(&offsets_bytes),
                    pm(&mut expected),
                )
                .unwrap()
        };
        for geo in geometries(n, rng) {
            let mut mem = TestMem::new();
            let views_at = SRC + 4; // 4-byte aligned only
            map_read(&mut mem, views_at, &views);
            if nulls {
                super::map_bits(&mut mem, &bitmap, BITS, bit_offset, n);
            }
            for (b, &at) in buffers.iter().zip(&device_buffers) {
                map_read(&mut mem, at, b);
            }
            let table: Vec<u8> = device_buffers
                .iter()
                .flat_map(|a| a.to_le_bytes())
                .collect();
            map_read(&mut mem, TABLE, &table);
            map_read(&mut mem, OFFS, &offsets_bytes);
            let out = OUT + rng.below(16);
            mem.map_dst(out, total);
            // Every other geometry narrows the offsets too (4-byte aligned).
            let narrow = (rng.below(2) == 0).then(|| NARROW + 4 * rng.below(4));
            if let Some(narrow) = narrow {
                mem.map_dst(narrow, 4 * (n + 1));
            }
            let lane_bytes = match rng.below(3) {
                0 => 1 << 31,
                1 => rng.below(8),
                _ => rng.below(2 * total / n.div_ceil(32) + 2),
            };
            let params = [
                p64(views_at),
                p64(if nulls { BITS } else { 0 }),
                p64(bit_offset),
                p64(n),
                p64(TABLE),
                p64(OFFS),
                p64(out),
                p64(lane_bytes),
                p64(narrow.unwrap_or(0)),
            ];
            let what = format!(
                "views n {n} nulls {nulls} lane_bytes {lane_bytes} narrow {narrow:?} {geo:?}"
            );
            run(module(), "dvx_gather_views", geo, &params, &mem)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(written(&mem, out, total, &what), expected, "{what}");
            if let Some(narrow) = narrow {
                let want: Vec<u8> = offsets
                    .iter()
                    .flat_map(|&o| (o as i32).to_le_bytes())
                    .collect();
                assert_eq!(
                    written(&mem, narrow, 4 * (n + 1), &what),
                    want,
                    "{what}: narrowed"
                );
            }
        }
    }

    #[test]
    fn view_bytes_match_cpu_kernels() {
        let mut rng = SplitMix64(103);
        for n in row_counts() {
            check_views(&mut rng, n, false);
            check_views(&mut rng, n, true);
        }
    }

    #[test]
    fn narrow_widen_and_fill_match_cpu_kernels() {
        let mut rng = SplitMix64(104);
        for n in row_counts() {
            let values: Vec<i64> = (0..n).map(|_| rng.next_u64() as i64).collect();
            let src = bytes_of_i64(&values);
            // narrow
            let mut expected = vec![0u8; 4 * n as usize];
            // SAFETY: host buffers of the sizes read and written.
            unsafe {
                CpuKernels
                    .narrow_i64_to_i32(p(&src), n, pm(&mut expected))
                    .unwrap()
            };
            for geo in geometries(n, &mut rng) {
                let mut mem = TestMem::new();
                map_read(&mut mem, SRC + 8, &src);
                let dst = OUT + 4 * rng.below(4);
                mem.map_dst(dst, 4 * n);
                run(
                    module(),
                    "dvx_narrow_i64_i32",
                    geo,
                    &[p64(SRC + 8), p64(n), p64(dst)],
                    &mem,
                )
                .unwrap();
                assert_eq!(
                    written(&mem, dst, 4 * n, "narrow"),
                    expected,
                    "narrow n {n}"
                );
            }
            // widen
            for width in [4u64, 8] {
                let src = rng.bytes((n * width) as usize);
                let mut expected = vec![0u8; 16 * n as usize];
                // SAFETY: as above.
                unsafe {
                    CpuKernels
                        .widen_decimals(p(&src), width, n, pm(&mut expected))
                        .unwrap()
                };
                for geo in geometries(n, &mut rng) {
                    let mut mem = TestMem::new();
                    let at = SRC + width * rng.below(4);
                    map_read(&mut mem, at, &src);
                    let dst = OUT + 8 * rng.below(2);
                    mem.map_dst(dst, 16 * n);
                    let params = [p64(at), p64(width), p64(n), p64(dst)];
                    run(module(), "dvx_widen_decimals", geo, &params, &mem).unwrap();
                    assert_eq!(
                        written(&mem, dst, 16 * n, "widen"),
                        expected,
                        "widen {width} n {n}"
                    );
                }
            }
            // fill
            let step = [0u32, 1, 7, 0x8000_0001][rng.below(4) as usize];
            let mut expected = vec![0u8; 4 * n as usize];
            // SAFETY: as above.
            unsafe {
                CpuKernels
                    .fill_offsets_i32(pm(&mut expected), n, step)
                    .unwrap()
            };
            for geo in geometries(n, &mut rng) {
                let mut mem = TestMem::new();
                let dst = OUT + 4 * rng.below(4);
                mem.map_dst(dst, 4 * n);
                run(
                    module(),
                    "dvx_fill_offsets_i32",
                    geo,
                    &[p64(dst), p64(n), p32(step)],
                    &mem,
                )
                .unwrap();
                assert_eq!(
                    written(&mem, dst, 4 * n, "fill"),
                    expected,
                    "fill n {n} step {step}"
                );
            }
        }
    }

    /// List views: sizes (some null, some empty) and their list offsets.
    struct Lists {
        n: u64,
        sizes: Vec<u8>,
        bitmap: Vec<u8>,
        bit_offset: u64,
        new_offsets: Vec<i64>,
    }

    fn lists(rng: &mut SplitMix64, n: u64, max_size: u64) -> Lists {
        let sizes: Vec<u8> = (0..n)
            .flat_map(|_| (rng.below(max_size + 1) as u32).to_le_bytes())
            .collect();
        let bit_offset = rng.below(20);
        let bitmap = rng.bitmap((bit_offset + n).div_ceil(8) as usize);
        let new_offsets = offsets_of(
            RowIntegers {
                address: p(&sizes),
                stride: 4,
                wide: false,
            },
            Validity::new(p(&bitmap), bit_offset),
            n,
        );
        Lists {
            n,
            sizes,
            bitmap,
            bit_offset,
            new_offsets,
        }
    }

    /// Row integers of `values`: (bytes, stride, wide) with the layout picked by `layout`.
    fn row_integers(values: &[i64], layout: u64) -> (Vec<u8>, u64, bool) {
        match layout {
            0 => (
                values
                    .iter()
                    .flat_map(|&v| (v as i32).to_le_bytes())
                    .collect(),
                4,
                false,
            ),
            1 => (bytes_of_i64(values), 8, true),
            _ => (
                values
                    .iter()
                    .flat_map(|&v| {
                        let mut b = (v as i32).to_le_bytes().to_vec();
                        b.extend_from_slice(&[0xEE; 8]);
                        b
                    })
                    .collect(),
                12,
                false,
            ),
        }
    }

    #[test]
    fn compare_list_offsets_matches_cpu_kernels() {
        let mut rng = SplitMix64(105);
        for n in row_counts() {
            for layout in 0..3u64 {
                for mode in 0..4u64 {
                    let mut l = lists(&mut rng, n, 4);
                    if mode == 3 {
                        // past 2^31: int32 offsets sign-extend (a mismatch), int64 ones match
                        l.new_offsets.iter_mut().for_each(|o| *o += 0xFFFF_0000);
                    }
                    let mut offsets: Vec<i64> = l.new_offsets[..n as usize].to_vec();
                    let i = rng.below(n) as usize;
                    match mode {
                        1 => offsets[i] += 1,
                        2 => offsets[i] = -1, // -1 as int32 is not 4294967295
                        _ => {}
                    }
                    let (bytes, stride, wide) = row_integers(&offsets, layout);
                    let expected_bytes = bytes_of_i64(&l.new_offsets);
                    let mut expected = [0u8; 4];
                    let rows = RowIntegers {
                        address: p(&bytes),
                        stride,
                        wide,
                    };
                    // SAFETY: host buffers of the sizes read and written.
                    unsafe {
                        CpuKernels
                            .compare_list_offsets(rows, n, p(&expected_bytes), pm(&mut expected))
                            .unwrap()
                    };
                    for geo in geometries(n, &mut rng) {
                        let mut mem = TestMem::new();
                        let at = SRC + if wide { 8 } else { 4 };
                        let len = (n - 1) * stride + if wide { 8 } else { 4 };
                        map_read(&mut mem, at, &bytes[..len as usize]);
                        map_read(&mut mem, OFFS, &expected_bytes);
                        map_rw(&mut mem, OUT, &[0; 4]);
                        let params = [
                            p64(at),
                            p64(stride),
                            p32(wide as u32),
                            p64(n),
                            p64(OFFS),
                            p64(OUT),
                        ];
                        run(module(), "dvx_compare_list_offsets", geo, &params, &mem).unwrap();
                        let what = format!("compare n {n} layout {layout} mode {mode} {geo:?}");
                        assert_eq!(written(&mem, OUT, 4, &what), expected, "{what}");
                    }
                }
            }
        }
    }

    #[test]
    fn gather_list_values_and_bits_match_cpu_kernels() {
        let mut rng = SplitMix64(106);
        for n in [0u64].into_iter().chain(row_counts()) {
            for layout in 0..3u64 {
                let l = lists(&mut rng, n, 9);
                let children = 400u64;
                let child_offset = rng.below(5);
                let offsets: Vec<i64> = (0..n).map(|_| rng.below(children - 10) as i64).collect();
                let (bytes, stride, wide) = row_integers(&offsets, layout);
                let rows = RowIntegers {
                    address: p(&bytes),
                    stride,
                    wide,
                };
                let total = l.new_offsets[n as usize] as u64;
                let new_offsets = bytes_of_i64(&l.new_offsets);
                let what = format!("n {n} layout {layout}");
                let _ = (&l.sizes, &l.bitmap, l.bit_offset, l.n);
                // values
                for width in [1u64, 2, 3, 4, 8, 12, 16] {
                    let child = rng.bytes(((children + child_offset) * width) as usize);
                    let mut expected = vec![0x5Au8; (total * width) as usize];
                    // SAFETY: host buffers of the sizes read and written.
                    unsafe {
                        CpuKernels
                            .gather_list_values(
                                p(&child),
                                width,
                                child_offset,
                                rows,
                                n,
                                p(&new_offsets),
                                pm(&mut expected),
                            )
                            .unwrap()
                    };
                    for geo in wave_geometries(total, &mut rng) {
                        let mut mem = TestMem::new();
                        let child_at = AUX + [0, width, 8, rng.below(16)][rng.below(4) as usize];
                        map_read(&mut mem, child_at, &child);
                        let at = SRC + 8;
                        if n > 0 {
                            let len = (n - 1) * stride + if wide { 8 } else { 4 };
                            map_read(&mut mem, at, &bytes[..len as usize]);
                        }
                        map_read(&mut mem, OFFS, &new_offsets);
                        let dst = OUT + [0, width, 8, rng.below(16)][rng.below(4) as usize];
                        mem.map_dst(dst, total * width);
                        let params = [
                            p64(child_at),
                            p64(width),
                            p64(child_offset),
                            p64(at),
                            p64(stride),
                            p32(wide as u32),
                            p64(n),
                            p64(OFFS),
                            p64(dst),
                        ];
                        let what = format!("values {what} width {width} {geo:?}");
                        run(module(), "dvx_gather_list_values", geo, &params, &mem)
                            .unwrap_or_else(|e| panic!("{what}: {e}"));
                        assert_eq!(written(&mem, dst, total * width, &what), expected, "{what}");
                    }
                }
                // bits
                let bit_offset = rng.below(70);
                let bits = rng.bitmap((bit_offset + child_offset + children).div_ceil(8) as usize);
                let words = total.div_ceil(32);
                let mut expected = vec![0x5Au8; 4 * words as usize];
                // SAFETY: as above.
                unsafe {
                    CpuKernels
                        .gather_list_bits(
                            p(&bits),
                            bit_offset + child_offset,
                            rows,
                            n,
                            p(&new_offsets),
                            pm(&mut expected),
                        )
                        .unwrap()
                };
                for geo in wave_geometries(words * 32, &mut rng) {
                    let mut mem = TestMem::new();
                    map_read(&mut mem, BITS, &bits);
                    let at = SRC + 8;
                    if n > 0 {
                        let len = (n - 1) * stride + if wide { 8 } else { 4 };
                        map_read(&mut mem, at, &bytes[..len as usize]);
                    }
                    map_read(&mut mem, OFFS, &new_offsets);
                    let dst = OUT + 4 * rng.below(4);
                    mem.map_dst(dst, 4 * words);
                    let params = [
                        p64(BITS),
                        p64(bit_offset + child_offset),
                        p64(at),
                        p64(stride),
                        p32(wide as u32),
                        p64(n),
                        p64(OFFS),
                        p64(dst),
                    ];
                    let what = format!("bits {what} {geo:?}");
                    run(module(), "dvx_gather_list_bits", geo, &params, &mem)
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                    assert_eq!(written(&mem, dst, 4 * words, &what), expected, "{what}");
                }
            }
        }
    }

    /// `dvx_offsets_to_views` against `CpuKernels::offsets_to_views`: int32 and int64
    /// offsets (a stride wider than the width too), values inline, of exactly 12 and 13
    /// bytes, empty, and long; indices in any order, repeated.
    #[test]
    fn offsets_to_views_match_cpu_kernels() {
        let mut rng = SplitMix64(107);
        for n in [0u64].into_iter().chain(row_counts()) {
            for (stride, wide) in [(4u64, false), (8, true), (16, true)] {
                let values = 1 + rng.below(300);
                let mut offsets = vec![0i64; values as usize + 1];
                for i in 0..values as usize {
                    let len = match rng.below(5) {
                        0 => 0,
                        1 => 12,
                        2 => 13,
                        3 => rng.below(12),
                        _ => 13 + rng.below(40),
                    };
                    offsets[i + 1] = offsets[i] + len as i64;
                }
                let base = rng.below(3) as i64; // offsets need not start at 0
                let data = rng.bytes((offsets[values as usize] + base) as usize);
                let mut offset_bytes = vec![0u8; (values as usize + 1) * stride as usize];
                for (i, o) in offsets.iter().enumerate() {
                    let at = i * stride as usize;
                    if wide {
                        offset_bytes[at..at + 8].copy_from_slice(&(o + base).to_le_bytes());
                    } else {
                        offset_bytes[at..at + 4]
                            .copy_from_slice(&((o + base) as i32).to_le_bytes());
                    }
                }
                let indices: Vec<u8> = (0..n)
                    .flat_map(|_| (rng.below(values) as i32).to_le_bytes())
                    .collect();
                let host_offsets = RowIntegers {
                    address: p(&offset_bytes),
                    stride,
                    wide,
                };
                let mut expected = vec![0u8; 16 * n as usize];
                // SAFETY: host buffers of the sizes read and written.
                unsafe {
                    CpuKernels
                        .offsets_to_views(host_offsets, p(&data), p(&indices), n, pm(&mut expected))
                        .unwrap()
                };
                for geo in geometries(n, &mut rng) {
                    let mut mem = TestMem::new();
                    map_read(&mut mem, OFFS, &offset_bytes);
                    let data_at = SRC + rng.below(16);
                    map_read(&mut mem, data_at, &data);
                    map_read(&mut mem, AUX, &indices);
                    mem.map_dst(OUT, 16 * n);
                    let params = [
                        p64(OFFS),
                        p64(stride),
                        p32(wide as u32),
                        p64(data_at),
                        p64(AUX),
                        p64(n),
                        p64(OUT),
                    ];
                    let what = format!("n {n} stride {stride} wide {wide} {geo:?}");
                    run(module(), "dvx_offsets_to_views", geo, &params, &mem)
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                    let got = written(&mem, OUT, 16 * n, &what);
                    // long views hold the start in the data buffer the CPU read from: the
                    // same start, as both are offsets into `data`
                    assert_eq!(got, expected, "{what}");
                }
            }
        }
    }
}
