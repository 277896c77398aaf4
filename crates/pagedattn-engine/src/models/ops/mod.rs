//! The CPU operations of a transformer forward pass other than attention: [`Linear`]
//! (exact f32 or fast int8 products over GGUF weights, with or without a bias), [`Embedding`]
//! lookup, the norms ([`Norm`]: [`rms_norm`], [`layer_norm`]), [`Rope`], the MLP's
//! [`Activation`]s ([`gated`], [`swiglu`], [`activate`]), [`soft_cap`] and [`add_assign`] (sampling is the serving core's:
//! [`crate::serving::sample`]).
//!
//! Every op works on a batch of `t` rows stored row-major in caller-owned `f32` slices and
//! allocates nothing in its hot path (the fast [`Linear`]'s int8 activations live in a
//! per-thread buffer that grows once).
//!
//! ## Instruction sets
//! Kernels are chosen at run time: AVX512-VNNI (`vpdpbusd`), AVX2 (`vpmaddubsw`), or portable
//! scalar code (every other CPU, aarch64 included, for the integer dots). The f32 kernels run
//! on `pagedattn`'s [`Isa`] vectors (AVX-512, AVX2, NEON, scalar). `PAGEDATTN_ISA` (see
//! [`pagedattn::cpu::ISA_ENV`]) forces an instruction set as it does for attention;
//! [`Linear::forward_isa`] forces one per call (the tests run every path this way).

mod embedding;
mod gemv;
mod linear;
mod norm;
mod qdot;
mod quant;
mod rope;

pub use embedding::Embedding;
pub use linear::{Linear, Precision, GEMM_MIN_ROWS};
pub use norm::{
    activate, add_assign, gated, layer_norm, rms_norm, soft_cap, swiglu, Activation, Norm,
};
pub use pagedattn::cpu::Isa;
pub use quant::{dequantize_row, quantize_row_q8, ACT_BLOCK};
pub use rope::{Rope, RopeStyle};

use crate::models::weights::WeightType;

/// What an op refuses: sizes that do not match, or bytes that do not hold the tensor.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum OpsError {
    /// A dimension is zero.
    #[error("{what}: a dimension is zero")]
    Empty {
        /// The argument.
        what: &'static str,
    },
    /// A row length is not a whole number of the type's blocks.
    #[error("{what}: {len} is not a multiple of {ty:?}'s block of {block} elements")]
    NotBlockMultiple {
        /// The argument.
        what: &'static str,
        /// The weight type.
        ty: WeightType,
        /// The row length.
        len: usize,
        /// The block length.
        block: usize,
    },
    /// A buffer's length is not the one the dimensions need.
    #[error("{what}: expected {expected} elements, got {got}")]
    Length {
        /// The argument.
        what: &'static str,
        /// What the dimensions need.
        expected: usize,
        /// What was given.
        got: usize,
    },
    /// A token id past the vocabulary.
    #[error("token {token} is outside the vocabulary of {vocab}")]
    Token {
        /// The id.
        token: u32,
        /// The vocabulary size.
        vocab: usize,
    },
    /// A bad parameter (a rope dimension).
    #[error("{what}: {why}")]
    Param {
        /// The parameter.
        what: &'static str,
        /// Why it is refused.
        why: String,
    },
    /// `PAGEDATTN_ISA` names an unknown instruction set or one this CPU lacks.
    #[error("instruction set: {0}")]
    Isa(String),
}

/// Results of the ops.
pub type Result<T> = std::result::Result<T, OpsError>;

/// Checks that `got == expected`.
pub(crate) fn check_len(what: &'static str, expected: usize, got: usize) -> Result<()> {
    if expected == got {
        Ok(())
    } else {
        Err(OpsError::Length {
            what,
            expected,
            got,
        })
    }
}

/// The instruction set of the ops: `PAGEDATTN_ISA` if set, else the best of this CPU.
pub fn isa_from_env() -> Result<Isa> {
    Isa::from_env().map_err(|e| OpsError::Isa(e.to_string()))
}
