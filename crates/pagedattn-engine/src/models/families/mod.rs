//! Model families from Hugging Face folders (`config.json`, `*.safetensors`): one module per
//! family maps its config fields and tensor names onto the shared blocks
//! ([`crate::models::blocks`]) of the two forward passes, the decoder ([`Llama`]) and the
//! encoder(-decoder) ([`EncDec`]). Adding a family is a module here and a line in
//! `FAMILIES`, the table [`from_hf`] reads (docs/models.md, "Adding a family").
//!
//! | `model_type` | model | attention features |
//! |---|---|---|
//! | `llama`, `mistral`, `qwen2` | [`Llama`] | GQA, RoPE; Mistral's window; Qwen2's q/k/v biases |
//! | `gemma2` | [`Llama`] | local/global layers, attention and final soft caps |
//! | `bloom` | [`Llama`] | ALiBi |
//! | `opt` | [`Llama`] | learned positions (offset 2), no RoPE |
//! | `bert` | [`EncDec`], encoder-only | bidirectional attention, no cache |
//! | `bart` | [`EncDec`], encoder-decoder | cross-attention over a cached encoder |

mod bart;
mod bert;
mod bloom;
mod gemma2;
mod llama;
mod opt;

use crate::models::encdec::EncDec;
use crate::models::hf::HfFolder;
use crate::models::llama::Llama;
use crate::models::ops::{Activation, Embedding, Linear, Norm, Precision};
use crate::serving::model::Model;
use crate::{Error, Result};

/// A model loaded from a folder: a decoder (which may also run on the GPU, see
/// [`Llama::runs_on_gpu_model`]) or an encoder-only / encoder-decoder model.
pub enum HfModel {
    /// A decoder-only model.
    Decoder(Llama),
    /// An encoder-only or encoder-decoder model.
    Encoder(EncDec),
}

impl HfModel {
    /// The model, boxed for the engine.
    pub fn into_model(self) -> Box<dyn Model> {
        match self {
            HfModel::Decoder(m) => Box::new(m),
            HfModel::Encoder(m) => Box::new(m),
        }
    }
}

/// A family's loader.
type Loader = fn(&Reader<'_>) -> Result<HfModel>;

/// Every `model_type` served, with its family's loader.
const FAMILIES: [(&str, Loader); 8] = [
    ("llama", llama::load),
    ("mistral", llama::load),
    ("qwen2", llama::load),
    ("gemma2", gemma2::load),
    ("bloom", bloom::load),
    ("opt", opt::load),
    ("bert", bert::load),
    ("bart", bart::load),
];

/// Every `model_type` served.
pub fn model_types() -> impl Iterator<Item = &'static str> {
    FAMILIES.iter().map(|(name, _)| *name)
}

/// The model of `folder`, by its `config.json`'s `model_type`, its projections at
/// `precision` (f32 weights compute the same at either).
///
/// # Errors
/// An unsupported `model_type`, or a config field or tensor missing or of the wrong shape:
/// the error names the file and the field or tensor.
pub fn from_hf(folder: &HfFolder, precision: Precision) -> Result<HfModel> {
    let model_type = folder.model_type()?;
    if let Some(q) = folder.config("quantization_config") {
        let method = q.get("quant_method").and_then(serde_json::Value::as_str);
        return Err(folder.config_error(
            "quantization_config",
            &format!(
                "none: quantized checkpoints ({}) are not read (a GGUF file is)",
                method.unwrap_or("a quantization")
            ),
        ));
    }
    match FAMILIES.iter().find(|(name, _)| *name == model_type) {
        Some((_, load)) => load(&Reader { folder, precision }),
        None => {
            let names: Vec<&str> = model_types().collect();
            Err(folder.config_error("model_type", &format!("one of {}", names.join(", "))))
        }
    }
}

/// What a family's loader reads the folder with: tensors as the blocks take them.
pub(crate) struct Reader<'a> {
    pub(crate) folder: &'a HfFolder,
    pub(crate) precision: Precision,
}

impl Reader<'_> {
    /// The projection `{name}.weight` (`[out, inp]`), with `{name}.bias` where the folder
    /// has it (the module had `bias=True`).
    pub(crate) fn linear(&self, name: &str, out: usize, inp: usize) -> Result<Linear> {
        let weight = self.folder.tensor(&format!("{name}.weight"), &[out, inp])?;
        let linear = Linear::from_f32(&weight, out, inp, self.precision)?;
        let bias = format!("{name}.bias");
        Ok(if self.folder.has(&bias) {
            linear.with_bias(self.folder.tensor(&bias, &[out])?)?
        } else {
            linear
        })
    }

    /// Tensor `name` of `len` elements.
    pub(crate) fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        self.folder.tensor(name, &[len])
    }

    /// The RMSNorm `{name}.weight`.
    pub(crate) fn rms_norm(&self, name: &str, len: usize, eps: f32) -> Result<Norm> {
        Ok(Norm::Rms {
            weight: self.vector(&format!("{name}.weight"), len)?,
            eps,
        })
    }

    /// The LayerNorm `{name}.weight` and `{name}.bias`.
    pub(crate) fn layer_norm(&self, name: &str, len: usize, eps: f32) -> Result<Norm> {
        Ok(Norm::Layer {
            weight: self.vector(&format!("{name}.weight"), len)?,
            bias: self.vector(&format!("{name}.bias"), len)?,
            eps,
        })
    }

    /// The `[vocab, hidden]` table `name`.
    pub(crate) fn embedding(&self, name: &str, vocab: usize, hidden: usize) -> Result<Embedding> {
        let table = self.folder.tensor(name, &[vocab, hidden])?;
        Ok(Embedding::from_f32(&table, vocab, hidden)?)
    }

    /// Config field `key` (`usize`), which must be positive.
    pub(crate) fn positive(&self, key: &str) -> Result<usize> {
        match self.folder.config_usize(key)? {
            0 => Err(self.folder.config_error(key, "a positive number")),
            n => Ok(n),
        }
    }

    /// The head count of config field `key`, which must divide `width` (config field
    /// `width_key`: the heads split it).
    pub(crate) fn heads(&self, key: &str, width: usize, width_key: &str) -> Result<usize> {
        let heads = self.positive(key)?;
        if !width.is_multiple_of(heads) {
            return Err(self
                .folder
                .config_error(key, &format!("a divisor of {width_key} {width}")));
        }
        Ok(heads)
    }

    /// The layer count of config field `key`, checked against the weights: the folder must
    /// hold `tensor_of(count - 1)` (a count from the config alone sizes the model's tables
    /// before any tensor is read: 2^31 layers once asked for 32 GiB).
    pub(crate) fn layers(&self, key: &str, tensor_of: impl Fn(usize) -> String) -> Result<usize> {
        let n = self.positive(key)?;
        let last = tensor_of(n - 1);
        if n > self.folder.tensor_names().count() || !self.folder.has(&last) {
            return Err(self.folder.config_error(
                key,
                &format!("the layers the weights hold (no tensor `{last}`)"),
            ));
        }
        Ok(n)
    }

    /// The epsilon of config field `key`: finite and at least 0 (as an f32).
    pub(crate) fn eps(&self, key: &str) -> Result<f32> {
        let eps = self.folder.config_f64(key)? as f32;
        if !(eps.is_finite() && eps >= 0.0) {
            return Err(self
                .folder
                .config_error(key, "a finite number of at least 0"));
        }
        Ok(eps)
    }

    /// Config field `key` if given (a soft cap, a scalar): finite and above 0 (as an f32).
    pub(crate) fn positive_f32(&self, key: &str) -> Result<Option<f32>> {
        match self.folder.config_f64_opt(key)? {
            Some(v) if !(v as f32 > 0.0 && (v as f32).is_finite()) => {
                Err(self.folder.config_error(key, "a finite number above 0"))
            }
            v => Ok(v.map(|v| v as f32)),
        }
    }

    /// The activation named by config field `key` (transformers' `ACT2FN` names).
    pub(crate) fn activation(&self, key: &str) -> Result<Activation> {
        match self.folder.config_str_opt(key)? {
            Some("silu" | "swish") => Ok(Activation::Silu),
            Some("gelu") => Ok(Activation::Gelu),
            Some("gelu_pytorch_tanh" | "gelu_new" | "gelu_fast") => Ok(Activation::GeluTanh),
            Some("relu") => Ok(Activation::Relu),
            _ => Err(self
                .folder
                .config_error(key, "silu, gelu, gelu_new, gelu_pytorch_tanh or relu")),
        }
    }

    /// `eos_token_id` (a number or a list): the tokens that end a sample.
    pub(crate) fn stop_tokens(&self) -> Vec<u32> {
        let id = |v: &serde_json::Value| v.as_u64().and_then(|t| u32::try_from(t).ok());
        match self.folder.config("eos_token_id") {
            Some(serde_json::Value::Array(ids)) => ids.iter().filter_map(id).collect(),
            Some(v) => id(v).into_iter().collect(),
            None => Vec::new(),
        }
    }

    /// The model's name for reports: the folder's.
    pub(crate) fn name(&self) -> String {
        let dir = self.folder.dir();
        dir.file_name().map_or(dir.display().to_string(), |n| {
            n.to_string_lossy().into_owned()
        })
    }

    /// The longest sequence: `max_position_embeddings`, or where a family has no position
    /// table (BLOOM's ALiBi) the first of the fields vLLM reads, else vLLM's default 2048.
    pub(crate) fn max_context(&self) -> Result<usize> {
        for key in ["max_position_embeddings", "n_positions", "seq_length"] {
            if let Some(n) = self.folder.config_usize_opt(key)? {
                return Ok(n);
            }
        }
        Ok(2048)
    }

    /// Each layer's sliding window: `sliding_window` on the layers that `layer_types` calls
    /// `sliding_attention` (transformers 5 writes it for Mistral, Qwen2 and Gemma-2); without
    /// `layer_types`, on every layer when `all_without_types` (Mistral's older configs).
    pub(crate) fn windows(
        &self,
        layers: usize,
        all_without_types: bool,
    ) -> Result<Vec<Option<usize>>> {
        let window = match self.folder.config_usize_opt("sliding_window")? {
            Some(0) => {
                return Err(self
                    .folder
                    .config_error("sliding_window", "a positive number"))
            }
            w => w,
        };
        let Some(types) = self.folder.config("layer_types") else {
            return Ok(vec![window.filter(|_| all_without_types); layers]);
        };
        let types: Vec<&str> = types
            .as_array()
            .map(|t| t.iter().filter_map(serde_json::Value::as_str).collect())
            .unwrap_or_default();
        if types.len() != layers {
            return Err(self.folder.config_error(
                "layer_types",
                &format!("{layers} of sliding_attention or full_attention"),
            ));
        }
        types
            .iter()
            .map(|t| match *t {
                "full_attention" => Ok(None),
                "sliding_attention" => window.map(Some).ok_or_else(|| {
                    self.folder
                        .config_error("sliding_window", "a window for the sliding layers")
                }),
                _ => Err(self
                    .folder
                    .config_error("layer_types", "sliding_attention or full_attention")),
            })
            .collect()
    }

    /// RoPE's base: `rope_parameters.rope_theta` (transformers 5) or `rope_theta` (4.x),
    /// default 10,000; RoPE variants other than the default (scaling) are refused.
    pub(crate) fn rope_theta(&self) -> Result<f32> {
        let rope = self.folder.config("rope_parameters");
        let field = |key: &str| rope.and_then(|r| r.get(key)).filter(|v| !v.is_null());
        if let Some(kind) = field("rope_type").or_else(|| self.folder.config("rope_scaling")) {
            if kind.as_str() != Some("default") {
                return Err(Error::Model(format!(
                    "{}: rope {kind}: only default RoPE is supported (no scaling)",
                    self.folder.dir().join("config.json").display()
                )));
            }
        }
        let theta = match field("rope_theta") {
            Some(v) => v.as_f64(),
            None => self.folder.config_f64_opt("rope_theta")?.or(Some(10_000.0)),
        };
        theta
            .map(|t| t as f32)
            .filter(|t| t.is_finite() && *t > 0.0)
            .ok_or_else(|| {
                let key = match rope {
                    Some(_) => "rope_parameters",
                    None => "rope_theta",
                };
                self.folder
                    .config_error(key, "a rope_theta: a finite number above 0")
            })
    }
}
