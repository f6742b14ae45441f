//! Typed reads of `config.json` fields, with errors that name the field and the value.

use serde_json::Value;

use crate::ModelError;

/// A view of a `config.json` object.
pub struct Config<'a> {
    value: &'a Value,
}

impl<'a> Config<'a> {
    /// Wraps a parsed config.
    pub fn new(value: &'a Value) -> Config<'a> {
        Config { value }
    }

    /// The raw value of `field`, if present and not null.
    pub fn get(&self, field: &str) -> Option<&'a Value> {
        self.value.get(field).filter(|v| !v.is_null())
    }

    fn invalid(field: &str, value: &Value, expected: &str) -> ModelError {
        ModelError::Config {
            field: field.to_string(),
            message: format!("is {value}, expected {expected}"),
        }
    }

    /// A required positive integer.
    pub fn usize(&self, field: &str) -> Result<usize, ModelError> {
        self.opt_usize(field)?.ok_or_else(|| ModelError::Config {
            field: field.to_string(),
            message: "is missing".into(),
        })
    }

    /// An optional positive integer.
    pub fn opt_usize(&self, field: &str) -> Result<Option<usize>, ModelError> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) if n > 0 => Ok(Some(n as usize)),
                _ => Err(Self::invalid(field, v, "a positive integer")),
            },
        }
    }

    /// A positive integer that is `default` where the field is missing and none where it is null
    /// (as transformers reads a field whose default is not null).
    pub fn usize_or_null(&self, field: &str, default: usize) -> Result<Option<usize>, ModelError> {
        match self.value.get(field) {
            None => Ok(Some(default)),
            Some(_) => self.opt_usize(field),
        }
    }

    /// A non-negative integer with a default.
    pub fn count_or(&self, field: &str, default: usize) -> Result<usize, ModelError> {
        match self.get(field) {
            None => Ok(default),
            Some(v) => v
                .as_u64()
                .map(|n| n as usize)
                .ok_or_else(|| Self::invalid(field, v, "a non-negative integer")),
        }
    }

    /// An optional number.
    pub fn opt_f64(&self, field: &str) -> Result<Option<f64>, ModelError> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| Self::invalid(field, v, "a number")),
        }
    }

    /// A number with a default.
    pub fn f64_or(&self, field: &str, default: f64) -> Result<f64, ModelError> {
        Ok(self.opt_f64(field)?.unwrap_or(default))
    }

    /// An optional string.
    pub fn opt_str(&self, field: &str) -> Result<Option<&'a str>, ModelError> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| Self::invalid(field, v, "a string")),
        }
    }

    /// A boolean with a default.
    pub fn bool_or(&self, field: &str, default: bool) -> Result<bool, ModelError> {
        match self.get(field) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| Self::invalid(field, v, "true or false")),
        }
    }

    /// An error saying that `field` has a value kiln does not support.
    pub fn unsupported(&self, field: &str, what: &str) -> ModelError {
        let value = self.get(field).cloned().unwrap_or(Value::Null);
        ModelError::Config {
            field: field.to_string(),
            message: format!("= {value} is not supported ({what})"),
        }
    }
}
