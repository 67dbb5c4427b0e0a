//! Foreign `ArrowSchema` trees from fuzz input, laid out in C by hand (not by arrow-rs):
//! arbitrary format strings (known ones, mutated ones, arbitrary bytes, rarely NULL),
//! names (rarely not UTF-8), flags, well-formed metadata with arbitrary bytes, children
//! and dictionaries.
//!
//! Kept from the contract of the C data interface: the struct tree is well-formed (a
//! non-NULL `children` holds `n_children` pointers to live schemas, metadata is encoded
//! as the interface says, strings are NUL-terminated).

use std::ffi::{c_char, c_void};

use arbitrary::{Result, Unstructured};
use arrow_schema::ffi::FFI_ArrowSchema;

use crate::tree::rare;

/// Format strings arrow-rs knows, and some near misses.
pub const FORMATS: &[&str] = &[
    "n",
    "b",
    "c",
    "C",
    "s",
    "S",
    "i",
    "I",
    "l",
    "L",
    "e",
    "f",
    "g",
    "z",
    "Z",
    "u",
    "U",
    "vz",
    "vu",
    "w:3",
    "w:0",
    "w:-1",
    "w:",
    "d:10,2",
    "d:40,3,256",
    "d:5,1,32",
    "d:12,2,64",
    "d:",
    "d:1,2,3,4",
    "tdD",
    "tdm",
    "tts",
    "ttm",
    "ttu",
    "ttn",
    "tss:",
    "tsn:UTC",
    "tsu:+01:00",
    "tsx:",
    "tDs",
    "tDn",
    "tiM",
    "tiD",
    "tin",
    "+l",
    "+L",
    "+vl",
    "+vL",
    "+w:2",
    "+w:0",
    "+w:-3",
    "+w:",
    "+s",
    "+m",
    "+ud:0,1",
    "+us:3",
    "+us:",
    "+ud:",
    "+ud:1,1",
    "+us:0,1,2",
    "+r",
];

/// The C `struct ArrowSchema`, built here.
#[repr(C)]
struct RawSchema {
    format: *const c_char,
    name: *const c_char,
    metadata: *const c_char,
    flags: i64,
    n_children: i64,
    children: *mut *mut RawSchema,
    dictionary: *mut RawSchema,
    release: Option<unsafe extern "C" fn(*mut RawSchema)>,
    private_data: *mut c_void,
}

/// What a schema tree owns: freed by the root's release.
#[derive(Default)]
struct Storage {
    strings: Vec<Vec<u8>>,
    nodes: Vec<*mut RawSchema>,
    lists: Vec<(*mut *mut RawSchema, usize)>,
}

impl Drop for Storage {
    fn drop(&mut self) {
        // SAFETY: all from Box::into_raw in this module, freed only here.
        unsafe {
            for &n in &self.nodes {
                drop(Box::from_raw(n));
            }
            for &(p, len) in &self.lists {
                drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(p, len)));
            }
        }
    }
}

impl Storage {
    fn string(&mut self, mut bytes: Vec<u8>) -> *const c_char {
        bytes.retain(|&b| b != 0);
        bytes.push(0);
        let p = bytes.as_ptr() as *const c_char;
        self.strings.push(bytes);
        p
    }
}

unsafe extern "C" fn child_release(schema: *mut RawSchema) {
    // SAFETY: one of our live child structs; the memory is the root's.
    unsafe { (*schema).release = None };
}

unsafe extern "C" fn root_release(schema: *mut RawSchema) {
    // SAFETY: our root (possibly moved), with its private data.
    let s = unsafe { &mut *schema };
    if s.private_data.is_null() {
        eprintln!("devarrow-fuzz: a foreign ArrowSchema was released twice");
        std::process::abort();
    }
    // SAFETY: the Box<Storage> made in `schema`, freed only here.
    let storage = unsafe { Box::from_raw(s.private_data as *mut Storage) };
    for &n in &storage.nodes {
        // SAFETY: live until `storage` drops.
        if let Some(release) = unsafe { (*n).release } {
            // SAFETY: an unreleased child of ours.
            unsafe { release(n) };
        }
    }
    drop(storage);
    s.release = None;
    s.private_data = std::ptr::null_mut();
}

fn format(u: &mut Unstructured) -> Result<Option<Vec<u8>>> {
    Ok(match u.int_in_range(0u8..=15)? {
        0 => Some(u.arbitrary::<Vec<u8>>()?),
        1 => {
            let mut f = FORMATS[u.choose_index(FORMATS.len())?].as_bytes().to_vec();
            let extra: Vec<u8> = u.arbitrary()?;
            f.extend(extra.into_iter().take(6));
            Some(f)
        }
        2 if rare(u, 8)? => None,
        _ => Some(FORMATS[u.choose_index(FORMATS.len())?].as_bytes().to_vec()),
    })
}

fn expected_children(format: &[u8], u: &mut Unstructured) -> Result<usize> {
    Ok(match format {
        b"+l" | b"+L" | b"+vl" | b"+vL" | b"+m" => 1,
        f if f.starts_with(b"+w:") => 1,
        b"+s" => u.int_in_range(1..=3)?,
        b"+r" => 2,
        f if f.starts_with(b"+u") => f.iter().filter(|&&c| c == b',').count() + 1,
        _ => 0,
    })
}

fn metadata(u: &mut Unstructured) -> Result<Vec<u8>> {
    let n = u.int_in_range(0i32..=3)?;
    let mut out = n.to_ne_bytes().to_vec();
    for _ in 0..n {
        for _ in 0..2 {
            let s: Vec<u8> = if rare(u, 4)? {
                u.arbitrary()?
            } else {
                b"key".to_vec()
            };
            out.extend((s.len() as i32).to_ne_bytes());
            out.extend(s);
        }
    }
    Ok(out)
}

fn node(
    u: &mut Unstructured,
    st: &mut Storage,
    root_format: Option<&[u8]>,
    depth: u32,
) -> Result<RawSchema> {
    let format = match root_format {
        Some(f) => Some(f.to_vec()),
        None => format(u)?,
    };
    let mut n = match &format {
        Some(f) => expected_children(f, u)?,
        None => 0,
    };
    if depth == 0 {
        n = 0;
    } else if rare(u, 12)? {
        n = u.int_in_range(0..=3)?;
    }
    let name = match u.int_in_range(0u8..=7)? {
        0 => None,
        1 => Some(u.arbitrary::<Vec<u8>>()?),
        _ => Some(b"f".to_vec()),
    };
    let metadata = if rare(u, 6)? {
        Some(metadata(u)?)
    } else {
        None
    };
    let flags = match u.int_in_range(0u8..=7)? {
        0 => u.arbitrary()?,
        1..=3 => 0,
        _ => 2,
    };
    let children = if n == 0 {
        std::ptr::null_mut()
    } else {
        let mut list = Vec::with_capacity(n);
        for _ in 0..n {
            let mut child = node(u, st, None, depth - 1)?;
            child.release = Some(child_release);
            let p = Box::into_raw(Box::new(child));
            st.nodes.push(p);
            list.push(p);
        }
        let list = list.into_boxed_slice();
        let p = Box::into_raw(list) as *mut *mut RawSchema;
        st.lists.push((p, n));
        p
    };
    let dictionary = if depth > 0 && rare(u, 10)? {
        let mut d = node(u, st, None, depth - 1)?;
        d.release = Some(child_release);
        let p = Box::into_raw(Box::new(d));
        st.nodes.push(p);
        p
    } else {
        std::ptr::null_mut()
    };
    Ok(RawSchema {
        format: format.map_or(std::ptr::null(), |f| st.string(f)),
        name: name.map_or(std::ptr::null(), |n| st.string(n)),
        metadata: match metadata {
            // Not a C string: keep the bytes as they are (they may hold NULs).
            Some(m) => {
                let p = m.as_ptr() as *const c_char;
                st.strings.push(m);
                p
            }
            None => std::ptr::null(),
        },
        flags,
        n_children: n as i64,
        children,
        dictionary,
        release: Some(child_release),
        private_data: std::ptr::null_mut(),
    })
}

/// A foreign schema tree (root format `root_format`, or a generated one); releasing it
/// frees everything.
pub fn schema(u: &mut Unstructured, root_format: Option<&[u8]>) -> Result<FFI_ArrowSchema> {
    let mut st = Box::<Storage>::default();
    let mut root = node(u, &mut st, root_format, 3)?;
    root.release = Some(root_release);
    root.private_data = Box::into_raw(st) as *mut c_void;
    // SAFETY: RawSchema is the C struct ArrowSchema, as FFI_ArrowSchema is (same size,
    // checked below); `from_raw` moves it out and leaves `root` released.
    const _: () =
        assert!(std::mem::size_of::<RawSchema>() == std::mem::size_of::<FFI_ArrowSchema>());
    Ok(unsafe { FFI_ArrowSchema::from_raw(&mut root as *mut RawSchema as *mut FFI_ArrowSchema) })
}
