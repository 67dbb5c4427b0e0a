//! What every part of the parser shares: PTX types, declared names, operands, the
//! per-function state ([`FnCtx`]), the [`Parser`] itself with its token-level helpers,
//! and the instruction being decoded ([`Insn`]).
//!
//! The leaf of `parse`: its siblings use it, it uses none of them.

use std::collections::HashMap;

use super::super::inst::*;
use super::super::lex::{parse_int, Kind, Token};
use super::super::types::ParseError;

/// Most register slots one function may use.
pub(super) const MAX_SLOTS: usize = 1 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum TyKind {
    B,
    U,
    S,
    F,
    Pred,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Ty {
    pub(super) bits: u8,
    pub(super) kind: TyKind,
}

impl Ty {
    pub(super) fn bytes(self) -> u32 {
        (self.bits as u32).div_ceil(8)
    }
    pub(super) fn is_int(self) -> bool {
        matches!(self.kind, TyKind::B | TyKind::U | TyKind::S)
    }
    pub(super) fn signed(self) -> bool {
        self.kind == TyKind::S
    }
}

pub(super) fn parse_ty(s: &str) -> Option<Ty> {
    let (kind, rest) = match s.as_bytes().first()? {
        b'b' => (TyKind::B, &s[1..]),
        b'u' => (TyKind::U, &s[1..]),
        b's' => (TyKind::S, &s[1..]),
        b'f' => (TyKind::F, &s[1..]),
        b'p' if s == "pred" => {
            return Some(Ty {
                bits: 1,
                kind: TyKind::Pred,
            })
        }
        _ => return None,
    };
    let bits = match rest {
        "8" => 8,
        "16" => 16,
        "32" => 32,
        "64" => 64,
        _ => return None,
    };
    if kind == TyKind::F && bits == 8 {
        return None;
    }
    Some(Ty { bits, kind })
}

/// A declared name.
#[derive(Debug, Clone, Copy)]
pub(super) enum Sym {
    /// A register; `bits` is 1 for predicates.
    Reg { slot: Slot, bits: u8 },
    /// A kernel parameter (offset in the kernel parameter buffer).
    KParam { off: u32, size: u32 },
    /// A parameter in the frame's parameter area (formal or block-scoped).
    FParam { off: u32, size: u32 },
    /// A `.shared` variable (address in the shared window).
    Shared { addr: u64, dynamic: bool },
}

/// What kind of value an operand slot must hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum W {
    Pred,
    /// A register of exactly this many bits (immediates are truncated to it).
    Exact(u8),
    /// A register at least this wide (sub-word `ld`/`st`/`cvt` types).
    AtLeast(u8),
}

#[derive(Debug, Clone)]
pub(super) enum Opnd<'a> {
    Name(&'a str),
    Imm(u64),
    /// `!%p`
    Not(&'a str),
    /// `%p|%q`
    Pair(&'a str, &'a str),
    /// `[base+off]`; `None` base for an absolute address.
    Addr(Option<&'a str>, i64),
    /// `{a, b, ...}`
    Vector(Vec<Opnd<'a>>),
    /// `(a, b, ...)`
    List(Vec<Opnd<'a>>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SlotKind {
    Reg(u8),
    Const,
    Special,
}

/// Per-function parsing state.
pub(super) struct FnCtx {
    pub(super) idx: u32,
    pub(super) name: String,
    pub(super) scopes: Vec<HashMap<String, Sym>>,
    pub(super) init: Vec<u64>,
    pub(super) kinds: Vec<SlotKind>,
    pub(super) consts: HashMap<u64, Slot>,
    pub(super) param_bytes: u32,
    pub(super) labels: HashMap<String, u32>,
    pub(super) label_fixups: Vec<(usize, String, usize)>,
}

impl FnCtx {
    pub(super) fn new(idx: u32, name: &str) -> Self {
        FnCtx {
            idx,
            name: name.to_string(),
            scopes: vec![HashMap::new()],
            init: vec![0; NSPECIAL],
            kinds: vec![SlotKind::Special; NSPECIAL],
            consts: HashMap::new(),
            param_bytes: 0,
            labels: HashMap::new(),
            label_fixups: Vec::new(),
        }
    }

    pub(super) fn lookup(&self, name: &str) -> Option<Sym> {
        self.scopes.iter().rev().find_map(|s| s.get(name).copied())
    }

    pub(super) fn new_slot(&mut self, kind: SlotKind, value: u64) -> Result<Slot, String> {
        if self.init.len() >= MAX_SLOTS {
            return Err("too many registers".into());
        }
        self.init.push(value);
        self.kinds.push(kind);
        Ok((self.init.len() - 1) as Slot)
    }

    pub(super) fn konst(&mut self, value: u64) -> Result<Slot, String> {
        if let Some(&s) = self.consts.get(&value) {
            return Ok(s);
        }
        let s = self.new_slot(SlotKind::Const, value)?;
        self.consts.insert(value, s);
        Ok(s)
    }

    pub(super) fn alloc_param(&mut self, size: u32, align: u32) -> Result<u32, String> {
        let off = align_up(self.param_bytes as u64, align.max(1) as u64);
        let end = off + size as u64;
        if end > u32::MAX as u64 / 2 {
            return Err("parameter area too large".into());
        }
        self.param_bytes = end as u32;
        Ok(off as u32)
    }
}

pub(super) fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

/// The initial value of a register: PTX leaves registers undefined, so they start as
/// junk (predicates as false) rather than zero, which a kernel must not rely on.
pub(super) fn poison(bits: u8) -> u64 {
    if bits == 1 {
        0
    } else {
        0xDEAD_BEEF_DEAD_BEEF & mask(bits)
    }
}

pub(super) fn mask(bits: u8) -> u64 {
    if bits >= 64 {
        u64::MAX
    } else {
        (1u64 << bits) - 1
    }
}

pub(super) struct PendingCall {
    pub(super) info: usize,
    pub(super) callee: String,
    pub(super) line: usize,
}

/// One declared parameter: name, size, alignment.
pub(super) struct ParamDecl<'a> {
    pub(super) name: &'a str,
    pub(super) size: u32,
    pub(super) align: u32,
}

pub(super) struct Parser<'a> {
    pub(super) src: &'a str,
    pub(super) toks: Vec<Token<'a>>,
    pub(super) pos: usize,
    pub(super) prog: Program,
    pub(super) func_ids: HashMap<String, u32>,
    pub(super) pending_calls: Vec<PendingCall>,
    pub(super) globals: HashMap<String, Sym>,
    /// (function, slot, offset in the dynamic shared area) to rebase once the static
    /// shared size is known.
    pub(super) dyn_patches: Vec<(u32, Slot, u64)>,
}

pub(super) type PResult<T> = Result<T, ParseError>;

pub(super) fn perr<T>(line: usize, message: impl Into<String>) -> PResult<T> {
    Err(ParseError {
        line,
        message: message.into(),
    })
}

impl<'a> Parser<'a> {
    pub(super) fn peek(&self) -> Option<Token<'a>> {
        self.toks.get(self.pos).copied()
    }

    pub(super) fn line(&self) -> usize {
        self.toks
            .get(self.pos)
            .or_else(|| self.toks.last())
            .map_or(1, |t| t.line)
    }

    pub(super) fn next(&mut self) -> PResult<Token<'a>> {
        match self.toks.get(self.pos) {
            Some(t) => {
                self.pos += 1;
                Ok(*t)
            }
            None => perr(self.line(), "unexpected end of input"),
        }
    }

    /// The size of a parameter of `elem` bytes, times the optional `[n]` array suffix
    /// that follows its name (1 to 4096 elements).
    pub(super) fn param_size(&mut self, elem: u32, line: usize) -> PResult<u32> {
        if !self.eat_punct(b'[') {
            return Ok(elem);
        }
        let n = self.expect_uint()?;
        self.expect_punct(b']')?;
        if n == 0 || n > 4096 {
            return perr(line, "bad parameter array size");
        }
        Ok(elem * n as u32)
    }

    pub(super) fn eat_punct(&mut self, c: u8) -> bool {
        if self.peek().is_some_and(|t| t.is_punct(c)) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    pub(super) fn expect_punct(&mut self, c: u8) -> PResult<Token<'a>> {
        let t = self.next()?;
        if t.is_punct(c) {
            Ok(t)
        } else {
            perr(
                t.line,
                format!("expected `{}`, found `{}`", c as char, t.text),
            )
        }
    }

    pub(super) fn expect_ident(&mut self) -> PResult<Token<'a>> {
        let t = self.next()?;
        if t.kind == Kind::Ident {
            Ok(t)
        } else {
            perr(t.line, format!("expected a name, found `{}`", t.text))
        }
    }

    pub(super) fn expect_uint(&mut self) -> PResult<u64> {
        let t = self.next()?;
        if t.kind == Kind::Num {
            if let Some(v) = parse_int(t.text) {
                return Ok(v);
            }
        }
        perr(t.line, format!("expected an integer, found `{}`", t.text))
    }

    /// Skips the rest of the current token's line (directives without `;`).
    pub(super) fn skip_line(&mut self, line: usize) {
        while self.peek().is_some_and(|t| t.line == line) {
            self.pos += 1;
        }
    }

    /// Skips to just past the next `;`.
    pub(super) fn skip_statement(&mut self) -> PResult<()> {
        loop {
            if self.next()?.is_punct(b';') {
                return Ok(());
            }
        }
    }
}

/// One instruction being decoded: its opcode split at the dots, its operands, its line.
#[derive(Clone, Copy)]
pub(super) struct Insn<'i, 'a> {
    /// The whole opcode (`ld.global.v4.u32`), for messages.
    pub(super) opcode: &'i str,
    /// The opcode's first part (`ld`).
    pub(super) base: &'i str,
    /// The modifiers after it (`global`, `v4`, `u32`).
    pub(super) mods: &'i [&'i str],
    pub(super) ops: &'i [Opnd<'a>],
    pub(super) line: usize,
}

impl Insn<'_, '_> {
    /// The error for an instruction, or a form of one, that is not implemented.
    pub(super) fn unsupported<T>(&self) -> PResult<T> {
        perr(
            self.line,
            format!("unsupported instruction `{}`", self.opcode),
        )
    }

    /// Checks that there are `n` operands.
    pub(super) fn nops(&self, n: usize) -> PResult<()> {
        if self.ops.len() == n {
            Ok(())
        } else {
            perr(
                self.line,
                format!(
                    "`{}` takes {n} operands, {} given",
                    self.opcode,
                    self.ops.len()
                ),
            )
        }
    }

    /// The type: the last modifier.
    pub(super) fn last_ty(&self) -> Option<Ty> {
        self.mods.last().and_then(|s| parse_ty(s))
    }

    /// The type, which must be a 32- or 64-bit integer type that `allowed` accepts
    /// (else the instruction is unsupported).
    pub(super) fn int_ty(&self, allowed: impl Fn(Ty) -> bool) -> PResult<Ty> {
        match self.last_ty() {
            Some(t) if t.is_int() && (t.bits == 32 || t.bits == 64) && allowed(t) => Ok(t),
            _ => self.unsupported(),
        }
    }
}
