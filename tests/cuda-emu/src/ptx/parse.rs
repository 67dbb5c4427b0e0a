//! PTX text to [`Program`]: directives, `.entry`/`.func` definitions, declarations, and
//! instructions decoded to [`Op`]s with every name resolved (registers to frame slots,
//! labels to instruction indices, parameters to offsets, calls to [`CallInfo`]s).

use std::collections::HashMap;

use super::inst::*;
use super::lex::{lex, parse_int, Kind, Token};
use super::{Param, ParseError};

/// Most register slots one function may use.
const MAX_SLOTS: usize = 1 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TyKind {
    B,
    U,
    S,
    F,
    Pred,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ty {
    bits: u8,
    kind: TyKind,
}

impl Ty {
    fn bytes(self) -> u32 {
        (self.bits as u32).div_ceil(8)
    }
    fn is_int(self) -> bool {
        matches!(self.kind, TyKind::B | TyKind::U | TyKind::S)
    }
    fn signed(self) -> bool {
        self.kind == TyKind::S
    }
}

fn parse_ty(s: &str) -> Option<Ty> {
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
enum Sym {
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
enum W {
    Pred,
    /// A register of exactly this many bits (immediates are truncated to it).
    Exact(u8),
    /// A register at least this wide (sub-word `ld`/`st`/`cvt` types).
    AtLeast(u8),
}

#[derive(Debug, Clone)]
enum Opnd<'a> {
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
enum SlotKind {
    Reg(u8),
    Const,
    Special,
}

/// Per-function parsing state.
struct FnCtx {
    idx: u32,
    name: String,
    scopes: Vec<HashMap<String, Sym>>,
    init: Vec<u64>,
    kinds: Vec<SlotKind>,
    consts: HashMap<u64, Slot>,
    param_bytes: u32,
    labels: HashMap<String, u32>,
    label_fixups: Vec<(usize, String, usize)>,
}

impl FnCtx {
    fn new(idx: u32, name: &str) -> Self {
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

    fn lookup(&self, name: &str) -> Option<Sym> {
        self.scopes.iter().rev().find_map(|s| s.get(name).copied())
    }

    fn new_slot(&mut self, kind: SlotKind, value: u64) -> Result<Slot, String> {
        if self.init.len() >= MAX_SLOTS {
            return Err("too many registers".into());
        }
        self.init.push(value);
        self.kinds.push(kind);
        Ok((self.init.len() - 1) as Slot)
    }

    fn konst(&mut self, value: u64) -> Result<Slot, String> {
        if let Some(&s) = self.consts.get(&value) {
            return Ok(s);
        }
        let s = self.new_slot(SlotKind::Const, value)?;
        self.consts.insert(value, s);
        Ok(s)
    }

    fn alloc_param(&mut self, size: u32, align: u32) -> Result<u32, String> {
        let off = align_up(self.param_bytes as u64, align.max(1) as u64);
        let end = off + size as u64;
        if end > u32::MAX as u64 / 2 {
            return Err("parameter area too large".into());
        }
        self.param_bytes = end as u32;
        Ok(off as u32)
    }
}

fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

/// The initial value of a register: PTX leaves registers undefined, so they start as
/// junk (predicates as false) rather than zero, which a kernel must not rely on.
fn poison(bits: u8) -> u64 {
    if bits == 1 {
        0
    } else {
        0xDEAD_BEEF_DEAD_BEEF & mask(bits)
    }
}

fn mask(bits: u8) -> u64 {
    if bits >= 64 {
        u64::MAX
    } else {
        (1u64 << bits) - 1
    }
}

struct PendingCall {
    info: usize,
    callee: String,
    line: usize,
}

/// One declared parameter: name, size, alignment.
struct ParamDecl<'a> {
    name: &'a str,
    size: u32,
    align: u32,
}

struct Parser<'a> {
    src: &'a str,
    toks: Vec<Token<'a>>,
    pos: usize,
    prog: Program,
    func_ids: HashMap<String, u32>,
    pending_calls: Vec<PendingCall>,
    globals: HashMap<String, Sym>,
    /// (function, slot, offset in the dynamic shared area) to rebase once the static
    /// shared size is known.
    dyn_patches: Vec<(u32, Slot, u64)>,
}

type PResult<T> = Result<T, ParseError>;

fn perr<T>(line: usize, message: impl Into<String>) -> PResult<T> {
    Err(ParseError {
        line,
        message: message.into(),
    })
}

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
    fn peek(&self) -> Option<Token<'a>> {
        self.toks.get(self.pos).copied()
    }

    fn line(&self) -> usize {
        self.toks
            .get(self.pos)
            .or_else(|| self.toks.last())
            .map_or(1, |t| t.line)
    }

    fn next(&mut self) -> PResult<Token<'a>> {
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
    fn param_size(&mut self, elem: u32, line: usize) -> PResult<u32> {
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

    fn eat_punct(&mut self, c: u8) -> bool {
        if self.peek().is_some_and(|t| t.is_punct(c)) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    fn expect_punct(&mut self, c: u8) -> PResult<Token<'a>> {
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

    fn expect_ident(&mut self) -> PResult<Token<'a>> {
        let t = self.next()?;
        if t.kind == Kind::Ident {
            Ok(t)
        } else {
            perr(t.line, format!("expected a name, found `{}`", t.text))
        }
    }

    fn expect_uint(&mut self) -> PResult<u64> {
        let t = self.next()?;
        if t.kind == Kind::Num {
            if let Some(v) = parse_int(t.text) {
                return Ok(v);
            }
        }
        perr(t.line, format!("expected an integer, found `{}`", t.text))
    }

    /// Skips the rest of the current token's line (directives without `;`).
    fn skip_line(&mut self, line: usize) {
        while self.peek().is_some_and(|t| t.line == line) {
            self.pos += 1;
        }
    }

    /// Skips to just past the next `;`.
    fn skip_statement(&mut self) -> PResult<()> {
        loop {
            if self.next()?.is_punct(b';') {
                return Ok(());
            }
        }
    }

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

    /// After `.shared`: `[.align A] .type name[N]...;` (or `name[]` when extern).
    fn shared_decl(&mut self, external: bool, line: usize) -> PResult<(&'a str, Sym)> {
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
    fn param_list(&mut self) -> PResult<Vec<ParamDecl<'a>>> {
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

    fn push_inst(
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

    // ------------------------------------------------------------------ function bodies

    fn body(&mut self, fc: &mut FnCtx) -> PResult<()> {
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

    fn body_directive(&mut self, fc: &mut FnCtx, t: Token<'a>) -> PResult<()> {
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

    fn declare(&mut self, fc: &mut FnCtx, name: &str, sym: Sym, line: usize) -> PResult<()> {
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
    fn reg_decl(&mut self, fc: &mut FnCtx, line: usize) -> PResult<()> {
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

    fn new_reg(&mut self, fc: &mut FnCtx, name: &str, bits: u8, line: usize) -> PResult<()> {
        if SPECIALS.contains(&name) {
            return perr(line, format!("`{name}` is a special register"));
        }
        let slot = fc
            .new_slot(SlotKind::Reg(bits), poison(bits))
            .map_err(|m| ParseError { line, message: m })?;
        self.declare(fc, name, Sym::Reg { slot, bits }, line)
    }

    // ------------------------------------------------------------------ operands

    fn operand(&mut self) -> PResult<Opnd<'a>> {
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

    fn int_value(&self, t: Token<'a>, neg: bool) -> PResult<u64> {
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
    fn reg_operand(&mut self, fc: &mut FnCtx, name: &str, w: W, line: usize) -> PResult<Slot> {
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

    fn src(&mut self, fc: &mut FnCtx, o: &Opnd<'a>, w: W, line: usize) -> PResult<Slot> {
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

    fn dst(&mut self, fc: &mut FnCtx, o: &Opnd<'a>, w: W, line: usize) -> PResult<(Slot, u8)> {
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
    fn address(
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
    fn param_address(
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

    fn decode(
        &mut self,
        fc: &mut FnCtx,
        opcode: &str,
        ops: &[Opnd<'a>],
        line: usize,
    ) -> PResult<Op> {
        let parts: Vec<&str> = opcode.split('.').collect();
        let base = parts[0];
        let mods = &parts[1..];
        let unsupported = || perr(line, format!("unsupported instruction `{opcode}`"));
        let nops = |n: usize| -> PResult<()> {
            if ops.len() == n {
                Ok(())
            } else {
                perr(
                    line,
                    format!("`{opcode}` takes {n} operands, {} given", ops.len()),
                )
            }
        };
        // the type is the last modifier
        let last_ty = || mods.last().and_then(|s| parse_ty(s));
        macro_rules! int_ty {
            ($allowed:expr) => {{
                match (mods.len(), last_ty()) {
                    (_, Some(t)) if t.is_int() && (t.bits == 32 || t.bits == 64) && $allowed(t) => {
                        t
                    }
                    _ => return unsupported(),
                }
            }};
        }
        match base {
            "add" | "sub" | "div" | "rem" | "min" | "max" => {
                if mods.len() != 1 {
                    return unsupported();
                }
                let t = int_ty!(|t: Ty| t.kind != TyKind::B || matches!(base, "add" | "sub"));
                nops(3)?;
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
                    return unsupported();
                }
                nops(3)?;
                if mods[0] == "pred" {
                    let d = self.dst(fc, &ops[0], W::Pred, line)?.0;
                    let a = self.src(fc, &ops[1], W::Pred, line)?;
                    let b = self.src(fc, &ops[2], W::Pred, line)?;
                    let op = match base {
                        "and" => BoolOp::And,
                        "or" => BoolOp::Or,
                        _ => BoolOp::Xor,
                    };
                    return Ok(Op::PredLogic { op, d, a, b });
                }
                let t = int_ty!(|_| true);
                let op = match base {
                    "and" => AluOp::And,
                    "or" => AluOp::Or,
                    _ => AluOp::Xor,
                };
                self.alu(fc, op, t.bits, t.bits, ops, line)
            }
            "shl" | "shr" => {
                if mods.len() != 1 {
                    return unsupported();
                }
                let t = int_ty!(|t: Ty| base == "shr" || t.kind == TyKind::B);
                nops(3)?;
                let op = match (base, t.signed()) {
                    ("shl", _) => AluOp::Shl,
                    (_, true) => AluOp::ShrS,
                    _ => AluOp::ShrU,
                };
                self.alu(fc, op, t.bits, 32, ops, line)
            }
            "mul" => {
                if mods.len() != 2 {
                    return unsupported();
                }
                let t = int_ty!(|t: Ty| t.kind != TyKind::B);
                nops(3)?;
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
                    _ => unsupported(),
                }
            }
            "mad" => {
                if mods.len() != 2 || mods[0] != "lo" {
                    return unsupported();
                }
                let t = int_ty!(|t: Ty| t.kind != TyKind::B);
                nops(4)?;
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
                    return unsupported();
                }
                nops(2)?;
                if base == "not" && mods[0] == "pred" {
                    let d = self.dst(fc, &ops[0], W::Pred, line)?.0;
                    let a = self.src(fc, &ops[1], W::Pred, line)?;
                    return Ok(Op::PredNot { d, a });
                }
                let t = int_ty!(|t: Ty| match base {
                    "neg" | "abs" => t.kind == TyKind::S,
                    _ => t.kind == TyKind::B,
                });
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
                    return unsupported();
                }
                let t = int_ty!(|t: Ty| t.kind != TyKind::B);
                nops(4)?;
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
                    return unsupported();
                }
                let t = int_ty!(|t: Ty| t.kind == TyKind::B);
                nops(5)?;
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
                    return unsupported();
                }
                let left = match mods[0] {
                    "l" => true,
                    "r" => false,
                    _ => return unsupported(),
                };
                let clamp = match mods[1] {
                    "clamp" => true,
                    "wrap" => false,
                    _ => return unsupported(),
                };
                nops(4)?;
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
                let t = match (mods.len(), last_ty()) {
                    (1, Some(t)) if t.bits == 32 || t.bits == 64 => t,
                    _ => return unsupported(),
                };
                nops(4)?;
                let w = W::Exact(t.bits);
                let d = self.dst(fc, &ops[0], w, line)?.0;
                let a = self.src(fc, &ops[1], w, line)?;
                let b = self.src(fc, &ops[2], w, line)?;
                let p = self.src(fc, &ops[3], W::Pred, line)?;
                Ok(Op::Selp { d, a, b, p })
            }
            "setp" => self.setp(fc, mods, ops, line, opcode),
            "cvt" => {
                if mods.len() != 2 {
                    return unsupported();
                }
                let (Some(dt), Some(st)) = (parse_ty(mods[0]), parse_ty(mods[1])) else {
                    return unsupported();
                };
                if !dt.is_int() || !st.is_int() {
                    return unsupported();
                }
                nops(2)?;
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
                    return unsupported();
                }
                nops(2)?;
                let d = self.dst(fc, &ops[0], W::Exact(64), line)?.0;
                let a = self.src(fc, &ops[1], W::Exact(64), line)?;
                Ok(Op::Mov { d, a })
            }
            "mov" => {
                if mods.len() != 1 {
                    return unsupported();
                }
                let Some(t) = parse_ty(mods[0]) else {
                    return unsupported();
                };
                nops(2)?;
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
                    _ => unsupported(),
                }
            }
            "ld" | "st" => self.ld_st(fc, base == "ld", mods, ops, line, opcode),
            "atom" | "red" => {
                let mut space = Space::Global;
                let mut add = false;
                let mut ty = None;
                for (i, m) in mods.iter().enumerate() {
                    match *m {
                        "global" => space = Space::Global,
                        "shared" => space = Space::Shared,
                        "relaxed" | "cta" | "gpu" | "sys" => {}
                        "add" => add = true,
                        _ if i == mods.len() - 1 => ty = parse_ty(m),
                        _ => return unsupported(),
                    }
                }
                let Some(t) = ty.filter(|t| {
                    add && t.is_int() && t.kind != TyKind::B && (t.bits == 32 || t.bits == 64)
                }) else {
                    return unsupported();
                };
                if t.signed() && t.bits == 64 {
                    return unsupported();
                }
                let w = W::Exact(t.bits);
                let (d, rest) = if base == "atom" {
                    nops(3)?;
                    (self.dst(fc, &ops[0], w, line)?.0, &ops[1..])
                } else {
                    nops(2)?;
                    (NO_SLOT, ops)
                };
                let (abase, off) = self.address(fc, &rest[0], space, line)?;
                let b = self.src(fc, &rest[1], w, line)?;
                Ok(Op::AtomAdd {
                    space,
                    size: t.bits / 8,
                    d,
                    base: abase,
                    off,
                    b,
                })
            }
            "bra" => {
                if !(mods.is_empty() || mods == ["uni"]) {
                    return unsupported();
                }
                nops(1)?;
                if !matches!(ops[0], Opnd::Name(_)) {
                    return perr(line, "bra needs a label");
                }
                Ok(Op::Bra { target: u32::MAX })
            }
            "call" => {
                if !(mods.is_empty() || mods == ["uni"]) {
                    return unsupported();
                }
                self.call(fc, ops, line)
            }
            "ret" => {
                if !(mods.is_empty() || mods == ["uni"]) {
                    return unsupported();
                }
                nops(0)?;
                Ok(Op::Ret)
            }
            "exit" => {
                if !mods.is_empty() {
                    return unsupported();
                }
                nops(0)?;
                Ok(Op::Exit)
            }
            "bar" | "barrier" => {
                let ok = matches!(
                    mods,
                    ["sync"] | ["sync", "aligned"] | ["cta", "sync"] | ["cta", "sync", "aligned"]
                );
                if !ok {
                    return unsupported();
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
                    return unsupported();
                }
                let mode = match mods[1] {
                    "up" => ShflMode::Up,
                    "down" => ShflMode::Down,
                    "bfly" => ShflMode::Bfly,
                    "idx" => ShflMode::Idx,
                    _ => return unsupported(),
                };
                nops(5)?;
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
            "membar" | "fence" => {
                nops(0)?;
                Ok(Op::Nop)
            }
            _ => unsupported(),
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

    fn setp(
        &mut self,
        fc: &mut FnCtx,
        mods: &[&str],
        ops: &[Opnd<'a>],
        line: usize,
        opcode: &str,
    ) -> PResult<Op> {
        let unsupported = || perr(line, format!("unsupported instruction `{opcode}`"));
        let (cmp_s, bop_s, ty_s) = match mods {
            [c, t] => (*c, None, *t),
            [c, b, t] => (*c, Some(*b), *t),
            _ => return unsupported(),
        };
        let Some(t) = parse_ty(ty_s).filter(|t| t.is_int() && (t.bits == 32 || t.bits == 64))
        else {
            return unsupported();
        };
        let s = t.signed();
        let cmp = match cmp_s {
            "eq" => Cmp::Eq,
            "ne" => Cmp::Ne,
            _ if t.kind == TyKind::B => return unsupported(),
            "lt" if s => Cmp::LtS,
            "le" if s => Cmp::LeS,
            "gt" if s => Cmp::GtS,
            "ge" if s => Cmp::GeS,
            "lt" | "lo" => Cmp::LtU,
            "le" | "ls" => Cmp::LeU,
            "gt" | "hi" => Cmp::GtU,
            "ge" | "hs" => Cmp::GeU,
            _ => return unsupported(),
        };
        let bop = match bop_s {
            None => None,
            Some("and") => Some(BoolOp::And),
            Some("or") => Some(BoolOp::Or),
            Some("xor") => Some(BoolOp::Xor),
            Some(_) => return unsupported(),
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

    fn ld_st(
        &mut self,
        fc: &mut FnCtx,
        is_ld: bool,
        mods: &[&str],
        ops: &[Opnd<'a>],
        line: usize,
        opcode: &str,
    ) -> PResult<Op> {
        let unsupported = || perr(line, format!("unsupported instruction `{opcode}`"));
        let Some((ty_s, rest)) = mods.split_last() else {
            return unsupported();
        };
        let Some(t) = parse_ty(ty_s).filter(|t| t.kind != TyKind::Pred) else {
            return unsupported();
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
                _ => return unsupported(),
            }
        }
        if param && space.is_some() {
            return unsupported();
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
                return unsupported();
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
