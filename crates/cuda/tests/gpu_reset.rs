//! devarrow after `cuDevicePrimaryCtxReset`, the usual recovery from a sticky fault. A
//! test binary of its own: a reset destroys everything every other test holds.
//!
//! The primary context keeps its `CUcontext` value across a reset, but its modules,
//! streams and memory are gone. Kernels cached by that value would then launch functions
//! of the destroyed context; devarrow caches them by context id (`cuCtxGetId`).

use devarrow_cuda::cudarc::driver::sys;
use devarrow_cuda::{export_array_data, kernels, DeviceBuffer, ImportedArray, PrimaryContext};

/// Counts set bits on the GPU, exports and imports a buffer: kernels, memory and events.
fn use_the_device(dev: &PrimaryContext) {
    let stream = dev.new_stream().unwrap();
    let bits = DeviceBuffer::from_host(&stream, &[0xffu8, 0x0f, 0, 1]).unwrap();
    assert_eq!(kernels::count_set_bits(&stream, &bits, 0, 32).unwrap(), 13);
    let values = DeviceBuffer::from_host(&stream, &[7i32, 8, 9]).unwrap();
    // SAFETY: the buffer only travels inside the exported array, never read on the host.
    let buffer = unsafe { values.into_arrow_buffer() };
    // SAFETY: three i32 values, no nulls: an Int32 array of length 3.
    let data = unsafe {
        arrow_data::ArrayData::builder(arrow_schema::DataType::Int32)
            .len(3)
            .null_count(0)
            .add_buffer(buffer)
            .build_unchecked()
    };
    let array = export_array_data(data, devarrow_abi::ArrowDeviceType::CUDA, &stream).unwrap();
    let consumer = dev.new_stream().unwrap();
    let imported = ImportedArray::import(array, &consumer).unwrap();
    assert_eq!(imported.array().length, 3);
    drop(imported);
    consumer.synchronize().unwrap();
    stream.synchronize().unwrap();
}

#[test]
fn devarrow_works_again_after_a_primary_context_reset() {
    let Some((_lock, dev)) = devarrow_testing::gpu::open_or_skip(|| PrimaryContext::open(0)) else {
        return;
    };
    use_the_device(&dev);
    let handle = dev.cu_context();
    // SAFETY: nothing of this test binary uses the device during the reset (the test
    // lock is held, and the objects made above are gone).
    unsafe { sys::cuDevicePrimaryCtxReset_v2(dev.context().cu_device()) }
        .result()
        .unwrap();
    dev.bind_to_thread().unwrap();
    assert_eq!(
        dev.cu_context(),
        handle,
        "the primary context keeps its handle"
    );
    use_the_device(&dev);
    // And a device opened anew works too.
    let again = PrimaryContext::open(0).unwrap();
    use_the_device(&again);
}
