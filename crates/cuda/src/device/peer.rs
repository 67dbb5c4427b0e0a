//! Copies from another device's memory ([`Device::copy_from_peer`]): one
//! `cuMemcpyPeerAsync` where peer access is possible, enabled once per pair of contexts.
//!
//! [`Device::copy_from_peer`]: devarrow_abi::device::Device::copy_from_peer

use std::ffi::c_void;
use std::sync::Mutex;

use cudarc::driver::sys;
use devarrow_abi::device::Device;
use devarrow_abi::ArrowDeviceType;

use crate::driver;
use crate::error::CudaError;

use super::CudaDevice;

/// Per pair of contexts (their `cuCtxGetId`s: this device's, the source memory's):
/// whether copies go device to device (`cuDeviceCanAccessPeer` said so and peer access
/// from the first to the second was enabled), asked once per pair for the process
/// ([`Device::copy_from_peer`]): peer access belongs to the context, which every
/// `CudaDevice` of its device shares, so a second enable (another `CudaDevice` of the
/// same device) would be `CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED`. A context made anew
/// after a reset has a new id, and is asked again.
static PEER_ACCESS: Mutex<Option<std::collections::HashMap<(u64, u64), bool>>> = Mutex::new(None);

impl CudaDevice {
    /// One `cuMemcpyPeerAsync` on the device's stream from another CUDA device's memory
    /// (`cuMemcpyAsync` from this device's own), where `cuDeviceCanAccessPeer` says this
    /// device can access the peer's memory; the first copy between two contexts enables
    /// peer access from this device's context to the source memory's (its
    /// `CU_POINTER_ATTRIBUTE_CONTEXT`), remembered for the process per pair of contexts.
    /// `Ok(false)` for a peer without access, or a device of another type: the caller
    /// stages the copy.
    ///
    /// # Safety
    /// As [`Device::copy_from_peer`].
    pub(super) unsafe fn direct_copy_from_peer(
        &self,
        from: &dyn Device,
        src: *const c_void,
        dst: *mut c_void,
        len: usize,
    ) -> devarrow_abi::Result<bool> {
        if from.device_type() != ArrowDeviceType::CUDA {
            return Ok(false);
        }
        if len == 0 {
            return Ok(true);
        }
        if src.is_null() || dst.is_null() {
            return Err(CudaError::InvalidArgument(format!(
                "peer copy of {len} bytes with a NULL pointer"
            ))
            .into());
        }
        self.bind()?;
        let stream = self.stream.cu_stream();
        let peer = from.device_id();
        if peer == self.device_id() {
            // SAFETY: the caller guarantees both ranges, device memory of this device,
            // until the copy completes; the stream belongs to the context bound above.
            unsafe {
                driver::memcpy_async(
                    dst as sys::CUdeviceptr,
                    src as sys::CUdeviceptr,
                    len,
                    stream,
                )
            }?;
            return Ok(true);
        }
        let src_ctx = driver::pointer_context(src as usize)?;
        let pair = (
            driver::ctx_get_id(self.device.cu_context())?,
            driver::ctx_get_id(src_ctx)?,
        );
        let mut peers = PEER_ACCESS.lock().unwrap_or_else(|e| e.into_inner());
        let known = peers
            .get_or_insert_with(Default::default)
            .get(&pair)
            .copied();
        let direct = match known {
            Some(direct) => direct,
            None => {
                let own = driver::device_get(self.device.id() as i32)?;
                let other = driver::device_get(
                    i32::try_from(peer)
                        .map_err(|_| CudaError::InvalidArgument(format!("device id {peer}")))?,
                )?;
                let can = driver::device_can_access_peer(own, other)?;
                if can {
                    // SAFETY: `src_ctx` owns live memory (the source), so it is live; our
                    // context is current (bound above).
                    unsafe { driver::ctx_enable_peer_access(src_ctx) }?;
                }
                peers.get_or_insert_with(Default::default).insert(pair, can);
                can
            }
        };
        drop(peers);
        if !direct {
            return Ok(false);
        }
        // SAFETY: the caller guarantees `src` (memory of `src_ctx`) readable and `dst`
        // (memory of our context) writable for `len` bytes until the copy completes; the
        // stream belongs to our context, bound above.
        unsafe {
            driver::memcpy_peer_async(
                dst as sys::CUdeviceptr,
                self.device.cu_context(),
                src as sys::CUdeviceptr,
                src_ctx,
                len,
                stream,
            )
        }?;
        Ok(true)
    }
}
