//! Data-parallel kernels a device runs over its own memory, on its own stream, in order
//! with its copies: what an export that rewrites arrays **on the device** is made of
//! (the bridge's `ExportOptions::for_libcudf`: string views to offsets, list views to
//! lists, narrower offsets, wider decimals, exact null counts).
//!
//! A [`Device`](super::Device) offers them through
//! [`Device::kernels`](super::Device::kernels). The CPU device runs them on the calling
//! thread ([`CpuKernels`], also the reference the CUDA kernels are tested against);
//! devarrow-cuda launches PTX kernels (`crates/cuda/kernels/convert.ptx`).
//!
//! Every address is device memory of the device (a host address on the CPU device),
//! naturally aligned for the elements it holds (`int64` arrays to 8 bytes, views and
//! `int32` arrays to 4, a bitmap output to 4, row integers and their stride to their
//! width): a device may refuse a misaligned address with `Error::InvalidArgument` before
//! enqueuing anything (CUDA does: a misaligned access would fault the whole context; the
//! CPU's kernels accept any address). Integers in device memory are little-endian. A kernel returns once it is enqueued:
//! its results are read after a later event, like a copy's.
//!
//! ```
//! use std::ffi::c_void;
//! use devarrow_abi::device::{CpuDevice, Device, Validity};
//!
//! # fn main() -> devarrow_abi::Result<()> {
//! let device = CpuDevice::new();
//! let kernels = device.kernels().expect("the CPU device has kernels");
//! // offsets of three strings of sizes 3, 0 and 5: a scan of [0, 3, 0, 5]
//! let mut offsets: Vec<i64> = vec![0, 3, 0, 5];
//! // SAFETY: `offsets` is host memory, which is the CPU device's memory.
//! unsafe { kernels.inclusive_scan_i64(offsets.as_mut_ptr().cast::<c_void>(), 4)? };
//! assert_eq!(offsets, [0, 3, 3, 8]);
//! # let _ = Validity::ALL_VALID;
//! # Ok(())
//! # }
//! ```

use std::ffi::c_void;

use crate::error::Result;

/// A validity bitmap of the rows a kernel reads: bit `bit_offset + i` of the bitmap at
/// `address` says whether row `i` is valid (Arrow's LSB order); a NULL `address` means
/// every row is valid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Validity {
    /// The bitmap, or NULL.
    pub address: *const c_void,
    /// The bit of the first row.
    pub bit_offset: u64,
}

impl Validity {
    /// Every row valid (no bitmap).
    pub const ALL_VALID: Validity = Validity {
        address: std::ptr::null(),
        bit_offset: 0,
    };

    /// The bitmap at `address` from bit `bit_offset` (NULL: every row valid).
    pub fn new(address: *const c_void, bit_offset: u64) -> Self {
        Validity {
            address,
            bit_offset,
        }
    }
}

/// Unsigned integers read one per row: row `i`'s lies at `address + i * stride`, 8 bytes
/// when `wide`, else 4 (a string view's length: `stride` 16, not wide; a list view's
/// `int32` sizes: `stride` 4; `int64`: `stride` 8, wide).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowIntegers {
    /// The first row's integer.
    pub address: *const c_void,
    /// Bytes from one row's integer to the next's.
    pub stride: u64,
    /// 8-byte integers (else 4-byte).
    pub wide: bool,
}

/// The data-parallel kernels of a device ([`Device::kernels`](super::Device::kernels)),
/// run over its own memory on its own stream, in order with its copies: what an export
/// that rewrites arrays on the device (the bridge's `ExportOptions::for_libcudf`) is made
/// of. The CPU device runs them on the calling thread ([`CpuKernels`], the reference);
/// devarrow-cuda launches PTX kernels.
///
/// Every address is device memory of the device, naturally aligned for the elements it
/// holds (`int64` arrays to 8 bytes, views and `int32` arrays to 4, a bitmap output to 4,
/// row integers and their stride to their width): a device may refuse a misaligned
/// address with `Error::InvalidArgument` before enqueuing anything (CUDA does). A kernel
/// returns once it is enqueued; its results are read after a later event.
///
/// ```
/// use std::ffi::c_void;
/// use devarrow_abi::device::{CpuDevice, Device};
///
/// # fn main() -> devarrow_abi::Result<()> {
/// let device = CpuDevice::new();
/// let kernels = device.kernels().expect("the CPU device has kernels");
/// let mut sizes: Vec<i64> = vec![0, 3, 0, 5]; // offsets of 3 values: a scan of their sizes
/// // SAFETY: host memory is the CPU device's memory; 4 int64s.
/// unsafe { kernels.inclusive_scan_i64(sizes.as_mut_ptr().cast::<c_void>(), 4)? };
/// assert_eq!(sizes, [0, 3, 3, 8]);
/// # Ok(())
/// # }
/// ```
///
/// # Safety
/// Callers rely on each method doing exactly what its documentation says, reading and
/// writing no other memory, in order with the device's other work on its stream.
pub unsafe trait DeviceKernels: Send + Sync {
    /// Per-row sizes for offsets: `out[0] = 0` and, for `i < n`,
    /// `out[i + 1] = sizes[i]` (as `int64`) for a valid row, 0 for a null one.
    /// Follow with [`DeviceKernels::inclusive_scan_i64`] over the `n + 1` values to get
    /// the offsets of the rows' values, packed in row order.
    ///
    /// # Safety
    /// `sizes` readable for `n` rows, `validity` for `n` bits, `out` writable for `n + 1`
    /// `int64`s, none overlapping `out`.
    unsafe fn row_sizes(
        &self,
        sizes: RowIntegers,
        validity: Validity,
        n: u64,
        out: *mut c_void,
    ) -> Result<()>;

    /// Inclusive prefix sum in place of the `n` `int64`s at `data` (wrapping).
    ///
    /// # Safety
    /// `data` readable and writable for `n` `int64`s.
    unsafe fn inclusive_scan_i64(&self, data: *mut c_void, n: u64) -> Result<()>;

    /// Gathers the bytes of `n` string or binary views (16 bytes each at `views`) into
    /// `out`: the bytes of valid row `i` go to `out[offsets[i]..offsets[i] + len]`, where
    /// `len` is the view's length and `offsets` the `n + 1` `int64`s from
    /// [`DeviceKernels::row_sizes`] and the scan. A view of at most 12 bytes holds them
    /// inline; a longer one reads `buffers[index][offset..offset + len]`, `buffers` being
    /// an array in device memory of the variadic buffers' addresses (`u64` each).
    ///
    /// # Safety
    /// The views readable for `n` rows and the validity for `n` bits; every valid view's
    /// buffer index and range inside `buffers` and its buffer; `offsets` as described;
    /// `out` writable for the last offset's bytes and overlapping nothing read.
    unsafe fn gather_view_bytes(
        &self,
        views: *const c_void,
        validity: Validity,
        n: u64,
        buffers: *const c_void,
        offsets: *const c_void,
        out: *mut c_void,
    ) -> Result<()>;

    /// [`DeviceKernels::gather_view_bytes`], and the `n + 1` `offsets` narrowed to `int32`s
    /// at `narrow` as [`DeviceKernels::narrow_i64_to_i32`] makes them: the bytes and the
    /// `int32` offsets of a conversion whose bytes fit, in one pass where the device can
    /// (by default, the two calls in order).
    ///
    /// # Safety
    /// As both: the ranges of [`DeviceKernels::gather_view_bytes`]; every offset fits in
    /// an `int32`; `narrow` writable for `n + 1` 4-byte-aligned `int32`s and overlapping
    /// nothing read or `out`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn gather_view_bytes_narrowed(
        &self,
        views: *const c_void,
        validity: Validity,
        n: u64,
        buffers: *const c_void,
        offsets: *const c_void,
        out: *mut c_void,
        narrow: *mut c_void,
    ) -> Result<()> {
        // SAFETY: the caller's guarantees, passed on to both.
        unsafe {
            self.gather_view_bytes(views, validity, n, buffers, offsets, out)?;
            self.narrow_i64_to_i32(offsets, n + 1, narrow)
        }
    }

    /// `dst[i] = src[i] as i32` (the low 32 bits) for `i < n`: `int64` offsets narrowed
    /// to `int32` ones that the caller checked fit.
    ///
    /// # Safety
    /// `src` readable for `n` `int64`s, `dst` writable for `n` `int32`s, not overlapping.
    unsafe fn narrow_i64_to_i32(&self, src: *const c_void, n: u64, dst: *mut c_void) -> Result<()>;

    /// Sign-extends `n` little-endian integers of `width` bytes (4 or 8: decimal32 and
    /// decimal64 values) at `src` to 16 bytes each (decimal128) at `dst`.
    ///
    /// # Safety
    /// `src` readable for `n * width` bytes, `dst` writable for `n * 16`, not overlapping;
    /// `width` is 4 or 8.
    unsafe fn widen_decimals(
        &self,
        src: *const c_void,
        width: u64,
        n: u64,
        dst: *mut c_void,
    ) -> Result<()>;

    /// `dst[i] = i * step` (`int32`, wrapping) for `i < n`: the offsets of fixed-size
    /// lists as lists.
    ///
    /// # Safety
    /// `dst` writable for `n` `int32`s.
    unsafe fn fill_offsets_i32(&self, dst: *mut c_void, n: u64, step: u32) -> Result<()>;

    /// Compares list views with lists: for every row `i < n` with
    /// `expected[i + 1] > expected[i]` (a non-empty valid row, when `expected` comes from
    /// [`DeviceKernels::row_sizes`] and the scan), whether `offsets[i] == expected[i]`;
    /// writes the `u32` 1 to `mismatch` if any row differs, and nothing otherwise (the
    /// caller zeroes it first).
    ///
    /// # Safety
    /// `offsets` readable for `n` rows, `expected` for `n + 1` `int64`s, `mismatch`
    /// writable for 4 bytes.
    unsafe fn compare_list_offsets(
        &self,
        offsets: RowIntegers,
        n: u64,
        expected: *const c_void,
        mismatch: *mut c_void,
    ) -> Result<()>;

    /// Gathers the child values of `n` list views into list order: for row `i` with
    /// `new_offsets[i + 1] > new_offsets[i]`, the `size = new_offsets[i + 1] -
    /// new_offsets[i]` values of `width` bytes from child index
    /// `child_offset + offsets[i]` go to index `new_offsets[i]` of `dst`.
    ///
    /// # Safety
    /// `child` readable at every index reached, `offsets` for `n` rows, `new_offsets` for
    /// `n + 1` `int64`s; `dst` writable for `new_offsets[n]` values, overlapping nothing.
    #[allow(clippy::too_many_arguments)] // one per operand of the kernel, as in C
    unsafe fn gather_list_values(
        &self,
        child: *const c_void,
        width: u64,
        child_offset: u64,
        offsets: RowIntegers,
        n: u64,
        new_offsets: *const c_void,
        dst: *mut c_void,
    ) -> Result<()>;

    /// As [`DeviceKernels::gather_list_values`] for bits (a child's validity bitmap, or
    /// boolean values): bit `bit_offset + offsets[i] + k` of `bits` goes to bit
    /// `new_offsets[i] + k` of `dst`, for `k < size`. `dst` is written in whole 32-bit
    /// words, `ceil(new_offsets[n] / 32)` of them; bits past `new_offsets[n]` are 0.
    ///
    /// # Safety
    /// As [`DeviceKernels::gather_list_values`]; `dst` 4-byte aligned and writable for
    /// those words.
    unsafe fn gather_list_bits(
        &self,
        bits: *const c_void,
        bit_offset: u64,
        offsets: RowIntegers,
        n: u64,
        new_offsets: *const c_void,
        dst: *mut c_void,
    ) -> Result<()>;

    /// String (or binary) views of the values at `indices` of an array with offsets:
    /// view `j` describes value `s = indices[j]` (an `int32`), the bytes
    /// `data[offsets[s]..offsets[s + 1]]`, in the 16-byte layout of `Utf8View`: at most 12
    /// bytes inline (zero-padded), longer ones as their first 4 bytes, buffer index 0 and
    /// the start `offsets[s]` (which must fit a `u32`). `offsets` are the array's signed
    /// offsets (`int32`, or `int64` when `wide`). With
    /// [`DeviceKernels::gather_view_bytes`] over them (one variadic buffer: `data`), the
    /// values are gathered in `indices`' order: how a list view's string child is put in
    /// list order.
    ///
    /// # Safety
    /// `indices` readable for `n` `int32`s, each `s` with `offsets[s]` and
    /// `offsets[s + 1]` readable, `data` readable between them, every start below 2^32;
    /// `views` writable for `16 * n` bytes, 16-byte aligned.
    unsafe fn offsets_to_views(
        &self,
        offsets: RowIntegers,
        data: *const c_void,
        indices: *const c_void,
        n: u64,
        views: *mut c_void,
    ) -> Result<()>;

    /// Counts the set bits `bit_offset .. bit_offset + len` of the bitmap at `bitmap`
    /// and writes the count (`u64`) to `out`: a null count is `len` minus it.
    ///
    /// # Safety
    /// `bitmap` readable for those bits, `out` writable for 8 bytes, 8-byte aligned.
    unsafe fn count_set_bits(
        &self,
        bitmap: *const c_void,
        bit_offset: u64,
        len: u64,
        out: *mut c_void,
    ) -> Result<()>;
}

/// The kernels on the CPU, run on the calling thread: the CPU device's, and the
/// reference the CUDA kernels are tested against. Callers order them after pending copies
/// (the CPU device synchronizes its copy engine first).
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuKernels;

/// Reads `T` at `address + index * size_of::<T>()`.
///
/// # Safety
/// That address readable for a `T`.
unsafe fn read<T: Copy>(address: *const c_void, index: u64) -> T {
    // SAFETY: the caller's guarantee; unaligned reads, as device buffers from foreign
    // producers need not be aligned for the CPU.
    unsafe { address.cast::<T>().add(index as usize).read_unaligned() }
}

/// Writes `value` at `address + index * size_of::<T>()`.
///
/// # Safety
/// That address writable for a `T`.
unsafe fn write<T>(address: *mut c_void, index: u64, value: T) {
    // SAFETY: the caller's guarantee.
    unsafe {
        address
            .cast::<T>()
            .add(index as usize)
            .write_unaligned(value)
    }
}

/// Bit `index` of the bitmap at `bits`.
///
/// # Safety
/// The byte of that bit readable.
unsafe fn bit(bits: *const c_void, index: u64) -> bool {
    // SAFETY: the caller's guarantee.
    let byte: u8 = unsafe { read(bits, index / 8) };
    byte & (1 << (index % 8)) != 0
}

impl Validity {
    /// Whether row `i` is valid.
    ///
    /// # Safety
    /// The bitmap (if any) readable for that bit.
    unsafe fn is_valid(&self, i: u64) -> bool {
        // SAFETY: the caller's guarantee.
        self.address.is_null() || unsafe { bit(self.address, self.bit_offset + i) }
    }
}

impl RowIntegers {
    /// Row `i`'s integer.
    ///
    /// # Safety
    /// Readable for that row.
    unsafe fn get(&self, i: u64) -> u64 {
        // SAFETY: the caller's guarantee.
        let at = unsafe { self.address.cast::<u8>().add((i * self.stride) as usize) }.cast();
        if self.wide {
            // SAFETY: as above.
            unsafe { read::<u64>(at, 0) }
        } else {
            // SAFETY: as above.
            unsafe { read::<u32>(at, 0) as u64 }
        }
    }
}

// SAFETY: each method below does what its documentation says, on host memory, on the
// calling thread.
unsafe impl DeviceKernels for CpuKernels {
    unsafe fn row_sizes(
        &self,
        sizes: RowIntegers,
        validity: Validity,
        n: u64,
        out: *mut c_void,
    ) -> Result<()> {
        // SAFETY: (every access below) the ranges the caller guarantees.
        unsafe {
            write::<i64>(out, 0, 0);
            for i in 0..n {
                let size = if validity.is_valid(i) {
                    sizes.get(i)
                } else {
                    0
                };
                write::<i64>(out, i + 1, size as i64);
            }
        }
        Ok(())
    }

    unsafe fn inclusive_scan_i64(&self, data: *mut c_void, n: u64) -> Result<()> {
        let mut sum = 0i64;
        for i in 0..n {
            // SAFETY: `data` holds `n` int64s, the caller's guarantee.
            unsafe {
                sum = sum.wrapping_add(read::<i64>(data, i));
                write(data, i, sum);
            }
        }
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
    ) -> Result<()> {
        for i in 0..n {
            // SAFETY: (the block) the ranges the caller guarantees; a view is 16 bytes:
            // length (u32), then 12 inline bytes or prefix (4), buffer index (u32) and
            // offset (u32).
            unsafe {
                if !validity.is_valid(i) {
                    continue;
                }
                let view = views.cast::<u8>().add(16 * i as usize);
                let len = read::<u32>(view.cast(), 0) as usize;
                let src = if len <= 12 {
                    view.add(4)
                } else {
                    let index = read::<u32>(view.cast(), 2);
                    let offset = read::<u32>(view.cast(), 3) as usize;
                    let buffer = read::<u64>(buffers, index as u64) as usize as *const u8;
                    buffer.add(offset)
                };
                let at = read::<i64>(offsets, i) as usize;
                std::ptr::copy_nonoverlapping(src, out.cast::<u8>().add(at), len);
            }
        }
        Ok(())
    }

    unsafe fn narrow_i64_to_i32(&self, src: *const c_void, n: u64, dst: *mut c_void) -> Result<()> {
        for i in 0..n {
            // SAFETY: the ranges the caller guarantees.
            unsafe { write(dst, i, read::<i64>(src, i) as i32) };
        }
        Ok(())
    }

    unsafe fn widen_decimals(
        &self,
        src: *const c_void,
        width: u64,
        n: u64,
        dst: *mut c_void,
    ) -> Result<()> {
        for i in 0..n {
            // SAFETY: the ranges the caller guarantees; `width` is 4 or 8.
            let value = unsafe {
                if width == 4 {
                    read::<i32>(src, i) as i128
                } else {
                    read::<i64>(src, i) as i128
                }
            };
            // SAFETY: as above.
            unsafe { write(dst, i, value) };
        }
        Ok(())
    }

    unsafe fn fill_offsets_i32(&self, dst: *mut c_void, n: u64, step: u32) -> Result<()> {
        for i in 0..n {
            // SAFETY: the range the caller guarantees.
            unsafe { write(dst, i, (i as u32).wrapping_mul(step) as i32) };
        }
        Ok(())
    }

    unsafe fn compare_list_offsets(
        &self,
        offsets: RowIntegers,
        n: u64,
        expected: *const c_void,
        mismatch: *mut c_void,
    ) -> Result<()> {
        for i in 0..n {
            // SAFETY: the ranges the caller guarantees.
            unsafe {
                let (start, end) = (read::<i64>(expected, i), read::<i64>(expected, i + 1));
                let offset = if offsets.wide {
                    offsets.get(i) as i64
                } else {
                    offsets.get(i) as u32 as i32 as i64
                };
                if end > start && offset != start {
                    write::<u32>(mismatch, 0, 1);
                }
            }
        }
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
    ) -> Result<()> {
        for i in 0..n {
            // SAFETY: the ranges the caller guarantees.
            unsafe {
                let (start, end) = (read::<i64>(new_offsets, i), read::<i64>(new_offsets, i + 1));
                if end <= start {
                    continue;
                }
                let from = child_offset + offsets.get(i);
                std::ptr::copy_nonoverlapping(
                    child.cast::<u8>().add((from * width) as usize),
                    dst.cast::<u8>().add(start as usize * width as usize),
                    (end - start) as usize * width as usize,
                );
            }
        }
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
    ) -> Result<()> {
        // SAFETY: `new_offsets` holds n + 1 int64s.
        let total = unsafe { read::<i64>(new_offsets, n) }.max(0) as u64;
        let words = total.div_ceil(32);
        for w in 0..words {
            // SAFETY: `dst` holds `words` u32s, the caller's guarantee.
            unsafe { write::<u32>(dst, w, 0) };
        }
        for i in 0..n {
            // SAFETY: the ranges the caller guarantees.
            unsafe {
                let (start, end) = (read::<i64>(new_offsets, i), read::<i64>(new_offsets, i + 1));
                let from = bit_offset + offsets.get(i);
                for k in 0..(end - start).max(0) as u64 {
                    if bit(bits, from + k) {
                        let to = start as u64 + k;
                        let word = read::<u32>(dst, to / 32) | (1 << (to % 32));
                        write(dst, to / 32, word);
                    }
                }
            }
        }
        Ok(())
    }

    unsafe fn offsets_to_views(
        &self,
        offsets: RowIntegers,
        data: *const c_void,
        indices: *const c_void,
        n: u64,
        views: *mut c_void,
    ) -> Result<()> {
        for j in 0..n {
            // SAFETY: the ranges the caller guarantees (signed offsets, sign-extended
            // when 4 bytes wide).
            let (start, end) = unsafe {
                let s = read::<i32>(indices, j) as u64;
                let at = |i: u64| {
                    let v = offsets.get(i);
                    if offsets.wide {
                        v as i64
                    } else {
                        v as u32 as i32 as i64
                    }
                };
                (at(s), at(s + 1))
            };
            let len = (end - start) as usize;
            let mut view = [0u8; 16];
            view[..4].copy_from_slice(&(len as u32).to_le_bytes());
            // SAFETY: `data[start..end]` readable, the caller's guarantee.
            let bytes = |k: usize| unsafe {
                std::slice::from_raw_parts(data.cast::<u8>().add(start as usize), k)
            };
            if len <= 12 {
                view[4..4 + len].copy_from_slice(bytes(len));
            } else {
                view[4..8].copy_from_slice(bytes(4));
                view[12..16].copy_from_slice(&(start as u32).to_le_bytes());
            }
            // SAFETY: `views` holds 16 bytes per value.
            unsafe { write(views, j, view) };
        }
        Ok(())
    }

    unsafe fn count_set_bits(
        &self,
        bitmap: *const c_void,
        bit_offset: u64,
        len: u64,
        out: *mut c_void,
    ) -> Result<()> {
        let mut count = 0u64;
        for i in 0..len {
            // SAFETY: the bits the caller guarantees.
            count += unsafe { bit(bitmap, bit_offset + i) } as u64;
        }
        // SAFETY: `out` writable for 8 bytes.
        unsafe { write(out, 0, count) };
        Ok(())
    }
}
