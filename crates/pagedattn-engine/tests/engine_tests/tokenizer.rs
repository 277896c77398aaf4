//! The tokenizer and the chat template built from the SmolLM2 GGUF against transformers' own
//! (golden/smollm2.json, written by tools/golden-smollm2.py), and their errors on
//! synthetic files.

use crate::common::model_path;
use crate::golden_file::{golden, ids};
use pagedattn_engine::models::gguf_writer;

use gguf_writer::*;
use pagedattn_engine::models::chat::{ChatMessage, ChatTemplate};
use pagedattn_engine::models::gguf::Gguf;
use pagedattn_engine::models::tokenizer::{SpecialTokens, Tokenizer};

fn smollm2() -> Option<Gguf> {
    model_path().map(|p| Gguf::open(p).expect("the SmolLM2 file reads"))
}

#[test]
fn token_ids_match_transformers() {
    let Some(g) = smollm2() else { return };
    let tok = Tokenizer::from_gguf(&g).unwrap();
    assert_eq!(tok.vocab_size(), 49152);
    let golden = golden();
    let mut failures = Vec::new();
    let cases = golden["tokenizer_cases"].as_array().unwrap();
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let want = ids(&case["ids"]);
        let got = tok.encode(text, true).unwrap();
        if got != want {
            failures.push(format!("{text:?}: got {got:?}, transformers {want:?}"));
            continue;
        }
        let decoded = tok.decode(&got, false).unwrap();
        if decoded != case["decoded"].as_str().unwrap() {
            failures.push(format!("{text:?}: decoded {decoded:?}"));
        }
    }
    for case in golden["generation_cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        if tok.encode(text, true).unwrap() != ids(&case["prompt_ids"]) {
            failures.push(format!("prompt {:?} differs", case["name"]));
        }
        let generated = ids(&case["generated_ids"]);
        if tok.decode(&generated, false).unwrap() != case["generated_text"].as_str().unwrap() {
            failures.push(format!("generated text of {:?} differs", case["name"]));
        }
    }
    assert!(
        failures.is_empty(),
        "{} differences:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert!(cases.len() >= 20);
}

#[test]
fn special_tokens_and_markers() {
    let Some(g) = smollm2() else { return };
    let tok = Tokenizer::from_gguf(&g).unwrap();
    let s = tok.special_tokens();
    assert_eq!(
        s.bos.as_ref().map(|t| (t.id, t.text.as_str())),
        Some((1, "<|im_start|>"))
    );
    assert_eq!(
        s.eos.as_ref().map(|t| (t.id, t.text.as_str())),
        Some((2, "<|im_end|>"))
    );
    assert!(tok.is_eos(2) && !tok.is_eos(1));
    assert_eq!(tok.encode("<|im_start|>user", true).unwrap()[0], 1);
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(2));
    assert_eq!(tok.id_to_token(905).as_deref(), Some("Ġworld"));
    // Skipping special tokens drops the markers.
    let ids = tok.encode("<|im_start|>user\nhi<|im_end|>", false).unwrap();
    assert_eq!(tok.decode(&ids, true).unwrap(), "user\nhi");
}

#[test]
fn streaming_decode_equals_whole_decode() {
    let Some(g) = smollm2() else { return };
    let tok = Tokenizer::from_gguf(&g).unwrap();
    let golden = golden();
    let texts = golden["tokenizer_cases"]
        .as_array()
        .unwrap()
        .iter()
        .chain(golden["generation_cases"].as_array().unwrap())
        .map(|c| {
            c.get("decoded")
                .or(c.get("generated_text"))
                .unwrap()
                .as_str()
                .unwrap()
        });
    for text in texts {
        let ids = tok.encode(text, false).unwrap();
        let mut stream = tok.stream_decoder(false);
        let mut out = String::new();
        for &id in &ids {
            if let Some(piece) = stream.step(id).unwrap() {
                // A piece is whole characters: a split emoji waits for its last byte.
                assert!(
                    !piece.contains('\u{fffd}') || text.contains('\u{fffd}'),
                    "{piece:?}"
                );
                out.push_str(&piece);
            }
        }
        assert_eq!(out, tok.decode(&ids, false).unwrap());
    }
}

#[test]
fn chat_template_matches_transformers() {
    let Some(g) = smollm2() else { return };
    let template = ChatTemplate::from_gguf(&g).unwrap();
    let tok = Tokenizer::from_gguf(&g).unwrap();
    let golden = golden();
    let cases = golden["chat_cases"].as_array().unwrap();
    assert!(cases.len() >= 3);
    for case in cases {
        let messages: Vec<ChatMessage> = case["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
            .collect();
        let add = case["add_generation_prompt"].as_bool().unwrap();
        let rendered = template.render(&messages, add).unwrap();
        assert_eq!(
            rendered,
            case["rendered"].as_str().unwrap(),
            "{}",
            case["name"]
        );
        assert_eq!(
            tok.encode(&rendered, true).unwrap(),
            ids(&case["ids"]),
            "{}",
            case["name"]
        );
    }
}

/// Templates that would never finish, or grow past memory, stop with an error naming the chat
/// template (each once aborted the process or rendered forever).
#[test]
fn template_bombs_are_errors() {
    let render = |src: &str| {
        ChatTemplate::new(src, SpecialTokens::default())
            .and_then(|t| t.render(&[ChatMessage::new("user", "hi")], true))
    };
    for (src, says) in [
        // A macro doubling a string on each call (4 GB at depth 32).
        (
            "{% macro d(s) %}{{ d(s ~ s) }}{% endmacro %}{{ d('0123456789abcdef') }}",
            "recursion limit exceeded",
        ),
        // Three nested loops of 10^5 (10^15 iterations).
        (
            "{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}x{% endfor %}{% endfor %}{% endfor %}",
            "",
        ),
        // 10^9 characters written.
        (
            "{% for i in range(100000) %}{{ 'x' * 10000 }}{% endfor %}",
            "",
        ),
        // A string doubled in a loop (2^40 x 16 bytes), never written out.
        (
            "{% set ns = namespace(s='0123456789abcdef') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
            "fuel",
        ),
        // And by `+` in a macro's loop.
        (
            "{% macro m() %}{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}{% endmacro %}{{ m() }}",
            "fuel",
        ),
    ] {
        let e = render(src).expect_err(src).to_string();
        assert!(e.starts_with("chat template: ") && e.contains(says), "{src}: {e}");
    }
}

#[test]
fn chat_template_environment_is_transformers() {
    let special = SpecialTokens::default();
    let render = |src: &str| {
        ChatTemplate::new(src, special.clone())
            .and_then(|t| t.render(&[ChatMessage::new("user", "é\n\"<b>\"")], true))
    };
    // trim_blocks and lstrip_blocks: block tags take their line's indent and newline.
    assert_eq!(
        render("  {% if true %}\nA\n  {% endif %}\nB").unwrap(),
        "A\nB"
    );
    // raise_exception fails the rendering with the template's message.
    let e = render("{{ raise_exception('only user and assistant roles') }}").unwrap_err();
    assert!(
        e.to_string().contains("only user and assistant roles"),
        "{e}"
    );
    // tojson is Python's json.dumps(ensure_ascii=False): ", " and ": ", no HTML escaping.
    // (Expected strings rendered by transformers 5.24's own environment, jinja2 3.1.6.)
    assert_eq!(
        render("{{ messages | tojson }}").unwrap(),
        r#"[{"role": "user", "content": "é\n\"<b>\""}]"#
    );
    assert_eq!(
        render("{{ {'b': 1, 'a': 2} | tojson }}").unwrap(),
        r#"{"b": 1, "a": 2}"#
    );
    assert_eq!(
        render("{{ {'a': [1, 2.5, none, true, 1e20, 0.0001, 1e-05]} | tojson(indent=2) }}").unwrap(),
        "{\n  \"a\": [\n    1,\n    2.5,\n    null,\n    true,\n    1e+20,\n    0.0001,\n    1e-05\n  ]\n}"
    );
    assert_eq!(
        render("{{ 'ü😀' | tojson(ensure_ascii=true) }}").unwrap(),
        r#""\u00fc\ud83d\ude00""#
    );
    // Loop controls, Python string methods, and the generation prompt flag.
    assert_eq!(
        render("{% for m in messages %}{% if loop.first %}{% break %}{% endif %}x{% endfor %}{{ '  s '.strip() }}{{ add_generation_prompt }}")
            .unwrap(),
        "sTrue"
    );
    let e = ChatTemplate::new("{% if %}", special.clone()).unwrap_err();
    assert!(e.to_string().starts_with("chat template:"), "{e}");
}

/// A tiny byte-level tokenizer file: tokens, merges, types and the given model/pre names.
fn tiny(model: &str, pre: &str) -> Gguf {
    let mut w = GgufWriter::default();
    w.kv_str("general.architecture", "llama")
        .kv_str("tokenizer.ggml.model", model)
        .kv_str("tokenizer.ggml.pre", pre)
        .kv_str_array(
            "tokenizer.ggml.tokens",
            &["<|end|>", "a", "b", "Ġ", "ab", "Ġab"],
        )
        .kv_i32_array("tokenizer.ggml.token_type", &[3, 1, 1, 1, 1, 1])
        .kv_str_array("tokenizer.ggml.merges", &["a b", "Ġ ab"])
        .kv_u32("tokenizer.ggml.eos_token_id", 0);
    Gguf::from_bytes(w.build()).unwrap()
}

#[test]
fn tiny_tokenizer_and_unsupported_kinds() {
    let tok = Tokenizer::from_gguf(&tiny("gpt2", "smollm")).unwrap();
    assert_eq!(tok.encode("ab ab<|end|>", true).unwrap(), [4, 5, 0]);
    assert_eq!(tok.decode(&[4, 5, 0], true).unwrap(), "ab ab");

    let e = Tokenizer::from_gguf(&tiny("llama", "default"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("\"llama\"") && e.contains("tokenizer.ggml.model"),
        "{e}"
    );
    let e = Tokenizer::from_gguf(&tiny("gpt2", "qwen2"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("\"qwen2\"") && e.contains("tokenizer.ggml.pre"),
        "{e}"
    );

    let mut w = GgufWriter::default();
    w.kv_str("tokenizer.ggml.model", "gpt2")
        .kv_str_array("tokenizer.ggml.tokens", &["a"])
        .kv_str_array("tokenizer.ggml.merges", &["a b c"]);
    let e = Tokenizer::from_gguf(&Gguf::from_bytes(w.build()).unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("tokenizer.ggml.merges"), "{e}");

    let mut w = GgufWriter::default();
    w.kv_str("tokenizer.ggml.model", "gpt2")
        .kv_str_array("tokenizer.ggml.tokens", &["a"])
        .kv_str_array("tokenizer.ggml.merges", &[])
        .kv_u32("tokenizer.ggml.bos_token_id", 7);
    let e = Tokenizer::from_gguf(&Gguf::from_bytes(w.build()).unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("tokenizer.ggml.bos_token_id") && e.contains('7'),
        "{e}"
    );

    let e = ChatTemplate::from_gguf(&tiny("gpt2", "smollm"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("tokenizer.chat_template") && e.contains("missing"),
        "{e}"
    );
}
