//! A decoder-only transformer on the CPU, Llama's architecture and its relatives': the input
//! embedding, per layer a norm → q/k/v projections → RoPE (unless ALiBi) → attention (the
//! engine's, over the paged cache, with the layer's window, soft cap, slopes) → output
//! projection → residual, then a norm → MLP → residual, and the final norm, the LM head and
//! an optional soft cap of the logits. Which norms, biases, activation and embedding a model
//! has is its [`LayerWeights`] and [`InputEmbedding`] ([`crate::models::blocks`]): Llama,
//! Mistral, Qwen2, Gemma-2, BLOOM and OPT are all this model (the `families` module loads
//! them from Hugging Face folders). Weights also come from a GGUF file (Llama) or are drawn
//! from a seed (the synthetic model).

use pagedattn::{AttentionConfig, DType, Device, Tensor};

use crate::models::blocks::{InputEmbedding, LayerWeights, MlpBuffers, Placement, SublayerBuffers};
use crate::models::check_layer_output;
use crate::models::gguf::{Gguf, LlamaConfig, MetaArray};
use crate::models::ops::{soft_cap, Embedding, Linear, Norm, Precision, Rope, RopeStyle};
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
    /// The longest sequence served.
    pub max_context: usize,
    /// Tokens that end a sample.
    pub stop_tokens: Vec<u32>,
    /// Ids below this are special tokens.
    pub first_plain_token: u32,
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

/// A decoder's weights and attention settings.
pub struct Llama {
    pub(crate) shape: LlamaShape,
    pub(crate) embedding: InputEmbedding,
    pub(crate) layers: Vec<LayerWeights>,
    pub(crate) out_norm: Norm,
    pub(crate) head: Linear,
    /// `cap · tanh(logits / cap)` (Gemma-2's final soft cap).
    pub(crate) final_soft_cap: Option<f32>,
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
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    o: Vec<f32>,
    attn: SublayerBuffers,
    mlp: MlpBuffers,
    rows: Vec<f32>,
}

impl Llama {
    /// A model from its parts: `attention` is every layer's config (heads, head size, kv
    /// heads, scale and the options), `dtype` the attention tensors' and cache's dtype.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        shape: LlamaShape,
        embedding: InputEmbedding,
        layers: Vec<LayerWeights>,
        out_norm: Norm,
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
            final_soft_cap: None,
            rope,
            attention,
            dtype,
            scratch: Scratch::default(),
        })
    }

    /// The same model with its logits soft-capped, `cap · tanh(logits / cap)`.
    pub fn with_final_soft_cap(mut self, cap: Option<f32>) -> Self {
        self.final_soft_cap = cap;
        self
    }

    /// Its shape.
    pub fn shape(&self) -> &LlamaShape {
        &self.shape
    }

    /// Whether the GPU model computes it: Llama's blocks (RMSNorms, SwiGLU, the token table
    /// alone, no soft cap of the logits), biases on the q, k and v projections only (Qwen2's).
    pub fn runs_on_gpu_model(&self) -> bool {
        self.embedding.is_plain()
            && matches!(self.out_norm, Norm::Rms { .. })
            && self.final_soft_cap.is_none()
            && self.head.bias().is_none()
            && self.layers.iter().all(LayerWeights::is_llama)
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
                Ok(LayerWeights::llama(
                    vector(&name("attn_norm"), c.hidden)?,
                    [
                        linear(&name("attn_q"), q, c.hidden)?,
                        linear(&name("attn_k"), kv, c.hidden)?,
                        linear(&name("attn_v"), kv, c.hidden)?,
                        linear(&name("attn_output"), c.hidden, q)?,
                    ],
                    vector(&name("ffn_norm"), c.hidden)?,
                    [
                        linear(&name("ffn_gate"), c.ffn, c.hidden)?,
                        linear(&name("ffn_up"), c.ffn, c.hidden)?,
                        linear(&name("ffn_down"), c.hidden, c.ffn)?,
                    ],
                    c.rms_eps,
                ))
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
                max_context: c.context_length,
                stop_tokens,
                first_plain_token: first_plain_token(file)?,
            },
            InputEmbedding::plain(embedding),
            layers,
            Norm::Rms {
                weight: vector("output_norm.weight", c.hidden)?,
                eps: c.rms_eps,
            },
            head,
            Some(rope),
            vec![attention; c.n_layers],
            DType::F32,
        )
    }
}

/// Every weight's size against `shape` (the GPU model's kernels index by the shape alone).
fn check_parts(
    s: &LlamaShape,
    embedding: &InputEmbedding,
    layers: &[LayerWeights],
    out_norm: &Norm,
    head: &Linear,
) -> Result<()> {
    let (q, kv) = (s.heads * s.head_size, s.kv_heads * s.head_size);
    let linear = |w: &Linear| (w.out_features(), w.in_features());
    let norm = |n: &Norm| (n.width(), 1);
    let table = (embedding.tokens.vocab(), embedding.tokens.hidden());
    check_part(|| "token embedding".into(), table, (s.vocab, s.hidden))?;
    if let Some(n) = &embedding.norm {
        check_part(|| "embedding norm".into(), norm(n), (s.hidden, 1))?;
    }
    check_part(|| "output norm".into(), norm(out_norm), (s.hidden, 1))?;
    check_part(|| "LM head".into(), linear(head), (s.vocab, s.hidden))?;
    for (i, l) in layers.iter().enumerate() {
        let mut parts = vec![
            ("attention norm", norm(&l.attn_norm), (s.hidden, 1)),
            ("MLP norm", norm(&l.ffn_norm), (s.hidden, 1)),
            ("wq", linear(&l.wq), (q, s.hidden)),
            ("wk", linear(&l.wk), (kv, s.hidden)),
            ("wv", linear(&l.wv), (kv, s.hidden)),
            ("wo", linear(&l.wo), (s.hidden, q)),
            ("up", linear(&l.mlp.up), (s.ffn, s.hidden)),
            ("down", linear(&l.mlp.down), (s.hidden, s.ffn)),
        ];
        if let Some(gate) = &l.mlp.gate {
            parts.push(("gate", linear(gate), (s.ffn, s.hidden)));
        }
        for (name, n) in [
            ("attention output norm", &l.attn_out_norm),
            ("MLP output norm", &l.ffn_out_norm),
        ] {
            if let Some(n) = n {
                parts.push((name, norm(n), (s.hidden, 1)));
            }
        }
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
        let Scratch {
            x,
            h,
            q,
            k,
            v,
            o,
            attn,
            mlp,
            rows,
        } = &mut self.scratch;
        for (buf, len) in [
            (&mut *x, t * s.hidden),
            (&mut *q, t * q_width),
            (&mut *k, t * kv_width),
            (&mut *v, t * kv_width),
            (&mut *o, t * q_width),
        ] {
            buf.resize(len, 0.0);
        }
        let config = &self.attention[0];
        let mut qt = config.zeros_query(Device::Cpu, self.dtype, t)?;
        let mut kt = config.zeros_kv(Device::Cpu, self.dtype, t)?;
        let mut vt = config.zeros_kv(Device::Cpu, self.dtype, t)?;
        let mut ot = config.zeros_query(Device::Cpu, self.dtype, t)?;
        self.embedding.embed(step.tokens, step.positions, x)?;
        for (l, layer) in self.layers.iter().enumerate() {
            let norms = (&layer.attn_norm, layer.attn_out_norm.as_ref());
            Placement::Pre.sublayer(x, norms.0, norms.1, attn, |h, out| {
                layer.wq.forward(h, q)?;
                layer.wk.forward(h, k)?;
                layer.wv.forward(h, v)?;
                if let Some(rope) = &self.rope {
                    rope.apply(q, step.positions, s.heads)?;
                    rope.apply(k, step.positions, s.kv_heads)?;
                }
                fill(&mut qt, q)?;
                fill(&mut kt, k)?;
                fill(&mut vt, v)?;
                attend(l, &qt, &kt, &vt, &mut ot)?;
                read(&ot, o)?;
                Ok(layer.wo.forward(o, out)?)
            })?;
            layer.mlp(x, Placement::Pre, mlp)?;
            check_layer_output(x, s.hidden, || format!("layer {l}"))?;
        }
        let n = step.logit_rows.len();
        rows.clear();
        for &r in step.logit_rows {
            rows.extend_from_slice(&x[r * s.hidden..(r + 1) * s.hidden]);
        }
        h.resize(n * s.hidden, 0.0);
        self.out_norm.apply(rows, h)?;
        logits.resize(n * s.vocab, 0.0);
        self.head.forward(h, logits)?;
        if let Some(cap) = self.final_soft_cap {
            soft_cap(logits, cap);
        }
        Ok(())
    }
}
