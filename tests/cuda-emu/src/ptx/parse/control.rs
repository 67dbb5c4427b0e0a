//! Control flow: `bra`, `call` (with its argument layout), `ret`, `exit`.

use super::super::inst::*;
use super::super::types::ParseError;
use super::common::*;

impl<'a> Parser<'a> {
    /// Decodes `bra`, `call`, `ret` or `exit`.
    pub(super) fn control(&mut self, fc: &mut FnCtx, insn: &Insn<'_, 'a>) -> PResult<Op> {
        let Insn {
            base,
            mods,
            ops,
            line,
            ..
        } = *insn;
        match base {
            "bra" => {
                if !(mods.is_empty() || mods == ["uni"]) {
                    return insn.unsupported();
                }
                insn.nops(1)?;
                if !matches!(ops[0], Opnd::Name(_)) {
                    return perr(line, "bra needs a label");
                }
                Ok(Op::Bra { target: u32::MAX })
            }
            "call" => {
                if !(mods.is_empty() || mods == ["uni"]) {
                    return insn.unsupported();
                }
                self.call(fc, ops, line)
            }
            "ret" => {
                if !(mods.is_empty() || mods == ["uni"]) {
                    return insn.unsupported();
                }
                insn.nops(0)?;
                Ok(Op::Ret)
            }
            "exit" => {
                if !mods.is_empty() {
                    return insn.unsupported();
                }
                insn.nops(0)?;
                Ok(Op::Exit)
            }
            _ => insn.unsupported(),
        }
    }

    fn call(&mut self, fc: &mut FnCtx, ops: &[Opnd<'a>], line: usize) -> PResult<Op> {
        let (rets, name, args): (&[Opnd<'a>], &str, &[Opnd<'a>]) = match ops {
            [Opnd::Name(n)] => (&[], n, &[]),
            [Opnd::Name(n), Opnd::List(a)] => (&[], n, a),
            [Opnd::List(r), Opnd::Name(n)] => (r, n, &[]),
            [Opnd::List(r), Opnd::Name(n), Opnd::List(a)] => (r, n, a),
            _ => return perr(line, "bad call syntax"),
        };
        let mut refs = |list: &[Opnd<'a>], is_ret: bool| -> PResult<Vec<ArgRef>> {
            let mut out = Vec::new();
            for o in list {
                let r = match o {
                    Opnd::Name(n) => match fc.lookup(n) {
                        Some(Sym::FParam { off, size }) => ArgRef::Param { off, size },
                        Some(Sym::Reg { slot, bits }) if bits >= 8 => ArgRef::Slot {
                            slot,
                            size: bits as u32 / 8,
                        },
                        Some(_) => return perr(line, format!("`{n}` cannot be a call argument")),
                        None => return perr(line, format!("undeclared identifier `{n}`")),
                    },
                    Opnd::Imm(v) if !is_ret => {
                        let slot = fc.konst(*v).map_err(|m| ParseError { line, message: m })?;
                        ArgRef::Slot { slot, size: 8 }
                    }
                    _ => return perr(line, "bad call argument"),
                };
                out.push(r);
            }
            Ok(out)
        };
        let rets = refs(rets, true)?;
        let args = refs(args, false)?;
        let info = self.prog.calls.len();
        self.prog.calls.push(CallInfo {
            func: u32::MAX,
            args,
            rets,
        });
        self.pending_calls.push(PendingCall {
            info,
            callee: name.to_string(),
            line,
        });
        Ok(Op::Call { info: info as u32 })
    }
}
