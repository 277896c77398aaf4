//! The example replay case: a realistic mixed batch built the way an engine would build it.

use half::bf16;
use pagedattn::replay::ReplayCase;
use pagedattn::{
    AttentionConfig, BlockId, CacheLayout, DType, HostStorage, KvCache, KvScales, MetadataBuilder,
    SequenceDesc, Tensor,
};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

const HEADS: usize = 8;
const KV_HEADS: usize = 2;
const HEAD_SIZE: usize = 64;
const BLOCK: usize = 16;
const NUM_BLOCKS: usize = 64;

/// Two prompt chunks after cached context, one fresh prompt, four decodes; bf16, GQA 4:1.
/// Slots no sequence covers hold NaN, as a real cache's free blocks may.
pub fn mixed_batch(seed: u64) -> ReplayCase {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    // (context already cached, new tokens, is decode)
    let seqs: [(usize, usize, bool); 7] = [
        (37, 24, false),
        (16, 9, false),
        (0, 31, false),
        (70, 1, true),
        (5, 1, true),
        (128, 1, true),
        (15, 1, true),
    ];
    let mut free: Vec<BlockId> = (0..NUM_BLOCKS as BlockId).collect();
    free.shuffle(&mut rng);
    let tables: Vec<Vec<BlockId>> = seqs
        .iter()
        .map(|&(ctx, new, _)| free.drain(..(ctx + new).div_ceil(BLOCK)).collect())
        .collect();
    let mut builder = MetadataBuilder::new(BLOCK);
    let mut context_slots = Vec::new();
    for (&(ctx, new, decode), table) in seqs.iter().zip(&tables) {
        context_slots
            .extend((0..ctx).map(|p| table[p / BLOCK] as i64 * BLOCK as i64 + (p % BLOCK) as i64));
        builder.push(if decode {
            SequenceDesc::decode(ctx, table)
        } else {
            SequenceDesc::prompt(ctx, new, table)
        });
    }
    let metadata = builder.build().expect("example batch is valid");
    let config = AttentionConfig::builder(HEADS, HEAD_SIZE)
        .num_kv_heads(KV_HEADS)
        .build()
        .expect("valid config");
    let spec = config.kv_cache_spec(DType::BF16, NUM_BLOCKS, BLOCK);
    let nan = HostStorage::BF16(vec![bf16::NAN; spec.buffer_elems()].into());
    let mut cache =
        KvCache::from_canonical(spec, CacheLayout::Nhd, nan.clone(), nan).expect("spec matches");
    let mut random = |shape: &[usize]| {
        let values: Vec<f32> = (0..shape.iter().product())
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        Tensor::from_f32(DType::BF16, shape, &values).expect("shape matches")
    };
    let context = [context_slots.len(), KV_HEADS, HEAD_SIZE];
    let (ck, cv) = (random(&context), random(&context));
    cache
        .write(&ck, &cv, &context_slots, KvScales::ONE)
        .expect("context fits");
    let t = metadata.num_tokens();
    let query = random(&[t, HEADS, HEAD_SIZE]);
    let key_value = Some((
        random(&[t, KV_HEADS, HEAD_SIZE]),
        random(&[t, KV_HEADS, HEAD_SIZE]),
    ));
    ReplayCase {
        config: AttentionConfig::builder(HEADS, HEAD_SIZE)
            .num_kv_heads(KV_HEADS)
            .build()
            .expect("valid config"),
        query,
        key_value,
        kv_cache: Some(cache),
        metadata,
    }
}
