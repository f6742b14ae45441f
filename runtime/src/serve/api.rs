//! The OpenAI request bodies the server accepts: parsed, checked parameter by parameter (an
//! unknown or unsupported one is named in the error), and turned into what the engine runs.

use serde::Deserialize;
use serde_json::{Map, Value};

use super::text::Message;

/// A request error: the HTTP status and the message (one line).
#[derive(Debug)]
pub struct ApiError {
    /// 400, 404, 503, ...
    pub status: u16,
    /// What is wrong.
    pub message: String,
    /// The parameter at fault, when one is.
    pub param: Option<String>,
}

impl ApiError {
    /// A 400 about `param`.
    pub fn param(param: &str, message: String) -> ApiError {
        ApiError {
            status: 400,
            message,
            param: Some(param.to_string()),
        }
    }

    /// A 400.
    pub fn bad(message: String) -> ApiError {
        ApiError {
            status: 400,
            message,
            param: None,
        }
    }
}

/// Parameters every generation endpoint takes.
#[derive(Debug)]
pub struct Common {
    /// The model's name.
    pub model: Option<String>,
    /// Tokens to generate.
    pub max_tokens: Option<u64>,
    /// The chat API's newer name for `max_tokens`.
    pub max_completion_tokens: Option<u64>,
    /// 0 is greedy (the default 1 samples).
    pub temperature: Option<f32>,
    /// Nucleus mass.
    pub top_p: Option<f32>,
    /// Keep the k largest logits (0 or -1 keeps all).
    pub top_k: Option<i64>,
    /// Seed of the sampling stream (random when absent).
    pub seed: Option<i64>,
    /// Stop strings, or token ids.
    pub stop: Option<Stop>,
    /// Token ids that end the sequence (vLLM's name).
    pub stop_token_ids: Option<Vec<i64>>,
    /// Stream server-sent events.
    pub stream: bool,
    /// `include_usage`: a last chunk with the usage.
    pub stream_options: Option<StreamOptions>,
    /// Each choice (and chunk) also carries its generated token ids.
    pub return_token_ids: bool,
    /// Keep generating past end-of-sequence tokens.
    pub ignore_eos: bool,
}

/// `stream_options`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct StreamOptions {
    /// Send a last chunk with the usage.
    pub include_usage: bool,
}

/// `stop`: one string, or a list of strings and token ids.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    /// One stop string.
    One(String),
    /// Stop strings and token ids.
    Many(Vec<StopItem>),
}

/// One entry of a `stop` list.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum StopItem {
    /// A stop string.
    Text(String),
    /// A stop token id.
    Id(i64),
}

impl Stop {
    /// The stop strings and the stop token ids.
    pub fn split(self) -> (Vec<String>, Vec<i64>) {
        let items = match self {
            Stop::One(s) => vec![StopItem::Text(s)],
            Stop::Many(items) => items,
        };
        let mut texts = Vec::new();
        let mut ids = Vec::new();
        for item in items {
            match item {
                StopItem::Text(t) => texts.push(t),
                StopItem::Id(i) => ids.push(i),
            }
        }
        (texts, ids)
    }
}

/// A prompt (`/v1/completions`) or input (`/v1/embeddings`): text or token ids, one or a list.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Input {
    /// One text.
    Text(String),
    /// One token-id list.
    Ids(Vec<i64>),
    /// Several texts.
    Texts(Vec<String>),
    /// Several token-id lists.
    IdLists(Vec<Vec<i64>>),
}

/// One input of [`Input`]: a text or token ids.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Text, tokenised by the server.
    Text(String),
    /// Token ids.
    Ids(Vec<i64>),
}

impl Input {
    /// Every input in order.
    pub fn items(self) -> Vec<Prompt> {
        match self {
            Input::Text(t) => vec![Prompt::Text(t)],
            Input::Ids(ids) => vec![Prompt::Ids(ids)],
            Input::Texts(ts) => ts.into_iter().map(Prompt::Text).collect(),
            Input::IdLists(ls) => ls.into_iter().map(Prompt::Ids).collect(),
        }
    }
}

/// A chat message as sent: its content a string or a list of text parts.
#[derive(Debug, Deserialize)]
pub struct ChatMessage {
    role: String,
    #[serde(default)]
    content: Option<Content>,
}

/// A message's content.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
}

/// A content part (only text parts are served).
#[derive(Debug, Deserialize)]
struct Part {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: String,
}

impl ChatMessage {
    /// The message as the template takes it; `Err` for a part that is not text.
    pub fn message(self) -> Result<Message, ApiError> {
        let content = match self.content {
            None => String::new(),
            Some(Content::Text(t)) => t,
            Some(Content::Parts(parts)) => {
                if let Some(p) = parts.iter().find(|p| p.kind != "text") {
                    return Err(ApiError::param(
                        "messages",
                        format!("content parts of type `{}` are not supported", p.kind),
                    ));
                }
                parts.into_iter().map(|p| p.text).collect()
            }
        };
        Ok(Message {
            role: self.role,
            content,
        })
    }
}

/// What each endpoint's body may hold besides [`Common`].
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/completions`: `prompt`.
    Completions,
    /// `/v1/chat/completions`: `messages`.
    Chat,
    /// `/v1/embeddings`: `input`, `encoding_format`, `dimensions`.
    Embeddings,
}

/// Parameters of [`Common`] (and `user`, which is accepted and ignored).
const COMMON: &[&str] = &[
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "stream",
    "stream_options",
    "return_token_ids",
    "ignore_eos",
    "user",
];

/// Parameters of the API that this server does not implement, with the value that means "off"
/// (accepted as that).
const UNSUPPORTED: &[(&str, &str)] = &[
    ("n", "1"),
    ("best_of", "1"),
    ("logprobs", "false"),
    ("top_logprobs", "0"),
    ("echo", "false"),
    ("suffix", "null"),
    ("presence_penalty", "0"),
    ("frequency_penalty", "0"),
    ("repetition_penalty", "1"),
    ("logit_bias", "{}"),
    ("tools", "[]"),
    ("tool_choice", "\"none\""),
    ("response_format", "{\"type\":\"text\"}"),
];

/// `body` as a JSON object whose every key this endpoint knows, and whose unsupported
/// parameters hold their neutral values.
pub fn object(body: &[u8], endpoint: Endpoint) -> Result<Map<String, Value>, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad(format!("the body is not valid JSON: {e}")))?;
    let Value::Object(map) = value else {
        return Err(ApiError::bad("the body must be a JSON object".into()));
    };
    let own: &[&str] = match endpoint {
        Endpoint::Completions => &["prompt"],
        Endpoint::Chat => &["messages"],
        Endpoint::Embeddings => &["input", "encoding_format", "dimensions", "model", "user"],
    };
    for (key, value) in &map {
        if own.contains(&key.as_str())
            || (endpoint != Endpoint::Embeddings && COMMON.contains(&key.as_str()))
        {
            continue;
        }
        match UNSUPPORTED.iter().find(|(k, _)| k == key) {
            Some((_, neutral)) if neutral_value(value, neutral) => {}
            Some(_) => {
                return Err(ApiError::param(
                    key,
                    format!("parameter `{key}` = {value} is not supported by this server"),
                ))
            }
            None => {
                return Err(ApiError::param(key, format!("unknown parameter `{key}`")));
            }
        }
    }
    Ok(map)
}

/// Whether `value` is null or the parameter's neutral value.
fn neutral_value(value: &Value, neutral: &str) -> bool {
    let neutral: Value = serde_json::from_str(neutral).expect("the table holds JSON");
    value.is_null()
        || *value == neutral
        || value.as_f64().is_some_and(|v| Some(v) == neutral.as_f64())
}

/// Field `key` of `map` as `T` (`None` when absent or null); a wrong type names the parameter.
pub fn field<T: serde::de::DeserializeOwned>(
    map: &mut Map<String, Value>,
    key: &str,
) -> Result<Option<T>, ApiError> {
    match map.remove(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => serde_json::from_value(v)
            .map(Some)
            .map_err(|e| ApiError::param(key, format!("parameter `{key}`: {e}"))),
    }
}

/// The [`Common`] parameters of `map` (whatever is left of it).
pub fn common(map: Map<String, Value>) -> Result<Common, ApiError> {
    let mut map = map;
    Ok(Common {
        model: field(&mut map, "model")?,
        max_tokens: field(&mut map, "max_tokens")?,
        max_completion_tokens: field(&mut map, "max_completion_tokens")?,
        temperature: field(&mut map, "temperature")?,
        top_p: field(&mut map, "top_p")?,
        top_k: field(&mut map, "top_k")?,
        seed: field(&mut map, "seed")?,
        stop: field(&mut map, "stop")?,
        stop_token_ids: field(&mut map, "stop_token_ids")?,
        stream: field(&mut map, "stream")?.unwrap_or(false),
        stream_options: field(&mut map, "stream_options")?,
        return_token_ids: field(&mut map, "return_token_ids")?.unwrap_or(false),
        ignore_eos: field(&mut map, "ignore_eos")?.unwrap_or(false),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_and_unsupported_parameters_are_named() {
        let body = br#"{"model": "m", "prompt": "x", "n": 2}"#;
        let e = object(body, Endpoint::Completions).unwrap_err();
        assert!(
            e.message.contains("`n`") && e.status == 400,
            "{}",
            e.message
        );
        let body = br#"{"model": "m", "prompt": "x", "n": 1, "logprobs": null, "user": "u"}"#;
        assert!(object(body, Endpoint::Completions).is_ok());
        let body = br#"{"model": "m", "prompt": "x", "temprature": 1}"#;
        let e = object(body, Endpoint::Completions).unwrap_err();
        assert!(e.message.contains("`temprature`"), "{}", e.message);
        let body = br#"{"model": "m", "messages": [], "prompt": "x"}"#;
        assert!(
            object(body, Endpoint::Chat).is_err(),
            "prompt is not a chat parameter"
        );
        let e = object(b"{", Endpoint::Chat).unwrap_err();
        assert!(e.message.contains("JSON"), "{}", e.message);
    }

    #[test]
    fn wrong_types_name_the_parameter() {
        let mut map = object(br#"{"temperature": "hot"}"#, Endpoint::Completions).unwrap();
        let e = field::<f32>(&mut map, "temperature").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("temperature"));
    }

    #[test]
    fn stop_lists_split_into_texts_and_ids() {
        let stop: Stop = serde_json::from_str(r#"["\n", 50256, "END"]"#).unwrap();
        assert_eq!(stop.split(), (vec!["\n".into(), "END".into()], vec![50256]));
    }
}
