//! The handlers and their answers: generations handed to the engine and gathered or streamed
//! (server-sent events), embeddings, the model list, health and metrics, and OpenAI-style errors.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use kiln_ir::inputs::TokenBatch;
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::api::ApiError;
use super::engine::{Command, Embedding, Event, Finish, Generation};
use super::requests::{chat_request, completion_request, embedding_request, Request};
use super::text::Detokenizer;
use super::App;
use crate::batcher::Job;
use crate::RuntimeError;

/// An OpenAI-style JSON error.
pub(super) fn error(e: ApiError) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::BAD_REQUEST);
    let kind = match e.status {
        404 => "not_found_error",
        400..=499 => "invalid_request_error",
        503 => "overloaded_error",
        _ => "server_error",
    };
    let body =
        json!({"error": {"message": e.message, "type": kind, "param": e.param, "code": e.status}});
    let mut response = (status, Json(body)).into_response();
    if e.status == 503 {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    response
}

/// A runtime error as an API error: the request's fault (400) or the server's (500).
pub(super) fn runtime_error(e: RuntimeError) -> ApiError {
    let status = match e {
        RuntimeError::Request(_) => 400,
        RuntimeError::Artifact { .. } | RuntimeError::Device(_) => 500,
    };
    ApiError {
        status,
        message: e.to_string(),
        param: None,
    }
}

pub(super) async fn completions(State(app): State<Arc<App>>, body: Bytes) -> Response {
    match completion_request(&app, &body) {
        Ok(req) => generate(app, req).await,
        Err(e) => error(e),
    }
}

pub(super) async fn chat_completions(State(app): State<Arc<App>>, body: Bytes) -> Response {
    match chat_request(&app, &body) {
        Ok(req) => generate(app, req).await,
        Err(e) => error(e),
    }
}

/// Hands `req` to the engine (or refuses it: draining, or the queue is full) and answers.
async fn generate(app: Arc<App>, req: Request) -> Response {
    if app.shared.draining.load(Ordering::SeqCst) {
        return error(ApiError {
            status: 503,
            message: "the server is shutting down".into(),
            param: None,
        });
    }
    // Requests that will find a free row do not count against the queue.
    let room = app.max_queue + app.shared.free_rows.load(Ordering::SeqCst);
    if app.shared.waiting.fetch_add(1, Ordering::SeqCst) >= room {
        app.shared.waiting.fetch_sub(1, Ordering::SeqCst);
        let message = format!(
            "{} requests are waiting already; retry later",
            app.max_queue
        );
        return error(ApiError {
            status: 503,
            message,
            param: None,
        });
    }
    let (events, rx) = mpsc::unbounded_channel();
    let generation = Generation {
        job: Job {
            prompt: req.prompt.clone(),
            max_new: req.max_new,
            sampling: req.sampling,
        },
        stop_ids: req.stop_ids.clone(),
        events,
        arrived: Instant::now(),
    };
    if app.engine.send(Command::Generate(generation)).is_err() {
        app.shared.waiting.fetch_sub(1, Ordering::SeqCst);
        return error(ApiError {
            status: 503,
            message: "the engine has stopped".into(),
            param: None,
        });
    }
    let answer = Answer::new(&app, &req);
    if req.stream {
        stream(app, req, rx, answer)
    } else {
        collect(app, req, rx, answer).await
    }
}

/// What every answer of one request shares: its id, kind and time.
struct Answer {
    id: String,
    object: &'static str,
    created: u64,
    model: String,
    chat: bool,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(0);

impl Answer {
    fn new(app: &App, req: &Request) -> Answer {
        let n = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let (prefix, object) = match (req.chat, req.stream) {
            (true, false) => ("chatcmpl", "chat.completion"),
            (true, true) => ("chatcmpl", "chat.completion.chunk"),
            (false, _) => ("cmpl", "text_completion"),
        };
        Answer {
            id: format!("{prefix}-{n}"),
            object,
            created,
            model: app.model.clone(),
            chat: req.chat,
        }
    }

    /// The answer object around `choices` (and `usage`, when given).
    fn body(&self, choices: Vec<Value>, usage: Option<Value>) -> Value {
        let mut body = json!({
            "id": self.id, "object": self.object, "created": self.created,
            "model": self.model, "choices": choices,
        });
        if let Some(u) = usage {
            body["usage"] = u;
        }
        body
    }

    /// A choice with `text`: a message (chat) or text; in a stream chunk, the delta.
    fn choice(
        &self,
        text: String,
        ids: Option<&[i64]>,
        finish: Option<&str>,
        chunk: bool,
    ) -> Value {
        let mut choice = json!({"index": 0, "finish_reason": finish, "logprobs": null});
        match (self.chat, chunk) {
            (true, false) => choice["message"] = json!({"role": "assistant", "content": text}),
            (true, true) if finish.is_some() && text.is_empty() => choice["delta"] = json!({}),
            (true, true) => choice["delta"] = json!({"content": text}),
            (false, _) => choice["text"] = json!(text),
        }
        if let Some(ids) = ids {
            choice["token_ids"] = json!(ids);
        }
        choice
    }
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    })
}

/// The outcome of reading one event: text to hand out, and whether the sequence ended.
enum Step {
    More(String, i64),
    End(String, Finish),
}

/// Reads the next event of a generation into `detok`; `Err` with the API error that ends it.
async fn next_event(
    rx: &mut mpsc::UnboundedReceiver<Event>,
    detok: &mut Detokenizer<'_>,
    deadline: tokio::time::Instant,
) -> Result<Step, ApiError> {
    let event = tokio::time::timeout_at(deadline, rx.recv())
        .await
        .map_err(|_| ApiError {
            status: 504,
            message: "the request took longer than the server's --request-timeout".into(),
            param: None,
        })?;
    match event {
        Some(Event::Token(t)) => {
            let (text, stopped) = detok.push(t).map_err(runtime_error)?;
            Ok(if stopped {
                Step::End(text, Finish::Stop)
            } else {
                Step::More(text, t)
            })
        }
        Some(Event::Done(f)) => Ok(Step::End(detok.finish().map_err(runtime_error)?, f)),
        Some(Event::Failed(e)) => Err(runtime_error(e)),
        None => Err(ApiError {
            status: 500,
            message: "the engine stopped".into(),
            param: None,
        }),
    }
}

/// Gathers the whole answer of a non-streamed request.
async fn collect(
    app: Arc<App>,
    req: Request,
    mut rx: mpsc::UnboundedReceiver<Event>,
    answer: Answer,
) -> Response {
    let deadline = tokio::time::Instant::now() + app.timeout;
    let mut detok = Detokenizer::new(app.tokenizer.as_ref(), req.stops.clone());
    let mut text = String::new();
    let mut ids = Vec::new();
    let finish = loop {
        match next_event(&mut rx, &mut detok, deadline).await {
            Ok(Step::More(t, id)) => {
                text += &t;
                ids.push(id);
            }
            Ok(Step::End(t, f)) => {
                text += &t;
                break f;
            }
            Err(e) => return error(e),
        }
    };
    let n = ids.len();
    let (prompt, reason) = (req.prompt.len(), finish.reason());
    tracing::info!(id = %answer.id, prompt, tokens = n, finish = reason, "answered");
    let ids = req.return_token_ids.then_some(ids.as_slice());
    let choice = answer.choice(text, ids, Some(finish.reason()), false);
    Json(answer.body(vec![choice], Some(usage(req.prompt.len(), n)))).into_response()
}

/// Streams the answer as server-sent events, ending with `data: [DONE]`.
fn stream(
    app: Arc<App>,
    req: Request,
    mut rx: mpsc::UnboundedReceiver<Event>,
    answer: Answer,
) -> Response {
    let (tx, out) = mpsc::unbounded_channel::<Result<SseEvent, std::convert::Infallible>>();
    tokio::spawn(async move {
        let send = |v: Value| tx.send(Ok(SseEvent::default().data(v.to_string()))).is_ok();
        let deadline = tokio::time::Instant::now() + app.timeout;
        let mut detok = Detokenizer::new(app.tokenizer.as_ref(), req.stops.clone());
        if answer.chat {
            let delta = json!({"role": "assistant", "content": ""});
            let first = json!({"index": 0, "delta": delta, "finish_reason": null});
            if !send(answer.body(vec![first], None)) {
                return;
            }
        }
        let mut n = 0;
        let ids = |id: i64| req.return_token_ids.then_some(vec![id]);
        let finish = loop {
            let (text, id, finish) = match next_event(&mut rx, &mut detok, deadline).await {
                Ok(Step::More(t, id)) => (t, Some(id), None),
                Ok(Step::End(t, f)) => (t, None, Some(f)),
                Err(e) => {
                    send(json!({"error": {"message": e.message, "code": e.status}}));
                    let _ = tx.send(Ok(SseEvent::default().data("[DONE]")));
                    return;
                }
            };
            n += usize::from(id.is_some());
            let id_list = id.and_then(ids);
            if (!text.is_empty() || id_list.is_some())
                && !send(answer.body(
                    vec![answer.choice(text, id_list.as_deref(), None, true)],
                    None,
                ))
            {
                return; // the client went away: dropping `rx` frees the row
            }
            if let Some(f) = finish {
                break f;
            }
        };
        let last = answer.choice(String::new(), None, Some(finish.reason()), true);
        send(answer.body(vec![last], None));
        if req.include_usage {
            send(answer.body(Vec::new(), Some(usage(req.prompt.len(), n))));
        }
        let (prompt, reason) = (req.prompt.len(), finish.reason());
        tracing::info!(id = %answer.id, prompt, tokens = n, finish = reason, "streamed");
        let _ = tx.send(Ok(SseEvent::default().data("[DONE]")));
    });
    Sse::new(UnboundedReceiverStream::new(out)).into_response()
}

pub(super) async fn embeddings(State(app): State<Arc<App>>, body: Bytes) -> Response {
    match embedding_request(&app, &body) {
        Ok(batch) => embed(app, batch).await,
        Err(e) => error(e),
    }
}

async fn embed(app: Arc<App>, batch: TokenBatch) -> Response {
    let tokens: usize = match &batch.mask {
        Some(mask) => mask.iter().flatten().filter(|&&m| m != 0).count(),
        None => batch.ids.iter().map(Vec::len).sum(),
    };
    let (reply, answer) = oneshot::channel();
    if app
        .engine
        .send(Command::Embed(Embedding { batch, reply }))
        .is_err()
    {
        return error(ApiError {
            status: 503,
            message: "the engine has stopped".into(),
            param: None,
        });
    }
    let rows = match tokio::time::timeout(app.timeout, answer).await {
        Ok(Ok(Ok(rows))) => rows,
        Ok(Ok(Err(e))) => return error(runtime_error(e)),
        Ok(Err(_)) => {
            return error(ApiError {
                status: 500,
                message: "the engine stopped".into(),
                param: None,
            })
        }
        Err(_) => {
            return error(ApiError {
                status: 504,
                message: "the request took longer than the server's --request-timeout".into(),
                param: None,
            })
        }
    };
    let data: Vec<Value> = rows
        .into_iter()
        .enumerate()
        .map(|(i, e)| json!({"object": "embedding", "index": i, "embedding": e}))
        .collect();
    let usage = json!({"prompt_tokens": tokens, "total_tokens": tokens});
    Json(json!({"object": "list", "data": data, "model": app.model, "usage": usage}))
        .into_response()
}

pub(super) async fn models(State(app): State<Arc<App>>) -> Response {
    let model = json!({
        "id": app.model, "object": "model", "created": app.created, "owned_by": "kiln",
        "max_model_len": app.context,
    });
    Json(json!({"object": "list", "data": [model]})).into_response()
}

pub(super) async fn health(State(app): State<Arc<App>>) -> Response {
    let failed = app
        .shared
        .failed
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let (status, state) = if let Some(why) = failed {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            json!({"status": "failed", "error": why}),
        )
    } else if app.shared.draining.load(Ordering::SeqCst) {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            json!({"status": "draining"}),
        )
    } else if app.shared.ready.load(Ordering::SeqCst) {
        (StatusCode::OK, json!({"status": "ok"}))
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            json!({"status": "loading"}),
        )
    };
    (status, Json(state)).into_response()
}

pub(super) async fn metrics_text(State(app): State<Arc<App>>) -> Response {
    let content_type = "application/openmetrics-text; version=1.0.0; charset=utf-8";
    ([(header::CONTENT_TYPE, content_type)], app.metrics.render()).into_response()
}
