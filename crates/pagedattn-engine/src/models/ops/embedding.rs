//! Embedding lookup over a (possibly quantized) `[vocab, hidden]` table.

use super::linear::{Linear, Precision};
use super::quant::dequantize_row;
use super::{check_len, OpsError, Result};
use crate::models::weights::WeightType;

/// A `[vocab, hidden]` table kept as stored; rows are dequantized on lookup (as the exact
/// [`Linear`] dequantizes, so a tied LM head sees the same values).
#[derive(Clone, Debug)]
pub struct Embedding {
    ty: WeightType,
    vocab: usize,
    hidden: usize,
    row_bytes: usize,
    bytes: Vec<u8>,
}

impl Embedding {
    /// A table of `vocab` rows of `hidden` elements stored as `ty` (GGUF's layout).
    ///
    /// # Errors
    /// A zero dimension, `hidden` not a whole number of blocks, or `bytes` not the table's
    /// size.
    pub fn from_gguf(bytes: &[u8], ty: WeightType, vocab: usize, hidden: usize) -> Result<Self> {
        if vocab == 0 || hidden == 0 {
            return Err(OpsError::Empty { what: "Embedding" });
        }
        let row_bytes = ty.row_bytes(hidden).ok_or(OpsError::NotBlockMultiple {
            what: "Embedding hidden",
            ty,
            len: hidden,
            block: ty.block_len(),
        })?;
        check_len("Embedding bytes", row_bytes * vocab, bytes.len())?;
        Ok(Embedding {
            ty,
            vocab,
            hidden,
            row_bytes,
            bytes: bytes.to_vec(),
        })
    }

    /// A table from f32 values (`[vocab, hidden]`).
    ///
    /// # Errors
    /// A zero dimension or `values` not `vocab * hidden` long.
    pub fn from_f32(values: &[f32], vocab: usize, hidden: usize) -> Result<Self> {
        check_len("Embedding values", vocab * hidden, values.len())?;
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Self::from_gguf(&bytes, WeightType::F32, vocab, hidden)
    }

    /// Rows of the table.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Elements of a row.
    pub fn hidden(&self) -> usize {
        self.hidden
    }

    /// The storage type.
    pub fn weight_type(&self) -> WeightType {
        self.ty
    }

    /// The stored bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// Writes row `tokens[i]` into row `i` of `out` (`[tokens.len(), hidden]`).
    ///
    /// # Errors
    /// A token past the vocabulary, or `out` of the wrong length.
    pub fn lookup(&self, tokens: &[u32], out: &mut [f32]) -> Result<()> {
        check_len("Embedding out", tokens.len() * self.hidden, out.len())?;
        for (&tok, o) in tokens.iter().zip(out.chunks_exact_mut(self.hidden)) {
            if tok as usize >= self.vocab {
                return Err(OpsError::Token {
                    token: tok,
                    vocab: self.vocab,
                });
            }
            let b = &self.bytes[tok as usize * self.row_bytes..][..self.row_bytes];
            dequantize_row(self.ty, b, o)?;
        }
        Ok(())
    }

    /// The table as a [`Linear`] `[vocab, hidden]`: the tied LM head.
    ///
    /// # Errors
    /// As [`Linear::from_gguf`].
    pub fn to_linear(&self, precision: Precision) -> Result<Linear> {
        Linear::from_gguf(&self.bytes, self.ty, self.vocab, self.hidden, precision)
    }
}
