//! Teacher-forced scoring: a model's output at every position of one token sequence,
//! computed in one step (perplexity, comparing two precisions of a model position by
//! position, or a model against transformers' logits and hidden states). Decoder attention
//! runs over a fresh paged cache, encoder attention over the encoder tokens without one,
//! cross-attention through a fresh cross cache written in the same step.

use pagedattn::{
    AttnType, Backend, BlockId, KvCache, MetadataBuilder, Plan, SequenceDesc, Workspace,
};

use crate::serving::model::{Model, ModelKind, StepTokens};
use crate::serving::{run_attention, write_kv, DecoderPlans};
use crate::{Error, Result};

/// Tokens per cache block of the scoring step.
const BLOCK_SIZE: usize = 16;

/// The logits (`[tokens.len(), vocab]`, row `i` predicting token `i + 1`) of a decoder
/// `model` over `tokens` on `backend`: one step whose every row is a logit row. An
/// encoder-only model gives its output of every row instead (with
/// [`Pooling::State`](crate::models::encdec::Pooling::State), every token's final state).
pub fn prompt_logits(
    model: &mut dyn Model,
    backend: &dyn Backend,
    tokens: &[u32],
) -> Result<Vec<f32>> {
    encoder_decoder_logits(model, backend, &[], tokens)
}

/// [`prompt_logits`] of an encoder-decoder `model`: the encoder over `encoder_tokens`, the
/// decoder over `tokens` (its prompt, starting with the decoder start token), the logits of
/// every decoder position.
pub fn encoder_decoder_logits(
    model: &mut dyn Model,
    backend: &dyn Backend,
    encoder_tokens: &[u32],
    tokens: &[u32],
) -> Result<Vec<f32>> {
    let layers = model.layers().to_vec();
    if (model.kind() == ModelKind::EncoderDecoder) == encoder_tokens.is_empty() {
        return Err(Error::Model(
            "encoder tokens are an encoder-decoder model's, and it needs them".into(),
        ));
    }
    let table_of =
        |len: usize| -> Vec<BlockId> { (0..len.div_ceil(BLOCK_SIZE).max(1) as BlockId).collect() };
    let (table, cross_table) = (table_of(tokens.len()), table_of(encoder_tokens.len()));
    let mut caches = layers
        .iter()
        .map(|c| {
            let blocks = match c.attn_type() {
                AttnType::Decoder => table.len(),
                AttnType::EncoderDecoder => cross_table.len(),
                _ => return Ok(None),
            };
            let spec = c.kv_cache_spec(model.dtype(), blocks, BLOCK_SIZE);
            backend.allocate_kv_cache(&spec).map(Some)
        })
        .collect::<pagedattn::Result<Vec<Option<KvCache>>>>()?;
    let attention = layers
        .iter()
        .map(|c| backend.attention(c))
        .collect::<pagedattn::Result<Vec<_>>>()?;
    let first_of = |t: AttnType| layers.iter().position(|c| c.attn_type() == t);
    let plan = |layer: Option<usize>, builder: MetadataBuilder<'_>| -> Result<Option<Plan>> {
        let Some(layer) = layer else { return Ok(None) };
        let spec = caches[layer].as_ref().map(|c| *c.spec());
        Ok(Some(
            attention[layer].plan(&builder.build()?, spec.as_ref())?,
        ))
    };
    let decoder_desc = SequenceDesc::prompt(0, tokens.len(), &table);
    /// A one-sequence step of `desc`; with `cross`, `(written only, encoder length,
    /// cross block table)`, a cross-attention step.
    fn with<'a>(
        desc: SequenceDesc<'a>,
        cross: Option<(bool, usize, &'a [BlockId])>,
    ) -> MetadataBuilder<'a> {
        let mut builder = MetadataBuilder::new(BLOCK_SIZE);
        match cross {
            Some((written, len, table)) => {
                builder.write_cross_kv(written);
                builder.push(desc.with_encoder(len, table));
            }
            None => {
                builder.push(desc);
            }
        }
        builder
    }
    let dense_len = match model.kind() {
        ModelKind::EncoderOnly => tokens.len(),
        _ => encoder_tokens.len(),
    };
    // A plan per group of decoder layers that share one (Gemma-2's local and global).
    let decoder = DecoderPlans::new(&layers, |layer| {
        plan(Some(layer), with(decoder_desc, None))?.ok_or_else(|| Error::Model("no plan".into()))
    })?;
    let dense_layer = first_of(AttnType::Encoder).or(first_of(AttnType::EncoderOnly));
    let dense = plan(
        dense_layer,
        with(SequenceDesc::prompt(0, dense_len, &[]), None),
    )?;
    let cross = first_of(AttnType::EncoderDecoder);
    let cross_plan = |written| {
        let cross_step = Some((written, encoder_tokens.len(), cross_table.as_slice()));
        plan(cross, with(decoder_desc, cross_step))
    };
    let (cross_read, cross_write) = (cross_plan(false)?, cross_plan(true)?);
    let mut workspace = Workspace::empty(backend.device());
    let decoder_plans = decoder.iter();
    for p in [&dense, &cross_read, &cross_write]
        .into_iter()
        .flatten()
        .chain(decoder_plans)
    {
        workspace.reserve(p)?;
    }
    let positions: Vec<usize> = (0..tokens.len()).collect();
    let encoder_positions: Vec<usize> = (0..encoder_tokens.len()).collect();
    let step = StepTokens {
        tokens,
        positions: &positions,
        logit_rows: &positions,
        encoder_tokens,
        encoder_positions: &encoder_positions,
    };
    let missing = || Error::Model("an attention of a type the step has no plan for".into());
    let mut logits = Vec::new();
    model.forward(
        &step,
        &mut |layer, q, k, v, out| {
            let (attention, cache) = (attention[layer].as_ref(), caches[layer].as_mut());
            let config = &layers[layer];
            // Self-attention reads this step's keys and values (and a decoder's cache);
            // cross-attention writes the encoder's into the cross cache, then reads it.
            let (plan, kv, cache) = match config.attn_type() {
                AttnType::Decoder => (decoder.of(&layers, config), Some((k, v)), cache),
                AttnType::Encoder | AttnType::EncoderOnly => (dense.as_ref(), Some((k, v)), None),
                AttnType::EncoderDecoder => {
                    let cache = cache.ok_or_else(missing)?;
                    let write = cross_write.as_ref().ok_or_else(missing)?;
                    write_kv(backend, attention, write, k, v, cache)?;
                    (cross_read.as_ref(), None, Some(cache))
                }
            };
            let plan = plan.ok_or_else(missing)?;
            run_attention(backend, attention, plan, &mut workspace, q, kv, cache, out)
        },
        &mut logits,
    )?;
    Ok(logits)
}
