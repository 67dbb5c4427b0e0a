//! The emulated CUDA driver API (see the crate docs). Filled in by the driver work.
