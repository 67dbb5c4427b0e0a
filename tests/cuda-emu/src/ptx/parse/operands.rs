//! Operands: the syntax (`[base+off]`, `{a, b}`, `(a, b)`, `!%p`, `%p|%q`, immediates)
//! and its resolution to frame slots, addresses and parameter offsets, with the width
//! each use requires checked.

use super::super::inst::*;
use super::super::lex::{parse_int, Kind, Token};
use super::super::types::ParseError;
use super::common::*;

impl<'a> Parser<'a> {
    pub(super) fn operand(&mut self) -> PResult<Opnd<'a>> {
        let t = self.next()?;
        match t.kind {
            Kind::Punct(b'[') => {
                let mut base = None;
                let mut off: i64 = 0;
                let first = self.next()?;
                match first.kind {
                    Kind::Ident => base = Some(first.text),
                    Kind::Num => off = self.int_value(first, false)? as i64,
                    Kind::Punct(b'-') => {
                        let n = self.next()?;
                        off = self.int_value(n, true)? as i64;
                    }
                    _ => return perr(first.line, format!("bad address `{}`", first.text)),
                }
                while !self.eat_punct(b']') {
                    let sign = self.next()?;
                    let mut neg = match sign.kind {
                        Kind::Punct(b'+') => false,
                        Kind::Punct(b'-') => true,
                        _ => return perr(sign.line, format!("bad address near `{}`", sign.text)),
                    };
                    if self.eat_punct(b'-') {
                        neg = !neg;
                    }
                    let n = self.next()?;
                    let v = self.int_value(n, neg)? as i64;
                    off = off.wrapping_add(v);
                }
                Ok(Opnd::Addr(base, off))
            }
            Kind::Punct(b'{') => {
                let mut v = Vec::new();
                loop {
                    v.push(self.operand()?);
                    if self.eat_punct(b'}') {
                        return Ok(Opnd::Vector(v));
                    }
                    self.expect_punct(b',')?;
                }
            }
            Kind::Punct(b'(') => {
                let mut v = Vec::new();
                if self.eat_punct(b')') {
                    return Ok(Opnd::List(v));
                }
                loop {
                    v.push(self.operand()?);
                    if self.eat_punct(b')') {
                        return Ok(Opnd::List(v));
                    }
                    self.expect_punct(b',')?;
                }
            }
            Kind::Punct(b'-') => {
                let n = self.next()?;
                Ok(Opnd::Imm(self.int_value(n, true)?))
            }
            Kind::Punct(b'!') => Ok(Opnd::Not(self.expect_ident()?.text)),
            Kind::Num => Ok(Opnd::Imm(self.int_value(t, false)?)),
            Kind::Ident => {
                if self.eat_punct(b'|') {
                    let q = self.expect_ident()?;
                    return Ok(Opnd::Pair(t.text, q.text));
                }
                Ok(Opnd::Name(t.text))
            }
            _ => perr(t.line, format!("unexpected `{}` in operands", t.text)),
        }
    }

    pub(super) fn int_value(&self, t: Token<'a>, neg: bool) -> PResult<u64> {
        if t.kind != Kind::Num {
            return perr(t.line, format!("expected a number, found `{}`", t.text));
        }
        let v = parse_int(t.text).ok_or(ParseError {
            line: t.line,
            message: format!("unsupported number `{}`", t.text),
        })?;
        Ok(if neg { v.wrapping_neg() } else { v })
    }

    /// Resolves a name used as a source or destination register.
    pub(super) fn reg_operand(
        &mut self,
        fc: &mut FnCtx,
        name: &str,
        w: W,
        line: usize,
    ) -> PResult<Slot> {
        if let Some(i) = SPECIALS.iter().position(|&s| s == name) {
            return match w {
                W::Exact(32) | W::AtLeast(_) => Ok(i as Slot),
                _ => perr(line, format!("special register `{name}` is 32 bits")),
            };
        }
        match fc.lookup(name).or_else(|| self.globals.get(name).copied()) {
            Some(Sym::Reg { slot, bits }) => {
                let ok = match w {
                    W::Pred => bits == 1,
                    W::Exact(n) => bits == n,
                    W::AtLeast(n) => bits != 1 && bits >= n,
                };
                if !ok {
                    let want = match w {
                        W::Pred => "a predicate".to_string(),
                        W::Exact(n) => format!("a {n}-bit register"),
                        W::AtLeast(n) => format!("a register of at least {n} bits"),
                    };
                    let have = if bits == 1 {
                        "a predicate".to_string()
                    } else {
                        format!("a {bits}-bit register")
                    };
                    return perr(line, format!("`{name}` is {have}, {want} is needed"));
                }
                Ok(slot)
            }
            Some(Sym::Shared { addr, dynamic }) => {
                if !matches!(w, W::Exact(32) | W::Exact(64)) {
                    return perr(
                        line,
                        format!("address of `{name}` needs a 32- or 64-bit operand"),
                    );
                }
                if dynamic {
                    let slot = fc
                        .new_slot(SlotKind::Const, 0)
                        .map_err(|m| ParseError { line, message: m })?;
                    self.dyn_patches.push((fc.idx, slot, addr));
                    Ok(slot)
                } else {
                    fc.konst(addr).map_err(|m| ParseError { line, message: m })
                }
            }
            Some(Sym::KParam { .. } | Sym::FParam { .. }) => perr(
                line,
                format!("parameter `{name}` used as a register (use ld.param/st.param)"),
            ),
            None => match name {
                "%globaltimer" | "%clock64" | "%clock" | "%globaltimer_lo" | "%globaltimer_hi" => {
                    perr(
                        line,
                        format!("`{name}` is only supported as the source of mov.u64"),
                    )
                }
                _ => perr(line, format!("undeclared identifier `{name}`")),
            },
        }
    }

    pub(super) fn src(&mut self, fc: &mut FnCtx, o: &Opnd<'a>, w: W, line: usize) -> PResult<Slot> {
        match o {
            Opnd::Name(n) => self.reg_operand(fc, n, w, line),
            Opnd::Imm(v) => {
                let bits = match w {
                    W::Pred => return perr(line, "an immediate cannot be a predicate"),
                    W::Exact(n) => n,
                    W::AtLeast(n) => n,
                };
                fc.konst(v & mask(bits))
                    .map_err(|m| ParseError { line, message: m })
            }
            _ => perr(line, "expected a register or an immediate"),
        }
    }

    pub(super) fn dst(
        &mut self,
        fc: &mut FnCtx,
        o: &Opnd<'a>,
        w: W,
        line: usize,
    ) -> PResult<(Slot, u8)> {
        match o {
            Opnd::Name("_") => {
                let bits = match w {
                    W::Pred => 1,
                    W::Exact(n) | W::AtLeast(n) => n.max(32),
                };
                let s = fc
                    .new_slot(SlotKind::Reg(bits), 0)
                    .map_err(|m| ParseError { line, message: m })?;
                Ok((s, bits))
            }
            Opnd::Name(n) => {
                let s = self.reg_operand(fc, n, w, line)?;
                match fc.kinds.get(s as usize) {
                    Some(SlotKind::Reg(bits)) => Ok((s, *bits)),
                    _ => perr(line, format!("`{n}` cannot be written")),
                }
            }
            _ => perr(line, "expected a destination register"),
        }
    }

    /// An address operand: (base slot, offset).
    pub(super) fn address(
        &mut self,
        fc: &mut FnCtx,
        o: &Opnd<'a>,
        space: Space,
        line: usize,
    ) -> PResult<(Slot, i64)> {
        let Opnd::Addr(base, off) = o else {
            return perr(line, "expected an address `[...]`");
        };
        let base = match base {
            None => fc.konst(0).map_err(|m| ParseError { line, message: m })?,
            Some(name) => {
                let sym = fc.lookup(name).or_else(|| self.globals.get(*name).copied());
                match (sym, space) {
                    (Some(Sym::Shared { .. }), Space::Shared) => {
                        self.reg_operand(fc, name, W::Exact(64), line)?
                    }
                    (Some(Sym::Shared { .. }), Space::Global) => {
                        return perr(line, format!("`{name}` is a .shared variable"))
                    }
                    (Some(Sym::Reg { bits: 32, .. }), Space::Shared) => {
                        self.reg_operand(fc, name, W::Exact(32), line)?
                    }
                    _ => self.reg_operand(fc, name, W::Exact(64), line)?,
                }
            }
        };
        Ok((base, *off))
    }

    /// A `.param` address: (kernel parameter?, byte offset), checked against the
    /// variable's size.
    pub(super) fn param_address(
        &mut self,
        fc: &FnCtx,
        o: &Opnd<'a>,
        size: u32,
        line: usize,
    ) -> PResult<(bool, u32)> {
        let Opnd::Addr(Some(name), off) = o else {
            return perr(line, "expected a parameter address `[name]`");
        };
        let (kernel, base, psize) = match fc.lookup(name) {
            Some(Sym::KParam { off, size }) => (true, off, size),
            Some(Sym::FParam { off, size }) => (false, off, size),
            _ => return perr(line, format!("`{name}` is not a parameter")),
        };
        if *off < 0 || (*off as u64) + size as u64 > psize as u64 {
            return perr(
                line,
                format!("access of {size} bytes at offset {off} is outside parameter `{name}` ({psize} bytes)"),
            );
        }
        Ok((kernel, base + *off as u32))
    }
}
