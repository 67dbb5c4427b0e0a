//! # devarrow-bridge
//!
//! arrow-rs record batches to a device and back (filled by the bridge issue).
#![warn(missing_docs)]
