//! Request bodies into what the engine runs: the model checked, prompts tokenised or the chat
//! template rendered, sampling and stop parameters settled, prompt and budget checked against the
//! compiled context.

use std::time::{SystemTime, UNIX_EPOCH};

use kiln_ir::inputs::TokenBatch;
use serde_json::Value;

use super::answers::runtime_error;
use super::api::{self, ApiError, Endpoint, Input, Prompt};
use super::App;
use crate::generate::{check_prompt, Sampling};
use crate::tokenizer::TextTokenizer;

/// A generation, checked and ready for the engine.
pub(super) struct Request {
    pub(super) prompt: Vec<i64>,
    pub(super) max_new: usize,
    pub(super) sampling: Sampling,
    pub(super) stops: Vec<String>,
    pub(super) stop_ids: Vec<i64>,
    pub(super) stream: bool,
    pub(super) include_usage: bool,
    pub(super) return_token_ids: bool,
    pub(super) chat: bool,
}

pub(super) fn completion_request(app: &App, body: &[u8]) -> Result<Request, ApiError> {
    let mut map = api::object(body, Endpoint::Completions)?;
    let input: Input = api::field(&mut map, "prompt")?
        .ok_or_else(|| ApiError::param("prompt", "`prompt` is required".into()))?;
    let mut items = input.items();
    if items.len() != 1 {
        let n = items.len();
        return Err(ApiError::param(
            "prompt",
            format!("one prompt per request ({n} given)"),
        ));
    }
    let prompt = match items.remove(0) {
        Prompt::Ids(ids) => ids,
        Prompt::Text(t) => tokenizer(app, "prompt")?
            .encode(&t)
            .map_err(|e| ApiError::param("prompt", e.to_string()))?,
    };
    settle(app, api::common(map)?, prompt, Some(16), false)
}

pub(super) fn chat_request(app: &App, body: &[u8]) -> Result<Request, ApiError> {
    let mut map = api::object(body, Endpoint::Chat)?;
    let messages: Vec<api::ChatMessage> = api::field(&mut map, "messages")?
        .ok_or_else(|| ApiError::param("messages", "`messages` is required".into()))?;
    if messages.is_empty() {
        return Err(ApiError::param("messages", "`messages` is empty".into()));
    }
    let messages = messages
        .into_iter()
        .map(api::ChatMessage::message)
        .collect::<Result<Vec<_>, _>>()?;
    let template = app.chat.as_ref().ok_or_else(|| {
        ApiError::bad(format!(
            "model `{}` has no chat template (tokenizer_config.json)",
            app.model
        ))
    })?;
    let text = template.render(&messages).map_err(runtime_error)?;
    let prompt = tokenizer(app, "messages")?
        .encode_plain(&text)
        .map_err(|e| ApiError::param("messages", e.to_string()))?;
    settle(app, api::common(map)?, prompt, None, true)
}

/// The model's tokenizer, or a 400 naming the parameter that needs it.
pub(super) fn tokenizer<'a>(app: &'a App, param: &str) -> Result<&'a TextTokenizer, ApiError> {
    app.tokenizer.as_ref().ok_or_else(|| {
        ApiError::param(
            param,
            format!(
                "model `{}` has no tokenizer.json: give token ids",
                app.model
            ),
        )
    })
}

/// Checks the model name and turns the common parameters into a [`Request`]; `max_new` defaults
/// to `default_max`, or to what the context leaves after the prompt.
pub(super) fn settle(
    app: &App,
    c: api::Common,
    prompt: Vec<i64>,
    default_max: Option<u64>,
    chat: bool,
) -> Result<Request, ApiError> {
    check_model(app, c.model.as_deref())?;
    if !app.decoder {
        return Err(ApiError::bad(format!(
            "model `{}` is an encoder: use /v1/embeddings",
            app.model
        )));
    }
    let room = app.context.saturating_sub(prompt.len()) as u64;
    let max_new = c
        .max_completion_tokens
        .or(c.max_tokens)
        .or(default_max)
        .unwrap_or(room);
    if max_new == 0 {
        return Err(ApiError::param(
            "max_tokens",
            "`max_tokens` must be at least 1".into(),
        ));
    }
    let top_k = match c.top_k.unwrap_or(0) {
        -1 => 0,
        k if k < 0 => {
            return Err(ApiError::param(
                "top_k",
                format!("top_k {k} must be >= 0 (or -1)"),
            ))
        }
        k => k as usize,
    };
    let sampling = Sampling {
        temperature: c.temperature.unwrap_or(1.0),
        top_k,
        top_p: c.top_p.unwrap_or(1.0),
        seed: c.seed.unwrap_or_else(random_seed),
    };
    sampling.validate().map_err(|e| {
        let param = if e.to_string().starts_with("temperature") {
            "temperature"
        } else {
            "top_p"
        };
        ApiError::param(param, e.to_string())
    })?;
    let (stops, mut stop_ids) = c.stop.map(api::Stop::split).unwrap_or_default();
    if !stops.is_empty() {
        tokenizer(app, "stop")?;
    }
    stop_ids.extend(c.stop_token_ids.unwrap_or_default());
    if !c.ignore_eos {
        stop_ids.extend(&app.eos);
    }
    let max_new = usize::try_from(max_new).unwrap_or(usize::MAX);
    check_prompt(&prompt, max_new, app.context, app.vocab).map_err(|e| {
        let param = if e.contains("exceed") {
            "max_tokens"
        } else {
            "prompt"
        };
        ApiError::param(param, e)
    })?;
    Ok(Request {
        prompt,
        max_new,
        sampling,
        stops,
        stop_ids,
        stream: c.stream,
        include_usage: c.stream_options.is_some_and(|o| o.include_usage),
        return_token_ids: c.return_token_ids,
        chat,
    })
}

/// `Err` unless `model` names the served model (400 when absent, 404 when another).
pub(super) fn check_model(app: &App, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        None => Err(ApiError::param("model", "`model` is required".into())),
        Some(m) if m != app.model => Err(ApiError {
            status: 404,
            message: format!(
                "model `{m}` does not exist; this server serves `{}`",
                app.model
            ),
            param: Some("model".into()),
        }),
        Some(_) => Ok(()),
    }
}

/// A seed for a request that gave none.
pub(super) fn random_seed() -> i64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish() as i64
}

pub(super) fn embedding_request(app: &App, body: &[u8]) -> Result<TokenBatch, ApiError> {
    let mut map = api::object(body, Endpoint::Embeddings)?;
    let model: Option<String> = api::field(&mut map, "model")?;
    check_model(app, model.as_deref())?;
    if app.decoder || !app.embeds {
        let message = format!(
            "model `{}` has no sentence embeddings (an encoder compiled from a \
             sentence-transformers folder serves them)",
            app.model
        );
        return Err(ApiError::bad(message));
    }
    if let Some(f) = api::field::<String>(&mut map, "encoding_format")?.filter(|f| f != "float") {
        return Err(ApiError::param(
            "encoding_format",
            format!("encoding_format `{f}` is not supported (only `float`)"),
        ));
    }
    if api::field::<Value>(&mut map, "dimensions")?.is_some() {
        return Err(ApiError::param(
            "dimensions",
            "parameter `dimensions` is not supported by this server".into(),
        ));
    }
    let input: Input = api::field(&mut map, "input")?
        .ok_or_else(|| ApiError::param("input", "`input` is required".into()))?;
    let items = input.items();
    if items.is_empty() {
        return Err(ApiError::param("input", "`input` is empty".into()));
    }
    let mut texts = Vec::new();
    let mut lists = Vec::new();
    for item in items {
        match item {
            Prompt::Text(t) => texts.push(t),
            Prompt::Ids(ids) if ids.is_empty() => {
                return Err(ApiError::param("input", "an input has no tokens".into()))
            }
            Prompt::Ids(ids) => lists.push(ids),
        }
    }
    if texts.is_empty() {
        return Ok(TokenBatch::padded(&lists, 0));
    }
    tokenizer(app, "input")?
        .encode_batch(&texts, &[])
        .map_err(|e| ApiError::param("input", e.to_string()))
}
