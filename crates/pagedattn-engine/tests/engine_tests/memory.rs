//! The KV pool sized from memory: whole blocks of every cached layer, a share of the device
//! net of what is in use, budgets that hold nothing refused.

use pagedattn::registry;
use pagedattn_engine::serving::memory::{kv_bytes_per_block, kv_pool_size, KvCacheMemory};
use pagedattn_engine::serving::model::ModelKind;

use crate::common::small;

#[test]
fn a_budget_holds_whole_blocks_of_every_cached_layer() {
    let backend = registry::backend("cpu").unwrap();
    // An encoder-decoder model: its encoder layers keep no cache, its cross attentions do.
    for kind in [ModelKind::Decoder, ModelKind::EncoderDecoder] {
        let model = small(kind).build_model().unwrap();
        let per_block = kv_bytes_per_block(model.as_ref(), 16);
        // Keys and values of each cached layer: 2 x 16 tokens x kv heads x head size x bytes.
        let expected: u64 = model
            .layers()
            .iter()
            .filter(|c| c.attn_type().uses_cache())
            .map(|c| 2 * 16 * (c.num_kv_heads() * c.head_size()) as u64 * 2)
            .sum();
        assert!(expected > 0);
        assert_eq!(per_block, expected, "{kind:?}");
        let pool = kv_pool_size(
            backend.as_ref(),
            model.as_ref(),
            16,
            KvCacheMemory::Bytes(10 * per_block + per_block / 2),
        )
        .unwrap();
        assert_eq!((pool.blocks, pool.bytes_per_block), (10, per_block));
        let none = kv_pool_size(
            backend.as_ref(),
            model.as_ref(),
            16,
            KvCacheMemory::Bytes(per_block - 1),
        );
        assert!(none.unwrap_err().to_string().contains("at least one block"));
        for bad in [0.0, -0.5, 1.5, f64::NAN] {
            let e = kv_pool_size(
                backend.as_ref(),
                model.as_ref(),
                16,
                KvCacheMemory::Utilization(bad),
            );
            assert!(e.unwrap_err().to_string().contains("expected a fraction"));
        }
    }
}

/// An encoder-only model caches nothing: whatever the budget, its pool is a few blocks of
/// bookkeeping (4 GiB of 1-byte "blocks" once made the scheduler refuse 2^32 blocks).
#[test]
fn a_model_without_a_cache_gets_a_nominal_pool() {
    let backend = registry::backend("cpu").unwrap();
    let model = small(ModelKind::EncoderOnly).build_model().unwrap();
    for budget in [
        KvCacheMemory::Bytes(1),
        KvCacheMemory::Bytes(4 << 30),
        KvCacheMemory::Utilization(0.9),
    ] {
        let pool = kv_pool_size(backend.as_ref(), model.as_ref(), 16, budget).unwrap();
        assert_eq!(
            pool.blocks,
            pagedattn_engine::serving::memory::CACHELESS_BLOCKS
        );
    }
}

#[test]
fn a_share_of_the_host_counts_what_is_in_use() {
    let backend = registry::backend("cpu").unwrap();
    let model = small(ModelKind::Decoder).build_model().unwrap();
    let m = backend.memory().unwrap();
    assert!(m.available <= m.total && m.total > 0, "{m:?}");
    let in_use = m.total - m.available;
    // A share well below what is in use holds nothing.
    if in_use > m.total / 10 {
        let share = in_use as f64 / m.total as f64 / 2.0;
        let e = kv_pool_size(
            backend.as_ref(),
            model.as_ref(),
            16,
            KvCacheMemory::Utilization(share),
        );
        assert!(e
            .unwrap_err()
            .to_string()
            .contains("leaves no room for a KV block"));
    }
    // All of it holds at most what was free (the host's use moves between the readings).
    let all = kv_pool_size(
        backend.as_ref(),
        model.as_ref(),
        16,
        KvCacheMemory::Utilization(1.0),
    )
    .unwrap();
    assert!(all.budget <= m.total);
    assert!(all.blocks as u64 * all.bytes_per_block <= all.budget);
    // The host's default: 4 GiB at most, half of what is available at most.
    match KvCacheMemory::default_for(backend.as_ref()).unwrap() {
        KvCacheMemory::Bytes(b) => assert!(b <= 4 << 30 && b <= m.available / 2 + (1 << 30)),
        other => panic!("{other:?}"),
    }
}
