//! Hugging Face folders: the tiny checkpoints of `tests/hf-models/` (transformers wrote them)
//! open, every tensor reads with the shape its config implies, and a broken folder is one
//! error naming the file and the field or tensor.

use std::path::{Path, PathBuf};

use std::sync::atomic::AtomicBool;

use crate::golden_file::ids;
use pagedattn_engine::harness::score::{encoder_decoder_logits, prompt_logits};
use pagedattn_engine::models::encdec::Pooling;
use pagedattn_engine::models::families::{self, HfModel};
use pagedattn_engine::models::hf::HfFolder;
use pagedattn_engine::models::ops::Precision;
use pagedattn_engine::serving::engine::{Engine, EngineRequest};
use pagedattn_engine::serving::model::Model;

/// `tests/hf-models/`.
pub(crate) fn models() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/hf-models")
}

const FAMILIES: [&str; 8] = [
    "llama", "qwen2", "mistral", "gemma2", "bloom", "opt", "bert", "bart",
];

#[test]
fn every_family_folder_opens_and_every_tensor_reads() {
    for family in FAMILIES {
        let folder = HfFolder::open(&models().join(family)).unwrap();
        assert_eq!(folder.model_type().unwrap(), family);
        let mut names: Vec<&str> = folder.tensor_names().collect();
        names.sort_unstable();
        assert!(names.len() > 10, "{family}: {names:?}");
        let vocab = folder.config_usize("vocab_size").unwrap();
        assert_eq!(vocab, 512);
        // The embedding's shape follows from the config.
        let (embedding, hidden) = match family {
            "bloom" => (
                "transformer.word_embeddings.weight",
                folder.config_usize("hidden_size").unwrap(),
            ),
            "bert" => (
                "embeddings.word_embeddings.weight",
                folder.config_usize("hidden_size").unwrap(),
            ),
            "bart" => (
                "model.shared.weight",
                folder.config_usize("d_model").unwrap(),
            ),
            "opt" => (
                "model.decoder.embed_tokens.weight",
                folder.config_usize("hidden_size").unwrap(),
            ),
            _ => (
                "model.embed_tokens.weight",
                folder.config_usize("hidden_size").unwrap(),
            ),
        };
        let rows = folder.tensor(embedding, &[vocab, hidden]).unwrap();
        assert_eq!(rows.len(), vocab * hidden);
        assert!(rows.iter().all(|v| v.is_finite()) && rows.iter().any(|&v| v != 0.0));
        for name in names {
            assert!(folder.has(name));
        }
    }
}

#[test]
fn a_wrong_shape_a_missing_tensor_and_a_bad_config_name_what_is_wrong() {
    let llama = models().join("llama");
    let folder = HfFolder::open(&llama).unwrap();
    let e = folder
        .tensor("model.embed_tokens.weight", &[64, 512])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("model.safetensors")
            && e.contains("model.embed_tokens.weight")
            && e.contains("[512, 64]"),
        "{e}"
    );
    let e = folder
        .tensor("model.nothing", &[1])
        .unwrap_err()
        .to_string();
    assert!(e.contains("no tensor `model.nothing`"), "{e}");
    let e = folder.config_usize("rms_norm_eps").unwrap_err().to_string();
    assert!(
        e.contains("config.json") && e.contains("rms_norm_eps = 0.00001: expected a whole number"),
        "{e}"
    );
    let e = folder.config_f64("no_such_key").unwrap_err().to_string();
    assert!(e.contains("no_such_key = missing"), "{e}");

    // A folder without config.json, a config that is not an object, a truncated weight file,
    // and an index naming a file outside the folder.
    let dir = std::env::temp_dir().join(format!("pagedattn-hf-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let e = HfFolder::open(&dir).err().unwrap().to_string();
    assert!(e.contains("config.json"), "{e}");
    std::fs::write(dir.join("config.json"), "[1, 2]").unwrap();
    let e = HfFolder::open(&dir).err().unwrap().to_string();
    assert!(e.contains("config.json: expected a JSON object"), "{e}");
    std::fs::copy(llama.join("config.json"), dir.join("config.json")).unwrap();
    let weights = std::fs::read(llama.join("model.safetensors")).unwrap();
    std::fs::write(dir.join("model.safetensors"), &weights[..weights.len() / 2]).unwrap();
    let e = HfFolder::open(&dir).err().unwrap().to_string();
    assert!(
        e.contains("model.safetensors: not a safetensors file"),
        "{e}"
    );
    // A header whose shape's size overflows: refused at open or at read, never a panic.
    let header =
        br#"{"w":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,4]}}"#;
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header);
    file.extend_from_slice(&[0; 4]);
    std::fs::write(dir.join("model.safetensors"), &file).unwrap();
    if let Ok(folder) = HfFolder::open(&dir) {
        let e = folder
            .tensor("w", &[4294967296, 4294967296, 16])
            .unwrap_err()
            .to_string();
        assert!(e.contains("overflows"), "{e}");
    }
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        r#"{"weight_map": {"a": "../../etc/passwd"}}"#,
    )
    .unwrap();
    let e = HfFolder::open(&dir).err().unwrap().to_string();
    assert!(e.contains("expected a file in the folder"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Each folder's tokenizer encodes the golden prompts (a rendered chat turn among them) to
/// transformers' ids with what the post-processor adds (BOS; BERT's `[CLS]` … `[SEP]`; BART's
/// `<s>` … `</s>`), and decodes them back.
#[test]
fn every_family_tokenizer_encodes_as_transformers() {
    use pagedattn_engine::models::tokenizer::Tokenizer;
    for family in FAMILIES {
        let dir = models().join(family);
        let tokenizer = Tokenizer::from_hf_folder(&dir).unwrap();
        for prompt in golden(family)["prompts"].as_array().unwrap() {
            let text = prompt["text"].as_str().unwrap();
            let want = ids(&prompt["ids"]);
            assert_eq!(
                tokenizer.encode(text, true).unwrap(),
                want,
                "{family}: {text:?}"
            );
            let skip_special = tokenizer.decode(&want, false).unwrap();
            assert!(skip_special.contains(text.trim_start_matches("<s>")) || family == "bert");
        }
        let special = tokenizer.special_tokens();
        match family {
            "bert" => assert_eq!(special.unk.as_ref().map(|t| t.text.as_str()), Some("[UNK]")),
            _ => assert_eq!(special.eos.as_ref().map(|t| t.text.as_str()), Some("</s>")),
        }
    }
    let e = Tokenizer::from_hf_folder(std::path::Path::new("/nonexistent"))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("/nonexistent/tokenizer.json"), "{e}");
}

/// The golden of `family`'s folder.
pub(crate) fn golden(family: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(models().join(family).join("golden.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// A JSON list of numbers.
fn floats(v: &serde_json::Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_f64().unwrap())
        .collect()
}

/// `family`'s model from its folder, at exact precision.
pub(crate) fn load(family: &str) -> HfModel {
    let folder = HfFolder::open(&models().join(family)).unwrap();
    families::from_hf(&folder, Precision::Exact).unwrap()
}

/// The largest error of `ours` (rows of `golden["rows"]`'s width) against the golden rows,
/// in units of each row's standard deviation (`golden["row_std"]`).
fn worst_in_stds(ours: &[f32], golden: &serde_json::Value) -> f64 {
    let mut worst = 0.0f64;
    let rows = golden["rows"].as_array().unwrap();
    let width = rows[0].as_array().unwrap().len();
    assert_eq!(ours.len(), rows.len() * width);
    for (i, (row, std)) in rows.iter().zip(floats(&golden["row_std"])).enumerate() {
        for (j, want) in floats(row).into_iter().enumerate() {
            worst = worst.max((ours[i * width + j] as f64 - want).abs() / std);
        }
    }
    worst
}

/// Serves `requests` on `model` on `backend` and checks each one's 32 greedy tokens
/// against transformers' `greedy` entries up to the first near tie (a top-2 margin under
/// 1e-3): how many tokens were compared in all.
fn greedy_matches(
    backend: &str,
    family: &str,
    model: Box<dyn Model>,
    requests: Vec<EngineRequest>,
) -> usize {
    let golden = golden(family);
    let backend = pagedattn::registry::backend(backend).unwrap();
    let config = crate::common::config(256, 512);
    let engine = Engine::new(backend.as_ref(), model, &config).unwrap();
    let report = engine
        .run("hf", requests, &AtomicBool::new(false), &mut |_, _, _| {})
        .unwrap();
    let mut compared = 0;
    for (g, r) in golden["greedy"]
        .as_array()
        .unwrap()
        .iter()
        .zip(&report.requests)
    {
        let want = ids(&g["tokens"]);
        let sure = floats(&g["margins"])
            .iter()
            .position(|&m| m < 1e-3)
            .unwrap_or(want.len());
        assert_eq!(
            r.generated[0][..sure],
            want[..sure],
            "{family}: prompt {:?}",
            g["prompt"]
        );
        compared += sure;
    }
    compared
}

/// The ids of the golden prompt whose text is `text`.
fn prompt_ids(golden: &serde_json::Value, text: &serde_json::Value) -> Vec<u32> {
    let p = golden["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["text"] == *text);
    ids(&p.unwrap()["ids"])
}

/// Every decoder family from its folder: Llama, Mistral (its window of 16 crossed by the
/// longer prompts), Qwen2 (q/k/v biases), Gemma-2 (local/global layers, both soft caps
/// biting), BLOOM (ALiBi over 3 heads, LayerNorms, the fused qkv) and OPT (learned positions
/// from row 2, LayerNorms, biases, ReLU): the logits of every
/// position of the golden prompt within 1e-4 of each row's standard deviation of
/// transformers', and the engine's greedy tokens equal to transformers' up to the first near
/// tie.
#[test]
fn every_decoder_family_computes_what_transformers_computes() {
    decoders_compute_what_transformers_computes("cpu");
}

/// [`every_decoder_family_computes_what_transformers_computes`] with `backend`'s attention.
fn decoders_compute_what_transformers_computes(backend_name: &str) {
    let backend = pagedattn::registry::backend(backend_name).unwrap();
    for family in ["llama", "mistral", "qwen2", "gemma2", "bloom", "opt"] {
        let golden = golden(family);
        let HfModel::Decoder(mut model) = load(family) else {
            panic!("{family} is a decoder")
        };
        let tokens = ids(&golden["logits"]["ids"]);
        let ours = prompt_logits(&mut model, backend.as_ref(), &tokens).unwrap();
        let worst = worst_in_stds(&ours, &golden["logits"]);
        assert!(
            worst <= 1e-4,
            "{family}: logits off by {worst:.2e} of a row's std"
        );
        let requests = golden["greedy"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| crate::common::greedy_past_eos(prompt_ids(&golden, &g["prompt"]), 32))
            .collect();
        let compared = greedy_matches(backend_name, family, Box::new(model), requests);
        assert!(compared >= 64, "{family}: only {compared} tokens compared");
    }
}

/// BERT from its folder: every token's final hidden state of each golden prompt within 1e-5
/// of the row's largest magnitude of transformers' (`last_hidden_state`), and served as
/// encoder-only requests, each prompt's pooled output (`pooler_output`) the same.
#[test]
fn bert_computes_what_transformers_computes() {
    bert_on("cpu");
}

/// [`bert_computes_what_transformers_computes`] with `backend`'s attention.
fn bert_on(backend: &str) {
    let golden = golden("bert");
    let backend = pagedattn::registry::backend(backend).unwrap();
    let HfModel::Encoder(model) = load("bert") else {
        panic!("bert is an encoder")
    };
    let close = |ours: &[f32], want: &serde_json::Value, what: &str| {
        let want = floats(want);
        let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        let worst = ours
            .iter()
            .zip(&want)
            .fold(0.0f64, |m, (&a, b)| m.max((a as f64 - b).abs()));
        assert!(
            worst <= 1e-5 * scale,
            "bert {what}: off by {worst:.2e} of {scale:.2e}"
        );
    };
    let mut states = model.with_pooling(Pooling::State).unwrap();
    let prompts = golden["prompts"].as_array().unwrap();
    for (p, hidden) in prompts
        .iter()
        .zip(golden["hidden_states"].as_array().unwrap())
    {
        let ours = prompt_logits(&mut states, backend.as_ref(), &ids(&p["ids"])).unwrap();
        for (i, row) in hidden.as_array().unwrap().iter().enumerate() {
            close(&ours[i * 64..(i + 1) * 64], row, "hidden state");
        }
    }
    let HfModel::Encoder(pooled) = load("bert") else {
        unreachable!()
    };
    let config = crate::common::config(256, 512);
    let engine = Engine::new(backend.as_ref(), Box::new(pooled), &config).unwrap();
    let requests = prompts
        .iter()
        .map(|p| EngineRequest::greedy(ids(&p["ids"]), 0))
        .collect();
    let report = engine
        .run("bert", requests, &AtomicBool::new(false), &mut |_, _, _| {})
        .unwrap();
    for (r, want) in report
        .requests
        .iter()
        .zip(golden["pooled"].as_array().unwrap())
    {
        close(r.pooled.as_ref().unwrap(), want, "pooled output");
    }
}

/// BART from its folder: the decoder's logits at every position of the teacher-forced
/// decoder prompt (over the encoder's prompt) within 1e-4 of each row's std of transformers',
/// and, served as encoder-decoder requests from the decoder start token, the greedy tokens
/// transformers generates.
#[test]
fn bart_computes_what_transformers_computes() {
    bart_on("cpu");
}

/// [`bart_computes_what_transformers_computes`] with `backend`'s attention.
fn bart_on(backend_name: &str) {
    let golden = golden("bart");
    let backend = pagedattn::registry::backend(backend_name).unwrap();
    let HfModel::Encoder(mut model) = load("bart") else {
        panic!("bart is an encoder-decoder")
    };
    let forced = &golden["teacher_forced"];
    let ours = encoder_decoder_logits(
        &mut model,
        backend.as_ref(),
        &ids(&forced["encoder_ids"]),
        &ids(&forced["decoder_ids"]),
    )
    .unwrap();
    let worst = worst_in_stds(&ours, forced);
    assert!(
        worst <= 1e-4,
        "bart: logits off by {worst:.2e} of a row's std"
    );
    let requests = golden["greedy"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| EngineRequest {
            encoder_prompt: Some(prompt_ids(&golden, &g["prompt"])),
            ..crate::common::greedy_past_eos(
                vec![g["decoder_start_token_id"].as_u64().unwrap() as u32],
                32,
            )
        })
        .collect();
    let compared = greedy_matches(backend_name, "bart", Box::new(model), requests);
    assert!(compared >= 64, "bart: only {compared} tokens compared");
}

/// A family's folder as a model source of the shared runs.
#[derive(Debug)]
struct Folder(&'static str);

impl crate::common::ModelSource for Folder {
    fn model(&self) -> Box<dyn Model> {
        load(self.0).into_model()
    }
}

/// Preemption by swap and by recompute changes no greedy token on any family: 12 requests of
/// each family's golden prompts (64 new tokens each, past EOS) in a pool of 12 blocks of 16
/// tokens, against a pool where nothing is preempted.
#[test]
fn preemption_changes_no_greedy_token_on_any_family() {
    for family in [
        "llama", "qwen2", "mistral", "gemma2", "bloom", "opt", "bart",
    ] {
        let golden = golden(family);
        let requests: Vec<EngineRequest> = (0..12)
            .map(|i| {
                let prompts = golden["prompts"].as_array().unwrap();
                let prompt = ids(&prompts[i % prompts.len()]["ids"]);
                match family {
                    "bart" => EngineRequest {
                        encoder_prompt: Some(prompt),
                        ..crate::common::greedy_past_eos(vec![1], 64)
                    },
                    _ => crate::common::greedy_past_eos(prompt, 64),
                }
            })
            .collect();
        crate::common::preemption_changes_nothing(&Folder(family), &requests, (512, 12), 256);
    }
}

/// Every family's checks with attention on the GPU (the models compute on the host in f32,
/// as on `cpu`; the same tolerances).
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU (tools/gpu-suite.sh runs it)"]
fn every_family_computes_what_transformers_computes_on_cuda() {
    decoders_compute_what_transformers_computes("cuda");
    bert_on("cuda");
    bart_on("cuda");
}
