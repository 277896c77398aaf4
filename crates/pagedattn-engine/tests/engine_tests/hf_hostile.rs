//! Hugging Face folders with hostile configs: every field of each family's `config.json`
//! (and `rope_parameters.rope_theta`) replaced by zero, small and huge numbers, negatives,
//! fractions, a string, null, or removed. Each load is refused with one line naming
//! `config.json` (and the field) or the weights file (and the tensor), or gives a model that
//! serves a request: never a panic, never a huge allocation (2^31 layers once asked for 32 GiB
//! before a tensor was read).

use std::sync::atomic::AtomicBool;

use pagedattn_engine::models::families;
use pagedattn_engine::models::hf::HfFolder;
use pagedattn_engine::models::ops::Precision;
use pagedattn_engine::serving::engine::{Engine, EngineRequest};
use pagedattn_engine::serving::model::ModelKind;
use serde_json::{json, Value};

/// What a field may be replaced by (`None`: removed).
fn replacements() -> Vec<Option<Value>> {
    [
        json!(0),
        json!(1),
        json!(3),
        json!(1u64 << 31),
        json!(1u64 << 62),
        json!(-1),
        json!(0.5),
        json!("x"),
        Value::Null,
    ]
    .into_iter()
    .map(Some)
    .chain([None])
    .collect()
}

#[test]
fn hostile_config_fields_are_refused_or_served_never_a_panic() {
    let models = crate::hf::models();
    let dir = std::env::temp_dir().join(format!("pagedattn-hf-hostile-{}", std::process::id()));
    let backend = pagedattn::registry::backend("cpu").unwrap();
    let (mut refused, mut served) = (0, 0);
    for family in [
        "llama", "qwen2", "mistral", "gemma2", "bloom", "opt", "bert", "bart",
    ] {
        let source = models.join(family);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for file in [
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        ] {
            std::fs::copy(source.join(file), dir.join(file)).unwrap();
        }
        let config: serde_json::Map<String, Value> =
            serde_json::from_str(&std::fs::read_to_string(source.join("config.json")).unwrap())
                .unwrap();
        let mut fields: Vec<Vec<&str>> = config.keys().map(|k| vec![k.as_str()]).collect();
        if config.contains_key("rope_parameters") {
            fields.push(vec!["rope_parameters", "rope_theta"]);
        }
        for path in &fields {
            for value in replacements() {
                let mut mutated = Value::Object(config.clone());
                let (last, parents) = path.split_last().unwrap();
                let mut at = &mut mutated;
                for p in parents {
                    at = &mut at[*p];
                }
                let object = at.as_object_mut().unwrap();
                match &value {
                    Some(v) => object.insert(last.to_string(), v.clone()),
                    None => object.remove(*last),
                };
                std::fs::write(dir.join("config.json"), mutated.to_string()).unwrap();
                let what = format!("{family}: {} = {value:?}", path.join("."));
                let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let folder = HfFolder::open(&dir)?;
                    let model = families::from_hf(&folder, Precision::Exact)?.into_model();
                    let kind = model.kind();
                    let config = crate::common::config(64, 256);
                    let engine = Engine::new(backend.as_ref(), model, &config)?;
                    let request = match kind {
                        ModelKind::EncoderDecoder => EngineRequest {
                            encoder_prompt: Some(vec![7, 8, 9]),
                            ..EngineRequest::greedy(vec![1], 4)
                        },
                        ModelKind::EncoderOnly => EngineRequest::greedy(vec![2, 7, 8, 3], 0),
                        ModelKind::Decoder => EngineRequest::greedy(vec![0, 7, 8, 9], 4),
                    };
                    engine.run(
                        "hostile",
                        vec![request],
                        &AtomicBool::new(false),
                        &mut |_, _, _| {},
                    )
                }));
                match outcome {
                    Err(_) => panic!("{what}: panicked"),
                    Ok(Ok(_)) => served += 1,
                    Ok(Err(e)) => {
                        let e = e.to_string();
                        // One line naming the file at fault.
                        let named = e.contains("config.json") || e.contains("model.safetensors");
                        assert!(named && e.len() < 500 && !e.contains('\n'), "{what}: {e}");
                        refused += 1;
                    }
                }
            }
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
    eprintln!("hostile configs: {refused} refused, {served} served");
    assert!(
        refused > 100 && served > 100,
        "{refused} refused, {served} served"
    );
}
