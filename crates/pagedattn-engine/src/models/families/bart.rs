//! BART (`BartForConditionalGeneration`): an encoder-decoder model. Encoder and decoder embed
//! with the shared token table (times √d_model where `scale_embedding`), learned positions
//! from row 2 on, and a LayerNorm; every sublayer — the encoder's self-attention, the
//! decoder's causal self-attention and its cross-attention over the encoder's output, the
//! plain GELU MLPs — is followed by its residual add and a LayerNorm (post-norm); biases
//! everywhere; the head tied to the token table plus `final_logits_bias`. Generation starts
//! from `decoder_start_token_id` (`</s>`).

use pagedattn::{AttentionConfig, AttnType};

use super::{HfModel, Reader};
use crate::models::blocks::{InputEmbedding, LayerWeights, LearnedPositions, Mlp, Placement};
use crate::models::encdec::{CrossWeights, EncDec, Pooling};
use crate::models::ops::{Activation, Linear, Norm};
use crate::serving::model::ModelKind;
use crate::Result;

/// BART's learned positions start at row 2 (fairseq's padding offset).
const POSITION_OFFSET: usize = 2;

/// BART's LayerNorms are torch's default, epsilon 1e-5.
const EPS: f32 = 1e-5;

/// The projections `q_proj`, `k_proj`, `v_proj`, `out_proj` of attention `name`.
fn projections(r: &Reader<'_>, name: &str, d: usize) -> Result<[Linear; 4]> {
    let p = |part: &str| r.linear(&format!("{name}.{part}"), d, d);
    Ok([p("q_proj")?, p("k_proj")?, p("v_proj")?, p("out_proj")?])
}

/// A layer's self-attention (`self_attn`, norm `self_attn_layer_norm`) and MLP (`fc1`, `fc2`,
/// norm `final_layer_norm`) under `prefix`.
fn layer(
    r: &Reader<'_>,
    prefix: &str,
    d: usize,
    ffn: usize,
    act: Activation,
) -> Result<LayerWeights> {
    let name = |p: &str| format!("{prefix}.{p}");
    let [wq, wk, wv, wo] = projections(r, &name("self_attn"), d)?;
    Ok(LayerWeights {
        attn_norm: r.layer_norm(&name("self_attn_layer_norm"), d, EPS)?,
        wq,
        wk,
        wv,
        wo,
        attn_out_norm: None,
        ffn_norm: r.layer_norm(&name("final_layer_norm"), d, EPS)?,
        mlp: Mlp {
            gate: None,
            up: r.linear(&name("fc1"), ffn, d)?,
            down: r.linear(&name("fc2"), d, ffn)?,
            activation: act,
        },
        ffn_out_norm: None,
    })
}

/// A BART folder.
pub(super) fn load(r: &Reader<'_>) -> Result<HfModel> {
    let f = r.folder;
    let d = r.positive("d_model")?;
    let heads = r.heads("encoder_attention_heads", d, "d_model")?;
    if r.positive("decoder_attention_heads")? != heads {
        return Err(f.config_error(
            "decoder_attention_heads",
            &format!("encoder_attention_heads ({heads})"),
        ));
    }
    let vocab = r.positive("vocab_size")?;
    let positions = r.positive("max_position_embeddings")?;
    let act = r.activation("activation_function")?;
    let shared = if f.has("model.shared.weight") {
        "model.shared.weight"
    } else {
        "model.encoder.embed_tokens.weight"
    };
    let tokens = std::sync::Arc::new(r.embedding(shared, vocab, d)?);
    let scale = f
        .config_bool("scale_embedding", false)?
        .then(|| (d as f64).sqrt() as f32);
    let embedding = |part: &str| -> Result<InputEmbedding> {
        Ok(InputEmbedding {
            scale,
            positions: Some(LearnedPositions {
                table: f.tensor(
                    &format!("model.{part}.embed_positions.weight"),
                    &[positions + POSITION_OFFSET, d],
                )?,
                offset: POSITION_OFFSET,
            }),
            norm: Some(r.layer_norm(&format!("model.{part}.layernorm_embedding"), d, EPS)?),
            ..InputEmbedding::shared(tokens.clone())
        })
    };
    let layer_norm = |part: &'static str| {
        move |l: usize| format!("model.{part}.layers.{l}.final_layer_norm.weight")
    };
    let encoder = (0..r.layers("encoder_layers", layer_norm("encoder"))?)
        .map(|l| {
            layer(
                r,
                &format!("model.encoder.layers.{l}"),
                d,
                r.positive("encoder_ffn_dim")?,
                act,
            )
        })
        .collect::<Result<Vec<_>>>()?;
    let decoder = (0..r.layers("decoder_layers", layer_norm("decoder"))?)
        .map(|l| {
            let prefix = format!("model.decoder.layers.{l}");
            let [wq, wk, wv, wo] = projections(r, &format!("{prefix}.encoder_attn"), d)?;
            let cross = CrossWeights {
                norm: r.layer_norm(&format!("{prefix}.encoder_attn_layer_norm"), d, EPS)?,
                wq,
                wk,
                wv,
                wo,
            };
            Ok((
                layer(r, &prefix, d, r.positive("decoder_ffn_dim")?, act)?,
                cross,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    let head = if f.config_bool("tie_word_embeddings", true)? {
        tokens.to_linear(r.precision)?
    } else {
        r.linear("lm_head", vocab, d)?
    };
    let head = match f.has("final_logits_bias") {
        true => head.with_bias(f.tensor("final_logits_bias", &[1, vocab])?)?,
        false => head,
    };
    let config = |attn_type| {
        AttentionConfig::builder(heads, d / heads)
            .attn_type(attn_type)
            .build()
    };
    let mut attention = vec![config(AttnType::Encoder)?; encoder.len()];
    for _ in 0..decoder.len() {
        attention.push(config(AttnType::Decoder)?);
        attention.push(config(AttnType::EncoderDecoder)?);
    }
    Ok(HfModel::Encoder(EncDec {
        name: r.name(),
        kind: ModelKind::EncoderDecoder,
        hidden: d,
        heads,
        kv_heads: heads,
        head_size: d / heads,
        vocab,
        max_context: positions,
        placement: Placement::Post,
        encoder_embedding: embedding("encoder")?,
        decoder_embedding: Some(embedding("decoder")?),
        encoder,
        encoder_norm: None::<Norm>,
        decoder,
        out_norm: None,
        head: Some(head),
        pooling: Pooling::State,
        pooler: None,
        rope: None,
        decoder_rope: false,
        attention,
        dtype: pagedattn::DType::F32,
        stop_tokens: r.stop_tokens(),
    }))
}
