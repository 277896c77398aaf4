//! The benchmark workloads (decode and prefill sweeps, a mixed chunked-prefill batch, the paging
//! comparison), what each one costs (KV bytes read, FLOPs), and their inputs, built the way an
//! engine builds them: `MetadataBuilder` + `SequenceDesc`, caches from `Backend::allocate_kv_cache`
//! filled with random data.

use std::fmt;

use pagedattn::{
    AttentionConfig, AttentionImpl, Backend, BlockId, DType, Device, HostSliceMut, Inputs, KvCache,
    KvCacheDtype, KvScales, MetadataBuilder, Plan, Result, SequenceDesc, Tensor, Workspace,
};
use serde_json::{json, Value};

use super::platform::Target;

/// A group of workloads, selected by `--suite`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Suite {
    /// Decode: batch x context.
    Decode,
    /// Prefill: causal prompts.
    Prefill,
    /// One chunked-prefill batch: prompt chunks over cached context, a fresh prompt, decodes.
    Mixed,
    /// The headline decode on contiguous versus shuffled block tables.
    Paging,
}

impl Suite {
    /// Every suite, in the order they run.
    pub const ALL: [Suite; 4] = [Suite::Decode, Suite::Prefill, Suite::Mixed, Suite::Paging];

    /// The lowercase name.
    pub fn name(self) -> &'static str {
        match self {
            Suite::Decode => "decode",
            Suite::Prefill => "prefill",
            Suite::Mixed => "mixed",
            Suite::Paging => "paging",
        }
    }
}

/// How sequences' blocks are laid out in the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mapping {
    /// A random permutation of all blocks, as a block manager hands them out after churn.
    Shuffled,
    /// Sequence `s` gets one contiguous run of blocks `s*M .. s*M+M-1`.
    Contiguous,
}

impl Mapping {
    /// The lowercase name.
    pub fn name(self) -> &'static str {
        match self {
            Mapping::Shuffled => "shuffled",
            Mapping::Contiguous => "contiguous",
        }
    }
}

/// The size class of the sweeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scale {
    /// The full sweeps.
    Full,
    /// The headline rows and a few others.
    Quick,
    /// Toy shapes (4 heads, D = 32) for smoke tests and the `reference` backend.
    Tiny,
}

/// One sequence of a workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqShape {
    /// Tokens already in the cache.
    pub context_len: usize,
    /// New tokens (1 for a decode).
    pub query_len: usize,
    /// Whether this is a decode.
    pub is_decode: bool,
}

impl SeqShape {
    /// A decode step of a sequence that will hold `seq_len` tokens.
    pub fn decode(seq_len: usize) -> SeqShape {
        SeqShape {
            context_len: seq_len - 1,
            query_len: 1,
            is_decode: true,
        }
    }

    /// A prompt chunk of `query_len` tokens after `context_len` cached ones.
    pub fn prompt(context_len: usize, query_len: usize) -> SeqShape {
        SeqShape {
            context_len,
            query_len,
            is_decode: false,
        }
    }

    /// Keys the sequence attends over (context + new).
    pub fn seq_len(&self) -> usize {
        self.context_len + self.query_len
    }

    /// Allowed causal (query, key) pairs: query at position i sees keys 0..=i.
    pub fn causal_pairs(&self) -> u64 {
        let (c, q) = (self.context_len as u64, self.query_len as u64);
        q * c + q * (q + 1) / 2
    }
}

/// One benchmark workload: a layer shape, a batch, a cache dtype and a block mapping.
#[derive(Debug, Clone, PartialEq)]
pub struct Workload {
    /// The suite it belongs to.
    pub suite: Suite,
    /// A short name for the table.
    pub name: String,
    /// Whether this is a headline row of the targets.
    pub headline: bool,
    /// Query heads (H).
    pub num_heads: usize,
    /// KV heads (Hkv).
    pub num_kv_heads: usize,
    /// Head size (D).
    pub head_size: usize,
    /// Tokens per cache block (B).
    pub block_size: usize,
    /// Activation dtype.
    pub dtype: DType,
    /// Cache storage.
    pub kv_cache_dtype: KvCacheDtype,
    /// fp8 scales (1.0 otherwise).
    pub scales: KvScales,
    /// The batch, prefills first.
    pub seqs: Vec<SeqShape>,
    /// How blocks are assigned to sequences.
    pub mapping: Mapping,
}

impl fmt::Display for Workload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)
    }
}

/// Layer shape shared by the workloads of a scale: (H, Hkv, D, B).
fn shape(scale: Scale) -> (usize, usize, usize, usize) {
    match scale {
        Scale::Tiny => (4, 2, 32, 16),
        _ => (32, 8, 128, 16),
    }
}

impl Workload {
    fn new(suite: Suite, name: String, scale: Scale, seqs: Vec<SeqShape>) -> Workload {
        let (h, hkv, d, b) = shape(scale);
        Workload {
            suite,
            name,
            headline: false,
            num_heads: h,
            num_kv_heads: hkv,
            head_size: d,
            block_size: b,
            dtype: DType::BF16,
            kv_cache_dtype: KvCacheDtype::Auto,
            scales: KvScales::ONE,
            seqs,
            mapping: Mapping::Shuffled,
        }
    }

    fn fp8(mut self, dtype: KvCacheDtype) -> Workload {
        self.kv_cache_dtype = dtype;
        // Random activations in [-1, 1) stored as x / scale: codes up to 16, far from 448
        // (e4m3's largest) and 57344 (e5m2's).
        self.scales = KvScales {
            k_scale: 1.0 / 16.0,
            v_scale: 1.0 / 16.0,
        };
        self
    }

    fn headline(mut self) -> Workload {
        self.headline = true;
        self
    }

    fn kv_heads(mut self, n: usize) -> Workload {
        self.num_kv_heads = n;
        self
    }

    /// Another head size than the scale's, named in the row (` D64`).
    fn head_size(mut self, d: usize) -> Workload {
        self.head_size = d;
        self.name += &format!(" D{d}");
        self
    }

    /// Bytes per stored cache element.
    pub fn cache_elem_bytes(&self) -> usize {
        match self.kv_cache_dtype {
            KvCacheDtype::Auto => self.dtype.size_bytes(),
            _ => 1,
        }
    }

    /// KV bytes a forward call must read: every sequence's keys and values, once.
    pub fn kv_bytes(&self) -> f64 {
        let tokens: usize = self.seqs.iter().map(SeqShape::seq_len).sum();
        (tokens * self.num_kv_heads * self.head_size * 2 * self.cache_elem_bytes()) as f64
    }

    /// FLOPs: 4 * (allowed causal query-key pairs) * D * H (`bench/README.md`).
    pub fn flops(&self) -> f64 {
        let pairs: u64 = self.seqs.iter().map(SeqShape::causal_pairs).sum();
        4.0 * pairs as f64 * (self.head_size * self.num_heads) as f64
    }

    /// Query tokens in the batch.
    pub fn num_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.query_len).sum()
    }

    /// Blocks per sequence.
    fn blocks_per_seq(&self) -> Vec<usize> {
        self.seqs
            .iter()
            .map(|s| s.seq_len().div_ceil(self.block_size))
            .collect()
    }

    /// Blocks in one layer's cache: exactly what the batch covers.
    pub fn num_blocks(&self) -> usize {
        self.blocks_per_seq().iter().sum()
    }

    /// Bytes of one layer's cache (keys and values).
    pub fn cache_bytes(&self) -> usize {
        self.num_blocks()
            * self.block_size
            * self.num_kv_heads
            * self.head_size
            * 2
            * self.cache_elem_bytes()
    }

    /// Layers to rotate over so that their caches together exceed `working_set` bytes
    /// (at least 2, at most 256).
    pub fn layers_for(&self, working_set: usize) -> usize {
        working_set
            .div_ceil(self.cache_bytes().max(1))
            .clamp(2, 256)
    }

    /// Every parameter, for the JSON output (what `bench/torch_compare.py` rebuilds).
    pub fn params_json(&self) -> Value {
        let seqs: Vec<Value> = self
            .seqs
            .iter()
            .map(|s| {
                json!({"context_len": s.context_len, "query_len": s.query_len, "decode": s.is_decode})
            })
            .collect();
        json!({
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "block_size": self.block_size,
            "dtype": self.dtype.name(),
            "kv_cache_dtype": self.kv_cache_dtype.name(),
            "k_scale": self.scales.k_scale,
            "v_scale": self.scales.v_scale,
            "mapping": self.mapping.name(),
            "causal": true,
            "num_seqs": self.seqs.len(),
            "num_tokens": self.num_tokens(),
            "num_blocks": self.num_blocks(),
            "seqs": seqs,
        })
    }
}

/// The workloads of `suite` at `scale`, in the shapes of `target`.
pub fn suite(suite: Suite, scale: Scale, target: Target) -> Vec<Workload> {
    match target {
        Target::Gpu => gpu_suite(suite, scale),
        Target::Cpu => cpu_suite(suite, scale),
    }
}

/// The workloads of `suite` in groups timed together, interleaved: each paging pair, a mixed
/// batch with its parts; every other workload alone.
pub fn groups(suite_: Suite, scale: Scale, target: Target) -> Vec<Vec<Workload>> {
    let all = suite(suite_, scale, target);
    if suite_ == Suite::Paging {
        all.chunks(2).map(<[Workload]>::to_vec).collect()
    } else if suite_ == Suite::Mixed && all.len() > 1 {
        vec![all]
    } else {
        all.into_iter().map(|w| vec![w]).collect()
    }
}

/// A mixed batch, then its prefill part and its decode part alone (the same sequences).
fn with_parts(whole: Workload) -> Vec<Workload> {
    let part = |decode: bool, what: &str| {
        let mut w = whole.clone();
        w.headline = false;
        w.seqs.retain(|s| s.is_decode == decode);
        w.name = format!("{} ({what} part)", whole.name);
        w
    };
    let parts = [part(false, "prefill"), part(true, "decode")];
    std::iter::once(whole).chain(parts).collect()
}

/// A decode workload: `batch` sequences of `ctx` tokens.
fn decode(scale: Scale, batch: usize, ctx: usize) -> Workload {
    Workload::new(
        Suite::Decode,
        format!("decode b{batch} ctx{ctx}"),
        scale,
        vec![SeqShape::decode(ctx); batch],
    )
}

/// A prefill workload: `n` causal prompts of `len` tokens, `hkv` kv heads.
fn prefill(scale: Scale, n: usize, len: usize, hkv: usize) -> Workload {
    let (h, _, _, _) = shape(scale);
    Workload::new(
        Suite::Prefill,
        format!("prefill {n}x{len} H{h}/{hkv}"),
        scale,
        vec![SeqShape::prompt(0, len); n],
    )
    .kv_heads(hkv)
}

/// A mixed batch: two prompt chunks over cached context, a fresh prompt, decodes.
fn mixed(
    scale: Scale,
    chunk: usize,
    ctx: usize,
    fresh: usize,
    decodes: usize,
    dctx: usize,
) -> Workload {
    let mut seqs = vec![SeqShape::prompt(ctx, chunk); 2];
    seqs.push(SeqShape::prompt(0, fresh));
    seqs.extend(vec![SeqShape::decode(dctx); decodes]);
    Workload::new(
        Suite::Mixed,
        format!("mixed 2x{chunk}@{ctx} + {fresh} + {decodes} dec@{dctx}"),
        scale,
        seqs,
    )
    .headline()
}

/// `base` (the headline decode or prefill) on contiguous and on shuffled block tables.
fn paging_pair(base: Workload) -> Vec<Workload> {
    [Mapping::Contiguous, Mapping::Shuffled]
        .into_iter()
        .map(|m| {
            let mut w = base.clone().headline();
            w.suite = Suite::Paging;
            w.mapping = m;
            w.name = format!(
                "paging {} {}",
                base.name.trim_start_matches("decode "),
                m.name()
            );
            w
        })
        .collect()
}

/// The fp8 (`dtype`: e4m3 or e5m2) version of the headline decode.
fn fp8_decode(scale: Scale, batch: usize, ctx: usize, dtype: KvCacheDtype) -> Workload {
    let mut fp8 = decode(scale, batch, ctx).fp8(dtype);
    fp8.name = format!("decode b{batch} ctx{ctx} {}", dtype.name());
    fp8
}

/// `prefill` over an fp8 cache: its name says which.
fn fp8_prefill(scale: Scale, n: usize, len: usize, hkv: usize, dtype: KvCacheDtype) -> Workload {
    let mut fp8 = prefill(scale, n, len, hkv).fp8(dtype);
    fp8.name += &format!(" {}", dtype.name());
    fp8
}

/// A decode sweep over `batches` x `contexts`; `keep` filters the pairs, `(hb, hc)` is the
/// headline.
fn decode_sweep(
    scale: Scale,
    batches: &[usize],
    contexts: &[usize],
    keep: impl Fn(usize, usize) -> bool,
    (hb, hc): (usize, usize),
) -> Vec<Workload> {
    let mut rows = Vec::new();
    for &b in batches {
        for &c in contexts {
            if !keep(b, c) {
                continue;
            }
            let w = decode(scale, b, c);
            rows.push(if (b, c) == (hb, hc) { w.headline() } else { w });
        }
    }
    // e5m2 too: the only fp8 format IPEX caches.
    for dtype in [KvCacheDtype::Fp8E4m3, KvCacheDtype::Fp8E5m2] {
        rows.push(fp8_decode(scale, hb, hc, dtype));
    }
    rows
}

/// The CPU's workloads (issue 3's targets).
fn cpu_suite(suite: Suite, scale: Scale) -> Vec<Workload> {
    let tiny = scale == Scale::Tiny;
    let head = if tiny { (4, 200) } else { (32, 4096) };
    match suite {
        Suite::Decode => {
            let (batches, contexts): (&[usize], &[usize]) = match scale {
                Scale::Full => (&[1, 8, 32], &[512, 1024, 4096]),
                Scale::Quick => (&[8, 32], &[1024, 4096]),
                Scale::Tiny => (&[1, 4], &[64, 200]),
            };
            let keep = |b, c| scale != Scale::Quick || (b, c) == (8, 1024) || (b, c) == (32, 4096);
            decode_sweep(scale, batches, contexts, keep, head)
        }
        Suite::Prefill => {
            let (h, _, _, _) = shape(scale);
            match scale {
                Scale::Full => vec![
                    prefill(scale, 1, 512, h),
                    prefill(scale, 8, 1024, h),
                    prefill(scale, 4, 2048, h).headline(),
                    prefill(scale, 4, 2048, 8),
                ],
                Scale::Quick => vec![
                    prefill(scale, 1, 512, h),
                    prefill(scale, 4, 2048, h).headline(),
                ],
                Scale::Tiny => vec![
                    prefill(scale, 2, 64, h).headline(),
                    prefill(scale, 2, 64, 2),
                ],
            }
        }
        Suite::Mixed => vec![if tiny {
            mixed(scale, 32, 64, 16, 6, 100)
        } else {
            mixed(scale, 512, 1536, 256, 30, 2048)
        }],
        Suite::Paging => paging_pair(decode(scale, head.0, head.1)),
    }
}

/// A GPU's workloads (issue 12's targets): decode 64 x 4096 (32 query / 8 kv heads, D = 128,
/// block 16, shuffled, bf16), prefill 1 x 8192 causal with 32 heads over the paged cache (the
/// full suite also at D = 64 and 256), a
/// mixed batch timed with its prefill and decode parts, the paging pairs at the headline decode
/// and prefill.
/// Tiny shapes: the CPU's, the mixed batch with its parts.
fn gpu_suite(suite: Suite, scale: Scale) -> Vec<Workload> {
    if scale == Scale::Tiny {
        return match suite {
            Suite::Mixed => with_parts(cpu_suite(suite, scale).remove(0)),
            _ => cpu_suite(suite, scale),
        };
    }
    let head = (64, 4096);
    let (h, _, _, _) = shape(scale);
    match suite {
        Suite::Decode => {
            let (batches, contexts): (&[usize], &[usize]) = match scale {
                Scale::Quick => (&[8, 64], &[4096]),
                Scale::Full | Scale::Tiny => (&[1, 8, 64, 128], &[1024, 4096, 16384]),
            };
            // The full sweep leaves out 128 x 16384 (8 GiB per layer).
            let keep = |b, c| (b, c) != (128, 16384);
            decode_sweep(scale, batches, contexts, keep, head)
        }
        Suite::Prefill => match scale {
            Scale::Quick => vec![
                prefill(scale, 1, 2048, h),
                prefill(scale, 1, 8192, h).headline(),
            ],
            Scale::Full | Scale::Tiny => vec![
                prefill(scale, 1, 1024, h),
                prefill(scale, 1, 2048, h),
                prefill(scale, 1, 4096, h),
                prefill(scale, 1, 8192, h).headline(),
                prefill(scale, 4, 2048, h),
                prefill(scale, 1, 8192, 8),
                prefill(scale, 1, 8192, h).head_size(64),
                prefill(scale, 1, 8192, h).head_size(256),
                fp8_prefill(scale, 1, 8192, h, KvCacheDtype::Fp8E4m3),
                fp8_prefill(scale, 1, 8192, h, KvCacheDtype::Fp8E5m2),
            ],
        },
        Suite::Mixed => with_parts(mixed(scale, 1024, 3072, 2048, 64, 4096)),
        // The prefill's pair too: issue 27 bounds its paging overhead separately (3%).
        Suite::Paging => [decode(scale, head.0, head.1), prefill(scale, 1, 8192, h)]
            .into_iter()
            .flat_map(paging_pair)
            .collect(),
    }
}

/// A small, fast generator (splitmix64): the benchmark needs many random values, not quality.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        let bits = 0x3F80_0000 | ((self.next() >> 41) as u32);
        (f32::from_bits(bits) - 1.5) * 2.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Fills a buffer with random values of its dtype (valid fp8 codes for U8), in parallel.
fn fill_random(buf: HostSliceMut<'_>, seed: u64) {
    // Codes of values in [-1, 1) / (1/16): a realistic spread of fp8 codes, never NaN.
    let fp8: Vec<u8> = (0..64)
        .map(|i| pagedattn::Fp8Format::E4m3.encode((i as f32 - 32.0) / 2.0))
        .collect();
    match buf {
        HostSliceMut::F32(v) => fill_parallel(v, seed, |r| r.unit()),
        HostSliceMut::F16(v) => fill_parallel(v, seed, |r| half::f16::from_f32(r.unit())),
        HostSliceMut::BF16(v) => fill_parallel(v, seed, |r| half::bf16::from_f32(r.unit())),
        HostSliceMut::U8(v) => fill_parallel(v, seed, |r| fp8[r.below(fp8.len())]),
    }
}

/// Sets every element of `v` to `value(rng)`, one generator per thread.
fn fill_parallel<T: Send>(v: &mut [T], seed: u64, value: impl Fn(&mut SplitMix) -> T + Sync) {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let chunk = v.len().div_ceil(threads).max(1);
    std::thread::scope(|s| {
        for (i, part) in v.chunks_mut(chunk).enumerate() {
            let value = &value;
            s.spawn(move || {
                let mut rng = SplitMix(seed ^ ((i as u64 + 1) << 32));
                for x in part.iter_mut() {
                    *x = value(&mut rng);
                }
            });
        }
    });
}

fn random_tensor(dtype: DType, shape: &[usize], seed: u64) -> Result<Tensor> {
    let mut rng = SplitMix(seed);
    let values: Vec<f32> = (0..shape.iter().product()).map(|_| rng.unit()).collect();
    Tensor::from_f32(dtype, shape, &values)
}

/// A random permutation of `items` (Fisher-Yates), the same for the same seed: blocks as a
/// block manager hands them out after churn.
pub fn shuffle<T>(items: &mut [T], seed: u64) {
    let mut rng = SplitMix(seed);
    for i in (1..items.len()).rev() {
        items.swap(i, rng.below(i + 1));
    }
}

/// The block table of every sequence under `mapping`.
pub fn block_tables(w: &Workload, seed: u64) -> Vec<Vec<BlockId>> {
    let mut blocks: Vec<BlockId> = (0..w.num_blocks() as BlockId).collect();
    if w.mapping == Mapping::Shuffled {
        shuffle(&mut blocks, seed);
    }
    let mut rest = &blocks[..];
    w.blocks_per_seq()
        .into_iter()
        .map(|n| {
            let (mine, tail) = rest.split_at(n);
            rest = tail;
            mine.to_vec()
        })
        .collect()
}

/// Everything one workload's forward calls need: the layer, its plan and workspace, `layers`
/// filled caches to rotate over, and the input and output tensors, on the backend's device.
pub struct Prepared {
    attention: Box<dyn AttentionImpl>,
    plan: Plan,
    workspace: Workspace,
    caches: Vec<KvCache>,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    output: Tensor,
}

impl Prepared {
    /// Builds the inputs of `w` on `backend`, with `layers` caches.
    pub fn new(backend: &dyn Backend, w: &Workload, layers: usize, seed: u64) -> Result<Prepared> {
        let config = AttentionConfig::builder(w.num_heads, w.head_size)
            .num_kv_heads(w.num_kv_heads)
            .kv_cache_dtype(w.kv_cache_dtype)
            .kv_scales(w.scales.k_scale, w.scales.v_scale)
            .build()?;
        let attention = backend.attention(&config)?;
        let spec = config.kv_cache_spec(w.dtype, w.num_blocks(), w.block_size);
        let tables = block_tables(w, seed);
        let mut builder = MetadataBuilder::for_cache(&spec);
        for (s, table) in w.seqs.iter().zip(&tables) {
            builder.push(if s.is_decode {
                SequenceDesc::decode(s.context_len, table)
            } else {
                SequenceDesc::prompt(s.context_len, s.query_len, table)
            });
        }
        let metadata = builder.build()?;
        let device = backend.device();
        let caches = (0..layers)
            .map(|l| {
                // Filled in host memory: in place on a host backend (keeping its allocation),
                // then moved to a device backend's memory.
                let mut cache = match device {
                    Device::Cpu => backend.allocate_kv_cache(&spec)?,
                    _ => KvCache::zeros(spec, backend.kv_cache_layout())?,
                };
                let (k, v) = cache.host_buffers_mut()?;
                fill_random(k, seed.wrapping_add(2 * l as u64 + 1));
                fill_random(v, seed.wrapping_add(2 * l as u64 + 2));
                match device {
                    Device::Cpu => Ok(cache),
                    _ => cache.to_device(device),
                }
            })
            .collect::<Result<Vec<_>>>()?;
        let plan = attention.plan(&metadata, Some(&spec))?;
        let workspace = backend.workspace(&plan)?;
        let t = w.num_tokens();
        let (h, hkv, d) = (w.num_heads, w.num_kv_heads, w.head_size);
        let on_device = |t: Tensor| t.to_device(device);
        Ok(Prepared {
            attention,
            plan,
            workspace,
            caches,
            query: on_device(random_tensor(w.dtype, &[t, h, d], seed ^ 0x51)?)?,
            key: on_device(random_tensor(w.dtype, &[t, hkv, d], seed ^ 0x52)?)?,
            value: on_device(random_tensor(w.dtype, &[t, hkv, d], seed ^ 0x53)?)?,
            output: Tensor::zeros_on(device, w.dtype, &[t, h, d])?,
        })
    }

    /// Number of caches rotated over.
    pub fn layers(&self) -> usize {
        self.caches.len()
    }

    /// One forward call (cache write, then attention) on layer `i % layers`, with the step's
    /// plan made once beforehand.
    pub fn run(&mut self, i: usize) -> Result<()> {
        let layer = i % self.caches.len();
        let inputs = Inputs::new(&self.query)
            .with_kv(&self.key, &self.value)
            .with_cache(&mut self.caches[layer]);
        self.attention
            .forward_into(&self.plan, &mut self.workspace, inputs, &mut self.output)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn costs_follow_design_md() {
        let w = &suite(Suite::Decode, Scale::Full, Target::Cpu)
            .into_iter()
            .find(|w| w.headline)
            .unwrap();
        assert_eq!((w.seqs.len(), w.seqs[0].seq_len()), (32, 4096));
        // 32 seqs x 4096 tokens x 8 kv heads x 128 x (K and V) x 2 bytes.
        assert_eq!(w.kv_bytes(), (32 * 4096 * 8 * 128 * 2 * 2) as f64);
        let p = &suite(Suite::Prefill, Scale::Full, Target::Cpu)
            .into_iter()
            .find(|w| w.headline)
            .unwrap();
        assert_eq!(p.flops(), 4.0 * (4 * 2048 * 2049 / 2) as f64 * 128.0 * 32.0);
        assert_eq!(
            SeqShape::prompt(1536, 512).causal_pairs(),
            512 * 1536 + 512 * 513 / 2
        );
    }

    #[test]
    fn gpu_headline_shapes() {
        for scale in [Scale::Full, Scale::Quick] {
            let decode = suite(Suite::Decode, scale, Target::Gpu);
            let w = decode.iter().find(|w| w.headline).unwrap();
            assert_eq!((w.seqs.len(), w.seqs[0].seq_len()), (64, 4096));
            assert_eq!(
                (w.num_heads, w.num_kv_heads, w.head_size, w.block_size),
                (32, 8, 128, 16)
            );
            assert_eq!((w.dtype, w.mapping), (DType::BF16, Mapping::Shuffled));
            for dtype in [KvCacheDtype::Fp8E4m3, KvCacheDtype::Fp8E5m2] {
                assert!(decode.iter().any(|w| w.kv_cache_dtype == dtype));
            }
            let prefills = suite(Suite::Prefill, scale, Target::Gpu);
            if scale == Scale::Full {
                assert!(prefills
                    .iter()
                    .any(|w| w.kv_cache_dtype == KvCacheDtype::Fp8E4m3));
            }
            let p = prefills.iter().find(|w| w.headline).unwrap();
            assert_eq!(
                (p.seqs.len(), p.seqs[0].query_len, p.seqs[0].context_len),
                (1, 8192, 0)
            );
            assert_eq!((p.num_heads, p.num_kv_heads), (32, 32));
            let mixed = groups(Suite::Mixed, scale, Target::Gpu);
            assert_eq!(mixed.len(), 1);
            let [whole, pre, dec] = &mixed[0][..] else {
                panic!("the mixed batch and its two parts")
            };
            assert_eq!(pre.seqs.len() + dec.seqs.len(), whole.seqs.len());
            assert!(pre.seqs.iter().all(|s| !s.is_decode) && dec.seqs.iter().all(|s| s.is_decode));
            let paging = groups(Suite::Paging, scale, Target::Gpu);
            assert_eq!(paging.len(), 2);
            assert!(paging.iter().all(|pair| pair.len() == 2
                && pair[0].mapping == Mapping::Contiguous
                && pair[1].mapping == Mapping::Shuffled
                && pair[0].seqs == pair[1].seqs));
            assert_eq!(paging[0][1].seqs, w.seqs);
            assert_eq!(paging[1][1].seqs, p.seqs);
        }
    }

    #[test]
    fn block_tables_cover_every_block_once() {
        for mapping in [Mapping::Contiguous, Mapping::Shuffled] {
            let mut w = suite(Suite::Mixed, Scale::Tiny, Target::Cpu).remove(0);
            w.mapping = mapping;
            let tables = block_tables(&w, 7);
            let mut all: Vec<BlockId> = tables.concat();
            if mapping == Mapping::Contiguous {
                assert_eq!(tables[1][0], tables[0].len() as BlockId);
            }
            all.sort();
            assert_eq!(all, (0..w.num_blocks() as BlockId).collect::<Vec<_>>());
        }
    }
}
