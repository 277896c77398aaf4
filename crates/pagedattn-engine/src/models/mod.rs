//! The models the engine serves, each a [`Model`](crate::serving::model::Model): Llama on
//! the host ([`llama`]) and on the GPU ([`gpu_llama`]), the synthetic models
//! ([`synthetic`]: decoder, and through [`encdec`] encoder-only and encoder-decoder), the
//! shared ops they are built of ([`ops`]), and the readers of what models come in:
//! [`gguf`] files with their [`weights`] types, the [`tokenizer`] and [`chat`] templates.

pub mod chat;
pub mod encdec;
pub mod gguf;
#[cfg(feature = "cuda")]
pub mod gpu_llama;
pub mod llama;
pub mod ops;
pub mod synthetic;
pub mod tokenizer;
pub mod weights;
