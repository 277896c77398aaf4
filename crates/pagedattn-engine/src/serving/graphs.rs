//! Decode steps replayed from CUDA graphs: for a model whose whole forward is device work
//! ([`GraphStages`](crate::serving::model::GraphStages)), a decode step of `n` sequences is
//! padded to a bucket (vLLM's: 1, 2, 4, 8, then multiples of 8) and replayed from that
//! bucket's graph after `replan` refreshes the attention's plan in place. A replay costs one
//! launch where the forward costs hundreds.
//!
//! Every bucket up to the most sequences of a step is captured when the engine starts (as
//! vLLM does: no request pays for a capture), after the model has reserved its activations
//! for the largest step, so that no later step moves them; should the model move them all
//! the same, every bucket is captured again before the next replay. The graphs share one
//! attention workspace (they replay one at a time on one stream).
//!
//! Padding sequences decode one token each into blocks past the scheduler's pool (the engine
//! allocates them for this), at distinct slots; their rows are computed and never read.

#[cfg(feature = "cuda")]
pub(crate) use gpu::DecodeGraphs;

/// What a capture and a replay use of a rank: its backend, attentions, caches (and which layer
/// has which) and model.
// (Without CUDA no graph exists to read them.)
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct GraphParts<'a> {
    pub(crate) backend: &'a dyn pagedattn::Backend,
    pub(crate) attention: &'a [Box<dyn pagedattn::AttentionImpl>],
    pub(crate) caches: &'a mut [pagedattn::KvCache],
    pub(crate) cache_of: &'a [Option<usize>],
    pub(crate) model: &'a mut dyn crate::serving::model::Model,
}

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
        _: (usize, usize),
    ) -> crate::Result<Option<Self>> {
        Ok(None)
    }

    /// Never called: there is no value.
    pub(crate) fn captures(&self) -> usize {
        match *self {}
    }

    /// Never called: there is no value.
    pub(crate) fn capture(&mut self, _: &mut GraphParts<'_>) -> crate::Result<()> {
        match *self {}
    }

    /// Extra cache blocks (none).
    pub(crate) fn pad_blocks(&self) -> usize {
        match *self {}
    }

    /// Never called: there is no value.
    pub(crate) fn replay(
        &mut self,
        _: &mut GraphParts<'_>,
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
        AttentionConfig, AttnType, Backend, BlockId, Device, GraphCapacity, MetadataBuilder, Plan,
        SequenceDesc, Workspace,
    };

    use super::GraphParts;
    use crate::serving::attention::{run_attention, same_plan};
    use crate::serving::model::{GraphStages, Model, StepTokens};
    use crate::{Error, Result};

    /// One bucket's graph, with the plan its attention calls captured.
    struct DecodeGraph {
        graph: Graph,
        plan: Plan,
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

    /// Every bucket up to (and including) `largest`'s, largest first.
    fn buckets(largest: usize) -> Vec<usize> {
        let mut all: Vec<usize> = (1..=largest).map(bucket).collect();
        all.dedup();
        all.reverse();
        all
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
        /// The most tokens of any step, reserved in the model before capturing.
        max_step_tokens: usize,
        /// Every bucket's graph, captured together.
        graphs: HashMap<usize, DecodeGraph>,
        /// The model's [`generation`](crate::serving::model::GraphStages::generation) at
        /// capture (`None`: nothing captured yet).
        generation: Option<u64>,
        /// The attention workspace of every graph: replays never overlap (one stream), so
        /// one suffices, sized for every bucket's plan before the first capture takes its
        /// address. Declared after `graphs`, which hold that address: dropped after them.
        workspace: Workspace,
        /// Times every bucket was captured.
        captures: usize,
    }

    impl DecodeGraphs {
        /// Graphs for `model` on `backend`, where both allow them: a CUDA backend, a model
        /// with [`graph_stages`](Model::graph_stages) whose attentions are all `decoder`.
        /// `pool_blocks` is the scheduler's pool, `max_seqs` the most sequences of a step and
        /// `max_step_tokens` the most tokens. Nothing is captured before
        /// [`capture`](Self::capture).
        pub(crate) fn new(
            backend: &dyn Backend,
            model: &mut dyn Model,
            block_size: usize,
            pool_blocks: usize,
            (max_seqs, max_step_tokens): (usize, usize),
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
            let max_seqs = max_seqs.max(1);
            Ok(Some(DecodeGraphs {
                cuda: Cuda::new(ordinal)?,
                block_size,
                pad_base,
                max_seqs,
                max_seq_len,
                max_step_tokens: max_step_tokens.max(bucket(max_seqs)),
                graphs: HashMap::new(),
                generation: None,
                workspace: Workspace::empty(backend.device()),
                captures: 0,
            }))
        }

        /// Cache blocks the padding sequences need past the pool: a capture's step is
        /// padding only, as many sequences as the largest bucket.
        pub(crate) fn pad_blocks(&self) -> usize {
            bucket(self.max_seqs).div_ceil(self.block_size)
        }

        /// The metadata of a step of `descs` padded to `bucket` sequences: each padding
        /// sequence decodes one token into the blocks past the pool, at a slot of its own.
        fn metadata(
            &self,
            descs: &[SequenceDesc<'_>],
            bucket: usize,
        ) -> Result<pagedattn::AttentionMetadata> {
            let bs = self.block_size;
            let pad_tables: Vec<[BlockId; 1]> = (0..bucket - descs.len())
                .map(|i| [self.pad_base + (i / bs) as BlockId])
                .collect();
            let mut builder = MetadataBuilder::new(bs);
            for d in descs {
                builder.push(*d);
            }
            for (i, table) in pad_tables.iter().enumerate() {
                builder.push(SequenceDesc::decode(i % bs, table));
            }
            Ok(builder.build()?)
        }

        /// Captures every bucket's graph (replacing any captured before), after reserving
        /// the model's activations for the largest step, so that no later step moves them
        /// (vLLM captures at start-up too: no request pays for a capture). Each bucket's
        /// step is padding only, computed once for real (loading every kernel, which a
        /// capture cannot do), then captured.
        pub(crate) fn capture(&mut self, parts: &mut GraphParts<'_>) -> Result<()> {
            let (backend, attention, cache_of) = (parts.backend, parts.attention, parts.cache_of);
            let spec = decoder_spec(parts)?;
            let (caches, stages) = (&mut *parts.caches, stages_of(parts.model)?);
            let largest = bucket(self.max_seqs);
            stages.reserve(self.max_step_tokens, largest)?;
            // The old graphs hold the old workspace's address: gone before it is.
            self.graphs.clear();
            self.generation = None;
            let capacity = GraphCapacity {
                max_seq_len: self.max_seq_len,
            };
            // Every plan first: the shared workspace must fit them all before a capture.
            let mut workspace = Workspace::empty(backend.device());
            let mut plans = Vec::new();
            for b in buckets(largest) {
                // Every layer is a decoder: the first one's attention plans for all.
                let plan =
                    attention[0].plan_for_graph(&self.metadata(&[], b)?, Some(&spec), capacity)?;
                workspace.reserve(&plan)?;
                plans.push((b, plan));
            }
            self.workspace = workspace;
            let padding = StepTokens {
                tokens: &[],
                positions: &[],
                logit_rows: &[],
                encoder_tokens: &[],
                encoder_positions: &[],
            };
            let mut scratch = Vec::new();
            for (b, plan) in plans {
                stages.load(&padding, b)?;
                let workspace = &mut self.workspace;
                let mut attend = |l: usize, q: &_, k: &_, v: &_, out: &mut _| {
                    let cache = cache_of[l].map(|i| &mut caches[i]);
                    run_attention(
                        backend,
                        attention[l].as_ref(),
                        &plan,
                        workspace,
                        q,
                        Some((k, v)),
                        cache,
                        out,
                    )
                };
                stages.compute(b, b, &mut attend)?;
                // Waited for (through its tokens) before the capture: NCCL takes whether a
                // collective is captured as a property of all its ranks, so no rank starts
                // capturing while its uncaptured collectives are still queued (a 2-GPU test
                // hung once without this wait, cause not established: design/engine.md,
                // "Tensor parallelism").
                stages.greedy(b, &mut scratch)?;
                // (The capture ends either way; a failed compute's partial graph is
                // dropped and its error returned.)
                let mut computed = Ok(());
                // Thread-local: a tensor-parallel engine's other ranks allocate and
                // synchronize on their threads meanwhile.
                let graph = self.cuda.capture_on_this_thread(|| {
                    computed = stages.compute(b, b, &mut attend);
                    Ok(())
                });
                computed?;
                let graph = graph?;
                self.graphs.insert(b, DecodeGraph { graph, plan });
            }
            self.generation = Some(stages.generation());
            self.captures += 1;
            Ok(())
        }

        /// Times every bucket was captured.
        pub(crate) fn captures(&self) -> usize {
            self.captures
        }

        /// Runs a decode step (`descs`, one new token each, every sample greedy) through its
        /// bucket's graph, capturing every bucket again first if the model moved its memory
        /// since; leaves the greedy tokens in `greedy`. `false` (nothing done) for a step
        /// larger than every bucket.
        pub(crate) fn replay(
            &mut self,
            parts: &mut GraphParts<'_>,
            (descs, step): (&[SequenceDesc<'_>], StepTokens<'_>),
            greedy: &mut Vec<u32>,
        ) -> Result<bool> {
            let n = descs.len();
            if n == 0 || n > self.max_seqs {
                return Ok(false);
            }
            let bucket = bucket(n);
            let metadata = self.metadata(descs, bucket)?;
            let spec = decoder_spec(parts)?;
            stages_of(parts.model)?.load(&step, bucket)?;
            if self.generation != Some(stages_of(parts.model)?.generation()) {
                // (A capture's padding steps overwrite the inputs: loaded again.)
                self.capture(parts)?;
                stages_of(parts.model)?.load(&step, bucket)?;
            }
            let g = self
                .graphs
                .get_mut(&bucket)
                .ok_or_else(|| Error::Model(format!("no graph of bucket {bucket}")))?;
            // Every layer is a decoder: the first one's attention plans for all.
            parts.attention[0].replan(&mut g.plan, &metadata, Some(&spec))?;
            // SAFETY: the graph's tensors (the model's, unchanged since its generation
            // matches after the `load`: `GraphStages`' contract), caches (the engine's, never
            // reallocated), workspace (this value's, replaced only by `capture` after the
            // graphs) and plan (this entry's, refreshed by `replan` only) are alive, and the
            // metadata was validated for these caches by `replan`.
            unsafe { g.graph.replay()? };
            stages_of(parts.model)?.greedy(n, greedy)?;
            Ok(true)
        }
    }

    /// The cache spec of the first layer, a decoder's (every layer's plan is its).
    fn decoder_spec(parts: &GraphParts<'_>) -> Result<pagedattn::KvCacheSpec> {
        parts.cache_of[0]
            .map(|i| *parts.caches[i].spec())
            .ok_or_else(|| Error::Model("a decoder layer without a cache".into()))
    }

    /// `model`'s graph stages.
    fn stages_of(model: &mut dyn Model) -> Result<&mut dyn GraphStages> {
        model
            .graph_stages()
            .ok_or_else(|| Error::Model("the model lost its graph stages".into()))
    }
}
