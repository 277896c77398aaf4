//! `--verify`'s recomputation: a real paged call on `cpu` passes, a poisoned output or a
//! wrong block table fails with the step and layer named.

use pagedattn::{
    registry, AttentionConfig, BlockId, DType, Inputs, KvCache, MetadataBuilder, SequenceDesc,
    Tensor, Workspace,
};
use pagedattn_engine::harness::verify::{Verifier, VerifyMode};
use pagedattn_engine::serving::check::{CallCheck, CheckedSeq};

fn random(shape: &[usize], seed: u32) -> Tensor {
    let n: usize = shape.iter().product();
    let values: Vec<f32> = (0..n as u32)
        .map(|i| {
            let h = (i ^ seed.wrapping_mul(0x9E37_79B9)).wrapping_mul(0x85EB_CA6B);
            (h >> 8) as f32 / (1u32 << 23) as f32 - 1.0
        })
        .collect();
    Tensor::from_f32(DType::BF16, shape, &values).unwrap()
}

#[test]
fn a_paged_call_passes_and_a_wrong_one_fails() {
    let backend = registry::backend("cpu").unwrap();
    let config = AttentionConfig::builder(4, 32)
        .num_kv_heads(2)
        .build()
        .unwrap();
    let spec = config.kv_cache_spec(DType::BF16, 12, 4);
    let mut cache: KvCache = backend.allocate_kv_cache(&spec).unwrap();
    let attention = backend.attention(&config).unwrap();
    // Shuffled tables; step 1 fills 7 and 5 tokens, step 2 adds 3 (chunked prefill) and 1.
    let tables: [Vec<BlockId>; 2] = [vec![9, 2, 6], vec![4, 11]];
    let mut run = |lens: [(usize, usize); 2], seed: u32| {
        let mut b = MetadataBuilder::for_cache(&spec);
        for (s, &(cached, new)) in lens.iter().enumerate() {
            b.push(SequenceDesc::prompt(cached, new, &tables[s]));
        }
        let metadata = b.build().unwrap();
        let plan = attention.plan(&metadata, Some(&spec)).unwrap();
        let mut workspace = Workspace::empty(backend.device());
        workspace.reserve(&plan).unwrap();
        let t = metadata.num_tokens();
        let (q, k, v) = (
            random(&config.query_shape(t), seed),
            random(&config.kv_shape(t), seed + 1),
            random(&config.kv_shape(t), seed + 2),
        );
        let out = attention
            .forward(
                &plan,
                &mut workspace,
                Inputs::new(&q).with_kv(&k, &v).with_cache(&mut cache),
            )
            .unwrap();
        (q, k, v, out)
    };
    run([(0, 7), (0, 5)], 1);
    let (q, k, v, out) = run([(7, 3), (5, 1)], 4);
    let seqs = [
        CheckedSeq {
            cached: 7,
            new: 3,
            table: &tables[0],
        },
        CheckedSeq {
            cached: 5,
            new: 1,
            table: &tables[1],
        },
    ];
    let mut verifier = Verifier::new(VerifyMode::Every, 0).unwrap();
    let check = |verifier: &mut Verifier, seqs: &[CheckedSeq<'_>], out: &Tensor| {
        verifier
            .check(
                (1, 0),
                backend.as_ref(),
                &config,
                &cache,
                seqs,
                (&q, &k, &v),
                out,
            )
            .unwrap()
    };
    assert_eq!(check(&mut verifier, &seqs, &out), Ok(()));
    let mut poisoned = out.to_f32_vec().unwrap();
    poisoned[5] += 0.5;
    let poisoned = Tensor::from_f32(DType::BF16, out.shape(), &poisoned).unwrap();
    let err = check(&mut verifier, &seqs, &poisoned).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("verification failed at step 1, layer 0"),
        "{err}"
    );
    // A table that names the other sequence's first block: the dense copy differs.
    let wrong: Vec<BlockId> = vec![4, 2, 6];
    let seqs_wrong = [
        CheckedSeq {
            table: &wrong,
            ..seqs[0]
        },
        seqs[1],
    ];
    assert!(check(&mut verifier, &seqs_wrong, &out).is_err());
    assert_eq!(verifier.counts().calls_checked, 3);
    // A NaN in the query: the model's, not the attention's, and said so.
    let mut nan = q.to_f32_vec().unwrap();
    nan[7] = f32::NAN;
    let nan = Tensor::from_f32(DType::BF16, q.shape(), &nan).unwrap();
    let err = verifier
        .check(
            (1, 0),
            backend.as_ref(),
            &config,
            &cache,
            &seqs,
            (&nan, &k, &v),
            &out,
        )
        .unwrap()
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("layer 0 at step 1 was given a non-finite query, key or value"),
        "{err}"
    );
}
