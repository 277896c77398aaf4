//! The tokenizer a GGUF file describes, built as transformers builds it from the same file
//! (`transformers.integrations.gguf.gguf_tokenizer_mapping`, which the golden tokens come from),
//! on the `tokenizers` crate — the Rust core that transformers itself runs — so that BPE merges,
//! added-token matching and byte-level decoding are the reference's own code.
//!
//! Supported: `tokenizer.ggml.model = "gpt2"` (byte-level BPE) with `tokenizer.ggml.pre` one of
//! [`SUPPORTED_PRE_TOKENIZERS`]. Built as transformers' `byte_level_tokenizer`:
//! - BPE over `tokenizer.ggml.tokens` (a token not spelled in GPT-2's byte alphabet is
//!   respelled from its UTF-8 bytes) and `tokenizer.ggml.merges`, no unknown token, no
//!   dropout, no byte fallback;
//! - pre-tokenizer `ByteLevel(add_prefix_space = false, use_regex = true)`: GPT-2's split
//!   regex. transformers' table of per-`pre` regexes has no entry for `smollm` (nor `gpt2`), so
//!   it keeps this default; llama.cpp's `smollm` additionally splits every digit apart first,
//!   which on SmolLM2's vocabulary (no token joins an ASCII digit to anything) gives the same ids
//!   on ASCII digits;
//! - decoder `ByteLevel`;
//! - tokens typed control (3) and spelled in the byte alphabet become special added tokens,
//!   matched whole in the text; tokens typed user-defined (4) become plain added tokens;
//! - `tokenizer.ggml.add_bos_token` / `add_eos_token` (default off) wrap an encoding when
//!   special tokens are asked for.

use thiserror::Error;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, DecodeStream, DecoderWrapper, ModelWrapper, NormalizerWrapper};
use tokenizers::{PostProcessorWrapper, PreTokenizerWrapper};

use crate::models::gguf::{Gguf, GgufError, MetaArray};
use crate::models::hf::json_object;

/// The `tokenizer.ggml.pre` values this module builds, all with GPT-2's split regex as
/// transformers does for them.
pub const SUPPORTED_PRE_TOKENIZERS: &[&str] = &["smollm", "gpt2", "default"];

/// llama.cpp's `LLAMA_TOKEN_TYPE_CONTROL`.
const TOKEN_TYPE_CONTROL: i64 = 3;
/// llama.cpp's `LLAMA_TOKEN_TYPE_USER_DEFINED`.
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// A tokenizer that cannot be built from the file, or a failed encode/decode.
#[derive(Debug, Error)]
pub enum TokenizerError {
    /// Missing or mistyped metadata.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// A `tokenizer.ggml.model` other than `gpt2`.
    #[error("unsupported tokenizer model {0:?} (tokenizer.ggml.model): only \"gpt2\" (byte-level BPE) is supported")]
    UnsupportedModel(String),
    /// A `tokenizer.ggml.pre` this module has no pre-tokenizer for.
    #[error("unsupported pre-tokenizer {0:?} (tokenizer.ggml.pre): supported are {SUPPORTED_PRE_TOKENIZERS:?}")]
    UnsupportedPre(String),
    /// Metadata whose values do not fit together.
    #[error("{key}: {reason}")]
    BadMetadata {
        /// The key.
        key: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// An error of the `tokenizers` crate (a merge naming an unknown token, …).
    #[error("tokenizer: {0}")]
    Tokenizers(String),
}

/// `Result` with a [`TokenizerError`].
pub type Result<T, E = TokenizerError> = std::result::Result<T, E>;

fn tk(e: tokenizers::Error) -> TokenizerError {
    TokenizerError::Tokenizers(e.to_string())
}

/// A special token: its id and its text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecialToken {
    /// The id.
    pub id: u32,
    /// The token's text (`<|im_start|>`).
    pub text: String,
}

/// The special tokens a GGUF names (`tokenizer.ggml.{bos,eos,unknown,padding}_token_id`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    /// Beginning of sequence.
    pub bos: Option<SpecialToken>,
    /// End of sequence (generation stops on it).
    pub eos: Option<SpecialToken>,
    /// Unknown.
    pub unk: Option<SpecialToken>,
    /// Padding.
    pub pad: Option<SpecialToken>,
}

impl SpecialTokens {
    /// Reads the ids and looks their text up in `tokenizer.ggml.tokens`.
    pub fn from_gguf(g: &Gguf) -> Result<Self> {
        let tokens = g.get_str_array("tokenizer.ggml.tokens")?;
        let one = |key: &'static str| -> Result<Option<SpecialToken>> {
            let Some(id) = g.opt_u32(key)? else {
                return Ok(None);
            };
            let text = tokens
                .get(id as usize)
                .ok_or_else(|| TokenizerError::BadMetadata {
                    key,
                    reason: format!("id {id} is past the {} tokens", tokens.len()),
                })?;
            Ok(Some(SpecialToken {
                id,
                text: text.clone(),
            }))
        };
        Ok(SpecialTokens {
            bos: one("tokenizer.ggml.bos_token_id")?,
            eos: one("tokenizer.ggml.eos_token_id")?,
            unk: one("tokenizer.ggml.unknown_token_id")?,
            pad: one("tokenizer.ggml.padding_token_id")?,
        })
    }
}

/// The `tokenizers` crate's tokenizer type with its wrapper components.
type Inner = tokenizers::Tokenizer;

/// Incremental decoding for streaming: [`StreamDecoder::step`] takes one id and returns the text
/// it completes (none while a character's UTF-8 bytes are split across tokens).
pub struct StreamDecoder<'a> {
    inner: DecodeStream<
        'a,
        ModelWrapper,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    >,
}

impl StreamDecoder<'_> {
    /// Adds `id`; returns the new text, if any is complete.
    pub fn step(&mut self, id: u32) -> Result<Option<String>> {
        self.inner.step(id).map_err(tk)
    }
}

/// A byte-level BPE tokenizer read from a GGUF file, equal to transformers' for that file.
pub struct Tokenizer {
    inner: Inner,
    special: SpecialTokens,
    add_bos: bool,
    add_eos: bool,
    /// Special tokens are added by the tokenizer's own post-processor (a Hugging Face
    /// `tokenizer.json`), not by `add_bos` / `add_eos` (a GGUF file).
    post_processed: bool,
    /// A Hugging Face folder's chat template source.
    chat_template: Option<String>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("special", &self.special)
            .field("add_bos", &self.add_bos)
            .field("add_eos", &self.add_eos)
            .finish()
    }
}

impl Tokenizer {
    /// Builds the tokenizer from the file's `tokenizer.*` metadata.
    pub fn from_gguf(g: &Gguf) -> Result<Self> {
        let model = g.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(TokenizerError::UnsupportedModel(model.into()));
        }
        // transformers treats a file without `pre` as GPT-2's default, as llama.cpp does.
        let pre = g.opt_str("tokenizer.ggml.pre")?.unwrap_or("default");
        if !SUPPORTED_PRE_TOKENIZERS.contains(&pre) {
            return Err(TokenizerError::UnsupportedPre(pre.into()));
        }
        let tokens = g.get_str_array("tokenizer.ggml.tokens")?;
        let merges = g.get_str_array("tokenizer.ggml.merges")?;
        let types = match g.get("tokenizer.ggml.token_type") {
            Some(_) => Some(
                integers(g.get_array("tokenizer.ggml.token_type")?).ok_or_else(|| {
                    TokenizerError::BadMetadata {
                        key: "tokenizer.ggml.token_type",
                        reason: "is not an array of integers".into(),
                    }
                })?,
            ),
            None => None,
        };
        if let Some(t) = &types {
            if t.len() != tokens.len() {
                return Err(TokenizerError::BadMetadata {
                    key: "tokenizer.ggml.token_type",
                    reason: format!("{} types for {} tokens", t.len(), tokens.len()),
                });
            }
        }
        let n_tokens = u32::try_from(tokens.len()).map_err(|_| TokenizerError::BadMetadata {
            key: "tokenizer.ggml.tokens",
            reason: format!("{} tokens do not fit u32 ids", tokens.len()),
        })?;

        let alphabet = byte_alphabet();
        let in_alphabet = |t: &str| t.chars().all(in_byte_alphabet);
        let mut vocab = Vocab::default();
        vocab.reserve(tokens.len());
        for (id, t) in (0..n_tokens).zip(tokens) {
            let spelled = if in_alphabet(t) {
                t.clone()
            } else {
                t.bytes().map(|b| alphabet[b as usize]).collect()
            };
            // A later duplicate wins, as in transformers' dict comprehension.
            vocab.insert(spelled, id);
        }
        let mut pairs = Vec::with_capacity(merges.len());
        for m in merges {
            // transformers splits on every space; a merge is two tokens, neither holding one.
            let mut parts = m.split(' ');
            match (parts.next(), parts.next(), parts.next()) {
                (Some(a), Some(b), None) => pairs.push((a.to_string(), b.to_string())),
                _ => {
                    return Err(TokenizerError::BadMetadata {
                        key: "tokenizer.ggml.merges",
                        reason: format!("merge {m:?} is not two tokens separated by a space"),
                    })
                }
            }
        }
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, pairs)
            .continuing_subword_prefix(String::new())
            .end_of_word_suffix(String::new())
            .fuse_unk(false)
            .build()
            .map_err(tk)?;

        let mut inner = Inner::new(bpe);
        inner.with_pre_tokenizer(Some(
            ByteLevel::default().add_prefix_space(false).use_regex(true),
        ));
        inner.with_decoder(Some(ByteLevelDecoder::default()));

        if let Some(types) = &types {
            let of_type = |ty: i64| {
                tokens
                    .iter()
                    .zip(types)
                    .filter(move |&(_, &t)| t == ty)
                    .map(|(tok, _)| tok)
            };
            // A control token outside the byte alphabet is a converter mislabel that
            // transformers skips (it would grow the vocabulary past the model's).
            let control: Vec<AddedToken> = of_type(TOKEN_TYPE_CONTROL)
                .filter(|t| in_alphabet(t))
                .map(|t| AddedToken::from(t.clone(), true).normalized(false))
                .collect();
            inner.add_special_tokens(control).map_err(tk)?;
            let vocab = inner.get_vocab(false);
            let user: Vec<AddedToken> = of_type(TOKEN_TYPE_USER_DEFINED)
                .filter(|t| vocab.contains_key(t.as_str()))
                .map(|t| AddedToken::from(t.clone(), false).normalized(false))
                .collect();
            inner.add_tokens(user).map_err(tk)?;
        }

        Ok(Tokenizer {
            inner,
            special: SpecialTokens::from_gguf(g)?,
            add_bos: g.opt_bool("tokenizer.ggml.add_bos_token")?.unwrap_or(false),
            add_eos: g.opt_bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false),
            post_processed: false,
            chat_template: None,
        })
    }

    /// The tokenizer of a Hugging Face folder: `tokenizer.json` as the `tokenizers` library
    /// reads it (its post-processor adds what a prompt gets: BOS, or BERT's `[CLS]` and
    /// `[SEP]`, as transformers' fast tokenizers do), with the special tokens
    /// `tokenizer_config.json` names (`bos_token`, `eos_token`, `unk_token`, `pad_token`:
    /// strings, or objects with `content`) and its chat template (`chat_template`: a string, or
    /// the entry named `default` of a list; else the file `chat_template.jinja`, where
    /// transformers 5 writes it), as transformers' tokenizer holds them.
    pub fn from_hf_folder(dir: &std::path::Path) -> crate::Result<Self> {
        let path = dir.join("tokenizer.json");
        let inner = Inner::from_file(&path)
            .map_err(|e| crate::Error::Model(format!("{}: {e}", path.display())))?;
        let config_path = dir.join("tokenizer_config.json");
        // (A folder may have no tokenizer_config.json: no named special tokens.)
        let config = if config_path.exists() {
            json_object(&config_path)?
        } else {
            serde_json::Map::new()
        };
        let refused =
            |what: String| crate::Error::Model(format!("{}: {what}", config_path.display()));
        let special = |key: &str| -> crate::Result<Option<SpecialToken>> {
            let text = match config.get(key) {
                None | Some(serde_json::Value::Null) => return Ok(None),
                Some(serde_json::Value::String(s)) => s.clone(),
                Some(v) => match v.get("content").and_then(serde_json::Value::as_str) {
                    Some(s) => s.to_string(),
                    None => return Err(refused(format!("{key} = {v}: expected a token's text"))),
                },
            };
            let id = inner.token_to_id(&text).ok_or_else(|| {
                refused(format!("{key} = {text:?}: not a token of tokenizer.json"))
            })?;
            Ok(Some(SpecialToken { id, text }))
        };
        let special = SpecialTokens {
            bos: special("bos_token")?,
            eos: special("eos_token")?,
            unk: special("unk_token")?,
            pad: special("pad_token")?,
        };
        let chat_template = match config.get("chat_template") {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Array(named)) => named
                .iter()
                .find(|t| t.get("name").and_then(serde_json::Value::as_str) == Some("default"))
                .and_then(|t| t.get("template")?.as_str().map(str::to_string)),
            _ => std::fs::read_to_string(dir.join("chat_template.jinja")).ok(),
        };
        Ok(Tokenizer {
            inner,
            special,
            add_bos: false,
            add_eos: false,
            post_processed: true,
            chat_template,
        })
    }

    /// A Hugging Face folder's chat template source (`None` for a GGUF file, whose template
    /// the chat module reads from the file itself, or for a folder without one).
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Token ids of `text`. Special tokens written in the text (`<|im_start|>`) are recognised
    /// as transformers does. With `add_special_tokens`, BOS/EOS are added as the file's
    /// `add_bos_token`/`add_eos_token` say (a GGUF), or as the tokenizer's post-processor does
    /// (a Hugging Face folder).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        if self.post_processed {
            let encoding = self.inner.encode(text, add_special_tokens).map_err(tk)?;
            return Ok(encoding.get_ids().to_vec());
        }
        let encoding = self.inner.encode(text, false).map_err(tk)?;
        let mut ids = Vec::with_capacity(encoding.len() + 2);
        if add_special_tokens && self.add_bos {
            ids.extend(self.special.bos.as_ref().map(|t| t.id));
        }
        ids.extend_from_slice(encoding.get_ids());
        if add_special_tokens && self.add_eos {
            ids.extend(self.special.eos.as_ref().map(|t| t.id));
        }
        Ok(ids)
    }

    /// The text of `ids` (ids past the vocabulary are skipped, as `tokenizers` does).
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner.decode(ids, skip_special_tokens).map_err(tk)
    }

    /// An incremental decoder for streaming generated ids.
    pub fn stream_decoder(&self, skip_special_tokens: bool) -> StreamDecoder<'_> {
        StreamDecoder {
            inner: self.inner.decode_stream(skip_special_tokens),
        }
    }

    /// The number of ids (the vocabulary with the added tokens).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of a token spelled `token` (in the byte alphabet), if any.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The spelling of token `id` (in the byte alphabet), if any.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The special tokens the file names.
    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.special
    }

    /// Whether `id` is an end of generation (the EOS token).
    pub fn is_eos(&self, id: u32) -> bool {
        self.special.eos.as_ref().is_some_and(|t| t.id == id)
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// The integers of an integer array, widened.
fn integers(a: &MetaArray) -> Option<Vec<i64>> {
    Some(match a {
        MetaArray::I32(v) => v.iter().map(|&x| x.into()).collect(),
        MetaArray::U32(v) => v.iter().map(|&x| x.into()).collect(),
        MetaArray::I8(v) => v.iter().map(|&x| x.into()).collect(),
        MetaArray::U8(v) => v.iter().map(|&x| x.into()).collect(),
        MetaArray::I16(v) => v.iter().map(|&x| x.into()).collect(),
        MetaArray::U16(v) => v.iter().map(|&x| x.into()).collect(),
        MetaArray::I64(v) => v.clone(),
        _ => return None,
    })
}

/// Whether `b` is a byte GPT-2's alphabet spells as itself.
fn spells_itself(b: u32) -> bool {
    matches!(b, 0x21..=0x7e | 0xa1..=0xac | 0xae..=0xff)
}

/// Whether `c` is a letter of GPT-2's byte alphabet: a byte spelling itself, or one of the 68
/// code points from U+0100 that the other bytes take.
fn in_byte_alphabet(c: char) -> bool {
    let c = c as u32;
    spells_itself(c) || (0x100..0x100 + 68).contains(&c)
}

/// GPT-2's `bytes_to_unicode`: byte `b` is spelled `alphabet[b]`. Printable Latin-1 bytes spell
/// themselves; the others (controls, space, …) take the code points from U+0100 on, in order.
/// (The `tokenizers` crate has this table but keeps it private.)
pub(crate) fn byte_alphabet() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for (b, slot) in table.iter_mut().enumerate() {
        let code = if spells_itself(b as u32) {
            b as u32
        } else {
            next += 1;
            next - 1
        };
        *slot = char::from_u32(code).expect("below U+0200");
    }
    table
}
