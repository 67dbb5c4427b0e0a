//! Checks devarrow's `#[repr(C)]` definitions against `include/arrow_c_device.h`, compiled
//! with the system C compiler (`$CC`, or `cc`): the size and alignment of every struct, the
//! offset of every field, the `ARROW_DEVICE_*` and `ARROW_FLAG_*` values and the include
//! guards of the canonical `abi.h`.
//!
//! `ArrowSchema`, `ArrowArray` and `ArrowArrayStream` are arrow-rs types whose fields are
//! private, so their offsets are checked on a test-local mirror whose size and alignment
//! equal arrow-rs's, and the mirror is then checked against live arrow-rs values (reading
//! each field through the mirror gives what the arrow-rs accessors give; the stream's
//! callbacks are called through the mirror).

use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::mem::{align_of, offset_of, size_of};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use arrow_array::ffi_stream::FFI_ArrowArrayStream;
use arrow_array::{Int32Array, RecordBatch, RecordBatchIterator};
use arrow_schema::ffi::FFI_ArrowSchema;
use arrow_schema::{DataType, Field, Schema};
use devarrow_abi::ffi::FFI_ArrowArray;
use devarrow_abi::{
    ArrowArray, ArrowAsyncDeviceStreamHandler, ArrowAsyncProducer, ArrowAsyncTask,
    ArrowDeviceArray, ArrowDeviceArrayStream, ArrowDeviceType,
};

/// The package's directory as cargo runs this test, else as it built it: a test binary
/// reused from a shared target directory, built in another checkout, keeps that
/// checkout's path in `env!`.
fn manifest_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

fn header() -> PathBuf {
    manifest_dir().join("../../include/arrow_c_device.h")
}

fn c_compiler() -> String {
    std::env::var("CC")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "cc".into())
}

/// Compiles `source` (with the header's directory on the include path) into an executable
/// and returns its path. Panics with the compiler's output on failure.
fn compile(name: &str, source: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("c_layout");
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join(format!("{name}.c"));
    let exe = dir.join(name);
    std::fs::write(&src, source).unwrap();
    let cc = c_compiler();
    let include = header().parent().unwrap().to_path_buf();
    let output = Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic", "-I"])
        .arg(&include)
        .arg("-o")
        .arg(&exe)
        .arg(&src)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "could not run the C compiler {cc:?} ({e}); this test needs a C compiler: \
                 install gcc or clang, or set CC"
            )
        });
    assert!(
        output.status.success(),
        "{cc} failed to compile {}:\n{}{}",
        src.display(),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    exe
}

/// The struct fields the C program reports, in declaration order.
const STRUCTS: &[(&str, &[&str])] = &[
    (
        "ArrowSchema",
        &[
            "format",
            "name",
            "metadata",
            "flags",
            "n_children",
            "children",
            "dictionary",
            "release",
            "private_data",
        ],
    ),
    (
        "ArrowArray",
        &[
            "length",
            "null_count",
            "offset",
            "n_buffers",
            "n_children",
            "buffers",
            "children",
            "dictionary",
            "release",
            "private_data",
        ],
    ),
    (
        "ArrowDeviceArray",
        &[
            "array",
            "device_id",
            "device_type",
            "sync_event",
            "reserved",
        ],
    ),
    (
        "ArrowArrayStream",
        &[
            "get_schema",
            "get_next",
            "get_last_error",
            "release",
            "private_data",
        ],
    ),
    (
        "ArrowDeviceArrayStream",
        &[
            "device_type",
            "get_schema",
            "get_next",
            "get_last_error",
            "release",
            "private_data",
        ],
    ),
    ("ArrowAsyncTask", &["extract_data", "private_data"]),
    (
        "ArrowAsyncProducer",
        &[
            "device_type",
            "request",
            "cancel",
            "additional_metadata",
            "private_data",
        ],
    ),
    (
        "ArrowAsyncDeviceStreamHandler",
        &[
            "on_schema",
            "on_next_task",
            "on_error",
            "release",
            "producer",
            "private_data",
        ],
    ),
];

const MACROS: &[&str] = &[
    "ARROW_DEVICE_CPU",
    "ARROW_DEVICE_CUDA",
    "ARROW_DEVICE_CUDA_HOST",
    "ARROW_DEVICE_OPENCL",
    "ARROW_DEVICE_VULKAN",
    "ARROW_DEVICE_METAL",
    "ARROW_DEVICE_VPI",
    "ARROW_DEVICE_ROCM",
    "ARROW_DEVICE_ROCM_HOST",
    "ARROW_DEVICE_EXT_DEV",
    "ARROW_DEVICE_CUDA_MANAGED",
    "ARROW_DEVICE_ONEAPI",
    "ARROW_DEVICE_WEBGPU",
    "ARROW_DEVICE_HEXAGON",
    "ARROW_DEVICE_MAIA",
    "ARROW_FLAG_DICTIONARY_ORDERED",
    "ARROW_FLAG_NULLABLE",
    "ARROW_FLAG_MAP_KEYS_SORTED",
];

/// Runs the C program and returns `key -> value` for `sizeof:S`, `alignof:S`, `offsetof:S.f`,
/// `sizeof:S.f` and `macro:M`.
fn c_layout() -> BTreeMap<String, u64> {
    let mut src = String::from(
        "#include <stddef.h>\n#include <stdio.h>\n#include <stdalign.h>\n\
         #include \"arrow_c_device.h\"\n\
         #include \"arrow_c_device.h\" /* twice: #pragma once / guards */\n\
         #define MEMBER_SIZE(S, f) sizeof(((struct S*)0)->f)\n\
         int main(void) {\n",
    );
    for (s, fields) in STRUCTS {
        src += &format!(
            "  printf(\"sizeof:{s} %zu\\n\", sizeof(struct {s}));\n\
             \x20 printf(\"alignof:{s} %zu\\n\", alignof(struct {s}));\n"
        );
        for f in *fields {
            src += &format!(
                "  printf(\"offsetof:{s}.{f} %zu\\n\", offsetof(struct {s}, {f}));\n\
                 \x20 printf(\"sizeof:{s}.{f} %zu\\n\", MEMBER_SIZE({s}, {f}));\n"
            );
        }
    }
    src += "  printf(\"sizeof:ArrowDeviceType %zu\\n\", sizeof(ArrowDeviceType));\n";
    src += "  printf(\"signed:ArrowDeviceType %d\\n\", (ArrowDeviceType)-1 < 0);\n";
    for m in MACROS {
        src += &format!("  printf(\"macro:{m} %lld\\n\", (long long)({m}));\n");
    }
    src += "  return 0;\n}\n";
    let exe = compile("layout", &src);
    let out = Command::new(&exe).output().expect("run the layout program");
    assert!(out.status.success(), "{} failed", exe.display());
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let (k, v) = l.split_once(' ').unwrap();
            (k.to_string(), v.parse().unwrap())
        })
        .collect()
}

/// `struct ArrowSchema` with public fields, to take offsets (arrow-rs's are private).
#[repr(C)]
#[allow(dead_code)]
struct SchemaMirror {
    format: *const c_char,
    name: *const c_char,
    metadata: *const c_char,
    flags: i64,
    n_children: i64,
    children: *mut *mut SchemaMirror,
    dictionary: *mut SchemaMirror,
    release: Option<unsafe extern "C" fn(*mut SchemaMirror)>,
    private_data: *mut c_void,
}

/// `struct ArrowArrayStream` with public fields, to take offsets (arrow-rs's are private).
#[repr(C)]
#[allow(dead_code)]
struct StreamMirror {
    get_schema: Option<unsafe extern "C" fn(*mut StreamMirror, *mut FFI_ArrowSchema) -> c_int>,
    get_next: Option<unsafe extern "C" fn(*mut StreamMirror, *mut FFI_ArrowArray) -> c_int>,
    get_last_error: Option<unsafe extern "C" fn(*mut StreamMirror) -> *const c_char>,
    release: Option<unsafe extern "C" fn(*mut StreamMirror)>,
    private_data: *mut c_void,
}

/// Size of a field's type, from a (never dereferenced) raw pointer to the struct.
macro_rules! field_size {
    ($t:ty, $f:ident) => {{
        fn size_of_pointee<T>(_: *const T) -> usize {
            size_of::<T>()
        }
        let u = std::mem::MaybeUninit::<$t>::uninit();
        // SAFETY: `addr_of!` on a field of the uninitialized value computes an address
        // without creating a reference or reading memory.
        size_of_pointee(unsafe { std::ptr::addr_of!((*u.as_ptr()).$f) })
    }};
}

/// The Rust side of every key `c_layout` prints.
fn rust_layout() -> BTreeMap<String, u64> {
    let mut m = BTreeMap::new();
    macro_rules! record {
        ($c:literal, $t:ty, [$($f:ident),* $(,)?]) => {{
            m.insert(format!("sizeof:{}", $c), size_of::<$t>() as u64);
            m.insert(format!("alignof:{}", $c), align_of::<$t>() as u64);
            $(
                m.insert(
                    format!("offsetof:{}.{}", $c, stringify!($f)),
                    offset_of!($t, $f) as u64,
                );
                m.insert(
                    format!("sizeof:{}.{}", $c, stringify!($f)),
                    field_size!($t, $f) as u64,
                );
            )*
        }};
    }
    record!(
        "ArrowSchema",
        SchemaMirror,
        [
            format,
            name,
            metadata,
            flags,
            n_children,
            children,
            dictionary,
            release,
            private_data
        ]
    );
    record!(
        "ArrowArray",
        ArrowArray,
        [
            length,
            null_count,
            offset,
            n_buffers,
            n_children,
            buffers,
            children,
            dictionary,
            release,
            private_data
        ]
    );
    record!(
        "ArrowDeviceArray",
        ArrowDeviceArray,
        [array, device_id, device_type, sync_event, reserved]
    );
    record!(
        "ArrowArrayStream",
        StreamMirror,
        [get_schema, get_next, get_last_error, release, private_data]
    );
    record!(
        "ArrowDeviceArrayStream",
        ArrowDeviceArrayStream,
        [
            device_type,
            get_schema,
            get_next,
            get_last_error,
            release,
            private_data
        ]
    );
    record!(
        "ArrowAsyncTask",
        ArrowAsyncTask,
        [extract_data, private_data]
    );
    record!(
        "ArrowAsyncProducer",
        ArrowAsyncProducer,
        [
            device_type,
            request,
            cancel,
            additional_metadata,
            private_data
        ]
    );
    record!(
        "ArrowAsyncDeviceStreamHandler",
        ArrowAsyncDeviceStreamHandler,
        [
            on_schema,
            on_next_task,
            on_error,
            release,
            producer,
            private_data
        ]
    );
    m.insert(
        "sizeof:ArrowDeviceType".into(),
        size_of::<ArrowDeviceType>() as u64,
    );
    m.insert("signed:ArrowDeviceType".into(), 1); // a transparent i32
    let devices = MACROS.iter().filter(|n| n.starts_with("ARROW_DEVICE_"));
    for (name, device) in devices.zip(ArrowDeviceType::ALL) {
        assert_eq!(
            format!("ARROW_DEVICE_{}", device.name().unwrap()),
            *name,
            "ArrowDeviceType::ALL is not in the header's order"
        );
        m.insert(format!("macro:{name}"), device.0 as u64);
    }
    m.insert("macro:ARROW_FLAG_DICTIONARY_ORDERED".into(), 1);
    m.insert("macro:ARROW_FLAG_NULLABLE".into(), 2);
    m.insert("macro:ARROW_FLAG_MAP_KEYS_SORTED".into(), 4);
    m
}

#[test]
// Compiles and runs a C program: Miri cannot spawn processes.
#[cfg_attr(miri, ignore)]
fn header_layout_matches_rust() {
    let c = c_layout();
    let rust = rust_layout();
    let mut mismatches = Vec::new();
    for (key, c_value) in &c {
        match rust.get(key) {
            Some(r) if r == c_value => {}
            Some(r) => mismatches.push(format!("{key}: C {c_value}, Rust {r}")),
            None => mismatches.push(format!("{key}: C {c_value}, not checked on the Rust side")),
        }
    }
    for key in rust.keys().filter(|k| !c.contains_key(*k)) {
        mismatches.push(format!("{key}: not printed by the C program"));
    }
    assert!(
        mismatches.is_empty(),
        "layout mismatches:\n{}",
        mismatches.join("\n")
    );
    // The figures the spec README states for x86-64 and aarch64 Linux.
    if cfg!(all(target_os = "linux", target_pointer_width = "64")) {
        assert_eq!(c["sizeof:ArrowArray"], 80);
        assert_eq!(c["sizeof:ArrowSchema"], 72);
        assert_eq!(c["sizeof:ArrowDeviceArray"], 128);
        assert_eq!(c["offsetof:ArrowDeviceArray.device_id"], 80);
        assert_eq!(c["offsetof:ArrowDeviceArray.device_type"], 88);
        assert_eq!(c["offsetof:ArrowDeviceArray.sync_event"], 96);
        assert_eq!(c["offsetof:ArrowDeviceArray.reserved"], 104);
        assert_eq!(c["sizeof:ArrowDeviceArrayStream"], 48);
    }
}

/// The mirrors stand for arrow-rs's types: same size and alignment, and reading through
/// them gives what arrow-rs's accessors give.
#[test]
fn mirrors_match_arrow_rs() {
    assert_eq!(size_of::<SchemaMirror>(), size_of::<FFI_ArrowSchema>());
    assert_eq!(align_of::<SchemaMirror>(), align_of::<FFI_ArrowSchema>());
    assert_eq!(size_of::<ArrowArray>(), size_of::<FFI_ArrowArray>());
    assert_eq!(align_of::<ArrowArray>(), align_of::<FFI_ArrowArray>());
    assert_eq!(size_of::<StreamMirror>(), size_of::<FFI_ArrowArrayStream>());
    assert_eq!(
        align_of::<StreamMirror>(),
        align_of::<FFI_ArrowArrayStream>()
    );

    let dict = DataType::Dictionary(Box::new(DataType::Int8), Box::new(DataType::Utf8));
    let schema = Schema::new(vec![
        Field::new("a", DataType::Int32, true),
        Field::new("b", dict, false),
    ]);
    let ffi = FFI_ArrowSchema::try_from(&schema).unwrap();
    // SAFETY: SchemaMirror has the layout of struct ArrowSchema, as does FFI_ArrowSchema
    // (sizes asserted above, offsets against the C header in the other test); we only read.
    let mirror = unsafe { &*(&ffi as *const FFI_ArrowSchema).cast::<SchemaMirror>() };
    assert_eq!(mirror.format, ffi.format().as_ptr().cast());
    assert_eq!(
        mirror.name,
        ffi.name().map_or(std::ptr::null(), |n| n.as_ptr().cast())
    );
    assert_eq!(mirror.n_children as usize, ffi.children().count());
    assert_eq!(mirror.flags, ffi.flags().unwrap().bits());
    assert!(mirror.release.is_some() && !mirror.private_data.is_null());
    assert!(mirror.dictionary.is_null());
    // SAFETY: `children` holds n_children (2) valid pointers while `ffi` lives.
    let child1 = unsafe { *mirror.children.add(1) };
    assert_eq!(
        child1.cast_const().cast(),
        ffi.child(1) as *const FFI_ArrowSchema
    );
    // SAFETY: child 1 is a valid dictionary-encoded schema owned by `ffi`.
    let child1 = unsafe { &*child1 };
    assert_eq!(child1.flags, 0, "b is not nullable");
    assert_eq!(
        child1.dictionary.cast_const().cast(),
        ffi.child(1).dictionary().unwrap() as *const FFI_ArrowSchema
    );
    // SAFETY: `metadata` is NULL or a valid C string here.
    assert!(mirror.metadata.is_null() || unsafe { CStr::from_ptr(mirror.metadata) }.is_empty());

    // Drive an arrow-rs stream through the mirror's callbacks.
    let batch = RecordBatch::try_new(
        Arc::new(Schema::new(vec![Field::new("x", DataType::Int32, false)])),
        vec![Arc::new(Int32Array::from(vec![1, 2, 3]))],
    )
    .unwrap();
    let reader = RecordBatchIterator::new(vec![Ok(batch.clone())], batch.schema());
    let mut stream = FFI_ArrowArrayStream::new(Box::new(reader));
    // SAFETY: StreamMirror has the layout of struct ArrowArrayStream (checked above and
    // against the header); the callbacks are arrow-rs's and get valid out structs.
    unsafe {
        let mirror = &mut *(&mut stream as *mut FFI_ArrowArrayStream).cast::<StreamMirror>();
        let mut schema_out = FFI_ArrowSchema::empty();
        assert_eq!((mirror.get_schema.unwrap())(mirror, &mut schema_out), 0);
        assert_eq!(Schema::try_from(&schema_out).unwrap(), *batch.schema());
        let mut array_out = FFI_ArrowArray::empty();
        assert_eq!((mirror.get_next.unwrap())(mirror, &mut array_out), 0);
        assert_eq!(array_out.len(), 3);
        let mut end = FFI_ArrowArray::empty();
        assert_eq!((mirror.get_next.unwrap())(mirror, &mut end), 0);
        assert!(end.is_released());
        let _ = (mirror.get_last_error.unwrap())(mirror);
        (mirror.release.unwrap())(mirror);
        assert!(mirror.release.is_none());
        assert!(mirror.private_data.is_null() || mirror.get_schema.is_none());
    }
}

/// The header uses the canonical include guards: with them all defined first, it declares
/// nothing, so the program's own (incompatible) definitions compile.
#[test]
// Compiles and runs a C program: Miri cannot spawn processes.
#[cfg_attr(miri, ignore)]
fn header_uses_canonical_guards() {
    let src = "#define ARROW_C_DATA_INTERFACE\n\
               #define ARROW_C_DEVICE_DATA_INTERFACE\n\
               #define ARROW_C_STREAM_INTERFACE\n\
               #define ARROW_C_DEVICE_STREAM_INTERFACE\n\
               #define ARROW_C_ASYNC_STREAM_INTERFACE\n\
               #include \"arrow_c_device.h\"\n\
               struct ArrowSchema { char x; };\n\
               struct ArrowArray { char x; };\n\
               typedef char ArrowDeviceType;\n\
               struct ArrowDeviceArray { char x; };\n\
               struct ArrowArrayStream { char x; };\n\
               struct ArrowDeviceArrayStream { char x; };\n\
               struct ArrowAsyncTask { char x; };\n\
               struct ArrowAsyncProducer { char x; };\n\
               struct ArrowAsyncDeviceStreamHandler { char x; };\n\
               #ifdef ARROW_DEVICE_CPU\n#error ARROW_DEVICE_CPU outside its guard\n#endif\n\
               int main(void) { return (int)sizeof(struct ArrowDeviceArray) - 1; }\n";
    let exe = compile("guards", src);
    let status = Command::new(&exe).status().unwrap();
    assert!(status.success());

    // And each guard covers the structs the canonical abi.h puts under it.
    let text = std::fs::read_to_string(header()).unwrap();
    for (guard, structs) in [
        ("ARROW_C_DATA_INTERFACE", &["ArrowSchema", "ArrowArray"][..]),
        ("ARROW_C_DEVICE_DATA_INTERFACE", &["ArrowDeviceArray"][..]),
        ("ARROW_C_STREAM_INTERFACE", &["ArrowArrayStream"][..]),
        (
            "ARROW_C_DEVICE_STREAM_INTERFACE",
            &["ArrowDeviceArrayStream"][..],
        ),
        (
            "ARROW_C_ASYNC_STREAM_INTERFACE",
            &[
                "ArrowAsyncTask",
                "ArrowAsyncProducer",
                "ArrowAsyncDeviceStreamHandler",
            ][..],
        ),
    ] {
        let start = text
            .find(&format!("#ifndef {guard}\n#define {guard}\n"))
            .unwrap_or_else(|| panic!("no #ifndef/#define {guard}"));
        let len = text[start..]
            .find(&format!("#endif  // {guard}"))
            .unwrap_or_else(|| panic!("no #endif for {guard}"));
        let section = &text[start..start + len];
        for s in structs {
            assert!(
                section.contains(&format!("struct {s} {{")),
                "struct {s} is not under {guard}"
            );
        }
        if guard == "ARROW_C_DEVICE_DATA_INTERFACE" {
            assert!(section.contains("typedef int32_t ArrowDeviceType;"));
            for m in MACROS.iter().filter(|m| m.starts_with("ARROW_DEVICE_")) {
                assert!(section.contains(&format!("#define {m} ")), "{m}");
            }
        }
    }
}
