//! The Llama model on the GPU (`GpuLlama`, bf16) against the same model on the host (f32):
//! teacher-forced logits position by position (`score::prompt_logits`), on the synthetic model
//! and on SmolLM2 (the golden sequences); the engine serving it with every attention call
//! verified. The host-only test checks `prompt_logits` itself against the engine.

use crate::common;

use pagedattn::registry;
use pagedattn_engine::harness::score::prompt_logits;
use pagedattn_engine::harness::verify::VerifyMode;
use pagedattn_engine::harness::workload::Builtin;
use pagedattn_engine::serving::model::ModelKind;
use pagedattn_engine::serving::scheduler::PreemptionPolicy;

use common::{requests, serve, small};

/// Row `i` of `[rows, width]` logits.
fn row(logits: &[f32], width: usize, i: usize) -> &[f32] {
    &logits[i * width..(i + 1) * width]
}

#[test]
fn prompt_logits_predict_what_the_engine_generates() {
    let config = small(ModelKind::Decoder);
    let mut model = config.build().unwrap();
    let reqs = requests(&model, Builtin::Chat, 4, 6, 3);
    let report = serve(
        "cpu",
        &config,
        reqs.clone(),
        (512, 256),
        PreemptionPolicy::Auto,
        VerifyMode::Off,
    );
    let backend = registry::backend("cpu").unwrap();
    let vocab = config.vocab;
    for (req, record) in reqs.iter().zip(&report.requests) {
        // The prompt and all but the last generated token, scored at once: row p predicts
        // token p + 1, so the rows from the prompt's last on are the greedy choices.
        let generated = &record.generated[0];
        let mut tokens = req.prompt.clone();
        tokens.extend(&generated[..generated.len() - 1]);
        let logits = prompt_logits(&mut model, backend.as_ref(), &tokens).unwrap();
        assert_eq!(logits.len(), tokens.len() * vocab);
        let predicted: Vec<u32> = (req.prompt.len() - 1..tokens.len())
            .map(|p| pagedattn_engine::serving::sample::argmax(row(&logits, vocab, p)))
            .collect();
        assert_eq!(&predicted, generated);
    }
}

/// `Llama::new` refuses parts that disagree with the shape (the GPU model's kernels index by
/// the shape alone): a projection of the wrong size, an attention config of other heads, RoPE
/// wider than a head; the same parts made consistent are taken.
#[test]
fn llama_new_refuses_parts_that_disagree_with_its_shape() {
    use pagedattn::{AttentionConfig, DType};
    use pagedattn_engine::models::blocks::{InputEmbedding, LayerWeights};
    use pagedattn_engine::models::llama::{Llama, LlamaShape};
    use pagedattn_engine::models::ops::{Embedding, Linear, Norm, Precision, Rope, RopeStyle};

    let (hidden, heads, kv_heads, d, ffn, vocab) = (8, 2, 1, 4, 16, 32);
    let shape = LlamaShape {
        name: "tiny".into(),
        layers: 1,
        hidden,
        ffn,
        heads,
        kv_heads,
        head_size: d,
        vocab,
        max_context: 64,
        stop_tokens: Vec::new(),
        first_plain_token: 0,
    };
    let linear = |out: usize, inp: usize| {
        Linear::from_f32(&vec![0.01; out * inp], out, inp, Precision::Exact).unwrap()
    };
    let layer = |q_rows: usize| {
        LayerWeights::llama(
            vec![1.0; hidden],
            [
                linear(q_rows, hidden),
                linear(kv_heads * d, hidden),
                linear(kv_heads * d, hidden),
                linear(hidden, heads * d),
            ],
            vec![1.0; hidden],
            [
                linear(ffn, hidden),
                linear(ffn, hidden),
                linear(hidden, ffn),
            ],
            1e-5,
        )
    };
    let config = |heads: usize| {
        AttentionConfig::builder(heads, d)
            .num_kv_heads(kv_heads)
            .build()
            .unwrap()
    };
    let build = |q_rows: usize, attn_heads: usize, rope_dim: usize| {
        Llama::new(
            shape.clone(),
            InputEmbedding::plain(
                Embedding::from_f32(&vec![0.1; vocab * hidden], vocab, hidden).unwrap(),
            ),
            vec![layer(q_rows)],
            Norm::Rms {
                weight: vec![1.0; hidden],
                eps: 1e-5,
            },
            linear(vocab, hidden),
            Some(Rope::new(rope_dim, 10_000.0, RopeStyle::Neox).unwrap()),
            vec![config(attn_heads)],
            DType::F32,
        )
    };
    assert!(build(heads * d, heads, d).is_ok());
    let error = |r: pagedattn_engine::Result<Llama>| r.err().expect("refused").to_string();
    assert!(error(build(heads * d - 1, heads, d)).contains("layer 0 wq is 7x8, expected 8x8"));
    assert!(error(build(heads * d, heads + 2, d)).contains("an attention of 4/1 heads of 4"));
    assert!(error(build(heads * d, heads, 2 * d)).contains("RoPE over 8 elements of heads of 4"));
}

#[cfg(feature = "cuda")]
pub(crate) mod gpu {
    use super::*;

    use crate::golden_file::{golden, ids};
    use pagedattn::cuda::Cuda;
    use pagedattn_engine::models::gguf::Gguf;
    use pagedattn_engine::models::gpu_llama::GpuLlama;
    use pagedattn_engine::models::llama::Llama;
    use pagedattn_engine::models::ops::Precision;
    use pagedattn_engine::serving::model::Model;
    use pagedattn_engine::serving::sample::argmax;

    /// Serves `reqs` with `model` on `cuda`: blocks of 16 tokens, 2048 of them, at most 16
    /// sequences and `max_batched_tokens` tokens a step.
    fn serve_on_gpu(
        model: GpuLlama,
        reqs: Vec<pagedattn_engine::serving::engine::EngineRequest>,
        max_batched_tokens: usize,
        verify: VerifyMode,
        cuda_graphs: bool,
    ) -> pagedattn_engine::serving::report::Report {
        use pagedattn_engine::harness::verify::Verifier;
        use pagedattn_engine::serving::blocks::BlockConfig;
        use pagedattn_engine::serving::engine::{Engine, EngineConfig};
        use pagedattn_engine::serving::scheduler::SchedulerConfig;
        use std::sync::atomic::AtomicBool;

        let backend = registry::backend("cuda").unwrap();
        let config = EngineConfig {
            scheduler: SchedulerConfig {
                max_batched_tokens,
                max_seqs: 16,
                preemption: PreemptionPolicy::Auto,
                blocks: BlockConfig {
                    block_size: 16,
                    num_device_blocks: 2048,
                    num_host_blocks: 64,
                    prefix_caching: true,
                    sliding_window: None,
                    watermark_blocks: 1,
                },
            },
            cuda_graphs,
        };
        let engine = Engine::new(backend.as_ref(), Box::new(model), &config)
            .unwrap()
            .with_check(Box::new(Verifier::new(verify, 1).unwrap()));
        engine
            .run("test", reqs, &AtomicBool::new(false), &mut |_, _, _| {})
            .unwrap()
    }

    /// How bf16 logits compare with f32 ones over the same rows.
    #[derive(Debug)]
    pub(crate) struct Agreement {
        pub(crate) rows: usize,
        /// Rows whose greedy token is the same.
        pub(crate) same_top1: usize,
        /// The largest |bf16 − f32| over every logit.
        pub(crate) max_abs: f32,
        /// The largest |bf16 − f32| relative to the f32 logits' standard deviation in its row.
        pub(crate) max_rel_to_std: f32,
        /// The smallest margin (top-1 minus top-2, f32) among rows whose top-1 differs.
        pub(crate) worst_flip_margin: f32,
    }

    /// The standard deviation of a row of logits: the scale the tests measure differences in.
    pub(crate) fn spread(row: &[f32]) -> f32 {
        let mean = row.iter().sum::<f32>() / row.len() as f32;
        (row.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / row.len() as f32).sqrt()
    }

    /// Compares `rows` (indices) of `got` (bf16) with `want` (f32).
    pub(crate) fn agreement(
        want: &[f32],
        got: &[f32],
        width: usize,
        rows: impl Iterator<Item = usize>,
    ) -> Agreement {
        let mut a = Agreement {
            rows: 0,
            same_top1: 0,
            max_abs: 0.0,
            max_rel_to_std: 0.0,
            worst_flip_margin: 0.0,
        };
        for r in rows {
            let (w, g) = (row(want, width, r), row(got, width, r));
            let std = spread(w);
            let diff = w
                .iter()
                .zip(g)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            a.rows += 1;
            a.max_abs = a.max_abs.max(diff);
            a.max_rel_to_std = a.max_rel_to_std.max(diff / std);
            if argmax(w) == argmax(g) {
                a.same_top1 += 1;
            } else {
                let top = w[argmax(w) as usize];
                let second = w
                    .iter()
                    .enumerate()
                    .filter(|&(i, _)| i != argmax(w) as usize)
                    .map(|(_, &x)| x)
                    .fold(f32::NEG_INFINITY, f32::max);
                a.worst_flip_margin = a.worst_flip_margin.max(top - second);
            }
        }
        a
    }

    /// The synthetic decoder's f32 host model and its GPU copy score the same random tokens
    /// alike: every logit within 5% of its row's spread, the same greedy token in 95% of the
    /// rows (random weights leave some rows with near ties).
    #[test]
    #[ignore = "needs a CUDA GPU (tools/gpu-suite.sh runs it)"]
    fn synthetic_gpu_logits_match_the_host_model() {
        let config = pagedattn_engine::models::synthetic::SyntheticConfig::default();
        let mut host = config.build().unwrap();
        let cuda = Cuda::new(0).unwrap();
        let mut gpu = GpuLlama::new(&host, &cuda).unwrap();
        let tokens: Vec<u32> = (0..300u32)
            .map(|i| (i * 7919 + 13) % config.vocab as u32)
            .collect();
        let backend = registry::backend("cuda").unwrap();
        let want = prompt_logits(&mut host, backend.as_ref(), &tokens).unwrap();
        let got = prompt_logits(&mut gpu, backend.as_ref(), &tokens).unwrap();
        let a = agreement(&want, &got, config.vocab, 0..tokens.len());
        eprintln!("synthetic, bf16 GPU model against f32 host model: {a:?}");
        assert!(a.max_rel_to_std <= 0.05, "{a:?}");
        assert!(a.same_top1 * 100 >= a.rows * 95, "{a:?}");
    }

    /// The Hugging Face folders the GPU model computes — Llama, Mistral, and Qwen2 with its
    /// q/k/v biases — score the golden prompt as their f32 host models do: every logit within
    /// 10% of its row's spread (the tiny random models' bf16 error: 7.6% for Llama on an
    /// H200), the same greedy token in 90% of the rows (they leave near ties). Gemma-2 is
    /// refused by name (its blocks are not the GPU model's).
    #[test]
    #[ignore = "needs a CUDA GPU (tools/gpu-suite.sh runs it)"]
    fn hugging_face_folders_on_the_gpu_model_match_their_host_models() {
        use pagedattn_engine::models::families::HfModel;

        let cuda = Cuda::new(0).unwrap();
        let backend = registry::backend("cuda").unwrap();
        let load = |family: &str| match crate::hf::load(family) {
            HfModel::Decoder(m) => m,
            HfModel::Encoder(_) => unreachable!("{family} is a decoder"),
        };
        for family in ["llama", "mistral", "qwen2"] {
            let tokens = ids(&crate::hf::golden(family)["logits"]["ids"]);
            let mut host = load(family);
            assert!(host.runs_on_gpu_model(), "{family}");
            let mut gpu = GpuLlama::new(&host, &cuda).unwrap();
            let want = prompt_logits(&mut host, backend.as_ref(), &tokens).unwrap();
            let got = prompt_logits(&mut gpu, backend.as_ref(), &tokens).unwrap();
            let a = agreement(&want, &got, 512, 0..tokens.len());
            eprintln!("{family}, bf16 GPU model against f32 host model: {a:?}");
            assert!(a.max_rel_to_std <= 0.1, "{family}: {a:?}");
            assert!(a.same_top1 * 10 >= a.rows * 9, "{family}: {a:?}");
        }
        let e = GpuLlama::new(&load("gemma2"), &cuda)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("the GPU model computes Llama's blocks"), "{e}");
    }

    /// Requests arriving while the engine idles, on the GPU model with CUDA graphs: every one
    /// served, each after its arrival.
    #[test]
    #[ignore = "needs a CUDA GPU (tools/gpu-suite.sh runs it)"]
    fn requests_arriving_over_time_are_served_on_the_gpu() {
        let host = pagedattn_engine::models::synthetic::SyntheticConfig::default()
            .build()
            .unwrap();
        let gpu = GpuLlama::new(&host, &Cuda::new(0).unwrap()).unwrap();
        let mut reqs = requests(&gpu, Builtin::Chat, 4, 4, 3);
        for (i, r) in reqs.iter_mut().enumerate() {
            r.arrival = 0.15 * i as f64;
        }
        let report = serve_on_gpu(gpu, reqs, 256, VerifyMode::Sampled(0.5), true);
        assert!(report.requests.iter().all(|r| r.rejected.is_none()));
        for r in &report.requests {
            assert!(!r.generated[0].is_empty(), "{r:?}");
            assert!(r.finished.is_some_and(|f| f >= r.arrival), "{r:?}");
        }
        assert!(report.seconds >= 0.45, "{}", report.seconds);
    }

    /// The tiny Llama whose first MLP overflows, on the GPU: greedy (the argmax kernel marks
    /// the row) and sampled (the logits brought back), the run stops naming the logits.
    #[test]
    #[ignore = "needs a CUDA GPU (tools/gpu-suite.sh runs it)"]
    fn a_gpu_model_that_overflows_stops_naming_the_logits() {
        use crate::hostile::{overflowing_llama, run_to_error};

        let cuda = Cuda::new(0).unwrap();
        for (temperature, graphs) in [(0.0, false), (0.0, true), (0.8, false)] {
            let gpu = GpuLlama::new(&overflowing_llama(), &cuda).unwrap();
            let err = run_to_error("cuda", Box::new(gpu), graphs, temperature);
            assert!(
                err.starts_with("model: step 0's logits (row 0")
                    && err.ends_with("holds a non-finite value (NaN or ±inf)"),
                "temperature {temperature}: {err}"
            );
        }
    }

    /// The engine serves the GPU model on `cuda`, greedy (tokens sampled on the GPU) and at
    /// temperature 0.8 (logits brought back), every attention call checked against
    /// `reference`.
    #[test]
    #[ignore = "needs a CUDA GPU (tools/gpu-suite.sh runs it)"]
    fn the_engine_serves_the_gpu_model_verified() {
        use pagedattn_engine::serving::sample::SamplingParams;

        let config = pagedattn_engine::models::synthetic::SyntheticConfig::default();
        let host = config.build().unwrap();
        let cuda = Cuda::new(0).unwrap();
        for temperature in [0.0, 0.8] {
            let gpu = GpuLlama::new(&host, &cuda).unwrap();
            let mut reqs = requests(&gpu, Builtin::Chat, 24, 24, 5);
            for r in &mut reqs {
                r.sampling = SamplingParams {
                    temperature,
                    seed: 9,
                    ..SamplingParams::default()
                };
            }
            let report = serve_on_gpu(gpu, reqs, 256, VerifyMode::Every, true);
            assert!(report.verify.calls_checked > 0);
            assert!(report.requests.iter().all(|r| !r.generated[0].is_empty()));
        }
    }

    /// With CUDA graphs (decode steps padded to a bucket and replayed; every bucket captured
    /// once, at the engine's start) and without,
    /// every token the engine generates with the GPU model is a greedy choice of that model:
    /// scored afterwards by `prompt_logits` (one plain prefill), its logit is within 2% of
    /// the row's standard deviation of the row's largest (products over a padded batch may
    /// round differently).
    #[test]
    #[ignore = "needs a CUDA GPU (tools/gpu-suite.sh runs it)"]
    fn graph_replayed_decodes_generate_greedy_tokens() {
        let config = pagedattn_engine::models::synthetic::SyntheticConfig::default();
        let host = config.build().unwrap();
        let cuda = Cuda::new(0).unwrap();
        let backend = registry::backend("cuda").unwrap();
        for cuda_graphs in [true, false] {
            let gpu = GpuLlama::new(&host, &cuda).unwrap();
            // 13 requests: buckets of 16, 8, 4, 2 and 1 (13 and 9 sequences pad to 16) as they finish
            // at different lengths.
            let reqs = requests(&gpu, Builtin::Chat, 13, 20, 8);
            let report = serve_on_gpu(gpu, reqs.clone(), 512, VerifyMode::Off, cuda_graphs);
            let replayed = report.steps.iter().filter(|s| s.graph).count();
            assert_eq!(replayed > 0, cuda_graphs, "{replayed} steps replayed");
            // Captured once, at the engine's start: the prefills of up to 512 tokens between
            // decodes moved no activation under the graphs.
            assert_eq!(report.cuda_graph_captures, usize::from(cuda_graphs));
            let mut scorer = GpuLlama::new(&host, &cuda).unwrap();
            for (req, record) in reqs.iter().zip(&report.requests) {
                let generated = &record.generated[0];
                let mut tokens = req.prompt.clone();
                tokens.extend(&generated[..generated.len() - 1]);
                let logits = prompt_logits(&mut scorer, backend.as_ref(), &tokens).unwrap();
                for (i, &token) in generated.iter().enumerate() {
                    let r = row(&logits, config.vocab, req.prompt.len() - 1 + i);
                    let max = r.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let std = spread(r);
                    assert!(
                        r[token as usize] >= max - 0.02 * std,
                        "graphs {cuda_graphs}: token {i} ({token}) has logit {}, the row's largest is {max} (std {std})",
                        r[token as usize]
                    );
                }
            }
        }
    }

    /// SmolLM2 in bf16 on the GPU against the f32 host model on the golden sequences (each
    /// prompt with transformers' 32 greedy tokens), teacher-forced: at every position that
    /// predicts a generated token, every logit within 25% of its row's spread (standard
    /// deviation: bf16 weights and activations through 30 layers) and the same greedy token
    /// in at least 99% of the rows.
    #[test]
    #[ignore = "needs a CUDA GPU and the SmolLM2 file (tools/gpu-suite.sh runs it)"]
    fn smollm2_bf16_logits_match_f32() {
        let Some(path) = crate::common::model_path() else {
            return;
        };
        let golden = golden();
        let file = Gguf::open(&path).unwrap();
        let mut host = Llama::from_gguf(&file, Precision::Exact).unwrap();
        let cuda = Cuda::new(0).unwrap();
        let mut gpu = GpuLlama::new(&host, &cuda).unwrap();
        let cpu = registry::backend("cpu").unwrap();
        let backend = registry::backend("cuda").unwrap();
        let vocab = gpu.vocab_size();
        let (mut rows, mut same, mut worst) = (0, 0, 0f32);
        for case in golden["generation_cases"].as_array().unwrap() {
            let prompt = ids(&case["prompt_ids"]);
            let generated = ids(&case["generated_ids"]);
            let mut tokens = prompt.clone();
            tokens.extend(&generated[..generated.len() - 1]);
            let want = prompt_logits(&mut host, cpu.as_ref(), &tokens).unwrap();
            let got = prompt_logits(&mut gpu, backend.as_ref(), &tokens).unwrap();
            let a = agreement(&want, &got, vocab, prompt.len() - 1..tokens.len());
            eprintln!("{}: {a:?}", case["name"]);
            rows += a.rows;
            same += a.same_top1;
            worst = worst.max(a.max_rel_to_std);
        }
        eprintln!("SmolLM2 bf16 against f32: {same} of {rows} greedy tokens the same, largest difference {worst:.4} of a row's standard deviation");
        assert!(
            worst <= 0.25,
            "largest difference {worst} of a row's standard deviation"
        );
        assert!(
            same * 100 >= rows * 99,
            "{same} of {rows} greedy tokens the same"
        );
    }
}
