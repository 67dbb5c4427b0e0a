//! The pre-decoded form of a PTX module: instructions whose operands are register slot
//! indices (immediates and special registers are slots too), branch targets that are
//! instruction indices, and calls that index a table of argument layouts.

/// A register slot of the current frame.
pub(crate) type Slot = u32;

/// "No register" (an unguarded instruction, an unused destination).
pub(crate) const NO_SLOT: Slot = u32::MAX;

/// Special registers live in the first slots of every frame, in this order.
pub(crate) const SPECIALS: [&str; 15] = [
    "%tid.x",
    "%tid.y",
    "%tid.z",
    "%ntid.x",
    "%ntid.y",
    "%ntid.z",
    "%ctaid.x",
    "%ctaid.y",
    "%ctaid.z",
    "%nctaid.x",
    "%nctaid.y",
    "%nctaid.z",
    "%laneid",
    "%warpid",
    "%nwarpid",
];

/// Number of special-register slots at the start of every frame.
pub(crate) const NSPECIAL: usize = SPECIALS.len();

/// Two-operand integer operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AluOp {
    Add,
    Sub,
    MulLo,
    MulHiU,
    MulHiS,
    DivU,
    DivS,
    RemU,
    RemS,
    MinU,
    MinS,
    MaxU,
    MaxS,
    And,
    Or,
    Xor,
    Shl,
    ShrU,
    ShrS,
    /// `{add,sub,mul,div}.rn.f64` on the registers' bits: IEEE 754 binary64, rounded to
    /// the nearest even (64-bit only).
    FAdd,
    FSub,
    FMul,
    FDiv,
}

/// One-operand integer operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum UnOp {
    Not,
    Neg,
    Abs,
    Popc,
    Clz,
    Brev,
}

/// Integer comparisons of `setp`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cmp {
    Eq,
    Ne,
    LtU,
    LeU,
    GtU,
    GeU,
    LtS,
    LeS,
    GtS,
    GeS,
}

/// Predicate combinations (`and.pred`, `setp.*.and`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BoolOp {
    And,
    Or,
    Xor,
}

/// Memory state spaces reached through an address register.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Space {
    Global,
    Shared,
}

/// `shfl.sync` modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ShflMode {
    Up,
    Down,
    Bfly,
    Idx,
}

/// `vote.sync` modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum VoteMode {
    All,
    Any,
    Uni,
    Ballot,
}

/// `setp` with a predicate combination and/or a second (complement) destination.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SetpFull {
    pub cmp: Cmp,
    pub wide: bool,
    pub d: Slot,
    /// Complement destination or [`NO_SLOT`].
    pub q: Slot,
    pub a: Slot,
    pub b: Slot,
    /// Combination with predicate `c` (negated when `c_neg`).
    pub bop: Option<BoolOp>,
    pub c: Slot,
    pub c_neg: bool,
}

/// One decoded operation.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Op {
    Nop,
    /// `d = a` (64-bit slot copy; sources are canonical for their width).
    Mov {
        d: Slot,
        a: Slot,
    },
    /// `mov.b64 d, {lo, hi}`.
    Pack {
        d: Slot,
        lo: Slot,
        hi: Slot,
    },
    /// `mov.b64 {lo, hi}, a`.
    Unpack {
        lo: Slot,
        hi: Slot,
        a: Slot,
    },
    /// `mov.u64 d, %globaltimer`.
    Timer {
        d: Slot,
    },
    Alu32 {
        op: AluOp,
        d: Slot,
        a: Slot,
        b: Slot,
    },
    Alu64 {
        op: AluOp,
        d: Slot,
        a: Slot,
        b: Slot,
    },
    Un32 {
        op: UnOp,
        d: Slot,
        a: Slot,
    },
    Un64 {
        op: UnOp,
        d: Slot,
        a: Slot,
    },
    /// `mul.wide.{u32,s32}`.
    MulWide {
        signed: bool,
        d: Slot,
        a: Slot,
        b: Slot,
    },
    /// `mad.lo`.
    Mad {
        wide: bool,
        d: Slot,
        a: Slot,
        b: Slot,
        c: Slot,
    },
    Bfe {
        wide: bool,
        signed: bool,
        d: Slot,
        a: Slot,
        b: Slot,
        c: Slot,
    },
    /// `bfi f, a, b, c, d` (here `d, a, b, pos, len`).
    Bfi {
        wide: bool,
        d: Slot,
        a: Slot,
        b: Slot,
        pos: Slot,
        len: Slot,
    },
    /// `shf.{l,r}.{clamp,wrap}.b32`.
    Shf {
        left: bool,
        clamp: bool,
        d: Slot,
        a: Slot,
        b: Slot,
        c: Slot,
    },
    /// `d = p ? a : b`.
    Selp {
        d: Slot,
        a: Slot,
        b: Slot,
        p: Slot,
    },
    Setp32 {
        cmp: Cmp,
        d: Slot,
        a: Slot,
        b: Slot,
    },
    Setp64 {
        cmp: Cmp,
        d: Slot,
        a: Slot,
        b: Slot,
    },
    SetpFull(Box<SetpFull>),
    /// `and`/`or`/`xor.pred d, a, b`, either source negated where its flag is set
    /// (`!%p`, as ptxas accepts).
    PredLogic {
        op: BoolOp,
        d: Slot,
        a: Slot,
        b: Slot,
        a_neg: bool,
        b_neg: bool,
    },
    PredNot {
        d: Slot,
        a: Slot,
    },
    /// Integer conversion: `a`'s low `sbits` bits, sign- or zero-extended, truncated to
    /// `dbits`.
    Cvt {
        d: Slot,
        a: Slot,
        sbits: u8,
        ssigned: bool,
        dbits: u8,
    },
    /// `cvt.rn.f64.s64`: a signed 64-bit integer to the nearest binary64 (ties to even).
    CvtF64S64 {
        d: Slot,
        a: Slot,
    },
    /// `cvt.rn.f64.u64`: an unsigned 64-bit integer to the nearest binary64 (ties to
    /// even).
    CvtF64U64 {
        d: Slot,
        a: Slot,
    },
    /// `cvt.rzi.s64.f64 d, a`: the double truncated toward zero, clamped to the s64
    /// range; NaN gives 0 (PTX's float-to-integer conversion).
    CvtS64F64Rzi {
        d: Slot,
        a: Slot,
    },
    /// `cvt.{rni,rzi,rmi,rpi}.f64.f64 d, a`: the double rounded to an integral double
    /// (to nearest even, toward zero, down, up); infinities, zeros and NaN as they are.
    CvtF64F64 {
        d: Slot,
        a: Slot,
        mode: IntegralRound,
    },
    /// `sqrt.rn.f64 d, a`: the square root, correctly rounded (IEEE 754); a negative
    /// operand (not -0.0) gives NaN.
    SqrtF64 {
        d: Slot,
        a: Slot,
    },
    /// A scalar load of `size` bytes at `[base + off]`, extended (sign when `signed`)
    /// to a `dbits`-bit register.
    Ld {
        space: Space,
        size: u8,
        signed: bool,
        dbits: u8,
        d: Slot,
        base: Slot,
        off: i64,
    },
    St {
        space: Space,
        size: u8,
        a: Slot,
        base: Slot,
        off: i64,
    },
    /// A vector load of `n` elements of `esize` bytes: one access of `n * esize` bytes.
    LdV {
        space: Space,
        esize: u8,
        n: u8,
        d: [Slot; 4],
        base: Slot,
        off: i64,
    },
    StV {
        space: Space,
        esize: u8,
        n: u8,
        a: [Slot; 4],
        base: Slot,
        off: i64,
    },
    /// `ld.param` from the kernel parameters (`kernel`) or the frame's parameter area.
    LdParam {
        kernel: bool,
        size: u8,
        signed: bool,
        dbits: u8,
        d: Slot,
        off: u32,
    },
    StParam {
        size: u8,
        a: Slot,
        off: u32,
    },
    /// `atom.add` / `red.add` (`d` is [`NO_SLOT`] for `red`).
    AtomAdd {
        space: Space,
        size: u8,
        d: Slot,
        base: Slot,
        off: i64,
        b: Slot,
    },
    /// `atom.add.f64` / `red.add.f64`: the double at `[base + off]` plus `b`'s, rounded
    /// to the nearest even, in one atomic step (`d` the old value, or [`NO_SLOT`]).
    AtomAddF64 {
        space: Space,
        d: Slot,
        base: Slot,
        off: i64,
        b: Slot,
    },
    /// `atom.{and,or,xor}.b{32,64}` / `red.{and,or,xor}`: `[base + off]` combined with `b`
    /// bit by bit, in one atomic step (`d` the old value, or [`NO_SLOT`]).
    AtomBits {
        space: Space,
        size: u8,
        op: BitsOp,
        d: Slot,
        base: Slot,
        off: i64,
        b: Slot,
    },
    /// `atom.cas`: `d = [base + off]`, which becomes `c` where it equals `b`, in one
    /// atomic step.
    AtomCas {
        space: Space,
        size: u8,
        d: Slot,
        base: Slot,
        off: i64,
        b: Slot,
        c: Slot,
    },
    Bra {
        target: u32,
    },
    Call {
        info: u32,
    },
    Ret,
    Exit,
    Bar {
        id: Slot,
    },
    Shfl {
        mode: ShflMode,
        d: Slot,
        p: Slot,
        a: Slot,
        b: Slot,
        c: Slot,
        mask: Slot,
    },
    /// `vote.sync.{all,any,uni}.pred d, {!}a, mask` and `vote.sync.ballot.b32`.
    Vote {
        mode: VoteMode,
        d: Slot,
        a: Slot,
        a_neg: bool,
        mask: Slot,
    },
}

/// An operation with its guard predicate.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Inst {
    pub op: Op,
    /// Guard predicate slot or [`NO_SLOT`].
    pub guard: Slot,
    /// The instruction runs when the guard equals `!guard_neg`.
    pub guard_neg: bool,
}

/// Where a call argument or result lives in the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ArgRef {
    /// The caller frame's parameter area.
    Param { off: u32, size: u32 },
    /// A caller register (or immediate) slot.
    Slot { slot: Slot, size: u32 },
}

/// A resolved `call`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CallInfo {
    pub func: u32,
    pub args: Vec<ArgRef>,
    pub rets: Vec<ArgRef>,
}

/// A function (`.entry` or `.func`).
#[derive(Debug, Clone)]
pub(crate) struct Func {
    pub defined: bool,
    pub entry_pc: u32,
    /// Initial frame: specials (overwritten per thread), registers (zero), immediates.
    pub init: Vec<u64>,
    /// Bytes of the frame's parameter area (formal parameters, then block-scoped
    /// `.param` variables).
    pub param_bytes: u32,
    /// (offset, size) of the input formal parameters in the parameter area.
    pub args: Vec<(u32, u32)>,
    /// (offset, size) of the return parameters in the parameter area.
    pub rets: Vec<(u32, u32)>,
}

/// A kernel (`.entry`).
#[derive(Debug, Clone)]
pub(crate) struct KernelDef {
    pub func: u32,
    pub params: Vec<super::types::Param>,
    /// Offset of each parameter in the kernel parameter buffer.
    pub offsets: Vec<u32>,
    pub param_bytes: u32,
}

/// A parsed module.
#[derive(Debug, Clone)]
pub(crate) struct Program {
    pub code: Vec<Inst>,
    /// Source text of each instruction (with function and line), for error reports.
    pub text: Vec<String>,
    pub funcs: Vec<Func>,
    pub calls: Vec<CallInfo>,
    pub kernels: Vec<(String, KernelDef)>,
    /// Bytes of static `.shared` variables (dynamic shared memory starts here).
    pub static_shared: u64,
    /// Where dynamic (`.extern .shared`) shared memory starts.
    pub dyn_shared_base: u64,
}

/// The rounding of `cvt.{rni,rzi,rmi,rpi}` to an integral value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IntegralRound {
    /// `.rni`: to the nearest integer, ties to even.
    NearestEven,
    /// `.rzi`: toward zero.
    Zero,
    /// `.rmi`: toward minus infinity.
    Down,
    /// `.rpi`: toward plus infinity.
    Up,
}

/// The bitwise atomics' operation ([`Op::AtomBits`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BitsOp {
    And,
    Or,
    Xor,
}

impl BitsOp {
    /// `old` combined with `v`.
    pub fn apply(self, old: u64, v: u64) -> u64 {
        match self {
            Self::And => old & v,
            Self::Or => old | v,
            Self::Xor => old ^ v,
        }
    }
}
