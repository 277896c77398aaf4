//! An inference engine's use of pagedattn: the attention of a two-layer model over a paged KV
//! cache, for two prompts and then three decode steps of both sequences, on the backend named
//! on the command line (default `auto`), checked against `reference`.
//!
//! `cargo run --release -p pagedattn --example engine_steps -- [BACKEND]`

use std::process::ExitCode;

use pagedattn::{
    registry, AttentionConfig, Backend, DType, Device, Inputs, MetadataBuilder, Result,
    SequenceDesc, Tensor, Workspace,
};

const LAYERS: usize = 2;
const PROMPTS: [usize; 2] = [37, 20];
const DECODE_STEPS: usize = 3;

fn main() -> ExitCode {
    let name = std::env::args().nth(1).unwrap_or_else(|| "auto".into());
    let run = || -> Result<f32> {
        let backend = registry::backend(&name)?;
        println!("backend {} on {}", backend.name(), backend.device());
        let got = run_steps(backend.as_ref())?;
        let want = run_steps(registry::backend("reference")?.as_ref())?;
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

/// Runs the prompts and the decode steps on `backend`; returns every output, step by step.
fn run_steps(backend: &dyn Backend) -> Result<Vec<f32>> {
    let device = backend.device();
    let config = AttentionConfig::builder(8, 64).num_kv_heads(2).build()?;
    let attention = backend.attention(&config)?;
    // The cache geometry comes from the layer: kv heads and head size are not written twice.
    let spec = config.kv_cache_spec(DType::BF16, 16, 16);
    let mut caches = (0..LAYERS)
        .map(|_| backend.allocate_kv_cache(&spec))
        .collect::<Result<Vec<_>>>()?;
    // The block manager's work: blocks 0-3 for sequence 0, 4-7 for sequence 1.
    let tables: [Vec<i32>; 2] = [(0..4).collect(), (4..8).collect()];
    let mut outputs = Vec::new();
    let mut workspace = Workspace::empty(device);
    for step in 0..=DECODE_STEPS {
        let mut builder = MetadataBuilder::for_cache(&spec);
        for (prompt, table) in PROMPTS.iter().zip(&tables) {
            builder.push(match step {
                0 => SequenceDesc::prompt(0, *prompt, table.clone()),
                _ => SequenceDesc::decode(prompt + step, table.clone()),
            });
        }
        let metadata = builder.build()?;
        // Once per step: the metadata is validated and prepared, then every layer uses it.
        let plan = attention.plan(&metadata, Some(&spec))?;
        workspace.reserve(&plan)?;
        let t = metadata.num_tokens();
        for (layer, cache) in caches.iter_mut().enumerate() {
            let seed = (step * LAYERS + layer) as u32;
            let q = random(device, &[t, 8, 64], seed * 3)?;
            let k = random(device, &[t, 2, 64], seed * 3 + 1)?;
            let v = random(device, &[t, 2, 64], seed * 3 + 2)?;
            let inputs = Inputs::new(&q).with_kv(&k, &v).with_cache(cache);
            let out = attention.forward(&plan, &mut workspace, inputs)?;
            outputs.extend(out.to_f32_vec()?);
        }
    }
    Ok(outputs)
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
