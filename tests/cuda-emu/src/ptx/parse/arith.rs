//! Integer arithmetic, logic and bit instructions (`add` ... `shf`), comparisons
//! (`setp`) and selection (`selp`).

use super::super::inst::*;
use super::common::*;

impl<'a> Parser<'a> {
    /// Decodes an integer arithmetic, logic, bit, comparison or selection instruction.
    pub(super) fn arith(&mut self, fc: &mut FnCtx, insn: &Insn<'_, 'a>) -> PResult<Op> {
        let Insn {
            base,
            mods,
            ops,
            line,
            ..
        } = *insn;
        if matches!(mods, ["rn", "f64"]) && matches!(base, "add" | "sub" | "mul" | "div") {
            // Binary64 arithmetic on 64-bit registers (bit-size registers go with any
            // type of their size).
            insn.nops(3)?;
            let op = match base {
                "add" => AluOp::FAdd,
                "sub" => AluOp::FSub,
                "mul" => AluOp::FMul,
                _ => AluOp::FDiv,
            };
            return self.alu(fc, op, 64, 64, ops, line);
        }
        if base == "sqrt" {
            if mods != ["rn", "f64"] {
                return insn.unsupported();
            }
            insn.nops(2)?;
            let d = self.dst(fc, &ops[0], W::Exact(64), line)?.0;
            let a = self.src(fc, &ops[1], W::Exact(64), line)?;
            return Ok(Op::SqrtF64 { d, a });
        }
        match base {
            "add" | "sub" | "div" | "rem" | "min" | "max" => {
                if mods.len() != 1 {
                    return insn.unsupported();
                }
                let t =
                    insn.int_ty(|t: Ty| t.kind != TyKind::B || matches!(base, "add" | "sub"))?;
                insn.nops(3)?;
                let s = t.signed();
                let op = match base {
                    "add" => AluOp::Add,
                    "sub" => AluOp::Sub,
                    "div" if s => AluOp::DivS,
                    "div" => AluOp::DivU,
                    "rem" if s => AluOp::RemS,
                    "rem" => AluOp::RemU,
                    "min" if s => AluOp::MinS,
                    "min" => AluOp::MinU,
                    "max" if s => AluOp::MaxS,
                    _ => AluOp::MaxU,
                };
                self.alu(fc, op, t.bits, t.bits, ops, line)
            }
            "and" | "or" | "xor" => {
                if mods.len() != 1 {
                    return insn.unsupported();
                }
                insn.nops(3)?;
                if mods[0] == "pred" {
                    let d = self.dst(fc, &ops[0], W::Pred, line)?.0;
                    // A source may be negated (`!%p`), as ptxas accepts.
                    let mut source = |o: &Opnd<'a>| match o {
                        Opnd::Not(n) => Ok((self.reg_operand(fc, n, W::Pred, line)?, true)),
                        o => Ok((self.src(fc, o, W::Pred, line)?, false)),
                    };
                    let (a, a_neg) = source(&ops[1])?;
                    let (b, b_neg) = source(&ops[2])?;
                    let op = match base {
                        "and" => BoolOp::And,
                        "or" => BoolOp::Or,
                        _ => BoolOp::Xor,
                    };
                    return Ok(Op::PredLogic {
                        op,
                        d,
                        a,
                        b,
                        a_neg,
                        b_neg,
                    });
                }
                let t = insn.int_ty(|_| true)?;
                let op = match base {
                    "and" => AluOp::And,
                    "or" => AluOp::Or,
                    _ => AluOp::Xor,
                };
                self.alu(fc, op, t.bits, t.bits, ops, line)
            }
            "shl" | "shr" => {
                if mods.len() != 1 {
                    return insn.unsupported();
                }
                let t = insn.int_ty(|t: Ty| base == "shr" || t.kind == TyKind::B)?;
                insn.nops(3)?;
                let op = match (base, t.signed()) {
                    ("shl", _) => AluOp::Shl,
                    (_, true) => AluOp::ShrS,
                    _ => AluOp::ShrU,
                };
                self.alu(fc, op, t.bits, 32, ops, line)
            }
            "mul" => {
                if mods.len() != 2 {
                    return insn.unsupported();
                }
                let t = insn.int_ty(|t: Ty| t.kind != TyKind::B)?;
                insn.nops(3)?;
                match mods[0] {
                    "lo" => self.alu(fc, AluOp::MulLo, t.bits, t.bits, ops, line),
                    "hi" => {
                        let op = if t.signed() {
                            AluOp::MulHiS
                        } else {
                            AluOp::MulHiU
                        };
                        self.alu(fc, op, t.bits, t.bits, ops, line)
                    }
                    "wide" if t.bits == 32 => {
                        let d = self.dst(fc, &ops[0], W::Exact(64), line)?.0;
                        let a = self.src(fc, &ops[1], W::Exact(32), line)?;
                        let b = self.src(fc, &ops[2], W::Exact(32), line)?;
                        Ok(Op::MulWide {
                            signed: t.signed(),
                            d,
                            a,
                            b,
                        })
                    }
                    _ => insn.unsupported(),
                }
            }
            "mad" => {
                if mods.len() != 2 || mods[0] != "lo" {
                    return insn.unsupported();
                }
                let t = insn.int_ty(|t: Ty| t.kind != TyKind::B)?;
                insn.nops(4)?;
                let w = W::Exact(t.bits);
                let d = self.dst(fc, &ops[0], w, line)?.0;
                let a = self.src(fc, &ops[1], w, line)?;
                let b = self.src(fc, &ops[2], w, line)?;
                let c = self.src(fc, &ops[3], w, line)?;
                Ok(Op::Mad {
                    wide: t.bits == 64,
                    d,
                    a,
                    b,
                    c,
                })
            }
            "not" | "neg" | "abs" | "popc" | "clz" | "brev" => {
                if mods.len() != 1 {
                    return insn.unsupported();
                }
                insn.nops(2)?;
                if base == "not" && mods[0] == "pred" {
                    let d = self.dst(fc, &ops[0], W::Pred, line)?.0;
                    let a = self.src(fc, &ops[1], W::Pred, line)?;
                    return Ok(Op::PredNot { d, a });
                }
                let t = insn.int_ty(|t: Ty| match base {
                    "neg" | "abs" => t.kind == TyKind::S,
                    _ => t.kind == TyKind::B,
                })?;
                let op = match base {
                    "not" => UnOp::Not,
                    "neg" => UnOp::Neg,
                    "abs" => UnOp::Abs,
                    "popc" => UnOp::Popc,
                    "clz" => UnOp::Clz,
                    _ => UnOp::Brev,
                };
                let dbits = if matches!(op, UnOp::Popc | UnOp::Clz) {
                    32
                } else {
                    t.bits
                };
                let d = self.dst(fc, &ops[0], W::Exact(dbits), line)?.0;
                let a = self.src(fc, &ops[1], W::Exact(t.bits), line)?;
                Ok(if t.bits == 64 {
                    Op::Un64 { op, d, a }
                } else {
                    Op::Un32 { op, d, a }
                })
            }
            "bfe" => {
                if mods.len() != 1 {
                    return insn.unsupported();
                }
                let t = insn.int_ty(|t: Ty| t.kind != TyKind::B)?;
                insn.nops(4)?;
                let d = self.dst(fc, &ops[0], W::Exact(t.bits), line)?.0;
                let a = self.src(fc, &ops[1], W::Exact(t.bits), line)?;
                let b = self.src(fc, &ops[2], W::Exact(32), line)?;
                let c = self.src(fc, &ops[3], W::Exact(32), line)?;
                Ok(Op::Bfe {
                    wide: t.bits == 64,
                    signed: t.signed(),
                    d,
                    a,
                    b,
                    c,
                })
            }
            "bfi" => {
                if mods.len() != 1 {
                    return insn.unsupported();
                }
                let t = insn.int_ty(|t: Ty| t.kind == TyKind::B)?;
                insn.nops(5)?;
                let d = self.dst(fc, &ops[0], W::Exact(t.bits), line)?.0;
                let a = self.src(fc, &ops[1], W::Exact(t.bits), line)?;
                let b = self.src(fc, &ops[2], W::Exact(t.bits), line)?;
                let pos = self.src(fc, &ops[3], W::Exact(32), line)?;
                let len = self.src(fc, &ops[4], W::Exact(32), line)?;
                Ok(Op::Bfi {
                    wide: t.bits == 64,
                    d,
                    a,
                    b,
                    pos,
                    len,
                })
            }
            "shf" => {
                if mods.len() != 3 || mods[2] != "b32" {
                    return insn.unsupported();
                }
                let left = match mods[0] {
                    "l" => true,
                    "r" => false,
                    _ => return insn.unsupported(),
                };
                let clamp = match mods[1] {
                    "clamp" => true,
                    "wrap" => false,
                    _ => return insn.unsupported(),
                };
                insn.nops(4)?;
                let w = W::Exact(32);
                let d = self.dst(fc, &ops[0], w, line)?.0;
                let a = self.src(fc, &ops[1], w, line)?;
                let b = self.src(fc, &ops[2], w, line)?;
                let c = self.src(fc, &ops[3], w, line)?;
                Ok(Op::Shf {
                    left,
                    clamp,
                    d,
                    a,
                    b,
                    c,
                })
            }
            "selp" => {
                let t = match (mods.len(), insn.last_ty()) {
                    (1, Some(t)) if t.bits == 32 || t.bits == 64 => t,
                    _ => return insn.unsupported(),
                };
                insn.nops(4)?;
                let w = W::Exact(t.bits);
                let d = self.dst(fc, &ops[0], w, line)?.0;
                let a = self.src(fc, &ops[1], w, line)?;
                let b = self.src(fc, &ops[2], w, line)?;
                let p = self.src(fc, &ops[3], W::Pred, line)?;
                Ok(Op::Selp { d, a, b, p })
            }
            "setp" => self.setp(fc, insn),
            _ => insn.unsupported(),
        }
    }

    fn alu(
        &mut self,
        fc: &mut FnCtx,
        op: AluOp,
        bits: u8,
        bbits: u8,
        ops: &[Opnd<'a>],
        line: usize,
    ) -> PResult<Op> {
        let d = self.dst(fc, &ops[0], W::Exact(bits), line)?.0;
        let a = self.src(fc, &ops[1], W::Exact(bits), line)?;
        let b = self.src(fc, &ops[2], W::Exact(bbits), line)?;
        Ok(if bits == 64 {
            Op::Alu64 { op, d, a, b }
        } else {
            Op::Alu32 { op, d, a, b }
        })
    }

    fn setp(&mut self, fc: &mut FnCtx, insn: &Insn<'_, 'a>) -> PResult<Op> {
        let Insn {
            opcode,
            mods,
            ops,
            line,
            ..
        } = *insn;
        let (cmp_s, bop_s, ty_s) = match mods {
            [c, t] => (*c, None, *t),
            [c, b, t] => (*c, Some(*b), *t),
            _ => return insn.unsupported(),
        };
        let Some(t) = parse_ty(ty_s).filter(|t| t.is_int() && (t.bits == 32 || t.bits == 64))
        else {
            return insn.unsupported();
        };
        let s = t.signed();
        let cmp = match cmp_s {
            "eq" => Cmp::Eq,
            "ne" => Cmp::Ne,
            _ if t.kind == TyKind::B => return insn.unsupported(),
            "lt" if s => Cmp::LtS,
            "le" if s => Cmp::LeS,
            "gt" if s => Cmp::GtS,
            "ge" if s => Cmp::GeS,
            "lt" | "lo" => Cmp::LtU,
            "le" | "ls" => Cmp::LeU,
            "gt" | "hi" => Cmp::GtU,
            "ge" | "hs" => Cmp::GeU,
            _ => return insn.unsupported(),
        };
        let bop = match bop_s {
            None => None,
            Some("and") => Some(BoolOp::And),
            Some("or") => Some(BoolOp::Or),
            Some("xor") => Some(BoolOp::Xor),
            Some(_) => return insn.unsupported(),
        };
        let want = if bop.is_some() { 4 } else { 3 };
        if ops.len() != want {
            return perr(
                line,
                format!("`{opcode}` takes {want} operands, {} given", ops.len()),
            );
        }
        let (d, q) = match &ops[0] {
            Opnd::Pair(d, q) => (
                self.dst(fc, &Opnd::Name(d), W::Pred, line)?.0,
                self.dst(fc, &Opnd::Name(q), W::Pred, line)?.0,
            ),
            o => (self.dst(fc, o, W::Pred, line)?.0, NO_SLOT),
        };
        let w = W::Exact(t.bits);
        let a = self.src(fc, &ops[1], w, line)?;
        let b = self.src(fc, &ops[2], w, line)?;
        if bop.is_none() && q == NO_SLOT {
            return Ok(if t.bits == 64 {
                Op::Setp64 { cmp, d, a, b }
            } else {
                Op::Setp32 { cmp, d, a, b }
            });
        }
        let (c, c_neg) = match ops.get(3) {
            None => (NO_SLOT, false),
            Some(Opnd::Not(n)) => (self.reg_operand(fc, n, W::Pred, line)?, true),
            Some(o) => (self.src(fc, o, W::Pred, line)?, false),
        };
        Ok(Op::SetpFull(Box::new(SetpFull {
            cmp,
            wide: t.bits == 64,
            d,
            q,
            a,
            b,
            bop,
            c,
            c_neg,
        })))
    }
}
