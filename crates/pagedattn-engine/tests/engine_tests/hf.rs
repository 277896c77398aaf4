//! Hugging Face folders: the tiny checkpoints of `tests/hf-models/` (transformers wrote them)
//! open, every tensor reads with the shape its config implies, and a broken folder is one
//! error naming the file and the field or tensor.

use std::path::{Path, PathBuf};

use pagedattn_engine::models::hf::HfFolder;

fn models() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/hf-models")
}

const FAMILIES: [&str; 7] = [
    "llama", "qwen2", "mistral", "gemma2", "bloom", "bert", "bart",
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
        let golden: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap())
                .unwrap();
        for prompt in golden["prompts"].as_array().unwrap() {
            let text = prompt["text"].as_str().unwrap();
            let want: Vec<u32> = prompt["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
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

/// Llama and Mistral (its window of 16 crossed by the longer prompts) from their folders: the
/// logits of every position of the golden prompt within 1e-4 of each row's standard
/// deviation of transformers', and the engine's greedy tokens equal to transformers' up to the
/// first near tie (a top-2 margin under 1e-3).
#[test]
fn llama_and_mistral_folders_compute_what_transformers_computes() {
    use std::sync::atomic::AtomicBool;

    use pagedattn_engine::harness::score::prompt_logits;
    use pagedattn_engine::models::llama::Llama;
    use pagedattn_engine::models::ops::Precision;
    use pagedattn_engine::serving::engine::{Engine, EngineRequest};

    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect()
    };
    let backend = pagedattn::registry::backend("cpu").unwrap();
    for family in ["llama", "mistral"] {
        let dir = models().join(family);
        let folder = HfFolder::open(&dir).unwrap();
        let golden: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap())
                .unwrap();
        let mut model = Llama::from_hf(&folder, Precision::Exact).unwrap();
        let logits = &golden["logits"];
        let tokens = ids(&logits["ids"]);
        let ours = prompt_logits(&mut model, backend.as_ref(), &tokens).unwrap();
        let vocab = 512;
        let mut worst = 0.0f64;
        for (i, (row, std)) in logits["rows"]
            .as_array()
            .unwrap()
            .iter()
            .zip(logits["row_std"].as_array().unwrap())
            .enumerate()
        {
            let std = std.as_f64().unwrap();
            for (j, want) in row.as_array().unwrap().iter().enumerate() {
                let err = (ours[i * vocab + j] as f64 - want.as_f64().unwrap()).abs() / std;
                worst = worst.max(err);
            }
        }
        assert!(
            worst <= 1e-4,
            "{family}: logits off by {worst:.2e} of a row's std"
        );

        // A greedy entry names its prompt by text.
        let prompt_ids = |text: &serde_json::Value| {
            let p = golden["prompts"]
                .as_array()
                .unwrap()
                .iter()
                .find(|p| p["text"] == *text);
            ids(&p.unwrap()["ids"])
        };
        let requests: Vec<EngineRequest> = golden["greedy"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| crate::common::greedy_past_eos(prompt_ids(&g["prompt"]), 32))
            .collect();
        let config = crate::common::config(256, 512);
        let engine = Engine::new(
            backend.as_ref(),
            Box::new(Llama::from_hf(&folder, Precision::Exact).unwrap()),
            &config,
        )
        .unwrap();
        let report = engine
            .run("hf", requests, &AtomicBool::new(false), &mut |_, _, _| {})
            .unwrap();
        for (g, r) in golden["greedy"]
            .as_array()
            .unwrap()
            .iter()
            .zip(&report.requests)
        {
            let want = ids(&g["tokens"]);
            let margins: Vec<f64> = g["margins"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| m.as_f64().unwrap())
                .collect();
            let sure = margins.iter().position(|&m| m < 1e-3).unwrap_or(want.len());
            assert_eq!(
                r.generated[0][..sure],
                want[..sure],
                "{family}: prompt {:?}",
                g["prompt"]
            );
        }
    }
}
