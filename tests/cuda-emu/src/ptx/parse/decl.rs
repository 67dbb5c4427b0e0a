//! Declarations: `.shared` variables (module or function scope), parameter lists,
//! and the directives of a function body (`.reg`, `.param`, `.shared`, `.loc`, ...).

use super::super::inst::*;
use super::super::lex::Token;
use super::super::types::ParseError;
use super::common::*;

impl<'a> Parser<'a> {
    /// After `.shared`: `[.align A] .type name[N]...;` (or `name[]` when extern).
    pub(super) fn shared_decl(&mut self, external: bool, line: usize) -> PResult<(&'a str, Sym)> {
        let mut align = 0u64;
        let mut ty = None;
        loop {
            let t = self.expect_ident()?;
            if t.text == ".align" {
                align = self.expect_uint()?;
                if !align.is_power_of_two() || align > 4096 {
                    return perr(t.line, "bad .align");
                }
            } else if let Some(x) = t.text.strip_prefix('.').and_then(parse_ty) {
                if x.kind == TyKind::Pred {
                    return perr(t.line, ".shared .pred is not allowed");
                }
                ty = Some(x);
            } else if t.text.starts_with('.') {
                return perr(
                    t.line,
                    format!("unsupported `{}` in .shared declaration", t.text),
                );
            } else {
                let ty = ty.ok_or_else(|| ParseError {
                    line,
                    message: "missing type in .shared declaration".into(),
                })?;
                let elem = ty.bytes() as u64;
                let align = if align == 0 { elem } else { align };
                let mut count = 1u64;
                let mut open_array = false;
                while self.eat_punct(b'[') {
                    if self.eat_punct(b']') {
                        open_array = true;
                        continue;
                    }
                    let n = self.expect_uint()?;
                    self.expect_punct(b']')?;
                    count = count
                        .checked_mul(n)
                        .filter(|&c| c <= 1 << 24)
                        .ok_or(ParseError {
                            line,
                            message: "shared array too large".into(),
                        })?;
                }
                self.expect_punct(b';')?;
                if open_array || external {
                    if !(open_array && external) {
                        return perr(
                            line,
                            "dynamic shared memory must be `.extern .shared` with `[]`",
                        );
                    }
                    // dynamic shared memory: placed after all static variables
                    // (the address is patched in `finish`; `addr` holds the alignment)
                    return Ok((
                        t.text,
                        Sym::Shared {
                            addr: align.max(16),
                            dynamic: true,
                        },
                    ));
                }
                let addr = align_up(self.prog.static_shared, align);
                self.prog.static_shared = addr + elem * count;
                if self.prog.static_shared > 1 << 24 {
                    return perr(line, "too much shared memory");
                }
                return Ok((
                    t.text,
                    Sym::Shared {
                        addr,
                        dynamic: false,
                    },
                ));
            }
        }
    }

    /// `( .param ..., ... )`
    pub(super) fn param_list(&mut self) -> PResult<Vec<ParamDecl<'a>>> {
        self.expect_punct(b'(')?;
        let mut out = Vec::new();
        if self.eat_punct(b')') {
            return Ok(out);
        }
        loop {
            let t = self.expect_ident()?;
            if t.text != ".param" && t.text != ".reg" {
                return perr(t.line, format!("expected .param, found `{}`", t.text));
            }
            if t.text == ".reg" {
                return perr(t.line, ".reg parameters are not supported");
            }
            let mut align = 0u32;
            let mut ty = None;
            let name = loop {
                let t = self.expect_ident()?;
                match t.text {
                    ".align" => {
                        let a = self.expect_uint()?;
                        if !a.is_power_of_two() || a > 256 {
                            return perr(t.line, "bad .align");
                        }
                        align = a as u32;
                    }
                    ".ptr" | ".global" | ".shared" | ".const" | ".local" => {}
                    s if s.starts_with('.') => match parse_ty(&s[1..]) {
                        Some(x) if x.kind != TyKind::Pred => ty = Some(x),
                        _ => return perr(t.line, format!("unsupported parameter type `{s}`")),
                    },
                    _ => break t,
                }
            };
            let ty = ty.ok_or(ParseError {
                line: name.line,
                message: format!("parameter `{}` has no type", name.text),
            })?;
            let size = self.param_size(ty.bytes(), name.line)?;
            let align = if align == 0 { ty.bytes() } else { align };
            out.push(ParamDecl {
                name: name.text,
                size,
                align,
            });
            if self.eat_punct(b')') {
                return Ok(out);
            }
            self.expect_punct(b',')?;
        }
    }

    pub(super) fn body_directive(&mut self, fc: &mut FnCtx, t: Token<'a>) -> PResult<()> {
        match t.text {
            ".reg" => self.reg_decl(fc, t.line),
            ".param" => {
                let mut align = 0u32;
                let mut ty = None;
                let name = loop {
                    let x = self.expect_ident()?;
                    if x.text == ".align" {
                        let a = self.expect_uint()?;
                        if !a.is_power_of_two() || a > 256 {
                            return perr(x.line, "bad .align");
                        }
                        align = a as u32;
                    } else if let Some(s) = x.text.strip_prefix('.') {
                        match parse_ty(s) {
                            Some(y) if y.kind != TyKind::Pred => ty = Some(y),
                            _ => {
                                return perr(x.line, format!("unsupported `{}` in .param", x.text))
                            }
                        }
                    } else {
                        break x;
                    }
                };
                let ty = ty.ok_or(ParseError {
                    line: t.line,
                    message: "missing type in .param".into(),
                })?;
                let size = self.param_size(ty.bytes(), t.line)?;
                self.expect_punct(b';')?;
                let align = if align == 0 { ty.bytes() } else { align };
                let off = fc.alloc_param(size, align).map_err(|m| ParseError {
                    line: t.line,
                    message: m,
                })?;
                self.declare(fc, name.text, Sym::FParam { off, size }, name.line)
            }
            ".shared" => {
                let (name, sym) = self.shared_decl(false, t.line)?;
                self.declare(fc, name, sym, t.line)
            }
            ".extern" => {
                let s = self.expect_ident()?;
                if s.text != ".shared" {
                    return perr(
                        s.line,
                        format!("unsupported `.extern {}` in a function", s.text),
                    );
                }
                let (name, sym) = self.shared_decl(true, t.line)?;
                self.declare(fc, name, sym, t.line)
            }
            ".loc" | ".file" => {
                self.skip_line(t.line);
                Ok(())
            }
            ".pragma" => self.skip_statement(),
            ".local" => perr(t.line, ".local variables are not supported"),
            _ => perr(t.line, format!("unsupported directive `{}`", t.text)),
        }
    }

    pub(super) fn declare(
        &mut self,
        fc: &mut FnCtx,
        name: &str,
        sym: Sym,
        line: usize,
    ) -> PResult<()> {
        let scope = fc.scopes.last_mut().ok_or(ParseError {
            line,
            message: "declaration outside a scope".into(),
        })?;
        if scope.insert(name.to_string(), sym).is_some() {
            return perr(line, format!("`{name}` declared twice in one scope"));
        }
        Ok(())
    }

    /// `.reg [.v2|.v4]? .type name[<N>] (, name[<N>])* ;`
    pub(super) fn reg_decl(&mut self, fc: &mut FnCtx, line: usize) -> PResult<()> {
        let t = self.expect_ident()?;
        let ty = t
            .text
            .strip_prefix('.')
            .and_then(parse_ty)
            .ok_or(ParseError {
                line: t.line,
                message: format!("unsupported register type `{}`", t.text),
            })?;
        loop {
            let name = self.expect_ident()?;
            if name.text.starts_with('.') {
                return perr(name.line, format!("bad register name `{}`", name.text));
            }
            if self.eat_punct(b'<') {
                let n = self.expect_uint()?;
                self.expect_punct(b'>')?;
                if n > 65536 {
                    return perr(line, "register range too large");
                }
                for i in 0..n {
                    self.new_reg(fc, &format!("{}{i}", name.text), ty.bits, line)?;
                }
            } else {
                self.new_reg(fc, name.text, ty.bits, line)?;
            }
            if self.eat_punct(b';') {
                return Ok(());
            }
            self.expect_punct(b',')?;
        }
    }

    pub(super) fn new_reg(
        &mut self,
        fc: &mut FnCtx,
        name: &str,
        bits: u8,
        line: usize,
    ) -> PResult<()> {
        if SPECIALS.contains(&name) {
            return perr(line, format!("`{name}` is a special register"));
        }
        let slot = fc
            .new_slot(SlotKind::Reg(bits), poison(bits))
            .map_err(|m| ParseError { line, message: m })?;
        self.declare(fc, name, Sym::Reg { slot, bits }, line)
    }
}
