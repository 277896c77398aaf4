//! A choice's text as its tokens arrive: incremental detokenization (text appears once its
//! characters are whole) and stop strings (the text up to the first match is the answer; the
//! match itself is not returned, and nothing that could begin one is sent before it is known
//! not to).

use pagedattn_engine::models::tokenizer::Tokenizer;

/// Prompt tokens kept as the decoder's left context: a token's text can depend on the token
/// before it (a leading space, a character split over tokens), as vLLM's incremental
/// detokenizer keeps them.
const CONTEXT_TOKENS: usize = 5;

/// One choice's text so far.
#[derive(Clone, Debug)]
pub struct ChoiceText {
    /// The context and the generated tokens.
    ids: Vec<u32>,
    /// Where the text already returned starts being decoded from.
    prefix_offset: usize,
    /// The tokens before this have been returned as text.
    read_offset: usize,
    /// Decoded text not yet returned: it might begin a stop string.
    pending: String,
    /// Whether a stop string ended the choice.
    stopped: bool,
}

impl ChoiceText {
    /// A choice continuing `prompt`.
    pub fn new(prompt: &[u32]) -> Self {
        let ids = prompt[prompt.len().saturating_sub(CONTEXT_TOKENS)..].to_vec();
        ChoiceText {
            prefix_offset: 0,
            read_offset: ids.len(),
            ids,
            pending: String::new(),
            stopped: false,
        }
    }

    /// Whether a stop string ended it.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Adds a generated token; returns the text that is now final (empty while a character
    /// is incomplete or the text might begin one of `stops`). After a stop string matched,
    /// returns the text before it and ignores later tokens.
    pub fn push(
        &mut self,
        tokenizer: &Tokenizer,
        id: u32,
        stops: &[String],
    ) -> pagedattn_engine::Result<String> {
        if self.stopped {
            return Ok(String::new());
        }
        self.ids.push(id);
        self.decode(tokenizer, false)?;
        Ok(self.release(stops))
    }

    /// The text still held when the choice ends (its stop token or length): the bytes of an
    /// incomplete character as U+FFFD, and text that began a stop string but did not become
    /// one. A stop string found in it ends the text there.
    pub fn finish(
        &mut self,
        tokenizer: &Tokenizer,
        stops: &[String],
    ) -> pagedattn_engine::Result<String> {
        if self.stopped {
            return Ok(String::new());
        }
        self.decode(tokenizer, true)?;
        let mut text = self.release(stops);
        if !self.stopped {
            text.push_str(&std::mem::take(&mut self.pending));
        }
        Ok(text)
    }

    /// Moves the text of the tokens not yet read into `pending`: once it is whole (not
    /// ending in U+FFFD, the mark of a character whose bytes are still coming), or anyway
    /// when `last`.
    fn decode(&mut self, tokenizer: &Tokenizer, last: bool) -> pagedattn_engine::Result<()> {
        let before = tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset], true)?;
        let now = tokenizer.decode(&self.ids[self.prefix_offset..], true)?;
        if now.len() > before.len()
            && (last || !now.ends_with('\u{FFFD}'))
            && now.is_char_boundary(before.len())
        {
            self.pending.push_str(&now[before.len()..]);
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
        }
        Ok(())
    }

    /// Returns what of the pending text is final under `stops`.
    fn release(&mut self, stops: &[String]) -> String {
        let first = stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min();
        if let Some(at) = first {
            self.stopped = true;
            self.pending.truncate(at);
            return std::mem::take(&mut self.pending);
        }
        // Hold back the longest end of the text that begins a stop string.
        let held = stops
            .iter()
            .flat_map(|s| {
                s.char_indices()
                    .skip(1)
                    .map(|(i, _)| &s[..i])
                    .filter(|prefix| self.pending.ends_with(prefix))
                    .map(str::len)
            })
            .max()
            .unwrap_or(0);
        let rest = self.pending.split_off(self.pending.len() - held);
        std::mem::replace(&mut self.pending, rest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The release rule alone, on text given directly.
    fn feed(pieces: &[&str], stops: &[&str]) -> (Vec<String>, bool, String) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut t = ChoiceText::new(&[]);
        let mut out = Vec::new();
        for p in pieces {
            if t.stopped {
                break;
            }
            t.pending.push_str(p);
            out.push(t.release(&stops));
        }
        let stopped = t.stopped;
        (out, stopped, std::mem::take(&mut t.pending))
    }

    #[test]
    fn a_stop_string_split_over_pieces_is_held_back_then_cut() {
        let (out, stopped, rest) = feed(&["Hello", " wor", "ld!", " more"], &["world"]);
        assert_eq!(out, ["Hello", " ", ""]);
        assert!(stopped);
        assert_eq!(rest, "");
    }

    #[test]
    fn text_that_only_began_a_stop_string_is_released_later() {
        let (out, stopped, rest) = feed(&["a wo", "nder", "s"], &["world"]);
        assert_eq!(out, ["a ", "wonder", "s"]);
        assert!(!stopped);
        assert_eq!(rest, "");
        let (out, _, rest) = feed(&["ends with wor"], &["world"]);
        assert_eq!(out, ["ends with "]);
        assert_eq!(rest, "wor", "what is held until the end");
    }

    /// A byte-level tokenizer (the 256 byte tokens and `<|im_end|>`).
    fn byte_tokenizer() -> Tokenizer {
        use pagedattn_engine::models::gguf::Gguf;
        use pagedattn_engine::models::gguf_writer::{tiny_llama, TinyLlama};
        let file = Gguf::from_bytes(tiny_llama(&TinyLlama::default())).unwrap();
        Tokenizer::from_gguf(&file).unwrap()
    }

    #[test]
    fn streamed_text_is_the_whole_decode_for_any_bytes() {
        // (Token b < 256 is byte b; 256 is the end of turn, skipped in the text.)
        let tokenizer = byte_tokenizer();
        let utf8 = "héllo wörld → ✓ 😀 ".as_bytes();
        let mut seed = 7u64;
        for case in 0..300 {
            // Valid UTF-8, random bytes, and both mixed, with the end of turn now and then.
            let ids: Vec<u32> = (0..40)
                .map(|i| {
                    seed = seed
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let r = (seed >> 33) as u32;
                    let valid = u32::from(utf8[i % utf8.len()]);
                    match (case % 3, r % 17) {
                        (_, 0) => 256,
                        (0, _) => valid,
                        (1, _) => r % 256,
                        _ if r.is_multiple_of(2) => r % 256,
                        _ => valid,
                    }
                })
                .collect();
            let mut t = ChoiceText::new(&[]);
            let mut text = String::new();
            for &id in &ids {
                text.push_str(&t.push(&tokenizer, id, &[]).unwrap());
            }
            text.push_str(&t.finish(&tokenizer, &[]).unwrap());
            assert_eq!(
                text,
                tokenizer.decode(&ids, true).unwrap(),
                "case {case}: {ids:?}"
            );
        }
    }

    #[test]
    fn a_stop_string_over_tokens_ends_the_text_before_it() {
        let tokenizer = byte_tokenizer();
        let ids = tokenizer.encode("say hello world and more", false).unwrap();
        let stops = vec!["o w".to_string(), "more".to_string()];
        let mut t = ChoiceText::new(&[]);
        let mut text = String::new();
        for &id in &ids {
            text.push_str(&t.push(&tokenizer, id, &stops).unwrap());
        }
        assert!(t.stopped());
        assert_eq!(text, "say hell");
        assert_eq!(t.finish(&tokenizer, &stops).unwrap(), "");
    }

    #[test]
    fn the_earliest_of_several_stops_wins_and_multibyte_prefixes_are_whole() {
        let (out, stopped, _) = feed(&["xx STOP yy END"], &["END", "STOP"]);
        assert_eq!(out, ["xx "]);
        assert!(stopped);
        let (out, stopped, rest) = feed(&["café ", "é"], &["éclair"]);
        assert_eq!(out, ["café ", ""]);
        assert!(!stopped);
        assert_eq!(rest, "é");
    }
}
