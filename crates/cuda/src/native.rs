//! [`DeviceNative`]: the Rust element types of fixed-width Arrow arrays in device memory,
//! and which Arrow data types each one fits.

use arrow_schema::{DataType, IntervalUnit};
use cudarc::driver::DeviceRepr;

mod sealed {
    pub trait Sealed {}
}

/// A Rust element type of a fixed-width Arrow array (the values of `Int32`, `Float64`,
/// `Timestamp`, ...), as cudarc slices and views of device memory hold them.
///
/// Implemented for `i8`, `i16`, `i32`, `i64`, `i128`, `u8`, `u16`, `u32`, `u64`, `f32`
/// and `f64` only (sealed): plain numbers, for which **every** bit pattern is a valid
/// value, so that device bytes of any content (a foreign producer's, a kernel's) may be
/// copied into host values of the type.
pub trait DeviceNative: DeviceRepr + Copy + Send + Sync + sealed::Sealed + 'static {
    /// The type's name, for messages (`"i32"`).
    const NAME: &'static str;

    /// Whether the values buffer of an array of `data_type` holds elements of this type
    /// (same width and meaning): `i32` fits `Int32`, `Date32`, `Time32` and
    /// `Interval(YearMonth)`; `i64` fits `Int64`, `Date64`, `Time64`, `Timestamp` and
    /// `Duration`; `i128` fits `Decimal128`; each other integer its own Arrow integer
    /// type, `f32` and `f64` `Float32` and `Float64`. A dictionary fits its key type.
    fn fits(data_type: &DataType) -> bool;
}

macro_rules! native {
    ($t:ty, $name:literal, $pattern:pat) => {
        impl sealed::Sealed for $t {}
        impl DeviceNative for $t {
            const NAME: &'static str = $name;
            fn fits(data_type: &DataType) -> bool {
                match data_type {
                    DataType::Dictionary(key, _) => Self::fits(key),
                    $pattern => true,
                    _ => false,
                }
            }
        }
    };
}

native!(i8, "i8", DataType::Int8);
native!(i16, "i16", DataType::Int16);
native!(
    i32,
    "i32",
    DataType::Int32
        | DataType::Date32
        | DataType::Time32(_)
        | DataType::Interval(IntervalUnit::YearMonth)
);
native!(
    i64,
    "i64",
    DataType::Int64
        | DataType::Date64
        | DataType::Time64(_)
        | DataType::Timestamp(_, _)
        | DataType::Duration(_)
);
native!(i128, "i128", DataType::Decimal128(_, _));
native!(u8, "u8", DataType::UInt8);
native!(u16, "u16", DataType::UInt16);
native!(u32, "u32", DataType::UInt32);
native!(u64, "u64", DataType::UInt64);
native!(f32, "f32", DataType::Float32);
native!(f64, "f64", DataType::Float64);

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_schema::TimeUnit;

    /// Every fit has the width arrow-rs gives the type.
    #[test]
    fn fits_have_the_arrow_width() {
        fn check<T: DeviceNative>(types: &[DataType]) {
            for dt in types {
                assert_eq!(
                    T::fits(dt),
                    dt.primitive_width() == Some(size_of::<T>()) && {
                        // same width is not enough: floats and integers differ
                        let float = matches!(dt, DataType::Float32 | DataType::Float64);
                        let float_t = matches!(T::NAME, "f32" | "f64");
                        let unsigned = matches!(
                            dt,
                            DataType::UInt8
                                | DataType::UInt16
                                | DataType::UInt32
                                | DataType::UInt64
                        );
                        let unsigned_t = T::NAME.starts_with('u');
                        float == float_t && unsigned == unsigned_t
                    },
                    "{} vs {dt}",
                    T::NAME
                );
            }
        }
        let types = [
            DataType::Int8,
            DataType::Int16,
            DataType::Int32,
            DataType::Int64,
            DataType::UInt8,
            DataType::UInt16,
            DataType::UInt32,
            DataType::UInt64,
            DataType::Float32,
            DataType::Float64,
            DataType::Date32,
            DataType::Date64,
            DataType::Time32(TimeUnit::Second),
            DataType::Time64(TimeUnit::Nanosecond),
            DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
            DataType::Duration(TimeUnit::Millisecond),
            DataType::Decimal128(10, 2),
            DataType::Interval(IntervalUnit::YearMonth),
        ];
        check::<i8>(&types);
        check::<i16>(&types);
        check::<i32>(&types);
        check::<i64>(&types);
        check::<i128>(&types);
        check::<u8>(&types);
        check::<u16>(&types);
        check::<u32>(&types);
        check::<u64>(&types);
        check::<f32>(&types);
        check::<f64>(&types);
        assert!(!i32::fits(&DataType::Utf8));
        assert!(!u8::fits(&DataType::Boolean));
        assert!(!i64::fits(&DataType::Interval(IntervalUnit::DayTime)));
        assert!(i32::fits(&DataType::Dictionary(
            Box::new(DataType::Int32),
            Box::new(DataType::Utf8)
        )));
    }
}
