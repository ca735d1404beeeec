//! The element types of Megatron's indexed datasets, by the codes its `.idx` files store.

/// The dtype of the tokens in a `.bin` file, stored as a one-byte code in the `.idx` header
/// (Megatron-Core's `indexed_dataset.DType`, whose codes follow NumPy's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// Code 1 (`numpy.uint8`): a vocabulary of at most 256 tokens.
    U8,
    /// Code 2 (`numpy.int8`).
    I8,
    /// Code 3 (`numpy.int16`).
    I16,
    /// Code 4 (`numpy.int32`): Megatron's choice for vocabularies of 65 500 tokens or more.
    I32,
    /// Code 5 (`numpy.int64`).
    I64,
    /// Code 6 (`numpy.float64`): valid in the format, but holds no token ids.
    F64,
    /// Code 7 (`numpy.float32`): valid in the format, but holds no token ids.
    F32,
    /// Code 8 (`numpy.uint16`): Megatron's choice for vocabularies below 65 500 tokens.
    U16,
}

impl DType {
    /// The code stored in the `.idx` header.
    pub fn code(self) -> u8 {
        match self {
            DType::U8 => 1,
            DType::I8 => 2,
            DType::I16 => 3,
            DType::I32 => 4,
            DType::I64 => 5,
            DType::F64 => 6,
            DType::F32 => 7,
            DType::U16 => 8,
        }
    }

    /// The dtype of a header code; `None` for a code Megatron does not define.
    pub fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            1 => DType::U8,
            2 => DType::I8,
            3 => DType::I16,
            4 => DType::I32,
            5 => DType::I64,
            6 => DType::F64,
            7 => DType::F32,
            8 => DType::U16,
            _ => return None,
        })
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::U8 | DType::I8 => 1,
            DType::I16 | DType::U16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }

    /// Megatron's dtype for a vocabulary of `vocab_size` tokens (`DType.optimal_dtype`): `U16`
    /// below 65 500 tokens, else `I32`.
    pub fn optimal(vocab_size: usize) -> Self {
        if vocab_size < 65_500 {
            DType::U16
        } else {
            DType::I32
        }
    }

    /// Whether the dtype holds token ids (the integer dtypes).
    pub fn is_integer(self) -> bool {
        !matches!(self, DType::F32 | DType::F64)
    }

    /// The range of token ids the dtype holds; `None` for the floating-point dtypes.
    pub fn token_range(self) -> Option<core::ops::RangeInclusive<i64>> {
        Some(match self {
            DType::U8 => 0..=u8::MAX as i64,
            DType::I8 => i8::MIN as i64..=i8::MAX as i64,
            DType::I16 => i16::MIN as i64..=i16::MAX as i64,
            DType::U16 => 0..=u16::MAX as i64,
            DType::I32 => i32::MIN as i64..=i32::MAX as i64,
            DType::I64 => i64::MIN..=i64::MAX,
            DType::F32 | DType::F64 => return None,
        })
    }

    /// What to do about a token the dtype cannot hold.
    pub(crate) fn widening_hint(self) -> &'static str {
        if self.is_integer() {
            "choose a wider dtype (DType::optimal(vocab_size) fits the vocabulary)"
        } else {
            "token ids need an integer dtype"
        }
    }

    /// Appends `token` to `out` in little-endian bytes; `false` (nothing appended) if the
    /// dtype cannot hold it.
    pub(crate) fn encode(self, token: i64, out: &mut Vec<u8>) -> bool {
        if !self.token_range().is_some_and(|r| r.contains(&token)) {
            return false;
        }
        match self {
            DType::U8 => out.push(token as u8),
            DType::I8 => out.push(token as i8 as u8),
            DType::I16 => out.extend_from_slice(&(token as i16).to_le_bytes()),
            DType::U16 => out.extend_from_slice(&(token as u16).to_le_bytes()),
            DType::I32 => out.extend_from_slice(&(token as i32).to_le_bytes()),
            DType::I64 => out.extend_from_slice(&token.to_le_bytes()),
            DType::F32 | DType::F64 => unreachable!("float dtypes have no token range"),
        }
        true
    }

    /// Decodes little-endian `bytes` (a whole number of elements) into token ids, appended to
    /// `out`. The caller checks that the dtype is an integer dtype.
    pub(crate) fn decode(self, bytes: &[u8], out: &mut Vec<i64>) {
        match self {
            DType::U8 => out.extend(bytes.iter().map(|&b| b as i64)),
            DType::I8 => out.extend(bytes.iter().map(|&b| b as i8 as i64)),
            DType::I16 => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|c| i16::from_le_bytes([c[0], c[1]]) as i64),
            ),
            DType::U16 => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|c| u16::from_le_bytes([c[0], c[1]]) as i64),
            ),
            DType::I32 => out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64),
            ),
            DType::I64 => out.extend(
                bytes
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]])),
            ),
            DType::F32 | DType::F64 => {}
        }
    }
}

impl core::fmt::Display for DType {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(match self {
            DType::U8 => "u8",
            DType::I8 => "i8",
            DType::I16 => "i16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::F64 => "f64",
            DType::F32 => "f32",
            DType::U16 => "u16",
        })
    }
}
