//! Text around the token stream: the checkpoint's chat template, its end-of-sequence ids, and
//! incremental detokenisation that holds back what may still become a stop string.

use minijinja::{Environment, ErrorKind};
use serde_json::Value;

use crate::tokenizer::TextTokenizer;
use crate::{Artifact, RuntimeError};

/// A chat template of `tokenizer_config.json`, with the special tokens it refers to.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
}

/// One chat message: its role and its text.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Message {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// The text.
    pub content: String,
}

impl ChatTemplate {
    /// The artifact's chat template, `None` when its `tokenizer_config.json` has none.
    pub fn of(art: &Artifact) -> Result<Option<ChatTemplate>, RuntimeError> {
        let Some(config) = read_json(art, art.manifest.tokenizer_config.as_deref())? else {
            return Ok(None);
        };
        let source = match &config["chat_template"] {
            Value::String(t) => t.clone(),
            // A list of named templates: the one called `default`.
            Value::Array(named) => match named
                .iter()
                .find(|t| t["name"] == "default")
                .and_then(|t| t["template"].as_str())
            {
                Some(t) => t.to_string(),
                None => return Ok(None),
            },
            _ => return Ok(None),
        };
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |message: String| -> Result<String, _> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
        });
        env.add_template_owned("chat", source).map_err(|e| {
            RuntimeError::Request(format!("tokenizer_config.json: chat_template: {e}"))
        })?;
        let token = |key: &str| match &config[key] {
            Value::String(s) => s.clone(),
            Value::Object(o) => o
                .get("content")
                .and_then(Value::as_str)
                .unwrap_or("")
                .into(),
            _ => String::new(),
        };
        Ok(Some(ChatTemplate {
            env,
            bos: token("bos_token"),
            eos: token("eos_token"),
        }))
    }

    /// The prompt text of `messages`, ending with the assistant's turn opened.
    pub fn render(&self, messages: &[Message]) -> Result<String, RuntimeError> {
        let template = self.env.get_template("chat").expect("added at load");
        template
            .render(minijinja::context! {
                messages => messages,
                add_generation_prompt => true,
                bos_token => self.bos,
                eos_token => self.eos,
            })
            .map_err(|e| RuntimeError::Request(format!("the chat template failed: {e}")))
    }
}

/// The end-of-sequence token ids of `config.json` and `generation_config.json` (either may give
/// one id or a list).
pub fn eos_ids(art: &Artifact) -> Result<Vec<i64>, RuntimeError> {
    let config: Value = serde_json::from_str(&art.manifest.model_config)
        .map_err(|e| RuntimeError::Request(format!("the manifest's config.json: {e}")))?;
    let generation = read_json(art, art.manifest.generation_config.as_deref())?;
    let mut ids: Vec<i64> = [Some(&config), generation.as_ref()]
        .into_iter()
        .flatten()
        .flat_map(|c| match &c["eos_token_id"] {
            Value::Number(n) => n.as_i64().into_iter().collect(),
            Value::Array(list) => list.iter().filter_map(Value::as_i64).collect(),
            _ => Vec::new(),
        })
        .collect();
    ids.sort_unstable();
    ids.dedup();
    Ok(ids)
}

/// An artifact's JSON file `file`, when it has one.
fn read_json(art: &Artifact, file: Option<&str>) -> Result<Option<Value>, RuntimeError> {
    let Some(file) = file else {
        return Ok(None);
    };
    let text = art.read_text(file)?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| art.file_error(file, format!("is not JSON: {e}")))
}

/// A sequence's text as its tokens arrive: each [`Detokenizer::push`] gives the text that is
/// final, holding back an incomplete character and any tail that may still begin a stop string.
/// Each token decodes a window of the last few tokens only (what vLLM does): the window's text
/// past what its first part gave is new, so a long answer costs no more per token than a short
/// one, and a decoder that treats a sequence's first token apart (a leading space dropped) treats
/// both the same.
pub struct Detokenizer<'t> {
    tokenizer: Option<&'t TextTokenizer>,
    stops: Vec<String>,
    ids: Vec<i64>,
    /// The text so far.
    text: String,
    /// The window: `ids[prefix..read]` decoded to the end of `text`, `ids[read..]` is new.
    prefix: usize,
    read: usize,
    /// Bytes of the text handed out so far.
    sent: usize,
}

impl<'t> Detokenizer<'t> {
    /// A detokenizer for one sequence; without a tokenizer every text is empty.
    pub fn new(tokenizer: Option<&'t TextTokenizer>, stops: Vec<String>) -> Detokenizer<'t> {
        Detokenizer {
            tokenizer,
            stops,
            ids: Vec::new(),
            text: String::new(),
            prefix: 0,
            read: 0,
            sent: 0,
        }
    }

    /// Adds `token`; returns the new final text, and whether a stop string ended the text (the
    /// stop string itself is never handed out).
    pub fn push(&mut self, token: i64) -> Result<(String, bool), RuntimeError> {
        self.ids.push(token);
        let Some(tokenizer) = self.tokenizer else {
            return Ok((String::new(), false));
        };
        if !self.extend(tokenizer)? {
            return Ok((String::new(), false));
        }
        let text = std::mem::take(&mut self.text);
        let from = self.sent.min(text.len());
        let out = match self.first_stop(&text, from) {
            Some(end) => (self.take(&text, end), true),
            None => {
                let end = text.len() - self.stop_prefix(&text);
                (self.take(&text, end), false)
            }
        };
        self.text = text;
        Ok(out)
    }

    /// Appends the new tokens' text to `text`; `false` (nothing appended) while the window ends
    /// inside a character (an incomplete UTF-8 sequence decodes to U+FFFD until its last byte
    /// arrives).
    fn extend(&mut self, tokenizer: &TextTokenizer) -> Result<bool, RuntimeError> {
        let before = tokenizer.decode(&self.ids[self.prefix..self.read])?;
        let after = tokenizer.decode(&self.ids[self.prefix..])?;
        if after.ends_with('\u{FFFD}') {
            return Ok(false);
        }
        match after.strip_prefix(before.as_str()) {
            Some(new) => self.text.push_str(new),
            // The window's first part reads otherwise with the rest after it: decode it all.
            None => self.text = tokenizer.decode(&self.ids)?,
        }
        self.prefix = self.read;
        self.read = self.ids.len();
        Ok(true)
    }

    /// The rest of the text, at the end of the sequence (the whole sequence decoded once).
    pub fn finish(&mut self) -> Result<String, RuntimeError> {
        let Some(tokenizer) = self.tokenizer else {
            return Ok(String::new());
        };
        let text = tokenizer.decode(&self.ids)?;
        Ok(self.take(&text, text.len()))
    }

    /// `text[sent..end]`, marking it sent.
    fn take(&mut self, text: &str, end: usize) -> String {
        let start = self.sent.min(end);
        self.sent = end.max(self.sent);
        text.get(start..end).unwrap_or("").to_string()
    }

    /// Where the first stop string that ends at or after byte `from` begins.
    fn first_stop(&self, text: &str, from: usize) -> Option<usize> {
        let longest = self.stops.iter().map(String::len).max()?;
        let mut start = from.saturating_sub(longest);
        while !text.is_char_boundary(start) {
            start -= 1;
        }
        self.stops
            .iter()
            .filter_map(|s| text[start..].find(s.as_str()).map(|i| start + i))
            .min()
    }

    /// The length of the longest tail of `text` that begins some stop string (held back).
    fn stop_prefix(&self, text: &str) -> usize {
        self.stops
            .iter()
            .flat_map(|s| {
                (1..s.len())
                    .filter(|&n| s.is_char_boundary(n) && text.ends_with(&s[..n]))
                    .max()
            })
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A byte-level BPE tokenizer without merges (one token per byte, GPT-2's byte alphabet).
    fn byte_tokenizer(dir: &std::path::Path) -> TextTokenizer {
        let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
        let mut extra = 0;
        let vocab: serde_json::Map<String, Value> = (0..256u32)
            .map(|b| {
                let c = if printable(b) {
                    char::from_u32(b).unwrap()
                } else {
                    extra += 1;
                    char::from_u32(255 + extra).unwrap()
                };
                (c.to_string(), Value::from(b))
            })
            .collect();
        let level = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false,
            "trim_offsets": true, "use_regex": true});
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": level, "post_processor": null, "decoder": level,
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
                "byte_fallback": false, "vocab": vocab, "merges": []}
        });
        let path = dir.join("tokenizer.json");
        std::fs::write(&path, json.to_string()).unwrap();
        TextTokenizer::from_file(&path).unwrap()
    }

    #[test]
    fn text_arrives_whole_characters_at_a_time_and_adds_up() {
        let dir = tempfile::tempdir().unwrap();
        let t = byte_tokenizer(dir.path());
        let text = "héllo wörld, ☃ «ok» END tail";
        let ids = t.encode(text).unwrap();
        assert!(
            ids.len() > text.chars().count(),
            "multi-byte characters are several tokens"
        );
        let mut d = Detokenizer::new(Some(&t), Vec::new());
        let mut got = String::new();
        for &id in &ids {
            let (piece, stopped) = d.push(id).unwrap();
            assert!(!piece.contains('\u{FFFD}') && !stopped, "{piece:?}");
            got += &piece;
        }
        got += &d.finish().unwrap();
        assert_eq!(got, text);
        let mut d = Detokenizer::new(Some(&t), vec![" END".into()]);
        let mut got = String::new();
        for &id in &ids {
            let (piece, stopped) = d.push(id).unwrap();
            got += &piece;
            if stopped {
                break;
            }
        }
        assert_eq!(got, "héllo wörld, ☃ «ok»");
    }

    #[test]
    fn stop_strings_and_their_prefixes_are_held_back() {
        let d = Detokenizer::new(None, vec!["END".into(), "\n\n".into()]);
        assert_eq!(d.stop_prefix("hello EN"), 2);
        assert_eq!(d.stop_prefix("hello\n"), 1);
        assert_eq!(d.stop_prefix("hello E."), 0);
        assert_eq!(d.first_stop("abc END x", 0), Some(4));
        assert_eq!(d.first_stop("abc\n\nEND", 2), Some(3));
        assert_eq!(d.first_stop("abc", 0), None);
    }
}
