//! # devarrow-cuda
//!
//! CUDA for the Arrow C Device Data Interface (filled by the CUDA issue).
#![warn(missing_docs)]
