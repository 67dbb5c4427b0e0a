//! C-ABI entry points used by the pyarrow interoperability tests.
