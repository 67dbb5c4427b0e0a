//! The compaction of a frame's kept rows on CUDA ([`crate::compute::compact`]): the
//! selection scanned, each column moved to the front (`compact_lanes`) and stored back
//! at its width.

use std::sync::Arc;

use devarrow::bridge::DeviceBatch;
use devarrow::cuda::CudaDevice;

use super::{addr, context, load, store_column, A};
use crate::compute::SELECTION;
use crate::error::BoxError;
use crate::frame::{DeviceFrame, FrameColumn};
use crate::step::ExecDevice;

/// [`crate::compute::compact`] on CUDA: the selection's lanes scanned (devarrow's
/// `inclusive_scan_i64`, on this stream), every column loaded as lanes and compacted
/// (`compact_lanes`), stored back at its width (`store_lanes`, `pack_bits`); one
/// read-back, of the kept row count and the error word together. `Some(None)` when no row
/// is kept; `None` where a column's values do not fit a lane (a decimal beyond 64 bits):
/// the caller filters on the host.
pub(crate) fn compact(
    frame: &DeviceFrame,
    selection: &FrameColumn,
    cuda: &Arc<CudaDevice>,
    device: &ExecDevice,
) -> Result<Option<Option<DeviceFrame>>, BoxError> {
    use devarrow::abi::device::DeviceKernels;

    let n = frame.num_rows();
    let cx = context(cuda)?;
    let s = cx.stream;
    let err = cx.zeros::<u32>(1)?;
    let e = addr(&err, s);
    let incl = load(&cx, selection, SELECTION, e)?;
    // Selected: valid and non-zero, as 0/1 lanes (a null selection keeps no row).
    let keep = cx.lanes(n)?;
    cx.launch(
        &cx.k.select_rows,
        n,
        &[
            A::U64(addr(&incl.values, s)),
            A::U64(addr(&incl.valid, s)),
            A::U64(0),
            A::U64(0),
            A::U64(addr(&keep.valid, s)),
            A::U64(n as u64),
        ],
    )?;
    drop(incl);
    let all_valid = cx.zeros::<u8>(n)?;
    cx.launch(
        &cx.k.load_lanes,
        n,
        &[
            A::U64(addr(&keep.valid, s)),
            A::U64(0),
            A::U64(0),
            A::U64(n as u64),
            A::U32(1),
            A::U64(addr(&keep.values, s)),
            A::U64(addr(&all_valid, s)),
            A::U64(e),
        ],
    )?;
    let scan = addr(&keep.values, s);
    // SAFETY: `keep.values` holds `n` i64s on this device, written by the launches above
    // on the device's stream, the stream the scan runs on (in order after them).
    unsafe { cuda.inclusive_scan_i64(scan as *mut std::ffi::c_void, n as u64) }?;
    let mut loaded = Vec::with_capacity(frame.columns().len());
    for (i, column) in frame.columns().iter().enumerate() {
        let name = frame.schema().field(i).name().clone();
        loaded.push(load(&cx, column, &name, e)?);
    }
    let mut kept = [0i64; 1];
    let mut word = [0u32; 1];
    s.memcpy_dtoh(&keep.values.slice(n - 1..n), &mut kept)?;
    s.memcpy_dtoh(&err.slice(0..1), &mut word)?;
    s.synchronize()?;
    if word[0] != 0 {
        return Ok(None);
    }
    let m = kept[0].max(0) as usize;
    if m == 0 {
        return Ok(Some(None));
    }
    let mut arrays = Vec::with_capacity(loaded.len());
    for (lanes, field) in loaded.iter().zip(frame.schema().fields()) {
        let out = cx.lanes(m)?;
        cx.launch(
            &cx.k.compact_lanes,
            n,
            &[
                A::U64(scan),
                A::U64(addr(&lanes.values, s)),
                A::U64(addr(&lanes.valid, s)),
                A::U64(addr(&out.values, s)),
                A::U64(addr(&out.valid, s)),
                A::U64(n as u64),
            ],
        )?;
        arrays.push(store_column(
            &cx,
            field.data_type(),
            &out,
            m,
            field.is_nullable(),
            e,
        )?);
    }
    drop((keep, all_valid, loaded));
    let batch =
        DeviceBatch::from_cuda_arrays(device.device().clone(), frame.schema().clone(), arrays)?;
    Ok(Some(Some(DeviceFrame::from_batch(batch))))
}
