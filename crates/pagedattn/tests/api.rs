//! Golden values, every error path of the public API, and cache round trips.

use pagedattn::*;

fn spec(num_blocks: usize, kv_cache_dtype: KvCacheDtype) -> KvCacheSpec {
    KvCacheSpec {
        num_blocks,
        block_size: 4,
        num_kv_heads: 2,
        head_size: 8,
        dtype: DType::F16,
        kv_cache_dtype,
    }
}

fn ramp(dtype: DType, shape: &[usize], offset: f32) -> Tensor {
    let n: usize = shape.iter().product();
    let values: Vec<f32> = (0..n)
        .map(|i| ((i as f32 * 0.37 + offset).sin()) * 3.0)
        .collect();
    Tensor::from_f32(dtype, shape, &values).unwrap()
}

fn assert_invalid(result: Result<impl std::fmt::Debug>, field: &str) {
    match result {
        Err(Error::Invalid { field: f, .. }) => {
            assert!(f.contains(field), "field {f:?}, expected {field:?}")
        }
        other => panic!("expected Invalid({field}), got {other:?}"),
    }
}

fn assert_unsupported(result: Result<impl std::fmt::Debug>, feature: &str) {
    match result {
        Err(Error::Unsupported { feature: f, .. }) => {
            assert!(f.contains(feature), "{f:?} vs {feature:?}")
        }
        other => panic!("expected Unsupported({feature}), got {other:?}"),
    }
}

#[test]
fn bloom_slopes_golden() {
    let p = |e: f64| 2f64.powf(e) as f32;
    assert_eq!(
        alibi_slopes_bloom(8),
        (1..=8).map(|k| p(-(k as f64))).collect::<Vec<_>>()
    );
    assert_eq!(
        alibi_slopes_bloom(5),
        vec![0.25, 0.0625, 0.015625, 0.00390625, 0.5]
    );
    let s12 = alibi_slopes_bloom(12);
    let want12: Vec<f32> = (1..=8)
        .map(|k| p(-(k as f64)))
        .chain([p(-0.5), p(-1.5), p(-2.5), p(-3.5)])
        .collect();
    for (a, b) in s12.iter().zip(&want12) {
        assert!((a / b - 1.0).abs() < 1e-6, "{s12:?} vs {want12:?}");
    }
    // Bloom-560m: 16 heads, slopes 2^(-k/2).
    for (k, s) in alibi_slopes_bloom(16).iter().enumerate() {
        assert!((s / p(-(k as f64 + 1.0) / 2.0) - 1.0).abs() < 1e-6);
    }
    assert!(alibi_slopes_bloom(0).is_empty());
}

#[test]
fn mpt_slopes_golden() {
    let p = |e: i32| 2f32.powi(e);
    assert_eq!(
        alibi_slopes_mpt(8, 8.0),
        (1..=8).map(|k| p(-k)).collect::<Vec<_>>()
    );
    assert_eq!(
        alibi_slopes_mpt(6, 8.0),
        vec![p(-2), p(-4), p(-6), p(-8), p(-1), p(-3)]
    );
    assert_eq!(
        alibi_slopes_mpt(4, 16.0),
        vec![p(-4), p(-8), p(-12), p(-16)]
    );
}

#[test]
fn config_errors_name_the_field() {
    assert_invalid(AttentionConfig::builder(0, 64).build(), "num_heads");
    assert_invalid(AttentionConfig::builder(8, 0).build(), "head_size");
    assert_invalid(
        AttentionConfig::builder(8, 64).num_kv_heads(3).build(),
        "num_kv_heads",
    );
    assert_invalid(
        AttentionConfig::builder(8, 64).num_kv_heads(0).build(),
        "num_kv_heads",
    );
    assert_invalid(
        AttentionConfig::builder(8, 64).scale(f32::NAN).build(),
        "scale",
    );
    assert_invalid(
        AttentionConfig::builder(8, 64)
            .alibi_slopes(Some(vec![0.5; 7]))
            .build(),
        "alibi_slopes",
    );
    let mut slopes = vec![0.5; 8];
    slopes[3] = f32::INFINITY;
    assert_invalid(
        AttentionConfig::builder(8, 64)
            .alibi_slopes(Some(slopes))
            .build(),
        "alibi_slopes[3]",
    );
    assert_invalid(
        AttentionConfig::builder(8, 64)
            .sliding_window(Some(0))
            .build(),
        "sliding_window",
    );
    assert_invalid(
        AttentionConfig::builder(8, 64)
            .logits_soft_cap(Some(-1.0))
            .build(),
        "logits_soft_cap",
    );
    for t in [
        AttnType::Encoder,
        AttnType::EncoderOnly,
        AttnType::EncoderDecoder,
    ] {
        let r = AttentionConfig::builder(8, 64)
            .attn_type(t)
            .sliding_window(Some(4))
            .build();
        assert_unsupported(r, "sliding window");
    }
    let c = AttentionConfig::builder(8, 64)
        .logits_soft_cap(Some(0.0))
        .build()
        .unwrap();
    assert_eq!(
        c.logits_soft_cap(),
        None,
        "a cap of 0 disables capping, as in vLLM"
    );
    assert!((c.scale() - 0.125).abs() < 1e-9);
    assert_invalid("cross".parse::<AttnType>(), "attn_type");
    assert_invalid("fp4".parse::<KvCacheDtype>(), "kv_cache_dtype");
    assert_eq!(
        "fp8".parse::<KvCacheDtype>().unwrap(),
        KvCacheDtype::Fp8E4m3
    );
}

#[test]
fn cache_write_errors() {
    let mut cache = KvCache::zeros(spec(3, KvCacheDtype::Auto), CacheLayout::Nhd).unwrap();
    let (k, v) = (
        ramp(DType::F16, &[2, 2, 8], 0.0),
        ramp(DType::F16, &[2, 2, 8], 1.0),
    );
    let ok = KvScales::ONE;
    assert_invalid(cache.write(&k, &v, &[0, 12], ok), "slot_mapping[1]");
    assert_invalid(cache.write(&k, &v, &[-2, 1], ok), "slot_mapping[0]");
    assert_invalid(cache.write(&k, &v, &[0], ok), "slot_mapping.len()");
    let k32 = ramp(DType::F32, &[2, 2, 8], 0.0);
    assert_invalid(cache.write(&k32, &v, &[0, 1], ok), "key.dtype");
    let wide = ramp(DType::F16, &[2, 3, 8], 0.0);
    assert_invalid(cache.write(&wide, &v, &[0, 1], ok), "key.shape");
    let scaled = KvScales {
        k_scale: 2.0,
        v_scale: 1.0,
    };
    assert_invalid(cache.write(&k, &v, &[0, 1], scaled), "k_scale");
    let mut fp8 = KvCache::zeros(spec(3, KvCacheDtype::Fp8E4m3), CacheLayout::Nhd).unwrap();
    let bad = KvScales {
        k_scale: 0.0,
        v_scale: 1.0,
    };
    assert_invalid(fp8.write(&k, &v, &[0, 1], bad), "k_scale");
    fp8.write(&k, &v, &[0, 1], scaled).unwrap();
    assert_invalid(
        KvCache::zeros(
            KvCacheSpec {
                block_size: 0,
                ..spec(1, KvCacheDtype::Auto)
            },
            CacheLayout::Nhd,
        ),
        "block_size",
    );
}

#[test]
fn slot_minus_one_is_skipped_and_fp8_quantizes_with_scale() {
    let s = spec(2, KvCacheDtype::Fp8E5m2);
    let mut cache = KvCache::zeros(s, CacheLayout::Hnd).unwrap();
    let (k, v) = (
        ramp(DType::F16, &[3, 2, 8], 0.0),
        ramp(DType::F16, &[3, 2, 8], 2.0),
    );
    let scales = KvScales {
        k_scale: 0.25,
        v_scale: 4.0,
    };
    cache.write(&k, &v, &[5, -1, 0], scales).unwrap();
    let (ck, cv) = cache.to_canonical().unwrap();
    let (HostStorage::U8(ck), HostStorage::U8(cv)) = (ck, cv) else {
        panic!("fp8 caches are bytes")
    };
    let (kf, vf) = (k.to_f32_vec().unwrap(), v.to_f32_vec().unwrap());
    for (token, slot) in [(0usize, 5usize), (2, 0)] {
        for e in 0..16 {
            assert_eq!(
                ck[slot * 16 + e],
                Fp8Format::E5m2.encode(kf[token * 16 + e] / 0.25)
            );
            assert_eq!(
                cv[slot * 16 + e],
                Fp8Format::E5m2.encode(vf[token * 16 + e] / 4.0)
            );
        }
    }
    let written: Vec<usize> = [5usize, 0]
        .iter()
        .flat_map(|s| s * 16..s * 16 + 16)
        .collect();
    assert!(
        ck.iter()
            .enumerate()
            .all(|(i, &b)| written.contains(&i) || b == 0),
        "slot -1 wrote nothing"
    );
}

#[test]
fn layout_round_trip() {
    for dtype in [KvCacheDtype::Auto, KvCacheDtype::Fp8E4m3] {
        let s = spec(3, dtype);
        let mut cache = KvCache::zeros(s, CacheLayout::Nhd).unwrap();
        let n = s.num_slots();
        let slots: Vec<i64> = (0..n as i64).collect();
        let scales = if dtype == KvCacheDtype::Auto {
            KvScales::ONE
        } else {
            KvScales {
                k_scale: 0.1,
                v_scale: 0.2,
            }
        };
        cache
            .write(
                &ramp(DType::F16, &[n, 2, 8], 0.0),
                &ramp(DType::F16, &[n, 2, 8], 5.0),
                &slots,
                scales,
            )
            .unwrap();
        let hnd = cache.to_layout(CacheLayout::Hnd).unwrap();
        assert_eq!(hnd.shape(), vec![2, 3, 2, 4, 8]);
        assert_ne!(
            hnd.key(),
            cache.key(),
            "the layouts order elements differently"
        );
        assert_eq!(hnd.to_canonical().unwrap(), cache.to_canonical().unwrap());
        let (k, v) = hnd.to_canonical().unwrap();
        assert_eq!(
            KvCache::from_canonical(s, CacheLayout::Hnd, k, v).unwrap(),
            hnd
        );
    }
}

fn filled(num_blocks: usize, layout: CacheLayout, offset: f32) -> KvCache {
    let s = spec(num_blocks, KvCacheDtype::Auto);
    let mut cache = KvCache::zeros(s, layout).unwrap();
    let n = s.num_slots();
    let slots: Vec<i64> = (0..n as i64).collect();
    cache
        .write(
            &ramp(DType::F16, &[n, 2, 8], offset),
            &ramp(DType::F16, &[n, 2, 8], offset + 9.0),
            &slots,
            KvScales::ONE,
        )
        .unwrap();
    cache
}

/// Block `b` of a cache's canonical key and value buffers, as bytes.
fn block(cache: &KvCache, b: usize) -> (Vec<u8>, Vec<u8>) {
    let bytes = cache.spec().block_elems() * 2;
    let (k, v) = cache.to_canonical().unwrap();
    (
        k.as_bytes()[b * bytes..(b + 1) * bytes].to_vec(),
        v.as_bytes()[b * bytes..(b + 1) * bytes].to_vec(),
    )
}

#[test]
fn swap_round_trip() {
    let backend = registry::backend("reference").unwrap();
    for layout in [CacheLayout::Nhd, CacheLayout::Hnd] {
        let device = filled(6, layout, 0.0);
        let mut host = KvCache::zeros(spec(3, KvCacheDtype::Auto), layout).unwrap();
        swap_blocks(&device, &mut host, &[(4, 0), (1, 2)]).unwrap();
        assert_eq!(block(&host, 0), block(&device, 4));
        assert_eq!(block(&host, 2), block(&device, 1));
        assert_eq!(block(&host, 1).0, vec![0; 128], "untouched block stays");
        let mut back = KvCache::zeros(spec(6, KvCacheDtype::Auto), layout).unwrap();
        backend
            .swap_in(
                std::slice::from_ref(&host),
                std::slice::from_mut(&mut back),
                &[(0, 4), (2, 1)],
            )
            .unwrap();
        assert_eq!(block(&back, 4), block(&device, 4));
        assert_eq!(block(&back, 1), block(&device, 1));
        assert_invalid(swap_blocks(&device, &mut host, &[(6, 0)]), "pairs[0].src");
        assert_invalid(
            swap_blocks(&device, &mut host, &[(0, 0), (0, 3)]),
            "pairs[1].dst",
        );
        let mut other = KvCache::zeros(
            KvCacheSpec {
                head_size: 4,
                ..spec(3, KvCacheDtype::Auto)
            },
            layout,
        )
        .unwrap();
        assert_invalid(swap_blocks(&device, &mut other, &[(0, 0)]), "dst cache");
    }
}

#[test]
fn copy_blocks_in_every_layer() {
    let backend = registry::backend("reference").unwrap();
    let originals: Vec<KvCache> = (0..3)
        .map(|l| filled(5, CacheLayout::Nhd, l as f32))
        .collect();
    let clone_all = |caches: &[KvCache]| -> Vec<KvCache> {
        caches.iter().map(|c| c.try_clone().unwrap()).collect()
    };
    let mut layers = clone_all(&originals);
    backend.copy_blocks(&mut layers, &[(0, 3), (2, 4)]).unwrap();
    for (layer, original) in layers.iter().zip(&originals) {
        assert_eq!(block(layer, 3), block(original, 0));
        assert_eq!(block(layer, 4), block(original, 2));
        for b in 0..3 {
            assert_eq!(block(layer, b), block(original, b));
        }
    }
    let before = clone_all(&layers);
    assert_invalid(copy_blocks(&mut layers, &[(0, 1), (0, 5)]), "pairs[1].dst");
    assert_eq!(layers, before, "a refused copy changes nothing");
}

#[test]
fn builder_derives_slots_and_checks_order() {
    let md = MetadataBuilder::new(4)
        .push(SequenceDesc::prompt(3, 2, &[7, 2]))
        .push(SequenceDesc::prompt(0, 1, &[5]))
        .push(SequenceDesc::decode(8, &[1, 0, 3]))
        .build()
        .unwrap();
    assert_eq!(md.num_prefills, 2);
    assert_eq!(md.num_prefill_tokens, 3);
    assert_eq!(md.num_decode_tokens, 1);
    assert_eq!(md.query_start_loc, vec![0, 2, 3, 4]);
    assert_eq!(md.seq_lens, vec![5, 1, 9]);
    assert_eq!(md.context_lens, vec![3, 0, 8]);
    assert_eq!(md.slot_mapping, vec![7 * 4 + 3, 2 * 4, 5 * 4, 3 * 4]);
    assert_eq!(md.block_tables.row(0), &[7, 2, 0]);
    assert_eq!((md.max_query_len, md.max_seq_len), (2, 9));

    let late_prefill = MetadataBuilder::new(4)
        .push(SequenceDesc::decode(2, &[0]))
        .push(SequenceDesc::prompt(0, 2, &[1]))
        .build();
    assert_invalid(late_prefill, "sequence 1");
    let short = MetadataBuilder::new(4)
        .push(SequenceDesc::prompt(3, 3, &[1]))
        .build();
    assert_invalid(short, "block_table.len()");
    let cross = MetadataBuilder::new(4)
        .write_cross_kv(true)
        .push(SequenceDesc::prompt(0, 2, &[]).with_encoder(5, &[3, 1]))
        .build()
        .unwrap();
    let enc = cross.encoder.unwrap();
    assert_eq!(enc.cross_slot_mapping, vec![12, 13, 14, 15, 4]);
    assert_eq!(
        cross.slot_mapping,
        vec![-1, -1],
        "no self-cache table: no slots"
    );
}

/// A valid decoder call to perturb.
struct Call {
    config: AttentionConfig,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cache: KvCache,
    md: AttentionMetadata,
    out: Tensor,
}

fn call() -> Call {
    let md = MetadataBuilder::new(4)
        .push(SequenceDesc::prompt(2, 3, &[1, 0]))
        .push(SequenceDesc::decode(5, &[2, 3]))
        .build()
        .unwrap();
    Call {
        config: AttentionConfig::builder(4, 8)
            .num_kv_heads(2)
            .build()
            .unwrap(),
        q: ramp(DType::F16, &[4, 4, 8], 0.0),
        k: ramp(DType::F16, &[4, 2, 8], 1.0),
        v: ramp(DType::F16, &[4, 2, 8], 2.0),
        cache: KvCache::zeros(spec(4, KvCacheDtype::Auto), CacheLayout::Nhd).unwrap(),
        md,
        out: Tensor::zeros(DType::F16, &[4, 4, 8]).unwrap(),
    }
}

impl Call {
    fn run(mut self) -> Result<Tensor> {
        let backend = registry::backend("reference")?;
        let attention = backend.attention(&self.config)?;
        let plan = attention.plan(&self.md, Some(self.cache.spec()))?;
        let mut workspace = backend.workspace(&plan)?;
        let inputs = Inputs::new(&self.q)
            .with_kv(&self.k, &self.v)
            .with_cache(&mut self.cache);
        attention.forward_into(&plan, &mut workspace, inputs, &mut self.out)?;
        Ok(self.out)
    }
}

#[test]
fn forward_errors() {
    call().run().unwrap();
    let mut c = call();
    c.q = ramp(DType::F16, &[4, 3, 8], 0.0);
    assert_invalid(c.run(), "query.shape");
    let mut c = call();
    c.out = Tensor::zeros(DType::F32, &[4, 4, 8]).unwrap();
    assert_invalid(c.run(), "output.dtype");
    let mut c = call();
    c.k = ramp(DType::F16, &[3, 2, 8], 0.0);
    assert_invalid(c.run(), "key.shape");
    let mut c = call();
    c.v = ramp(DType::F16, &[4, 1, 8], 0.0);
    assert_invalid(c.run(), "value.shape");
    let mut c = call();
    (c.k, c.v) = (
        ramp(DType::F16, &[3, 2, 8], 0.0),
        ramp(DType::F16, &[3, 2, 8], 0.0),
    );
    assert_invalid(c.run(), "key.shape");
    let mut c = call();
    c.cache = c.cache.to_layout(CacheLayout::Hnd).unwrap();
    assert_invalid(c.run(), "kv_cache.layout");
    let mut c = call();
    c.cache = KvCache::zeros(
        KvCacheSpec {
            dtype: DType::BF16,
            ..spec(4, KvCacheDtype::Auto)
        },
        CacheLayout::Nhd,
    )
    .unwrap();
    assert_invalid(c.run(), "kv_cache.dtype");
    let mut c = call();
    c.md.seq_lens[1] = 9;
    c.md.max_seq_len = 9;
    c.md.context_lens[1] = 8;
    assert_invalid(c.run(), "block_tables width");
    let mut c = call();
    c.md.slot_mapping[3] = 4;
    assert_invalid(c.run(), "slot_mapping[3]");
    let mut c = call();
    c.md.max_query_len = 7;
    assert_invalid(c.run(), "max_query_len");
    let mut c = call();
    c.md.query_start_loc = vec![0, 3, 2];
    assert_invalid(c.run(), "query_start_loc[2]");
    let mut c = call();
    c.config = AttentionConfig::builder(4, 8)
        .num_kv_heads(2)
        .attn_type(AttnType::EncoderOnly)
        .build()
        .unwrap();
    assert_invalid(c.run(), "kv_cache");
    let mut c = call();
    c.config = AttentionConfig::builder(4, 8)
        .num_kv_heads(2)
        .attn_type(AttnType::EncoderDecoder)
        .build()
        .unwrap();
    assert_invalid(c.run(), "metadata.encoder");
    assert_invalid(registry::backend("fastest").map(|b| b.name()), "backend");
    // `auto`: cuda where the driver sees a GPU, else cpu.
    #[cfg(feature = "cuda")]
    let gpu = pagedattn::cuda::gpu_present();
    #[cfg(not(feature = "cuda"))]
    let gpu = false;
    let auto = registry::backend("auto").unwrap();
    assert_eq!(auto.name(), if gpu { "cuda" } else { "cpu" });
}

#[test]
fn plan_and_workspace_errors() {
    let backend = registry::backend("cpu").unwrap();
    let c = call();
    let attention = backend.attention(&c.config).unwrap();
    // The builder's block size (4) against a cache of blocks of 8: named directly.
    let spec8 = KvCacheSpec {
        block_size: 8,
        ..spec(4, KvCacheDtype::Auto)
    };
    assert_invalid(attention.plan(&c.md, Some(&spec8)), "metadata.block_size");

    let plan = attention.plan(&c.md, Some(c.cache.spec())).unwrap();
    let run = |attention: &dyn AttentionImpl, plan: &Plan, workspace: &mut Workspace| {
        let mut c = call();
        let cache = backend.load_kv_cache(&c.cache).unwrap();
        c.cache = cache;
        let inputs = Inputs::new(&c.q)
            .with_kv(&c.k, &c.v)
            .with_cache(&mut c.cache);
        attention.forward_into(plan, workspace, inputs, &mut c.out)
    };
    let mut workspace = backend.workspace(&plan).unwrap();
    run(&*attention, &plan, &mut workspace).unwrap();

    // A plan of another backend, or of a layer of another shape.
    let reference = registry::backend("reference").unwrap();
    let other_plan = reference
        .attention(&c.config)
        .unwrap()
        .plan(&c.md, Some(c.cache.spec()))
        .unwrap();
    assert_invalid(run(&*attention, &other_plan, &mut workspace), "plan");
    let mqa = AttentionConfig::builder(4, 8)
        .num_kv_heads(1)
        .build()
        .unwrap();
    let mqa_attention = backend.attention(&mqa).unwrap();
    assert_invalid(run(&*mqa_attention, &plan, &mut workspace), "plan");

    // The plan made without a cache, used with one.
    let encoder_md = MetadataBuilder::new(4)
        .push(SequenceDesc::prompt(0, 3, &[]))
        .push(SequenceDesc::decode(0, &[]))
        .build()
        .unwrap();
    let uncached_plan = attention.plan(&encoder_md, None).unwrap();
    assert_invalid(run(&*attention, &uncached_plan, &mut workspace), "kv_cache");

    // A workspace smaller than a split-K decode plan needs.
    let long = MetadataBuilder::new(4)
        .push(SequenceDesc::decode(4095, &(0..1024).collect::<Vec<_>>()))
        .build()
        .unwrap();
    let long_plan = attention
        .plan(&long, Some(&spec(1024, KvCacheDtype::Auto)))
        .unwrap();
    if long_plan.workspace_bytes() > 0 {
        let mut small = Workspace::empty(Device::Cpu);
        let mut cache = backend
            .allocate_kv_cache(&spec(1024, KvCacheDtype::Auto))
            .unwrap();
        let (q, kv) = (
            ramp(DType::F16, &[1, 4, 8], 0.0),
            ramp(DType::F16, &[1, 2, 8], 1.0),
        );
        let mut out = Tensor::zeros(DType::F16, &[1, 4, 8]).unwrap();
        let inputs = Inputs::new(&q).with_kv(&kv, &kv).with_cache(&mut cache);
        let result = attention.forward_into(&long_plan, &mut small, inputs, &mut out);
        assert_invalid(result, "workspace bytes");
        small.reserve(&long_plan).unwrap();
        assert!(small.bytes() >= long_plan.workspace_bytes());
    }
}

#[test]
fn one_plan_serves_layers_that_differ_in_scale_and_soft_cap() {
    for name in ["reference", "cpu"] {
        let backend = registry::backend(name).unwrap();
        let c = call();
        let layers = [
            c.config.clone(),
            AttentionConfig::builder(4, 8)
                .num_kv_heads(2)
                .scale(0.5)
                .logits_soft_cap(Some(3.0))
                .build()
                .unwrap(),
        ];
        let first = backend.attention(&layers[0]).unwrap();
        let shared = first.plan(&c.md, Some(c.cache.spec())).unwrap();
        let mut workspace = backend.workspace(&shared).unwrap();
        for config in &layers {
            let attention = backend.attention(config).unwrap();
            let own = attention.plan(&c.md, Some(c.cache.spec())).unwrap();
            let mut outs = Vec::new();
            for plan in [&shared, &own] {
                let mut c = call();
                c.cache = backend.load_kv_cache(&c.cache).unwrap();
                let inputs = Inputs::new(&c.q)
                    .with_kv(&c.k, &c.v)
                    .with_cache(&mut c.cache);
                let out = attention.forward(plan, &mut workspace, inputs).unwrap();
                outs.push(out.to_f32_vec().unwrap());
            }
            assert_eq!(outs[0], outs[1], "{name}: shared plan vs the layer's own");
        }
    }
}

#[test]
fn fp8_scales_belong_to_fp8_caches() {
    let no_fp8 = AttentionConfig::builder(4, 8).kv_scales(0.5, 1.0).build();
    assert_invalid(no_fp8, "k_scale");
    let fp8 = AttentionConfig::builder(4, 8)
        .kv_cache_dtype(KvCacheDtype::Fp8E4m3)
        .kv_scales(0.5, 0.25)
        .build()
        .unwrap();
    assert_eq!(fp8.kv_scales().v_scale, 0.25);
    let spec = fp8.kv_cache_spec(DType::BF16, 3, 16);
    assert_eq!(
        (spec.num_kv_heads, spec.head_size, spec.kv_cache_dtype),
        (4, 8, KvCacheDtype::Fp8E4m3)
    );
}

#[test]
fn device_memory_needs_a_device() {
    // Without a usable GPU (or without the `cuda` feature), asking for GPU memory is an error
    // that says why, never a panic.
    match Tensor::zeros_on(Device::Cuda(0), DType::F32, &[4]) {
        Ok(t) => assert_eq!(t.device(), Device::Cuda(0)),
        Err(e) => assert!(
            matches!(e, Error::Driver(_) | Error::Unsupported { .. }),
            "{e:?}"
        ),
    }
    let host = Tensor::zeros(DType::F32, &[2, 3]).unwrap();
    assert_eq!(host.to_host().unwrap(), host);
    let overflow = Tensor::zeros_on(Device::Cpu, DType::F32, &[1 << 40, 1 << 40]);
    assert_invalid(overflow, "tensor shape");
}

// ---------------------------------------------------------------------------------------------
// The smoothings of issue 24: one type for block ids, borrowed tables, one way of counting,
// swap spaces from the cache's spec, swaps of every layer, shapes from the config, errors
// that read as one sentence.
// ---------------------------------------------------------------------------------------------

#[test]
fn block_ids_are_one_type_and_bad_ones_are_named() {
    // Tables and pairs hold the same `BlockId`: a table's entries are pairs' ids as they are.
    let table: Vec<BlockId> = vec![4, 1];
    let md = MetadataBuilder::new(4)
        .push(SequenceDesc::prompt(0, 6, &table))
        .build()
        .unwrap();
    let row: &[BlockId] = md.block_tables.row(0);
    let pairs: Vec<(BlockId, BlockId)> = row.iter().map(|&b| (b, b + 1)).collect();
    assert_eq!(pairs, [(4, 5), (1, 2)]);

    let backend = registry::backend("reference").unwrap();
    let mut layers = vec![
        filled(6, CacheLayout::Nhd, 0.0),
        filled(6, CacheLayout::Nhd, 1.0),
    ];
    let before: Vec<KvCache> = layers.iter().map(|c| c.try_clone().unwrap()).collect();
    let refused = |result: Result<()>, field: &str, value: &str| match result {
        Err(Error::Invalid {
            field: f, value: v, ..
        }) => assert_eq!((f.as_str(), v.as_str()), (field, value)),
        other => panic!("expected Invalid({field} = {value}), got {other:?}"),
    };
    refused(
        backend.copy_blocks(&mut layers, &[(0, 1), (-1, 2)]),
        "pairs[1].src",
        "-1",
    );
    refused(
        backend.copy_blocks(&mut layers, &[(0, 6)]),
        "pairs[0].dst",
        "6",
    );
    refused(
        backend.copy_blocks(&mut layers, &[(BlockId::MIN, 0)]),
        "pairs[0].src",
        &BlockId::MIN.to_string(),
    );
    assert_eq!(layers, before, "a refused copy changes nothing");
    let mut host = KvCache::zeros(spec(3, KvCacheDtype::Auto), CacheLayout::Nhd).unwrap();
    refused(
        swap_blocks(&layers[0], &mut host, &[(2, -3)]),
        "pairs[0].dst",
        "-3",
    );
    let mut swaps = vec![backend.allocate_swap_space(layers[0].spec(), 3).unwrap()];
    refused(
        backend.swap_out(&layers[..1], &mut swaps, &[(-2, 0)]),
        "pairs[0].src of layer 0",
        "-2",
    );
    refused(
        backend.swap_in(&swaps, &mut layers[..1], &[(0, 0), (3, 1)]),
        "pairs[1].src of layer 0",
        "3",
    );
}

#[test]
fn sequences_borrow_their_tables_step_after_step() {
    // The engine's tables live across steps; each step's descriptions borrow them.
    let mut tables: Vec<Vec<BlockId>> = vec![vec![7], vec![2]];
    let (mut cached, mut free) = ([0usize, 0], 10..);
    for step in 0..6 {
        let new = if step == 0 { [3, 4] } else { [1, 1] };
        for ((table, &c), n) in tables.iter_mut().zip(&cached).zip(new) {
            // Block growth: a new block when the step's tokens pass the last one.
            if table.len() * 4 < c + n {
                table.push(free.next().unwrap());
            }
        }
        let mut builder = MetadataBuilder::new(4);
        for ((table, &c), n) in tables.iter().zip(&cached).zip(new) {
            builder.push(if step == 0 {
                SequenceDesc::prompt(c, n, table)
            } else {
                SequenceDesc::decode(c, table)
            });
        }
        let md = builder.build().unwrap();
        for (s, table) in tables.iter().enumerate() {
            assert_eq!(&md.block_tables.row(s)[..table.len()], table.as_slice());
            assert_eq!(md.context_lens[s] as usize, cached[s]);
        }
        for (c, n) in cached.iter_mut().zip(new) {
            *c += n;
        }
    }
    assert_eq!(tables, [vec![7, 11], vec![2, 10, 12]]);
    assert_eq!(cached, [8, 9]);
}

#[test]
fn prompt_and_decode_count_cached_then_new_tokens() {
    let table: [BlockId; 3] = [5, 0, 2];
    let build = |seq: SequenceDesc<'_>| MetadataBuilder::new(4).push(seq).build();
    // decode(c) is one new token after c cached ones: prompt(c, 1) but for the decode flag.
    for cached in [0, 3, 4, 11] {
        let decode = build(SequenceDesc::decode(cached, &table)).unwrap();
        let prompt = build(SequenceDesc::prompt(cached, 1, &table)).unwrap();
        assert_eq!(
            (decode.context_lens[0], decode.seq_lens[0]),
            (cached as i32, cached as i32 + 1)
        );
        assert_eq!(decode.slot_mapping, prompt.slot_mapping);
        assert_eq!(
            decode.slot_mapping[0],
            table[cached / 4] as i64 * 4 + (cached % 4) as i64
        );
        assert_eq!((decode.num_prefills, prompt.num_prefills), (0, 1));
    }
    // decode(0): a sequence's first token; a decode needing a 4th block is too long a table.
    assert_eq!(
        build(SequenceDesc::decode(0, &[9])).unwrap().slot_mapping,
        [36]
    );
    assert_invalid(
        build(SequenceDesc::decode(12, &table)),
        "sequence 0 block_table.len()",
    );

    // No new token: nothing to compute, refused whichever way it is described.
    let empty = |result: Result<AttentionMetadata>| match result {
        Err(e @ Error::Invalid { .. }) => {
            let Error::Invalid { field, value, .. } = &e else {
                unreachable!()
            };
            assert_eq!(
                (field.as_str(), value.as_str()),
                ("sequence 1 query_len", "0")
            );
            assert!(e.to_string().contains("at least 1 new token"), "{e}");
        }
        other => panic!("an empty sequence was not refused: {other:?}"),
    };
    let two = |seq: SequenceDesc<'_>| {
        MetadataBuilder::new(4)
            .push(SequenceDesc::prompt(0, 2, &[1]))
            .push(seq)
            .build()
    };
    empty(two(SequenceDesc::prompt(5, 0, &table)));
    empty(two(SequenceDesc::prompt(0, 0, &[])));
    empty(two(SequenceDesc {
        query_len: 0,
        ..SequenceDesc::decode(3, &table)
    }));
    empty(two(SequenceDesc::prompt(0, 0, &[]).with_encoder(3, &[])));

    // The encoder variants: an empty encoder side is fine (its queries see no key), and an
    // encoder-only batch is prompts without tables.
    let cross = MetadataBuilder::new(4)
        .write_cross_kv(true)
        .push(SequenceDesc::prompt(0, 2, &[]).with_encoder(0, &[]))
        .push(SequenceDesc::decode(6, &[]).with_encoder(5, &[3, 1]))
        .build()
        .unwrap();
    let enc = cross.encoder.as_ref().unwrap();
    assert_eq!(enc.encoder_seq_lens, [0, 5]);
    assert_eq!(enc.cross_slot_mapping, [12, 13, 14, 15, 4]);
    assert_eq!(
        (cross.seq_lens.as_slice(), cross.num_prefills),
        ([2, 7].as_slice(), 1)
    );
    let backend = registry::backend("reference").unwrap();
    let config = AttentionConfig::builder(2, 8)
        .attn_type(AttnType::EncoderOnly)
        .build()
        .unwrap();
    let md = MetadataBuilder::new(4)
        .push(SequenceDesc::prompt(0, 3, &[]))
        .push(SequenceDesc::prompt(0, 1, &[]))
        .build()
        .unwrap();
    let attention = backend.attention(&config).unwrap();
    let plan = attention.plan(&md, None).unwrap();
    let mut workspace = backend.workspace(&plan).unwrap();
    let q = ramp(DType::F32, &config.query_shape(4), 0.0);
    let kv = ramp(DType::F32, &config.kv_shape(4), 1.0);
    let out = attention
        .forward(&plan, &mut workspace, Inputs::new(&q).with_kv(&kv, &kv))
        .unwrap();
    // The second sequence's one token sees only itself: its output is its value.
    assert_eq!(
        out.to_f32_vec().unwrap()[48..],
        kv.to_f32_vec().unwrap()[48..]
    );
}

#[test]
fn swap_spaces_come_from_the_cache_spec() {
    let spec = spec(6, KvCacheDtype::Fp8E4m3);
    assert_eq!(
        spec.with_num_blocks(2),
        KvCacheSpec {
            num_blocks: 2,
            ..spec
        }
    );
    for name in ["reference", "cpu"] {
        let backend = registry::backend(name).unwrap();
        let cache = backend.allocate_kv_cache(&spec).unwrap();
        let swap = backend.allocate_swap_space(cache.spec(), 2).unwrap();
        assert_eq!(swap.spec(), &spec.with_num_blocks(2), "{name}");
        assert_eq!(swap.layout(), backend.kv_cache_layout(), "{name}");
        assert_eq!(swap.device(), backend.swap_device(), "{name}");
        // The spec is checked as a cache's is.
        let bytes = KvCacheSpec {
            dtype: DType::U8,
            ..spec
        };
        assert_invalid(backend.allocate_swap_space(&bytes, 2), "kv_cache.dtype");
    }
}

#[test]
fn swaps_move_every_layer_in_one_call() {
    for name in ["reference", "cpu"] {
        let backend = registry::backend(name).unwrap();
        let layout = backend.kv_cache_layout();
        // Three layers of 6 blocks, each with its own contents; swap spaces of 3 blocks.
        let originals: Vec<KvCache> = (0..3).map(|l| filled(6, layout, l as f32 * 5.0)).collect();
        let mut caches: Vec<KvCache> = originals.iter().map(|c| c.try_clone().unwrap()).collect();
        let mut swaps: Vec<KvCache> = caches
            .iter()
            .map(|c| backend.allocate_swap_space(c.spec(), 3).unwrap())
            .collect();
        backend
            .swap_out(&caches, &mut swaps, &[(4, 0), (1, 2)])
            .unwrap();
        for (swap, original) in swaps.iter().zip(&originals) {
            assert_eq!(block(swap, 0), block(original, 4), "{name}");
            assert_eq!(block(swap, 2), block(original, 1), "{name}");
            assert_eq!(block(swap, 1).0, vec![0; 128], "{name}: untouched");
        }
        // The sequence's blocks come back elsewhere: blocks 0 and 5 of every layer.
        backend
            .swap_in(&swaps, &mut caches, &[(0, 0), (2, 5)])
            .unwrap();
        for (cache, original) in caches.iter().zip(&originals) {
            assert_eq!(block(cache, 0), block(original, 4), "{name}");
            assert_eq!(block(cache, 5), block(original, 1), "{name}");
            for b in 1..5 {
                assert_eq!(block(cache, b), block(original, b), "{name}");
            }
        }

        // One swap space per layer, or an error naming both counts.
        match backend.swap_out(&caches, &mut swaps[..2], &[(0, 0)]) {
            Err(Error::Invalid {
                field,
                value,
                expected,
            }) => {
                assert_eq!((field.as_str(), value.as_str()), ("swaps.len()", "2"));
                assert!(expected.contains("caches.len() = 3"), "{expected}");
            }
            other => panic!("{name}: {other:?}"),
        }
        // Every layer is checked before any is copied: a swap space of 1 block in layer 2
        // refuses the whole swap, and layers 0 and 1 keep what they had.
        let before: Vec<KvCache> = swaps.iter().map(|s| s.try_clone().unwrap()).collect();
        swaps[2] = backend.allocate_swap_space(caches[2].spec(), 1).unwrap();
        let mut expected = before;
        expected[2] = swaps[2].try_clone().unwrap();
        assert_invalid(
            backend.swap_out(&caches, &mut swaps, &[(3, 1)]),
            "pairs[0].dst of layer 2",
        );
        assert_eq!(swaps, expected, "{name}: a refused swap changes nothing");
    }
}

#[test]
fn shapes_and_zeroed_tensors_come_from_the_config() {
    let config = AttentionConfig::builder(8, 16)
        .num_kv_heads(2)
        .build()
        .unwrap();
    assert_eq!(config.query_shape(5), [5, 8, 16]);
    assert_eq!(config.kv_shape(5), [5, 2, 16]);
    let q = config.zeros_query(Device::Cpu, DType::BF16, 5).unwrap();
    let k = config.zeros_kv(Device::Cpu, DType::BF16, 5).unwrap();
    assert_eq!(
        (q.shape(), q.dtype(), q.device()),
        (&[5, 8, 16][..], DType::BF16, Device::Cpu)
    );
    assert_eq!((k.shape(), k.dtype()), (&[5, 2, 16][..], DType::BF16));
    assert!(q.to_f32_vec().unwrap().iter().all(|&x| x == 0.0));
    assert_invalid(
        config.zeros_query(Device::Cpu, DType::F32, usize::MAX),
        "tensor shape",
    );
    // They are what a forward takes: a decode of one token writes its output in place.
    let backend = registry::backend("cpu").unwrap();
    let spec = config.kv_cache_spec(DType::BF16, 2, 4);
    let mut cache = backend.allocate_kv_cache(&spec).unwrap();
    let md = MetadataBuilder::for_cache(&spec)
        .push(SequenceDesc::decode(0, &[1]))
        .build()
        .unwrap();
    let attention = backend.attention(&config).unwrap();
    let plan = attention.plan(&md, Some(&spec)).unwrap();
    let mut workspace = backend.workspace(&plan).unwrap();
    let q = ramp(DType::BF16, &config.query_shape(1), 0.0);
    let v = ramp(DType::BF16, &config.kv_shape(1), 3.0);
    let mut out = config
        .zeros_query(backend.device(), DType::BF16, 1)
        .unwrap();
    let inputs = Inputs::new(&q).with_kv(&v, &v).with_cache(&mut cache);
    attention
        .forward_into(&plan, &mut workspace, inputs, &mut out)
        .unwrap();
    // One key: every query head's output is its kv head's value.
    let (out, v) = (out.to_f32_vec().unwrap(), v.to_f32_vec().unwrap());
    for h in 0..8 {
        assert_eq!(out[h * 16..][..16], v[(h / 4) * 16..][..16]);
    }
}

#[test]
fn errors_read_as_one_sentence() {
    let reference = registry::backend("reference").unwrap();
    let f16_cache = |blocks| KvCache::zeros(spec(blocks, KvCacheDtype::Auto), CacheLayout::Nhd);
    let mut errors: Vec<Error> = Vec::new();
    // A swap between caches of other geometries: both specs described.
    let mut other = KvCache::zeros(
        KvCacheSpec {
            head_size: 4,
            ..spec(3, KvCacheDtype::Fp8E5m2)
        },
        CacheLayout::Nhd,
    )
    .unwrap();
    errors.push(swap_blocks(&f16_cache(6).unwrap(), &mut other, &[(0, 0)]).unwrap_err());
    // A cache of another geometry than the plan's (made for the call's cache of 4 blocks).
    let c = call();
    let attention = reference.attention(&c.config).unwrap();
    let plan = attention.plan(&c.md, Some(c.cache.spec())).unwrap();
    let mut workspace = reference.workspace(&plan).unwrap();
    let mut five = f16_cache(5).unwrap();
    let mut out = c.out;
    let inputs = Inputs::new(&c.q).with_kv(&c.k, &c.v).with_cache(&mut five);
    errors.push(
        attention
            .forward_into(&plan, &mut workspace, inputs, &mut out)
            .unwrap_err(),
    );
    // A plan of another layer shape.
    let c = call();
    let window = AttentionConfig::builder(4, 8)
        .num_kv_heads(2)
        .sliding_window(Some(3))
        .build()
        .unwrap();
    let plan = reference
        .attention(&window)
        .unwrap()
        .plan(&c.md, Some(c.cache.spec()))
        .unwrap();
    let mut c = call();
    let attention = reference.attention(&c.config).unwrap();
    let mut workspace = reference.workspace(&plan).unwrap();
    let inputs = Inputs::new(&c.q)
        .with_kv(&c.k, &c.v)
        .with_cache(&mut c.cache);
    errors.push(
        attention
            .forward_into(&plan, &mut workspace, inputs, &mut c.out)
            .unwrap_err(),
    );
    // A cache in another layout, a device mismatch, an unsupported feature, a bad file.
    let mut c = call();
    c.cache = c.cache.to_layout(CacheLayout::Hnd).unwrap();
    errors.push(c.run().unwrap_err());
    errors.push(Error::device_mismatch(
        "swaps[0]",
        Device::Cuda(0),
        "cpu (the backend's swap space)",
    ));
    // (An instruction set of the other architecture: unsupported on every machine, GPU or
    // not.)
    let foreign = if cfg!(target_arch = "aarch64") {
        cpu::Isa::Avx2
    } else {
        cpu::Isa::Neon
    };
    errors.push(cpu::Cpu::with_isa(foreign).map(drop).unwrap_err());
    errors.push(pagedattn::replay::read_case(b"not a safetensors file").unwrap_err());
    errors.push(
        MetadataBuilder::new(4)
            .push(SequenceDesc::prompt(2, 0, &[0]))
            .build()
            .unwrap_err(),
    );

    for e in &errors {
        let (display, debug) = (e.to_string(), format!("{e:?}"));
        // Debug is what `fn main() -> Result<(), pagedattn::Error>` prints of an error.
        assert_eq!(debug, display, "Debug prints the message");
        assert!(!display.contains('\n'), "one line: {display}");
        assert!(!display.contains("{ "), "no struct dump: {display}");
        assert!(
            !display.contains("KvCacheSpec"),
            "no struct dump: {display}"
        );
        assert!(!display.is_empty());
    }
    let swap = errors[0].to_string();
    assert!(
        swap.contains("cache spec of 3 blocks of 4 slots, 2 kv heads, head size 4, f16 stored as fp8_e5m2 in layout Nhd")
            && swap.contains("cache spec of 6 blocks of 4 slots, 2 kv heads, head size 8, f16 in layout Nhd"),
        "{swap}"
    );
    let geometry = errors[1].to_string();
    assert!(
        geometry.contains("cache spec of 5 blocks") && geometry.contains("cache spec of 4 blocks"),
        "{geometry}"
    );
    let shape = errors[2].to_string();
    assert!(
        shape.contains("decoder layer of 4 heads (2 kv heads) of size 8, window 3, cache auto:")
            && shape.contains("decoder layer of 4 heads (2 kv heads) of size 8, cache auto"),
        "{shape}"
    );
    assert!(
        errors[3].to_string().contains("kv_cache.layout = Hnd"),
        "{}",
        errors[3]
    );
}

#[test]
fn caches_from_storages_check_their_buffers() {
    let s = spec(3, KvCacheDtype::Auto);
    let n = s.buffer_elems();
    let buf = |dtype, len| Storage::from(HostStorage::zeros(dtype, len).unwrap());
    // A buffer one element short, or of another dtype, would let a kernel read past it.
    assert_invalid(
        KvCache::from_storages(
            s,
            CacheLayout::Hnd,
            buf(DType::F16, n - 1),
            buf(DType::F16, n),
        ),
        "key_cache element count",
    );
    assert_invalid(
        KvCache::from_storages(s, CacheLayout::Hnd, buf(DType::F16, n), buf(DType::F32, n)),
        "value_cache dtype",
    );
    let fp8 = spec(3, KvCacheDtype::Fp8E4m3);
    assert_invalid(
        KvCache::from_storages(
            fp8,
            CacheLayout::Nhd,
            buf(DType::F16, n),
            buf(DType::F16, n),
        ),
        "key_cache dtype",
    );
    let cache = KvCache::from_storages(s, CacheLayout::Hnd, buf(DType::F16, n), buf(DType::F16, n))
        .unwrap();
    assert_eq!(
        (cache.layout(), cache.shape()),
        (CacheLayout::Hnd, vec![2, 3, 2, 4, 8])
    );
}
