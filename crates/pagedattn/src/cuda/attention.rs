//! [`CudaAttention`]: one layer's attention on a GPU.
//!
//! A plan validates the step's metadata through the gate, makes the work list on the host
//! (`plan.rs`) and uploads everything the kernels read (the write's slots, the sequences, the
//! block-table entries, the units, the split-K merges and the private cache's slots) in one
//! asynchronous copy from pinned staging memory into device memory the plan owns; its
//! workspace holds the split-K partials and the private cache of the sequences with unwritten
//! keys (`src/detached.rs`). A forward then only queues work on the GPU's stream, allocating
//! nothing and never waiting for the GPU: the cache write, the private cache's block copies
//! and write (when the step has one), the prefill kernel, the decode kernel and the merge, in
//! that order (so a step's work could be captured in a CUDA graph once its variant is loaded).

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::abi::{MergeField, Params, UnitField, DECODE_ROWS, THREADS};
use super::device::{driver_error, Gpu};
use super::kernels::{self, grid_size, Merge, WriteKv};
use super::memory;
use super::packed::Packed;
use super::plan::{self, Split, Work};
use super::storage::{cuda_storage, cuda_storage_mut, CudaStorage};
use super::variant::{self, Variant};
use crate::backend::{AttentionImpl, Capabilities, GraphCapacity};
use crate::config::AttentionConfig;
use crate::detached::Detached;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::kv_cache::write_slots;
use crate::kv_cache::{CacheLayout, KvCache, KvCacheSpec};
use crate::metadata::AttentionMetadata;
use crate::step::{partials_bytes, ForwardCheck, Inputs, KvPair, Plan, Workspace};
use crate::tensor::{HostStorage, Storage, Tensor};

/// One layer's attention on the `cuda` backend.
pub struct CudaAttention {
    config: AttentionConfig,
    gpu: Arc<Gpu>,
    capabilities: Capabilities,
    /// The ALiBi slopes, one per query head, on the GPU.
    slopes: Option<CudaStorage>,
}

impl std::fmt::Debug for CudaAttention {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaAttention")
            .field("config", &self.config)
            .field("device", &Device::Cuda(self.gpu.ordinal))
            .finish_non_exhaustive()
    }
}

/// A plan's data on the GPU: one packed buffer and where each section is in it.
struct Prepared {
    /// The GPU it was uploaded to.
    ordinal: usize,
    /// The step's metadata and work list.
    metadata: Packed,
    /// The write's slot mapping (also where the kernels look up which new tokens are keys).
    slot_mapping: Range<usize>,
    seqs: Range<usize>,
    tables: Range<usize>,
    decode: Range<usize>,
    prefill: Range<usize>,
    merges: Range<usize>,
    /// The private cache's slots for the call's key/value tokens (empty without one).
    private_slots: Range<usize>,
    /// Where the private cache lies in the workspace, and what fills it.
    private: Option<PrivateCache>,
    /// How many units at the end of the decode and prefill sections read the private cache.
    private_decode: usize,
    private_prefill: usize,
    /// Whether the kernels read keys through block tables (a cache) or from the inputs.
    paged: bool,
    /// For a plan made for CUDA graphs, what stays fixed from step to step.
    graph: Option<GraphShape>,
}

impl Prepared {
    /// The sections' ranges, in the order of [`CudaAttention::sections`].
    fn ranges(&self) -> [Range<usize>; 7] {
        [
            self.slot_mapping.clone(),
            self.seqs.clone(),
            self.tables.clone(),
            self.decode.clone(),
            self.prefill.clone(),
            self.merges.clone(),
            self.private_slots.clone(),
        ]
    }
}

/// The names of the sections, for errors.
const SECTION_NAMES: [&str; 7] = [
    "write slots",
    "sequences",
    "block-table entries",
    "decode units",
    "prefill units",
    "split-K merges",
    "private cache slots",
];

/// The private cache of a step's detached sequences, in the workspace past the split-K
/// partials: its keys at `offset` bytes, its values `buffer_bytes` later.
#[derive(Debug, Clone)]
struct PrivateCache {
    spec: KvCacheSpec,
    offset: usize,
    buffer_bytes: usize,
    /// (cache block, private block) copies, after the call's write.
    copies: Vec<(usize, usize)>,
}

/// Alignment of the private cache's buffers in the workspace (a cp.async reads 16 bytes; the
/// allocator's 256).
const PRIVATE_ALIGN: usize = 256;

/// A step's work, its detached sequences and their private cache, and the workspace bytes
/// they need.
struct Planned {
    work: Work,
    detached: Option<Detached>,
    private: Option<PrivateCache>,
    workspace_bytes: usize,
}

/// What a plan for CUDA graphs keeps from step to step: every decode unit's partitions, and
/// room for the block-table entries of its longest sequences.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct GraphShape {
    parts: usize,
    tables: usize,
}

impl CudaAttention {
    /// The layer on `gpu`; uploads its ALiBi slopes.
    pub(crate) fn new(
        config: &AttentionConfig,
        gpu: Arc<Gpu>,
        capabilities: Capabilities,
    ) -> Result<Self> {
        let slopes = config
            .alibi_slopes()
            .map(|s| {
                CudaStorage::upload(
                    &HostStorage::F32(s.to_vec().into()),
                    Device::Cuda(gpu.ordinal),
                )
            })
            .transpose()?;
        Ok(CudaAttention {
            config: config.clone(),
            gpu,
            capabilities,
            slopes,
        })
    }

    /// The gate of this layer's calls.
    fn gate(&self) -> ForwardCheck<'_> {
        ForwardCheck {
            backend: "cuda",
            device: Device::Cuda(self.gpu.ordinal),
            capabilities: &self.capabilities,
            layout: CacheLayout::Hnd,
            config: &self.config,
        }
    }

    /// The work of a step over validated metadata (split automatically, or in a graph
    /// plan's fixed shape), checked against the GPU's launch limits, and the workspace bytes
    /// its split-K partials and private cache need.
    fn work(
        &self,
        md: &AttentionMetadata,
        cache: Option<&KvCacheSpec>,
        has_new_kv: bool,
        graph: Option<GraphShape>,
    ) -> Result<Planned> {
        let split = graph.map_or(
            Split::Auto {
                sm_count: self.gpu.sm_count,
            },
            |g| Split::Fixed {
                parts: g.parts,
                sm_count: self.gpu.sm_count,
            },
        );
        let block_size = cache.map(|c| c.block_size);
        let detached = Detached::plan(&self.config, md, block_size, has_new_kv)?;
        if graph.is_some() && detached.is_some() {
            // A graph replays a fixed list of launches: the private cache's copies and write
            // vary with the step.
            return Err(Error::invalid(
                "metadata.slot_mapping",
                "a new token with slot -1",
                "a slot for every new token in a plan for CUDA graphs (plan_for_graph)",
            ));
        }
        let mut work = plan::build(
            &self.config,
            md,
            block_size,
            has_new_kv,
            detached.as_ref(),
            split,
        );
        if let Some(g) = graph {
            if work.tables.len() > g.tables {
                let longest = md.seq_lens.iter().max().copied().unwrap_or(0);
                return Err(Error::invalid(
                    "metadata",
                    format!(
                        "a step needing {} block-table entries (longest seq_len {longest})",
                        work.tables.len()
                    ),
                    format!(
                        "at most {} (the graph plan's capacity.max_seq_len for every sequence)",
                        g.tables
                    ),
                ));
            }
            // Entries past a sequence's keys are never read.
            work.tables.resize(g.tables, 0);
        }
        for (records, what) in [
            (&work.decode, "decode units"),
            (&work.prefill, "prefill units"),
        ] {
            grid_size(records.len() / UnitField::COUNT, what)?;
        }
        grid_size(work.merges.len() / MergeField::COUNT, "split-K merges")?;
        let floats = plan::partial_floats(self.config.head_size());
        let mut workspace_bytes = partials_bytes("cuda", work.num_partials, floats)?;
        let private = match (&detached, cache) {
            (Some(d), Some(cache)) => {
                let spec = d.spec(cache);
                let too_big = || {
                    Error::unsupported(
                        "cuda",
                        format!("a private cache of {} blocks in a workspace", d.num_blocks),
                    )
                };
                let buffer_bytes = spec
                    .num_blocks
                    .checked_mul(spec.block_bytes())
                    .and_then(|b| b.checked_next_multiple_of(PRIVATE_ALIGN))
                    .ok_or_else(too_big)?;
                let offset = workspace_bytes
                    .checked_next_multiple_of(PRIVATE_ALIGN)
                    .ok_or_else(too_big)?;
                workspace_bytes = buffer_bytes
                    .checked_mul(2)
                    .and_then(|b| b.checked_add(offset))
                    .ok_or_else(too_big)?;
                let index = |b: crate::kv_cache::BlockId| b as usize;
                Some(PrivateCache {
                    spec,
                    offset,
                    buffer_bytes,
                    copies: d
                        .copies
                        .iter()
                        .map(|&(s, t)| (index(s), index(t)))
                        .collect(),
                })
            }
            _ => None,
        };
        Ok(Planned {
            work,
            detached,
            private,
            workspace_bytes,
        })
    }

    /// The sections of a step's packed metadata: the write's slots, the work's records, the
    /// private cache's slots.
    fn sections<'a>(&self, md: &'a AttentionMetadata, planned: &'a Planned) -> [&'a [i64]; 7] {
        let work = &planned.work;
        [
            write_slots(&self.config, md),
            &work.seqs,
            &work.tables,
            &work.decode,
            &work.prefill,
            &work.merges,
            planned.detached.as_ref().map_or(&[], |d| &d.slots),
        ]
    }

    /// A new plan's data: its work, uploaded.
    fn prepare(
        &self,
        md: &AttentionMetadata,
        cache: Option<&KvCacheSpec>,
        has_new_kv: bool,
        graph: Option<GraphShape>,
    ) -> Result<(Prepared, usize)> {
        let planned = self.work(md, cache, has_new_kv, graph)?;
        let (metadata, [slot_mapping, seqs, tables, decode, prefill, merges, private_slots]) =
            Packed::upload(&self.gpu, self.sections(md, &planned))?;
        let prepared = Prepared {
            ordinal: self.gpu.ordinal,
            metadata,
            slot_mapping,
            seqs,
            tables,
            decode,
            prefill,
            merges,
            private_slots,
            private: planned.private,
            private_decode: planned.work.private_decode,
            private_prefill: planned.work.private_prefill,
            paged: cache.is_some(),
            graph,
        };
        Ok((prepared, planned.workspace_bytes))
    }

    /// The plan's data, if it was uploaded to this layer's GPU.
    fn prepared<'p>(&self, plan: &'p Plan) -> Result<&'p Prepared> {
        let prepared: &Prepared = plan.prepared("cuda")?;
        if prepared.ordinal != self.gpu.ordinal {
            return Err(Error::device_mismatch(
                "plan",
                Device::Cuda(prepared.ordinal),
                format!(
                    "{} (plan with this layer's backend)",
                    Device::Cuda(self.gpu.ordinal)
                ),
            ));
        }
        Ok(prepared)
    }

    /// Queues the write of `key` and `value` (checked by the gate) into `cache` through the
    /// plan's slots.
    fn queue_write(
        &self,
        prepared: &Prepared,
        key: &Tensor,
        value: &Tensor,
        cache: &mut KvCache,
    ) -> Result<()> {
        let num_tokens = prepared.slot_mapping.len();
        if key.shape()[0] != num_tokens {
            return Err(Error::invalid(
                "key.shape[0]",
                key.shape()[0],
                format!("{num_tokens}, the plan's write slots"),
            ));
        }
        let spec = *cache.spec();
        let (key_cache, value_cache) = cache.buffers_mut();
        let write = WriteKv {
            key: address(key.storage(), "key")?,
            value: address(value.storage(), "value")?,
            key_cache: address_mut(key_cache, "kv_cache.key")?,
            value_cache: address_mut(value_cache, "kv_cache.value")?,
            slot_mapping: prepared.metadata.address(prepared.slot_mapping.start),
            num_tokens,
            spec,
            scales: self.config.kv_scales(),
        };
        kernels::write_kv(&self.gpu, &write)
    }

    /// Queues the fill of the private cache that lies at `workspace + private.offset`: the
    /// copies of the cache's blocks (`key` and `value` are its buffers' addresses, after the
    /// call's write), then the write of `kv` through the private slots. Returns the private
    /// key and value buffers' addresses.
    #[allow(clippy::too_many_arguments)]
    fn fill_private(
        &self,
        prepared: &Prepared,
        private: &PrivateCache,
        workspace: u64,
        key: u64,
        value: u64,
        cache: &KvCache,
        kv: KvPair<'_>,
    ) -> Result<(u64, u64)> {
        let private_key = workspace + private.offset as u64;
        let private_value = private_key + private.buffer_bytes as u64;
        let block_bytes = cache.spec().block_bytes();
        self.gpu.with_queue(|stream| {
            for &(from, to) in &private.copies {
                for (dst, src) in [(private_key, key), (private_value, value)] {
                    // SAFETY: `from` is a block of the cache (the metadata's validation checked
                    // the table entries the plan copied), `to` a block of the private cache,
                    // which the workspace holds (the gate checked its size); both stay
                    // allocated until the stream is done (borrowed for this call, device
                    // memory freed after the streams that use it).
                    unsafe {
                        memory::copy_async(
                            stream,
                            dst + (to * block_bytes) as u64,
                            src + (from * block_bytes) as u64,
                            block_bytes,
                        )?
                    };
                }
            }
            Ok(())
        })?;
        kernels::write_kv(
            &self.gpu,
            &WriteKv {
                key: address(kv.key.storage(), "key")?,
                value: address(kv.value.storage(), "value")?,
                key_cache: private_key,
                value_cache: private_value,
                slot_mapping: prepared.metadata.address(prepared.private_slots.start),
                num_tokens: prepared.private_slots.len(),
                spec: private.spec,
                scales: self.config.kv_scales(),
            },
        )?;
        Ok((private_key, private_value))
    }

    /// Queues one attention kernel over the `units` section (nothing when it is empty):
    /// `shape` is (CTAs per unit, threads per CTA, dynamic shared memory in bytes).
    fn launch(
        &self,
        kernel: &cudarc::driver::CudaFunction,
        params: Params,
        prepared: &Prepared,
        units: &Range<usize>,
        shape: (u32, u32, u32),
        what: &str,
    ) -> Result<()> {
        let count = units.len() / UnitField::COUNT;
        if count == 0 {
            return Ok(());
        }
        let params = Params {
            units: prepared.metadata.address(units.start),
            ..params
        };
        let config = LaunchConfig {
            grid_dim: (grid_size(count, "attention units")?, shape.0, 1),
            block_dim: (shape.1, 1, 1),
            shared_mem_bytes: shape.2,
        };
        self.gpu.with_queue(|stream| {
            let mut launch = stream.launch_builder(kernel);
            launch.arg(&params);
            // SAFETY: `params` matches the kernel's one parameter (`Params`, by value); the dynamic
            // shared memory is what the kernel takes (the variant's prefill shape or decode bytes,
            // allowed on the function when it was loaded), and a kernel given less traps instead of
            // overrunning it. Every index the kernel computes stays inside the buffer it reads or
            // writes, because the gate validated the metadata against the call and the plan derived
            // every record from it: units and sequences name tokens inside the query and output
            // `[T, H, D]` (query_start_loc) and heads below H; keys are read only at positions
            // below the sequence's key count, either through the compacted block-table entries
            // (each a block inside the cache, checked by the metadata's validation, or, for a
            // detached sequence, a block of the private cache, which the plan sized and the
            // workspace holds) at kv heads below Hkv, or as rows of the key/value tensors (whose
            // shape the gate checked against the sequences' lengths); partial slots lie below
            // the plan's partial count, which the workspace holds (the gate checked its size). The memory outlives the kernel: the tensors and
            // cache are borrowed for this call, and device memory of this crate's (the plan's
            // buffer) is freed after the streams that use it.
            unsafe { launch.launch(config) }
                .map_err(|e| driver_error(&format!("cuLaunchKernel({what})"), e))?;
            Ok(())
        })
    }
}

impl AttentionImpl for CudaAttention {
    fn config(&self) -> &AttentionConfig {
        &self.config
    }

    fn plan(&self, metadata: &AttentionMetadata, cache: Option<&KvCacheSpec>) -> Result<Plan> {
        self.gate().plan(metadata, cache, |md, has_new_kv| {
            self.prepare(md, cache, has_new_kv, None)
        })
    }

    fn plan_for_graph(
        &self,
        metadata: &AttentionMetadata,
        cache: Option<&KvCacheSpec>,
        capacity: GraphCapacity,
    ) -> Result<Plan> {
        self.gate().plan(metadata, cache, |md, has_new_kv| {
            let block_size = cache.map(|c| c.block_size);
            // The units before any split size the fixed split, as the automatic split
            // would for sequences of the capacity's length.
            let split = Split::Fixed {
                parts: 1,
                sm_count: self.gpu.sm_count,
            };
            let unsplit = plan::build(&self.config, md, block_size, has_new_kv, None, split);
            let units = (unsplit.decode.len() + unsplit.prefill.len()) / UnitField::COUNT;
            let max_keys = capacity.max_seq_len;
            let tables = match block_size {
                Some(b) => md
                    .num_seqs()
                    .checked_mul(max_keys.div_ceil(b))
                    .ok_or_else(|| {
                        Error::invalid(
                            "capacity.max_seq_len",
                            max_keys,
                            "a length whose block-table entries for every sequence fit in memory",
                        )
                    })?,
                None => 0,
            };
            let shape = GraphShape {
                parts: plan::graph_parts(units, max_keys, self.gpu.sm_count),
                tables,
            };
            self.prepare(md, cache, has_new_kv, Some(shape))
        })
    }

    fn replan(
        &self,
        plan: &mut Plan,
        metadata: &AttentionMetadata,
        cache: Option<&KvCacheSpec>,
    ) -> Result<()> {
        let shape = plan.prepared::<Prepared>("cuda").ok().and_then(|p| p.graph);
        let Some(shape) = shape else {
            *plan = self.plan(metadata, cache)?;
            return Ok(());
        };
        // What the captured calls' checks relied on stays as it was.
        let captured = (
            plan.cache_spec().copied(),
            plan.num_tokens(),
            plan.num_kv_tokens(),
        );
        let old: &mut Prepared = plan.prepared_mut("cuda")?;
        let new = self.gate().plan(metadata, cache, |md, has_new_kv| {
            let now = (cache.copied(), md.num_tokens(), has_new_kv);
            if (now.0, now.1) != (captured.0, captured.1) || now.2 != captured.2.is_some() {
                // A cache spec in words, or "no cache": the error is one sentence.
                let over = |spec: Option<KvCacheSpec>| {
                    spec.map_or("no cache".to_string(), |spec| format!("a {spec}"))
                };
                return Err(Error::invalid(
                    "metadata",
                    format!("a step of {} query tokens over {}", now.1, over(now.0)),
                    format!(
                        "{} query tokens over {} (what the graph plan was made for)",
                        captured.1,
                        over(captured.0)
                    ),
                ));
            }
            let planned = self.work(md, cache, has_new_kv, Some(shape))?;
            let sections = self.sections(md, &planned);
            let ranges = old.ranges();
            if let Some(i) = (0..sections.len()).find(|&i| sections[i].len() != ranges[i].len()) {
                return Err(Error::invalid(
                    "metadata",
                    format!("a step of {} {}", sections[i].len(), SECTION_NAMES[i]),
                    format!(
                        "{} (the batch shape the graph plan was made for: plan anew for another)",
                        ranges[i].len()
                    ),
                ));
            }
            old.metadata.rewrite(&self.gpu, sections, &ranges)?;
            let prepared = Prepared {
                metadata: std::mem::take(&mut old.metadata),
                slot_mapping: old.slot_mapping.clone(),
                seqs: old.seqs.clone(),
                tables: old.tables.clone(),
                decode: old.decode.clone(),
                prefill: old.prefill.clone(),
                merges: old.merges.clone(),
                private_slots: old.private_slots.clone(),
                private: None,
                ..*old
            };
            Ok((prepared, planned.workspace_bytes))
        })?;
        *plan = new;
        Ok(())
    }

    fn write_kv(
        &self,
        plan: &Plan,
        key: &Tensor,
        value: &Tensor,
        cache: &mut KvCache,
    ) -> Result<()> {
        self.gate().write(plan, KvPair { key, value }, cache)?;
        let prepared = self.prepared(plan)?;
        self.queue_write(prepared, key, value, cache)
    }

    fn forward_into(
        &self,
        plan: &Plan,
        workspace: &mut Workspace,
        inputs: Inputs<'_>,
        output: &mut Tensor,
    ) -> Result<()> {
        self.gate().call(plan, &inputs, output, workspace)?;
        let prepared = self.prepared(plan)?;
        let dtype = inputs.query().dtype();
        let (query, new_kv, mut cache) = inputs.into_parts();
        // Everything that can refuse the call comes before the first write: an unsupported
        // head size, a variant that does not compile.
        let variant = Variant::for_call(&self.config, dtype, cache.is_some())?;
        let kernels = variant::kernels(&self.gpu, variant)?;
        if !prepared.merges.is_empty() {
            self.gpu.kernels()?;
        }

        // 1. The new keys and values into the cache.
        if let (Some(cache), Some(kv)) = (cache.as_deref_mut(), new_kv) {
            self.queue_write(prepared, kv.key, kv.value, cache)?;
        }

        // 2. Attention over the cache (after the write, in stream order) or the inputs.
        let (key, value) = match (cache.as_deref(), new_kv) {
            (Some(c), _) => (
                address(c.key(), "kv_cache.key")?,
                address(c.value(), "kv_cache.value")?,
            ),
            (None, Some(kv)) => (
                address(kv.key.storage(), "key")?,
                address(kv.value.storage(), "value")?,
            ),
            (None, None) => unreachable!("validated: without a cache, key and value are given"),
        };
        let partials = match workspace.storage_mut() {
            Some(storage) => address_mut(storage, "workspace")?,
            None => 0,
        };
        // 3. The detached sequences' private cache (in the workspace, after the write).
        let (private_key, private_value) = match (&prepared.private, cache.as_deref(), new_kv) {
            (Some(private), Some(cache), Some(kv)) => {
                self.fill_private(prepared, private, partials, key, value, cache, kv)?
            }
            _ => (0, 0),
        };
        let cfg = &self.config;
        let scales = cfg.kv_scales();
        // The fp8 scales apply to what is read from an fp8 cache only.
        let fp8 = cache.is_some() && cfg.kv_cache_dtype().fp8_format().is_some();
        let (k_scale, v_scale) = if fp8 {
            (scales.k_scale, scales.v_scale)
        } else {
            (1.0, 1.0)
        };
        let metadata = &prepared.metadata;
        let block_size = plan.cache_spec().map_or(1, |s| s.block_size);
        let params = Params {
            query: address(query.storage(), "query")?,
            key,
            value,
            output: address_mut(output.storage_mut(), "output")?,
            partials,
            seqs: metadata.address(prepared.seqs.start),
            tables: metadata.address(prepared.tables.start),
            units: 0,
            slopes: match &self.slopes {
                Some(s) => s.kernel_address("alibi slopes")?.unwrap_or(0),
                None => 0,
            },
            // Sizes the validation bounded by the cache's size in bytes (isize).
            block_size: block_size as i64,
            window: cfg
                .sliding_window()
                .map_or(i64::MAX, |w| w.min(i64::MAX as usize) as i64),
            num_heads: cfg.num_heads() as i64,
            num_kv_heads: cfg.num_kv_heads() as i64,
            group: cfg.num_queries_per_kv() as i64,
            paged: prepared.paged as i64,
            // One f32 factor, as the contract allows (|scale| * k_scale is a normal f32).
            score_scale: cfg.scale() * k_scale,
            out_scale: v_scale,
            soft_cap: cfg.logits_soft_cap().unwrap_or(1.0),
            unused: 0.0,
        };
        // The detached sequences' units last, in launches of their own over the private cache.
        let private = Params {
            key: private_key,
            value: private_value,
            ..params
        };
        let (decode, decode_shared) = kernels.decode(cfg.num_queries_per_kv().min(DECODE_ROWS));
        for (kernel, section, private_units, shape, what) in [
            (
                &kernels.prefill,
                &prepared.prefill,
                prepared.private_prefill,
                kernels.prefill_launch,
                "attention prefill",
            ),
            (
                decode,
                &prepared.decode,
                prepared.private_decode,
                (1, THREADS, decode_shared),
                "attention decode",
            ),
        ] {
            let split = section.end - private_units * UnitField::COUNT;
            self.launch(
                kernel,
                params,
                prepared,
                &(section.start..split),
                shape,
                what,
            )?;
            self.launch(
                kernel,
                private,
                prepared,
                &(split..section.end),
                shape,
                what,
            )?;
        }
        kernels::merge(
            &self.gpu,
            &Merge {
                partials,
                merges: metadata.address(prepared.merges.start),
                count: prepared.merges.len() / MergeField::COUNT,
                output: params.output,
                dtype,
                num_heads: cfg.num_heads(),
                head_size: cfg.head_size(),
                v_scale,
            },
        )
    }
}

/// The device address of a tensor or cache buffer on the GPU (0 when it is empty).
fn address(storage: &Storage, what: &str) -> Result<u64> {
    Ok(cuda_storage(storage, what)?
        .kernel_address(what)?
        .unwrap_or(0))
}

/// [`address`] of a buffer a kernel writes (borrowed mutably, so that nothing else holds it).
fn address_mut(storage: &mut Storage, what: &str) -> Result<u64> {
    Ok(cuda_storage_mut(storage, what)?
        .kernel_address(what)?
        .unwrap_or(0))
}
