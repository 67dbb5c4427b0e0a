//! Bytes off the wire into `DeviceExecCodec::try_decode`: a node or a typed error,
//! never a panic (`cargo +nightly fuzz run codec_decode` from integrations/datafusion/fuzz).
#![no_main]

#[path = "../../tests/common/codec_fuzz_body.rs"]
mod body;

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    static DECODER: OnceLock<body::Decoder> = OnceLock::new();
    DECODER.get_or_init(body::Decoder::default).decode(data);
});
