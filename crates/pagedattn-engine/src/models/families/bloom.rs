//! BLOOM (`BloomForCausalLM`): ALiBi instead of positions (BLOOM's slopes, non-power-of-two
//! head counts included), LayerNorms (one on the embedding too), biases everywhere, a fused
//! query/key/value projection, a plain MLP of GELU by `tanh` four times as wide, the head tied.

use pagedattn::{alibi_slopes_bloom, AttentionConfig};

use super::{HfModel, Reader};
use crate::models::blocks::{InputEmbedding, LayerWeights, Mlp};
use crate::models::llama::{Llama, LlamaShape};
use crate::models::ops::{Activation, Linear};
use crate::{Error, Result};

/// The fused `query_key_value` projection split into q, k and v: its rows are per head a
/// query, a key and a value of `head_size` rows each (`view(heads, 3, head_size)`).
fn split_qkv(r: &Reader<'_>, name: &str, s: &LlamaShape) -> Result<[Linear; 3]> {
    let (hidden, d, heads) = (s.hidden, s.head_size, s.heads);
    let weight = r
        .folder
        .tensor(&format!("{name}.weight"), &[3 * hidden, hidden])?;
    let bias = r.vector(&format!("{name}.bias"), 3 * hidden)?;
    let part = |which: usize| -> Result<Linear> {
        let rows = |h: usize| (h * 3 + which) * d..(h * 3 + which + 1) * d;
        let w: Vec<f32> = (0..heads)
            .flat_map(|h| weight[rows(h).start * hidden..rows(h).end * hidden].to_vec())
            .collect();
        let b: Vec<f32> = (0..heads).flat_map(|h| bias[rows(h)].to_vec()).collect();
        Ok(Linear::from_f32(&w, hidden, hidden, r.precision)?.with_bias(b)?)
    };
    Ok([part(0)?, part(1)?, part(2)?])
}

/// A BLOOM folder.
pub(super) fn load(r: &Reader<'_>) -> Result<HfModel> {
    let f = r.folder;
    let hidden = match f.config("hidden_size") {
        Some(_) => r.positive("hidden_size")?,
        None => r.positive("n_embed")?,
    };
    let heads = r.heads("n_head", hidden, "hidden_size")?;
    if f.config_bool("apply_residual_connection_post_layernorm", false)? {
        return Err(Error::Model(format!(
            "{}: apply_residual_connection_post_layernorm = true is not supported",
            f.dir().join("config.json").display()
        )));
    }
    let s = LlamaShape {
        name: r.name(),
        layers: r.layers("n_layer", |l| {
            format!("transformer.h.{l}.mlp.dense_4h_to_h.weight")
        })?,
        hidden,
        ffn: 4 * hidden,
        heads,
        kv_heads: heads,
        head_size: hidden / heads,
        vocab: r.positive("vocab_size")?,
        max_context: r.max_context()?,
        stop_tokens: r.stop_tokens(),
        first_plain_token: 0,
    };
    let eps = r.eps("layer_norm_epsilon")?;
    let layers = (0..s.layers)
        .map(|l| {
            let name = |p: &str| format!("transformer.h.{l}.{p}");
            let [wq, wk, wv] = split_qkv(r, &name("self_attention.query_key_value"), &s)?;
            Ok(LayerWeights {
                attn_norm: r.layer_norm(&name("input_layernorm"), hidden, eps)?,
                wq,
                wk,
                wv,
                wo: r.linear(&name("self_attention.dense"), hidden, hidden)?,
                attn_out_norm: None,
                ffn_norm: r.layer_norm(&name("post_attention_layernorm"), hidden, eps)?,
                mlp: Mlp {
                    gate: None,
                    up: r.linear(&name("mlp.dense_h_to_4h"), s.ffn, hidden)?,
                    down: r.linear(&name("mlp.dense_4h_to_h"), hidden, s.ffn)?,
                    activation: Activation::GeluTanh,
                },
                ffn_out_norm: None,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let mut embedding = InputEmbedding::plain(r.embedding(
        "transformer.word_embeddings.weight",
        s.vocab,
        hidden,
    )?);
    embedding.norm = Some(r.layer_norm("transformer.word_embeddings_layernorm", hidden, eps)?);
    let head = if f.has("lm_head.weight") && !f.config_bool("tie_word_embeddings", true)? {
        r.linear("lm_head", s.vocab, hidden)?
    } else {
        embedding.tokens.to_linear(r.precision)?
    };
    let attention = AttentionConfig::builder(heads, s.head_size)
        .alibi_slopes(Some(alibi_slopes_bloom(heads)))
        .build()?;
    let out_norm = r.layer_norm("transformer.ln_f", hidden, eps)?;
    let n = s.layers;
    Ok(HfModel::Decoder(Llama::new(
        s,
        embedding,
        layers,
        out_norm,
        head,
        None,
        vec![attention; n],
        pagedattn::DType::F32,
    )?))
}
