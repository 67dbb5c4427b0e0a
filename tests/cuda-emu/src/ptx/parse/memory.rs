//! Memory instructions: `ld` and `st` (global, shared, generic and `.param`, scalar and
//! vector) and the atomics `atom`/`red`.

use super::super::inst::*;
use super::common::*;

impl<'a> Parser<'a> {
    /// Decodes `ld`, `st`, `atom` or `red`.
    pub(super) fn memory(&mut self, fc: &mut FnCtx, insn: &Insn<'_, 'a>) -> PResult<Op> {
        let Insn {
            base,
            mods,
            ops,
            line,
            ..
        } = *insn;
        match base {
            "ld" | "st" => self.ld_st(fc, base == "ld", insn),
            "atom" | "red" => {
                let mut space = Space::Global;
                let mut add = false;
                let mut cas = false;
                let mut bits = None;
                let mut ty = None;
                for (i, m) in mods.iter().enumerate() {
                    match *m {
                        "global" => space = Space::Global,
                        "shared" => space = Space::Shared,
                        "relaxed" | "cta" | "gpu" | "sys" => {}
                        "add" => add = true,
                        "cas" if base == "atom" => cas = true,
                        "and" => bits = Some(BitsOp::And),
                        "or" => bits = Some(BitsOp::Or),
                        "xor" => bits = Some(BitsOp::Xor),
                        _ if i == mods.len() - 1 => ty = parse_ty(m),
                        _ => return insn.unsupported(),
                    }
                }
                if let Some(op) = bits {
                    // atom.{and,or,xor}.{b32,b64} d, [a], b (red: no d); the ISA's types
                    // for them are the bit-size ones only.
                    let Some(t) = ty.filter(|t| {
                        !add && !cas && t.kind == TyKind::B && (t.bits == 32 || t.bits == 64)
                    }) else {
                        return insn.unsupported();
                    };
                    let w = W::Exact(t.bits);
                    let (d, abase, off, b) = self.atom_operands(fc, insn, space, w)?;
                    return Ok(Op::AtomBits {
                        space,
                        size: t.bits / 8,
                        op,
                        d,
                        base: abase,
                        off,
                        b,
                    });
                }
                if cas {
                    // atom.cas.{b32,b64} d, [a], b, c: d = [a]; [a] = ([a] == b) ? c : [a]
                    // (the ISA also allows .b16 on sm_70, and .u32/.s32/.u64 are not
                    // among its types: only the bit-size types are accepted here).
                    let Some(t) = ty
                        .filter(|t| !add && t.kind == TyKind::B && (t.bits == 32 || t.bits == 64))
                    else {
                        return insn.unsupported();
                    };
                    let w = W::Exact(t.bits);
                    insn.nops(4)?;
                    let d = self.dst(fc, &ops[0], w, line)?.0;
                    let (abase, off) = self.address(fc, &ops[1], space, line)?;
                    let b = self.src(fc, &ops[2], w, line)?;
                    let c = self.src(fc, &ops[3], w, line)?;
                    return Ok(Op::AtomCas {
                        space,
                        size: t.bits / 8,
                        d,
                        base: abase,
                        off,
                        b,
                        c,
                    });
                }
                // atom.add.f64 / red.add.f64 (sm_60 and later; rounded to the nearest
                // even, as add.rn.f64): one atomic read-modify-write of the double.
                if let Some(t) = ty.filter(|t| add && t.kind == TyKind::F && t.bits == 64) {
                    let w = W::Exact(t.bits);
                    let (d, abase, off, b) = self.atom_operands(fc, insn, space, w)?;
                    return Ok(Op::AtomAddF64 {
                        space,
                        d,
                        base: abase,
                        off,
                        b,
                    });
                }
                let Some(t) = ty.filter(|t| {
                    add && t.is_int() && t.kind != TyKind::B && (t.bits == 32 || t.bits == 64)
                }) else {
                    return insn.unsupported();
                };
                if t.signed() && t.bits == 64 {
                    return insn.unsupported();
                }
                let w = W::Exact(t.bits);
                let (d, abase, off, b) = self.atom_operands(fc, insn, space, w)?;
                Ok(Op::AtomAdd {
                    space,
                    size: t.bits / 8,
                    d,
                    base: abase,
                    off,
                    b,
                })
            }
            _ => insn.unsupported(),
        }
    }

    /// The operands of `atom` (`d, [a], b`) or `red` (`[a], b`), `b` of width `w`: the
    /// destination ([`NO_SLOT`] for `red`), the address's base and offset, and `b`.
    fn atom_operands(
        &mut self,
        fc: &mut FnCtx,
        insn: &Insn<'_, 'a>,
        space: Space,
        w: W,
    ) -> PResult<(Slot, Slot, i64, Slot)> {
        let Insn {
            base, ops, line, ..
        } = *insn;
        let (d, rest) = if base == "atom" {
            insn.nops(3)?;
            (self.dst(fc, &ops[0], w, line)?.0, &ops[1..])
        } else {
            insn.nops(2)?;
            (NO_SLOT, ops)
        };
        let (abase, off) = self.address(fc, &rest[0], space, line)?;
        let b = self.src(fc, &rest[1], w, line)?;
        Ok((d, abase, off, b))
    }

    fn ld_st(&mut self, fc: &mut FnCtx, is_ld: bool, insn: &Insn<'_, 'a>) -> PResult<Op> {
        let Insn {
            opcode,
            mods,
            ops,
            line,
            ..
        } = *insn;
        let Some((ty_s, rest)) = mods.split_last() else {
            return insn.unsupported();
        };
        let Some(t) = parse_ty(ty_s).filter(|t| t.kind != TyKind::Pred) else {
            return insn.unsupported();
        };
        let mut space = None; // None: generic (treated as global)
        let mut param = false;
        let mut vec = 1u8;
        for m in rest {
            match *m {
                "global" => space = Some(Space::Global),
                "shared" => space = Some(Space::Shared),
                "param" => param = true,
                "v2" => vec = 2,
                "v4" => vec = 4,
                "weak" | "volatile" | "relaxed" | "acquire" | "release" | "cta" | "gpu" | "sys"
                | "ca" | "cg" | "cs" | "lu" | "cv" | "wb" | "wt" | "nc" => {}
                m if m.starts_with("L1::") || m.starts_with("L2::") => {}
                _ => return insn.unsupported(),
            }
        }
        if param && space.is_some() {
            return insn.unsupported();
        }
        let size = t.bytes() as u8;
        // scalars: a register wider than the type is zero- or sign-extended (ld) or
        // truncated (st); vector elements must have the type's width
        let ws = W::AtLeast(t.bits);
        let w = if t.bits >= 32 { W::Exact(t.bits) } else { ws };
        if (size as u32) * (vec as u32) > 16 {
            return perr(
                line,
                format!("`{opcode}`: vector access wider than 16 bytes"),
            );
        }
        if ops.len() != 2 {
            return perr(
                line,
                format!("`{opcode}` takes 2 operands, {} given", ops.len()),
            );
        }
        let (data, addr) = if is_ld {
            (&ops[0], &ops[1])
        } else {
            (&ops[1], &ops[0])
        };
        if param {
            if vec != 1 {
                return insn.unsupported();
            }
            let (kernel, off) = self.param_address(fc, addr, size as u32, line)?;
            if is_ld {
                let (d, dbits) = self.dst(fc, data, ws, line)?;
                return Ok(Op::LdParam {
                    kernel,
                    size,
                    signed: t.signed(),
                    dbits,
                    d,
                    off,
                });
            }
            if kernel {
                return perr(line, "kernel parameters are read-only");
            }
            let a = self.src(fc, data, ws, line)?;
            return Ok(Op::StParam { size, a, off });
        }
        let space = space.unwrap_or(Space::Global);
        let (base, off) = self.address(fc, addr, space, line)?;
        if vec == 1 {
            return if is_ld {
                let (d, dbits) = self.dst(fc, data, ws, line)?;
                Ok(Op::Ld {
                    space,
                    size,
                    signed: t.signed(),
                    dbits,
                    d,
                    base,
                    off,
                })
            } else {
                let a = self.src(fc, data, ws, line)?;
                Ok(Op::St {
                    space,
                    size,
                    a,
                    base,
                    off,
                })
            };
        }
        if size < 4 {
            return perr(line, "vectors of sub-word elements are not supported");
        }
        let Opnd::Vector(elems) = data else {
            return perr(line, format!("`{opcode}` needs a vector operand `{{...}}`"));
        };
        if elems.len() != vec as usize {
            return perr(line, format!("`{opcode}` needs {vec} vector elements"));
        }
        let mut regs = [NO_SLOT; 4];
        for (i, e) in elems.iter().enumerate() {
            regs[i] = if is_ld {
                self.dst(fc, e, w, line)?.0
            } else {
                self.src(fc, e, w, line)?
            };
        }
        Ok(if is_ld {
            Op::LdV {
                space,
                esize: size,
                n: vec,
                d: regs,
                base,
                off,
            }
        } else {
            Op::StV {
                space,
                esize: size,
                n: vec,
                a: regs,
                base,
                off,
            }
        })
    }
}
