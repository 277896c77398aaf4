//! The models the engine serves, each a [`Model`](crate::serving::model::Model): Llama on
//! the host ([`llama`]) and on the GPU ([`gpu_llama`]), the synthetic models
//! ([`synthetic`]: decoder, and through [`encdec`] encoder-only and encoder-decoder), the
//! shared ops they are built of ([`ops`]), and the readers of what models come in:
//! [`gguf`] files with their [`weights`] types, Hugging Face folders ([`hf`]), the
//! [`tokenizer`] and [`chat`] templates. [`tensor_parallel`] shards a model over GPUs, whose
//! collectives run through [`nccl`].

pub mod blocks;
pub mod chat;
pub mod encdec;
pub mod families;
pub mod gguf;
pub mod gguf_writer;
#[cfg(feature = "cuda")]
pub mod gpu_llama;
pub mod hf;
pub mod llama;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod ops;
pub mod synthetic;
pub mod tensor_parallel;
pub mod tokenizer;
pub mod weights;

/// Checks a layer's output, the residual stream `x` of `hidden`-wide rows, for a NaN or an
/// infinity, so that a model that computes one stops naming the layer that made it (an
/// overflowing product, a broken weight) rather than a later check blaming what came after.
/// One pass over what the layer wrote many passes to compute. `layer` names it (`layer 3`).
pub(crate) fn check_layer_output(
    x: &[f32],
    hidden: usize,
    layer: impl FnOnce() -> String,
) -> crate::Result<()> {
    match crate::serving::model::first_non_finite(x, hidden) {
        None => Ok(()),
        Some((token, element)) => Err(crate::Error::NonFinite {
            at: format!(
                "{}'s output (token {token} of the step, element {element})",
                layer()
            ),
        }),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_non_finite_layer_output_names_the_layer_and_token() {
        let mut x = vec![0.5f32; 3 * 4];
        assert!(super::check_layer_output(&x, 4, || "layer 2".into()).is_ok());
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            x[9] = bad;
            let e = super::check_layer_output(&x, 4, || "layer 2".into()).unwrap_err();
            assert_eq!(
                e.to_string(),
                "model: layer 2's output (token 2 of the step, element 1) holds a non-finite \
                 value (NaN or ±inf)"
            );
        }
    }
}
