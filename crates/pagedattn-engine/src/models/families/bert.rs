//! BERT (`BertModel`): an encoder-only model. Token, learned position and token type (0)
//! embeddings summed and LayerNormed; per layer bidirectional attention and a plain GELU MLP,
//! each followed by its residual add and a LayerNorm (post-norm); biases everywhere. Its
//! output per sequence is transformers' `pooler_output`, `tanh(dense(first token's state))`,
//! or the first token's state where the checkpoint has no pooler.

use pagedattn::{AttentionConfig, AttnType};

use super::{HfModel, Reader};
use crate::models::blocks::{InputEmbedding, LayerWeights, LearnedPositions, Mlp, Placement};
use crate::models::encdec::{EncDec, Pooling};
use crate::serving::model::ModelKind;
use crate::Result;

/// A BERT folder (tensor names with or without the `bert.` prefix of the task models).
pub(super) fn load(r: &Reader<'_>) -> Result<HfModel> {
    let f = r.folder;
    let prefix = if f.has("bert.embeddings.word_embeddings.weight") {
        "bert."
    } else {
        ""
    };
    let hidden = r.positive("hidden_size")?;
    let heads = r.heads("num_attention_heads", hidden, "hidden_size")?;
    let ffn = r.positive("intermediate_size")?;
    let vocab = r.positive("vocab_size")?;
    let positions = r.positive("max_position_embeddings")?;
    let eps = r.eps("layer_norm_eps")?;
    let activation = r.activation("hidden_act")?;
    let name = |p: &str| format!("{prefix}{p}");
    let count = r.layers("num_hidden_layers", |l| {
        name(&format!("encoder.layer.{l}.output.dense.weight"))
    })?;
    let layers = (0..count)
        .map(|l| {
            let name = |p: &str| name(&format!("encoder.layer.{l}.{p}"));
            let linear = |p: &str, out: usize, inp: usize| r.linear(&name(p), out, inp);
            Ok(LayerWeights {
                attn_norm: r.layer_norm(&name("attention.output.LayerNorm"), hidden, eps)?,
                wq: linear("attention.self.query", hidden, hidden)?,
                wk: linear("attention.self.key", hidden, hidden)?,
                wv: linear("attention.self.value", hidden, hidden)?,
                wo: linear("attention.output.dense", hidden, hidden)?,
                attn_out_norm: None,
                ffn_norm: r.layer_norm(&name("output.LayerNorm"), hidden, eps)?,
                mlp: Mlp {
                    gate: None,
                    up: linear("intermediate.dense", ffn, hidden)?,
                    down: linear("output.dense", hidden, ffn)?,
                    activation,
                },
                ffn_out_norm: None,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let mut embedding = InputEmbedding::plain(r.embedding(
        &name("embeddings.word_embeddings.weight"),
        vocab,
        hidden,
    )?);
    embedding.positions = Some(LearnedPositions {
        table: f.tensor(
            &name("embeddings.position_embeddings.weight"),
            &[positions, hidden],
        )?,
        offset: 0,
    });
    let types = name("embeddings.token_type_embeddings.weight");
    if f.has(&types) {
        let rows = r.positive("type_vocab_size")?;
        let mut table = f.tensor(&types, &[rows, hidden])?;
        table.truncate(hidden);
        embedding.token_type = Some(table);
    }
    embedding.norm = Some(r.layer_norm(&name("embeddings.LayerNorm"), hidden, eps)?);
    let pooler = match f.has(&name("pooler.dense.weight")) {
        true => Some(r.linear(&name("pooler.dense"), hidden, hidden)?),
        false => None,
    };
    let attention = AttentionConfig::builder(heads, hidden / heads)
        .attn_type(AttnType::EncoderOnly)
        .build()?;
    Ok(HfModel::Encoder(EncDec {
        name: r.name(),
        kind: ModelKind::EncoderOnly,
        hidden,
        heads,
        kv_heads: heads,
        head_size: hidden / heads,
        vocab,
        max_context: positions,
        placement: Placement::Post,
        encoder_embedding: embedding,
        decoder_embedding: None,
        attention: vec![attention; layers.len()],
        encoder: layers,
        encoder_norm: None,
        decoder: Vec::new(),
        out_norm: None,
        head: None,
        pooling: if pooler.is_some() {
            Pooling::Pooler
        } else {
            Pooling::State
        },
        pooler,
        rope: None,
        decoder_rope: false,
        dtype: pagedattn::DType::F32,
        stop_tokens: Vec::new(),
    }))
}
