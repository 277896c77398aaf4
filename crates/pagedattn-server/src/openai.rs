//! OpenAI's request bodies read field by field, so that every refusal names its field: the
//! completion and chat completion requests as the engine's requests, with what the response
//! needs (streaming, stop strings, choices).

use pagedattn_engine::models::chat::{ChatMessage, ChatTemplate};
use pagedattn_engine::models::tokenizer::Tokenizer;
use pagedattn_engine::serving::engine::EngineRequest;
use pagedattn_engine::serving::model::ModelKind;
use pagedattn_engine::serving::sample::SamplingParams;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{Map, Value};

use crate::error::ApiError;
use axum::http::StatusCode;

/// The most stop strings a request may give.
pub const MAX_STOP_STRINGS: usize = 16;

/// The most prompts one completion request may give.
pub const MAX_PROMPTS: usize = 64;

/// What the server knows of its model when it reads a request.
pub struct ModelInfo<'a> {
    /// The name requests must give as `model`.
    pub name: &'a str,
    /// The longest sequence (prompt and output) it serves.
    pub max_context: usize,
    /// Token ids below this are valid.
    pub vocab: usize,
    /// Its tokenizer and chat template, where it has them.
    pub text: Option<&'a (Tokenizer, ChatTemplate)>,
    /// The most choices (`n`) a request may ask for.
    pub max_n: usize,
    /// What it computes: which endpoints it answers.
    pub kind: ModelKind,
    /// An encoder-decoder model's decoder start token.
    pub decoder_start: Option<u32>,
}

impl ModelInfo<'_> {
    /// Refuses a request for `endpoint` (`completions`, `chat/completions`, `embeddings`)
    /// that this model's kind does not answer.
    fn answers(&self, endpoint: &str) -> Result<(), ApiError> {
        let (answered, kind) = match self.kind {
            ModelKind::Decoder => (endpoint != "embeddings", "a decoder"),
            ModelKind::EncoderDecoder => (endpoint == "completions", "an encoder-decoder model"),
            ModelKind::EncoderOnly => (endpoint == "embeddings", "an encoder-only model"),
        };
        if answered {
            return Ok(());
        }
        let serves = match self.kind {
            ModelKind::Decoder => "/v1/completions and /v1/chat/completions",
            ModelKind::EncoderDecoder => "/v1/completions",
            ModelKind::EncoderOnly => "/v1/embeddings",
        };
        Err(ApiError::invalid(
            "model",
            format!(
                "`{}` is {kind}: it serves {serves}, not /v1/{endpoint}",
                self.name
            ),
        ))
    }
}

/// A JSON object whose fields are taken one by one; what is left at the end was not known.
struct Body(Map<String, Value>);

impl Body {
    fn parse(bytes: &[u8]) -> Result<Self, ApiError> {
        match serde_json::from_slice::<Value>(bytes) {
            Ok(Value::Object(map)) => Ok(Body(map)),
            Ok(other) => Err(ApiError::status(
                StatusCode::BAD_REQUEST,
                format!(
                    "the request body is JSON {}, expected an object",
                    kind_of(&other)
                ),
            )),
            Err(e) => Err(ApiError::status(
                StatusCode::BAD_REQUEST,
                format!("the request body is not valid JSON: {e}"),
            )),
        }
    }

    /// Field `key` as a `T` (`None` where absent or null).
    fn take<T: DeserializeOwned>(
        &mut self,
        key: &str,
        expected: &str,
    ) -> Result<Option<T>, ApiError> {
        match self.0.remove(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => {
                let shown = short(&v);
                serde_json::from_value(v).map(Some).map_err(|_| {
                    ApiError::invalid(key, format!("{key} = {shown}: expected {expected}"))
                })
            }
        }
    }

    /// Field `key` as a `T` that `valid` accepts (`None` where absent or null); a value of
    /// another type or one refused is an error saying what is `expected`.
    fn take_valid<T: DeserializeOwned + std::fmt::Display>(
        &mut self,
        key: &str,
        expected: &str,
        valid: impl Fn(&T) -> bool,
    ) -> Result<Option<T>, ApiError> {
        match self.take::<T>(key, expected)? {
            Some(v) if !valid(&v) => Err(ApiError::invalid(
                key,
                format!("{key} = {v}: expected {expected}"),
            )),
            v => Ok(v),
        }
    }

    /// Field `key`, which must be absent, null or `default` (OpenAI parameters not
    /// supported here beyond their no-op value).
    fn only_default(
        &mut self,
        key: &str,
        is_default: impl Fn(&Value) -> bool,
    ) -> Result<(), ApiError> {
        match self.0.remove(key) {
            None | Some(Value::Null) => Ok(()),
            Some(v) if is_default(&v) => Ok(()),
            Some(v) => Err(ApiError::invalid(
                key,
                format!(
                    "{key} = {}: not supported by this server (leave it out)",
                    short(&v)
                ),
            )),
        }
    }

    /// Refuses the fields nobody took.
    fn finish(self) -> Result<(), ApiError> {
        match self.0.keys().next() {
            None => Ok(()),
            Some(key) => Err(ApiError::invalid(
                key.as_str(),
                format!("Unrecognized request argument supplied: {key}"),
            )),
        }
    }
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A value as an error message shows it: its JSON, cut at 80 characters.
fn short(v: &Value) -> String {
    let text = v.to_string();
    match text.char_indices().nth(80) {
        Some((at, _)) => format!("{}...", &text[..at]),
        None => text,
    }
}

/// What a request asks for, read and checked: the engine's requests (one per prompt) and
/// how to answer.
#[derive(Debug)]
pub struct Generation {
    /// One engine request per prompt, with its prompt's ids.
    pub requests: Vec<EngineRequest>,
    /// Choices per prompt.
    pub n: usize,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Stream the answer as server-sent events.
    pub stream: bool,
    /// Send usage in a last chunk of the stream.
    pub include_usage: bool,
    /// Give each choice's token ids (vLLM's `return_token_ids`).
    pub return_token_ids: bool,
}

impl Generation {
    /// Encoder-only requests, answered with their pooled outputs.
    pub fn pooled(requests: Vec<EngineRequest>) -> Self {
        Generation {
            requests,
            n: 1,
            stop: Vec::new(),
            stream: false,
            include_usage: false,
            return_token_ids: false,
        }
    }
}

/// The sampling fields both endpoints share, and the stop conditions.
struct Common {
    sampling: SamplingParams,
    n: usize,
    stop: Vec<String>,
    stream: bool,
    include_usage: bool,
    ignore_eos: bool,
    min_tokens: usize,
    stop_token_ids: Vec<u32>,
    return_token_ids: bool,
}

fn check_model(body: &mut Body, model: &ModelInfo<'_>) -> Result<(), ApiError> {
    let name: String = body.take("model", "a string")?.ok_or_else(|| {
        ApiError::invalid(
            "model",
            "model is missing: expected the model's name (GET /v1/models)",
        )
    })?;
    if name != model.name {
        let mut e = ApiError::status(
            StatusCode::NOT_FOUND,
            format!(
                "The model `{name}` does not exist (this server serves `{}`).",
                model.name
            ),
        )
        .with_code("model_not_found");
        e.param = Some("model".into());
        return Err(e);
    }
    Ok(())
}

/// Reads the fields both endpoints have.
fn common(body: &mut Body, model: &ModelInfo<'_>) -> Result<Common, ApiError> {
    let temperature: f64 = body
        .take_valid("temperature", "a number in [0, 2]", |t| {
            (0.0..=2.0).contains(t)
        })?
        .unwrap_or(1.0);
    // (As the sampler computes it: 1e-300 is 0 as an f32.)
    let top_p: f64 = body
        .take_valid("top_p", "a number in (0, 1]", |&p: &f64| {
            p > 0.0 && p <= 1.0 && (p as f32) > 0.0
        })?
        .unwrap_or(1.0);
    let top_k: i64 = body
        .take_valid(
            "top_k",
            "an integer: -1 or 0 (all tokens), or at least 1",
            |&k| k >= -1,
        )?
        .unwrap_or(0);
    let n: i64 = body
        .take_valid(
            "n",
            &format!("an integer in [1, {}]", model.max_n),
            |&n: &i64| n >= 1 && n as u64 <= model.max_n as u64,
        )?
        .unwrap_or(1);
    // (Seeds are 64-bit integers either way; a negative one keeps its bits.)
    let seed = match body.take::<i64>("seed", "an integer")? {
        Some(s) => s as u64,
        None => random_seed(),
    };
    let stop: Vec<String> = match body.take::<Value>("stop", "a string or an array of strings")? {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s],
        Some(v @ Value::Array(_)) => serde_json::from_value(v.clone()).map_err(|_| {
            ApiError::invalid(
                "stop",
                format!(
                    "stop = {}: expected a string or an array of strings",
                    short(&v)
                ),
            )
        })?,
        Some(v) => {
            return Err(ApiError::invalid(
                "stop",
                format!(
                    "stop = {}: expected a string or an array of strings",
                    short(&v)
                ),
            ))
        }
    };
    if stop.len() > MAX_STOP_STRINGS || stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid(
            "stop",
            format!(
                "stop: {} strings: expected at most {MAX_STOP_STRINGS}, none empty",
                stop.len()
            ),
        ));
    }
    if !stop.is_empty() && model.text.is_none() {
        return Err(ApiError::invalid(
            "stop",
            "stop strings need a tokenizer, which this model has not (use stop_token_ids)",
        ));
    }
    let stream: bool = body.take("stream", "a boolean")?.unwrap_or(false);
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct StreamOptions {
        include_usage: Option<bool>,
        // vLLM's: accepted (so that its clients' requests are not refused), not used.
        #[allow(dead_code)]
        continuous_usage_stats: Option<bool>,
    }
    let options: Option<StreamOptions> =
        body.take("stream_options", "an object {\"include_usage\": boolean}")?;
    if options.is_some() && !stream {
        return Err(ApiError::invalid(
            "stream_options",
            "stream_options: only allowed when stream is true",
        ));
    }
    let include_usage = options.and_then(|o| o.include_usage).unwrap_or(false);
    let ignore_eos: bool = body.take("ignore_eos", "a boolean")?.unwrap_or(false);
    let min_tokens: i64 = body
        .take_valid("min_tokens", "an integer of at least 0", |&m| m >= 0)?
        .unwrap_or(0);
    let stop_token_ids: Vec<u32> = body
        .take("stop_token_ids", "an array of token ids")?
        .unwrap_or_default();
    if let Some(t) = stop_token_ids.iter().find(|&&t| t as usize >= model.vocab) {
        return Err(ApiError::invalid(
            "stop_token_ids",
            format!(
                "stop_token_ids holds {t}: expected ids below the vocabulary's {}",
                model.vocab
            ),
        ));
    }
    let return_token_ids: bool = body.take("return_token_ids", "a boolean")?.unwrap_or(false);
    // OpenAI's parameters that this server does not implement, at their no-op values.
    let zero = |v: &Value| v.as_f64() == Some(0.0);
    body.only_default("presence_penalty", zero)?;
    body.only_default("frequency_penalty", zero)?;
    body.only_default("repetition_penalty", |v| v.as_f64() == Some(1.0))?;
    body.only_default("logit_bias", |v| v.as_object().is_some_and(Map::is_empty))?;
    body.take::<String>("user", "a string")?;
    Ok(Common {
        sampling: SamplingParams {
            temperature: temperature as f32,
            top_p: top_p as f32,
            top_k: top_k.max(0) as usize,
            seed,
        },
        n: n as usize,
        stop,
        stream,
        include_usage,
        ignore_eos,
        min_tokens: min_tokens as usize,
        stop_token_ids,
        return_token_ids,
    })
}

/// A seed for a request that gives none: different per request (as OpenAI's and vLLM's).
fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}

/// `max_tokens` (or chat's `max_completion_tokens`) checked: at least 1 when given.
fn max_tokens(body: &mut Body, keys: &[&str]) -> Result<Option<usize>, ApiError> {
    let mut value = None;
    for key in keys {
        if let Some(v) = body.take_valid::<i64>(key, "an integer of at least 1", |&v| v >= 1)? {
            value = Some(v as usize);
        }
    }
    Ok(value)
}

/// Refuses field `param`'s tokens where there are none or one is past the vocabulary.
fn check_tokens(tokens: &[u32], model: &ModelInfo<'_>, param: &str) -> Result<(), ApiError> {
    if tokens.is_empty() {
        return Err(ApiError::invalid(
            param,
            format!("{param}: no tokens: expected at least one"),
        ));
    }
    if let Some(t) = tokens.iter().find(|&&t| t as usize >= model.vocab) {
        return Err(ApiError::invalid(
            param,
            format!(
                "{param} holds token {t}: expected ids below the vocabulary's {}",
                model.vocab
            ),
        ));
    }
    Ok(())
}

/// The engine request of one prompt.
fn engine_request(
    prompt: Vec<u32>,
    max_new_tokens: usize,
    c: &Common,
    model: &ModelInfo<'_>,
    param: &str,
) -> Result<EngineRequest, ApiError> {
    check_tokens(&prompt, model, param)?;
    // An encoder-decoder model encodes the prompt and generates from its decoder start.
    let (prompt, encoder_prompt) = match (model.kind, model.decoder_start) {
        (ModelKind::EncoderDecoder, Some(start)) => {
            if prompt.len() > model.max_context {
                return Err(ApiError::invalid(
                    param,
                    format!(
                        "{param}: {} tokens: this model encodes at most {}",
                        prompt.len(),
                        model.max_context
                    ),
                ));
            }
            (vec![start], Some(prompt))
        }
        (ModelKind::EncoderDecoder, None) => {
            return Err(ApiError::invalid(
                "model",
                "this encoder-decoder model names no decoder start token",
            ))
        }
        _ => (prompt, None),
    };
    // Checked here to name the fields; the engine checks it again.
    if prompt.len().saturating_add(max_new_tokens) > model.max_context {
        return Err(ApiError::invalid(
            "max_tokens",
            format!(
                "This model's maximum context length is {} tokens. However, you requested {} tokens ({} in the {param}, {max_new_tokens} in the completion). Please reduce the length of the {param} or completion.",
                model.max_context,
                prompt.len().saturating_add(max_new_tokens),
                prompt.len()
            ),
        ));
    }
    if c.min_tokens > max_new_tokens {
        return Err(ApiError::invalid(
            "min_tokens",
            format!(
                "min_tokens = {}: expected at most max_tokens ({max_new_tokens})",
                c.min_tokens
            ),
        ));
    }
    Ok(EngineRequest {
        arrival: 0.0,
        prompt,
        encoder_prompt,
        max_new_tokens,
        n: c.n,
        sampling: c.sampling,
        ignore_eos: c.ignore_eos,
        stop_token_ids: c.stop_token_ids.clone(),
        min_tokens: c.min_tokens,
    })
}

fn generation(requests: Vec<EngineRequest>, c: Common) -> Generation {
    Generation {
        requests,
        n: c.n,
        stop: c.stop,
        stream: c.stream,
        include_usage: c.include_usage,
        return_token_ids: c.return_token_ids,
    }
}

/// Field `param` (`prompt`, `input`): a string, an array of token ids, or an array of either,
/// as token ids (text through the tokenizer, its special tokens added as vLLM does), at
/// most [`MAX_PROMPTS`] of them.
fn token_prompts(
    body: &mut Body,
    param: &str,
    model: &ModelInfo<'_>,
) -> Result<Vec<Vec<u32>>, ApiError> {
    let expected = "a string, an array of token ids, or an array of either";
    let prompt: Value = body
        .take(param, expected)?
        .ok_or_else(|| ApiError::invalid(param, format!("{param} is missing")))?;
    let shown = short(&prompt);
    let bad = || ApiError::invalid(param, format!("{param} = {shown}: expected {expected}"));
    let texts_or_ids: Vec<Value> = match prompt {
        Value::String(_) => vec![prompt],
        Value::Array(items) if !items.is_empty() && items.iter().all(Value::is_number) => {
            vec![Value::Array(items)]
        }
        Value::Array(items) if !items.is_empty() => items,
        _ => return Err(bad()),
    };
    if texts_or_ids.len() > MAX_PROMPTS {
        return Err(ApiError::invalid(
            param,
            format!(
                "{param}: {} prompts: expected at most {MAX_PROMPTS}",
                texts_or_ids.len()
            ),
        ));
    }
    let mut prompts = Vec::with_capacity(texts_or_ids.len());
    for p in texts_or_ids {
        prompts.push(match p {
            Value::String(text) => match model.text {
                Some((tokenizer, _)) => tokenizer
                    .encode(&text, true)
                    .map_err(|e| ApiError::invalid(param, format!("{param}: {e}")))?,
                None => {
                    return Err(ApiError::invalid(
                        param,
                        format!("this model has no tokenizer: give the {param} as token ids"),
                    ))
                }
            },
            Value::Array(ids) => ids
                .into_iter()
                .map(|v| v.as_u64().and_then(|t| u32::try_from(t).ok()))
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(bad)?,
            _ => return Err(bad()),
        });
    }
    Ok(prompts)
}

/// `POST /v1/completions`: `prompt` is a string, an array of token ids, or an array of either
/// (one engine request each).
pub fn completion(bytes: &[u8], model: &ModelInfo<'_>) -> Result<Generation, ApiError> {
    let mut body = Body::parse(bytes)?;
    check_model(&mut body, model)?;
    model.answers("completions")?;
    let prompts = token_prompts(&mut body, "prompt", model)?;
    let max_new_tokens = max_tokens(&mut body, &["max_tokens"])?.unwrap_or(16);
    let c = common(&mut body, model)?;
    body.only_default("echo", |v| v == &Value::Bool(false))?;
    body.only_default("logprobs", |v| {
        v == &Value::Bool(false) || v.as_u64() == Some(0)
    })?;
    body.only_default("suffix", |v| v.as_str() == Some(""))?;
    let n = c.n;
    body.only_default("best_of", |v| v.as_u64() == Some(n as u64))?;
    body.finish()?;
    let requests = prompts
        .into_iter()
        .map(|p| engine_request(p, max_new_tokens, &c, model, "prompt"))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(generation(requests, c))
}

/// One chat message as OpenAI's clients send it: `content` a string or text parts.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Message {
    role: String,
    content: Option<Content>,
    // A participant's name: accepted, not given to the template (transformers' templates
    // read role and content).
    #[allow(dead_code)]
    name: Option<String>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Part {
    r#type: String,
    text: Option<String>,
}

/// `POST /v1/chat/completions`: the messages through the model's chat template.
pub fn chat_completion(bytes: &[u8], model: &ModelInfo<'_>) -> Result<Generation, ApiError> {
    let mut body = Body::parse(bytes)?;
    check_model(&mut body, model)?;
    model.answers("chat/completions")?;
    let messages: Vec<Value> = body
        .take("messages", "an array of messages")?
        .ok_or_else(|| ApiError::invalid("messages", "messages is missing"))?;
    if messages.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "messages = []: expected at least one message",
        ));
    }
    let mut turns = Vec::with_capacity(messages.len());
    for (i, m) in messages.into_iter().enumerate() {
        let param = format!("messages[{i}]");
        let shown = short(&m);
        let m: Message = serde_json::from_value(m).map_err(|e| {
            ApiError::invalid(param.clone(), format!("{param} = {shown}: expected {{\"role\": string, \"content\": string or text parts}} ({e})"))
        })?;
        let content = match m.content {
            None => String::new(),
            Some(Content::Text(t)) => t,
            Some(Content::Parts(parts)) => {
                let mut text = String::new();
                for p in parts {
                    match (p.r#type.as_str(), p.text) {
                        ("text", Some(t)) => text.push_str(&t),
                        (kind, _) => {
                            return Err(ApiError::invalid(param.clone(), format!("{param}: a content part of type `{kind}`: only text parts (with `text`) are supported")))
                        }
                    }
                }
                text
            }
        };
        turns.push(ChatMessage::new(m.role, content));
    }
    let max_new_tokens = max_tokens(&mut body, &["max_tokens", "max_completion_tokens"])?;
    let c = common(&mut body, model)?;
    body.only_default("logprobs", |v| v == &Value::Bool(false))?;
    body.only_default("top_logprobs", |v| v.as_u64() == Some(0))?;
    body.only_default("tools", |v| v.as_array().is_some_and(Vec::is_empty))?;
    body.only_default("tool_choice", |v| v.as_str() == Some("none"))?;
    body.only_default("response_format", |v| {
        v.get("type").and_then(Value::as_str) == Some("text")
    })?;
    body.only_default("parallel_tool_calls", |_| true)?;
    body.finish()?;
    let Some((tokenizer, template)) = model.text else {
        return Err(ApiError::invalid(
            "messages",
            "this model has no chat template: use /v1/completions with token ids",
        ));
    };
    let rendered = template.render(&turns, true).map_err(|e| {
        ApiError::invalid(
            "messages",
            format!("messages: the model's chat template refused them: {e}"),
        )
    })?;
    // The rendered template holds its special tokens already.
    let prompt = tokenizer
        .encode(&rendered, false)
        .map_err(|e| ApiError::invalid("messages", format!("messages: {e}")))?;
    let max_new_tokens =
        max_new_tokens.unwrap_or_else(|| model.max_context.saturating_sub(prompt.len()).max(1));
    let request = engine_request(prompt, max_new_tokens, &c, model, "messages")?;
    Ok(generation(vec![request], c))
}

/// How an embeddings response writes each vector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EncodingFormat {
    /// A JSON array of numbers.
    Float,
    /// The little-endian f32 bytes in base64 (what OpenAI's Python client asks for by
    /// default, and decodes).
    Base64,
}

/// What an embeddings request asks for: one engine request per input, and the format.
#[derive(Debug)]
pub struct Embeddings {
    /// One encoder-only request per input.
    pub requests: Vec<EngineRequest>,
    /// How to write the vectors.
    pub format: EncodingFormat,
}

/// `POST /v1/embeddings`: `input` as a completion's `prompt` (a string, token ids, or an
/// array of either), each input's pooled output (BERT's `pooler_output`, or its first
/// token's final state).
pub fn embeddings(bytes: &[u8], model: &ModelInfo<'_>) -> Result<Embeddings, ApiError> {
    let mut body = Body::parse(bytes)?;
    check_model(&mut body, model)?;
    model.answers("embeddings")?;
    let inputs = token_prompts(&mut body, "input", model)?;
    let format = match body.take::<String>("encoding_format", "\"float\" or \"base64\"")? {
        None => EncodingFormat::Float,
        Some(f) if f == "float" => EncodingFormat::Float,
        Some(f) if f == "base64" => EncodingFormat::Base64,
        Some(f) => {
            return Err(ApiError::invalid(
                "encoding_format",
                format!("encoding_format = {f:?}: expected \"float\" or \"base64\""),
            ))
        }
    };
    // Vectors of the model's own width only.
    body.only_default("dimensions", |_| false)?;
    body.take::<String>("user", "a string")?;
    body.finish()?;
    let requests = inputs
        .into_iter()
        .map(|input| {
            check_tokens(&input, model, "input")?;
            if input.len() > model.max_context {
                return Err(ApiError::invalid(
                    "input",
                    format!(
                        "This model's maximum context length is {} tokens. However, you requested {} tokens in the input. Please reduce the length of the input.",
                        model.max_context,
                        input.len()
                    ),
                ));
            }
            Ok(EngineRequest::greedy(input, 0))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Embeddings { requests, format })
}
