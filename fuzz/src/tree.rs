//! `ArrowArray` trees from fuzz input, for a data type: first a plain description
//! ([`NodeSpec`]), then C structs over real host allocations ([`build`]), as many times as
//! a target needs the same array (one per importer).
//!
//! See the crate documentation for what is fuzzed and what the generator keeps (the
//! contract of `DeviceArray::try_new`: exact buffer sizes).

use std::alloc::Layout;
use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use arbitrary::{Result, Unstructured};
use arrow_schema::{DataType, UnionMode};
use devarrow_abi::layout::{buffer_roles, child_types, fixed_bit_width, offset_width, BufferRole};
use devarrow_abi::{ArrowArray, ArrowDeviceArray, ArrowDeviceType};

/// The largest `offset + length` a node gets buffers for (larger ones get NULL buffers).
pub const MAX_END: i64 = 300;
/// The largest variable-length data or variadic buffer.
pub const MAX_DATA: i64 = 2048;
/// Nodes per tree, at most (then children are NULL slots).
pub const MAX_NODES: usize = 96;

/// `true` once in `n` (never when the input is exhausted).
pub fn rare(u: &mut Unstructured, n: u32) -> Result<bool> {
    Ok(u.int_in_range(0..=n - 1)? == n - 1)
}

/// One buffer: `bytes` at `misalign` bytes past a 64-byte boundary, in an allocation that
/// ends right after them.
#[derive(Debug, Clone)]
pub struct Buf {
    pub bytes: Vec<u8>,
    pub misalign: usize,
}

/// A child slot.
#[derive(Debug, Clone)]
pub enum Slot {
    Null,
    Node(NodeSpec),
}

/// The description of one `ArrowArray`.
#[derive(Debug, Clone)]
pub struct NodeSpec {
    pub length: i64,
    pub null_count: i64,
    pub offset: i64,
    pub n_buffers: i64,
    /// `None`: a NULL `buffers`; otherwise exactly `n_buffers` entries.
    pub buffers: Option<Vec<Option<Buf>>>,
    pub n_children: i64,
    /// `None`: a NULL `children`; otherwise exactly `n_children` entries.
    pub children: Option<Vec<Slot>>,
    pub dictionary: Option<Box<NodeSpec>>,
    pub released: bool,
}

/// Generation state of one tree.
#[derive(Debug, Default)]
pub struct Gen {
    nodes: usize,
}

fn bytes(u: &mut Unstructured, n: usize) -> Result<Vec<u8>> {
    let mut v = vec![0u8; n];
    u.fill_buffer(&mut v)?;
    Ok(v)
}

fn encode(values: &[i64], width: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * width);
    for &v in values {
        match width {
            1 => out.push(v as u8),
            2 => out.extend((v as i16).to_ne_bytes()),
            4 => out.extend((v as i32).to_ne_bytes()),
            _ => out.extend(v.to_ne_bytes()),
        }
    }
    out
}

/// A small non-negative value, or (rarely) anything.
fn small(u: &mut Unstructured, max: i64) -> Result<i64> {
    if rare(u, 40)? {
        return Ok(match u.int_in_range(0u8..=4)? {
            0 => -1,
            1 => i32::MAX as i64,
            2 => i64::MAX,
            3 => i32::MIN as i64,
            _ => u.arbitrary()?,
        });
    }
    u.int_in_range(0..=max)
}

/// Monotonic offsets (small steps), rarely broken.
fn offsets(u: &mut Unstructured, n: usize) -> Result<Vec<i64>> {
    let mut v = Vec::with_capacity(n);
    let mut cur = if rare(u, 4)? { small(u, 6)? } else { 0 };
    for _ in 0..n {
        v.push(cur);
        let step = if rare(u, 30)? {
            small(u, 1000)?.wrapping_neg()
        } else {
            small(u, 6)?
        };
        cur = cur.saturating_add(step);
    }
    Ok(v)
}

fn alignment(u: &mut Unstructured) -> Result<usize> {
    Ok(if rare(u, 16)? {
        u.int_in_range(1..=7)?
    } else {
        0
    })
}

fn buf(u: &mut Unstructured, bytes: Vec<u8>) -> Result<Option<Buf>> {
    Ok(Some(Buf {
        bytes,
        misalign: alignment(u)?,
    }))
}

/// What a parent wants of a child: its type-specific content.
#[derive(Debug, Clone, Copy)]
enum Hint {
    None,
    /// Run ends of a run-end-encoded array covering this many logical items.
    RunEnds(i64),
}

/// Generates a node of `dt`; `want` is the `offset + length` the parent needs (the child
/// mostly obeys).
pub fn node(
    u: &mut Unstructured,
    dt: &DataType,
    want: Option<i64>,
    g: &mut Gen,
) -> Result<NodeSpec> {
    node_with(u, dt, want, Hint::None, g)
}

fn node_with(
    u: &mut Unstructured,
    dt: &DataType,
    want: Option<i64>,
    hint: Hint,
    g: &mut Gen,
) -> Result<NodeSpec> {
    g.nodes += 1;
    let wild = rare(u, 10)?;
    let mut offset: i64 = if rare(u, 4)? {
        u.int_in_range(1..=9)?
    } else {
        0
    };
    let mut length: i64 = match want {
        Some(w) if !rare(u, 10)? => {
            if offset > w {
                offset = 0;
            }
            (w - offset).saturating_add(if rare(u, 5)? {
                u.int_in_range(0..=3)?
            } else {
                0
            })
        }
        _ => u.int_in_range(0..=10)?,
    };
    if wild {
        match u.int_in_range(0u8..=7)? {
            0 => length = -1 - u.int_in_range(0..=5)?,
            1 => offset = -1 - u.int_in_range(0..=5)?,
            2 => length = i64::MAX - u.int_in_range(0..=2)?,
            3 => offset = i64::MAX - u.int_in_range(0..=2)?,
            4 => length = 1 << u.int_in_range(10..=62)?,
            5 => offset = 1 << u.int_in_range(10..=62)?,
            6 => length = u.arbitrary()?,
            _ => offset = u.arbitrary()?,
        }
    }
    let mut null_count = match u.int_in_range(0u8..=3)? {
        0 | 1 => 0,
        2 => -1,
        _ if length > 0 => u.int_in_range(0..=length)?,
        _ => 0,
    };
    if wild && rare(u, 3)? {
        null_count = u.arbitrary()?;
    }
    // The end the buffers are sized for; `None` when they cannot be allocated.
    let logical_end = offset
        .checked_add(length)
        .filter(|_| offset >= 0 && length >= 0);
    let end = logical_end.filter(|&e| e <= MAX_END).map(|e| e as usize);

    let value_type = match dt {
        DataType::Dictionary(key, _) => key.as_ref(),
        dt => dt,
    };
    let roles = buffer_roles(dt);
    let is_view = matches!(dt, DataType::Utf8View | DataType::BinaryView);
    let n_variadic: usize = if is_view { u.int_in_range(0..=3)? } else { 0 };
    let mut list: Vec<Option<Buf>> = Vec::new();
    // Facts later steps need.
    let mut last_offset: Option<i64> = None;
    let mut view_extent: Option<i64> = None;
    let mut dict_len: i64 = 0;
    let mut union_counts: Vec<i64> = Vec::new();
    let mut runs: i64 = 0;
    let union_ids: Vec<i8> = match dt {
        DataType::Union(fields, _) => fields.iter().map(|(id, _)| id).collect(),
        _ => Vec::new(),
    };
    let mut type_ids: Vec<i8> = Vec::new();

    for role in &roles {
        let Some(end) = end else {
            list.push(None);
            continue;
        };
        let entry = match role {
            BufferRole::Validity => {
                if (null_count == 0 && u.arbitrary()?) || rare(u, 30)? {
                    None
                } else {
                    let b = bytes(u, end.div_ceil(8))?;
                    buf(u, b)?
                }
            }
            BufferRole::Values => {
                let bits = fixed_bit_width(value_type).unwrap_or(0);
                let n = (end * bits).div_ceil(8);
                let b = if let DataType::Dictionary(..) = dt {
                    let keys: Vec<i64> = (0..end).map(|_| small(u, 4)).collect::<Result<_>>()?;
                    dict_len = keys
                        .iter()
                        .copied()
                        .filter(|&k| k >= 0)
                        .max()
                        .map_or(0, |k| k.saturating_add(1));
                    encode(&keys, bits / 8)
                } else if let Hint::RunEnds(total) = hint {
                    // Increasing run ends covering `total` items, rarely broken.
                    let mut v = Vec::with_capacity(end);
                    let mut cur = 0i64;
                    for i in 0..end {
                        let step = if rare(u, 20)? {
                            small(u, 3)?.saturating_sub(2)
                        } else {
                            u.int_in_range(1..=3)?
                        };
                        cur = cur.saturating_add(step);
                        if i + 1 == end && !rare(u, 6)? {
                            cur = cur.max(total);
                        }
                        v.push(cur);
                    }
                    encode(&v, (bits / 8).max(1))
                } else {
                    bytes(u, n)?
                };
                if rare(u, 40)? {
                    None
                } else {
                    buf(u, b)?
                }
            }
            BufferRole::Offsets => match dt {
                DataType::Union(_, _) => {
                    // Dense: the k-th item of a type id at offset k of that child, mostly.
                    let mut counts = vec![0i64; union_ids.len()];
                    let mut offs = Vec::with_capacity(end);
                    for &id in &type_ids {
                        let k = union_ids.iter().position(|&x| x == id);
                        let o = match k {
                            Some(k) if !rare(u, 12)? => {
                                counts[k] += 1;
                                counts[k] - 1
                            }
                            _ => small(u, 4)?,
                        };
                        offs.push(o);
                    }
                    offs.resize(end, 0);
                    union_counts = counts;
                    buf(u, encode(&offs, 4))?
                }
                DataType::ListView(_) | DataType::LargeListView(_) => {
                    let w = offset_width(dt);
                    let offs: Vec<i64> = (0..end).map(|_| small(u, 6)).collect::<Result<_>>()?;
                    let sizes: Vec<i64> = (0..end).map(|_| small(u, 4)).collect::<Result<_>>()?;
                    view_extent = Some(
                        offs.iter()
                            .zip(&sizes)
                            .map(|(o, s)| o.saturating_add(*s))
                            .max()
                            .unwrap_or(0),
                    );
                    list.push(buf(u, encode(&offs, w))?);
                    buf(u, encode(&sizes, w))?
                }
                _ => {
                    let w = offset_width(dt);
                    let offs = offsets(u, end + 1)?;
                    last_offset = offs.last().copied();
                    buf(u, encode(&offs, w))?
                }
            },
            // Generated with the list-view offsets above.
            BufferRole::Sizes => continue,
            BufferRole::Data => {
                let last = last_offset.unwrap_or(0);
                if (0..=MAX_DATA).contains(&last) {
                    let n = last as usize;
                    let b = if matches!(dt, DataType::Utf8 | DataType::LargeUtf8) && !rare(u, 8)? {
                        (0..n).map(|i| b'a' + (i % 26) as u8).collect()
                    } else {
                        bytes(u, n)?
                    };
                    if rare(u, 40)? {
                        None
                    } else {
                        buf(u, b)?
                    }
                } else {
                    None
                }
            }
            BufferRole::TypeIds => {
                type_ids = (0..end)
                    .map(|_| -> Result<i8> {
                        Ok(if !union_ids.is_empty() && !rare(u, 16)? {
                            union_ids[u.choose_index(union_ids.len())?]
                        } else {
                            u.arbitrary()?
                        })
                    })
                    .collect::<Result<_>>()?;
                buf(u, type_ids.iter().map(|&t| t as u8).collect())?
            }
            BufferRole::Views => {
                let mut b = Vec::with_capacity(end * 16);
                for _ in 0..end {
                    if rare(u, 16)? {
                        b.extend(bytes(u, 16)?);
                        continue;
                    }
                    let len: i32 = small(u, 20)? as i32;
                    b.extend(len.to_le_bytes());
                    if (0..=12).contains(&len) {
                        let mut inline = [0u8; 12];
                        for (i, x) in inline.iter_mut().enumerate().take(len as usize) {
                            *x = b'a' + i as u8;
                        }
                        b.extend(inline);
                    } else {
                        b.extend(bytes(u, 4)?);
                        let index = small(u, n_variadic.saturating_sub(1) as i64)? as i32;
                        let off = small(u, 16)? as i32;
                        b.extend(index.to_le_bytes());
                        b.extend(off.to_le_bytes());
                    }
                }
                buf(u, b)?
            }
            BufferRole::VariadicSizes => None,
        };
        list.push(entry);
    }
    if is_view {
        match end {
            Some(_) => {
                let sizes: Vec<i64> = (0..n_variadic)
                    .map(|_| small(u, 64))
                    .collect::<Result<_>>()?;
                for &s in &sizes {
                    if (0..=MAX_DATA).contains(&s) {
                        let b = bytes(u, s as usize)?;
                        list.push(buf(u, b)?);
                    } else {
                        list.push(None);
                    }
                }
                list.push(buf(u, encode(&sizes, 8))?);
            }
            None => list.extend((0..=n_variadic).map(|_| None)),
        }
    }
    let mut n_buffers = list.len() as i64;
    if wild && rare(u, 2)? {
        n_buffers = u.int_in_range(-2..=8)?;
        let target = n_buffers.max(0) as usize;
        while list.len() < target {
            let n = u.int_in_range(0..=16)?;
            let b = bytes(u, n)?;
            list.push(buf(u, b)?);
        }
        list.truncate(target);
    }
    let buffers = if n_buffers > 0 && rare(u, 40)? {
        None
    } else {
        Some(list)
    };

    // Children.
    let types = child_types(dt);
    let wants: Vec<Option<i64>> = match dt {
        DataType::Struct(_) | DataType::Union(_, UnionMode::Sparse) => {
            vec![logical_end; types.len()]
        }
        DataType::FixedSizeList(_, k) => vec![logical_end.and_then(|e| e.checked_mul(*k as i64))],
        DataType::List(_) | DataType::LargeList(_) | DataType::Map(_, _) => {
            vec![last_offset.filter(|&l| l >= 0)]
        }
        DataType::ListView(_) | DataType::LargeListView(_) => vec![view_extent],
        DataType::Union(_, UnionMode::Dense) => (0..types.len())
            .map(|i| union_counts.get(i).copied().or(Some(0)))
            .collect(),
        DataType::RunEndEncoded(_, _) => {
            runs = u.int_in_range(1..=6)?;
            vec![Some(runs), Some(runs)]
        }
        _ => vec![None; types.len()],
    };
    let mut n_children = types.len() as i64;
    if wild && rare(u, 2)? {
        n_children = u.int_in_range(-1..=4)?;
    }
    let children = if n_children > 0 && rare(u, 40)? {
        None
    } else {
        let mut slots = Vec::new();
        for i in 0..n_children.max(0) as usize {
            if g.nodes >= MAX_NODES || rare(u, 40)? {
                slots.push(Slot::Null);
                continue;
            }
            let child_type = types.get(i).copied().unwrap_or(&DataType::Null);
            let want = wants.get(i).copied().flatten();
            let hint = match dt {
                DataType::RunEndEncoded(_, _) if i == 0 => Hint::RunEnds(logical_end.unwrap_or(0)),
                _ => Hint::None,
            };
            let mut child = node_with(u, child_type, want, hint, g)?;
            child.released = rare(u, 40)?;
            slots.push(Slot::Node(child));
        }
        Some(slots)
    };
    let _ = runs;

    let dictionary = match dt {
        DataType::Dictionary(_, value) if !rare(u, 30)? && g.nodes < MAX_NODES => {
            let mut d = node(u, value, Some(dict_len), g)?;
            d.released = rare(u, 40)?;
            Some(Box::new(d))
        }
        _ if rare(u, 60)? => Some(Box::new(node(u, &DataType::Null, None, g)?)),
        _ => None,
    };
    Ok(NodeSpec {
        length,
        null_count,
        offset,
        n_buffers,
        buffers,
        n_children,
        children,
        dictionary,
        released: false,
    })
}

/// The device fields of an `ArrowDeviceArray`.
#[derive(Debug, Clone, Copy)]
pub struct DeviceFields {
    pub device_type: ArrowDeviceType,
    pub device_id: i64,
    /// A `sync_event` address; only ever non-zero on the CPU, which has no event type
    /// (anywhere else the contract wants NULL or a live event of the device's kind).
    pub sync_event: usize,
    pub reserved: [i64; 3],
}

/// Device fields: mostly the CPU's (`ARROW_DEVICE_CPU`, -1, NULL).
pub fn device_fields(u: &mut Unstructured) -> Result<DeviceFields> {
    let device_type = if rare(u, 10)? {
        ArrowDeviceType(match u.int_in_range(0u8..=6)? {
            0 => 0,
            1 => 2,
            2 => 3,
            3 => 13,
            4 => 10,
            5 => 99,
            _ => u.arbitrary()?,
        })
    } else {
        ArrowDeviceType::CPU
    };
    let device_id = if rare(u, 8)? { u.arbitrary()? } else { -1 };
    let sync_event = if device_type == ArrowDeviceType::CPU && rare(u, 12)? {
        0x1000 + 8 * u.int_in_range(0usize..=100)?
    } else {
        0
    };
    let reserved = if rare(u, 8)? { u.arbitrary()? } else { [0; 3] };
    Ok(DeviceFields {
        device_type,
        device_id,
        sync_event,
        reserved,
    })
}

/// How often a built tree's root was released (must be exactly once in the end).
#[derive(Debug, Default)]
pub struct Counters {
    pub releases: AtomicUsize,
}

impl Counters {
    pub fn releases(&self) -> usize {
        self.releases.load(Ordering::SeqCst)
    }
}

/// Everything a built tree owns; freed by the root's release.
struct Storage {
    counters: Arc<Counters>,
    nodes: Vec<*mut ArrowArray>,
    buffer_lists: Vec<(*mut *const c_void, usize)>,
    child_lists: Vec<(*mut *mut ArrowArray, usize)>,
    allocs: Vec<(*mut u8, Layout)>,
}

impl Drop for Storage {
    fn drop(&mut self) {
        // SAFETY: every pointer below came from Box::into_raw / alloc in `build` (with these
        // lengths and layouts) and is freed only here.
        unsafe {
            for &n in &self.nodes {
                drop(Box::from_raw(n));
            }
            for &(p, len) in &self.buffer_lists {
                drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(p, len)));
            }
            for &(p, len) in &self.child_lists {
                drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(p, len)));
            }
            for &(p, layout) in &self.allocs {
                std::alloc::dealloc(p, layout);
            }
        }
    }
}

impl Storage {
    fn alloc(&mut self, b: &Buf) -> *const c_void {
        let size = b.bytes.len() + b.misalign;
        if size == 0 {
            // A zero-byte buffer: a non-NULL address nothing may read.
            return std::ptr::without_provenance(64);
        }
        let layout = Layout::from_size_align(size, 64).unwrap();
        // SAFETY: non-zero size.
        let p = unsafe { std::alloc::alloc(layout) };
        assert!(!p.is_null(), "out of memory");
        // SAFETY: `p` holds `size` bytes; the copy fills the last `bytes.len()` of them.
        unsafe {
            std::ptr::write_bytes(p, 0xAB, b.misalign);
            std::ptr::copy_nonoverlapping(b.bytes.as_ptr(), p.add(b.misalign), b.bytes.len());
        }
        self.allocs.push((p, layout));
        // SAFETY: within the allocation (or one past its end for an empty buffer).
        unsafe { p.add(b.misalign) as *const c_void }
    }

    fn node(&mut self, spec: &NodeSpec) -> ArrowArray {
        let buffers = match &spec.buffers {
            None => std::ptr::null_mut(),
            Some(list) => {
                let ptrs: Box<[*const c_void]> = list
                    .iter()
                    .map(|b| b.as_ref().map_or(std::ptr::null(), |b| self.alloc(b)))
                    .collect();
                let len = ptrs.len();
                let p = Box::into_raw(ptrs) as *mut *const c_void;
                self.buffer_lists.push((p, len));
                p
            }
        };
        let children = match &spec.children {
            None => std::ptr::null_mut(),
            Some(slots) => {
                let ptrs: Box<[*mut ArrowArray]> = slots
                    .iter()
                    .map(|s| match s {
                        Slot::Null => std::ptr::null_mut(),
                        Slot::Node(c) => self.boxed(c),
                    })
                    .collect();
                let len = ptrs.len();
                let p = Box::into_raw(ptrs) as *mut *mut ArrowArray;
                self.child_lists.push((p, len));
                p
            }
        };
        let dictionary = match &spec.dictionary {
            None => std::ptr::null_mut(),
            Some(d) => self.boxed(d),
        };
        ArrowArray {
            length: spec.length,
            null_count: spec.null_count,
            offset: spec.offset,
            n_buffers: spec.n_buffers,
            n_children: spec.n_children,
            buffers,
            children,
            dictionary,
            release: if spec.released {
                None
            } else {
                Some(child_release)
            },
            private_data: std::ptr::null_mut(),
        }
    }

    fn boxed(&mut self, spec: &NodeSpec) -> *mut ArrowArray {
        let node = self.node(spec);
        let p = Box::into_raw(Box::new(node));
        self.nodes.push(p);
        p
    }
}

unsafe extern "C" fn child_release(array: *mut ArrowArray) {
    // SAFETY: called on one of our (live) child structs; the memory is the root's.
    unsafe { (*array).release = None };
}

unsafe extern "C" fn root_release(array: *mut ArrowArray) {
    // SAFETY: called on our root struct (possibly moved), with its private data.
    let a = unsafe { &mut *array };
    if a.private_data.is_null() {
        eprintln!("devarrow-fuzz: the root ArrowArray was released twice");
        std::process::abort();
    }
    // SAFETY: private_data is the Box<Storage> made in `build`, freed only here.
    let storage = unsafe { Box::from_raw(a.private_data as *mut Storage) };
    for &n in &storage.nodes {
        // SAFETY: the nodes are live until `storage` drops.
        if let Some(release) = unsafe { (*n).release } {
            // SAFETY: an unreleased child of ours.
            unsafe { release(n) };
        }
    }
    storage.counters.releases.fetch_add(1, Ordering::SeqCst);
    drop(storage);
    a.release = None;
    a.private_data = std::ptr::null_mut();
}

/// Builds the C structs of `spec` with `device`; the root releases everything, once.
pub fn build(spec: &NodeSpec, device: &DeviceFields) -> (ArrowDeviceArray, Arc<Counters>) {
    let counters = Arc::new(Counters::default());
    let mut storage = Storage {
        counters: counters.clone(),
        nodes: Vec::new(),
        buffer_lists: Vec::new(),
        child_lists: Vec::new(),
        allocs: Vec::new(),
    };
    let mut root = storage.node(spec);
    root.release = Some(root_release);
    root.private_data = Box::into_raw(Box::new(storage)) as *mut c_void;
    let array = ArrowDeviceArray {
        array: root,
        device_id: device.device_id,
        device_type: device.device_type,
        sync_event: std::ptr::without_provenance_mut(device.sync_event),
        reserved: device.reserved,
    };
    (array, counters)
}
