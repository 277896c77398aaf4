//! What the engine is asked to serve: requests from the command line, from a JSONL trace, or
//! from a built-in workload (`chat`, `long-context`, `shared-prefix`, and for the synthetic
//! encoder models `encoder` and `encoder-decoder`).

use std::fmt;
use std::str::FromStr;

use thiserror::Error;

use crate::rng::SplitMix64;
use crate::serving::model::ModelKind;
use crate::serving::sample::SamplingParams;

/// A request's prompt, before tokenization.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    /// Text, tokenized as is.
    Text(String),
    /// One user turn, through the model's chat template (with the generation prompt).
    Chat(String),
    /// Token ids, used as they are.
    Tokens(Vec<u32>),
}

/// One request of a workload.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestInput {
    /// Seconds after the run's start at which the request arrives.
    pub arrival: f64,
    /// Its prompt (the decoder's, for an encoder-decoder model; the tokens to encode, for an
    /// encoder-only one).
    pub prompt: Prompt,
    /// The encoder's prompt of an encoder-decoder request (its decoder prompt may then be
    /// empty tokens: the model's decoder start token, which the caller supplies).
    pub encoder_prompt: Option<Prompt>,
    /// The most tokens to generate per sample (fewer when a stop token comes first; 0 for an
    /// encoder-only request).
    pub max_new_tokens: usize,
    /// Samples generated from the prompt (parallel sampling: they share the prompt's blocks).
    pub n: usize,
    /// How tokens are drawn (sample `i` of a request uses the random stream of its `seed +
    /// i`).
    pub sampling: SamplingParams,
    /// Generate `max_new_tokens` even past the model's stop tokens (benchmarks of fixed
    /// lengths; vLLM's `ignore_eos`).
    pub ignore_eos: bool,
}

/// A trace line or command-line value the engine cannot use.
#[derive(Debug, Error, PartialEq)]
pub enum WorkloadError {
    /// A line of a JSONL trace is not a JSON object.
    #[error("trace line {line}: not a JSON object ({reason})")]
    NotAnObject {
        /// 1-based line number.
        line: usize,
        /// What the JSON parser said, or what the line holds instead.
        reason: String,
    },
    /// A field of a trace line has a value the engine cannot use.
    #[error("trace line {line}: field `{field}` is {got}, expected {expected}")]
    BadField {
        /// 1-based line number.
        line: usize,
        /// The field.
        field: &'static str,
        /// What the line holds.
        got: String,
        /// What the field takes.
        expected: &'static str,
    },
    /// A field the trace line does not know (a typo would otherwise be ignored).
    #[error("trace line {line}: unknown field `{field}` (known: {known})")]
    UnknownField {
        /// 1-based line number.
        line: usize,
        /// The field.
        field: String,
        /// The fields a line may have.
        known: &'static str,
    },
    /// A trace line longer than [`MAX_TRACE_LINE_BYTES`].
    #[error("trace line {line}: {bytes} bytes, expected at most {MAX_TRACE_LINE_BYTES} (a prompt of a model's whole context is far less)")]
    LineTooLong {
        /// 1-based line number.
        line: usize,
        /// Its length.
        bytes: usize,
    },
    /// A trace with no request.
    #[error("the trace holds no request")]
    Empty,
    /// A built-in workload's name that does not exist.
    #[error("unknown workload `{0}` (expected one of: chat, long-context, shared-prefix, encoder, encoder-decoder)")]
    UnknownWorkload(String),
}

/// The longest trace line: 4 MiB, room for a prompt far past any model's context, as text or
/// ids. Longer ones are refused before parsing, since tokenizing text grows it about 50-fold
/// in memory (a 105 MB prompt once reached 5.5 GB and aborted).
pub const MAX_TRACE_LINE_BYTES: usize = 4 << 20;

/// The fields a trace line may have.
const TRACE_FIELDS: &str = "arrival, prompt, chat, tokens, encoder_prompt, encoder_tokens, \
     max_new_tokens, n, temperature, top_p, top_k, seed, ignore_eos";

/// Parses a JSONL trace: one request per non-empty line, a JSON object with `arrival`
/// (seconds, default 0), exactly one of `prompt` (text), `chat` (a user turn) or `tokens`
/// (token ids), for an encoder-decoder model at most one of `encoder_prompt` (text) or
/// `encoder_tokens` (ids) beside it (the decoder's prompt may then be left out: the model's
/// decoder start token), and optionally `max_new_tokens` (default 128), `n` (default 1),
/// `temperature` (default 0: greedy), `top_p` (default 1), `top_k` (default 0: every token)
/// `seed` (default: the line number) and `ignore_eos` (default false).
pub fn parse_trace(text: &str) -> Result<Vec<RequestInput>, WorkloadError> {
    let mut requests = Vec::new();
    for (index, raw) in text.lines().enumerate() {
        let line = index + 1;
        if raw.trim().is_empty() {
            continue;
        }
        if raw.len() > MAX_TRACE_LINE_BYTES {
            return Err(WorkloadError::LineTooLong {
                line,
                bytes: raw.len(),
            });
        }
        let value: serde_json::Value =
            serde_json::from_str(raw).map_err(|e| WorkloadError::NotAnObject {
                line,
                reason: e.to_string(),
            })?;
        let serde_json::Value::Object(fields) = value else {
            return Err(WorkloadError::NotAnObject {
                line,
                reason: format!("the line holds {}", json_kind(&value)),
            });
        };
        requests.push(parse_trace_line(line, &fields)?);
    }
    if requests.is_empty() {
        return Err(WorkloadError::Empty);
    }
    Ok(requests)
}

/// One trace line's request.
fn parse_trace_line(
    line: usize,
    fields: &serde_json::Map<String, serde_json::Value>,
) -> Result<RequestInput, WorkloadError> {
    if let Some(unknown) = fields
        .keys()
        .find(|k| !TRACE_FIELDS.split(", ").any(|f| f == k.as_str()))
    {
        return Err(WorkloadError::UnknownField {
            line,
            field: unknown.clone(),
            known: TRACE_FIELDS,
        });
    }
    let bad = |field: &'static str, got: &serde_json::Value, expected: &'static str| {
        WorkloadError::BadField {
            line,
            field,
            got: shorten(got),
            expected,
        }
    };
    let number =
        |field: &'static str, expected: &'static str| -> Result<Option<f64>, WorkloadError> {
            match fields.get(field) {
                None => Ok(None),
                Some(v) => v.as_f64().map(Some).ok_or_else(|| bad(field, v, expected)),
            }
        };
    let count = |field: &'static str,
                 min: u64,
                 expected: &'static str|
     -> Result<Option<u64>, WorkloadError> {
        match fields.get(field) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) if n >= min => Ok(Some(n)),
                _ => Err(bad(field, v, expected)),
            },
        }
    };
    let arrival = number("arrival", "a number of seconds >= 0")?.unwrap_or(0.0);
    if !(arrival >= 0.0 && arrival.is_finite()) {
        return Err(bad(
            "arrival",
            &fields["arrival"],
            "a number of seconds >= 0",
        ));
    }
    let token_ids = |field: &'static str| -> Result<Vec<u32>, WorkloadError> {
        let v = &fields[field];
        v.as_array()
            .filter(|a| !a.is_empty())
            .and_then(|a| {
                a.iter()
                    .map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()))
                    .collect::<Option<Vec<u32>>>()
            })
            .ok_or_else(|| bad(field, v, "a non-empty array of token ids (u32)"))
    };
    let encoder_prompt = match (fields.get("encoder_prompt"), fields.get("encoder_tokens")) {
        (None, None) => None,
        (Some(serde_json::Value::String(s)), None) => Some(Prompt::Text(s.clone())),
        (Some(v), None) => return Err(bad("encoder_prompt", v, "a string")),
        (None, Some(_)) => Some(Prompt::Tokens(token_ids("encoder_tokens")?)),
        (Some(_), Some(_)) => {
            return Err(WorkloadError::BadField {
                line,
                field: "encoder_prompt",
                got: "given with encoder_tokens".into(),
                expected: "at most one of `encoder_prompt` or `encoder_tokens`",
            })
        }
    };
    let prompts: Vec<&str> = ["prompt", "chat", "tokens"]
        .into_iter()
        .filter(|f| fields.contains_key(*f))
        .collect();
    let prompt = match prompts.as_slice() {
        ["prompt"] => match &fields["prompt"] {
            serde_json::Value::String(s) => Prompt::Text(s.clone()),
            v => return Err(bad("prompt", v, "a string")),
        },
        ["chat"] => match &fields["chat"] {
            serde_json::Value::String(s) => Prompt::Chat(s.clone()),
            v => return Err(bad("chat", v, "a string")),
        },
        ["tokens"] => Prompt::Tokens(token_ids("tokens")?),
        [] if encoder_prompt.is_some() => Prompt::Tokens(Vec::new()),
        [] => {
            return Err(WorkloadError::BadField {
                line,
                field: "prompt",
                got: "missing".into(),
                expected: "one of `prompt`, `chat` or `tokens`",
            })
        }
        _ => {
            return Err(WorkloadError::BadField {
                line,
                field: "prompt",
                got: format!("given as {}", prompts.join(" and ")),
                expected: "exactly one of `prompt`, `chat` or `tokens`",
            })
        }
    };
    let max_new_tokens = count("max_new_tokens", 1, "an integer >= 1")?.unwrap_or(128);
    let n = count("n", 1, "an integer >= 1")?.unwrap_or(1);
    let temperature = number("temperature", "a number >= 0")?.unwrap_or(0.0);
    if !(temperature >= 0.0 && temperature.is_finite()) {
        return Err(bad("temperature", &fields["temperature"], "a number >= 0"));
    }
    let top_p = number("top_p", "a number in (0, 1]")?.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(bad("top_p", &fields["top_p"], "a number in (0, 1]"));
    }
    let top_k = count("top_k", 0, "an integer >= 0")?.unwrap_or(0);
    let ignore_eos = match fields.get("ignore_eos") {
        None => false,
        Some(serde_json::Value::Bool(b)) => *b,
        Some(v) => return Err(bad("ignore_eos", v, "true or false")),
    };
    let seed = count("seed", 0, "an integer >= 0")?.unwrap_or(line as u64);
    Ok(RequestInput {
        arrival,
        prompt,
        encoder_prompt,
        max_new_tokens: to_usize(max_new_tokens),
        n: to_usize(n),
        sampling: SamplingParams {
            temperature: temperature as f32,
            top_p: top_p as f32,
            top_k: to_usize(top_k),
            seed,
        },
        ignore_eos,
    })
}

/// `n` as a `usize`, saturated (a count beyond the address space is refused later, by the
/// scheduler, as one that cannot fit).
fn to_usize(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

/// What a JSON value is, for an error message.
fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// A JSON value as an error message quotes it: at most 40 characters.
fn shorten(v: &serde_json::Value) -> String {
    let text = v.to_string();
    match text.char_indices().nth(40) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text,
    }
}

/// A built-in workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Builtin {
    /// A chat service: prompt and output lengths drawn from a ShareGPT-like mix (a few tens
    /// to about a thousand tokens, long-tailed), arrivals as a Poisson process or all at once.
    Chat,
    /// A few requests with long prompts (a tenth of the context each, up to 8192 tokens) and
    /// short outputs.
    LongContext,
    /// One long system prompt shared by every request (the prefix cache's case), each with
    /// its own question and parallel sampling (n = 2).
    SharedPrefix,
    /// Encoder-only requests (an encoder-only model: embeddings, classification): token
    /// sequences of varied lengths (8 to 512, log-normal around 64), each encoded in one pass;
    /// nothing generated.
    Encoder,
    /// Encoder-decoder requests (translation, summarization, speech): an encoder prompt of
    /// 32 to 512 tokens, a short decoder prompt (1 to 4 tokens, a start token's role) and
    /// outputs of tens of tokens (8 to 64).
    EncoderDecoder,
}

impl Builtin {
    /// Every built-in workload.
    pub const ALL: [Builtin; 5] = [
        Builtin::Chat,
        Builtin::LongContext,
        Builtin::SharedPrefix,
        Builtin::Encoder,
        Builtin::EncoderDecoder,
    ];

    /// The kind of model that serves it.
    pub fn model_kind(self) -> ModelKind {
        match self {
            Builtin::Encoder => ModelKind::EncoderOnly,
            Builtin::EncoderDecoder => ModelKind::EncoderDecoder,
            _ => ModelKind::Decoder,
        }
    }
}

impl FromStr for Builtin {
    type Err = WorkloadError;
    fn from_str(s: &str) -> Result<Self, WorkloadError> {
        match s {
            "chat" => Ok(Builtin::Chat),
            "long-context" => Ok(Builtin::LongContext),
            "shared-prefix" => Ok(Builtin::SharedPrefix),
            "encoder" => Ok(Builtin::Encoder),
            "encoder-decoder" => Ok(Builtin::EncoderDecoder),
            _ => Err(WorkloadError::UnknownWorkload(s.into())),
        }
    }
}

impl fmt::Display for Builtin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Builtin::Chat => "chat",
            Builtin::LongContext => "long-context",
            Builtin::SharedPrefix => "shared-prefix",
            Builtin::Encoder => "encoder",
            Builtin::EncoderDecoder => "encoder-decoder",
        })
    }
}

/// How a built-in workload is drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BuiltinParams {
    /// Requests to draw.
    pub requests: usize,
    /// Requests per second of a Poisson process; `None`: all arrive at once.
    pub rate: Option<f64>,
    /// Token ids are drawn from `first_token..vocab` (ids below are the model's special
    /// tokens).
    pub first_token: u32,
    /// The model's vocabulary size.
    pub vocab: u32,
    /// The model's context length: no request's prompt plus output passes it.
    pub max_context: usize,
    /// The most new tokens of any request (outputs drawn longer are cut to it).
    pub max_new_tokens: usize,
    /// Whether every request generates all its tokens, past stop tokens.
    pub ignore_eos: bool,
    /// Sampling of every request (its seed is offset by the request's index).
    pub sampling: SamplingParams,
    /// The seed of the draw.
    pub seed: u64,
}

impl Builtin {
    /// Draws the workload's requests (prompts as token ids).
    pub fn requests(self, p: &BuiltinParams) -> Vec<RequestInput> {
        let mut rng = SplitMix64::new(p.seed ^ 0x005E_ED0F_10AD);
        let mut clock = 0.0;
        let shared: Vec<u32> = match self {
            Builtin::SharedPrefix => tokens(&mut rng, p, (p.max_context / 4).clamp(16, 1024)),
            _ => Vec::new(),
        };
        (0..p.requests)
            .map(|i| {
                let arrival = match p.rate {
                    Some(rate) => {
                        // Exponential inter-arrival times: a Poisson process of `rate`.
                        clock += -(1.0 - rng.next_f64()).ln() / rate;
                        clock
                    }
                    None => 0.0,
                };
                let mut encoder_prompt = None;
                let (prompt, max_new, n) = match self {
                    Builtin::Chat => {
                        // Log-normal lengths: ShareGPT's prompts have a median near 100 tokens
                        // and a long tail, its answers a median near 200.
                        let prompt = lognormal(&mut rng, 100.0, 1.0, 4, 1024);
                        let out = lognormal(&mut rng, 200.0, 0.8, 4, 1024);
                        (tokens(&mut rng, p, prompt), out, 1)
                    }
                    Builtin::LongContext => {
                        let len = (p.max_context / 10).clamp(64, 8192);
                        (tokens(&mut rng, p, len), 32, 1)
                    }
                    Builtin::SharedPrefix => {
                        let question = lognormal(&mut rng, 24.0, 0.5, 4, 128);
                        let mut prompt = shared.clone();
                        prompt.extend(tokens(&mut rng, p, question));
                        (prompt, 64, 2)
                    }
                    Builtin::Encoder => {
                        let len = lognormal(&mut rng, 64.0, 1.0, 8, 512);
                        (tokens(&mut rng, p, len), 0, 1)
                    }
                    Builtin::EncoderDecoder => {
                        let encoder = lognormal(&mut rng, 128.0, 0.7, 32, 512);
                        encoder_prompt = Some(Prompt::Tokens(tokens(&mut rng, p, encoder)));
                        let decoder = 1 + (rng.next_u64() % 4) as usize;
                        let out = lognormal(&mut rng, 24.0, 0.6, 8, 64);
                        (tokens(&mut rng, p, decoder), out, 1)
                    }
                };
                let room = p.max_context.saturating_sub(prompt.len()).max(1);
                RequestInput {
                    arrival,
                    prompt: Prompt::Tokens(prompt),
                    encoder_prompt,
                    max_new_tokens: max_new.min(p.max_new_tokens).min(room),
                    n,
                    sampling: SamplingParams {
                        seed: p.sampling.seed.wrapping_add(1000 * i as u64),
                        ..p.sampling
                    },
                    ignore_eos: p.ignore_eos,
                }
            })
            .collect()
    }
}

/// `len` random token ids (at most `p.max_context - 1`, so that one token can follow).
fn tokens(rng: &mut SplitMix64, p: &BuiltinParams, len: usize) -> Vec<u32> {
    let span = u64::from(p.vocab.saturating_sub(p.first_token).max(1));
    (0..len.min(p.max_context.saturating_sub(1)).max(1))
        .map(|_| p.first_token + (rng.next_u64() % span) as u32)
        .collect()
}

/// A log-normal draw with the given median and spread (σ of the log), rounded and clamped.
fn lognormal(rng: &mut SplitMix64, median: f64, sigma: f64, min: usize, max: usize) -> usize {
    // Box-Muller.
    let (u, v) = (1.0 - rng.next_f64(), rng.next_f64());
    let z = (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos();
    ((median * (sigma * z).exp()).round() as usize).clamp(min, max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trace_lines_parse_with_defaults() {
        let text = "{\"prompt\": \"hi\"}\n\n{\"arrival\": 1.5, \"tokens\": [1, 2], \"n\": 2, \"max_new_tokens\": 5, \"temperature\": 0.7, \"top_p\": 0.9, \"seed\": 3}\n";
        let r = parse_trace(text).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].prompt, Prompt::Text("hi".into()));
        assert_eq!(
            (r[0].max_new_tokens, r[0].n, r[0].sampling.seed),
            (128, 1, 1)
        );
        assert_eq!(r[1].prompt, Prompt::Tokens(vec![1, 2]));
        assert_eq!((r[1].arrival, r[1].n, r[1].max_new_tokens), (1.5, 2, 5));
        assert_eq!(
            r[1].sampling,
            SamplingParams {
                temperature: 0.7,
                top_p: 0.9,
                top_k: 0,
                seed: 3
            }
        );
    }

    #[test]
    fn bad_trace_lines_name_the_line_and_the_field() {
        let cases = [
            ("{\"prompt\": \"a\"}\n{\"prompt\": 3}", "trace line 2: field `prompt` is 3, expected a string"),
            ("{\"tokens\": []}", "trace line 1: field `tokens` is [], expected a non-empty array of token ids (u32)"),
            ("{\"tokens\": [1, -2]}", "trace line 1: field `tokens` is [1,-2], expected a non-empty array of token ids (u32)"),
            ("{\"prompt\": \"a\", \"n\": 0}", "trace line 1: field `n` is 0, expected an integer >= 1"),
            ("{\"prompt\": \"a\", \"top_p\": 1.5}", "trace line 1: field `top_p` is 1.5, expected a number in (0, 1]"),
            ("{\"prompt\": \"a\", \"arrival\": -1}", "trace line 1: field `arrival` is -1, expected a number of seconds >= 0"),
            ("{\"max_new_tokens\": 3}", "trace line 1: field `prompt` is missing, expected one of `prompt`, `chat` or `tokens`"),
            ("{\"prompt\": \"a\", \"chat\": \"b\"}", "trace line 1: field `prompt` is given as prompt and chat, expected exactly one of `prompt`, `chat` or `tokens`"),
            ("{\"prompt\": \"a\", \"max_tokens\": 3}", "trace line 1: unknown field `max_tokens` (known: arrival, prompt, chat, tokens, encoder_prompt, encoder_tokens, max_new_tokens, n, temperature, top_p, top_k, seed, ignore_eos)"),
            ("{\"prompt\": \"a\", \"encoder_prompt\": 3}", "trace line 1: field `encoder_prompt` is 3, expected a string"),
            ("{\"encoder_tokens\": [1.5]}", "trace line 1: field `encoder_tokens` is [1.5], expected a non-empty array of token ids (u32)"),
            ("{\"encoder_prompt\": \"a\", \"encoder_tokens\": [1]}", "trace line 1: field `encoder_prompt` is given with encoder_tokens, expected at most one of `encoder_prompt` or `encoder_tokens`"),
            ("[1]", "trace line 1: not a JSON object (the line holds an array)"),
            ("\n  \n", "the trace holds no request"),
        ];
        for (text, want) in cases {
            assert_eq!(parse_trace(text).unwrap_err().to_string(), want, "{text}");
        }
        // An encoder-decoder line: the encoder's prompt, the decoder's left to the model.
        let r = parse_trace(
            "{\"encoder_prompt\": \"x\"}\n{\"tokens\": [1], \"encoder_tokens\": [4, 5]}",
        )
        .unwrap();
        assert_eq!(
            (&r[0].prompt, &r[0].encoder_prompt),
            (&Prompt::Tokens(vec![]), &Some(Prompt::Text("x".into())))
        );
        assert_eq!(
            (&r[1].prompt, &r[1].encoder_prompt),
            (&Prompt::Tokens(vec![1]), &Some(Prompt::Tokens(vec![4, 5])))
        );
        let broken = parse_trace("{\"prompt\": ").unwrap_err().to_string();
        assert!(
            broken.starts_with("trace line 1: not a JSON object ("),
            "{broken}"
        );
    }

    #[test]
    fn builtin_workloads_respect_their_limits() {
        let params = BuiltinParams {
            requests: 200,
            rate: Some(4.0),
            first_token: 3,
            vocab: 500,
            max_context: 512,
            max_new_tokens: 300,
            sampling: SamplingParams::default(),
            ignore_eos: false,
            seed: 9,
        };
        for w in Builtin::ALL {
            assert_eq!(w.to_string().parse::<Builtin>(), Ok(w));
            let r = w.requests(&params);
            assert_eq!(r.len(), 200);
            assert_eq!(r, w.requests(&params), "{w}: reproducible");
            let mut last = 0.0;
            for q in &r {
                let Prompt::Tokens(t) = &q.prompt else {
                    panic!("{w}: token prompts")
                };
                assert!(!t.is_empty() && t.iter().all(|&x| (3..500).contains(&x)));
                assert!(t.len() + q.max_new_tokens <= 512, "{w}");
                assert_eq!(q.max_new_tokens == 0, w == Builtin::Encoder, "{w}");
                match (&q.encoder_prompt, w) {
                    (Some(Prompt::Tokens(e)), Builtin::EncoderDecoder) => {
                        assert!((32..=512).contains(&e.len()) && t.len() <= 4, "{w}");
                        assert!((8..=64).contains(&q.max_new_tokens), "{w}");
                    }
                    (None, w) => assert_ne!(w, Builtin::EncoderDecoder),
                    (other, w) => panic!("{w}: encoder prompt {other:?}"),
                }
                assert!(q.arrival >= last, "{w}: arrivals in order");
                last = q.arrival;
            }
            // 200 arrivals at 4/s: about 50 s.
            assert!((30.0..80.0).contains(&last), "{w}: {last}");
        }
        let shared = Builtin::SharedPrefix.requests(&params);
        let (Prompt::Tokens(a), Prompt::Tokens(b)) = (&shared[0].prompt, &shared[1].prompt) else {
            unreachable!()
        };
        assert_eq!(a[..128], b[..128], "one system prompt");
        assert_eq!(shared[0].n, 2);
    }
}
