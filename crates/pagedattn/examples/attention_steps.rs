//! The library as an inference engine drives it (`pagedattn-engine` does the same at scale):
//! the attention of a two-layer model over a paged KV cache through a schedule of steps, on the
//! backend named on the command line (default `auto`), every output checked against
//! `reference`. The schedule:
//!
//! 1. a prompt of 37 tokens, and the first 20 tokens of a prompt of 30 (chunked prefill);
//! 2. the second prompt's last 10 tokens next to the first sequence's first decode;
//! 3. three decode steps of both, the second sequence growing a third block;
//! 4. the second sequence preempted (swapped out to host memory, every layer in one call), its
//!    blocks going to a new prompt decoded next to the first sequence;
//! 5. the second sequence swapped back in, into other blocks, and the first forked (parallel
//!    sampling: the child shares its full blocks and gets a copy of the last one);
//! 6. two decode steps of all four sequences.
//!
//! `cargo run --release --example attention_steps -- [BACKEND]` (from the workspace root, without
//! `-p`: it then reuses the library `cargo test --workspace --release` built)

use std::process::ExitCode;

use pagedattn::{
    registry, AttentionConfig, AttentionImpl, Backend, BlockId, DType, Device, Inputs, KvCache,
    KvCacheSpec, MetadataBuilder, Result, SequenceDesc, Tensor, Workspace,
};

const LAYERS: usize = 2;
/// Tokens per block.
const BLOCK: usize = 16;
/// Blocks of each layer's device cache.
const NUM_BLOCKS: usize = 16;
/// Blocks of each layer's host swap space.
const SWAP_BLOCKS: usize = 4;

fn main() -> ExitCode {
    let name = std::env::args().nth(1).unwrap_or_else(|| "auto".into());
    let run = || -> Result<f32> {
        let backend = registry::backend(&name)?;
        println!("backend {} on {}", backend.name(), backend.device());
        let got = run_schedule(backend.as_ref())?;
        let want = run_schedule(registry::backend("reference")?.as_ref())?;
        Ok(got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max))
    };
    match run() {
        // bf16 outputs of values in [-1, 1]: a few bf16 ulps apart at most.
        Ok(diff) if diff <= 2e-2 => {
            println!("largest difference from reference: {diff:.1e}: ok");
            ExitCode::SUCCESS
        }
        Ok(diff) => {
            eprintln!("largest difference from reference: {diff:.1e}: MISMATCH");
            ExitCode::from(1)
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

/// Runs the schedule of the module's header on `backend`; returns every output, step by step
/// and layer by layer.
fn run_schedule(backend: &dyn Backend) -> Result<Vec<f32>> {
    let mut engine = Engine::new(backend)?;
    let (a, b) = (engine.add(), engine.add());
    engine.step(&[Work::Prompt(a, 37), Work::Prompt(b, 20)])?;
    engine.step(&[Work::Prompt(b, 10), Work::Decode(a)])?;
    for _ in 0..3 {
        engine.step(&[Work::Decode(a), Work::Decode(b)])?;
    }
    engine.swap_out(b)?;
    let c = engine.add();
    engine.step(&[Work::Prompt(c, 24), Work::Decode(a)])?;
    engine.swap_in(b)?;
    let d = engine.fork(a)?;
    for _ in 0..2 {
        engine.step(&[a, b, c, d].map(Work::Decode))?;
    }
    Ok(engine.outputs)
}

/// What a step computes for one sequence (prompts come before decodes in a step).
#[derive(Clone, Copy)]
enum Work {
    /// The next `n` tokens of a prompt (all of it, or a chunk).
    Prompt(usize, usize),
    /// One new token.
    Decode(usize),
}

impl Work {
    /// The sequence and its number of new tokens.
    fn seq_and_new(self) -> (usize, usize) {
        match self {
            Work::Prompt(s, n) => (s, n),
            Work::Decode(s) => (s, 1),
        }
    }
}

/// One sequence as the scheduler keeps it.
#[derive(Default)]
struct Seq {
    /// Its blocks in the device caches (every layer's cache has the same block ids); empty
    /// while swapped out.
    table: Vec<BlockId>,
    /// Tokens already in the cache.
    cached: usize,
    /// Swap blocks `0..swapped` hold its blocks while it is swapped out.
    swapped: usize,
}

/// A tiny engine: one layer config for every layer, each layer's cache and swap space, the
/// free blocks, and the sequences.
struct Engine<'a> {
    backend: &'a dyn Backend,
    config: AttentionConfig,
    attention: Box<dyn AttentionImpl>,
    spec: KvCacheSpec,
    caches: Vec<KvCache>,
    swaps: Vec<KvCache>,
    workspace: Workspace,
    /// Free device blocks, the next one last.
    free: Vec<BlockId>,
    seqs: Vec<Seq>,
    steps: u32,
    outputs: Vec<f32>,
}

impl<'a> Engine<'a> {
    /// Allocates every layer's cache and swap space: the cache geometry comes from the layer
    /// (kv heads and head size are not written twice), the swap space's from the cache.
    fn new(backend: &'a dyn Backend) -> Result<Self> {
        let config = AttentionConfig::builder(8, 64).num_kv_heads(2).build()?;
        let spec = config.kv_cache_spec(DType::BF16, NUM_BLOCKS, BLOCK);
        let caches = (0..LAYERS)
            .map(|_| backend.allocate_kv_cache(&spec))
            .collect::<Result<Vec<_>>>()?;
        let swaps = caches
            .iter()
            .map(|cache| backend.allocate_swap_space(cache.spec(), SWAP_BLOCKS))
            .collect::<Result<Vec<_>>>()?;
        Ok(Engine {
            backend,
            attention: backend.attention(&config)?,
            config,
            spec,
            caches,
            swaps,
            workspace: Workspace::empty(backend.device()),
            free: (0..NUM_BLOCKS as BlockId).rev().collect(),
            seqs: Vec::new(),
            steps: 0,
            outputs: Vec::new(),
        })
    }

    /// A new, empty sequence.
    fn add(&mut self) -> usize {
        self.seqs.push(Seq::default());
        self.seqs.len() - 1
    }

    /// One step: blocks for the new tokens (a sequence's table grows when they pass its last
    /// block), the metadata, planned once, then every layer's forward with the layer's q, k
    /// and v (random here: a model computes them).
    fn step(&mut self, work: &[Work]) -> Result<()> {
        for &w in work {
            let (s, new) = w.seq_and_new();
            let seq = &mut self.seqs[s];
            while seq.table.len() * BLOCK < seq.cached + new {
                seq.table.push(self.free.pop().expect("a free block"));
            }
        }
        let metadata = {
            let mut builder = MetadataBuilder::for_cache(&self.spec);
            for &w in work {
                builder.push(match w {
                    Work::Prompt(s, n) => {
                        SequenceDesc::prompt(self.seqs[s].cached, n, &self.seqs[s].table)
                    }
                    Work::Decode(s) => {
                        SequenceDesc::decode(self.seqs[s].cached, &self.seqs[s].table)
                    }
                });
            }
            builder.build()?
        };
        let plan = self.attention.plan(&metadata, Some(&self.spec))?;
        self.workspace.reserve(&plan)?;
        let (device, t) = (self.backend.device(), metadata.num_tokens());
        let mut output = self.config.zeros_query(device, DType::BF16, t)?;
        for (layer, cache) in self.caches.iter_mut().enumerate() {
            let seed = 3 * (self.steps * LAYERS as u32 + layer as u32);
            let q = random(device, &self.config.query_shape(t), seed)?;
            let k = random(device, &self.config.kv_shape(t), seed + 1)?;
            let v = random(device, &self.config.kv_shape(t), seed + 2)?;
            let inputs = Inputs::new(&q).with_kv(&k, &v).with_cache(cache);
            self.attention
                .forward_into(&plan, &mut self.workspace, inputs, &mut output)?;
            self.outputs.extend(output.to_f32_vec()?);
        }
        for &w in work {
            let (s, new) = w.seq_and_new();
            self.seqs[s].cached += new;
        }
        self.steps += 1;
        Ok(())
    }

    /// Preempts sequence `s`: its blocks go to swap blocks 0.. of every layer in one call, and
    /// back to the free list.
    fn swap_out(&mut self, s: usize) -> Result<()> {
        let seq = &mut self.seqs[s];
        let pairs: Vec<(BlockId, BlockId)> = seq.table.iter().copied().zip(0..).collect();
        self.backend
            .swap_out(&self.caches, &mut self.swaps, &pairs)?;
        seq.swapped = pairs.len();
        self.free.append(&mut seq.table);
        Ok(())
    }

    /// Brings sequence `s` back from swap space into whichever blocks are free now.
    fn swap_in(&mut self, s: usize) -> Result<()> {
        let seq = &mut self.seqs[s];
        seq.table = (0..seq.swapped)
            .map(|_| self.free.pop().expect("a free block"))
            .collect();
        let pairs: Vec<(BlockId, BlockId)> = (0..).zip(seq.table.iter().copied()).collect();
        self.backend
            .swap_in(&self.swaps, &mut self.caches, &pairs)?;
        Ok(())
    }

    /// Forks sequence `s` into a new one: the child shares `s`'s full blocks (neither writes
    /// into them again; an engine that frees blocks counts their owners) and gets a copy of
    /// its last, partly filled block, which both will write into (copy-on-write), copied in
    /// every layer in one call.
    fn fork(&mut self, s: usize) -> Result<usize> {
        let cached = self.seqs[s].cached;
        let mut table = self.seqs[s].table[..cached / BLOCK].to_vec();
        if !cached.is_multiple_of(BLOCK) {
            let copy = self.free.pop().expect("a free block");
            let last = self.seqs[s].table[cached / BLOCK];
            self.backend
                .copy_blocks(&mut self.caches, &[(last, copy)])?;
            table.push(copy);
        }
        self.seqs.push(Seq {
            table,
            cached,
            swapped: 0,
        });
        Ok(self.seqs.len() - 1)
    }
}

/// A bf16 tensor of reproducible values in [-1, 1] on `device`.
fn random(device: Device, shape: &[usize], seed: u32) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let values: Vec<f32> = (0..n as u32)
        .map(|i| {
            let h = (i ^ seed.wrapping_mul(0x9E37_79B9)).wrapping_mul(0x85EB_CA6B);
            (h >> 8) as f32 / (1u32 << 23) as f32 - 1.0
        })
        .collect();
    Tensor::from_f32(DType::BF16, shape, &values)?.to_device(device)
}
