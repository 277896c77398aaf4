//! Gemma-2 (`Gemma2ForCausalLM`): Llama's layout with a norm on both sides of each sublayer
//! (RMSNorms scaling by `1 + w`), the embedding scaled by √hidden, a GeGLU MLP (GELU by
//! `tanh`), local (sliding window) and global layers by `layer_types`, attention scaled by
//! `query_pre_attn_scalar^-½` and soft-capped, the logits soft-capped, the head tied.

use pagedattn::AttentionConfig;

use super::llama::{attention, head, mlp, shape};
use super::{HfModel, Reader};
use crate::models::blocks::{InputEmbedding, LayerWeights};
use crate::models::llama::Llama;
use crate::models::ops::{Norm, Rope, RopeStyle};
use crate::Result;

/// Gemma's RMSNorm `{name}.weight`: `x · (1 + w)`, computed as transformers does in f32.
fn norm(r: &Reader<'_>, name: &str, len: usize, eps: f32) -> Result<Norm> {
    let mut weight = r.vector(&format!("{name}.weight"), len)?;
    weight.iter_mut().for_each(|w| *w += 1.0);
    Ok(Norm::Rms { weight, eps })
}

/// A Gemma-2 folder.
pub(super) fn load(r: &Reader<'_>) -> Result<HfModel> {
    let s = shape(r)?;
    let eps = r.eps("rms_norm_eps")?;
    let windows = r.windows(s.layers, false)?;
    let layers = (0..s.layers)
        .map(|l| {
            let norm = |p: &str| norm(r, &format!("model.layers.{l}.{p}"), s.hidden, eps);
            let [wq, wk, wv, wo] = attention(r, &s, l)?;
            Ok(LayerWeights {
                attn_norm: norm("input_layernorm")?,
                wq,
                wk,
                wv,
                wo,
                attn_out_norm: Some(norm("post_attention_layernorm")?),
                ffn_norm: norm("pre_feedforward_layernorm")?,
                mlp: mlp(r, &s, l, "hidden_activation")?,
                ffn_out_norm: Some(norm("post_feedforward_layernorm")?),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let mut embedding =
        InputEmbedding::plain(r.embedding("model.embed_tokens.weight", s.vocab, s.hidden)?);
    let head = head(r, &s, &embedding, true)?;
    // transformers multiplies by √hidden rounded to the activations' dtype.
    embedding.scale = Some((s.hidden as f64).sqrt() as f32);
    let scalar = r
        .positive_f32("query_pre_attn_scalar")?
        .map_or(s.head_size as f64, f64::from);
    let attention_cap = r.positive_f32("attn_logit_softcapping")?;
    let attention = windows
        .iter()
        .map(|&window| {
            AttentionConfig::builder(s.heads, s.head_size)
                .num_kv_heads(s.kv_heads)
                .scale(scalar.powf(-0.5) as f32)
                .sliding_window(window)
                .logits_soft_cap(attention_cap)
                .build()
        })
        .collect::<pagedattn::Result<Vec<_>>>()?;
    let rope = Rope::new(s.head_size, r.rope_theta()?, RopeStyle::Neox)?;
    let out_norm = norm(r, "model.norm", s.hidden, eps)?;
    let final_cap = r.positive_f32("final_logit_softcapping")?;
    Ok(HfModel::Decoder(
        Llama::new(
            s,
            embedding,
            layers,
            out_norm,
            head,
            Some(rope),
            attention,
            pagedattn::DType::F32,
        )?
        .with_final_soft_cap(final_cap),
    ))
}
