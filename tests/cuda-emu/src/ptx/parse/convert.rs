//! Data movement and conversion: `mov` (packing and unpacking included), `cvt`, `cvta`.

use super::super::inst::*;
use super::common::*;

impl<'a> Parser<'a> {
    /// Decodes `mov`, `cvt` or `cvta`.
    pub(super) fn convert(&mut self, fc: &mut FnCtx, insn: &Insn<'_, 'a>) -> PResult<Op> {
        let Insn {
            base,
            mods,
            ops,
            line,
            ..
        } = *insn;
        match base {
            "cvt" if matches!(mods, ["rn", "f64", "s64"]) => {
                insn.nops(2)?;
                let d = self.dst(fc, &ops[0], W::Exact(64), line)?.0;
                let a = self.src(fc, &ops[1], W::Exact(64), line)?;
                Ok(Op::CvtF64S64 { d, a })
            }
            "cvt" if matches!(mods, ["rn", "f64", "u64"]) => {
                insn.nops(2)?;
                let d = self.dst(fc, &ops[0], W::Exact(64), line)?.0;
                let a = self.src(fc, &ops[1], W::Exact(64), line)?;
                Ok(Op::CvtF64U64 { d, a })
            }
            "cvt" if matches!(mods, ["rzi", "s64", "f64"]) => {
                insn.nops(2)?;
                let d = self.dst(fc, &ops[0], W::Exact(64), line)?.0;
                let a = self.src(fc, &ops[1], W::Exact(64), line)?;
                Ok(Op::CvtS64F64Rzi { d, a })
            }
            "cvt" if matches!(mods, [_, "f64", "f64"]) => {
                let mode = match mods[0] {
                    "rni" => IntegralRound::NearestEven,
                    "rzi" => IntegralRound::Zero,
                    "rmi" => IntegralRound::Down,
                    "rpi" => IntegralRound::Up,
                    _ => return insn.unsupported(),
                };
                insn.nops(2)?;
                let d = self.dst(fc, &ops[0], W::Exact(64), line)?.0;
                let a = self.src(fc, &ops[1], W::Exact(64), line)?;
                Ok(Op::CvtF64F64 { d, a, mode })
            }
            "cvt" => {
                if mods.len() != 2 {
                    return insn.unsupported();
                }
                let (Some(dt), Some(st)) = (parse_ty(mods[0]), parse_ty(mods[1])) else {
                    return insn.unsupported();
                };
                if !dt.is_int() || !st.is_int() {
                    return insn.unsupported();
                }
                insn.nops(2)?;
                let wd = if dt.bits >= 32 {
                    W::Exact(dt.bits)
                } else {
                    W::AtLeast(dt.bits)
                };
                let ws = if st.bits >= 32 {
                    W::Exact(st.bits)
                } else {
                    W::AtLeast(st.bits)
                };
                let d = self.dst(fc, &ops[0], wd, line)?.0;
                let a = self.src(fc, &ops[1], ws, line)?;
                Ok(Op::Cvt {
                    d,
                    a,
                    sbits: st.bits,
                    ssigned: st.signed(),
                    dbits: dt.bits,
                })
            }
            "cvta" => {
                let ok = matches!(mods, ["to", "global", "u64"] | ["global", "u64"]);
                if !ok {
                    return insn.unsupported();
                }
                insn.nops(2)?;
                let d = self.dst(fc, &ops[0], W::Exact(64), line)?.0;
                let a = self.src(fc, &ops[1], W::Exact(64), line)?;
                Ok(Op::Mov { d, a })
            }
            "mov" => {
                if mods.len() != 1 {
                    return insn.unsupported();
                }
                let Some(t) = parse_ty(mods[0]) else {
                    return insn.unsupported();
                };
                insn.nops(2)?;
                if t.kind == TyKind::Pred {
                    let d = self.dst(fc, &ops[0], W::Pred, line)?.0;
                    let a = self.src(fc, &ops[1], W::Pred, line)?;
                    return Ok(Op::Mov { d, a });
                }
                match (&ops[0], &ops[1]) {
                    (Opnd::Vector(v), a) if t.bits == 64 && v.len() == 2 => {
                        let lo = self.dst(fc, &v[0], W::Exact(32), line)?.0;
                        let hi = self.dst(fc, &v[1], W::Exact(32), line)?.0;
                        let a = self.src(fc, a, W::Exact(64), line)?;
                        Ok(Op::Unpack { lo, hi, a })
                    }
                    (d, Opnd::Vector(v)) if t.bits == 64 && v.len() == 2 => {
                        let d = self.dst(fc, d, W::Exact(64), line)?.0;
                        let lo = self.src(fc, &v[0], W::Exact(32), line)?;
                        let hi = self.src(fc, &v[1], W::Exact(32), line)?;
                        Ok(Op::Pack { d, lo, hi })
                    }
                    (d, Opnd::Name("%globaltimer" | "%clock64")) if t.bits == 64 => {
                        let d = self.dst(fc, d, W::Exact(64), line)?.0;
                        Ok(Op::Timer { d })
                    }
                    (d, a) if t.bits == 32 || t.bits == 64 => {
                        let w = W::Exact(t.bits);
                        let d = self.dst(fc, d, w, line)?.0;
                        let a = self.src(fc, a, w, line)?;
                        Ok(Op::Mov { d, a })
                    }
                    _ => insn.unsupported(),
                }
            }
            _ => insn.unsupported(),
        }
    }
}
