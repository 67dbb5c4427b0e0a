//! A function's body: its statements (labels, declarations, guarded instructions) and
//! each instruction decoded by its family's decoder.

use std::collections::HashMap;

use super::super::inst::*;
use super::super::lex::{Kind, Token};
use super::common::*;

impl<'a> Parser<'a> {
    // ------------------------------------------------------------------ function bodies

    pub(super) fn body(&mut self, fc: &mut FnCtx) -> PResult<()> {
        let mut depth = 1usize;
        loop {
            let t = self.next()?;
            match t.kind {
                Kind::Punct(b'}') => {
                    depth -= 1;
                    fc.scopes.pop();
                    if depth == 0 {
                        return Ok(());
                    }
                }
                Kind::Punct(b'{') => {
                    depth += 1;
                    fc.scopes.push(HashMap::new());
                }
                Kind::Punct(b';') => {}
                Kind::Punct(b'@') => {
                    let neg = self.eat_punct(b'!');
                    let p = self.expect_ident()?;
                    let slot = self.reg_operand(fc, p.text, W::Pred, p.line)?;
                    let op = self.expect_ident()?;
                    self.instruction(fc, op, slot, neg, t.start)?;
                }
                Kind::Ident
                    if self.peek().is_some_and(|n| n.is_punct(b':'))
                        && !t.text.starts_with('.') =>
                {
                    self.pos += 1;
                    if t.text.starts_with('%') {
                        return perr(t.line, format!("bad label `{}`", t.text));
                    }
                    let pc = self.prog.code.len() as u32;
                    if fc.labels.insert(t.text.to_string(), pc).is_some() {
                        return perr(t.line, format!("label `{}` defined twice", t.text));
                    }
                }
                Kind::Ident if t.text.starts_with('.') => self.body_directive(fc, t)?,
                Kind::Ident => self.instruction(fc, t, NO_SLOT, false, t.start)?,
                _ => return perr(t.line, format!("unexpected `{}`", t.text)),
            }
        }
    }

    // ------------------------------------------------------------------ instructions

    fn instruction(
        &mut self,
        fc: &mut FnCtx,
        opcode: Token<'a>,
        guard: Slot,
        guard_neg: bool,
        start: usize,
    ) -> PResult<()> {
        let line = opcode.line;
        let mut ops = Vec::new();
        let end;
        if self.peek().is_some_and(|t| t.is_punct(b';')) {
            end = self.next()?.start;
        } else {
            loop {
                ops.push(self.operand()?);
                let t = self.next()?;
                if t.is_punct(b';') {
                    end = t.start;
                    break;
                }
                if !t.is_punct(b',') {
                    return perr(t.line, format!("expected `,` or `;`, found `{}`", t.text));
                }
            }
        }
        let text = self
            .src
            .get(start..end)
            .unwrap_or("")
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        let op = self.decode(fc, opcode.text, &ops, line)?;
        if let Op::Bra { .. } = op {
            let Some(Opnd::Name(label)) = ops.first() else {
                return perr(line, "bra needs a label");
            };
            fc.label_fixups
                .push((self.prog.code.len(), label.to_string(), line));
        }
        self.push_inst(fc, op, guard, guard_neg, text, line);
        Ok(())
    }

    /// Decodes one instruction: its opcode's first part picks the family's decoder.
    fn decode(
        &mut self,
        fc: &mut FnCtx,
        opcode: &str,
        ops: &[Opnd<'a>],
        line: usize,
    ) -> PResult<Op> {
        let parts: Vec<&str> = opcode.split('.').collect();
        let insn = Insn {
            opcode,
            base: parts[0],
            mods: &parts[1..],
            ops,
            line,
        };
        match insn.base {
            "add" | "sub" | "div" | "rem" | "min" | "max" | "and" | "or" | "xor" | "shl"
            | "shr" | "mul" | "mad" | "not" | "neg" | "abs" | "popc" | "clz" | "brev" | "bfe"
            | "bfi" | "shf" | "selp" | "setp" | "sqrt" => self.arith(fc, &insn),
            "cvt" | "cvta" | "mov" => self.convert(fc, &insn),
            "ld" | "st" | "atom" | "red" => self.memory(fc, &insn),
            "bra" | "call" | "ret" | "exit" => self.control(fc, &insn),
            "bar" | "barrier" | "shfl" | "vote" | "membar" | "fence" => self.sync(fc, &insn),
            _ => insn.unsupported(),
        }
    }
}
