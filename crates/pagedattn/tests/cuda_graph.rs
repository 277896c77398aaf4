//! CUDA graphs: a decode step of several layers captured once and replayed for later steps
//! whose metadata changed (longer sequences, new slots, new block tables), each replay checked
//! against `reference` run on host copies of the same caches, and the caches compared byte for
//! byte at the end. A plan made for graphs refuses steps it cannot hold, and stays usable.
//! And the same layers' steps on a caller's stream (`Cuda::on_stream`), in order with the
//! caller's kernels and with plans made and dropped around them.
//!
//! The test needs a GPU and is `#[ignore]`d: a run without one lists it as ignored;
//! `tools/gpu-suite.sh` (or `--include-ignored` on a GPU machine) runs it, and run where no GPU
//! is usable it fails saying why.
//! The seed is fresh every run and printed on failure (`PAGEDATTN_TEST_SEED` replays one).

#![cfg(feature = "cuda")]

mod common;

use common::{gpu, same_cache, seed};
use pagedattn::{
    registry, AttentionConfig, AttentionImpl, AttentionMetadata, Backend, CacheLayout, DType,
    GraphCapacity, HostStorage, Inputs, KvCache, KvCacheDtype, KvCacheSpec, MetadataBuilder,
    SequenceDesc, Tensor, Workspace,
};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

/// Held by each test for its whole run: a capture (global mode, on the backend's stream,
/// which every caller in the process shares) would take in, or refuse, the work another test
/// queued meanwhile.
static ALONE: std::sync::Mutex<()> = std::sync::Mutex::new(());

const LAYERS: usize = 3;
const SEQS: usize = 5;
const HEADS: usize = 8;
const KV_HEADS: usize = 2;
const HEAD_SIZE: usize = 128;
const BLOCK: usize = 16;
/// The graph plan's capacity: sequences of up to this many keys.
const MAX_LEN: usize = 640;
const NUM_BLOCKS: usize = SEQS * MAX_LEN / BLOCK + 8;

/// One decode step: every sequence's length and block table.
#[derive(Debug, Clone)]
struct Step {
    lens: Vec<usize>,
    tables: Vec<Vec<i32>>,
}

impl Step {
    /// Sequences of `lens` keys over blocks drawn from a fresh shuffle of the cache's blocks.
    fn shuffled(rng: &mut StdRng, lens: Vec<usize>) -> Step {
        let mut blocks: Vec<i32> = (0..NUM_BLOCKS as i32).collect();
        blocks.shuffle(rng);
        let mut next = blocks.into_iter();
        let tables = lens
            .iter()
            .map(|n| next.by_ref().take(n.div_ceil(BLOCK)).collect())
            .collect();
        Step { lens, tables }
    }

    /// The next step: each sequence `grow[s]` keys longer, its table extended with blocks no
    /// sequence uses yet.
    fn grown(&self, grow: &[usize]) -> Step {
        let mut free: Vec<i32> = (0..NUM_BLOCKS as i32)
            .filter(|b| !self.tables.iter().any(|t| t.contains(b)))
            .collect();
        let mut next = self.clone();
        for ((len, table), g) in next.lens.iter_mut().zip(&mut next.tables).zip(grow) {
            *len += g;
            while table.len() < len.div_ceil(BLOCK) {
                table.push(free.pop().expect("enough blocks"));
            }
        }
        next
    }

    fn metadata(&self) -> AttentionMetadata {
        let mut builder = MetadataBuilder::new(BLOCK);
        for (len, table) in self.lens.iter().zip(&self.tables) {
            builder.push(SequenceDesc::decode(*len - 1, table));
        }
        builder.build().expect("valid decode metadata")
    }
}

/// Random bf16-representable values in [-1, 1).
fn random_tensor(rng: &mut StdRng, shape: &[usize]) -> Tensor {
    let values: Vec<f32> = (0..shape.iter().product())
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    Tensor::from_f32(DType::BF16, shape, &values).unwrap()
}

/// One layer's inputs of a step on the host.
struct LayerInputs {
    query: Tensor,
    key: Tensor,
    value: Tensor,
}

impl LayerInputs {
    fn random(rng: &mut StdRng) -> Self {
        LayerInputs {
            query: random_tensor(rng, &[SEQS, HEADS, HEAD_SIZE]),
            key: random_tensor(rng, &[SEQS, KV_HEADS, HEAD_SIZE]),
            value: random_tensor(rng, &[SEQS, KV_HEADS, HEAD_SIZE]),
        }
    }

    fn to_device(&self, backend: &dyn Backend) -> LayerInputs {
        let on = |t: &Tensor| t.to_device(backend.device()).unwrap();
        LayerInputs {
            query: on(&self.query),
            key: on(&self.key),
            value: on(&self.value),
        }
    }

    fn copy_from(&mut self, host: &LayerInputs) {
        self.query.copy_from(&host.query).unwrap();
        self.key.copy_from(&host.key).unwrap();
        self.value.copy_from(&host.value).unwrap();
    }
}

/// `reference` on the host caches: every layer's output for `step`.
fn reference_step(
    reference: &dyn Backend,
    configs: &[AttentionConfig],
    caches: &mut [KvCache],
    inputs: &[LayerInputs],
    step: &Step,
) -> Vec<Tensor> {
    let md = step.metadata();
    (0..LAYERS)
        .map(|l| {
            let attention = reference.attention(&configs[l]).unwrap();
            let plan = attention.plan(&md, Some(caches[l].spec())).unwrap();
            let mut workspace = reference.workspace(&plan).unwrap();
            let x = &inputs[l];
            let call = Inputs::new(&x.query)
                .with_kv(&x.key, &x.value)
                .with_cache(&mut caches[l]);
            attention.forward(&plan, &mut workspace, call).unwrap()
        })
        .collect()
}

/// Every element of `got` within bf16 rounding (and the f32 accumulation) of `want`.
fn assert_close(got: &Tensor, want: &Tensor, what: &str) {
    let (g, w) = (got.to_f32_vec().unwrap(), want.to_f32_vec().unwrap());
    assert_eq!(g.len(), w.len());
    for (i, (g, w)) in g.iter().zip(&w).enumerate() {
        let allowed = 1e-2 + w.abs() / 128.0;
        assert!(
            (g - w).abs() <= allowed,
            "{what}: element {i} (token {}, head {}) is {g}, reference {w}",
            i / (HEADS * HEAD_SIZE),
            i / HEAD_SIZE % HEADS
        );
    }
}

/// Every layer's output (on the GPU) against `reference`'s.
fn check_outputs(outputs: &[Tensor], want: &[Tensor], what: &str) {
    for (l, (out, want)) in outputs.iter().zip(want).enumerate() {
        assert_close(&out.to_host().unwrap(), want, &format!("{what}, layer {l}"));
    }
}

/// The GPU's state for the captured layers: attention, caches, device inputs and outputs.
struct GpuLayers {
    attention: Vec<Box<dyn AttentionImpl>>,
    caches: Vec<KvCache>,
    inputs: Vec<LayerInputs>,
    outputs: Vec<Tensor>,
}

impl GpuLayers {
    /// Queues every layer's forward call for `plan` (run, or captured).
    fn queue(
        &mut self,
        plan: &pagedattn::Plan,
        workspace: &mut Workspace,
    ) -> pagedattn::Result<()> {
        for l in 0..LAYERS {
            let x = &self.inputs[l];
            let call = Inputs::new(&x.query)
                .with_kv(&x.key, &x.value)
                .with_cache(&mut self.caches[l]);
            self.attention[l].forward_into(plan, workspace, call, &mut self.outputs[l])?;
        }
        Ok(())
    }
}

#[test]
#[ignore = "needs a usable CUDA GPU (tools/gpu-suite.sh runs it)"]
fn a_captured_decode_step_replays_later_steps() {
    alone_with_seed("a_captured_decode_step_replays_later_steps", run);
}

/// Runs `test` on the GPU with a fresh seed, holding [`ALONE`]; prints the seed if it fails.
fn alone_with_seed(name: &str, test: fn(&pagedattn::cuda::Cuda, u64)) {
    let _alone = ALONE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let cuda = gpu();
    let seed = seed();
    let result = std::panic::catch_unwind(|| test(&cuda, seed));
    if let Err(panic) = result {
        eprintln!("{name} failed with seed {seed}");
        std::panic::resume_unwind(panic);
    }
}

/// The layers' configurations (sharing the plan but not their scores: a soft cap and
/// another scale), the cache geometry, host caches of random finite values, and the GPU's
/// layers over copies of them.
fn layers(
    rng: &mut StdRng,
    cuda: &pagedattn::cuda::Cuda,
    reference: &dyn Backend,
) -> (Vec<AttentionConfig>, KvCacheSpec, Vec<KvCache>, GpuLayers) {
    let configs: Vec<AttentionConfig> = (0..LAYERS)
        .map(|l| {
            AttentionConfig::builder(HEADS, HEAD_SIZE)
                .num_kv_heads(KV_HEADS)
                .scale(0.05 + 0.05 * l as f32)
                .logits_soft_cap((l == 1).then_some(20.0))
                .kv_cache_dtype(KvCacheDtype::Auto)
                .build()
                .unwrap()
        })
        .collect();
    let spec = KvCacheSpec {
        num_blocks: NUM_BLOCKS,
        block_size: BLOCK,
        num_kv_heads: KV_HEADS,
        head_size: HEAD_SIZE,
        dtype: DType::BF16,
        kv_cache_dtype: KvCacheDtype::Auto,
    };
    // Every slot holds a finite value, so that a kernel reading a stale table or length
    // gets a wrong answer rather than the right one or NaN.
    let host_caches: Vec<KvCache> = (0..LAYERS)
        .map(|_| {
            let n = spec.buffer_elems();
            let mut half = || {
                let t = random_tensor(rng, &[n]);
                HostStorage::from_bytes(DType::BF16, t.host().unwrap().as_bytes()).unwrap()
            };
            let canonical = KvCache::from_canonical(spec, CacheLayout::Nhd, half(), half());
            reference.load_kv_cache(&canonical.unwrap()).unwrap()
        })
        .collect();
    let layers = GpuLayers {
        attention: configs.iter().map(|c| cuda.attention(c).unwrap()).collect(),
        caches: host_caches
            .iter()
            .map(|c| cuda.load_kv_cache(c).unwrap())
            .collect(),
        inputs: Vec::new(),
        outputs: Vec::new(),
    };
    (configs, spec, host_caches, layers)
}

fn run(cuda: &pagedattn::cuda::Cuda, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let reference = registry::backend("reference").unwrap();
    let (configs, spec, mut host_caches, mut layers) = layers(&mut rng, cuda, &*reference);

    // Step 0: short sequences (one of a single key), on a plan for graphs.
    let lens: Vec<usize> = (0..SEQS)
        .map(|s| if s == 0 { 1 } else { rng.random_range(2..120) })
        .collect();
    let mut step = Step::shuffled(&mut rng, lens);
    let capacity = GraphCapacity {
        max_seq_len: MAX_LEN,
    };
    let mut plan = layers.attention[0]
        .plan_for_graph(&step.metadata(), Some(&spec), capacity)
        .unwrap();
    let mut workspace = cuda.workspace(&plan).unwrap();
    let host_inputs: Vec<LayerInputs> =
        (0..LAYERS).map(|_| LayerInputs::random(&mut rng)).collect();
    layers.inputs = host_inputs.iter().map(|x| x.to_device(cuda)).collect();
    layers.outputs = (0..LAYERS)
        .map(|_| Tensor::zeros_on(cuda.device(), DType::BF16, &[SEQS, HEADS, HEAD_SIZE]).unwrap())
        .collect();

    // Run once (loads the kernels; a capture refuses module loads), then capture the same
    // step: replaying it writes the same keys to the same slots.
    layers.queue(&plan, &mut workspace).unwrap();
    let want = reference_step(&*reference, &configs, &mut host_caches, &host_inputs, &step);
    check_outputs(&layers.outputs, &want, "step 0");
    for out in &mut layers.outputs {
        out.fill_nan().unwrap();
    }
    let graph = cuda
        .capture(|| layers.queue(&plan, &mut workspace))
        .unwrap();

    // Later steps: longer sequences (by one token, or by many: positions in between hold
    // whatever their slots held), new slots, then entirely new block tables.
    for n in 1..=4 {
        step = match n {
            3 => Step::shuffled(&mut rng, step.lens.clone()),
            _ => {
                let grow: Vec<usize> = (0..SEQS)
                    .map(|s| if s == 0 { 1 } else { rng.random_range(1..150) })
                    .map(|g| g.min(MAX_LEN - 1 - step.lens.iter().max().unwrap()))
                    .map(|g| g.max(1))
                    .collect();
                step.grown(&grow)
            }
        };
        layers.attention[0]
            .replan(&mut plan, &step.metadata(), Some(&spec))
            .unwrap();
        let host_inputs: Vec<LayerInputs> =
            (0..LAYERS).map(|_| LayerInputs::random(&mut rng)).collect();
        for (device, host) in layers.inputs.iter_mut().zip(&host_inputs) {
            device.copy_from(host);
        }
        for out in &mut layers.outputs {
            out.fill_nan().unwrap();
        }
        // SAFETY: the captured calls' tensors, caches, workspace and plan are all alive and
        // were never reallocated (inputs refilled with copy_from, the plan through replan
        // with metadata valid for these caches).
        unsafe { graph.replay() }.unwrap();
        let want = reference_step(&*reference, &configs, &mut host_caches, &host_inputs, &step);
        check_outputs(
            &layers.outputs,
            &want,
            &format!("replay {n} (lens {:?})", step.lens),
        );
    }
    for (l, (got, want)) in layers.caches.iter().zip(&host_caches).enumerate() {
        same_cache(got, want, &format!("layer {l} after the replays")).unwrap();
    }

    // What the plan cannot hold is refused, and the plan keeps serving the graph.
    let too_long = Step::shuffled(&mut rng, vec![MAX_LEN + 1; SEQS]);
    let e = layers.attention[0]
        .replan(&mut plan, &too_long.metadata(), Some(&spec))
        .unwrap_err();
    assert!(e.to_string().contains("max_seq_len"), "{e}");
    let other_batch = Step::shuffled(&mut rng, vec![10; SEQS - 1]);
    let e = layers.attention[0]
        .replan(&mut plan, &other_batch.metadata(), Some(&spec))
        .unwrap_err();
    assert!(e.to_string().contains("graph plan"), "{e}");
    // A new token with slot -1 needs the private cache's launches, which a graph cannot hold.
    let mut unwritten = Step::shuffled(&mut rng, vec![10; SEQS]).metadata();
    unwritten.slot_mapping[0] = -1;
    let e = layers.attention[0]
        .replan(&mut plan, &unwritten, Some(&spec))
        .unwrap_err();
    assert!(e.to_string().contains("slot_mapping"), "{e}");
    let host_inputs: Vec<LayerInputs> =
        (0..LAYERS).map(|_| LayerInputs::random(&mut rng)).collect();
    for (device, host) in layers.inputs.iter_mut().zip(&host_inputs) {
        device.copy_from(host);
    }
    // SAFETY: as above; the refused replans left the plan as it was.
    unsafe { graph.replay() }.unwrap();
    let want = reference_step(&*reference, &configs, &mut host_caches, &host_inputs, &step);
    check_outputs(&layers.outputs, &want, "replay after refusals");
}

/// A caller's kernel: spins for `cycles` clock cycles (so that the caller's stream runs well
/// behind the host), then copies `n` 16-bit elements from `src` to `dst`.
const SPIN_COPY: &str = r#"
__device__ long long now() {
    long long t;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(t));
    return t;
}
extern "C" __global__ void spin_copy(const unsigned short* src, unsigned short* dst,
                                     long long n, long long cycles) {
    long long start = now();
    while (now() - start < cycles) {}
    for (long long i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}
"#;

/// About 5 ms of spinning at the H100's clock: far longer than the host takes to queue a step.
const SPIN_CYCLES: i64 = 10_000_000;

#[test]
#[ignore = "needs a usable CUDA GPU (tools/gpu-suite.sh runs it)"]
fn calls_on_a_callers_stream_order_with_its_work() {
    alone_with_seed(
        "calls_on_a_callers_stream_order_with_its_work",
        on_callers_stream,
    );
}

/// Decode steps queued back to back on a caller's stream that runs behind the host: the
/// caller's kernel writes each layer's inputs just before the layer's call, plans are made
/// on the backend's stream (even steps) or inside the call (odd steps) and dropped right
/// after, so that a free or an upload not ordered after the caller's stream would overwrite
/// a plan its queued kernels have yet to read. Every step's outputs and the caches at the end
/// are checked against `reference`.
fn on_callers_stream(cuda: &pagedattn::cuda::Cuda, seed: u64) {
    use cudarc::driver::{LaunchConfig, PushKernelArg};

    let mut rng = StdRng::seed_from_u64(seed);
    let reference = registry::backend("reference").unwrap();
    let (configs, spec, mut host_caches, mut layers) = layers(&mut rng, cuda, &*reference);
    let spin = cuda
        .load_kernels("test_spin_copy", SPIN_COPY, &["spin_copy"])
        .unwrap()
        .remove(0);
    let caller = cuda.stream().context().new_stream().unwrap();
    let zeros = || Tensor::zeros_on(cuda.device(), DType::BF16, &[SEQS, HEADS, HEAD_SIZE]);
    layers.inputs = (0..LAYERS)
        .map(|_| LayerInputs::random(&mut rng).to_device(cuda))
        .collect();
    // The caller's copy of `src` into `dst`, after its spin.
    let copy = |src: &Tensor, dst: &mut Tensor| {
        let n = src.numel() as i64;
        let (from, to) = (src.cuda_address().unwrap(), dst.cuda_address_mut().unwrap());
        let mut launch = caller.launch_builder(&spin);
        launch.arg(&from).arg(&to).arg(&n).arg(&SPIN_CYCLES);
        let config = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the kernel's parameters are (ushort*, ushort*, i64, i64); both tensors hold
        // `n` bf16 elements and outlive the kernel (the test synchronizes before dropping).
        unsafe { launch.launch(config) }.unwrap();
    };

    let lens: Vec<usize> = (0..SEQS).map(|_| rng.random_range(100..400)).collect();
    let mut step = Step::shuffled(&mut rng, lens);
    let mut queued = Vec::new();
    for n in 0..6 {
        if n > 0 {
            let grow: Vec<usize> = (0..SEQS).map(|_| rng.random_range(1..40)).collect();
            step = step.grown(&grow);
        }
        let md = step.metadata();
        let host_inputs: Vec<LayerInputs> =
            (0..LAYERS).map(|_| LayerInputs::random(&mut rng)).collect();
        let staged: Vec<LayerInputs> = host_inputs.iter().map(|x| x.to_device(cuda)).collect();
        layers.outputs = (0..LAYERS).map(|_| zeros().unwrap()).collect();
        let outside = (n % 2 == 0).then(|| {
            let plan = layers.attention[0].plan(&md, Some(&spec)).unwrap();
            let workspace = cuda.workspace(&plan).unwrap();
            (plan, workspace)
        });
        // SAFETY: the stream is alive until the end of the test.
        let inside = unsafe {
            cuda.on_stream(caller.cu_stream(), || {
                let (plan, mut workspace) = match outside {
                    Some(made) => made,
                    None => {
                        let plan = layers.attention[0].plan(&md, Some(&spec))?;
                        let workspace = cuda.workspace(&plan)?;
                        (plan, workspace)
                    }
                };
                for (l, staged) in staged.iter().enumerate() {
                    let x = &mut layers.inputs[l];
                    copy(&staged.query, &mut x.query);
                    copy(&staged.key, &mut x.key);
                    copy(&staged.value, &mut x.value);
                }
                assert!(workspace.bytes() > 0, "split-K partials in the workspace");
                layers.queue(&plan, &mut workspace)?;
                Ok((plan, workspace))
            })
        };
        // Dropped on the host at once: the backend's stream frees them after the caller's.
        drop(inside.unwrap());
        queued.push((
            step.clone(),
            host_inputs,
            std::mem::take(&mut layers.outputs),
            staged,
        ));
    }
    for (n, (step, host_inputs, outputs, _staged)) in queued.iter().enumerate() {
        let want = reference_step(&*reference, &configs, &mut host_caches, host_inputs, step);
        check_outputs(outputs, &want, &format!("step {n} on the caller's stream"));
    }
    for (l, (got, want)) in layers.caches.iter().zip(&host_caches).enumerate() {
        same_cache(got, want, &format!("layer {l} after the steps")).unwrap();
    }
    caller.synchronize().unwrap();
}
