//! Teacher-forced scoring: a decoder model's logits at every position of one token sequence,
//! computed in one prefill step over a paged cache (perplexity, or comparing two precisions
//! of a model position by position).

use pagedattn::{AttnType, Backend, BlockId, MetadataBuilder, SequenceDesc, Workspace};

use crate::serving::model::{Model, StepTokens};
use crate::serving::run_attention;
use crate::{Error, Result};

/// Tokens per cache block of the scoring step.
const BLOCK_SIZE: usize = 16;

/// The logits (`[tokens.len(), vocab]`, row `i` predicting token `i + 1`) of `model` over
/// `tokens` on `backend`: one step whose every row is a logit row, attention through a
/// fresh paged cache. Only decoder models (every attention `decoder`) are scored.
pub fn prompt_logits(
    model: &mut dyn Model,
    backend: &dyn Backend,
    tokens: &[u32],
) -> Result<Vec<f32>> {
    let layers = model.layers().to_vec();
    if let Some(c) = layers.iter().find(|c| c.attn_type() != AttnType::Decoder) {
        return Err(Error::Model(format!(
            "prompt_logits scores decoder models; this one has a {} attention",
            c.attn_type()
        )));
    }
    let blocks = tokens.len().div_ceil(BLOCK_SIZE).max(1);
    let table: Vec<BlockId> = (0..blocks as BlockId).collect();
    let mut caches = layers
        .iter()
        .map(|c| backend.allocate_kv_cache(&c.kv_cache_spec(model.dtype(), blocks, BLOCK_SIZE)))
        .collect::<pagedattn::Result<Vec<_>>>()?;
    let attention = layers
        .iter()
        .map(|c| backend.attention(c))
        .collect::<pagedattn::Result<Vec<_>>>()?;
    let mut builder = MetadataBuilder::new(BLOCK_SIZE);
    builder.push(SequenceDesc::prompt(0, tokens.len(), &table));
    // One plan for every layer, as the engine's steps share one.
    let plan = match (attention.first(), caches.first()) {
        (Some(a), Some(c)) => a.plan(&builder.build()?, Some(c.spec()))?,
        _ => return Err(Error::Model("the model has no layer".into())),
    };
    let mut workspace = Workspace::empty(backend.device());
    workspace.reserve(&plan)?;
    let positions: Vec<usize> = (0..tokens.len()).collect();
    let step = StepTokens {
        tokens,
        positions: &positions,
        logit_rows: &positions,
        encoder_tokens: &[],
        encoder_positions: &[],
    };
    let mut logits = Vec::new();
    model.forward(
        &step,
        &mut |layer, q, k, v, out| {
            run_attention(
                backend,
                attention[layer].as_ref(),
                &plan,
                &mut workspace,
                q,
                Some((k, v)),
                Some(&mut caches[layer]),
                out,
            )
        },
        &mut logits,
    )?;
    Ok(logits)
}
