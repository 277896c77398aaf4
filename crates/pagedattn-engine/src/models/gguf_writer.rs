//! A GGUF writer: files built key by key and tensor by tensor, well-formed or deliberately
//! broken, and [`tiny_llama`], a complete small Llama model with a byte-level tokenizer and a
//! chat template. What the tests, the hostile-input suite and the GGUF fuzz target build
//! their files with (the reader is [`gguf`](super::gguf)).

use crate::models::tokenizer::byte_alphabet;
use crate::rng::SplitMix64;

/// GGUF's metadata value type code of a `u8`.
pub const U8: u32 = 0;
/// ... of a `u32`.
pub const U32: u32 = 4;
/// ... of an `i32`.
pub const I32: u32 = 5;
/// ... of an `f32`.
pub const F32: u32 = 6;
/// ... of a `bool`.
pub const BOOL: u32 = 7;
/// ... of a string.
pub const STRING: u32 = 8;
/// ... of an array.
pub const ARRAY: u32 = 9;

/// The ggml type code of f32 tensors.
pub const GGML_F32: u32 = 0;
/// ... of Q4_1 tensors.
pub const GGML_Q4_1: u32 = 3;
/// ... of Q8_0 tensors.
pub const GGML_Q8_0: u32 = 8;

/// Builds a GGUF file: key/values and tensors in the order added, data aligned as GGUF wants.
pub struct GgufWriter {
    /// The format version written in the header.
    pub version: u32,
    /// Where tensor data is aligned (GGUF's `general.alignment`, 32 by default).
    pub alignment: usize,
    kvs: Vec<u8>,
    n_kv: u64,
    infos: Vec<u8>,
    n_tensors: u64,
    data: Vec<u8>,
}

/// A GGUF string: u64 length, bytes.
pub fn string(s: &str) -> Vec<u8> {
    let mut v = (s.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(s.as_bytes());
    v
}

impl Default for GgufWriter {
    fn default() -> Self {
        GgufWriter::new(3, 32)
    }
}

impl GgufWriter {
    /// An empty file of `version` whose tensors are aligned to `alignment` (which the caller
    /// writes as `general.alignment` when it is not 32).
    pub fn new(version: u32, alignment: usize) -> Self {
        GgufWriter {
            version,
            alignment,
            kvs: Vec::new(),
            n_kv: 0,
            infos: Vec::new(),
            n_tensors: 0,
            data: Vec::new(),
        }
    }

    /// A key with a value type code and the value's encoded bytes.
    pub fn kv_raw(&mut self, key: &str, ty: u32, payload: &[u8]) -> &mut Self {
        self.kvs.extend(string(key));
        self.kvs.extend(ty.to_le_bytes());
        self.kvs.extend_from_slice(payload);
        self.n_kv += 1;
        self
    }

    /// A `u32` value.
    pub fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.kv_raw(key, U32, &v.to_le_bytes())
    }

    /// An `f32` value.
    pub fn kv_f32(&mut self, key: &str, v: f32) -> &mut Self {
        self.kv_raw(key, F32, &v.to_le_bytes())
    }

    /// A `bool` value.
    pub fn kv_bool(&mut self, key: &str, v: bool) -> &mut Self {
        self.kv_raw(key, BOOL, &[v as u8])
    }

    /// A string value.
    pub fn kv_str(&mut self, key: &str, v: &str) -> &mut Self {
        self.kv_raw(key, STRING, &string(v))
    }

    /// An array of strings.
    pub fn kv_str_array(&mut self, key: &str, items: &[&str]) -> &mut Self {
        let mut p = STRING.to_le_bytes().to_vec();
        p.extend((items.len() as u64).to_le_bytes());
        for s in items {
            p.extend(string(s));
        }
        self.kv_raw(key, ARRAY, &p)
    }

    /// An array of `i32`s.
    pub fn kv_i32_array(&mut self, key: &str, items: &[i32]) -> &mut Self {
        let mut p = I32.to_le_bytes().to_vec();
        p.extend((items.len() as u64).to_le_bytes());
        for v in items {
            p.extend(v.to_le_bytes());
        }
        self.kv_raw(key, ARRAY, &p)
    }

    /// A tensor record with an explicit offset and no data (for broken files).
    pub fn tensor_info(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.infos.extend(string(name));
        self.infos.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            self.infos.extend(d.to_le_bytes());
        }
        self.infos.extend(ty.to_le_bytes());
        self.infos.extend(offset.to_le_bytes());
        self.n_tensors += 1;
        self
    }

    /// A tensor with its data, placed at the next aligned offset.
    pub fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, data: &[u8]) -> &mut Self {
        let offset = self.data.len().next_multiple_of(self.alignment);
        self.data.resize(offset, 0);
        self.data.extend_from_slice(data);
        self.tensor_info(name, dims, ty, offset as u64)
    }

    /// The file's bytes.
    pub fn build(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(self.version.to_le_bytes());
        out.extend(self.n_tensors.to_le_bytes());
        out.extend(self.n_kv.to_le_bytes());
        out.extend_from_slice(&self.kvs);
        out.extend_from_slice(&self.infos);
        if self.n_tensors > 0 {
            out.resize(out.len().next_multiple_of(self.alignment), 0);
            out.extend_from_slice(&self.data);
        }
        out
    }
}

/// The shape and weights of [`tiny_llama`].
#[derive(Clone, Copy, Debug)]
pub struct TinyLlama {
    /// Layers.
    pub layers: usize,
    /// The residual stream's width.
    pub hidden: usize,
    /// The MLP's inner width.
    pub ffn: usize,
    /// Query heads (of `hidden / heads` each).
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// `llama.context_length`.
    pub context: u32,
    /// The weights' seed.
    pub seed: u64,
    /// Every weight (not the norms) is drawn in [-scale, scale].
    pub scale: f32,
    /// And `ffn_down`'s then multiplied by this (1; near f32's largest, the first MLP's
    /// product overflows: a model whose arithmetic makes infinities).
    pub ffn_down_factor: f32,
}

impl Default for TinyLlama {
    fn default() -> Self {
        TinyLlama {
            layers: 2,
            hidden: 32,
            ffn: 48,
            heads: 4,
            kv_heads: 2,
            context: 256,
            seed: 0,
            scale: 0.5,
            ffn_down_factor: 1.0,
        }
    }
}

/// A complete Llama GGUF of `shape`: f32 weights drawn from its seed (the output head tied to
/// the embedding), a byte-level BPE tokenizer of the 256 byte tokens and `<|im_end|>` (its
/// end of turn), and a ChatML template that refuses roles other than system, user and
/// assistant. What `Llama::from_gguf`, `Tokenizer::from_gguf` and `ChatTemplate::from_gguf`
/// load and the engine serves.
pub fn tiny_llama(shape: &TinyLlama) -> Vec<u8> {
    // The 256 byte tokens as byte-level BPE spells them, then the end of turn.
    let tokens: Vec<String> = byte_alphabet()
        .iter()
        .map(char::to_string)
        .chain(["<|im_end|>".to_string()])
        .collect();
    let token_refs: Vec<&str> = tokens.iter().map(String::as_str).collect();
    let vocab = tokens.len();
    let mut types = vec![1i32; vocab];
    types[vocab - 1] = 3; // control
    let head_size = shape.hidden / shape.heads;
    let (q, kv) = (shape.heads * head_size, shape.kv_heads * head_size);
    let mut rng = SplitMix64::new(shape.seed);
    let mut weights = |n: usize, factor: f32| -> Vec<u8> {
        (0..n)
            .flat_map(|_| {
                ((rng.next_f64() as f32 * 2.0 - 1.0) * shape.scale * factor).to_le_bytes()
            })
            .collect()
    };
    let ones = |n: usize| -> Vec<u8> { (0..n).flat_map(|_| 1.0f32.to_le_bytes()).collect() };
    let mut w = GgufWriter::default();
    w.kv_str("general.architecture", "llama")
        .kv_str("general.name", "tiny-llama")
        .kv_u32("llama.block_count", shape.layers as u32)
        .kv_u32("llama.context_length", shape.context)
        .kv_u32("llama.embedding_length", shape.hidden as u32)
        .kv_u32("llama.feed_forward_length", shape.ffn as u32)
        .kv_u32("llama.attention.head_count", shape.heads as u32)
        .kv_u32("llama.attention.head_count_kv", shape.kv_heads as u32)
        .kv_f32("llama.rope.freq_base", 10000.0)
        .kv_f32("llama.attention.layer_norm_rms_epsilon", 1e-5)
        .kv_str("tokenizer.ggml.model", "gpt2")
        .kv_str("tokenizer.ggml.pre", "default")
        .kv_str_array("tokenizer.ggml.tokens", &token_refs)
        .kv_i32_array("tokenizer.ggml.token_type", &types)
        .kv_str_array("tokenizer.ggml.merges", &[])
        .kv_u32("tokenizer.ggml.eos_token_id", vocab as u32 - 1)
        .kv_str(
            "tokenizer.chat_template",
            // (Roles checked as many real templates check them: a refusal to test.)
            "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}\
             {{ raise_exception('Unknown role: ' + m['role']) }}{% endif %}\
             <|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n\
             {% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        );
    let h = shape.hidden as u64;
    w.tensor(
        "token_embd.weight",
        &[h, vocab as u64],
        GGML_F32,
        &weights(shape.hidden * vocab, 1.0),
    );
    for l in 0..shape.layers {
        let name = |part: &str| format!("blk.{l}.{part}.weight");
        let (q64, kv64, ffn64) = (q as u64, kv as u64, shape.ffn as u64);
        w.tensor(&name("attn_norm"), &[h], GGML_F32, &ones(shape.hidden))
            .tensor(
                &name("attn_q"),
                &[h, q64],
                GGML_F32,
                &weights(shape.hidden * q, 1.0),
            )
            .tensor(
                &name("attn_k"),
                &[h, kv64],
                GGML_F32,
                &weights(shape.hidden * kv, 1.0),
            )
            .tensor(
                &name("attn_v"),
                &[h, kv64],
                GGML_F32,
                &weights(shape.hidden * kv, 1.0),
            )
            .tensor(
                &name("attn_output"),
                &[q64, h],
                GGML_F32,
                &weights(q * shape.hidden, 1.0),
            )
            .tensor(&name("ffn_norm"), &[h], GGML_F32, &ones(shape.hidden))
            .tensor(
                &name("ffn_gate"),
                &[h, ffn64],
                GGML_F32,
                &weights(shape.hidden * shape.ffn, 1.0),
            )
            .tensor(
                &name("ffn_up"),
                &[h, ffn64],
                GGML_F32,
                &weights(shape.hidden * shape.ffn, 1.0),
            )
            .tensor(
                &name("ffn_down"),
                &[ffn64, h],
                GGML_F32,
                &weights(shape.ffn * shape.hidden, shape.ffn_down_factor),
            );
    }
    w.tensor("output_norm.weight", &[h], GGML_F32, &ones(shape.hidden));
    w.build()
}
