//! The GGUF reader on the real SmolLM2 file and on synthetic, hostile files: every malformed
//! input is an error naming what is wrong, never a panic.

use crate::common::model_path;
use pagedattn_engine::models::gguf_writer;

use gguf_writer::*;
use pagedattn_engine::models::gguf::{Gguf, GgufError, LlamaConfig, MetaArray, MetaValue};
use pagedattn_engine::models::weights::WeightType;

/// A small well-formed llama file: metadata of every kind and three tensors.
fn synthetic() -> GgufWriter {
    synthetic_with(GgufWriter::default())
}

/// [`synthetic`]'s contents added to `w` (whose version and alignment are set).
fn synthetic_with(mut w: GgufWriter) -> GgufWriter {
    if w.alignment != 32 {
        w.kv_u32("general.alignment", w.alignment as u32);
    }
    w.kv_str("general.architecture", "llama")
        .kv_u32("llama.block_count", 2)
        .kv_u32("llama.context_length", 128)
        .kv_u32("llama.embedding_length", 64)
        .kv_u32("llama.feed_forward_length", 96)
        .kv_u32("llama.attention.head_count", 4)
        .kv_u32("llama.attention.head_count_kv", 2)
        .kv_f32("llama.rope.freq_base", 10000.0)
        .kv_f32("llama.attention.layer_norm_rms_epsilon", 1e-5)
        .kv_bool("tokenizer.ggml.add_bos_token", true)
        .kv_str_array("tokenizer.ggml.tokens", &["a", "b", "ab"])
        .kv_i32_array("tokenizer.ggml.token_type", &[1, 1, 3]);
    w.tensor("token_embd.weight", &[64, 3], GGML_Q8_0, &[7u8; 2 * 34 * 3])
        .tensor("blk.0.attn_norm.weight", &[64], GGML_F32, &[1u8; 64 * 4])
        .tensor(
            "blk.0.attn_q.weight",
            &[64, 64],
            GGML_Q4_1,
            &[2u8; 2 * 20 * 64],
        );
    w
}

fn err(bytes: Vec<u8>) -> GgufError {
    let e = Gguf::from_bytes(bytes).expect_err("a malformed file must be an error");
    let msg = e.to_string();
    assert!(!msg.contains('\n'), "one-line message: {msg}");
    e
}

#[test]
fn synthetic_file_reads_back() {
    let g = Gguf::from_bytes(synthetic().build()).unwrap();
    assert_eq!(g.version(), 3);
    assert_eq!(g.alignment(), 32);
    assert_eq!(g.data_start() % 32, 0);
    assert_eq!(g.get_u32("llama.block_count").unwrap(), 2);
    assert_eq!(g.get_u64("llama.block_count").unwrap(), 2);
    assert!(g.get_bool("tokenizer.ggml.add_bos_token").unwrap());
    assert_eq!(
        g.get_str_array("tokenizer.ggml.tokens").unwrap(),
        ["a", "b", "ab"]
    );
    assert_eq!(
        g.get_array("tokenizer.ggml.token_type").unwrap(),
        &MetaArray::I32(vec![1, 1, 3])
    );
    let names: Vec<_> = g.tensor_infos().iter().map(|t| t.name()).collect();
    assert_eq!(
        names,
        [
            "token_embd.weight",
            "blk.0.attn_norm.weight",
            "blk.0.attn_q.weight"
        ]
    );
    let q = g.tensor("blk.0.attn_q.weight").unwrap();
    assert_eq!(q.info.weight_type(), WeightType::Q4_1);
    assert_eq!(q.info.dims(), [64, 64]);
    assert_eq!(q.info.n_elements(), 64 * 64);
    assert_eq!(q.data, &[2u8; 2 * 20 * 64][..]);
    assert_eq!(
        g.tensor("blk.0.attn_norm.weight").unwrap().data,
        &[1u8; 256][..]
    );
    assert_eq!(g.tensors().count(), 3);

    let c = LlamaConfig::from_gguf(&g).unwrap();
    assert_eq!(
        (c.n_layers, c.hidden, c.ffn, c.n_heads, c.n_kv_heads),
        (2, 64, 96, 4, 2)
    );
    assert_eq!(
        (c.head_size, c.rope_dim, c.vocab_size, c.context_length),
        (16, 16, 3, 128)
    );
    assert!(c.tied_embeddings);
}

#[test]
fn version_2_and_custom_alignment() {
    let w = synthetic_with(GgufWriter::new(2, 64));
    let g = Gguf::from_bytes(w.build()).unwrap();
    assert_eq!(
        (g.version(), g.alignment(), g.data_start() % 64),
        (2, 64, 0)
    );
    assert_eq!(g.tensor("blk.0.attn_q.weight").unwrap().data[0], 2);
}

#[test]
fn typed_getters_name_key_and_type() {
    let g = Gguf::from_bytes(synthetic().build()).unwrap();
    let msg = g.get_u32("general.architecture").unwrap_err().to_string();
    assert!(
        msg.contains("general.architecture") && msg.contains("string") && msg.contains("u32"),
        "{msg}"
    );
    let msg = g.get_str("llama.nope").unwrap_err().to_string();
    assert!(
        msg.contains("llama.nope") && msg.contains("missing"),
        "{msg}"
    );
    let msg = g
        .get_str_array("tokenizer.ggml.token_type")
        .unwrap_err()
        .to_string();
    assert!(msg.contains("array of i32"), "{msg}");
    assert_eq!(g.opt_u32("llama.nope").unwrap(), None);
    let msg = g.tensor("output.weight").unwrap_err().to_string();
    assert!(msg.contains("output.weight"), "{msg}");
}

#[test]
fn every_truncation_is_an_error() {
    let full = synthetic().build();
    for n in 0..full.len() {
        let e = err(full[..n].to_vec());
        assert!(
            matches!(
                e,
                GgufError::Truncated { .. }
                    | GgufError::CountTooLarge { .. }
                    | GgufError::DataPastEnd { .. }
            ),
            "prefix {n}: {e}"
        );
    }
}

#[test]
fn corrupted_bytes_never_panic() {
    // Every byte of the header, metadata and tensor infos set to a few hostile values: the
    // result is a file or an error, never a panic or an absurd allocation.
    let full = synthetic().build();
    let g = Gguf::from_bytes(full.clone()).unwrap();
    for i in 0..g.data_start() {
        for v in [0x00, 0x01, 0x7f, 0x80, 0xff] {
            let mut bytes = full.clone();
            bytes[i] = v;
            if let Err(e) = Gguf::from_bytes(bytes) {
                assert!(!e.to_string().contains('\n'));
            }
        }
    }
}

#[test]
fn bad_magic_and_versions() {
    let mut bytes = synthetic().build();
    bytes[..4].copy_from_slice(b"GGML");
    assert!(err(bytes).to_string().contains("not a GGUF file"));
    for version in [1u32, 4, 3u32.swap_bytes()] {
        let mut w = synthetic();
        w.version = version;
        let msg = err(w.build()).to_string();
        assert!(msg.contains(&format!("version {version}")), "{msg}");
    }
}

#[test]
fn huge_counts_are_refused_before_allocating() {
    let mut bytes = GgufWriter::default().build();
    bytes[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(matches!(err(bytes), GgufError::CountTooLarge { .. }));
    let mut bytes = GgufWriter::default().build();
    bytes[16..24].copy_from_slice(&(1u64 << 40).to_le_bytes());
    assert!(matches!(err(bytes), GgufError::CountTooLarge { .. }));

    // An array claiming 2^61 strings.
    let mut w = GgufWriter::default();
    let mut p = STRING.to_le_bytes().to_vec();
    p.extend((1u64 << 61).to_le_bytes());
    w.kv_raw("tokenizer.ggml.tokens", ARRAY, &p);
    let msg = err(w.build()).to_string();
    assert!(msg.contains("tokenizer.ggml.tokens"), "{msg}");

    // A string claiming u64::MAX bytes.
    let mut w = GgufWriter::default();
    w.kv_raw("general.name", STRING, &u64::MAX.to_le_bytes());
    assert!(matches!(err(w.build()), GgufError::Truncated { .. }));
}

#[test]
fn malformed_metadata() {
    let mut w = GgufWriter::default();
    w.kv_raw("x", 13, &[0; 8]);
    assert!(err(w.build()).to_string().contains("unknown value type 13"));

    let mut w = GgufWriter::default();
    w.kv_raw("x", BOOL, &[2]);
    assert!(matches!(err(w.build()), GgufError::BadBool { byte: 2, .. }));

    let mut w = GgufWriter::default();
    w.kv_raw("x", STRING, &[2, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xfe]);
    assert!(matches!(err(w.build()), GgufError::InvalidUtf8 { .. }));

    let mut w = GgufWriter::default();
    w.kv_u32("x", 1).kv_u32("x", 2);
    assert!(matches!(err(w.build()), GgufError::DuplicateKey(k) if k == "x"));

    let mut w = GgufWriter::default();
    w.kv_u32("general.alignment", 24);
    assert!(err(w.build()).to_string().contains("general.alignment"));

    // Arrays of arrays nested past the limit (each level: element type ARRAY, count 1).
    let mut p = Vec::new();
    for _ in 0..10 {
        p.extend(ARRAY.to_le_bytes());
        p.extend(1u64.to_le_bytes());
    }
    p.extend(U8.to_le_bytes());
    p.extend(0u64.to_le_bytes());
    let mut w = GgufWriter::default();
    w.kv_raw("deep", ARRAY, &p);
    assert!(matches!(err(w.build()), GgufError::NestingTooDeep { .. }));

    // One level of nesting is fine.
    let mut p = ARRAY.to_le_bytes().to_vec();
    p.extend(1u64.to_le_bytes());
    p.extend(U8.to_le_bytes());
    p.extend(2u64.to_le_bytes());
    p.extend([5, 6]);
    let mut w = GgufWriter::default();
    w.kv_raw("nested", ARRAY, &p);
    let g = Gguf::from_bytes(w.build()).unwrap();
    assert_eq!(
        g.get("nested"),
        Some(&MetaValue::Array(MetaArray::Array(vec![MetaArray::U8(
            vec![5, 6]
        )])))
    );
}

#[test]
fn malformed_tensors() {
    let mut w = GgufWriter::default();
    w.tensor("t", &[32, 2], 12, &[0; 64]);
    let msg = err(w.build()).to_string();
    assert!(msg.contains("Q4_K") && msg.contains("\"t\""), "{msg}");

    let mut w = GgufWriter::default();
    w.tensor("t", &[16], GGML_Q8_0, &[0; 34]);
    assert!(matches!(err(w.build()), GgufError::RaggedRow { .. }));

    let mut w = GgufWriter::default();
    w.tensor_info("t", &[u64::MAX, 2], GGML_F32, 0);
    assert!(matches!(err(w.build()), GgufError::DimsOverflow { .. }));
    let mut w = GgufWriter::default();
    w.tensor_info("t", &[1 << 32, 1 << 32, 1 << 32], GGML_F32, 0);
    assert!(matches!(err(w.build()), GgufError::DimsOverflow { .. }));
    let mut w = GgufWriter::default();
    w.tensor_info("t", &[1 << 62], GGML_F32, 0);
    assert!(matches!(err(w.build()), GgufError::DimsOverflow { .. }));
    let mut w = GgufWriter::default();
    w.tensor_info("t", &[1 << 61], GGML_F32, 0);
    assert!(matches!(err(w.build()), GgufError::DataPastEnd { .. }));

    let mut w = GgufWriter::default();
    w.tensor_info("t", &[1, 1, 1, 1, 1], GGML_F32, 0);
    assert!(matches!(
        err(w.build()),
        GgufError::BadDimCount { n_dims: 5, .. }
    ));

    let mut w = GgufWriter::default();
    w.tensor("a", &[4], GGML_F32, &[0; 16])
        .tensor_info("b", &[4], GGML_F32, 8);
    assert!(matches!(
        err(w.build()),
        GgufError::Misaligned { offset: 8, .. }
    ));

    let mut w = GgufWriter::default();
    w.tensor("a", &[4], GGML_F32, &[0; 16])
        .tensor_info("b", &[4], GGML_F32, 1 << 20);
    let msg = err(w.build()).to_string();
    assert!(
        msg.contains("\"b\"") && msg.contains("past the end"),
        "{msg}"
    );
    let mut w = GgufWriter::default();
    w.tensor("a", &[4], GGML_F32, &[0; 16])
        .tensor_info("b", &[4], GGML_F32, u64::MAX - 31);
    assert!(matches!(err(w.build()), GgufError::DataPastEnd { .. }));

    let mut w = GgufWriter::default();
    w.tensor("a", &[4], GGML_F32, &[0; 16])
        .tensor("a", &[4], GGML_F32, &[0; 16]);
    assert!(matches!(err(w.build()), GgufError::DuplicateTensor(_)));
}

#[test]
fn config_errors_name_the_problem() {
    let mut w = synthetic();
    w.kv_str("general.architecture", "qwen2");
    // The duplicate key is refused first; build a fresh file with only the architecture changed.
    assert!(matches!(
        Gguf::from_bytes(w.build()),
        Err(GgufError::DuplicateKey(_))
    ));
    let bytes = synthetic().build();
    let at = bytes.windows(5).position(|w| w == b"llama").unwrap();
    let mut qwen = bytes.clone();
    qwen[at..at + 5].copy_from_slice(b"qwen2");
    let g = Gguf::from_bytes(qwen).unwrap();
    let msg = LlamaConfig::from_gguf(&g).unwrap_err().to_string();
    assert!(msg.contains("\"qwen2\""), "{msg}");

    let mut w = GgufWriter::default();
    w.kv_str("general.architecture", "llama")
        .kv_u32("llama.block_count", 2);
    let g = Gguf::from_bytes(w.build()).unwrap();
    let msg = LlamaConfig::from_gguf(&g).unwrap_err().to_string();
    assert!(
        msg.contains("llama.embedding_length") && msg.contains("missing"),
        "{msg}"
    );
}

/// Values that read but would run wrong (garbage or NaN tokens with exit code 0, once) are
/// refused, naming the key: an epsilon or a RoPE base that is not sensible, and a layer count
/// that disagrees with the layers' tensors.
#[test]
fn config_values_that_would_run_wrong_are_refused() {
    let file = |block_count: u32, base: f32, eps: f32, later_layer: bool| {
        let mut w = GgufWriter::default();
        w.kv_str("general.architecture", "llama")
            .kv_u32("llama.block_count", block_count)
            .kv_u32("llama.context_length", 128)
            .kv_u32("llama.embedding_length", 64)
            .kv_u32("llama.feed_forward_length", 96)
            .kv_u32("llama.attention.head_count", 4)
            .kv_f32("llama.rope.freq_base", base)
            .kv_f32("llama.attention.layer_norm_rms_epsilon", eps);
        w.tensor("token_embd.weight", &[64, 3], GGML_F32, &[0u8; 64 * 3 * 4])
            .tensor("blk.1.attn_norm.weight", &[64], GGML_F32, &[0u8; 64 * 4]);
        if later_layer {
            w.tensor("blk.2.attn_norm.weight", &[64], GGML_F32, &[0u8; 64 * 4]);
        }
        Gguf::from_bytes(w.build()).unwrap()
    };
    assert!(LlamaConfig::from_gguf(&file(2, 1e4, 1e-5, false)).is_ok());
    let eps = "llama.attention.layer_norm_rms_epsilon";
    let base = "llama.rope.freq_base";
    for (g, key, says) in [
        (file(2, 1e4, f32::NAN, false), eps, "NaN is not in (0, 1)"),
        (file(2, 1e4, -1e-5, false), eps, "-0.00001 is not in (0, 1)"),
        (file(2, 1e4, 0.0, false), eps, "0 is not in (0, 1)"),
        (
            file(2, 1e-45, 1e-5, false),
            base,
            "is not a finite base above 1",
        ),
        (
            file(2, f32::INFINITY, 1e-5, false),
            base,
            "inf is not a finite base",
        ),
        (
            file(2, 1e4, 1e-5, true),
            "llama.block_count",
            "blk.2.attn_norm.weight",
        ),
    ] {
        let msg = LlamaConfig::from_gguf(&g).unwrap_err().to_string();
        assert!(msg.contains(key) && msg.contains(says), "{msg}");
    }
}

#[test]
fn smollm2_file() {
    let Some(path) = model_path() else { return };
    let g = Gguf::open(&path).unwrap();
    assert_eq!(g.version(), 3);
    assert_eq!(g.tensor_infos().len(), 272);
    assert_eq!(g.get_str("tokenizer.ggml.pre").unwrap(), "smollm");
    let c = LlamaConfig::from_gguf(&g).unwrap();
    assert_eq!(
        c,
        LlamaConfig {
            n_layers: 30,
            hidden: 576,
            ffn: 1536,
            n_heads: 9,
            n_kv_heads: 3,
            head_size: 64,
            rope_dim: 64,
            rope_freq_base: 100000.0,
            rms_eps: 1e-5,
            vocab_size: 49152,
            context_length: 8192,
            tied_embeddings: true,
        }
    );
    let embd = g.tensor("token_embd.weight").unwrap();
    assert_eq!(embd.info.weight_type(), WeightType::Q8_0);
    assert_eq!(embd.info.dims(), [576, 49152]);
    assert_eq!(embd.data.len(), 49152 * 18 * 34);
    for (name, dims) in [
        ("blk.0.attn_q.weight", [576, 576]),
        ("blk.0.attn_k.weight", [576, 192]),
        ("blk.29.ffn_down.weight", [1536, 576]),
        ("blk.29.ffn_gate.weight", [576, 1536]),
    ] {
        let t = g.tensor(name).unwrap();
        assert_eq!(
            (t.info.weight_type(), t.info.dims()),
            (WeightType::Q4_1, &dims[..])
        );
        assert_eq!(t.data.len(), dims[0] / 32 * 20 * dims[1]);
    }
    let norm = g.tensor("output_norm.weight").unwrap();
    assert_eq!(norm.info.weight_type(), WeightType::F32);
    // RMSNorm weights of a trained model are finite and mostly positive.
    let w: Vec<f32> = norm
        .data
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert!(w.iter().all(|x| x.is_finite()) && w.iter().filter(|&&x| x > 0.0).count() > 500);
}
