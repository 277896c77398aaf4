//! Chat templates: the Jinja template a GGUF carries in `tokenizer.chat_template`, rendered
//! with `minijinja` the way transformers' `apply_chat_template` renders it with jinja2.
//!
//! transformers' environment (`utils/chat_template_utils.py`) is reproduced: `trim_blocks` and
//! `lstrip_blocks` on, `{% break %}`/`{% continue %}`, a `raise_exception(message)` function
//! that fails the rendering, and a `tojson` filter that is Python's `json.dumps` (no HTML
//! escaping, `ensure_ascii=False`, optional `indent`, `separators`, `sort_keys`), unlike
//! minijinja's built-in one. Python's string and dict methods come from `minijinja-contrib`'s
//! pycompat. The template sees `messages`, `add_generation_prompt`, `tools` and `documents`
//! (none), and the named special tokens (`bos_token`, `eos_token`, `unk_token`, `pad_token`)
//! that the file sets, as transformers passes its `special_tokens_map`.

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};
use serde::Serialize;
use thiserror::Error;

use crate::models::gguf::{Gguf, GgufError};
use crate::models::tokenizer::{SpecialTokens, TokenizerError};

/// The key holding the template.
pub const CHAT_TEMPLATE_KEY: &str = "tokenizer.chat_template";

/// A template that cannot be read, compiled or rendered.
#[derive(Debug, Error)]
pub enum ChatError {
    /// The template is missing or not a string.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// The special tokens could not be read.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    /// A syntax error, a failed `raise_exception`, or another rendering error.
    #[error("chat template: {0}")]
    Template(String),
}

fn template_error(e: Error) -> ChatError {
    // minijinja's Display has the kind and the detail on one line; the source chain adds the
    // inner error of a failed filter or function.
    let mut msg = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        source = s.source();
    }
    ChatError::Template(msg)
}

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

impl ChatMessage {
    /// A message of `role` saying `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template with the special tokens it may refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    special: SpecialTokens,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("special", &self.special)
            .finish_non_exhaustive()
    }
}

/// The template's name in the environment (no extension: no auto-escaping, as in jinja2's
/// default environment).
const NAME: &str = "chat_template";

/// The template's budget for one rendering, in minijinja's fuel: one an instruction, one per
/// 64 bytes of strings (and lists and maps) the operators, filters and output make. Chat
/// templates take thousands for a conversation; nested loops that would render for hours, or
/// a string doubled in a loop, stop here (at 2 million instructions or 128 MB of data made,
/// in well under a second) with an error, not an allocation that aborts the process.
const TEMPLATE_FUEL: u64 = 2_000_000;

/// The deepest nesting (minijinja counts 4 a macro call, 1 a loop or block; its default is
/// 500): chat templates nest a few levels; a macro calling itself stops at about 14 calls with
/// an error, before a string it doubles on each call can exhaust memory.
const TEMPLATE_RECURSION: usize = 64;

/// The most bytes one rendering writes: a conversation far past any model's context. More is an
/// error, not an allocation that aborts the process.
pub const MAX_RENDERED_BYTES: usize = 4 << 20;

/// An [`std::io::Write`] into a string that refuses to grow past [`MAX_RENDERED_BYTES`].
#[derive(Default)]
struct CappedOutput {
    bytes: Vec<u8>,
    exceeded: bool,
}

impl std::io::Write for CappedOutput {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.bytes.len() + buf.len() > MAX_RENDERED_BYTES {
            self.exceeded = true;
            return Err(std::io::Error::other("the rendering's size limit"));
        }
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl ChatTemplate {
    /// Compiles `source`.
    pub fn new(source: &str, special: SpecialTokens) -> Result<Self, ChatError> {
        let mut env = Environment::new();
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.set_recursion_limit(TEMPLATE_RECURSION);
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(template_error)?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source.to_string())
            .map_err(template_error)?;
        Ok(ChatTemplate { env, special })
    }

    /// Compiles the file's `tokenizer.chat_template`, with the file's special tokens.
    pub fn from_gguf(g: &Gguf) -> Result<Self, ChatError> {
        Self::new(g.get_str(CHAT_TEMPLATE_KEY)?, SpecialTokens::from_gguf(g)?)
    }

    /// The chat template of a Hugging Face folder, which its tokenizer holds (as
    /// transformers' does), with the tokenizer's special tokens. A folder without one gets a
    /// template that refuses every conversation, saying so.
    pub fn from_hf_folder(
        dir: &std::path::Path,
        tokenizer: &crate::models::tokenizer::Tokenizer,
    ) -> Result<Self, ChatError> {
        let source = match tokenizer.chat_template() {
            Some(s) => s.to_string(),
            None => format!(
                "{{{{ raise_exception('{} has no chat template') }}}}",
                dir.display().to_string().replace(['\\', '\''], "")
            ),
        };
        Self::new(&source, tokenizer.special_tokens().clone())
    }

    /// Renders `messages`; with `add_generation_prompt`, ends with the header of the
    /// assistant's turn, as the template writes it.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        let text =
            |t: &Option<crate::models::tokenizer::SpecialToken>| t.as_ref().map(|t| t.text.clone());
        let mut ctx = vec![
            ("messages", Value::from(minijinja::value::Serde(messages))),
            ("add_generation_prompt", Value::from(add_generation_prompt)),
            ("tools", Value::from(())),
            ("documents", Value::from(())),
        ];
        for (name, token) in [
            ("bos_token", &self.special.bos),
            ("eos_token", &self.special.eos),
            ("unk_token", &self.special.unk),
            ("pad_token", &self.special.pad),
        ] {
            if let Some(t) = text(token) {
                ctx.push((name, Value::from(t)));
            }
        }
        let ctx = Value::from_pairs(ctx);
        let mut out = CappedOutput::default();
        let rendered = self
            .env
            .get_template(NAME)
            .and_then(|t| t.render_captured_to(ctx, &mut out).map(drop));
        if out.exceeded {
            return Err(ChatError::Template(format!(
                "the rendering exceeds {MAX_RENDERED_BYTES} bytes"
            )));
        }
        rendered.map_err(template_error)?;
        String::from_utf8(out.bytes)
            .map_err(|e| ChatError::Template(format!("the rendering is not UTF-8: {e}")))
    }
}

/// transformers' `raise_exception(message)`: fails the rendering with the template's message.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// transformers' `tojson` filter: `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`, formatted as Python formats it (`", "` and `": "`
/// separators without indent, `","` with it).
fn tojson(value: Value, kwargs: Kwargs) -> Result<String, Error> {
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    let indent = match kwargs.get::<Option<Value>>("indent")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(match v.as_i64() {
            Some(n) => " ".repeat(usize::try_from(n).unwrap_or(0)),
            None => v.as_str().map(str::to_string).ok_or_else(|| {
                Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent is not an integer or a string",
                )
            })?,
        }),
    };
    let (item_sep, key_sep) = match kwargs.get::<Option<Vec<String>>>("separators")? {
        Some(s) if s.len() == 2 => (s[0].clone(), s[1].clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators is not a pair",
            ))
        }
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    kwargs.assert_all_used()?;
    let mut out = String::new();
    let fmt = JsonFormat {
        ensure_ascii,
        indent,
        item_sep,
        key_sep,
        sort_keys,
    };
    fmt.write(&value, 0, &mut out)?;
    Ok(out)
}

/// Python `json.dumps`' options.
struct JsonFormat {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

impl JsonFormat {
    fn newline(&self, level: usize, out: &mut String) {
        if let Some(indent) = &self.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(indent);
            }
        }
    }

    fn write(&self, v: &Value, level: usize, out: &mut String) -> Result<(), Error> {
        match v.kind() {
            ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => match v.as_i64() {
                Some(i) if v.is_integer() => out.push_str(&i.to_string()),
                _ => out.push_str(&python_float(f64::try_from(v.clone())?)),
            },
            ValueKind::String => self.string(v.as_str().unwrap_or_default(), out),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                self.container(('[', ']'), items.len(), level, out, |i, out| {
                    self.write(&items[i], level + 1, out)
                })?;
            }
            ValueKind::Map => {
                let mut keys: Vec<Value> = v.try_iter()?.collect();
                if self.sort_keys {
                    keys.sort();
                }
                self.container(('{', '}'), keys.len(), level, out, |i, out| {
                    let key = &keys[i];
                    match key.as_str() {
                        Some(s) => self.string(s, out),
                        // Python writes non-string keys as the strings of their JSON.
                        None => self.string(&key.to_string(), out),
                    }
                    out.push_str(&self.key_sep);
                    self.write(&v.get_item(key)?, level + 1, out)
                })?;
            }
            kind => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: a {kind} value is not JSON serializable"),
                ))
            }
        }
        Ok(())
    }

    fn container(
        &self,
        (open, close): (char, char),
        n: usize,
        level: usize,
        out: &mut String,
        mut item: impl FnMut(usize, &mut String) -> Result<(), Error>,
    ) -> Result<(), Error> {
        out.push(open);
        if n > 0 {
            for i in 0..n {
                if i > 0 {
                    out.push_str(&self.item_sep);
                }
                self.newline(level + 1, out);
                item(i, out)?;
            }
            self.newline(level, out);
        }
        out.push(close);
        Ok(())
    }

    fn string(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && (c as u32) > 0x7e) => {
                    let mut units = [0u16; 2];
                    for u in c.encode_utf16(&mut units) {
                        out.push_str(&format!("\\u{u:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// Python's `repr` of a float: shortest round-trip digits, `.0` on integral values, an
/// exponent (`1e+16`, `1e-05`) outside `[1e-4, 1e16)`, and `NaN`/`Infinity` as json.dumps
/// writes them.
fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let a = f.abs();
    if a == 0.0 || (1e-4..1e16).contains(&a) {
        // Rust's Debug is the shortest round-trip form in positional notation with ".0".
        return format!("{f:?}");
    }
    // `{:e}` gives the shortest digits with a bare exponent (`1e16`, `1.5e-7`).
    let s = format!("{f:e}");
    let (mantissa, exp) = s.split_once('e').expect("{:e} writes an exponent");
    let exp: i32 = exp.parse().expect("an integer exponent");
    let sign = if exp < 0 { '-' } else { '+' };
    format!("{mantissa}e{sign}{:02}", exp.unsigned_abs())
}
