//! Arbitrary sequence descriptions (any lengths, huge ones included, any block size, empty
//! batches, encoder sides) into `MetadataBuilder`: an error is fine, a panic or an allocation
//! beyond what the input asks for is not. Metadata it builds must hold what the descriptions
//! say (lengths, slots through the tables) and be accepted by a plan on `reference` and `cpu`
//! where the contract says it is: without a cache when no sequence has cached context, with a
//! cache whose geometry exists when the tables hold distinct blocks covering every sequence.

#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use pagedattn::{
    AttentionConfig, AttentionMetadata, AttnType, Backend, BlockId, DType, KvCacheDtype,
    KvCacheSpec, MetadataBuilder, SequenceDesc,
};
use pagedattn_fuzz::run;
use pagedattn_fuzz::size::Size;

/// Slot-mapping entries the builder may allocate for one input: it allocates one per new
/// token (and per encoder token it writes), which the metadata then holds, so an input asking
/// for more than this is skipped rather than allocated.
const ENTRIES: usize = 1 << 12;

/// The longest block table the harness allocates for a sequence.
const TABLE: usize = 4096;

#[derive(Debug, Arbitrary)]
struct Input {
    block_size: Size,
    write_cross_kv: bool,
    /// The tables as the input gives them, or allocated by the harness: distinct blocks that
    /// cover every sequence (where not longer than [`TABLE`]).
    own_tables: bool,
    /// The head geometry of the layer the metadata is planned for (small).
    kv_heads: u8,
    group: u8,
    head_size: u8,
    seqs: Vec<Seq>,
}

#[derive(Debug, Arbitrary)]
struct Seq {
    /// Tokens already in the cache.
    len: Size,
    query_len: Size,
    make: Make,
    table: Vec<BlockId>,
    encoder: Option<(Size, Vec<BlockId>)>,
}

/// Which constructor describes the sequence.
#[derive(Debug, Arbitrary)]
enum Make {
    Prompt,
    Decode,
    /// The fields as given (a "decode" of any query length included).
    Raw {
        is_decode: bool,
    },
}

fuzz_target!(|input: Input| {
    let b = input.block_size.get();
    // The tables as given, or ones that cover each sequence with blocks no other sequence has
    // (one block space for the decoder's cache, one for the cross cache).
    let mut tables: Vec<Vec<BlockId>> = input.seqs.iter().map(|s| s.table.clone()).collect();
    let mut cross_tables: Vec<Vec<BlockId>> = (input.seqs.iter())
        .map(|s| s.encoder.as_ref().map_or(Vec::new(), |(_, t)| t.clone()))
        .collect();
    let mut covered = !input.own_tables && b > 0;
    if covered {
        let (mut next, mut next_cross) = (0usize, 0usize);
        for (s, seq) in input.seqs.iter().enumerate() {
            let d = describe(seq, &[], &[]);
            let len = d.context_len.checked_add(d.query_len);
            covered &= allocate(&mut tables[s], len, b, &mut next);
            if let Some(e) = &d.encoder {
                covered &= allocate(&mut cross_tables[s], Some(e.len), b, &mut next_cross);
            }
        }
    }
    let descs: Vec<SequenceDesc> = (input.seqs.iter().zip(&tables).zip(&cross_tables))
        .map(|((seq, table), cross)| describe(seq, table, cross))
        .collect();
    if entries(&descs, input.write_cross_kv) > ENTRIES {
        return;
    }
    let mut builder = MetadataBuilder::new(b);
    builder.write_cross_kv(input.write_cross_kv);
    for d in &descs {
        builder.push(*d);
    }
    let built = builder.build();
    // A sequence with no new token has nothing to compute: always refused.
    if descs.iter().any(|d| d.query_len == 0) {
        assert!(built.is_err(), "a sequence without new tokens was accepted");
    }
    let Ok(md) = built else {
        return;
    };
    check_fields(&md, &descs, b, input.write_cross_kv);
    check_plans(&md, &descs, b, covered, &input);
});

/// `seq` through its constructor, with `table` and (if it has an encoder side) `cross_table`.
fn describe<'a>(seq: &Seq, table: &'a [BlockId], cross_table: &'a [BlockId]) -> SequenceDesc<'a> {
    let desc = match seq.make {
        Make::Prompt => SequenceDesc::prompt(seq.len.get(), seq.query_len.get(), table),
        Make::Decode => SequenceDesc::decode(seq.len.get(), table),
        Make::Raw { is_decode } => SequenceDesc {
            context_len: seq.len.get(),
            query_len: seq.query_len.get(),
            is_decode,
            block_table: table,
            encoder: None,
        },
    };
    match &seq.encoder {
        Some((len, _)) => desc.with_encoder(len.get(), cross_table),
        None => desc,
    }
}

/// Replaces `table` with the next `ceil(len / b)` fresh blocks; false (the table left as
/// given) when that is more than [`TABLE`] blocks or more than [`BlockId`] numbers.
fn allocate(table: &mut Vec<BlockId>, len: Option<usize>, b: usize, next: &mut usize) -> bool {
    let Some(n) = len.map(|l| l.div_ceil(b)).filter(|&n| n <= TABLE) else {
        return false;
    };
    if *next + n > BlockId::MAX as usize {
        return false;
    }
    *table = (*next..*next + n).map(|x| x as BlockId).rev().collect();
    *next += n;
    true
}

/// The slot-mapping entries building `descs` allocates, counted as the builder goes: a
/// sequence whose length or token count does not fit an i32 ends the build with an error
/// before its slots exist.
fn entries(descs: &[SequenceDesc], write_cross_kv: bool) -> usize {
    let limit = i32::MAX as usize;
    let mut tokens = 0usize;
    for d in descs {
        let fits = d
            .context_len
            .checked_add(d.query_len)
            .is_some_and(|l| l <= limit);
        if !fits || tokens + d.query_len > limit {
            return tokens;
        }
        tokens += d.query_len;
    }
    let encoder: usize = if write_cross_kv {
        descs
            .iter()
            .filter_map(|d| d.encoder.as_ref())
            .map(|e| e.len.min(limit + 1))
            .sum()
    } else {
        0
    };
    tokens + encoder
}

/// Every field of `md` against the descriptions.
fn check_fields(md: &AttentionMetadata, descs: &[SequenceDesc], b: usize, write_cross_kv: bool) {
    assert_eq!(md.block_size, Some(b));
    assert_eq!(md.num_seqs(), descs.len());
    let prefills = descs.iter().take_while(|d| !d.is_decode).count();
    assert_eq!(md.num_prefills, prefills);
    let mut t = 0;
    for (s, d) in descs.iter().enumerate() {
        assert_eq!(md.query_range(s).len(), d.query_len, "sequence {s}");
        assert_eq!(md.seq_lens[s] as usize, d.context_len + d.query_len);
        assert_eq!(md.context_lens[s] as usize, d.context_len);
        let row = md.block_tables.row(s);
        assert_eq!(&row[..d.block_table.len()], d.block_table);
        assert!(row[d.block_table.len()..].iter().all(|&x| x == 0));
        for p in d.context_len..d.context_len + d.query_len {
            assert_eq!(md.slot_mapping[t], slot(d.block_table, b, p), "token {t}");
            t += 1;
        }
    }
    assert_eq!(md.slot_mapping.len(), t);
    assert_eq!(md.num_tokens(), t);
    let with_encoder: Vec<_> = descs.iter().filter_map(|d| d.encoder.as_ref()).collect();
    match &md.encoder {
        None => assert!(with_encoder.is_empty()),
        Some(enc) => {
            assert_eq!(with_encoder.len(), descs.len());
            let mut slots = Vec::new();
            for (s, e) in with_encoder.iter().enumerate() {
                assert_eq!(enc.encoder_seq_lens[s] as usize, e.len);
                if write_cross_kv {
                    slots.extend((0..e.len).map(|p| slot(e.cross_block_table, b, p)));
                }
            }
            assert_eq!(enc.cross_slot_mapping, slots);
        }
    }
}

/// The slot of position `p` through `table` (-1 without a table: no cache).
fn slot(table: &[BlockId], b: usize, p: usize) -> i64 {
    if table.is_empty() {
        -1
    } else {
        table[p / b] as i64 * b as i64 + (p % b) as i64
    }
}

/// Plans `md` on `reference` and `cpu` (they share the gate: the same answer), and
/// checks the answer where the contract fixes it.
fn check_plans(
    md: &AttentionMetadata,
    descs: &[SequenceDesc],
    b: usize,
    covered: bool,
    input: &Input,
) {
    let (hkv, group, d) = (
        1 + input.kv_heads as usize % 4,
        1 + input.group as usize % 4,
        1 + input.head_size as usize % 64,
    );
    let cross = md.encoder.is_some();
    let attn_type = if cross {
        AttnType::EncoderDecoder
    } else {
        AttnType::Decoder
    };
    let config = AttentionConfig::builder(hkv * group, d)
        .num_kv_heads(hkv)
        .attn_type(attn_type)
        .build()
        .expect("a valid config");
    // A cache holding every block the tables name.
    let tables: Vec<&[BlockId]> = match &md.encoder {
        Some(enc) => (0..md.num_seqs())
            .map(|s| enc.cross_block_tables.row(s))
            .collect(),
        None => (0..md.num_seqs()).map(|s| md.block_tables.row(s)).collect(),
    };
    let max_block = tables
        .iter()
        .flat_map(|t| t.iter())
        .copied()
        .max()
        .unwrap_or(0);
    let spec = KvCacheSpec {
        num_blocks: max_block.max(0) as usize + 1,
        block_size: b,
        num_kv_heads: hkv,
        head_size: d,
        dtype: DType::F32,
        kv_cache_dtype: KvCacheDtype::Auto,
    };
    let plan = |cache: Option<&KvCacheSpec>| -> bool {
        let ok = plans(&run::reference(), &config, md, cache);
        assert_eq!(
            plans(&run::cpu(), &config, md, cache),
            ok,
            "cpu against reference"
        );
        ok
    };
    let without_cache = plan(None);
    let with_cache = plan(Some(&spec));
    if cross {
        // Cross attention over the inputs needs nothing the builder did not check.
        assert!(without_cache, "cross metadata refused without a cache");
    } else if descs.iter().all(|d| d.block_table.is_empty()) {
        let no_context = descs.iter().all(|d| d.context_len == 0);
        assert_eq!(without_cache, no_context, "decoder metadata without tables");
    }
    if covered {
        // Distinct blocks covering every sequence: only a geometry too large to exist refuses.
        assert_eq!(
            with_cache,
            spec.validate().is_ok(),
            "metadata on its own tables"
        );
    }
}

fn plans(
    backend: &dyn Backend,
    config: &AttentionConfig,
    md: &AttentionMetadata,
    cache: Option<&KvCacheSpec>,
) -> bool {
    let attention = backend.attention(config).expect("a valid config");
    attention.plan(md, cache).is_ok()
}
