//! Symbolic dimensions: integer polynomials over named symbols (`B`, `S`, `T`).
//!
//! A dimension is kept in a canonical form (a sum of monomials with integer coefficients), so that
//! two dimensions that are algebraically equal compare equal: `B*S*64` and `(B*S)*64` are the same
//! `Dim`. That is what reshape validation needs. A bucket is a substitution of symbols by constants;
//! after it, every dimension is a constant.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The batch size symbol.
pub const BATCH: &str = "B";
/// The sequence length symbol (prefill / encode).
pub const SEQ: &str = "S";
/// The context (KV cache) length symbol.
pub const CONTEXT: &str = "T";

/// A monomial: the sorted multiset of symbols multiplied together (empty = the constant 1).
type Monomial = Vec<String>;

/// A tensor dimension: a constant, a symbol, or a polynomial over symbols.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Dim {
    /// Monomial -> non-zero coefficient.
    terms: BTreeMap<Monomial, i64>,
}

impl Dim {
    /// A constant dimension.
    pub fn constant(value: i64) -> Dim {
        let mut terms = BTreeMap::new();
        if value != 0 {
            terms.insert(Vec::new(), value);
        }
        Dim { terms }
    }

    /// A symbolic dimension named `name`.
    pub fn sym(name: &str) -> Dim {
        let mut terms = BTreeMap::new();
        terms.insert(vec![name.to_string()], 1);
        Dim { terms }
    }

    /// The value of a constant dimension, `None` when it contains a symbol.
    pub fn as_const(&self) -> Option<i64> {
        match self.terms.len() {
            0 => Some(0),
            1 => self.terms.get(&Vec::new()).copied(),
            _ => None,
        }
    }

    /// True when the dimension has no symbol.
    pub fn is_const(&self) -> bool {
        self.as_const().is_some()
    }

    /// The symbols this dimension mentions.
    pub fn symbols(&self) -> impl Iterator<Item = &str> {
        self.terms.keys().flatten().map(String::as_str)
    }

    /// Replaces symbols by the values in `bindings`; symbols without a binding stay symbolic.
    pub fn substitute(&self, bindings: &BTreeMap<String, i64>) -> Dim {
        let mut out = Dim::constant(0);
        for (mono, coeff) in &self.terms {
            let mut term = Dim::constant(*coeff);
            for s in mono {
                let factor = match bindings.get(s) {
                    Some(v) => Dim::constant(*v),
                    None => Dim::sym(s),
                };
                term = term * factor;
            }
            out = out + term;
        }
        out
    }

    /// Evaluates the dimension under `bindings`; `None` if a symbol is unbound.
    pub fn eval(&self, bindings: &BTreeMap<String, i64>) -> Option<i64> {
        self.substitute(bindings).as_const()
    }

    /// Parses the text form written by `Display` (`64`, `S`, `B*S`, `S+1`, `2*S-1`).
    pub fn parse(text: &str) -> Result<Dim, String> {
        let text = text.trim();
        if text.is_empty() {
            return Err("empty dimension".into());
        }
        let mut out = Dim::constant(0);
        // Split on + and - at the top level (no parentheses in the canonical form).
        let mut sign = 1i64;
        let mut start = 0usize;
        let bytes = text.as_bytes();
        let mut pieces = Vec::new();
        for (i, &c) in bytes.iter().enumerate() {
            if (c == b'+' || c == b'-') && i > 0 {
                pieces.push((sign, &text[start..i]));
                sign = if c == b'-' { -1 } else { 1 };
                start = i + 1;
            } else if c == b'-' && i == 0 {
                sign = -1;
                start = 1;
            }
        }
        pieces.push((sign, &text[start..]));
        for (sign, piece) in pieces {
            let mut term = Dim::constant(sign);
            for factor in piece.split('*') {
                let factor = factor.trim();
                if factor.is_empty() {
                    return Err(format!("malformed dimension `{text}`"));
                }
                if let Ok(v) = factor.parse::<i64>() {
                    term = term * Dim::constant(v);
                } else if factor
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_')
                    && factor
                        .chars()
                        .next()
                        .is_some_and(|c| c.is_ascii_alphabetic())
                {
                    term = term * Dim::sym(factor);
                } else {
                    return Err(format!("malformed dimension `{text}`"));
                }
            }
            out = out + term;
        }
        Ok(out)
    }

    fn from_terms(terms: BTreeMap<Monomial, i64>) -> Dim {
        Dim {
            terms: terms.into_iter().filter(|(_, c)| *c != 0).collect(),
        }
    }
}

impl From<i64> for Dim {
    fn from(v: i64) -> Dim {
        Dim::constant(v)
    }
}

impl From<usize> for Dim {
    fn from(v: usize) -> Dim {
        Dim::constant(v as i64)
    }
}

impl std::ops::Add for Dim {
    type Output = Dim;
    fn add(self, rhs: Dim) -> Dim {
        let mut terms = self.terms;
        for (m, c) in rhs.terms {
            *terms.entry(m).or_insert(0) += c;
        }
        Dim::from_terms(terms)
    }
}

impl std::ops::Sub for Dim {
    type Output = Dim;
    fn sub(self, rhs: Dim) -> Dim {
        self + rhs * Dim::constant(-1)
    }
}

impl std::ops::Mul for Dim {
    type Output = Dim;
    fn mul(self, rhs: Dim) -> Dim {
        let mut terms = BTreeMap::new();
        for (ma, ca) in &self.terms {
            for (mb, cb) in &rhs.terms {
                let mut m: Monomial = ma.iter().chain(mb.iter()).cloned().collect();
                m.sort();
                *terms.entry(m).or_insert(0) += ca * cb;
            }
        }
        Dim::from_terms(terms)
    }
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.terms.is_empty() {
            return write!(f, "0");
        }
        // Highest-degree terms first, the constant last: `B*S+1`.
        let mut terms: Vec<_> = self.terms.iter().collect();
        terms.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.0.cmp(b.0)));
        for (i, (mono, coeff)) in terms.into_iter().enumerate() {
            let mut coeff = *coeff;
            if i > 0 {
                write!(f, "{}", if coeff < 0 { "-" } else { "+" })?;
                coeff = coeff.abs();
            } else if coeff < 0 && !mono.is_empty() {
                write!(f, "-")?;
                coeff = -coeff;
            }
            if mono.is_empty() {
                write!(f, "{coeff}")?;
            } else {
                if coeff != 1 {
                    write!(f, "{coeff}*")?;
                }
                write!(f, "{}", mono.join("*"))?;
            }
        }
        Ok(())
    }
}

impl fmt::Debug for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// Constants serialise as integers, everything else as its text form (`"B*S"`).
impl Serialize for Dim {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self.as_const() {
            Some(v) => serializer.serialize_i64(v),
            None => serializer.serialize_str(&self.to_string()),
        }
    }
}

impl<'de> Deserialize<'de> for Dim {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Dim, D::Error> {
        struct DimVisitor;
        impl Visitor<'_> for DimVisitor {
            type Value = Dim;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                write!(f, "an integer or a dimension expression such as \"B*S\"")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Dim, E> {
                Ok(Dim::constant(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Dim, E> {
                i64::try_from(v)
                    .map(Dim::constant)
                    .map_err(|_| E::custom("dimension too large"))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Dim, E> {
                Dim::parse(v).map_err(E::custom)
            }
        }
        deserializer.deserialize_any(DimVisitor)
    }
}

/// A tensor shape: one `Dim` per axis, outermost first.
pub type Shape = Vec<Dim>;

/// Formats a shape as `[B, S, 64]`.
pub fn shape_to_string(shape: &[Dim]) -> String {
    let parts: Vec<String> = shape.iter().map(Dim::to_string).collect();
    format!("[{}]", parts.join(", "))
}

/// The number of elements of a shape, as a `Dim`.
pub fn numel(shape: &[Dim]) -> Dim {
    shape
        .iter()
        .cloned()
        .fold(Dim::constant(1), |acc, d| acc * d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_products_compare_equal() {
        let b = Dim::sym(BATCH);
        let s = Dim::sym(SEQ);
        let lhs = b.clone() * s.clone() * Dim::constant(64);
        let rhs = Dim::constant(64) * (s * b);
        assert_eq!(lhs, rhs);
    }

    #[test]
    fn text_form_round_trips() {
        for text in ["64", "S", "B*S", "S+1", "2*S-1", "B*S*T-3", "-S", "0"] {
            let d = Dim::parse(text).unwrap();
            assert_eq!(Dim::parse(&d.to_string()).unwrap(), d, "{text}");
        }
        assert_eq!(Dim::parse("S+1").unwrap().to_string(), "S+1");
        assert!(Dim::parse("S+").is_err());
        assert!(Dim::parse("3x").is_err());
    }

    #[test]
    fn substitution_makes_constants() {
        let d = Dim::parse("2*B*S+S-1").unwrap();
        let bindings = BTreeMap::from([("B".to_string(), 3), ("S".to_string(), 5)]);
        assert_eq!(d.eval(&bindings), Some(2 * 3 * 5 + 5 - 1));
        let partial = BTreeMap::from([("S".to_string(), 5)]);
        assert_eq!(d.substitute(&partial).to_string(), "10*B+4");
    }
}
