//! Synchronization: block barriers (`bar`/`barrier`), warp shuffles (`shfl.sync`), warp
//! votes (`vote.sync`) and fences (`membar`/`fence`).

use super::super::inst::*;
use super::common::*;

impl<'a> Parser<'a> {
    /// Decodes `bar`/`barrier`, `shfl`, `vote` or `membar`/`fence`.
    pub(super) fn sync(&mut self, fc: &mut FnCtx, insn: &Insn<'_, 'a>) -> PResult<Op> {
        let Insn {
            base,
            mods,
            ops,
            line,
            opcode,
        } = *insn;
        match base {
            "bar" | "barrier" => {
                let ok = matches!(
                    mods,
                    ["sync"] | ["sync", "aligned"] | ["cta", "sync"] | ["cta", "sync", "aligned"]
                );
                if !ok {
                    return insn.unsupported();
                }
                if ops.len() != 1 {
                    return perr(
                        line,
                        format!("`{opcode}` with a thread count is not supported"),
                    );
                }
                let id = self.src(fc, &ops[0], W::Exact(32), line)?;
                Ok(Op::Bar { id })
            }
            "shfl" => {
                if mods.len() != 3 || mods[0] != "sync" || mods[2] != "b32" {
                    return insn.unsupported();
                }
                let mode = match mods[1] {
                    "up" => ShflMode::Up,
                    "down" => ShflMode::Down,
                    "bfly" => ShflMode::Bfly,
                    "idx" => ShflMode::Idx,
                    _ => return insn.unsupported(),
                };
                insn.nops(5)?;
                let w = W::Exact(32);
                let (d, p) = match &ops[0] {
                    Opnd::Pair(d, p) => {
                        let d = self.dst(fc, &Opnd::Name(d), w, line)?.0;
                        let p = self.dst(fc, &Opnd::Name(p), W::Pred, line)?.0;
                        (d, p)
                    }
                    o => (self.dst(fc, o, w, line)?.0, NO_SLOT),
                };
                let a = self.src(fc, &ops[1], w, line)?;
                let b = self.src(fc, &ops[2], w, line)?;
                let c = self.src(fc, &ops[3], w, line)?;
                let mask = self.src(fc, &ops[4], w, line)?;
                Ok(Op::Shfl {
                    mode,
                    d,
                    p,
                    a,
                    b,
                    c,
                    mask,
                })
            }
            "vote" => {
                // only the .sync forms (the others are for sm_6x and below)
                let (mode, w) = match mods {
                    ["sync", "all", "pred"] => (VoteMode::All, W::Pred),
                    ["sync", "any", "pred"] => (VoteMode::Any, W::Pred),
                    ["sync", "uni", "pred"] => (VoteMode::Uni, W::Pred),
                    ["sync", "ballot", "b32"] => (VoteMode::Ballot, W::Exact(32)),
                    _ => return insn.unsupported(),
                };
                insn.nops(3)?;
                let d = self.dst(fc, &ops[0], w, line)?.0;
                let (a, a_neg) = match &ops[1] {
                    Opnd::Not(n) => (self.reg_operand(fc, n, W::Pred, line)?, true),
                    o => (self.src(fc, o, W::Pred, line)?, false),
                };
                let mask = self.src(fc, &ops[2], W::Exact(32), line)?;
                Ok(Op::Vote {
                    mode,
                    d,
                    a,
                    a_neg,
                    mask,
                })
            }
            "membar" | "fence" => {
                insn.nops(0)?;
                Ok(Op::Nop)
            }
            _ => insn.unsupported(),
        }
    }
}
