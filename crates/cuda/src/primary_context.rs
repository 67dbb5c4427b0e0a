//! Opening CUDA devices on their primary context, and listing them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use cudarc::driver::{sys, CudaContext, CudaStream};

use crate::context::DropInContext;
use crate::driver;
use crate::error::{CudaError, DriverResultExt, Result};

/// Whether the CUDA driver library can be loaded on this machine (checked once).
///
/// Every entry point of this crate checks it before its first driver call, because
/// cudarc panics when `libcuda` is missing.
pub fn driver_available() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(driver::culib_present)
}

/// Loads and initializes the driver (`cuInit`), or says why it cannot.
pub(crate) fn init_driver() -> Result<()> {
    if !driver_available() {
        return Err(CudaError::NoDriver);
    }
    driver::init()
}

/// The number of CUDA devices (0 when the driver is present but sees no device).
pub fn device_count() -> Result<usize> {
    match init_driver() {
        Ok(()) => {}
        Err(CudaError::NoDevice) => return Ok(0),
        Err(e) => return Err(e),
    }
    let n = driver::device_get_count()?;
    Ok(n.max(0) as usize)
}

/// What [`list_devices`] reports about one device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The CUDA ordinal (the `device_id` of the Arrow C Device interface).
    pub id: usize,
    /// The marketing name (e.g. `NVIDIA H100 80GB HBM3`).
    pub name: String,
    /// Compute capability `(major, minor)`.
    pub compute_capability: (i32, i32),
    /// Total device memory in bytes.
    pub total_memory: usize,
    /// Whether stream-ordered allocation (memory pools) is supported.
    pub memory_pools: bool,
    /// Whether managed (unified) memory is supported.
    pub managed_memory: bool,
}

/// Lists the CUDA devices without creating contexts on them.
///
/// ```
/// use devarrow_cuda::{driver_available, list_devices, CudaError};
///
/// match list_devices() {
///     Ok(devices) => {
///         for d in &devices {
///             let (major, minor) = d.compute_capability;
///             println!("cuda:{} {} (sm_{major}{minor}, {} MiB)", d.id, d.name, d.total_memory >> 20);
///         }
///     }
///     // No libcuda on this machine: a typed error, never a panic.
///     Err(CudaError::NoDriver) => assert!(!driver_available()),
///     Err(e) => println!("CUDA is not usable here: {e}"),
/// }
/// ```
pub fn list_devices() -> Result<Vec<DeviceInfo>> {
    let count = device_count()?;
    let mut out = Vec::with_capacity(count);
    for id in 0..count {
        let dev = driver::device_get(id as i32)?;
        let attr = |a: sys::CUdevice_attribute| driver::device_get_attribute(dev, a);
        out.push(DeviceInfo {
            id,
            name: driver::device_get_name(dev)?,
            compute_capability: (
                attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            ),
            total_memory: driver::device_total_mem(dev)?,
            memory_pools: attr(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED,
            )? > 0,
            managed_memory: attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY)? > 0,
        });
    }
    Ok(out)
}

struct DeviceInner {
    ctx: DropInContext<Arc<CudaContext>>,
    id: usize,
    name: String,
    multiprocessors: u32,
    managed_memory: bool,
    /// Retains made by [`PrimaryContext::ensure_active`] after resets of the primary
    /// context (the one of `ctx` is cudarc's), each released once when this drops.
    re_retains: Mutex<usize>,
}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        let n = *self.re_retains.get_mut().unwrap_or_else(|e| e.into_inner());
        for _ in 0..n {
            // SAFETY: each of the `n` retains made by `ensure_active` is given back once,
            // here, as this value drops.
            let _ = unsafe { driver::primary_ctx_release(self.ctx.cu_device()) };
        }
    }
}

/// A CUDA device opened on its **primary** context (`cuDevicePrimaryCtxRetain`, through
/// cudarc's [`CudaContext::new`]), so its pointers, streams and events interoperate with
/// the CUDA runtime and the libraries built on it (libcudf, CuPy, PyTorch, ...).
///
/// Cheap to clone; every clone (and every [`PrimaryContext::open`] of the same id while one
/// is alive) shares one [`CudaContext`].
#[derive(Clone)]
pub struct PrimaryContext {
    inner: Arc<DeviceInner>,
}

impl std::fmt::Debug for PrimaryContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrimaryContext")
            .field("id", &self.inner.id)
            .field("name", &self.inner.name)
            .finish()
    }
}

impl PartialEq for PrimaryContext {
    fn eq(&self, other: &Self) -> bool {
        self.inner.ctx.cu_ctx() == other.inner.ctx.cu_ctx()
    }
}

impl Eq for PrimaryContext {}

fn open_devices() -> &'static Mutex<HashMap<usize, Weak<DeviceInner>>> {
    static OPEN: OnceLock<Mutex<HashMap<usize, Weak<DeviceInner>>>> = OnceLock::new();
    OPEN.get_or_init(Default::default)
}

impl PrimaryContext {
    /// Opens device `id` on its primary context.
    ///
    /// Fails with [`CudaError::NoDriver`] when libcuda is missing,
    /// [`CudaError::NoDevice`] when there is no device at all, and
    /// [`CudaError::InvalidDeviceId`] when `id` is out of range; never panics.
    pub fn open(id: usize) -> Result<Self> {
        let count = device_count()?;
        if count == 0 {
            return Err(CudaError::NoDevice);
        }
        if id >= count {
            return Err(CudaError::InvalidDeviceId { id, count });
        }
        let mut open = open_devices().lock().unwrap_or_else(|e| e.into_inner());
        if let Some(inner) = open.get(&id).and_then(Weak::upgrade) {
            let dev = Self { inner };
            dev.ensure_active()?;
            return Ok(dev);
        }
        let ctx = CudaContext::new(id).call("cuDevicePrimaryCtxRetain")?;
        // cudarc's event tracking orders its own `CudaSlice`s across streams, and makes
        // the first `new_stream` of a context run `cuCtxSynchronize`: on the shared
        // primary context that would wait for every library's work (PyTorch's, libcudf's)
        // and hang if any of it waits on the host.
        // SAFETY: devarrow creates no `CudaSlice`; it orders streams with its own events
        // (export, import, staging), so nothing relies on the tracking. This value of
        // `CudaContext` is devarrow's own.
        unsafe { ctx.disable_event_tracking() };
        let multiprocessors = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .call("cuDeviceGetAttribute")?
            .max(1) as u32;
        let managed_memory = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY)
            .call("cuDeviceGetAttribute")?
            > 0;
        let name = ctx.name().call("cuDeviceGetName")?;
        let inner = Arc::new(DeviceInner {
            ctx: DropInContext::new(ctx),
            id,
            name,
            multiprocessors,
            managed_memory,
            re_retains: Mutex::new(0),
        });
        open.insert(id, Arc::downgrade(&inner));
        Ok(Self { inner })
    }

    /// The device that `stream` belongs to.
    pub fn of_stream(stream: &CudaStream) -> Result<Self> {
        Self::open(stream.context().ordinal())
    }

    /// The CUDA ordinal.
    pub fn id(&self) -> usize {
        self.inner.id
    }

    /// The device name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The cudarc context (the device's primary context).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.inner.ctx
    }

    /// The raw `CUcontext` (the primary context; do not destroy it).
    pub fn cu_context(&self) -> sys::CUcontext {
        self.inner.ctx.cu_ctx()
    }

    /// Compute capability `(major, minor)`.
    pub fn compute_capability(&self) -> Result<(i32, i32)> {
        self.inner
            .ctx
            .compute_capability()
            .call("cuDeviceGetAttribute")
    }

    /// The number of streaming multiprocessors (used to size kernel grids).
    pub fn multiprocessor_count(&self) -> u32 {
        self.inner.multiprocessors
    }

    /// Whether device buffers are allocated stream-ordered (`cuMemAllocAsync`) from the
    /// device's memory pool.
    pub fn supports_memory_pools(&self) -> bool {
        self.inner.ctx.has_async_alloc()
    }

    /// Whether managed memory ([`crate::ManagedBuffer`]) is supported.
    pub fn supports_managed_memory(&self) -> bool {
        self.inner.managed_memory
    }

    /// `(free, total)` device memory in bytes (`cuMemGetInfo`).
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        self.bind_to_thread()?;
        driver::mem_get_info()
    }

    /// Makes this device's context current on the calling thread, first retaining the
    /// primary context again if it was reset (see [`PrimaryContext::ensure_active`]).
    pub fn bind_to_thread(&self) -> Result<()> {
        self.ensure_active()?;
        crate::context::bind(&self.inner.ctx)
    }

    /// Creates a new non-blocking stream (after [`PrimaryContext::ensure_active`]).
    pub fn new_stream(&self) -> Result<Arc<CudaStream>> {
        self.ensure_active()?;
        self.inner.ctx.new_stream().call("cuStreamCreate")
    }

    /// Makes the primary context active again after a `cuDevicePrimaryCtxReset` (by
    /// devarrow's user, or another library in the process, say after a sticky fault).
    ///
    /// A reset destroys the primary context's memory, streams, events, modules and
    /// pools but "does not release" it: the context is then *inactive*
    /// (`cuDevicePrimaryCtxGetState`) and every call in it fails with
    /// `CUDA_ERROR_CONTEXT_IS_DESTROYED` until someone retains it again, which gives the
    /// same `CUcontext` a new context id. This checks the state (one cheap driver call)
    /// and, when inactive, retains it (released when the last clone of this value
    /// drops). [`PrimaryContext::open`], [`PrimaryContext::bind_to_thread`] and
    /// [`PrimaryContext::new_stream`] call it; what devarrow caches per context (its
    /// kernels, its memory pool) is keyed by the context id, so it is made anew.
    /// Streams, events and buffers made before the reset stay unusable.
    pub fn ensure_active(&self) -> Result<()> {
        let device = self.inner.ctx.cu_device();
        if driver::primary_ctx_is_active(device)? {
            return Ok(());
        }
        let mut re_retains = self
            .inner
            .re_retains
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        // Another clone may have retained it meanwhile.
        if driver::primary_ctx_is_active(device)? {
            return Ok(());
        }
        let handle = driver::primary_ctx_retain(device)?;
        *re_retains += 1;
        if handle != self.inner.ctx.cu_ctx() {
            return Err(CudaError::InvalidArgument(format!(
                "the primary context of CUDA device {} came back under another handle after \
                 a reset; open the device anew",
                self.inner.id
            )));
        }
        Ok(())
    }

    /// The legacy default (NULL) stream of the context.
    pub fn default_stream(&self) -> Arc<CudaStream> {
        self.inner.ctx.default_stream()
    }

    /// Waits for all work on the device's context to finish.
    pub fn synchronize(&self) -> Result<()> {
        self.bind_to_thread()?;
        driver::ctx_synchronize()
    }

    /// Returns the unused memory of devarrow's memory pool of the device (which keeps
    /// freed [`DeviceBuffer`](crate::DeviceBuffer) memory for reuse, see [`crate::pool`])
    /// and of the device's default pool to the system (`cuMemPoolTrimTo(pool, 0)`), e.g.
    /// before measuring free memory or handing memory to another library. Memory whose
    /// stream-ordered free has not yet run stays reserved: synchronize first. A no-op on
    /// devices without memory pools.
    pub fn trim_memory_pool(&self) -> Result<()> {
        if !self.supports_memory_pools() {
            return Ok(());
        }
        self.bind_to_thread()?;
        crate::pool::trim(self.context(), 0)?;
        let pool = driver::device_get_default_mem_pool(self.inner.ctx.cu_device())?;
        // SAFETY: `pool` is the device's default pool, valid for the process lifetime.
        unsafe { driver::mem_pool_trim_to(pool, 0) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_without_gpu_is_an_error_not_a_panic() {
        // On a machine with a GPU this opens device 0; without, it must be a typed error.
        match PrimaryContext::open(0) {
            Ok(dev) => assert_eq!(dev.id(), 0),
            Err(e) => assert!(
                matches!(e, CudaError::NoDriver | CudaError::NoDevice),
                "unexpected error {e:?}"
            ),
        }
        match PrimaryContext::open(usize::MAX / 2) {
            Ok(_) => panic!("device id out of range opened"),
            Err(e) => assert!(matches!(
                e,
                CudaError::NoDriver | CudaError::NoDevice | CudaError::InvalidDeviceId { .. }
            )),
        }
    }

    #[test]
    fn listing_without_gpu_is_an_error_not_a_panic() {
        match list_devices() {
            Ok(list) => assert_eq!(list.len(), device_count().unwrap()),
            Err(e) => assert!(matches!(e, CudaError::NoDriver), "unexpected error {e:?}"),
        }
    }
}
