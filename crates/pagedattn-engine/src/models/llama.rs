//! A Llama-architecture decoder on the CPU: token embedding, per layer RMSNorm → q/k/v
//! projections → RoPE → attention (the engine's, over the paged cache) → output projection
//! → residual → RMSNorm → SwiGLU MLP → residual, then the final norm and the LM head. Its
//! weights come from a GGUF file or are drawn from a seed (the synthetic model).

use pagedattn::{AttentionConfig, DType, Device, Tensor};

use crate::models::check_layer_output;
use crate::models::gguf::{Gguf, LlamaConfig, MetaArray};
use crate::models::hf::HfFolder;
use crate::models::ops::{
    add_assign, rms_norm, swiglu, Embedding, Linear, Precision, Rope, RopeStyle,
};
use crate::serving::model::{Attend, Model, StepTokens};
use crate::{Error, Result};

/// The shape of a Llama model.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaShape {
    /// Its name, for reports.
    pub name: String,
    /// Decoder layers.
    pub layers: usize,
    /// The residual stream's width.
    pub hidden: usize,
    /// The MLP's inner width.
    pub ffn: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Each head's size.
    pub head_size: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// RMSNorm's epsilon.
    pub rms_eps: f32,
    /// The longest sequence served.
    pub max_context: usize,
    /// Tokens that end a sample.
    pub stop_tokens: Vec<u32>,
    /// Ids below this are special tokens.
    pub first_plain_token: u32,
}

/// One decoder layer's weights.
pub struct LayerWeights {
    /// RMSNorm weight before attention.
    pub attn_norm: Vec<f32>,
    /// Query projection `[heads * head_size, hidden]`.
    pub wq: Linear,
    /// Key projection `[kv_heads * head_size, hidden]`.
    pub wk: Linear,
    /// Value projection `[kv_heads * head_size, hidden]`.
    pub wv: Linear,
    /// Output projection `[hidden, heads * head_size]`.
    pub wo: Linear,
    /// RMSNorm weight before the MLP.
    pub ffn_norm: Vec<f32>,
    /// Gate projection `[ffn, hidden]`.
    pub gate: Linear,
    /// Up projection `[ffn, hidden]`.
    pub up: Linear,
    /// Down projection `[hidden, ffn]`.
    pub down: Linear,
}

/// The MLP's activations, reused across calls.
#[derive(Default)]
pub struct MlpBuffers {
    h: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    act: Vec<f32>,
    out: Vec<f32>,
}

impl LayerWeights {
    /// The layer's MLP with its residual, `x += down(swiglu(gate(norm(x)), up(norm(x))))`,
    /// over the rows of `x` (`[t, hidden]`), in `buf`'s buffers.
    pub fn mlp(&self, x: &mut [f32], rms_eps: f32, buf: &mut MlpBuffers) -> Result<()> {
        // (A `Linear` has no zero dimension.)
        let inner = x.len() / self.gate.in_features() * self.gate.out_features();
        buf.h.resize(x.len(), 0.0);
        buf.out.resize(x.len(), 0.0);
        for b in [&mut buf.gate, &mut buf.up, &mut buf.act] {
            b.resize(inner, 0.0);
        }
        rms_norm(x, &self.ffn_norm, rms_eps, &mut buf.h)?;
        self.gate.forward(&buf.h, &mut buf.gate)?;
        self.up.forward(&buf.h, &mut buf.up)?;
        swiglu(&buf.gate, &buf.up, &mut buf.act)?;
        self.down.forward(&buf.act, &mut buf.out)?;
        Ok(add_assign(x, &buf.out)?)
    }
}

/// The [`Model`] methods a Llama model on any device answers from its `shape`
/// ([`LlamaShape`]) and `attention` (every layer's config) fields.
macro_rules! llama_model_info {
    () => {
        fn layers(&self) -> &[AttentionConfig] {
            &self.attention
        }

        fn vocab_size(&self) -> usize {
            self.shape.vocab
        }

        fn max_context(&self) -> usize {
            self.shape.max_context
        }

        fn stop_tokens(&self) -> Vec<u32> {
            self.shape.stop_tokens.clone()
        }

        fn first_plain_token(&self) -> u32 {
            self.shape.first_plain_token
        }
    };
}
#[cfg(feature = "cuda")]
pub(crate) use llama_model_info;

/// A Llama model's weights and attention settings.
pub struct Llama {
    pub(crate) shape: LlamaShape,
    pub(crate) embedding: Embedding,
    pub(crate) layers: Vec<LayerWeights>,
    pub(crate) out_norm: Vec<f32>,
    pub(crate) head: Linear,
    /// RoPE, or `None` where position comes from ALiBi.
    pub(crate) rope: Option<Rope>,
    pub(crate) attention: Vec<AttentionConfig>,
    dtype: DType,
    scratch: Scratch,
}

/// Activations of a step, reused across steps.
#[derive(Default)]
struct Scratch {
    x: Vec<f32>,
    h: Vec<f32>,
    h2: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    o: Vec<f32>,
    mlp: MlpBuffers,
    rows: Vec<f32>,
}

impl Llama {
    /// A model from its parts: `attention` is every layer's config (heads, head size, kv
    /// heads, scale and the options), `dtype` the attention tensors' and cache's dtype.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        shape: LlamaShape,
        embedding: Embedding,
        layers: Vec<LayerWeights>,
        out_norm: Vec<f32>,
        head: Linear,
        rope: Option<Rope>,
        attention: Vec<AttentionConfig>,
        dtype: DType,
    ) -> Result<Self> {
        if layers.len() != shape.layers || attention.len() != shape.layers {
            return Err(Error::Model(format!(
                "{} layers of weights and {} attention configs for a {}-layer model",
                layers.len(),
                attention.len(),
                shape.layers
            )));
        }
        check_parts(&shape, &embedding, &layers, &out_norm, &head)?;
        // The attention tensors are made from the configs, the projections write the shape's
        // heads: they must agree. RoPE rotates the first `head_dim` elements of each head.
        let s = &shape;
        if let Some(c) = attention.iter().find(|c| {
            (c.num_heads(), c.num_kv_heads(), c.head_size()) != (s.heads, s.kv_heads, s.head_size)
        }) {
            return Err(Error::Model(format!(
                "an attention of {}/{} heads of {} in a model of {}/{} heads of {}",
                c.num_heads(),
                c.num_kv_heads(),
                c.head_size(),
                s.heads,
                s.kv_heads,
                s.head_size
            )));
        }
        if let Some(r) = rope.as_ref().filter(|r| r.head_dim() > s.head_size) {
            return Err(Error::Model(format!(
                "RoPE over {} elements of heads of {}",
                r.head_dim(),
                s.head_size
            )));
        }
        Ok(Llama {
            shape,
            embedding,
            layers,
            out_norm,
            head,
            rope,
            attention,
            dtype,
            scratch: Scratch::default(),
        })
    }

    /// Its shape.
    pub fn shape(&self) -> &LlamaShape {
        &self.shape
    }

    /// The model of a Llama-architecture GGUF file: configuration and weights from the file,
    /// the projections multiplied at `precision`, attention in f32 (what transformers computes
    /// on the dequantized weights). RoPE rotates adjacent pairs: llama.cpp's converter permutes
    /// the q/k rows so that it does (see [`LlamaConfig`]).
    pub fn from_gguf(file: &Gguf, precision: Precision) -> Result<Self> {
        let c = LlamaConfig::from_gguf(file)?;
        let linear = |name: &str, out: usize, inp: usize| -> Result<Linear> {
            let t = file.tensor(name)?;
            check_dims(name, t.info.dims(), &[inp, out])?;
            Ok(Linear::from_gguf(
                t.data,
                t.info.weight_type(),
                out,
                inp,
                precision,
            )?)
        };
        let vector = |name: &str, len: usize| -> Result<Vec<f32>> {
            let t = file.tensor(name)?;
            check_dims(name, t.info.dims(), &[len])?;
            let mut v = vec![0.0; len];
            crate::models::ops::dequantize_row(t.info.weight_type(), t.data, &mut v)?;
            Ok(v)
        };
        let (q, kv) = (c.n_heads * c.head_size, c.n_kv_heads * c.head_size);
        let layers = (0..c.n_layers)
            .map(|l| {
                let name = |part: &str| format!("blk.{l}.{part}.weight");
                Ok(LayerWeights {
                    attn_norm: vector(&name("attn_norm"), c.hidden)?,
                    wq: linear(&name("attn_q"), q, c.hidden)?,
                    wk: linear(&name("attn_k"), kv, c.hidden)?,
                    wv: linear(&name("attn_v"), kv, c.hidden)?,
                    wo: linear(&name("attn_output"), c.hidden, q)?,
                    ffn_norm: vector(&name("ffn_norm"), c.hidden)?,
                    gate: linear(&name("ffn_gate"), c.ffn, c.hidden)?,
                    up: linear(&name("ffn_up"), c.ffn, c.hidden)?,
                    down: linear(&name("ffn_down"), c.hidden, c.ffn)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let table = file.tensor("token_embd.weight")?;
        check_dims(
            "token_embd.weight",
            table.info.dims(),
            &[c.hidden, c.vocab_size],
        )?;
        let embedding =
            Embedding::from_gguf(table.data, table.info.weight_type(), c.vocab_size, c.hidden)?;
        let head = if c.tied_embeddings {
            embedding.to_linear(precision)?
        } else {
            linear("output.weight", c.vocab_size, c.hidden)?
        };
        let attention = AttentionConfig::builder(c.n_heads, c.head_size)
            .num_kv_heads(c.n_kv_heads)
            .build()?;
        let rope = Rope::new(c.rope_dim, c.rope_freq_base, RopeStyle::Normal)?;
        let stop_tokens = ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"]
            .into_iter()
            .filter_map(|key| file.opt_u32(key).transpose())
            .collect::<std::result::Result<Vec<u32>, _>>()?;
        Llama::new(
            LlamaShape {
                name: file.opt_str("general.name")?.unwrap_or("llama").to_string(),
                layers: c.n_layers,
                hidden: c.hidden,
                ffn: c.ffn,
                heads: c.n_heads,
                kv_heads: c.n_kv_heads,
                head_size: c.head_size,
                vocab: c.vocab_size,
                rms_eps: c.rms_eps,
                max_context: c.context_length,
                stop_tokens,
                first_plain_token: first_plain_token(file)?,
            },
            embedding,
            layers,
            vector("output_norm.weight", c.hidden)?,
            head,
            Some(rope),
            vec![attention; c.n_layers],
            DType::F32,
        )
    }
}

impl Llama {
    /// A Llama-architecture model from a Hugging Face folder: `model_type` `llama`, or
    /// `mistral` (a sliding window on every layer); RoPE in transformers' `rotate_half` layout,
    /// default RoPE only (no scaling).
    pub fn from_hf(folder: &HfFolder, precision: Precision) -> Result<Self> {
        let model_type = folder.model_type()?;
        let window = match model_type {
            "llama" => None,
            "mistral" => folder.config_usize_opt("sliding_window")?,
            other => {
                return Err(Error::Model(format!(
                    "{}: model_type {other:?}: Llama::from_hf reads llama and mistral",
                    folder.dir().display()
                )))
            }
        };
        let hidden = folder.config_usize("hidden_size")?;
        let n_layers = folder.config_usize("num_hidden_layers")?;
        let heads = folder.config_usize("num_attention_heads")?;
        let kv_heads = folder
            .config_usize_opt("num_key_value_heads")?
            .unwrap_or(heads);
        let head_size = folder
            .config_usize_opt("head_dim")?
            .unwrap_or(hidden / heads.max(1));
        let ffn = folder.config_usize("intermediate_size")?;
        let vocab = folder.config_usize("vocab_size")?;
        // transformers 5 nests RoPE's settings in `rope_parameters`; 4.x wrote `rope_theta`.
        let rope = folder.config("rope_parameters");
        if let Some(kind) = rope
            .and_then(|r| r.get("rope_type"))
            .and_then(serde_json::Value::as_str)
            .filter(|&k| k != "default")
        {
            return Err(Error::Model(format!(
                "{}: rope_parameters.rope_type = {kind:?}: only default RoPE is supported",
                folder.dir().join("config.json").display()
            )));
        }
        let theta = rope
            .and_then(|r| r.get("rope_theta"))
            .and_then(serde_json::Value::as_f64)
            .or_else(|| {
                folder
                    .config("rope_theta")
                    .and_then(serde_json::Value::as_f64)
            })
            .unwrap_or(10_000.0);
        let tied = folder
            .config("tie_word_embeddings")
            .and_then(serde_json::Value::as_bool)
            .unwrap_or(false);
        let stop_tokens = match folder.config("eos_token_id") {
            None => Vec::new(),
            Some(serde_json::Value::Array(ids)) => ids
                .iter()
                .filter_map(serde_json::Value::as_u64)
                .map(|t| t as u32)
                .collect(),
            Some(v) => v.as_u64().map(|t| vec![t as u32]).unwrap_or_default(),
        };
        let linear = |name: String, out: usize, inp: usize| -> Result<Linear> {
            Ok(Linear::from_f32(
                &folder.tensor(&name, &[out, inp])?,
                out,
                inp,
                precision,
            )?)
        };
        let vector = |name: String, len: usize| folder.tensor(&name, &[len]);
        let (q, kv) = (heads * head_size, kv_heads * head_size);
        let layers = (0..n_layers)
            .map(|l| {
                let name = |part: &str| format!("model.layers.{l}.{part}.weight");
                Ok(LayerWeights {
                    attn_norm: vector(name("input_layernorm"), hidden)?,
                    wq: linear(name("self_attn.q_proj"), q, hidden)?,
                    wk: linear(name("self_attn.k_proj"), kv, hidden)?,
                    wv: linear(name("self_attn.v_proj"), kv, hidden)?,
                    wo: linear(name("self_attn.o_proj"), hidden, q)?,
                    ffn_norm: vector(name("post_attention_layernorm"), hidden)?,
                    gate: linear(name("mlp.gate_proj"), ffn, hidden)?,
                    up: linear(name("mlp.up_proj"), ffn, hidden)?,
                    down: linear(name("mlp.down_proj"), hidden, ffn)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let table = folder.tensor("model.embed_tokens.weight", &[vocab, hidden])?;
        let embedding = Embedding::from_f32(&table, vocab, hidden)?;
        let head = if tied {
            embedding.to_linear(precision)?
        } else {
            linear("lm_head.weight".into(), vocab, hidden)?
        };
        let attention = AttentionConfig::builder(heads, head_size)
            .num_kv_heads(kv_heads)
            .sliding_window(window)
            .build()?;
        Llama::new(
            LlamaShape {
                name: folder
                    .dir()
                    .file_name()
                    .map_or(model_type.to_string(), |n| n.to_string_lossy().into_owned()),
                layers: n_layers,
                hidden,
                ffn,
                heads,
                kv_heads,
                head_size,
                vocab,
                rms_eps: folder.config_f64("rms_norm_eps")? as f32,
                max_context: folder.config_usize("max_position_embeddings")?,
                stop_tokens,
                first_plain_token: 0,
            },
            embedding,
            layers,
            vector("model.norm.weight".into(), hidden)?,
            head,
            Some(Rope::new(head_size, theta as f32, RopeStyle::Neox)?),
            vec![attention; n_layers],
            DType::F32,
        )
    }
}

/// Every weight's size against `shape` (the GPU model's kernels index by the shape alone).
fn check_parts(
    s: &LlamaShape,
    embedding: &Embedding,
    layers: &[LayerWeights],
    out_norm: &[f32],
    head: &Linear,
) -> Result<()> {
    let (q, kv) = (s.heads * s.head_size, s.kv_heads * s.head_size);
    let linear = |w: &Linear| (w.out_features(), w.in_features());
    let embedding = (embedding.vocab(), embedding.hidden());
    check_part(|| "token embedding".into(), embedding, (s.vocab, s.hidden))?;
    check_part(|| "output norm".into(), (out_norm.len(), 1), (s.hidden, 1))?;
    check_part(|| "LM head".into(), linear(head), (s.vocab, s.hidden))?;
    for (i, l) in layers.iter().enumerate() {
        let parts = [
            ("attention norm", (l.attn_norm.len(), 1), (s.hidden, 1)),
            ("MLP norm", (l.ffn_norm.len(), 1), (s.hidden, 1)),
            ("wq", linear(&l.wq), (q, s.hidden)),
            ("wk", linear(&l.wk), (kv, s.hidden)),
            ("wv", linear(&l.wv), (kv, s.hidden)),
            ("wo", linear(&l.wo), (s.hidden, q)),
            ("gate", linear(&l.gate), (s.ffn, s.hidden)),
            ("up", linear(&l.up), (s.ffn, s.hidden)),
            ("down", linear(&l.down), (s.hidden, s.ffn)),
        ];
        for (name, got, want) in parts {
            check_part(|| format!("layer {i} {name}"), got, want)?;
        }
    }
    Ok(())
}

/// A part of `got` (rows, columns) where the shape wants `want`: an error naming it (`name`
/// is only formatted then).
fn check_part(
    name: impl FnOnce() -> String,
    got: (usize, usize),
    want: (usize, usize),
) -> Result<()> {
    if got == want {
        return Ok(());
    }
    Err(Error::Model(format!(
        "{} is {}x{}, expected {}x{} for the model's shape",
        name(),
        got.0,
        got.1,
        want.0,
        want.1
    )))
}

/// A GGUF tensor's dimensions, checked against the model's (GGUF order: the contiguous
/// dimension first).
fn check_dims(name: &str, got: &[usize], want: &[usize]) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(Error::Model(format!(
            "tensor {name} has dimensions {got:?}, expected {want:?} for the file's configuration"
        )))
    }
}

/// The first token id after the leading special tokens (type other than normal, 1, in
/// `tokenizer.ggml.token_type`): workloads draw random prompts from there on.
fn first_plain_token(file: &Gguf) -> Result<u32> {
    let types: Vec<i64> = match file.get("tokenizer.ggml.token_type") {
        Some(crate::models::gguf::MetaValue::Array(MetaArray::I32(t))) => {
            t.iter().map(|&x| x.into()).collect()
        }
        Some(crate::models::gguf::MetaValue::Array(MetaArray::U32(t))) => {
            t.iter().map(|&x| x.into()).collect()
        }
        _ => Vec::new(),
    };
    Ok(types.iter().take_while(|&&t| t != 1).count() as u32)
}

/// `dst` (a host tensor of `dtype`) filled from f32 values.
fn fill(dst: &mut Tensor, src: &[f32]) -> Result<()> {
    let mut view = dst.host_mut()?;
    match view.dtype() {
        DType::F32 => view
            .as_slice_mut::<f32>()
            .ok_or_else(|| Error::Model("an f32 tensor without f32 storage".into()))?
            .copy_from_slice(src),
        DType::BF16 => {
            for (d, &s) in view
                .as_slice_mut::<half::bf16>()
                .into_iter()
                .flatten()
                .zip(src)
            {
                *d = half::bf16::from_f32(s);
            }
        }
        DType::F16 => {
            for (d, &s) in view
                .as_slice_mut::<half::f16>()
                .into_iter()
                .flatten()
                .zip(src)
            {
                *d = half::f16::from_f32(s);
            }
        }
        other => return Err(Error::Model(format!("activations of dtype {other}"))),
    }
    Ok(())
}

/// `dst` filled from a host tensor's values as f32.
fn read(src: &Tensor, dst: &mut [f32]) -> Result<()> {
    let host = src.host()?;
    match host.dtype() {
        DType::F32 => dst.copy_from_slice(host.as_slice::<f32>().unwrap_or_default()),
        DType::BF16 => {
            for (d, s) in dst
                .iter_mut()
                .zip(host.as_slice::<half::bf16>().unwrap_or_default())
            {
                *d = s.to_f32();
            }
        }
        DType::F16 => {
            for (d, s) in dst
                .iter_mut()
                .zip(host.as_slice::<half::f16>().unwrap_or_default())
            {
                *d = s.to_f32();
            }
        }
        other => return Err(Error::Model(format!("activations of dtype {other}"))),
    }
    Ok(())
}

impl Model for Llama {
    fn name(&self) -> String {
        self.shape.name.clone()
    }

    fn dtype(&self) -> DType {
        self.dtype
    }

    llama_model_info!();

    fn forward(
        &mut self,
        step: &StepTokens<'_>,
        attend: &mut Attend<'_>,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        let s = &self.shape;
        let t = step.tokens.len();
        let (q_width, kv_width) = (s.heads * s.head_size, s.kv_heads * s.head_size);
        let w = &mut self.scratch;
        for (buf, len) in [
            (&mut w.x, t * s.hidden),
            (&mut w.h, t * s.hidden),
            (&mut w.h2, t * s.hidden),
            (&mut w.q, t * q_width),
            (&mut w.k, t * kv_width),
            (&mut w.v, t * kv_width),
            (&mut w.o, t * q_width),
        ] {
            buf.resize(len, 0.0);
        }
        let config = &self.attention[0];
        let mut qt = config.zeros_query(Device::Cpu, self.dtype, t)?;
        let mut kt = config.zeros_kv(Device::Cpu, self.dtype, t)?;
        let mut vt = config.zeros_kv(Device::Cpu, self.dtype, t)?;
        let mut ot = config.zeros_query(Device::Cpu, self.dtype, t)?;
        self.embedding.lookup(step.tokens, &mut w.x)?;
        for (l, layer) in self.layers.iter().enumerate() {
            rms_norm(&w.x, &layer.attn_norm, s.rms_eps, &mut w.h)?;
            layer.wq.forward(&w.h, &mut w.q)?;
            layer.wk.forward(&w.h, &mut w.k)?;
            layer.wv.forward(&w.h, &mut w.v)?;
            if let Some(rope) = &self.rope {
                rope.apply(&mut w.q, step.positions, s.heads)?;
                rope.apply(&mut w.k, step.positions, s.kv_heads)?;
            }
            fill(&mut qt, &w.q)?;
            fill(&mut kt, &w.k)?;
            fill(&mut vt, &w.v)?;
            attend(l, &qt, &kt, &vt, &mut ot)?;
            read(&ot, &mut w.o)?;
            layer.wo.forward(&w.o, &mut w.h2)?;
            add_assign(&mut w.x, &w.h2)?;
            layer.mlp(&mut w.x, s.rms_eps, &mut w.mlp)?;
            check_layer_output(&w.x, s.hidden, || format!("layer {l}"))?;
        }
        let rows = step.logit_rows.len();
        w.rows.clear();
        for &r in step.logit_rows {
            w.rows
                .extend_from_slice(&w.x[r * s.hidden..(r + 1) * s.hidden]);
        }
        w.h.resize(rows * s.hidden, 0.0);
        rms_norm(
            &w.rows,
            &self.out_norm,
            s.rms_eps,
            &mut w.h[..rows * s.hidden],
        )?;
        logits.resize(rows * s.vocab, 0.0);
        self.head.forward(&w.h[..rows * s.hidden], logits)?;
        Ok(())
    }
}
