//! `impl DeviceKernels for CudaDevice`: the conversions of `devarrow_abi`'s
//! [`DeviceKernels`] as the PTX kernels of `kernels/convert.ptx` (launched through
//! [`crate::kernels`]) on the device's stream.

use std::ffi::c_void;

use devarrow_abi::device::{DeviceKernels, RowIntegers, Validity};

use crate::driver;
use crate::error::{CudaError, Result};
use crate::kernels;

use super::CudaDevice;

/// Refuses an address that is not a multiple of `align` (kernels load and store their
/// elements at natural alignment; a misaligned access would be a sticky fault).
fn check_aligned(what: &str, address: u64, align: u64) -> Result<()> {
    if !address.is_multiple_of(align) {
        return Err(CudaError::InvalidArgument(format!(
            "{what} at {address:#x} is not {align}-byte aligned"
        )));
    }
    Ok(())
}

/// Checks the alignment of row integers (address and stride, by their width) and gives
/// `(address, stride, wide)`.
fn row_integers(what: &str, rows: RowIntegers) -> Result<(u64, u64, bool)> {
    let width = if rows.wide { 8 } else { 4 };
    check_aligned(what, rows.address as u64, width)?;
    if !rows.stride.is_multiple_of(width) {
        return Err(CudaError::InvalidArgument(format!(
            "{what}: a stride of {} bytes for {width}-byte integers",
            rows.stride
        )));
    }
    Ok((rows.address as u64, rows.stride, rows.wide))
}

// SAFETY: each method enqueues on the device's stream the kernels of
// `kernels/convert.ptx` (`count_set_bits`: validity.ptx's) that do what its documentation
// says (checked against `CpuKernels` in tests/ptx_kernels.rs and tests/gpu.rs), reading
// and writing only the ranges it names plus temporary buffers of their own (freed in
// stream order). Misaligned addresses (past the natural alignment of each element) and
// unsupported widths are refused with an error before anything is enqueued.
unsafe impl DeviceKernels for CudaDevice {
    unsafe fn row_sizes(
        &self,
        sizes: RowIntegers,
        validity: Validity,
        n: u64,
        out: *mut c_void,
    ) -> devarrow_abi::Result<()> {
        let (src, stride, wide) = if n > 0 {
            row_integers("row sizes", sizes)?
        } else {
            (0, 0, false)
        };
        check_aligned("row sizes output", out as u64, 8)?;
        self.bind()?;
        // SAFETY: the ranges are the caller's guarantee, the alignment checked above.
        unsafe {
            kernels::launch_row_sizes(
                &self.stream,
                src,
                stride,
                wide,
                validity.address as u64,
                validity.bit_offset,
                n,
                out as u64,
            )
        }?;
        Ok(())
    }

    unsafe fn inclusive_scan_i64(&self, data: *mut c_void, n: u64) -> devarrow_abi::Result<()> {
        if n == 0 {
            return Ok(());
        }
        check_aligned("scan data", data as u64, 8)?;
        self.bind()?;
        // SAFETY: the caller's guarantee, the alignment checked above.
        unsafe { kernels::inclusive_scan_i64(&self.stream, data as u64, n) }?;
        Ok(())
    }

    unsafe fn gather_view_bytes(
        &self,
        views: *const c_void,
        validity: Validity,
        n: u64,
        buffers: *const c_void,
        offsets: *const c_void,
        out: *mut c_void,
    ) -> devarrow_abi::Result<()> {
        if n == 0 {
            return Ok(());
        }
        // SAFETY: the trait's contract, the caller's guarantee; no narrowed offsets.
        unsafe { self.launch_view_gather(views, validity, n, buffers, offsets, out, 0) }
    }

    unsafe fn gather_view_bytes_narrowed(
        &self,
        views: *const c_void,
        validity: Validity,
        n: u64,
        buffers: *const c_void,
        offsets: *const c_void,
        out: *mut c_void,
        narrow: *mut c_void,
    ) -> devarrow_abi::Result<()> {
        check_aligned("views", views as u64, 4)?;
        check_aligned("offsets", offsets as u64, 8)?;
        check_aligned("narrowed offsets", narrow as u64, 4)?;
        if n == 0 {
            // The one offset, narrowed.
            // SAFETY: `offsets` holds 1 int64 and `narrow` 1 int32, the caller's guarantee.
            return unsafe { self.narrow_i64_to_i32(offsets, 1, narrow) };
        }
        // SAFETY: the trait's contract, the caller's guarantee, `narrow` included.
        unsafe { self.launch_view_gather(views, validity, n, buffers, offsets, out, narrow as u64) }
    }

    unsafe fn narrow_i64_to_i32(
        &self,
        src: *const c_void,
        n: u64,
        dst: *mut c_void,
    ) -> devarrow_abi::Result<()> {
        if n == 0 {
            return Ok(());
        }
        check_aligned("int64 source", src as u64, 8)?;
        check_aligned("int32 destination", dst as u64, 4)?;
        self.bind()?;
        // SAFETY: the caller's guarantee, the alignment checked above.
        unsafe { kernels::launch_narrow_i64_i32(&self.stream, src as u64, n, dst as u64) }?;
        Ok(())
    }

    unsafe fn widen_decimals(
        &self,
        src: *const c_void,
        width: u64,
        n: u64,
        dst: *mut c_void,
    ) -> devarrow_abi::Result<()> {
        if n == 0 {
            return Ok(());
        }
        if width != 4 && width != 8 {
            return Err(CudaError::InvalidArgument(format!(
                "decimals of {width} bytes; 4 or 8 are widened"
            ))
            .into());
        }
        check_aligned("decimal source", src as u64, width)?;
        check_aligned("decimal128 destination", dst as u64, 8)?;
        self.bind()?;
        // SAFETY: the caller's guarantee, width and alignment checked above.
        unsafe { kernels::launch_widen_decimals(&self.stream, src as u64, width, n, dst as u64) }?;
        Ok(())
    }

    unsafe fn fill_offsets_i32(
        &self,
        dst: *mut c_void,
        n: u64,
        step: u32,
    ) -> devarrow_abi::Result<()> {
        if n == 0 {
            return Ok(());
        }
        check_aligned("int32 offsets", dst as u64, 4)?;
        self.bind()?;
        // SAFETY: the caller's guarantee, the alignment checked above.
        unsafe { kernels::launch_fill_offsets_i32(&self.stream, dst as u64, n, step) }?;
        Ok(())
    }

    unsafe fn compare_list_offsets(
        &self,
        offsets: RowIntegers,
        n: u64,
        expected: *const c_void,
        mismatch: *mut c_void,
    ) -> devarrow_abi::Result<()> {
        if n == 0 {
            return Ok(());
        }
        let (address, stride, wide) = row_integers("list offsets", offsets)?;
        check_aligned("expected offsets", expected as u64, 8)?;
        check_aligned("mismatch flag", mismatch as u64, 4)?;
        self.bind()?;
        // SAFETY: the caller's guarantee, the alignment checked above.
        unsafe {
            kernels::launch_compare_list_offsets(
                &self.stream,
                address,
                stride,
                wide,
                n,
                expected as u64,
                mismatch as u64,
            )
        }?;
        Ok(())
    }

    unsafe fn gather_list_values(
        &self,
        child: *const c_void,
        width: u64,
        child_offset: u64,
        offsets: RowIntegers,
        n: u64,
        new_offsets: *const c_void,
        dst: *mut c_void,
    ) -> devarrow_abi::Result<()> {
        let (address, stride, wide) = if n > 0 {
            row_integers("list offsets", offsets)?
        } else {
            (0, 0, false)
        };
        check_aligned("new offsets", new_offsets as u64, 8)?;
        self.bind()?;
        // SAFETY: the caller's guarantee, the alignment checked above (values move in
        // units the kernel picks from the addresses and the width).
        unsafe {
            kernels::launch_gather_list_values(
                &self.stream,
                child as u64,
                width,
                child_offset,
                address,
                stride,
                wide,
                n,
                new_offsets as u64,
                dst as u64,
            )
        }?;
        Ok(())
    }

    unsafe fn gather_list_bits(
        &self,
        bits: *const c_void,
        bit_offset: u64,
        offsets: RowIntegers,
        n: u64,
        new_offsets: *const c_void,
        dst: *mut c_void,
    ) -> devarrow_abi::Result<()> {
        let (address, stride, wide) = if n > 0 {
            row_integers("list offsets", offsets)?
        } else {
            (0, 0, false)
        };
        check_aligned("new offsets", new_offsets as u64, 8)?;
        check_aligned("bit gather destination", dst as u64, 4)?;
        self.bind()?;
        // SAFETY: the caller's guarantee, the alignment checked above.
        unsafe {
            kernels::launch_gather_list_bits(
                &self.stream,
                bits as u64,
                bit_offset,
                address,
                stride,
                wide,
                n,
                new_offsets as u64,
                dst as u64,
            )
        }?;
        Ok(())
    }

    unsafe fn offsets_to_views(
        &self,
        offsets: RowIntegers,
        data: *const c_void,
        indices: *const c_void,
        n: u64,
        views: *mut c_void,
    ) -> devarrow_abi::Result<()> {
        let (address, stride, wide) = if n > 0 {
            row_integers("offsets", offsets)?
        } else {
            (0, 0, false)
        };
        check_aligned("indices", indices as u64, 4)?;
        check_aligned("views", views as u64, 16)?;
        self.bind()?;
        // SAFETY: the caller's guarantee, the alignment checked above.
        unsafe {
            kernels::launch_offsets_to_views(
                &self.stream,
                address,
                stride,
                wide,
                data as u64,
                indices as u64,
                n,
                views as u64,
            )
        }?;
        Ok(())
    }

    unsafe fn count_set_bits(
        &self,
        bitmap: *const c_void,
        bit_offset: u64,
        len: u64,
        out: *mut c_void,
    ) -> devarrow_abi::Result<()> {
        check_aligned("bit count", out as u64, 8)?;
        self.bind()?;
        // dvx_count_set_bits adds to the counter: zero it first, in stream order.
        // SAFETY: `out` is writable for 8 bytes (the caller's guarantee).
        unsafe { driver::memset_d8_async(out as u64, 0, 8, self.stream.cu_stream()) }?;
        // SAFETY: the caller's guarantee, the alignment checked above.
        unsafe {
            kernels::launch_count_set_bits(&self.stream, bitmap as u64, bit_offset, len, out as u64)
        }?;
        Ok(())
    }
}

impl CudaDevice {
    /// `dvx_gather_views` of `n` views (at least one) into `out`, and with `narrow` (not
    /// 0) their offsets narrowed to `int32`s there, enqueued on this device's stream once
    /// the views and offsets are checked aligned.
    ///
    /// # Safety
    /// The ranges of `DeviceKernels::gather_view_bytes` (and, with `narrow`, of
    /// `gather_view_bytes_narrowed`).
    #[allow(clippy::too_many_arguments)]
    unsafe fn launch_view_gather(
        &self,
        views: *const c_void,
        validity: Validity,
        n: u64,
        buffers: *const c_void,
        offsets: *const c_void,
        out: *mut c_void,
        narrow: u64,
    ) -> devarrow_abi::Result<()> {
        check_aligned("views", views as u64, 4)?;
        check_aligned("offsets", offsets as u64, 8)?;
        self.bind()?;
        // The ranges read (the views, validity, buffers and offsets) and written (`out`,
        // and the n + 1 int32s at `narrow`) are the caller's guarantee; enqueued on this
        // device's stream, which later work on the same buffers follows.
        // SAFETY: so the kernel reads and writes only those ranges.
        unsafe {
            kernels::launch_gather_views(
                &self.stream,
                views as u64,
                validity.address as u64,
                validity.bit_offset,
                n,
                buffers as u64,
                offsets as u64,
                out as u64,
                narrow,
            )
        }?;
        Ok(())
    }
}
