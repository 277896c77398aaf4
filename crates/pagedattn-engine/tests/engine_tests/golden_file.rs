//! transformers' outputs for SmolLM2 (`golden/smollm2.json`, written by
//! tools/golden-smollm2.py), read by the golden, tokenizer and gpu_model tests.

use serde_json::Value;

/// The parsed golden file.
pub fn golden() -> Value {
    serde_json::from_str(include_str!("golden/smollm2.json")).expect("golden/smollm2.json parses")
}

/// A JSON list of token ids.
pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("an id list")
        .iter()
        .map(|x| x.as_u64().expect("an id") as u32)
        .collect()
}
