//! The emulated CUDA driver API: `extern "C"` functions with the names and signatures of
//! the NVIDIA driver's (`cuInit`, `cuMemAlloc_v2`, `cuLaunchKernel`, ...), as cudarc's
//! `driver::sys` loads them by name from `libcuda.so`.
//!
//! Built as the cdylib `libdevarrow_emu.so` and linked as `libcuda.so` /
//! `libcuda.so.1` by `.ci/emulated-gpu`, it is what cudarc `dlopen`s in place of the
//! driver. It emulates one device (ordinal 0) by default, H100-like, or several (see
//! *Several devices* below), and aims to be strict where the real driver's contract is
//! strict, so that devarrow's bugs show up as errors or wrong data instead of passing
//! silently:
//!
//! - **Contexts** ([`context`]): the primary context is retained and released with a
//!   reference count and destroyed (all its memory, streams, events and modules freed)
//!   when the count drops to zero; each thread has its own current context (a stack).
//!   Every call that needs a context fails with `CUDA_ERROR_INVALID_CONTEXT` on a thread
//!   where none is current. A kernel fault or an illegal copy found while a stream runs
//!   is *sticky*: every later call in that context returns it, as on a real GPU.
//!   `cuDevicePrimaryCtxReset` destroys the context (with the pools created in it) but
//!   does not release it: it is *inactive* (`cuDevicePrimaryCtxGetState`), calls in it
//!   fail with `CUDA_ERROR_CONTEXT_IS_DESTROYED`, until a retain activates it again under
//!   the same handle with a new `cuCtxGetId`.
//! - **Memory** ([`memory`]): device memory lives at fake, non-canonical addresses
//!   (from `0x000d_0000_0000_0000`, 256-byte aligned, separated by unmapped gaps) backed
//!   by host memory inside the emulator, so a host dereference of a device pointer
//!   crashes; fresh allocations are filled with a poison byte (`0xCD`), not zeros.
//!   `cuMemAlloc` addresses are never reused. The stream-ordered allocator reuses freed
//!   blocks as the driver's pools do: on the freeing stream at once, on other streams
//!   per the pool's `CU_MEMPOOL_ATTR_REUSE_*` flags (an event dependency on the free, a
//!   free already run, or an inserted wait); a `cuMemFreeAsync`, when it runs in stream
//!   order, fills the block with `0xDF` ([`FREED_POISON`]). A reader on another stream
//!   that is not ordered before the free thus reads the reusing allocation's data or
//!   the poison, never the old data; an access to a freed block that nothing reused
//!   faults. Pinned and managed memory are real page-aligned host allocations (device
//!   pointer == host pointer). Every copy and every kernel access must lie inside one
//!   live allocation (copies may also name plain host memory), else
//!   `CUDA_ERROR_ILLEGAL_ADDRESS`. Device memory is accounted exactly
//!   (`cuMemGetInfo_v2`), with the stream-ordered allocator's pool: memory freed with
//!   `cuMemFreeAsync` stays reserved by the pool until a synchronization releases it
//!   above the release threshold, or `cuMemPoolTrimTo`. The total comes from
//!   `DEVARROW_EMU_MEM_BYTES` (default 8 GiB; `K`, `M`, `G` suffixes allowed).
//!   `cuMemHostRegister` page-locks the caller's memory in place (a range sharing a page
//!   with a page-locked one is `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`); it is
//!   forgotten at `cuMemHostUnregister` at once, so a copy still queued on it faults.
//!   `devarrow_emu_host_registrations` (found with `dlsym`) counts registrations, and
//!   `devarrow_emu_mem_get_info_calls` the `cuMemGetInfo` calls.
//!   As lenient as the driver where it is: `cuMemFree` needs no current context (the
//!   pointer names its allocation's context, which it synchronizes); `cuMemAllocHost` /
//!   `cuMemHostAlloc` of 0 bytes succeed, allocate nothing and leave `*pp` unwritten
//!   (`cudaMallocHost(&p, 0)` on NVIDIA's driver), and `cuMemFreeHost(NULL)` succeeds;
//!   `cuMemAlloc(0)` stays `CUDA_ERROR_INVALID_VALUE`, as documented.
//!   `cuMemcpyPeerAsync` copies device memory between contexts, each pointer checked
//!   against the context named with it.
//! - **Several devices**: `DEVARROW_EMU_DEVICES=N` (1 to 8, default 1; read once per
//!   process, like every setting) offers N identical devices. Each has its own primary
//!   context, its own memory accounting (`DEVARROW_EMU_MEM_BYTES` each, `cuMemGetInfo`
//!   of the current context's device), its own default pool (`cuDeviceGetDefaultMemPool`)
//!   and its own slice of the fake address range ([`DEVICE_ADDRESS_SPAN`] bytes from
//!   `DEVICE_ADDRESS_BASE + d * DEVICE_ADDRESS_SPAN`), so a pointer tells its device
//!   ([`device_of_address`], `CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL`). A reset of one
//!   device's primary context touches no other. `cuDeviceCanAccessPeer` says 1 for every
//!   pair of two different devices (0 for a device and itself, as NVIDIA's driver), or 0
//!   for every pair with `DEVARROW_EMU_NO_PEER=1` (GPUs without a peer link).
//!   `cuCtxEnablePeerAccess` / `cuCtxDisablePeerAccess` keep, per context, the devices
//!   it may reach, with the documented errors (`CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED`,
//!   `_NOT_ENABLED`, `_UNSUPPORTED` where `cuDeviceCanAccessPeer` says 0,
//!   `CUDA_ERROR_INVALID_CONTEXT` for the current context itself or an invalid one,
//!   `CUDA_ERROR_INVALID_VALUE` for flags); access is one way and ends with either
//!   context. A plain copy, memset, batched copy or kernel in the context of device A
//!   that touches device memory of device B fails with `CUDA_ERROR_ILLEGAL_ADDRESS` (a
//!   kernel's fault is sticky) unless A enabled peer access to B, as on hardware
//!   without UVA peer mappings; pinned and managed memory are reachable from every
//!   device. `cuMemcpyPeerAsync` between two devices needs no peer access: the driver
//!   stages such a copy itself (CUDA driver API, `cuMemcpyPeerAsync`, which lists no
//!   peer-access error; CUDA programming guide, "Peer-to-Peer Memory Copy"), and the
//!   emulator copies either way. A stream-ordered allocation from a pool of another
//!   device than the stream's is `CUDA_ERROR_INVALID_VALUE`.
//! - **Batched copies**: `cuMemcpyBatchAsync` (CUDA 12.8) runs its copies as one stream
//!   operation, with the driver's checks (no legacy NULL stream, attribute indices,
//!   `failIdx`); `DEVARROW_EMU_NO_BATCH_COPY=1`, or `devarrow_emu_set_batch_copy(0)`,
//!   makes it return `CUDA_ERROR_NOT_SUPPORTED`, as a driver without it would.
//! - **Restricted runtimes**: `DEVARROW_EMU_RESTRICTED=1` plays a sandboxed deployment
//!   (gVisor's nvproxy, as in GKE Sandbox and hosted notebooks), which answers what it
//!   does not support with the codes such sandboxes give, not `CUDA_ERROR_NOT_SUPPORTED`:
//!   `cuMemHostRegister` and `cuMemAllocManaged` fail with `CUDA_ERROR_OPERATING_SYSTEM`
//!   (google/gvisor#9372, #9593), `cuMemcpyBatchAsync` with `CUDA_ERROR_NOT_PERMITTED`;
//!   the device attributes still claim managed memory. None of these errors is sticky,
//!   and each is reported as an API error (compute-sanitizer would report it too).
//! - **Streams and events** ([`stream`]): each stream is a queue with its own worker
//!   thread running its operations in order (copies, memsets, kernels, event records,
//!   waits on events, host functions, stream-ordered allocations and frees); the legacy
//!   NULL stream synchronizes with blocking streams. `DEVARROW_EMU_DELAY_US` (default 0)
//!   delays every stream operation by that many microseconds, plus a pseudo-random
//!   part of up to `DEVARROW_EMU_JITTER_US` (default 0), which makes a missing wait or
//!   synchronization show up as wrong data or a fault. API calls from a host function
//!   (that is, from a stream's worker) fail with `CUDA_ERROR_NOT_PERMITTED`. Events keep
//!   their creation flags: `cuEventElapsedTime` on one created with
//!   `CU_EVENT_DISABLE_TIMING` is `CUDA_ERROR_INVALID_HANDLE`, as documented, and
//!   `devarrow_emu_event_flags` (found with `dlsym`) reads them back. A stream or event
//!   handle the emulator never handed out (a garbage value, a handle of another kind),
//!   or one its owner destroyed (`cuStreamDestroy`, `cuEventDestroy`), ends the process
//!   (`devarrow-emu: fatal: <call>: ...` on stderr, then `abort`): NVIDIA's driver
//!   dereferences handles without validating them, so such a call crashes there, and no
//!   test may expect an error code from it. NULL, `CU_STREAM_LEGACY` and
//!   `CU_STREAM_PER_THREAD` are valid stream handles (the last names the calling
//!   thread's per-thread default stream, made on first use, blocking: it synchronizes
//!   with the legacy NULL stream only); a live stream of another context is
//!   `CUDA_ERROR_INVALID_CONTEXT`, and a handle that went with its context (destroyed or
//!   reset) `CUDA_ERROR_INVALID_HANDLE`.
//! - **Implicit synchronization** ([`sync`]): the calls NVIDIA documents as synchronizing
//!   wait as the driver does: page-locked host allocation and registration, device
//!   allocation outside the stream-ordered pool and the synchronous memsets make every
//!   stream of the context wait for the work enqueued before them (a device-side
//!   barrier); `cuMemFree` (of memory not from a pool) and `cuMemFreeHost` wait on the
//!   host for the whole context; any command on the legacy NULL stream waits for the
//!   blocking streams (see *Streams and events*). Each such call is counted, by name,
//!   with `cuCtxSynchronize`: `devarrow_emu_implicit_syncs` and
//!   `devarrow_emu_implicit_sync_count` (found with `dlsym`) read the counts.
//!   `devarrow_emu_api_calls` counts every driver call, by name: what a host path costs
//!   in calls (allocations, memsets, launches, events per batch), which tests assert.
//! - **Kernels** ([`module`]): `cuModuleLoadData` parses PTX with [`crate::ptx`];
//!   `cuLaunchKernel` copies the parameters at launch time and runs the grid on the
//!   stream's worker with [`crate::ptx::Module::launch`], every global access checked
//!   against the allocations live at launch (in stream order; a block freed and reused
//!   after the launch is still the launch's) and their state when it runs. Faults are printed to stderr.
//!
//! Every function catches panics and returns `CUDA_ERROR_UNKNOWN` (printing the panic)
//! instead of unwinding into C.
#![deny(unsafe_op_in_unsafe_fn)]
#![allow(non_snake_case)]

// Internal layers (no module uses one that uses it back): the leaves `common` (result
// type, locking, the API-call wrapper) and `config`; `sync` (the counters of implicit
// synchronization) on `common`; the data types `alloc` (the
// allocation table) and `kernel` (loaded modules and functions); `queue` (streams, their
// operations, events) on those; `state` (the handle table, contexts, the global driver)
// on top. The API modules after them use these layers and never each other.
mod alloc;
mod common;
mod config;
mod kernel;
mod queue;
mod state;

pub mod context;
pub mod device;
pub mod memory;
pub mod module;
pub mod stream;
pub mod sync;

pub use alloc::{
    device_of_address, DEVICE_ADDRESS_BASE, DEVICE_ADDRESS_END, DEVICE_ADDRESS_SPAN, FREED_POISON,
    MAX_DEVICES, POISON,
};
pub use config::{
    config_delay, config_devices, config_no_peer, config_restricted, config_total_memory,
};
