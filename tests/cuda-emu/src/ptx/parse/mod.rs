//! PTX text to [`Program`]: directives, `.entry`/`.func` definitions, declarations, and
//! instructions decoded to [`Op`]s with every name resolved (registers to frame slots,
//! labels to instruction indices, parameters to offsets, calls to [`CallInfo`]s).
//!
//! This module parses the module level and functions; `body` their bodies, dispatching
//! each instruction to its family's decoder. Layers (no file uses one that uses it back):
//! `common` (types, the [`Parser`] and its token helpers) is the leaf; `operands` and
//! `decl` use it; the instruction families (`arith`, `convert`, `memory`, `control`,
//! `sync`) use `common` and the operand methods; `body` and this module use them all.

mod arith;
mod body;
mod common;
mod control;
mod convert;
mod decl;
mod memory;
mod operands;
mod sync;

use std::collections::HashMap;

use super::inst::*;
use super::lex::{lex, Kind};
use super::types::{Param, ParseError};
use common::*;

/// Parses a whole module.
pub(crate) fn parse(src: &str) -> PResult<Program> {
    let toks = lex(src)?;
    let mut p = Parser {
        src,
        toks,
        pos: 0,
        prog: Program {
            code: Vec::new(),
            text: Vec::new(),
            funcs: Vec::new(),
            calls: Vec::new(),
            kernels: Vec::new(),
            static_shared: 0,
            dyn_shared_base: 0,
        },
        func_ids: HashMap::new(),
        pending_calls: Vec::new(),
        globals: HashMap::new(),
        dyn_patches: Vec::new(),
    };
    p.module()?;
    p.finish()?;
    Ok(p.prog)
}

impl<'a> Parser<'a> {
    // ------------------------------------------------------------------ module level

    fn module(&mut self) -> PResult<()> {
        while let Some(t) = self.peek() {
            if t.kind != Kind::Ident {
                return perr(t.line, format!("unexpected `{}` at module level", t.text));
            }
            match t.text {
                ".version" | ".target" | ".file" => {
                    self.pos += 1;
                    self.skip_line(t.line);
                }
                ".address_size" => {
                    self.pos += 1;
                    let v = self.expect_uint()?;
                    if v != 64 {
                        return perr(t.line, "only .address_size 64 is supported");
                    }
                }
                ".visible" | ".weak" | ".extern" | ".entry" | ".func" | ".shared" | ".global"
                | ".const" | ".local" => self.module_decl()?,
                _ => return perr(t.line, format!("unexpected `{}` at module level", t.text)),
            }
        }
        Ok(())
    }

    fn module_decl(&mut self) -> PResult<()> {
        let mut external = false;
        loop {
            let t = self.expect_ident()?;
            match t.text {
                ".visible" | ".weak" => {}
                ".extern" => external = true,
                ".entry" => return self.function(true, t.line),
                ".func" => return self.function(false, t.line),
                ".shared" => {
                    let (name, sym) = self.shared_decl(external, t.line)?;
                    self.globals.insert(name.to_string(), sym);
                    return Ok(());
                }
                ".global" | ".const" | ".local" => {
                    return perr(
                        t.line,
                        format!("module-scope {} variables are not supported", t.text),
                    )
                }
                _ => return perr(t.line, format!("unexpected `{}`", t.text)),
            }
        }
    }

    fn function(&mut self, is_entry: bool, line: usize) -> PResult<()> {
        let mut rets = Vec::new();
        if !is_entry && self.peek().is_some_and(|t| t.is_punct(b'(')) {
            rets = self.param_list()?;
        }
        let name = self.expect_ident()?;
        if name.text.starts_with('.') || name.text.starts_with('%') {
            return perr(name.line, format!("bad function name `{}`", name.text));
        }
        let args = if self.peek().is_some_and(|t| t.is_punct(b'(')) {
            self.param_list()?
        } else {
            Vec::new()
        };
        // performance directives
        while let Some(t) = self.peek() {
            match t.text {
                ".maxntid" | ".reqntid" | ".minnctapersm" | ".maxnctapersm" | ".maxnreg"
                | ".maxclusterrank" | ".reqnctapercluster" | ".noreturn" | ".pragma" => {
                    self.pos += 1;
                    while self.peek().is_some_and(|t| {
                        t.kind == Kind::Num || t.is_punct(b',') || t.kind == Kind::Str
                    }) {
                        self.pos += 1;
                    }
                    self.eat_punct(b';');
                }
                _ => break,
            }
        }
        let is_def = match self.peek() {
            Some(t) if t.is_punct(b'{') => true,
            Some(t) if t.is_punct(b';') => {
                self.pos += 1;
                false
            }
            Some(t) => return perr(t.line, format!("expected `{{` or `;`, found `{}`", t.text)),
            None => return perr(line, "unexpected end of input"),
        };

        // the function's frame parameter layout: returns, then arguments
        let idx = match self.func_ids.get(name.text) {
            Some(&i) => {
                let f = &self.prog.funcs[i as usize];
                if f.defined && is_def {
                    return perr(name.line, format!("function `{}` defined twice", name.text));
                }
                if self.prog.kernels.iter().any(|(n, _)| n == name.text) {
                    return perr(name.line, format!("`{}` is already a kernel", name.text));
                }
                i
            }
            None => {
                let i = self.prog.funcs.len() as u32;
                self.prog.funcs.push(Func {
                    defined: false,
                    entry_pc: 0,
                    init: Vec::new(),
                    param_bytes: 0,
                    args: Vec::new(),
                    rets: Vec::new(),
                });
                self.func_ids.insert(name.text.to_string(), i);
                i
            }
        };
        let mut fc = FnCtx::new(idx, name.text);
        let mut ret_layout = Vec::new();
        let mut arg_layout = Vec::new();
        let mut kparams = Vec::new();
        let mut koffsets = Vec::new();
        let mut kbytes = 0u64;
        for r in &rets {
            let off = fc
                .alloc_param(r.size, r.align)
                .map_err(|m| ParseError { line, message: m })?;
            ret_layout.push((off, r.size));
            fc.scopes[0].insert(r.name.to_string(), Sym::FParam { off, size: r.size });
        }
        for a in &args {
            if fc.scopes[0].contains_key(a.name) {
                return perr(line, format!("parameter `{}` declared twice", a.name));
            }
            if is_entry {
                let off = align_up(kbytes, a.align as u64);
                kbytes = off + a.size as u64;
                if kbytes > 32764 {
                    return perr(line, "kernel parameters exceed 32764 bytes");
                }
                kparams.push(Param {
                    name: a.name.to_string(),
                    size: a.size as usize,
                });
                koffsets.push(off as u32);
                fc.scopes[0].insert(
                    a.name.to_string(),
                    Sym::KParam {
                        off: off as u32,
                        size: a.size,
                    },
                );
            } else {
                let off = fc
                    .alloc_param(a.size, a.align)
                    .map_err(|m| ParseError { line, message: m })?;
                arg_layout.push((off, a.size));
                fc.scopes[0].insert(a.name.to_string(), Sym::FParam { off, size: a.size });
            }
        }
        if is_entry {
            self.prog.kernels.push((
                name.text.to_string(),
                KernelDef {
                    func: idx,
                    params: kparams,
                    offsets: koffsets,
                    param_bytes: kbytes as u32,
                },
            ));
        }
        {
            let f = &mut self.prog.funcs[idx as usize];
            f.args = arg_layout;
            f.rets = ret_layout;
        }
        if !is_def {
            return Ok(());
        }
        self.expect_punct(b'{')?;
        let entry_pc = self.prog.code.len() as u32;
        self.body(&mut fc)?;
        // falling off the end returns
        self.push_inst(
            &fc,
            Op::Ret,
            NO_SLOT,
            false,
            "ret (end of function)".into(),
            self.line(),
        );
        for (pc, label, line) in std::mem::take(&mut fc.label_fixups) {
            let Some(&target) = fc.labels.get(&label) else {
                return perr(line, format!("undefined label `{label}`"));
            };
            if let Op::Bra { target: t } = &mut self.prog.code[pc].op {
                *t = target;
            }
        }
        let f = &mut self.prog.funcs[idx as usize];
        f.defined = true;
        f.entry_pc = entry_pc;
        f.init = fc.init;
        f.param_bytes = fc.param_bytes;
        Ok(())
    }

    pub(super) fn push_inst(
        &mut self,
        fc: &FnCtx,
        op: Op,
        guard: Slot,
        guard_neg: bool,
        text: String,
        line: usize,
    ) {
        self.prog.code.push(Inst {
            op,
            guard,
            guard_neg,
        });
        self.prog
            .text
            .push(format!("{text}  // {}, line {line}", fc.name));
    }

    // ------------------------------------------------------------------ finishing

    fn finish(&mut self) -> PResult<()> {
        for pc in std::mem::take(&mut self.pending_calls) {
            let Some(&fid) = self.func_ids.get(&pc.callee) else {
                return perr(
                    pc.line,
                    format!("call of undeclared function `{}`", pc.callee),
                );
            };
            let f = &self.prog.funcs[fid as usize];
            if self.prog.kernels.iter().any(|(_, k)| k.func == fid) {
                return perr(
                    pc.line,
                    format!("`{}` is a kernel and cannot be called", pc.callee),
                );
            }
            if !f.defined {
                return perr(
                    pc.line,
                    format!("function `{}` is declared but not defined", pc.callee),
                );
            }
            let ci = &mut self.prog.calls[pc.info];
            if ci.args.len() != f.args.len() || ci.rets.len() != f.rets.len() {
                return perr(
                    pc.line,
                    format!(
                        "`{}` takes {} arguments and {} results, the call passes {} and {}",
                        pc.callee,
                        f.args.len(),
                        f.rets.len(),
                        ci.args.len(),
                        ci.rets.len()
                    ),
                );
            }
            for (a, &(_, fsize)) in ci
                .args
                .iter_mut()
                .zip(&f.args)
                .chain(ci.rets.iter_mut().zip(&f.rets))
            {
                match a {
                    ArgRef::Param { size, .. } if *size != fsize => {
                        return perr(
                            pc.line,
                            format!(
                                "argument of {size} bytes for a parameter of {fsize} bytes of `{}`",
                                pc.callee
                            ),
                        )
                    }
                    ArgRef::Slot { size, .. } => {
                        if *size < fsize {
                            return perr(
                                pc.line,
                                format!("register of {size} bytes for a parameter of {fsize} bytes of `{}`", pc.callee),
                            );
                        }
                        *size = fsize;
                    }
                    _ => {}
                }
            }
            ci.func = fid;
        }
        // dynamic shared memory starts after the static variables
        let align = self
            .dyn_patches
            .iter()
            .map(|p| p.2)
            .max()
            .unwrap_or(16)
            .max(16);
        let dyn_base = align_up(self.prog.static_shared, align);
        self.prog.dyn_shared_base = dyn_base;
        for &(fid, slot, _) in &self.dyn_patches {
            if let Some(v) = self.prog.funcs[fid as usize].init.get_mut(slot as usize) {
                *v = dyn_base;
            }
        }
        Ok(())
    }
}
