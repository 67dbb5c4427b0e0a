//! Dictionaries: signed indices (`ExportOptions::signed_dictionary_indices`, unsigned
//! ones relabelled when every index fits), and the dictionary's values converted as any
//! column.

use std::sync::Arc;

use arrow_schema::{DataType, Field, FieldRef};
use devarrow_abi::export_tree::ArrayNode;
use devarrow_abi::{Error, Result};

use super::{Converter, Step};

impl<'a> Converter<'a> {
    /// A dictionary column of `data_type` (indices `key`, values `value`): its index type
    /// ([`Converter::dictionary_key`]) and its values converted.
    pub(super) fn dictionary(
        &mut self,
        path: &str,
        data_type: &DataType,
        key: &DataType,
        value: &DataType,
        mut node: ArrayNode,
    ) -> Result<Step<'a, (DataType, ArrayNode)>> {
        let key = self.dictionary_key(path, data_type, key, &node)?;
        let value_field: FieldRef = Arc::new(Field::new("values", value.clone(), true));
        let dictionary = node.dictionary.take().ok_or_else(|| {
            Error::InvalidArgument(format!("{path}: a dictionary array without its dictionary"))
        })?;
        Ok(self
            .array(&format!("{path}.values"), &value_field, *dictionary)?
            .map(move |(value_field, dictionary)| {
                node.dictionary = Some(Box::new(dictionary));
                let value = value_field.data_type().clone();
                (DataType::Dictionary(Box::new(key), Box::new(value)), node)
            }))
    }

    /// The index type of a dictionary: unsigned relabelled as signed when every index of
    /// the dictionary stays non-negative.
    fn dictionary_key(
        &self,
        path: &str,
        data_type: &DataType,
        key: &DataType,
        node: &ArrayNode,
    ) -> Result<DataType> {
        if !self.options.signed_dictionary_indices {
            return Ok(key.clone());
        }
        let (signed, max) = match key {
            DataType::UInt8 => (DataType::Int8, i8::MAX as i64),
            DataType::UInt16 => (DataType::Int16, i16::MAX as i64),
            DataType::UInt32 => (DataType::Int32, i32::MAX as i64),
            DataType::UInt64 => (DataType::Int64, i64::MAX),
            other => return Ok(other.clone()),
        };
        let keys = node.dictionary.as_ref().map_or(0, |d| d.length);
        if keys - 1 > max {
            return Err(self.refuse(
                path,
                data_type,
                format!("{keys} dictionary values are too many for {signed} indices (libcudf refuses unsigned ones)"),
            ));
        }
        Ok(signed)
    }
}
