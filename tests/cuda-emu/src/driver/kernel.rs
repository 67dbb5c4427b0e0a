//! The data of loaded modules and their kernels ([`LoadedModule`], [`Function`]); the
//! driver calls that create and launch them are in [`super::module`].
//!
//! It depends on no other driver module (only on [`crate::ptx`]).

use std::collections::HashMap;
use std::sync::atomic::AtomicI32;
use std::sync::{Arc, Mutex};

use crate::ptx;

/// A loaded module.
pub(crate) struct LoadedModule {
    pub handle: u64,
    pub ctx: u64,
    pub ptx: ptx::Module,
    /// Function handles already handed out, by name.
    pub functions: Mutex<HashMap<String, u64>>,
}

/// A kernel of a loaded module.
pub(crate) struct Function {
    pub ctx: u64,
    pub module: Arc<LoadedModule>,
    pub name: String,
    /// The size of each parameter, in order.
    pub params: Vec<usize>,
    /// Bytes of static `.shared` memory per block.
    pub static_shared: i32,
    /// `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`.
    pub max_dynamic_shared: AtomicI32,
}
