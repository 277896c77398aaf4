//! Llama (`LlamaForCausalLM`), Mistral (a sliding window) and Qwen2 (q/k/v biases): one
//! architecture — RMSNorm before each sublayer, RoPE in transformers' `rotate_half` layout,
//! GQA, a SwiGLU MLP — whose variants the config and the tensors present decide.

use pagedattn::AttentionConfig;

use super::{HfModel, Reader};
use crate::models::blocks::{InputEmbedding, LayerWeights, Mlp};
use crate::models::llama::{Llama, LlamaShape};
use crate::models::ops::{Linear, Rope, RopeStyle};
use crate::Result;

/// The common shape of the Llama-like families (`hidden_size`, heads, `head_dim`, ...).
pub(super) fn shape(r: &Reader<'_>) -> Result<LlamaShape> {
    let f = r.folder;
    let hidden = r.positive("hidden_size")?;
    let heads = r.positive("num_attention_heads")?;
    let kv_heads = f.config_usize_opt("num_key_value_heads")?.unwrap_or(heads);
    Ok(LlamaShape {
        name: r.name(),
        layers: r.layers("num_hidden_layers", |l| {
            format!("model.layers.{l}.self_attn.o_proj.weight")
        })?,
        hidden,
        ffn: r.positive("intermediate_size")?,
        heads,
        kv_heads,
        head_size: f.config_usize_opt("head_dim")?.unwrap_or(hidden / heads),
        vocab: r.positive("vocab_size")?,
        max_context: r.max_context()?,
        stop_tokens: r.stop_tokens(),
        first_plain_token: 0,
    })
}

/// Layer `l`'s attention projections `q_proj`, `k_proj`, `v_proj`, `o_proj` (biases where
/// the folder has them).
pub(super) fn attention(r: &Reader<'_>, s: &LlamaShape, l: usize) -> Result<[Linear; 4]> {
    let name = |p: &str| format!("model.layers.{l}.self_attn.{p}");
    let (q, kv) = (s.heads * s.head_size, s.kv_heads * s.head_size);
    Ok([
        r.linear(&name("q_proj"), q, s.hidden)?,
        r.linear(&name("k_proj"), kv, s.hidden)?,
        r.linear(&name("v_proj"), kv, s.hidden)?,
        r.linear(&name("o_proj"), s.hidden, q)?,
    ])
}

/// Layer `l`'s gated MLP (`gate_proj`, `up_proj`, `down_proj`).
pub(super) fn mlp(r: &Reader<'_>, s: &LlamaShape, l: usize, act_key: &str) -> Result<Mlp> {
    let name = |p: &str| format!("model.layers.{l}.mlp.{p}");
    Ok(Mlp {
        gate: Some(r.linear(&name("gate_proj"), s.ffn, s.hidden)?),
        up: r.linear(&name("up_proj"), s.ffn, s.hidden)?,
        down: r.linear(&name("down_proj"), s.hidden, s.ffn)?,
        activation: r.activation(act_key)?,
    })
}

/// The LM head: `lm_head`, or the token table where `tie_word_embeddings` (default
/// `tied_default`).
pub(super) fn head(
    r: &Reader<'_>,
    s: &LlamaShape,
    embedding: &InputEmbedding,
    tied_default: bool,
) -> Result<Linear> {
    if r.folder.config_bool("tie_word_embeddings", tied_default)? {
        Ok(embedding.tokens.to_linear(r.precision)?)
    } else {
        r.linear("lm_head", s.vocab, s.hidden)
    }
}

/// A Llama, Mistral or Qwen2 folder.
pub(super) fn load(r: &Reader<'_>) -> Result<HfModel> {
    let s = shape(r)?;
    let eps = r.eps("rms_norm_eps")?;
    let mistral = r.folder.model_type()? == "mistral";
    let windows = r.windows(s.layers, mistral)?;
    let layers = (0..s.layers)
        .map(|l| {
            let norm = |p: &str| r.rms_norm(&format!("model.layers.{l}.{p}"), s.hidden, eps);
            let [wq, wk, wv, wo] = attention(r, &s, l)?;
            Ok(LayerWeights {
                attn_norm: norm("input_layernorm")?,
                wq,
                wk,
                wv,
                wo,
                attn_out_norm: None,
                ffn_norm: norm("post_attention_layernorm")?,
                mlp: mlp(r, &s, l, "hidden_act")?,
                ffn_out_norm: None,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let embedding =
        InputEmbedding::plain(r.embedding("model.embed_tokens.weight", s.vocab, s.hidden)?);
    let head = head(r, &s, &embedding, false)?;
    let attention = windows
        .iter()
        .map(|&window| {
            AttentionConfig::builder(s.heads, s.head_size)
                .num_kv_heads(s.kv_heads)
                .sliding_window(window)
                .build()
        })
        .collect::<pagedattn::Result<Vec<_>>>()?;
    let rope = Rope::new(s.head_size, r.rope_theta()?, RopeStyle::Neox)?;
    let out_norm = r.rms_norm("model.norm", s.hidden, eps)?;
    Ok(HfModel::Decoder(Llama::new(
        s,
        embedding,
        layers,
        out_norm,
        head,
        Some(rope),
        attention,
        pagedattn::DType::F32,
    )?))
}
