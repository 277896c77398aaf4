//! Decode steps replayed from CUDA graphs: for a model whose whole forward is device work
//! ([`GraphStages`](crate::serving::model::GraphStages)), a decode step of `n` sequences is padded to
//! a bucket (vLLM's: 1, 2, 4, 8, then multiples of 8) and its forward, attention included,
//! is captured once per
//! bucket and replayed for every later step of that bucket after `replan` refreshes the
//! attention's plan in place. A replay costs one launch where the forward costs hundreds.
//!
//! Padding sequences decode one token each into blocks past the scheduler's pool (the engine
//! allocates them for this), at distinct slots; their rows are computed and never read.

#[cfg(feature = "cuda")]
pub(crate) use gpu::DecodeGraphs;

/// Without the `cuda` feature there are no graphs.
#[cfg(not(feature = "cuda"))]
pub(crate) enum DecodeGraphs {}

#[cfg(not(feature = "cuda"))]
impl DecodeGraphs {
    /// No graphs without CUDA.
    pub(crate) fn new(
        _: &dyn pagedattn::Backend,
        _: &mut dyn crate::serving::model::Model,
        _: usize,
        _: usize,
        _: usize,
    ) -> crate::Result<Option<Self>> {
        Ok(None)
    }

    /// Extra cache blocks (none).
    pub(crate) fn pad_blocks(&self) -> usize {
        match *self {}
    }

    /// Never called: there is no value.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn replay(
        &mut self,
        _: &dyn pagedattn::Backend,
        _: &[Box<dyn pagedattn::AttentionImpl>],
        _: &mut [pagedattn::KvCache],
        _: &[Option<usize>],
        _: &mut dyn crate::serving::model::Model,
        _: (
            &[pagedattn::SequenceDesc<'_>],
            crate::serving::model::StepTokens<'_>,
        ),
        _: &mut Vec<u32>,
    ) -> crate::Result<bool> {
        match *self {}
    }
}

#[cfg(feature = "cuda")]
mod gpu {
    use std::collections::HashMap;

    use pagedattn::cuda::{Cuda, Graph};
    use pagedattn::{
        AttentionConfig, AttentionImpl, AttnType, Backend, BlockId, Device, GraphCapacity, KvCache,
        MetadataBuilder, Plan, SequenceDesc, Workspace,
    };

    use crate::serving::attention::{run_attention, same_plan};
    use crate::serving::model::{Model, StepTokens};
    use crate::{Error, Result};

    /// One bucket's graph, with the plan and workspace its attention calls captured.
    struct DecodeGraph {
        graph: Graph,
        plan: Plan,
        /// Kept alive: the graph holds its address.
        _workspace: Workspace,
        /// The model's [`generation`](crate::serving::model::GraphStages::generation) at capture.
        generation: u64,
    }

    /// The bucket of a decode step of `n` (> 0) sequences: the next power of two up to 8,
    /// then the next multiple of 8 (as vLLM captures).
    fn bucket(n: usize) -> usize {
        if n <= 8 {
            n.next_power_of_two()
        } else {
            n.next_multiple_of(8)
        }
    }

    /// The graphs of an engine (see the module doc).
    pub(crate) struct DecodeGraphs {
        cuda: Cuda,
        block_size: usize,
        /// The first block past the scheduler's pool.
        pad_base: BlockId,
        /// The most sequences of a step (larger steps run without a graph).
        max_seqs: usize,
        /// The longest sequence a plan must hold.
        max_seq_len: usize,
        graphs: HashMap<usize, DecodeGraph>,
    }

    impl DecodeGraphs {
        /// Graphs for `model` on `backend`, where both allow them: a CUDA backend, a model
        /// with [`graph_stages`](Model::graph_stages) whose attentions are all `decoder`.
        /// `pool_blocks` is the scheduler's pool, `max_seqs` the most sequences of a step.
        pub(crate) fn new(
            backend: &dyn Backend,
            model: &mut dyn Model,
            block_size: usize,
            pool_blocks: usize,
            max_seqs: usize,
        ) -> Result<Option<Self>> {
            let Device::Cuda(ordinal) = backend.device() else {
                return Ok(None);
            };
            let layers = model.layers();
            // A graph's step has one plan: every layer a decoder, all sharing it.
            let shared = |c: &AttentionConfig| {
                c.attn_type() == AttnType::Decoder && same_plan(c, &layers[0])
            };
            if layers.is_empty() || !layers.iter().all(shared) {
                return Ok(None);
            }
            let max_seq_len = model.max_context();
            if model.graph_stages().is_none() {
                return Ok(None);
            }
            let pad_base = BlockId::try_from(pool_blocks)
                .map_err(|_| Error::Model(format!("{pool_blocks} blocks for block ids")))?;
            Ok(Some(DecodeGraphs {
                cuda: Cuda::new(ordinal)?,
                block_size,
                pad_base,
                max_seqs: max_seqs.max(1),
                max_seq_len,
                graphs: HashMap::new(),
            }))
        }

        /// Cache blocks the padding sequences need past the pool.
        pub(crate) fn pad_blocks(&self) -> usize {
            let most = (1..=self.max_seqs)
                .map(|n| bucket(n) - n)
                .max()
                .unwrap_or(0);
            most.div_ceil(self.block_size)
        }

        /// Runs a decode step (`descs`, one new token each, every sample greedy) through its
        /// bucket's graph, capturing it at the bucket's first step; leaves the greedy tokens
        /// in `greedy`. `false` (nothing done) for a step larger than every bucket.
        #[allow(clippy::too_many_arguments)]
        pub(crate) fn replay(
            &mut self,
            backend: &dyn Backend,
            attention: &[Box<dyn AttentionImpl>],
            caches: &mut [KvCache],
            cache_of: &[Option<usize>],
            model: &mut dyn Model,
            (descs, step): (&[SequenceDesc<'_>], StepTokens<'_>),
            greedy: &mut Vec<u32>,
        ) -> Result<bool> {
            let n = descs.len();
            if n == 0 || n > self.max_seqs {
                return Ok(false);
            }
            let bucket = bucket(n);
            let bs = self.block_size;
            let pad_tables: Vec<[BlockId; 1]> = (0..bucket - n)
                .map(|i| [self.pad_base + (i / bs) as BlockId])
                .collect();
            let mut builder = MetadataBuilder::new(bs);
            for d in descs {
                builder.push(*d);
            }
            for (i, table) in pad_tables.iter().enumerate() {
                builder.push(SequenceDesc::decode(i % bs, table));
            }
            let metadata = builder.build()?;
            // Every layer is a decoder: the first one's attention plans for all.
            let layer = 0;
            let spec = *cache_of[layer]
                .map(|i| caches[i].spec())
                .ok_or_else(|| Error::Model("a decoder layer without a cache".into()))?;
            let stages = model
                .graph_stages()
                .ok_or_else(|| Error::Model("the model lost its graph stages".into()))?;
            stages.load(&step, bucket)?;
            let generation = stages.generation();
            match self.graphs.get_mut(&bucket) {
                Some(g) if g.generation == generation => {
                    attention[layer].replan(&mut g.plan, &metadata, Some(&spec))?;
                    // SAFETY: the graph's tensors (the model's, unchanged since its
                    // generation matches: `GraphStages`' contract), caches (the engine's,
                    // never reallocated), workspace and plan (this entry's, refreshed by
                    // `replan` only) are alive, and the metadata was validated for these
                    // caches by `replan`.
                    unsafe { g.graph.replay()? };
                }
                _ => {
                    let capacity = GraphCapacity {
                        max_seq_len: self.max_seq_len,
                    };
                    let plan = attention[layer].plan_for_graph(&metadata, Some(&spec), capacity)?;
                    let mut workspace = Workspace::empty(backend.device());
                    workspace.reserve(&plan)?;
                    let mut attend = |l: usize, q: &_, k: &_, v: &_, out: &mut _| {
                        let cache = cache_of[l].map(|i| &mut caches[i]);
                        run_attention(
                            backend,
                            attention[l].as_ref(),
                            &plan,
                            &mut workspace,
                            q,
                            Some((k, v)),
                            cache,
                            out,
                        )
                    };
                    // Once for real (loading every kernel a capture cannot load, and giving
                    // this step's tokens), then captured.
                    stages.compute(bucket, bucket, &mut attend)?;
                    // (The capture ends either way; a failed compute's partial graph is
                    // dropped and its error returned.)
                    let mut computed = Ok(());
                    // Thread-local: a tensor-parallel engine's other ranks allocate and
                    // synchronize on their threads meanwhile.
                    let graph = self.cuda.capture_on_this_thread(|| {
                        computed = stages.compute(bucket, bucket, &mut attend);
                        Ok(())
                    });
                    computed?;
                    let graph = graph?;
                    self.graphs.insert(
                        bucket,
                        DecodeGraph {
                            graph,
                            plan,
                            _workspace: workspace,
                            generation,
                        },
                    );
                }
            }
            stages.greedy(n, greedy)?;
            Ok(true)
        }
    }
}
