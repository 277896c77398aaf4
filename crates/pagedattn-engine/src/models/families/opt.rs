//! OPT (`OPTForCausalLM`): learned absolute positions from row 2 on (no RoPE), LayerNorms
//! before each sublayer and a final one, biases on the q/k/v/out projections and on a plain
//! MLP (`fc1` → ReLU → `fc2`), attention scaled by `head_dim^-½`, the head tied to the token
//! table. opt-350m's differences (post-norm layers, `project_in`/`project_out` around a
//! narrower token table) are refused at load.

use pagedattn::AttentionConfig;

use super::llama::head;
use super::{HfModel, Reader};
use crate::models::blocks::{InputEmbedding, LayerWeights, LearnedPositions, Mlp};
use crate::models::llama::{Llama, LlamaShape};
use crate::{Error, Result};

/// OPT's learned positions start at row 2 (`OPTLearnedPositionalEmbedding`'s offset, from
/// fairseq's padding): a prompt's position `p` reads row `p + 2`.
const POSITION_OFFSET: usize = 2;

/// OPT's LayerNorms are torch's default, epsilon 1e-5 (the config has no field for it).
const EPS: f32 = 1e-5;

/// Refuses the layouts this module does not compute — opt-350m's norms after the sublayers
/// and narrower token table, an old fine-tune's removed final norm, LayerNorms without
/// weights — naming the field, its value and what is supported.
fn refuse_variants(r: &Reader<'_>, hidden: usize) -> Result<()> {
    let f = r.folder;
    let refused = |field: &str, why: &str| {
        Err(Error::Model(format!(
            "{}: {field}: {why}",
            f.dir().join("config.json").display()
        )))
    };
    if !f.config_bool("do_layer_norm_before", true)? {
        return refused(
            "do_layer_norm_before",
            "false (opt-350m's norms after each sublayer) is not supported, only true",
        );
    }
    if let Some(proj) = f.config_usize_opt("word_embed_proj_dim")? {
        if proj != hidden {
            return refused(
                "word_embed_proj_dim",
                &format!(
                    "{proj} differs from hidden_size {hidden} (opt-350m's project_in and \
                     project_out): not supported"
                ),
            );
        }
    }
    if f.config_bool("_remove_final_layer_norm", false)? {
        return refused(
            "_remove_final_layer_norm",
            "true (no final LayerNorm) is not supported",
        );
    }
    if !f.config_bool("layer_norm_elementwise_affine", true)? {
        return refused(
            "layer_norm_elementwise_affine",
            "false (LayerNorms without weights) is not supported",
        );
    }
    Ok(())
}

/// An OPT folder.
pub(super) fn load(r: &Reader<'_>) -> Result<HfModel> {
    let f = r.folder;
    let hidden = r.positive("hidden_size")?;
    let heads = r.heads("num_attention_heads", hidden, "hidden_size")?;
    refuse_variants(r, hidden)?;
    let positions = r.positive("max_position_embeddings")?;
    let s = LlamaShape {
        name: r.name(),
        layers: r.layers("num_hidden_layers", |l| {
            format!("model.decoder.layers.{l}.fc2.weight")
        })?,
        hidden,
        ffn: r.positive("ffn_dim")?,
        heads,
        kv_heads: heads,
        head_size: hidden / heads,
        vocab: r.positive("vocab_size")?,
        max_context: positions,
        stop_tokens: r.stop_tokens(),
        first_plain_token: 0,
    };
    let activation = r.activation("activation_function")?;
    let layers = (0..s.layers)
        .map(|l| {
            let name = |p: &str| format!("model.decoder.layers.{l}.{p}");
            let proj = |p: &str| r.linear(&name(&format!("self_attn.{p}")), hidden, hidden);
            Ok(LayerWeights {
                attn_norm: r.layer_norm(&name("self_attn_layer_norm"), hidden, EPS)?,
                wq: proj("q_proj")?,
                wk: proj("k_proj")?,
                wv: proj("v_proj")?,
                wo: proj("out_proj")?,
                attn_out_norm: None,
                ffn_norm: r.layer_norm(&name("final_layer_norm"), hidden, EPS)?,
                mlp: Mlp {
                    gate: None,
                    up: r.linear(&name("fc1"), s.ffn, hidden)?,
                    down: r.linear(&name("fc2"), hidden, s.ffn)?,
                    activation,
                },
                ffn_out_norm: None,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let tokens = r.embedding("model.decoder.embed_tokens.weight", s.vocab, hidden)?;
    let embedding = InputEmbedding {
        positions: Some(LearnedPositions {
            // (Saturating: a hostile `max_position_embeddings` is then a shape mismatch.)
            table: f.tensor(
                "model.decoder.embed_positions.weight",
                &[positions.saturating_add(POSITION_OFFSET), hidden],
            )?,
            offset: POSITION_OFFSET,
        }),
        ..InputEmbedding::plain(tokens)
    };
    // Tied unless the config says otherwise (every released OPT is), then `lm_head`.
    let head = head(r, &s, &embedding, true)?;
    // OPT multiplies q by `head_dim^-½` before q·k; the layer's default scale is the same
    // factor applied to q·k.
    let attention = AttentionConfig::builder(heads, s.head_size).build()?;
    let out_norm = r.layer_norm("model.decoder.final_layer_norm", hidden, EPS)?;
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
