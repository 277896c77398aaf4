//! [`Rank`]: one device's share of the engine — a backend, the model (or its shard) on it,
//! its attentions, caches, swap space, workspace, clock and CUDA graphs. An engine on one
//! device has one rank; with tensor parallelism each GPU is a rank, and every step runs the
//! same forward on every rank at once, one thread a rank ([`RankRunner`]). The scheduler and
//! the block manager are the engine's, one for all ranks: a block id names the same block in
//! every rank's caches, and swaps and copies are applied on every rank.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use pagedattn::{AttentionConfig, AttentionImpl, Backend, KvCache, SequenceDesc, Workspace};

use super::watchdog::StepWatchdog;
use super::EngineConfig;
use crate::serving::batch::StepBatch;
use crate::serving::clock::AttentionClock;
use crate::serving::graphs::{DecodeGraphs, GraphParts};
use crate::serving::model::{Model, StepTokens};
use crate::{Error, Result};

/// A device's backend and the model (a tensor-parallel model's shard) that runs on it.
pub struct RankParts<'a> {
    /// The backend its attention runs on (its GPU).
    pub backend: &'a dyn Backend,
    /// The model, or this rank's shard of it: its [`layers`](Model::layers) have this rank's
    /// heads, so that its caches hold this rank's share of the keys and values.
    pub model: Box<dyn Model + 'a>,
}

/// A model placed on its devices, owned: each rank's backend and model (its shard: rank 0's
/// model answers for all), and what aborts the ranks' collectives where there are several.
/// What [`Engine::placed`](super::Engine::placed) borrows the backends of and takes the
/// models of ([`into_parts`](Self::into_parts)).
pub struct Placed {
    backends: Vec<Box<dyn Backend>>,
    models: Vec<Box<dyn Model>>,
    abort: Option<AbortRanks>,
}

impl Placed {
    /// Rank i's model `models[i]` on `backends[i]`, and `abort` (see [`AbortRanks`]; `None`
    /// for one rank). At least one rank, and as many backends as models.
    pub fn new(
        backends: Vec<Box<dyn Backend>>,
        models: Vec<Box<dyn Model>>,
        abort: Option<AbortRanks>,
    ) -> Result<Self> {
        if models.is_empty() || backends.len() != models.len() {
            return Err(Error::Model(format!(
                "{} backends for {} models: expected one backend a model, at least one",
                backends.len(),
                models.len()
            )));
        }
        Ok(Placed {
            backends,
            models,
            abort,
        })
    }

    /// `model` alone on `backend`.
    pub fn one(backend: Box<dyn Backend>, model: Box<dyn Model>) -> Self {
        Placed {
            backends: vec![backend],
            models: vec![model],
            abort: None,
        }
    }

    /// Rank 0's model, which answers for all (name, kind, vocabulary, context).
    pub fn model(&self) -> &dyn Model {
        self.models[0].as_ref()
    }

    /// Rank 0's backend (each rank's is of the same kind).
    pub fn backend(&self) -> &dyn Backend {
        self.backends[0].as_ref()
    }

    /// The backends, models and abort, for [`Engine::placed`](super::Engine::placed).
    #[allow(clippy::type_complexity)]
    pub fn into_parts(
        self,
    ) -> (
        Vec<Box<dyn Backend>>,
        Vec<Box<dyn Model>>,
        Option<AbortRanks>,
    ) {
        (self.backends, self.models, self.abort)
    }
}

/// Called from a rank's thread when that rank fails, while the other ranks may be waiting
/// for it inside a collective (an NCCL all-reduce): it must make them return (abort the
/// communicators). Called at most once per failed step, possibly concurrently with the
/// other ranks' work.
pub type AbortRanks = Arc<dyn Fn() + Send + Sync>;

/// What a forward leaves on a rank's host: each logit row's logits, or its greedy token.
#[derive(Default)]
pub(crate) struct RankOutput {
    pub(crate) logits: Vec<f32>,
    pub(crate) greedy: Vec<u32>,
}

/// One device's share of the engine (see the module doc).
pub(crate) struct Rank<'a> {
    pub(crate) backend: &'a dyn Backend,
    pub(crate) model: Box<dyn Model + 'a>,
    pub(crate) attention: Vec<Box<dyn AttentionImpl>>,
    /// Each attention's config (this rank's heads).
    pub(crate) layers: Vec<AttentionConfig>,
    /// Each attention's cache's index in `caches` (`None`: it runs without one).
    pub(crate) cache_of: Vec<Option<usize>>,
    /// The caches (every `decoder` and `encoder_decoder` attention's, in layer order).
    pub(crate) caches: Vec<KvCache>,
    pub(crate) swaps: Vec<KvCache>,
    pub(crate) workspace: Workspace,
    pub(crate) clock: AttentionClock,
    pub(crate) graphs: Option<DecodeGraphs>,
    /// Attention calls made.
    pub(crate) attention_calls: usize,
    pub(crate) output: RankOutput,
}

impl<'a> Rank<'a> {
    /// `parts` with one attention per layer and each layer's cache and swap space allocated
    /// for the pools of `config` (plus the CUDA graphs' padding blocks); its attention timed
    /// where `timed` (rank 0: the report's figure is its).
    pub(crate) fn new(parts: RankParts<'a>, config: &EngineConfig, timed: bool) -> Result<Self> {
        let RankParts { backend, mut model } = parts;
        let pools = &config.scheduler.blocks;
        let layers = model.layers().to_vec();
        let attention = layers
            .iter()
            .map(|c| backend.attention(c))
            .collect::<pagedattn::Result<Vec<_>>>()?;
        let graphs = if config.cuda_graphs {
            DecodeGraphs::new(
                backend,
                model.as_mut(),
                pools.block_size,
                pools.num_device_blocks,
                (
                    config.scheduler.max_seqs,
                    config.scheduler.max_batched_tokens,
                ),
            )?
        } else {
            None
        };
        // The padding sequences of graph steps write past the scheduler's pool.
        let cache_blocks = pools
            .num_device_blocks
            .checked_add(graphs.as_ref().map_or(0, |g| g.pad_blocks()))
            .ok_or_else(|| {
                Error::Model(format!(
                    "num_device_blocks = {}: too many blocks to add the CUDA graphs' padding",
                    pools.num_device_blocks
                ))
            })?;
        let mut cache_of = Vec::with_capacity(layers.len());
        let mut caches = Vec::new();
        for c in &layers {
            cache_of.push(if c.attn_type().uses_cache() {
                let spec = c.kv_cache_spec(model.dtype(), cache_blocks, pools.block_size);
                caches.push(backend.allocate_kv_cache(&spec)?);
                Some(caches.len() - 1)
            } else {
                None
            });
        }
        let swaps = caches
            .iter()
            .map(|c| backend.allocate_swap_space(c.spec(), pools.num_host_blocks))
            .collect::<pagedattn::Result<Vec<_>>>()?;
        Ok(Rank {
            backend,
            workspace: Workspace::empty(backend.device()),
            clock: if timed {
                AttentionClock::new(backend)?
            } else {
                AttentionClock::Off
            },
            model,
            attention,
            layers,
            cache_of,
            caches,
            swaps,
            graphs,
            attention_calls: 0,
            output: RankOutput::default(),
        })
    }

    /// The step's block moves on this rank's caches: swaps out, swaps in, then copies.
    pub(crate) fn move_blocks(&mut self, batch: &StepBatch) -> Result<()> {
        if !batch.swap_out.is_empty() {
            self.backend
                .swap_out(&self.caches, &mut self.swaps, &batch.swap_out)?;
        }
        if !batch.swap_in.is_empty() {
            self.backend
                .swap_in(&self.swaps, &mut self.caches, &batch.swap_in)?;
        }
        if !batch.copies.is_empty() {
            self.backend.copy_blocks(&mut self.caches, &batch.copies)?;
        }
        Ok(())
    }

    /// Captures the rank's CUDA graphs, where it has them (every rank at once: the graphs of
    /// a tensor-parallel model hold its collectives).
    pub(crate) fn capture_graphs(&mut self) -> Result<()> {
        let Some(graphs) = self.graphs.as_mut() else {
            return Ok(());
        };
        graphs.capture(&mut GraphParts {
            backend: self.backend,
            attention: &self.attention,
            caches: &mut self.caches,
            cache_of: &self.cache_of,
            model: self.model.as_mut(),
        })
    }

    /// Runs a decode step through a CUDA graph where there are graphs and the step fits one
    /// (the greedy tokens left in the rank's output); `false` where it ran nothing.
    pub(crate) fn replay_decode(
        &mut self,
        descs: &[SequenceDesc<'_>],
        step: StepTokens<'_>,
    ) -> Result<bool> {
        let Some(graphs) = self.graphs.as_mut() else {
            return Ok(false);
        };
        let mut parts = GraphParts {
            backend: self.backend,
            attention: &self.attention,
            caches: &mut self.caches,
            cache_of: &self.cache_of,
            model: self.model.as_mut(),
        };
        graphs.replay(&mut parts, (descs, step), &mut self.output.greedy)
    }
}

/// Whether the ranks' models agree on everything the engine reads of rank 0's alone: kind,
/// dtype, vocabulary, context, stop tokens, output width, and each attention's type, head
/// size and window (their head counts are each rank's own).
pub(crate) fn check_ranks_agree(ranks: &[Rank<'_>]) -> Result<()> {
    let Some((first, rest)) = ranks.split_first() else {
        return Err(Error::Model("an engine of no rank".into()));
    };
    let summary = |r: &Rank<'_>| {
        let m = &r.model;
        let layers: Vec<_> = r
            .layers
            .iter()
            .map(|c| (c.attn_type(), c.head_size(), c.sliding_window()))
            .collect();
        format!(
            "{:?} {:?} vocab {} context {} stops {:?} width {} layers {layers:?}",
            m.kind(),
            m.dtype(),
            m.vocab_size(),
            m.max_context(),
            m.stop_tokens(),
            m.output_width()
        )
    };
    let want = summary(first);
    for (i, r) in rest.iter().enumerate() {
        let got = summary(r);
        if got != want {
            return Err(Error::Model(format!(
                "rank {} serves another model than rank 0: {got}, expected {want}",
                i + 1
            )));
        }
    }
    Ok(())
}

/// The threads that run a step's ranks, one a rank, made once per engine (of several ranks):
/// a step hands each thread its rank instead of spawning threads. One thread a rank, each
/// running only its own: a rank's work waits for its GPU, whose collectives wait for every
/// other rank, so no rank may queue behind another.
struct RankThreads(rayon::ThreadPool);

impl RankThreads {
    /// Threads for `ranks` ranks.
    fn new(ranks: usize) -> Result<Self> {
        rayon::ThreadPoolBuilder::new()
            .num_threads(ranks)
            .thread_name(|i| format!("rank-{i}"))
            .build()
            .map(RankThreads)
            .map_err(|e| Error::Model(format!("starting {ranks} rank threads: {e}")))
    }
}

/// How the engine runs work on its ranks: with several, a thread a rank, what aborts their
/// collectives when one fails, and the watchdog that aborts them when all wait.
pub(crate) struct RankRunner {
    threads: Option<RankThreads>,
    abort: Option<AbortRanks>,
    watchdog: Option<StepWatchdog>,
}

impl RankRunner {
    /// The runner of `ranks` ranks (one: nothing to start) whose collectives `abort` aborts.
    pub(crate) fn new(ranks: usize, abort: Option<AbortRanks>) -> Result<Self> {
        let threads = match ranks {
            1 => None,
            n => Some(RankThreads::new(n)?),
        };
        let watchdog = match (&abort, ranks) {
            (Some(abort), 2..) => Some(StepWatchdog::new(abort.clone())?),
            _ => None,
        };
        Ok(RankRunner {
            threads,
            abort,
            watchdog,
        })
    }

    /// Work on several ranks may run this long from now on (see [`StepWatchdog`]).
    pub(crate) fn set_timeout(&self, timeout: Duration) {
        if let Some(w) = &self.watchdog {
            w.set_timeout(timeout);
        }
    }

    /// [`on_ranks`] under the watchdog, where there is one.
    pub(crate) fn run<T: Send>(
        &mut self,
        ranks: &mut [Rank<'_>],
        work: impl Fn(usize, &mut Rank<'_>) -> Result<T> + Sync,
    ) -> Result<Vec<T>> {
        let (threads, abort) = (self.threads.as_ref(), self.abort.as_ref());
        let run = || on_ranks(ranks, threads, abort, work);
        match self.watchdog.as_mut() {
            Some(w) => w.watch(run),
            None => run(),
        }
    }
}

/// Runs `work` on every rank at once and returns each rank's result: one rank on this thread,
/// several on `threads`, rank i on thread i (rayon's `broadcast` runs its closure once on
/// every thread of the pool). A rank that fails calls `abort` at once, so that ranks waiting
/// for it in a collective return; the error returned is the first rank's to fail (the
/// others' are its consequences). A rank that panics aborts the others too, and the panic is
/// resumed here.
fn on_ranks<T: Send>(
    ranks: &mut [Rank<'_>],
    threads: Option<&RankThreads>,
    abort: Option<&AbortRanks>,
    work: impl Fn(usize, &mut Rank<'_>) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    if let [rank] = ranks {
        return Ok(vec![work(0, rank)?]);
    }
    let threads = match threads {
        Some(t) if t.0.current_num_threads() == ranks.len() => t,
        _ => {
            return Err(Error::Model(format!(
                "{} ranks without a thread each",
                ranks.len()
            )))
        }
    };
    let first_error: Mutex<Option<Error>> = Mutex::new(None);
    // (Each thread locks only its own rank's: the locks hand out `&mut`, never contend.)
    let slots: Vec<Mutex<&mut Rank<'_>>> = ranks.iter_mut().map(Mutex::new).collect();
    let results: Vec<Option<T>> = threads.0.broadcast(|ctx| {
        let i = ctx.index();
        let mut rank = slots[i].lock().unwrap_or_else(|p| p.into_inner());
        // Aborts the others if this rank's work fails or unwinds.
        let guard = AbortOnDrop(abort);
        match work(i, &mut rank) {
            Ok(value) => {
                std::mem::forget(guard);
                Some(value)
            }
            Err(e) => {
                let mut first = first_error.lock().unwrap_or_else(|p| p.into_inner());
                first.get_or_insert(e);
                drop(first);
                drop(guard);
                None
            }
        }
    });
    if let Some(e) = first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    Ok(results.into_iter().flatten().collect())
}

/// Calls the abort hook when dropped (a rank's work failed or unwound).
struct AbortOnDrop<'h>(Option<&'h AbortRanks>);

impl Drop for AbortOnDrop<'_> {
    fn drop(&mut self) {
        if let Some(abort) = self.0 {
            abort();
        }
    }
}
