//! The interpreter: blocks run in parallel (each on one host thread), the threads of a
//! block one after the other, each until it exits, reaches a collective (`bar.sync`,
//! `shfl.sync`) or reads the clock (`%globaltimer`, so that timed spins overlap); collectives
//! complete once every participant has arrived.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use super::inst::*;
use super::types::{Dims, ExecError, Fault, Memory};

/// The byte shared memory starts filled with.
const SHARED_POISON: u8 = 0xCD;

/// Deepest `.func` call nesting before a thread faults.
const MAX_CALL_DEPTH: usize = 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum Status {
    Ready,
    /// Waiting at `bar.sync` with this barrier id.
    Bar(u32),
    /// Waiting at a warp collective, `shfl.sync` or `vote.sync` (at its `pc`).
    Warp,
    #[default]
    Exited,
}

#[derive(Debug, Clone, Copy)]
struct Frame {
    ret_pc: u32,
    rb: u32,
    pb: u32,
    call: u32,
}

/// One simulated thread: registers and `.param` areas of every frame, call stack, pc.
#[derive(Debug, Default)]
struct Thread {
    pc: u32,
    rb: usize,
    pb: usize,
    regs: Vec<u64>,
    params: Vec<u8>,
    stack: Vec<Frame>,
    status: Status,
    specials: [u64; NSPECIAL],
    tid: [u32; 3],
}

/// What a thread's current frame holds in `slot`.
fn reg(t: &Thread, slot: Slot) -> u64 {
    t.regs[t.rb + slot as usize]
}

/// What one launch sees.
struct Launch<'a> {
    prog: &'a Program,
    kernel: &'a str,
    entry: u32,
    dims: Dims,
    kparams: &'a [u8],
    mem: &'a dyn Memory,
    shared_bytes: usize,
}

/// Per-block state, reused across the blocks one worker runs.
#[derive(Default)]
struct BlockState {
    threads: Vec<Thread>,
    shared: Vec<u8>,
    block: [u32; 3],
    executed: u64,
}

fn ext(v: u64, size: u8, signed: bool, dbits: u8) -> u64 {
    let sb = size as u32 * 8;
    let v = if signed && sb < 64 {
        (((v << (64 - sb)) as i64) >> (64 - sb)) as u64
    } else {
        v
    };
    if dbits >= 64 {
        v
    } else {
        v & ((1u64 << dbits) - 1)
    }
}

/// The little-endian value of 1, 2, 4 or 8 bytes.
#[inline(always)]
fn le(buf: &[u8]) -> u64 {
    match *buf {
        [a] => a as u64,
        [a, b] => u16::from_le_bytes([a, b]) as u64,
        [a, b, c, d] => u32::from_le_bytes([a, b, c, d]) as u64,
        [a, b, c, d, e, f, g, h] => u64::from_le_bytes([a, b, c, d, e, f, g, h]),
        _ => {
            let mut b = [0u8; 8];
            let n = buf.len().min(8);
            b[..n].copy_from_slice(&buf[..n]);
            u64::from_le_bytes(b)
        }
    }
}

fn misaligned(addr: u64, size: usize, store: bool) -> Fault {
    Fault {
        addr,
        size,
        kind: if store {
            "misaligned store"
        } else {
            "misaligned load"
        }
        .into(),
    }
}

/// One atomic read-modify-write of the `size`-byte (4 or 8) word at `addr` of global
/// memory: `update(old)` stored where no other thread wrote in between (a
/// compare-and-swap loop, the read first); the old word. A misaligned word faults.
fn atomic_update(
    mem: &dyn Memory,
    addr: u64,
    size: usize,
    update: impl Fn(u64) -> u64,
) -> Result<u64, Fault> {
    if addr & (size as u64 - 1) != 0 {
        return Err(Fault {
            addr,
            size,
            kind: "misaligned atomic".into(),
        });
    }
    let mut seen = if size == 8 {
        mem.atomic_add_u64(addr, 0)?
    } else {
        u64::from(mem.atomic_add_u32(addr, 0)?)
    };
    loop {
        let new = update(seen);
        let found = if size == 8 {
            mem.atomic_cas_u64(addr, seen, new)?
        } else {
            u64::from(mem.atomic_cas_u32(addr, seen as u32, new as u32)?)
        };
        if found == seen {
            return Ok(seen);
        }
        seen = found;
    }
}

/// [`atomic_update`] of a word of a block's shared memory, whose threads run one at a
/// time: one step.
fn shared_update(
    shared: &mut [u8],
    addr: u64,
    size: usize,
    update: impl Fn(u64) -> u64,
) -> Result<u64, Fault> {
    let rg = shared_range(shared.len(), addr, size, "atomic")?;
    let old = le(&shared[rg.clone()]);
    shared[rg].copy_from_slice(&update(old).to_le_bytes()[..size]);
    Ok(old)
}

/// The byte range of a shared-memory access, bounds- and alignment-checked.
fn shared_range(
    len: usize,
    addr: u64,
    size: usize,
    what: &str,
) -> Result<std::ops::Range<usize>, Fault> {
    if addr & (size as u64 - 1) != 0 {
        return Err(Fault {
            addr,
            size,
            kind: format!("misaligned {what}"),
        });
    }
    match addr.checked_add(size as u64) {
        Some(end) if end <= len as u64 => Ok(addr as usize..end as usize),
        _ => Err(Fault {
            addr,
            size,
            kind: format!("out-of-bounds shared {what}"),
        }),
    }
}

fn load(l: &Launch, shared: &[u8], space: Space, addr: u64, buf: &mut [u8]) -> Result<(), Fault> {
    match space {
        Space::Global => {
            if addr & (buf.len() as u64 - 1) != 0 {
                return Err(misaligned(addr, buf.len(), false));
            }
            l.mem.load(addr, buf)
        }
        Space::Shared => {
            let r = shared_range(shared.len(), addr, buf.len(), "load")?;
            buf.copy_from_slice(&shared[r]);
            Ok(())
        }
    }
}

fn store(l: &Launch, shared: &mut [u8], space: Space, addr: u64, data: &[u8]) -> Result<(), Fault> {
    match space {
        Space::Global => {
            if addr & (data.len() as u64 - 1) != 0 {
                return Err(misaligned(addr, data.len(), true));
            }
            l.mem.store(addr, data)
        }
        Space::Shared => {
            let r = shared_range(shared.len(), addr, data.len(), "store")?;
            shared[r].copy_from_slice(data);
            Ok(())
        }
    }
}

#[inline(always)]
fn alu32(op: AluOp, a: u32, b: u32) -> u32 {
    match op {
        AluOp::Add => a.wrapping_add(b),
        AluOp::Sub => a.wrapping_sub(b),
        AluOp::MulLo => a.wrapping_mul(b),
        AluOp::MulHiU => ((a as u64 * b as u64) >> 32) as u32,
        AluOp::MulHiS => ((a as i32 as i64 * b as i32 as i64) >> 32) as u32,
        AluOp::DivU => a.checked_div(b).unwrap_or(u32::MAX),
        AluOp::DivS => (a as i32)
            .checked_div(b as i32)
            .map_or(u32::MAX, |v| v as u32),
        AluOp::RemU => a.checked_rem(b).unwrap_or(a),
        AluOp::RemS => (a as i32).checked_rem(b as i32).map_or(a, |v| v as u32),
        AluOp::MinU => a.min(b),
        AluOp::MinS => (a as i32).min(b as i32) as u32,
        AluOp::MaxU => a.max(b),
        AluOp::MaxS => (a as i32).max(b as i32) as u32,
        AluOp::And => a & b,
        AluOp::Or => a | b,
        AluOp::Xor => a ^ b,
        AluOp::Shl => a.checked_shl(b).unwrap_or(0),
        AluOp::ShrU => a.checked_shr(b).unwrap_or(0),
        AluOp::ShrS => ((a as i32) >> b.min(31)) as u32,
        // The parser makes binary64 operations 64-bit only.
        AluOp::FAdd | AluOp::FSub | AluOp::FMul | AluOp::FDiv => {
            unreachable!("binary64 arithmetic on 32-bit registers")
        }
    }
}

#[inline(always)]
fn alu64(op: AluOp, a: u64, b: u64) -> u64 {
    match op {
        AluOp::Add => a.wrapping_add(b),
        AluOp::Sub => a.wrapping_sub(b),
        AluOp::MulLo => a.wrapping_mul(b),
        AluOp::MulHiU => ((a as u128 * b as u128) >> 64) as u64,
        AluOp::MulHiS => ((a as i64 as i128 * b as i64 as i128) >> 64) as u64,
        AluOp::DivU => a.checked_div(b).unwrap_or(u64::MAX),
        AluOp::DivS => (a as i64)
            .checked_div(b as i64)
            .map_or(u64::MAX, |v| v as u64),
        AluOp::RemU => a.checked_rem(b).unwrap_or(a),
        AluOp::RemS => (a as i64).checked_rem(b as i64).map_or(a, |v| v as u64),
        AluOp::MinU => a.min(b),
        AluOp::MinS => (a as i64).min(b as i64) as u64,
        AluOp::MaxU => a.max(b),
        AluOp::MaxS => (a as i64).max(b as i64) as u64,
        AluOp::And => a & b,
        AluOp::Or => a | b,
        AluOp::Xor => a ^ b,
        // the shift amount is a .u32 operand; amounts >= 64 clamp
        AluOp::Shl => a.checked_shl(b as u32).filter(|_| b < 64).unwrap_or(0),
        AluOp::ShrU => a.checked_shr(b as u32).filter(|_| b < 64).unwrap_or(0),
        AluOp::ShrS => ((a as i64) >> (b as u32).min(63)) as u64,
        AluOp::FAdd => (f64::from_bits(a) + f64::from_bits(b)).to_bits(),
        AluOp::FSub => (f64::from_bits(a) - f64::from_bits(b)).to_bits(),
        AluOp::FMul => (f64::from_bits(a) * f64::from_bits(b)).to_bits(),
        AluOp::FDiv => (f64::from_bits(a) / f64::from_bits(b)).to_bits(),
    }
}

fn un32(op: UnOp, a: u32) -> u32 {
    match op {
        UnOp::Not => !a,
        UnOp::Neg => a.wrapping_neg(),
        UnOp::Abs => (a as i32).wrapping_abs() as u32,
        UnOp::Popc => a.count_ones(),
        UnOp::Clz => a.leading_zeros(),
        UnOp::Brev => a.reverse_bits(),
    }
}

fn un64(op: UnOp, a: u64) -> u64 {
    match op {
        UnOp::Not => !a,
        UnOp::Neg => a.wrapping_neg(),
        UnOp::Abs => (a as i64).wrapping_abs() as u64,
        UnOp::Popc => a.count_ones() as u64,
        UnOp::Clz => a.leading_zeros() as u64,
        UnOp::Brev => a.reverse_bits(),
    }
}

fn cmp32(c: Cmp, a: u32, b: u32) -> bool {
    match c {
        Cmp::Eq => a == b,
        Cmp::Ne => a != b,
        Cmp::LtU => a < b,
        Cmp::LeU => a <= b,
        Cmp::GtU => a > b,
        Cmp::GeU => a >= b,
        Cmp::LtS => (a as i32) < (b as i32),
        Cmp::LeS => (a as i32) <= (b as i32),
        Cmp::GtS => (a as i32) > (b as i32),
        Cmp::GeS => (a as i32) >= (b as i32),
    }
}

fn cmp64(c: Cmp, a: u64, b: u64) -> bool {
    match c {
        Cmp::Eq => a == b,
        Cmp::Ne => a != b,
        Cmp::LtU => a < b,
        Cmp::LeU => a <= b,
        Cmp::GtU => a > b,
        Cmp::GeU => a >= b,
        Cmp::LtS => (a as i64) < (b as i64),
        Cmp::LeS => (a as i64) <= (b as i64),
        Cmp::GtS => (a as i64) > (b as i64),
        Cmp::GeS => (a as i64) >= (b as i64),
    }
}

fn boolop(op: BoolOp, a: bool, b: bool) -> bool {
    match op {
        BoolOp::And => a & b,
        BoolOp::Or => a | b,
        BoolOp::Xor => a ^ b,
    }
}

fn low_mask(n: u32) -> u64 {
    if n >= 64 {
        u64::MAX
    } else {
        (1u64 << n) - 1
    }
}

/// `bfe`: `len` bits of `a` (`bits` wide) from `pos` (both taken modulo 256), zero- or
/// sign-extended (from bit `min(pos + len - 1, msb)`) to `bits`.
fn bfe(a: u64, pos: u32, len: u32, signed: bool, bits: u32) -> u64 {
    let pos = pos & 0xff;
    let len = len & 0xff;
    if len == 0 {
        return 0;
    }
    let msb = bits - 1;
    // the bits that come from `a`
    let n = if pos > msb { 0 } else { len.min(bits - pos) };
    let field = if n == 0 { 0 } else { (a >> pos) & low_mask(n) };
    let sbit = signed && (a >> (pos + len - 1).min(msb)) & 1 == 1;
    if sbit {
        (field | !low_mask(n)) & low_mask(bits)
    } else {
        field
    }
}

/// `bfi`: `b` with the bits `[pos, pos + len)` (those below `bits`) replaced by the low
/// bits of `a`.
fn bfi(a: u64, b: u64, pos: u32, len: u32, bits: u32) -> u64 {
    let pos = pos & 0xff;
    let len = len & 0xff;
    if pos >= bits {
        return b;
    }
    let m = low_mask(len.min(bits - pos)) << pos;
    (b & !m) | ((a << pos) & m)
}

/// `shf.{l,r}.{clamp,wrap}.b32 d, a, b, c`.
fn shf(left: bool, clamp: bool, a: u32, b: u32, c: u32) -> u32 {
    let n = if clamp { c.min(32) } else { c & 31 };
    let x = ((b as u64) << 32) | a as u64;
    if left {
        ((x << n) >> 32) as u32
    } else {
        (x >> n) as u32
    }
}

/// Writes the low `size` (1, 2, 4 or 8) bytes of `v` at `buf[off..]`, little-endian.
#[inline(always)]
fn write_bytes(buf: &mut [u8], off: usize, v: u64, size: usize) {
    match size {
        1 => buf[off] = v as u8,
        2 => buf[off..off + 2].copy_from_slice(&(v as u16).to_le_bytes()),
        4 => buf[off..off + 4].copy_from_slice(&(v as u32).to_le_bytes()),
        8 => buf[off..off + 8].copy_from_slice(&v.to_le_bytes()),
        _ => buf[off..off + size].copy_from_slice(&v.to_le_bytes()[..size.min(8)]),
    }
}

/// Copies `size` bytes within `buf` (parameter passing: usually one scalar).
#[inline(always)]
fn copy_param(buf: &mut [u8], src: usize, dst: usize, size: usize) {
    if size <= 8 && size.is_power_of_two() {
        let v = le(&buf[src..src + size]);
        write_bytes(buf, dst, v, size);
    } else {
        buf.copy_within(src..src + size, dst);
    }
}

impl Launch<'_> {
    fn fault(&self, st: &BlockState, tid: [u32; 3], pc: usize, fault: Fault) -> ExecError {
        ExecError::Fault {
            fault,
            thread: tid,
            block: st.block,
            kernel: self.kernel.to_string(),
            instruction: self.prog.text.get(pc).cloned().unwrap_or_default(),
        }
    }

    /// Runs thread `i` until it exits or waits at a collective.
    /// A fault comes back with the pc of the faulting instruction.
    fn run(&self, st: &mut BlockState, i: usize) -> Result<Status, (usize, Fault)> {
        let prog = self.prog;
        let code = &prog.code[..];
        let BlockState {
            threads,
            shared,
            executed,
            ..
        } = st;
        let t = &mut threads[i];
        let mut pc = t.pc as usize;
        let mut rb = t.rb;
        let mut pb = t.pb;
        let regs = &mut t.regs;
        let params = &mut t.params;
        let stack = &mut t.stack;
        let mut count: u64 = 0;
        // the current frame's registers (re-sliced after calls and returns)
        let mut fr: &mut [u64] = &mut regs[rb..];
        macro_rules! r {
            ($s:expr) => {
                fr[$s as usize]
            };
        }
        macro_rules! fail {
            ($f:expr) => {{
                *executed += count;
                return Err((pc, $f));
            }};
        }
        let status = loop {
            let inst = &code[pc];
            count += 1;
            if inst.guard != NO_SLOT && (r!(inst.guard) != 0) == inst.guard_neg {
                pc += 1;
                continue;
            }
            match &inst.op {
                Op::Nop => {}
                Op::Mov { d, a } => r!(*d) = r!(*a),
                Op::Pack { d, lo, hi } => r!(*d) = (r!(*lo) & 0xFFFF_FFFF) | (r!(*hi) << 32),
                Op::Unpack { lo, hi, a } => {
                    let v = r!(*a);
                    r!(*lo) = v & 0xFFFF_FFFF;
                    r!(*hi) = v >> 32;
                }
                Op::Timer { d } => {
                    // A thread that reads the clock yields: threads of a block then take
                    // turns through a timed spin (as they would run at once on a GPU)
                    // instead of each spinning its full time after the one before.
                    r!(*d) = self.mem.global_timer_ns();
                    pc += 1;
                    break Status::Ready;
                }
                Op::Alu32 { op, d, a, b } => {
                    r!(*d) = alu32(*op, r!(*a) as u32, r!(*b) as u32) as u64
                }
                Op::Alu64 { op, d, a, b } => r!(*d) = alu64(*op, r!(*a), r!(*b)),
                Op::Un32 { op, d, a } => r!(*d) = un32(*op, r!(*a) as u32) as u64,
                Op::Un64 { op, d, a } => r!(*d) = un64(*op, r!(*a)),
                Op::MulWide { signed, d, a, b } => {
                    let (x, y) = (r!(*a) as u32, r!(*b) as u32);
                    r!(*d) = if *signed {
                        (x as i32 as i64).wrapping_mul(y as i32 as i64) as u64
                    } else {
                        x as u64 * y as u64
                    };
                }
                Op::Mad { wide, d, a, b, c } => {
                    r!(*d) = if *wide {
                        r!(*a).wrapping_mul(r!(*b)).wrapping_add(r!(*c))
                    } else {
                        (r!(*a) as u32)
                            .wrapping_mul(r!(*b) as u32)
                            .wrapping_add(r!(*c) as u32) as u64
                    };
                }
                Op::Bfe {
                    wide,
                    signed,
                    d,
                    a,
                    b,
                    c,
                } => {
                    let bits = if *wide { 64 } else { 32 };
                    let v = if *wide { r!(*a) } else { r!(*a) & 0xFFFF_FFFF };
                    let x = bfe(v, r!(*b) as u32, r!(*c) as u32, *signed, bits);
                    r!(*d) = if *wide { x } else { x & 0xFFFF_FFFF };
                }
                Op::Bfi {
                    wide,
                    d,
                    a,
                    b,
                    pos,
                    len,
                } => {
                    let bits = if *wide { 64 } else { 32 };
                    let x = bfi(r!(*a), r!(*b), r!(*pos) as u32, r!(*len) as u32, bits);
                    r!(*d) = if *wide { x } else { x & 0xFFFF_FFFF };
                }
                Op::Shf {
                    left,
                    clamp,
                    d,
                    a,
                    b,
                    c,
                } => {
                    r!(*d) = shf(*left, *clamp, r!(*a) as u32, r!(*b) as u32, r!(*c) as u32) as u64;
                }
                Op::Selp { d, a, b, p } => r!(*d) = if r!(*p) != 0 { r!(*a) } else { r!(*b) },
                Op::Setp32 { cmp, d, a, b } => {
                    r!(*d) = cmp32(*cmp, r!(*a) as u32, r!(*b) as u32) as u64
                }
                Op::Setp64 { cmp, d, a, b } => r!(*d) = cmp64(*cmp, r!(*a), r!(*b)) as u64,
                Op::SetpFull(s) => {
                    let mut v = if s.wide {
                        cmp64(s.cmp, r!(s.a), r!(s.b))
                    } else {
                        cmp32(s.cmp, r!(s.a) as u32, r!(s.b) as u32)
                    };
                    let mut nv = !v;
                    if let Some(op) = s.bop {
                        let c = (r!(s.c) != 0) != s.c_neg;
                        v = boolop(op, v, c);
                        nv = boolop(op, nv, c);
                    }
                    r!(s.d) = v as u64;
                    if s.q != NO_SLOT {
                        r!(s.q) = nv as u64;
                    }
                }
                Op::PredLogic {
                    op,
                    d,
                    a,
                    b,
                    a_neg,
                    b_neg,
                } => r!(*d) = boolop(*op, (r!(*a) != 0) != *a_neg, (r!(*b) != 0) != *b_neg) as u64,
                Op::PredNot { d, a } => r!(*d) = (r!(*a) == 0) as u64,
                Op::CvtF64S64 { d, a } => r!(*d) = (r!(*a) as i64 as f64).to_bits(),
                Op::CvtF64U64 { d, a } => r!(*d) = (r!(*a) as f64).to_bits(),
                // Rust's `as` truncates, saturates and makes NaN 0, as PTX documents.
                Op::CvtS64F64Rzi { d, a } => r!(*d) = f64::from_bits(r!(*a)) as i64 as u64,
                Op::CvtF64F64 { d, a, mode } => {
                    let v = f64::from_bits(r!(*a));
                    r!(*d) = match mode {
                        IntegralRound::NearestEven => v.round_ties_even(),
                        IntegralRound::Zero => v.trunc(),
                        IntegralRound::Down => v.floor(),
                        IntegralRound::Up => v.ceil(),
                    }
                    .to_bits()
                }
                Op::SqrtF64 { d, a } => r!(*d) = f64::from_bits(r!(*a)).sqrt().to_bits(),
                Op::Cvt {
                    d,
                    a,
                    sbits,
                    ssigned,
                    dbits,
                } => {
                    let v = ext(
                        r!(*a),
                        *sbits / 8,
                        *ssigned,
                        if *ssigned { 64 } else { *sbits },
                    );
                    r!(*d) = ext(v, 8, false, *dbits);
                }
                Op::Ld {
                    space,
                    size,
                    signed,
                    dbits,
                    d,
                    base,
                    off,
                } => {
                    let addr = r!(*base).wrapping_add(*off as u64);
                    let mut buf = [0u8; 8];
                    let buf = &mut buf[..*size as usize];
                    if let Err(f) = load(self, shared, *space, addr, buf) {
                        fail!(f);
                    }
                    r!(*d) = ext(le(buf), *size, *signed, *dbits);
                }
                Op::St {
                    space,
                    size,
                    a,
                    base,
                    off,
                } => {
                    let addr = r!(*base).wrapping_add(*off as u64);
                    let bytes = r!(*a).to_le_bytes();
                    if let Err(f) = store(self, shared, *space, addr, &bytes[..*size as usize]) {
                        fail!(f);
                    }
                }
                Op::LdV {
                    space,
                    esize,
                    n,
                    d,
                    base,
                    off,
                } => {
                    let addr = r!(*base).wrapping_add(*off as u64);
                    let es = *esize as usize;
                    let mut buf = [0u8; 16];
                    let buf = &mut buf[..es * *n as usize];
                    if let Err(f) = load(self, shared, *space, addr, buf) {
                        fail!(f);
                    }
                    for (k, &s) in d.iter().take(*n as usize).enumerate() {
                        r!(s) = le(&buf[k * es..(k + 1) * es]);
                    }
                }
                Op::StV {
                    space,
                    esize,
                    n,
                    a,
                    base,
                    off,
                } => {
                    let addr = r!(*base).wrapping_add(*off as u64);
                    let es = *esize as usize;
                    let mut buf = [0u8; 16];
                    for (k, &s) in a.iter().take(*n as usize).enumerate() {
                        write_bytes(&mut buf, k * es, r!(s), es);
                    }
                    if let Err(f) = store(self, shared, *space, addr, &buf[..es * *n as usize]) {
                        fail!(f);
                    }
                }
                Op::LdParam {
                    kernel,
                    size,
                    signed,
                    dbits,
                    d,
                    off,
                } => {
                    let o = *off as usize;
                    let sz = *size as usize;
                    let v = if *kernel {
                        le(&self.kparams[o..o + sz])
                    } else {
                        le(&params[pb + o..pb + o + sz])
                    };
                    r!(*d) = ext(v, *size, *signed, *dbits);
                }
                Op::StParam { size, a, off } => {
                    write_bytes(params, pb + *off as usize, r!(*a), *size as usize)
                }
                Op::AtomAdd {
                    space,
                    size,
                    d,
                    base,
                    off,
                    b,
                } => {
                    let addr = r!(*base).wrapping_add(*off as u64);
                    let sz = *size as usize;
                    let v = r!(*b);
                    let old = match space {
                        Space::Global => {
                            if addr & (sz as u64 - 1) != 0 {
                                fail!(Fault {
                                    addr,
                                    size: sz,
                                    kind: "misaligned atomic".into()
                                });
                            }
                            let res = if sz == 8 {
                                self.mem.atomic_add_u64(addr, v)
                            } else {
                                self.mem.atomic_add_u32(addr, v as u32).map(|x| x as u64)
                            };
                            match res {
                                Ok(x) => x,
                                Err(f) => fail!(f),
                            }
                        }
                        Space::Shared => match shared_range(shared.len(), addr, sz, "atomic") {
                            Ok(rg) => {
                                let old = le(&shared[rg.clone()]);
                                let new = old.wrapping_add(v);
                                shared[rg].copy_from_slice(&new.to_le_bytes()[..sz]);
                                old
                            }
                            Err(f) => fail!(f),
                        },
                    };
                    if *d != NO_SLOT {
                        r!(*d) = old;
                    }
                }
                Op::AtomAddF64 {
                    space,
                    d,
                    base,
                    off,
                    b,
                } => {
                    let addr = r!(*base).wrapping_add(*off as u64);
                    let v = f64::from_bits(r!(*b));
                    let add = |old: u64| (f64::from_bits(old) + v).to_bits();
                    let old = match space {
                        Space::Global => match atomic_update(self.mem, addr, 8, add) {
                            Ok(x) => x,
                            Err(f) => fail!(f),
                        },
                        Space::Shared => match shared_update(shared, addr, 8, add) {
                            Ok(x) => x,
                            Err(f) => fail!(f),
                        },
                    };
                    if *d != NO_SLOT {
                        r!(*d) = old;
                    }
                }
                Op::AtomBits {
                    space,
                    size,
                    op,
                    d,
                    base,
                    off,
                    b,
                } => {
                    let addr = r!(*base).wrapping_add(*off as u64);
                    let sz = *size as usize;
                    let mask = if sz == 8 { u64::MAX } else { u32::MAX as u64 };
                    let v = r!(*b) & mask;
                    let old = match space {
                        Space::Global => {
                            match atomic_update(self.mem, addr, sz, |old| op.apply(old, v)) {
                                Ok(x) => x,
                                Err(f) => fail!(f),
                            }
                        }
                        Space::Shared => {
                            match shared_update(shared, addr, sz, |old| op.apply(old, v)) {
                                Ok(x) => x,
                                Err(f) => fail!(f),
                            }
                        }
                    };
                    if *d != NO_SLOT {
                        r!(*d) = old;
                    }
                }
                Op::AtomCas {
                    space,
                    size,
                    d,
                    base,
                    off,
                    b,
                    c,
                } => {
                    let addr = r!(*base).wrapping_add(*off as u64);
                    let sz = *size as usize;
                    let mask = if sz == 8 { u64::MAX } else { u32::MAX as u64 };
                    let (expected, new) = (r!(*b) & mask, r!(*c) & mask);
                    let old = match space {
                        Space::Global => {
                            if addr & (sz as u64 - 1) != 0 {
                                fail!(Fault {
                                    addr,
                                    size: sz,
                                    kind: "misaligned atomic".into()
                                });
                            }
                            let res = if sz == 8 {
                                self.mem.atomic_cas_u64(addr, expected, new)
                            } else {
                                self.mem
                                    .atomic_cas_u32(addr, expected as u32, new as u32)
                                    .map(|x| x as u64)
                            };
                            match res {
                                Ok(x) => x,
                                Err(f) => fail!(f),
                            }
                        }
                        // A block's threads run one at a time: the read, compare and
                        // write are one step.
                        Space::Shared => match shared_range(shared.len(), addr, sz, "atomic") {
                            Ok(rg) => {
                                let old = le(&shared[rg.clone()]);
                                if old == expected {
                                    shared[rg].copy_from_slice(&new.to_le_bytes()[..sz]);
                                }
                                old
                            }
                            Err(f) => fail!(f),
                        },
                    };
                    r!(*d) = old;
                }
                Op::Bra { target } => {
                    pc = *target as usize;
                    continue;
                }
                Op::Call { info } => {
                    let ci = &prog.calls[*info as usize];
                    let callee = &prog.funcs[ci.func as usize];
                    if stack.len() >= MAX_CALL_DEPTH {
                        fail!(Fault {
                            addr: 0,
                            size: 0,
                            kind: "call stack overflow".into()
                        });
                    }
                    let nrb = regs.len();
                    let npb = params.len();
                    // the callee's frame: the same special registers, then its own slots
                    regs.extend_from_within(rb..rb + NSPECIAL);
                    regs.extend_from_slice(&callee.init[NSPECIAL..]);
                    params.resize(npb + callee.param_bytes as usize, 0);
                    for (arg, &(foff, fsize)) in ci.args.iter().zip(&callee.args) {
                        let dst = npb + foff as usize;
                        match *arg {
                            ArgRef::Param { off, .. } => {
                                let src = pb + off as usize;
                                copy_param(params, src, dst, fsize as usize);
                            }
                            ArgRef::Slot { slot, .. } => {
                                write_bytes(params, dst, regs[rb + slot as usize], fsize as usize)
                            }
                        }
                    }
                    stack.push(Frame {
                        ret_pc: pc as u32 + 1,
                        rb: rb as u32,
                        pb: pb as u32,
                        call: *info,
                    });
                    rb = nrb;
                    pb = npb;
                    fr = &mut regs[rb..];
                    pc = callee.entry_pc as usize;
                    continue;
                }
                Op::Ret => {
                    let Some(frame) = stack.pop() else {
                        break Status::Exited;
                    };
                    let ci = &prog.calls[frame.call as usize];
                    let callee = &prog.funcs[ci.func as usize];
                    let (crb, cpb) = (frame.rb as usize, frame.pb as usize);
                    for (ret, &(foff, fsize)) in ci.rets.iter().zip(&callee.rets) {
                        let src = pb + foff as usize;
                        match *ret {
                            ArgRef::Param { off, .. } => {
                                copy_param(params, src, cpb + off as usize, fsize as usize);
                            }
                            ArgRef::Slot { slot, .. } => {
                                regs[crb + slot as usize] = le(&params[src..src + fsize as usize]);
                            }
                        }
                    }
                    regs.truncate(rb);
                    params.truncate(pb);
                    rb = crb;
                    pb = cpb;
                    fr = &mut regs[rb..];
                    pc = frame.ret_pc as usize;
                    continue;
                }
                Op::Exit => break Status::Exited,
                Op::Bar { id } => break Status::Bar(r!(*id) as u32),
                Op::Shfl { .. } | Op::Vote { .. } => break Status::Warp,
            }
            pc += 1;
        };
        *executed += count;
        t.pc = pc as u32;
        t.rb = rb;
        t.pb = pb;
        Ok(status)
    }

    /// Completes the warp collectives (`shfl.sync`, `vote.sync`) of warp `w` whose
    /// participants have all arrived.
    fn resolve_warp(&self, st: &mut BlockState, w: usize) -> Result<bool, ExecError> {
        let code = &self.prog.code;
        let lo = w * 32;
        let n = (st.threads.len() - lo).min(32);
        let lanes = &mut st.threads[lo..lo + n];
        let mask_of = |t: &Thread| -> Option<u32> {
            match (&t.status, &code[t.pc as usize].op) {
                (Status::Warp, Op::Shfl { mask, .. } | Op::Vote { mask, .. }) => {
                    Some(reg(t, *mask) as u32)
                }
                _ => None,
            }
        };
        let is_vote = |t: &Thread| matches!(code[t.pc as usize].op, Op::Vote { .. });
        let mut progress = false;
        let mut done = 0u32;
        for lane in 0..n {
            if done & (1 << lane) != 0 {
                continue;
            }
            let Some(m) = mask_of(&lanes[lane]) else {
                continue;
            };
            if m & (1 << lane) == 0 {
                return Err(ExecError::Deadlock {
                    kernel: self.kernel.to_string(),
                    detail: format!(
                        "thread {:?} of block {:?} executes `{}` with membermask {m:#010x}, which does not include its own lane {lane}",
                        lanes[lane].tid,
                        st.block,
                        self.prog.text[lanes[lane].pc as usize]
                    ),
                });
            }
            let ready =
                (0..32).all(|j| m & (1 << j) == 0 || (j < n && mask_of(&lanes[j]) == Some(m)));
            if !ready {
                continue;
            }
            let vote = is_vote(&lanes[lane]);
            if let Some(j) = (0..n).find(|&j| m & (1 << j) != 0 && is_vote(&lanes[j]) != vote) {
                // undefined on the hardware: one lane votes while another shuffles
                return Err(ExecError::Deadlock {
                    kernel: self.kernel.to_string(),
                    detail: format!(
                        "lanes {lane} and {j} of a warp of block {:?} meet with membermask {m:#010x} at different warp collectives: `{}` and `{}`",
                        st.block,
                        self.prog.text[lanes[lane].pc as usize],
                        self.prog.text[lanes[j].pc as usize]
                    ),
                });
            }
            if vote {
                Self::complete_vote(code, lanes, m);
            } else {
                Self::complete_shfl(code, lanes, m);
            }
            done |= m;
            progress = true;
        }
        Ok(progress)
    }

    /// Completes a `shfl.sync` of the lanes of mask `m`, all waiting at one.
    fn complete_shfl(code: &[Inst], lanes: &mut [Thread], m: u32) {
        let mut vals = [0u32; 32];
        for (j, t) in lanes.iter().enumerate() {
            if m & (1 << j) != 0 {
                if let Op::Shfl { a, .. } = code[t.pc as usize].op {
                    vals[j] = reg(t, a) as u32;
                }
            }
        }
        for (i, t) in lanes.iter_mut().enumerate() {
            if m & (1 << i) == 0 {
                continue;
            }
            let Op::Shfl {
                mode, d, p, b, c, ..
            } = code[t.pc as usize].op
            else {
                continue;
            };
            let bval = (reg(t, b) & 31) as i32;
            let cv = reg(t, c) as u32;
            let cval = (cv & 31) as i32;
            let segmask = ((cv >> 8) & 31) as i32;
            let lane_i = i as i32;
            let max_lane = (lane_i & segmask) | (cval & !segmask);
            let min_lane = lane_i & segmask;
            let (j, pval) = match mode {
                ShflMode::Up => (lane_i - bval, lane_i - bval >= max_lane),
                ShflMode::Down => (lane_i + bval, lane_i + bval <= max_lane),
                ShflMode::Bfly => (lane_i ^ bval, (lane_i ^ bval) <= max_lane),
                ShflMode::Idx => {
                    let j = min_lane | (bval & !segmask);
                    (j, j <= max_lane)
                }
            };
            let j = if pval { j } else { lane_i };
            // a source lane outside the participants gives an undefined value: 0
            let v = if (0..32).contains(&j) && m & (1 << j) != 0 {
                vals[j as usize]
            } else {
                0
            };
            t.regs[t.rb + d as usize] = v as u64;
            if p != NO_SLOT {
                t.regs[t.rb + p as usize] = pval as u64;
            }
            t.pc += 1;
            t.status = Status::Ready;
        }
    }

    /// Completes a `vote.sync` of the lanes of mask `m`, all waiting at one: each lane's
    /// (possibly negated) predicate, combined over the mask.
    fn complete_vote(code: &[Inst], lanes: &mut [Thread], m: u32) {
        let mut ballot = 0u32;
        for (j, t) in lanes.iter().enumerate() {
            if m & (1 << j) != 0 {
                if let Op::Vote { a, a_neg, .. } = code[t.pc as usize].op {
                    if (reg(t, a) != 0) != a_neg {
                        ballot |= 1 << j;
                    }
                }
            }
        }
        for (i, t) in lanes.iter_mut().enumerate() {
            if m & (1 << i) == 0 {
                continue;
            }
            let Op::Vote { mode, d, .. } = code[t.pc as usize].op else {
                continue;
            };
            let v = match mode {
                VoteMode::All => (ballot == m) as u64,
                VoteMode::Any => (ballot != 0) as u64,
                VoteMode::Uni => (ballot == 0 || ballot == m) as u64,
                VoteMode::Ballot => ballot as u64,
            };
            t.regs[t.rb + d as usize] = v;
            t.pc += 1;
            t.status = Status::Ready;
        }
    }

    /// Releases a `bar.sync` once every non-exited thread of the block waits at it.
    fn resolve_bar(st: &mut BlockState) -> bool {
        let mut id = None;
        for t in &st.threads {
            match t.status {
                Status::Bar(i) => {
                    if id.is_some_and(|x| x != i) {
                        return false;
                    }
                    id = Some(i);
                }
                Status::Exited => {}
                _ => return false,
            }
        }
        if id.is_none() {
            return false;
        }
        for t in &mut st.threads {
            if let Status::Bar(_) = t.status {
                t.pc += 1;
                t.status = Status::Ready;
            }
        }
        true
    }

    fn deadlock(&self, st: &BlockState) -> ExecError {
        let mut waiting = Vec::new();
        let mut exited = 0;
        for t in &st.threads {
            match t.status {
                Status::Exited => exited += 1,
                _ => waiting.push(t),
            }
        }
        let mut detail = format!(
            "block {:?}: {} threads can never continue ({exited} exited)",
            st.block,
            waiting.len()
        );
        for t in waiting.iter().take(4) {
            detail.push_str(&format!(
                "; thread {:?} waits at `{}`",
                t.tid,
                self.prog
                    .text
                    .get(t.pc as usize)
                    .map_or("?", |s| s.as_str())
            ));
        }
        ExecError::Deadlock {
            kernel: self.kernel.to_string(),
            detail,
        }
    }

    fn run_block(&self, st: &mut BlockState, block: [u32; 3]) -> Result<(), ExecError> {
        let func = &self.prog.funcs[self.entry as usize];
        let [bx, by, bz] = self.dims.block;
        let nthreads = (bx * by * bz) as usize;
        let nwarps = nthreads.div_ceil(32);
        st.block = block;
        // shared memory is undefined at block start: junk, not zeros
        st.shared.clear();
        st.shared.resize(self.shared_bytes, SHARED_POISON);
        st.threads.resize_with(nthreads, Thread::default);
        for (i, t) in st.threads.iter_mut().enumerate() {
            let i32_ = i as u32;
            t.tid = [i32_ % bx, (i32_ / bx) % by, i32_ / (bx * by)];
            let g = self.dims.grid;
            t.specials = [
                t.tid[0] as u64,
                t.tid[1] as u64,
                t.tid[2] as u64,
                bx as u64,
                by as u64,
                bz as u64,
                block[0] as u64,
                block[1] as u64,
                block[2] as u64,
                g[0] as u64,
                g[1] as u64,
                g[2] as u64,
                (i % 32) as u64,
                (i / 32) as u64,
                nwarps as u64,
            ];
            t.regs.clear();
            t.regs.extend_from_slice(&func.init);
            t.regs[..NSPECIAL].copy_from_slice(&t.specials);
            t.params.clear();
            t.params.resize(func.param_bytes as usize, 0);
            t.stack.clear();
            t.pc = func.entry_pc;
            t.rb = 0;
            t.pb = 0;
            t.status = Status::Ready;
        }
        loop {
            // a thread that yielded (read the clock) is still ready: that is progress
            let mut progress = false;
            for i in 0..nthreads {
                if st.threads[i].status == Status::Ready {
                    let s = self
                        .run(st, i)
                        .map_err(|(pc, f)| self.fault(st, st.threads[i].tid, pc, f))?;
                    st.threads[i].status = s;
                    progress |= s == Status::Ready;
                }
            }
            if st.threads.iter().all(|t| t.status == Status::Exited) {
                return Ok(());
            }
            for w in 0..nwarps {
                progress |= self.resolve_warp(st, w)?;
            }
            progress |= Self::resolve_bar(st);
            if !progress {
                return Err(self.deadlock(st));
            }
        }
    }
}

/// Runs kernel `entry` over the whole grid with up to `workers` host threads; returns the
/// number of instructions executed.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch(
    prog: &Program,
    kernel: &str,
    entry: u32,
    dims: Dims,
    kparams: &[u8],
    mem: &dyn Memory,
    shared_bytes: usize,
    workers: usize,
) -> Result<u64, ExecError> {
    let l = Launch {
        prog,
        kernel,
        entry,
        dims,
        kparams,
        mem,
        shared_bytes,
    };
    let [gx, gy, gz] = dims.grid.map(|v| v as u64);
    let nblocks = gx * gy * gz;
    let index = |i: u64| {
        [
            (i % gx) as u32,
            ((i / gx) % gy) as u32,
            (i / (gx * gy)) as u32,
        ]
    };
    let workers = (workers.max(1) as u64).min(nblocks) as usize;
    if workers <= 1 {
        let mut st = BlockState::default();
        for i in 0..nblocks {
            l.run_block(&mut st, index(i))?;
        }
        return Ok(st.executed);
    }
    let next = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    let first_err: Mutex<Option<(u64, ExecError)>> = Mutex::new(None);
    let total = AtomicU64::new(0);
    let work = || {
        let mut st = BlockState::default();
        while !stop.load(Ordering::Relaxed) {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= nblocks {
                break;
            }
            if let Err(e) = l.run_block(&mut st, index(i)) {
                stop.store(true, Ordering::Relaxed);
                let mut g = first_err.lock().unwrap_or_else(|p| p.into_inner());
                if g.as_ref().is_none_or(|(j, _)| i < *j) {
                    *g = Some((i, e));
                }
                break;
            }
        }
        total.fetch_add(st.executed, Ordering::Relaxed);
    };
    std::thread::scope(|s| {
        // the calling thread is one of the workers; fewer helpers if the OS refuses some
        for _ in 1..workers {
            if std::thread::Builder::new()
                .name("ptx-block".into())
                .spawn_scoped(s, work)
                .is_err()
            {
                break;
            }
        }
        work();
    });
    match first_err.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some((_, e)) => Err(e),
        None => Ok(total.load(Ordering::Relaxed)),
    }
}
