//! The public constructors with arbitrary arguments: `Tensor::new` / `from_f32` /
//! `zeros_on`, `HostStorage::from_bytes`, `BlockTables`, `AttentionMetadata::from_parts` (then
//! planned), `KvCacheSpec` validation and the cache allocations, copies and swaps of a
//! geometry that validates (only when small), `KvCache::from_canonical`, and the
//! `AttentionConfig` builder with arbitrary sizes and floats (then a layer on every backend,
//! and a small call compared across them). An error is fine where the contract allows one;
//! a panic, an answer the contract does not give, or a disagreement between backends is not.

#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use pagedattn::{
    AttentionConfig, AttentionMetadata, AttnType, Backend, BlockId, BlockTables, CacheLayout,
    DType, Device, EncoderMetadata, Error, HostStorage, KvCache, KvCacheDtype, KvCacheSpec,
    MetadataBuilder, SequenceDesc, Tensor,
};
use pagedattn_fuzz::size::Size;
use pagedattn_fuzz::{compare_backends, fail, run, Answer, Rows};

/// The most elements a tensor of this target gets (an arbitrary shape's element count is
/// allocated only below it).
const ELEMS: usize = 1 << 16;

/// The most bytes a cache of this target gets, keys and values together, as computed from
/// its validated geometry.
const CACHE_BYTES: usize = 1 << 20;

/// The most query tokens metadata of this target is planned for: a plan's memory grows with
/// the tokens (the `cpu` backend's query tiles), which a real call's query tensor holds.
const PLAN_TOKENS: usize = 1 << 16;

#[derive(Debug, Arbitrary)]
enum Op {
    Tensor {
        dtype: Dtype,
        shape: Vec<Size>,
        len: u16,
    },
    FromF32 {
        dtype: Dtype,
        shape: Vec<Size>,
        values: Vec<f32>,
    },
    FromBytes {
        dtype: Dtype,
        bytes: Vec<u8>,
    },
    CopyFrom {
        dst: (Dtype, Vec<Size>),
        src: (Dtype, Vec<Size>, Vec<u8>),
    },
    BlockTables(Tables),
    TableRows(Vec<Vec<i32>>),
    Metadata(Box<Metadata>),
    Cache {
        spec: Spec,
        pairs: Vec<(Id, Id)>,
    },
    FromCanonical {
        spec: Spec,
        hnd: bool,
        key_dtype: Dtype,
        key: Vec<u8>,
        value: Vec<u8>,
    },
    Config(Config),
}

#[derive(Debug, Clone, Copy, Arbitrary)]
enum Dtype {
    F32,
    F16,
    BF16,
    U8,
}

impl Dtype {
    fn get(self) -> DType {
        match self {
            Dtype::F32 => DType::F32,
            Dtype::F16 => DType::F16,
            Dtype::BF16 => DType::BF16,
            Dtype::U8 => DType::U8,
        }
    }
}

#[derive(Debug, Clone, Copy, Arbitrary)]
enum CacheDtype {
    Auto,
    E4m3,
    E5m2,
}

impl CacheDtype {
    fn get(self) -> KvCacheDtype {
        match self {
            CacheDtype::Auto => KvCacheDtype::Auto,
            CacheDtype::E4m3 => KvCacheDtype::Fp8E4m3,
            CacheDtype::E5m2 => KvCacheDtype::Fp8E5m2,
        }
    }
}

#[derive(Debug, Clone, Copy, Arbitrary)]
struct Spec {
    num_blocks: Size,
    block_size: Size,
    num_kv_heads: Size,
    head_size: Size,
    dtype: Dtype,
    cache: CacheDtype,
}

impl Spec {
    fn get(self) -> KvCacheSpec {
        KvCacheSpec {
            num_blocks: self.num_blocks.get(),
            block_size: self.block_size.get(),
            num_kv_heads: self.num_kv_heads.get(),
            head_size: self.head_size.get(),
            dtype: self.dtype.get(),
            kv_cache_dtype: self.cache.get(),
        }
    }
}

/// `BlockTables::new`'s arguments.
#[derive(Debug, Arbitrary)]
struct Tables {
    rows: Size,
    width: Size,
    data: Vec<i32>,
}

impl Tables {
    fn get(self) -> pagedattn::Result<BlockTables> {
        BlockTables::new(self.rows.get(), self.width.get(), self.data)
    }
}

/// `EncoderMetadata`'s fields.
#[derive(Debug, Arbitrary)]
struct Encoder {
    lens: Vec<i32>,
    cross: Tables,
    slots: Vec<i64>,
}

#[derive(Debug, Arbitrary)]
struct Metadata {
    num_prefills: Size,
    query_start_loc: Vec<i32>,
    seq_lens: Vec<i32>,
    slot_mapping: Vec<i64>,
    tables: Tables,
    encoder: Option<Encoder>,
    attn_type: Attn,
    /// The cache the metadata is planned with, if any.
    cache: Option<Spec>,
}

#[derive(Debug, Clone, Copy, Arbitrary)]
enum Attn {
    Decoder,
    Encoder,
    EncoderOnly,
    EncoderDecoder,
}

impl Attn {
    fn get(self) -> AttnType {
        match self {
            Attn::Decoder => AttnType::Decoder,
            Attn::Encoder => AttnType::Encoder,
            Attn::EncoderOnly => AttnType::EncoderOnly,
            Attn::EncoderDecoder => AttnType::EncoderDecoder,
        }
    }
}

#[derive(Debug, Arbitrary)]
struct Config {
    num_heads: Size,
    head_size: Size,
    num_kv_heads: Option<Size>,
    scale: Option<f32>,
    k_scale: f32,
    v_scale: f32,
    soft_cap: Option<f32>,
    slopes: Option<Vec<f32>>,
    window: Option<Size>,
    attn_type: Attn,
    cache: CacheDtype,
    /// Seeds the data of the small call run with a config that builds.
    seed: u8,
}

fuzz_target!(|ops: Vec<Op>| {
    for op in ops {
        match op {
            Op::Tensor { dtype, shape, len } => tensor(dtype.get(), &sizes(&shape), len.into()),
            Op::FromF32 {
                dtype,
                shape,
                values,
            } => from_f32(dtype.get(), &sizes(&shape), &values),
            Op::CopyFrom { dst, src } => copy_from(
                (dst.0.get(), &sizes(&dst.1)),
                (src.0.get(), &sizes(&src.1), &src.2),
            ),
            Op::FromBytes { dtype, bytes } => {
                let dtype = dtype.get();
                let storage = HostStorage::from_bytes(dtype, &bytes);
                assert_eq!(
                    storage.is_ok(),
                    bytes.len().is_multiple_of(dtype.size_bytes())
                );
                if let Ok(s) = storage {
                    assert_eq!((s.dtype(), s.as_bytes()), (dtype, bytes.as_slice()));
                }
            }
            Op::BlockTables(Tables { rows, width, data }) => {
                block_tables(rows.get(), width.get(), data)
            }
            Op::TableRows(rows) => {
                let t = BlockTables::from_rows(&rows);
                let width = rows.iter().map(Vec::len).max().unwrap_or(0);
                assert_eq!((t.num_rows(), t.width()), (rows.len(), width));
                for (s, row) in rows.iter().enumerate() {
                    assert_eq!(&t.row(s)[..row.len()], row.as_slice());
                    assert!(t.row(s)[row.len()..].iter().all(|&x| x == 0));
                }
            }
            Op::Metadata(m) => metadata(*m),
            Op::Cache { spec, pairs } => cache(spec.get(), &pairs),
            Op::FromCanonical {
                spec,
                hnd,
                key_dtype,
                key,
                value,
            } => from_canonical(spec.get(), hnd, key_dtype.get(), &key, &value),
            Op::Config(c) => config(c),
        }
    }
});

fn sizes(dims: &[Size]) -> Vec<usize> {
    dims.iter().map(|d| d.get()).collect()
}

/// The element count of `shape`, if it fits in usize.
fn numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
}

fn tensor(dtype: DType, shape: &[usize], len: usize) {
    let t = Tensor::new(
        shape.to_vec(),
        HostStorage::zeros(dtype, len).expect("a small buffer"),
    );
    assert_eq!(
        t.is_ok(),
        numel(shape) == Some(len),
        "Tensor::new({shape:?}, {len} elements)"
    );
    if let Ok(t) = t {
        assert_eq!((t.shape(), t.numel(), t.dtype()), (shape, len, dtype));
        assert_eq!(t.to_f32_vec().expect("host tensor").len(), len);
        let mut copy = t.try_clone().expect("host tensor");
        assert_eq!(copy, t);
        copy.fill_nan().expect("host tensor");
    }
    // An element count that overflows is an error; one that fits is allocated only when small.
    match numel(shape) {
        None => assert!(Tensor::zeros_on(Device::Cpu, dtype, shape).is_err()),
        Some(n) if n <= ELEMS => {
            let z = Tensor::zeros_on(Device::Cpu, dtype, shape).expect("a small tensor");
            assert_eq!((z.numel(), z.shape()), (n, shape));
        }
        Some(_) => {}
    }
}

/// `Tensor::copy_from` between small host tensors: a copy exactly when dtype and shape agree,
/// the destination then holding the source's bytes; otherwise an error, the destination
/// unchanged.
fn copy_from(dst: (DType, &[usize]), src: (DType, &[usize], &[u8])) {
    let small = |shape: &[usize]| numel(shape).filter(|&n| n <= ELEMS);
    let (Some(_), Some(n)) = (small(dst.1), small(src.1)) else {
        return;
    };
    let mut bytes = src.2.to_vec();
    bytes.resize(n * src.0.size_bytes(), 0);
    let source = HostStorage::from_bytes(src.0, &bytes).expect("whole elements");
    let source = Tensor::new(src.1.to_vec(), source).expect("a matching count");
    let mut target = Tensor::zeros_on(Device::Cpu, dst.0, dst.1).expect("a small tensor");
    let before = target.try_clone().expect("host tensor");
    let copied = target.copy_from(&source);
    assert_eq!(copied.is_ok(), (dst.0, dst.1) == (src.0, src.1));
    let want = if copied.is_ok() { &source } else { &before };
    let bytes = |t: &Tensor| t.host().expect("host tensor").as_bytes().to_vec();
    assert_eq!(bytes(&target), bytes(want));
}

fn from_f32(dtype: DType, shape: &[usize], values: &[f32]) {
    let t = Tensor::from_f32(dtype, shape, values);
    let expected = dtype.is_float() && numel(shape) == Some(values.len());
    assert_eq!(
        t.is_ok(),
        expected,
        "Tensor::from_f32({dtype}, {shape:?}, {} values)",
        values.len()
    );
    if let Ok(t) = t {
        let back = t.to_f32_vec().expect("host tensor");
        for (&x, &y) in values.iter().zip(&back) {
            // Rounded to nearest: the same class, and at most half a bf16 ulp away (the
            // coarsest dtype), or overflowed to the infinity of the same sign.
            let close = x == y
                || (x.is_nan() && y.is_nan())
                || (y.is_infinite() && y.signum() == x.signum())
                || (x - y).abs() <= x.abs() * 2f32.powi(-8) + 2f32.powi(-24);
            assert!(close, "{dtype}: {x:e} became {y:e}");
        }
    }
}

fn block_tables(rows: usize, width: usize, data: Vec<i32>) {
    let len = data.len();
    let t = BlockTables::new(rows, width, data.clone());
    assert_eq!(
        t.is_ok(),
        rows.checked_mul(width) == Some(len),
        "BlockTables::new({rows}, {width}, {len})"
    );
    if let Ok(t) = t {
        assert_eq!(
            (t.num_rows(), t.width(), t.as_slice()),
            (rows, width, data.as_slice())
        );
        if rows > 0 {
            assert_eq!(t.row(rows - 1).len(), width);
        }
    }
}

fn metadata(m: Metadata) {
    let Ok(tables) = m.tables.get() else {
        return;
    };
    let encoder = match m.encoder {
        Some(Encoder { lens, cross, slots }) => match cross.get() {
            Ok(cross_block_tables) => Some(EncoderMetadata {
                encoder_seq_lens: lens,
                cross_block_tables,
                cross_slot_mapping: slots,
            }),
            Err(_) => return,
        },
        None => None,
    };
    let Ok(md) = AttentionMetadata::from_parts(
        m.num_prefills.get(),
        m.query_start_loc,
        m.seq_lens,
        m.slot_mapping,
        tables,
        encoder,
    ) else {
        return;
    };
    if md.num_tokens() > PLAN_TOKENS {
        return;
    }
    let spec = m.cache.map(Spec::get);
    let config = |spec: Option<&KvCacheSpec>| {
        let (hkv, d) = spec.map_or((1, 8), |s| (s.num_kv_heads, s.head_size));
        let mut b = AttentionConfig::builder(hkv, d).attn_type(m.attn_type.get());
        if let Some(s) = spec {
            b = b.kv_cache_dtype(s.kv_cache_dtype);
        }
        b.build()
    };
    let Ok(config) = config(spec.as_ref()) else {
        return;
    };
    let plan = |backend: &dyn Backend| {
        backend
            .attention(&config)
            .and_then(|a| a.plan(&md, spec.as_ref()))
            .map(|p| p.workspace_bytes())
    };
    let want = plan(&run::reference());
    assert_eq!(
        plan(&run::cpu()).is_ok(),
        want.is_ok(),
        "cpu plan against reference's: {want:?}"
    );
}

/// What `KvCacheSpec::validate` must answer: positive sizes, a float dtype, and sizes in bytes
/// that fit: a block's in usize (the spec's own `block_elems` and `buffer_elems` multiply it out,
/// with no blocks too) and the whole cache's in isize.
fn valid(spec: &KvCacheSpec) -> bool {
    let block = [
        spec.num_kv_heads,
        spec.head_size,
        spec.storage_dtype().size_bytes(),
    ]
    .iter()
    .fold(spec.block_size as u128, |n, &f| n.saturating_mul(f as u128));
    spec.block_size > 0
        && spec.num_kv_heads > 0
        && spec.head_size > 0
        && spec.dtype.is_float()
        && block <= isize::MAX as u128
        && block.saturating_mul(spec.num_blocks as u128) <= isize::MAX as u128
}

/// A block id of a swap or copy pair: mostly an index near a small cache's blocks, sometimes
/// any `i32` (negative ones included).
#[derive(Debug, Clone, Copy, Arbitrary)]
enum Id {
    Index(Size),
    Any(i32),
}

impl Id {
    fn get(self) -> BlockId {
        match self {
            Id::Index(size) => BlockId::try_from(size.get()).unwrap_or(BlockId::MAX),
            Id::Any(id) => id,
        }
    }
}

fn cache(spec: KvCacheSpec, pairs: &[(Id, Id)]) {
    assert_eq!(spec.validate().is_ok(), valid(&spec), "{spec:?}");
    let backends = run::host_backends();
    if spec.validate().is_err() {
        for b in &backends {
            assert!(b.allocate_kv_cache(&spec).is_err());
            assert!(b.kv_cache_shape(&spec).is_err());
        }
        return;
    }
    // The size from the library's own geometry, which validation has bounded.
    let bytes = 2 * spec.buffer_elems() * spec.storage_dtype().size_bytes();
    if bytes > CACHE_BYTES {
        return;
    }
    let pairs: Vec<(BlockId, BlockId)> = pairs.iter().map(|(s, d)| (s.get(), d.get())).collect();
    let inside = |id: BlockId| usize::try_from(id).is_ok_and(|b| b < spec.num_blocks);
    let in_range = pairs.iter().all(|&(s, d)| inside(s) && inside(d));
    let mut seen = vec![false; spec.num_blocks];
    let distinct = in_range
        && pairs
            .iter()
            .all(|&(_, d)| !std::mem::replace(&mut seen[d as usize], true));
    for b in &backends {
        let cache = b.allocate_kv_cache(&spec).expect("a small valid cache");
        assert_eq!(cache.spec(), &spec);
        assert_eq!(cache.shape(), b.kv_cache_shape(&spec).expect("valid"));
        let swap = (b.allocate_swap_space(&spec, spec.num_blocks)).expect("a small valid cache");
        assert_eq!(swap.spec(), &spec);
        let (mut caches, mut swaps) = ([cache], [swap]);
        assert_eq!(b.copy_blocks(&mut caches, &pairs).is_ok(), in_range);
        assert_eq!(b.swap_out(&caches, &mut swaps, &pairs).is_ok(), distinct);
        assert_eq!(b.swap_in(&swaps, &mut caches, &pairs).is_ok(), distinct);
        let [cache] = caches;
        let (k, v) = cache.to_canonical().expect("host cache");
        assert_eq!(k.len(), spec.buffer_elems());
        assert!(k.as_bytes().iter().chain(v.as_bytes()).all(|&x| x == 0));
    }
}

fn from_canonical(spec: KvCacheSpec, hnd: bool, key_dtype: DType, key: &[u8], value: &[u8]) {
    let (Ok(k), Ok(v)) = (
        HostStorage::from_bytes(key_dtype, key),
        HostStorage::from_bytes(spec.storage_dtype(), value),
    ) else {
        return;
    };
    let layout = if hnd {
        CacheLayout::Hnd
    } else {
        CacheLayout::Nhd
    };
    let (k_len, v_len) = (k.len(), v.len());
    let cache = KvCache::from_canonical(spec, layout, k, v);
    let expected = valid(&spec)
        && key_dtype == spec.storage_dtype()
        && k_len == spec.buffer_elems()
        && v_len == spec.buffer_elems();
    assert_eq!(cache.is_ok(), expected, "{spec:?}");
    if let Ok(cache) = cache {
        let (k, v) = cache.to_canonical().expect("host cache");
        assert_eq!((k.as_bytes(), v.as_bytes()), (key, value));
    }
}

/// What the builder must answer, by the contract's "Accepted settings".
fn accepted(c: &Config) -> bool {
    let (h, d) = (c.num_heads.get(), c.head_size.get());
    let hkv = c.num_kv_heads.map_or(h, Size::get);
    let scale = c.scale.unwrap_or(1.0 / (d.max(1) as f32).sqrt());
    let fp8 = !matches!(c.cache, CacheDtype::Auto);
    let kv_scale = |s: f32| s.is_finite() && s > 0.0 && (fp8 || s == 1.0);
    // Exact in f64 (two 24-bit significands).
    let product = scale.abs() as f64 * c.k_scale as f64;
    // A query row, H x D elements of up to 4 bytes, must be an allocation that can exist.
    let row_fits = h
        .checked_mul(d)
        .and_then(|n| n.checked_mul(4))
        .is_some_and(|n| n <= isize::MAX as usize);
    h > 0
        && d > 0
        && hkv > 0
        && row_fits
        && h.is_multiple_of(hkv)
        && scale.is_finite()
        && scale != 0.0
        && kv_scale(c.k_scale)
        && kv_scale(c.v_scale)
        && (f32::MIN_POSITIVE as f64..=f32::MAX as f64).contains(&product)
        && c.slopes
            .as_ref()
            .is_none_or(|s| s.len() == h && s.iter().all(|x| x.is_finite()))
        && c.soft_cap
            .is_none_or(|cap| cap == 0.0 || (cap.is_finite() && cap > 0.0))
        && c.window
            .is_none_or(|w| w.get() > 0 && c.attn_type.get() == AttnType::Decoder)
}

fn config(c: Config) {
    let mut b = AttentionConfig::builder(c.num_heads.get(), c.head_size.get())
        .alibi_slopes(c.slopes.clone())
        .sliding_window(c.window.map(Size::get))
        .logits_soft_cap(c.soft_cap)
        .kv_cache_dtype(c.cache.get())
        .kv_scales(c.k_scale, c.v_scale)
        .attn_type(c.attn_type.get());
    if let Some(n) = c.num_kv_heads {
        b = b.num_kv_heads(n.get());
    }
    if let Some(s) = c.scale {
        b = b.scale(s);
    }
    let built = b.build();
    assert_eq!(built.is_ok(), accepted(&c), "{c:?}: {built:?}");
    let config = match built {
        Ok(config) => config,
        Err(Error::Invalid { .. } | Error::Unsupported { .. }) => return,
        Err(e) => panic!("{c:?}: an error of the wrong kind: {e:?}"),
    };
    // Every backend takes the layer and plans an empty batch (sizes of any magnitude).
    let empty = MetadataBuilder::new(1).build().expect("an empty batch");
    for backend in run::host_backends() {
        let attention = backend
            .attention(&config)
            .expect("every backend supports everything");
        let _ = attention.plan(&empty, None);
    }
    // A small call with these settings, compared across the backends.
    if config
        .num_heads()
        .checked_mul(config.head_size())
        .is_some_and(|n| n <= 256)
    {
        let case = small_call(config, c.seed);
        match compare_backends(&case, Rows::FiniteInDomain) {
            Ok(Answer::Ran(_)) => {}
            Ok(Answer::Refused(e)) => {
                fail(&case, &format!("every backend refused a valid call: {e}"))
            }
            Err(mismatch) => fail(&case, &mismatch),
        }
    }
}

/// A call without a cache under `config`: two sequences (5 and 2 tokens, for cross attention
/// 5 and 2 query tokens over 3 and 6 encoder tokens), data in [-1, 1] from `seed`.
fn small_call(config: AttentionConfig, seed: u8) -> pagedattn::replay::ReplayCase {
    let (h, hkv, d) = (
        config.num_heads(),
        config.num_kv_heads(),
        config.head_size(),
    );
    let cross = config.attn_type() == AttnType::EncoderDecoder;
    let mut builder = MetadataBuilder::new(1);
    let (mut tk, mut t) = (0, 0);
    for (n, e) in [(5, 3), (2, 6)] {
        let desc = SequenceDesc::prompt(0, n, &[]);
        builder.push(if cross {
            desc.with_encoder(e, &[])
        } else {
            desc
        });
        t += n;
        tk += if cross { e } else { n };
    }
    let mut rng = pagedattn_fuzz::rng::Rng::new(seed.into());
    let mut tensor = |shape: [usize; 3]| {
        let values: Vec<f32> = (0..shape.iter().product())
            .map(|_| rng.uniform(1.0))
            .collect();
        Tensor::from_f32(DType::F32, &shape, &values).expect("matching shape")
    };
    let (query, key, value) = (
        tensor([t, h, d]),
        tensor([tk, hkv, d]),
        tensor([tk, hkv, d]),
    );
    pagedattn::replay::ReplayCase {
        config,
        query,
        key_value: Some((key, value)),
        kv_cache: None,
        metadata: builder.build().expect("two fresh prompts"),
    }
}
