//! The Hugging Face families served: every decoder's completion and BART's (its prompt
//! encoded) give transformers' greedy tokens, BERT's embeddings its pooled outputs (as floats
//! and as base64), and each kind refuses the endpoints it does not answer.

use hyper::StatusCode;
use pagedattn_server::ServerConfig;
use serde_json::{json, Value};

use crate::common::{engine_config, hf_folder, start, TestModel};

/// The golden file of `family`.
fn golden(family: &str) -> Value {
    let path = hf_folder(family).join("golden.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The golden greedy entry with the most tokens before a near tie, and those tokens.
fn sure_tokens(golden: &Value) -> (&Value, Vec<u64>) {
    let sure = |g: &Value| {
        let margins = g["margins"].as_array().unwrap();
        margins
            .iter()
            .position(|m| m.as_f64().unwrap() < 1e-3)
            .unwrap_or(margins.len())
    };
    let best = golden["greedy"]
        .as_array()
        .unwrap()
        .iter()
        .max_by_key(|g| sure(g))
        .unwrap();
    let tokens = best["tokens"].as_array().unwrap()[..sure(best)]
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    (best, tokens)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_generating_family_completes_as_transformers() {
    for family in [
        "llama", "qwen2", "mistral", "gemma2", "bloom", "opt", "bart",
    ] {
        let golden = golden(family);
        let (entry, want) = sure_tokens(&golden);
        let server = start(
            ServerConfig::new(family),
            engine_config(256, 8),
            TestModel::Folder(family),
        );
        let answer = server
            .post(
                "/v1/completions",
                &json!({
                    "model": family, "prompt": entry["prompt"], "max_tokens": 32,
                    "temperature": 0, "ignore_eos": true, "return_token_ids": true,
                }),
            )
            .await;
        assert_eq!(answer.status, StatusCode::OK, "{family}: {}", answer.body);
        let answer = answer.json();
        let got: Vec<u64> = answer["choices"][0]["token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap())
            .collect();
        assert!(
            want.len() >= 8,
            "{family}: a near tie at token {}",
            want.len()
        );
        assert_eq!(got[..want.len()], want[..], "{family}");
        // BART's usage counts its encoded prompt and its decoder start token.
        let prompt_ids = golden["prompts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["text"] == entry["prompt"])
            .unwrap()["ids"]
            .as_array()
            .unwrap()
            .len();
        let extra = usize::from(family == "bart");
        assert_eq!(
            answer["usage"]["prompt_tokens"],
            prompt_ids + extra,
            "{family}"
        );
        server.stop();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bert_embeds_as_transformers_pools_in_floats_and_base64() {
    let golden = golden("bert");
    let server = start(
        ServerConfig::new("bert"),
        engine_config(64, 8),
        TestModel::Folder("bert"),
    );
    let texts: Vec<&Value> = golden["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| &p["text"])
        .collect();
    let floats = server
        .post("/v1/embeddings", &json!({"model": "bert", "input": texts}))
        .await;
    assert_eq!(floats.status, StatusCode::OK, "{}", floats.body);
    let floats = floats.json();
    assert_eq!(floats["object"], "list");
    let tokens: usize = golden["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["ids"].as_array().unwrap().len())
        .sum();
    assert_eq!(floats["usage"]["prompt_tokens"], tokens);
    let data = floats["data"].as_array().unwrap();
    assert_eq!(data.len(), texts.len());
    for (i, (d, want)) in data
        .iter()
        .zip(golden["pooled"].as_array().unwrap())
        .enumerate()
    {
        assert_eq!(
            (d["object"].as_str(), d["index"].as_u64()),
            (Some("embedding"), Some(i as u64))
        );
        let got = d["embedding"].as_array().unwrap();
        assert_eq!(got.len(), 64);
        for (g, w) in got.iter().zip(want.as_array().unwrap()) {
            assert!((g.as_f64().unwrap() - w.as_f64().unwrap()).abs() <= 1e-5);
        }
    }
    // base64: the same vectors' f32 bytes, little-endian; token ids as input.
    let ids = &golden["prompts"][0]["ids"];
    let b64 = server
        .post(
            "/v1/embeddings",
            &json!({"model": "bert", "input": ids, "encoding_format": "base64"}),
        )
        .await
        .json();
    let text = b64["data"][0]["embedding"].as_str().unwrap();
    let bytes = decode_base64(text);
    let got: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let want: Vec<f64> = data[0]["embedding"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(*g as f64, *w as f32 as f64);
    }
    server.stop();
}

/// Standard base64 without padding checks (the test's own decoder, to check the server's).
fn decode_base64(text: &str) -> Vec<u8> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        b'/' => 63,
        other => panic!("not base64: {other}"),
    };
    let digits: Vec<u8> = text.bytes().filter(|&c| c != b'=').map(value).collect();
    let mut out = Vec::new();
    for chunk in digits.chunks(4) {
        let n = chunk.iter().fold(0u32, |n, &d| n << 6 | d as u32) << (6 * (4 - chunk.len()));
        let bytes = n.to_be_bytes();
        out.extend_from_slice(&bytes[1..chunk.len()]);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_kind_refuses_the_endpoints_it_does_not_answer() {
    for (family, path, body, says) in [
        (
            "bert",
            "/v1/completions",
            json!({"model": "bert", "prompt": "hi"}),
            "`bert` is an encoder-only model: it serves /v1/embeddings, not /v1/completions",
        ),
        (
            "bart",
            "/v1/chat/completions",
            json!({"model": "bart", "messages": [{"role": "user", "content": "hi"}]}),
            "`bart` is an encoder-decoder model: it serves /v1/completions, not /v1/chat/completions",
        ),
        (
            "llama",
            "/v1/embeddings",
            json!({"model": "llama", "input": "hi"}),
            "`llama` is a decoder: it serves /v1/completions and /v1/chat/completions, not /v1/embeddings",
        ),
        (
            "bert",
            "/v1/embeddings",
            json!({"model": "bert", "input": "hi", "encoding_format": "int8"}),
            "encoding_format = \"int8\": expected \"float\" or \"base64\"",
        ),
        (
            "bert",
            "/v1/embeddings",
            json!({"model": "bert", "input": [[]]}),
            "input: no tokens: expected at least one",
        ),
        (
            "bert",
            "/v1/embeddings",
            json!({"model": "bert", "input": "hi", "dimensions": 8}),
            "dimensions = 8: not supported by this server (leave it out)",
        ),
    ] {
        let server = start(
            ServerConfig::new(family),
            engine_config(64, 8),
            TestModel::Folder(family),
        );
        let answer = server.post(path, &body).await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{family} {path}: {}", answer.body);
        let message = answer.json()["error"]["message"].as_str().unwrap().to_string();
        assert_eq!(message, says);
        server.stop();
    }
}
