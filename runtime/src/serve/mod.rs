//! `kiln-run serve`: an OpenAI-compatible HTTP server (axum on tokio) over one artifact.
//!
//! The HTTP side parses and checks requests ([`api`]), tokenises and renders chat templates
//! ([`text`]), and streams answers; one engine thread ([`engine`]) owns the executor and runs the
//! continuous batching loop of [`crate::batcher`]. They meet through channels: a bounded number of
//! requests may wait for a row (past it the server answers 503 with `Retry-After`), and a request
//! whose client goes away frees its row at the next step. Nothing is compiled or captured after
//! load; `/health` answers 503 until the executor is loaded and while draining.

pub mod api;
pub mod engine;
pub mod metrics;
pub mod text;

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kiln_ir::inputs::TokenBatch;
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::UnboundedReceiverStream;

use self::api::{ApiError, Endpoint, Input, Prompt};
use self::engine::{Command, Embedding, Event, Finish, Generation, Shared};
use self::metrics::Metrics;
use self::text::{ChatTemplate, Detokenizer};
use crate::batcher::Job;
use crate::generate::{check_prompt, Sampling};
use crate::tokenizer::TextTokenizer;
use crate::{Artifact, Device, Executor, RuntimeError, Work};

/// How `kiln-run serve` runs.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    /// The artifact folder.
    pub artifact: PathBuf,
    /// Where requests run.
    pub device: Device,
    /// The address to listen on.
    pub host: String,
    /// The port (0 picks a free one; the bound address is printed).
    pub port: u16,
    /// Requests that may wait for a free row before the server answers 503.
    pub max_queue: usize,
    /// A request still running after this long is ended (504, or an error event).
    pub request_timeout: Duration,
    /// On SIGTERM or Ctrl-C: how long running requests may take to finish.
    pub drain: Duration,
    /// Prompt chunks run between two decode steps.
    pub chunks_per_step: usize,
    /// The model's name in the API (default: the artifact folder's name).
    pub model_name: Option<String>,
}

/// What the handlers share.
struct App {
    model: String,
    created: u64,
    tokenizer: Option<TextTokenizer>,
    chat: Option<ChatTemplate>,
    eos: Vec<i64>,
    context: usize,
    vocab: usize,
    decoder: bool,
    embeds: bool,
    engine: mpsc::UnboundedSender<Command>,
    shared: Arc<Shared>,
    metrics: Arc<Metrics>,
    max_queue: usize,
    timeout: Duration,
}

/// Serves `opts.artifact` until SIGTERM or Ctrl-C (then drains) or until loading fails; writes
/// `listening on http://ADDR` to `out` once the port is bound.
pub fn serve(opts: ServeOptions, out: &mut dyn Write) -> Result<(), RuntimeError> {
    let art = Artifact::open(&opts.artifact)?;
    let m = &art.manifest;
    let cuda = match opts.device {
        Device::Cuda => true,
        Device::Auto => crate::cuda::probe().is_ok(),
        Device::Cpu | Device::Interpreter => false,
    };
    let tokenizer = m.tokenizer.is_some().then(|| art.tokenizer()).transpose()?;
    let (engine, commands) = mpsc::unbounded_channel();
    let shared = Arc::new(Shared::default());
    let metrics = Arc::new(Metrics::new(cuda));
    let model = opts.model_name.clone().unwrap_or_else(|| {
        let name = opts.artifact.file_name().map(|n| n.to_string_lossy());
        name.map_or_else(
            || "kiln".into(),
            |n| n.trim_end_matches(".kiln").to_string(),
        )
    });
    let app = Arc::new(App {
        model,
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        tokenizer,
        chat: ChatTemplate::of(&art)?,
        eos: text::eos_ids(&art)?,
        context: m.decode.iter().filter_map(|e| e.context).max().unwrap_or(0),
        vocab: m.model.vocab_size,
        decoder: m.model.decoder,
        embeds: m.model.outputs.iter().any(|o| o == "sentence_embedding"),
        engine,
        shared: shared.clone(),
        metrics: metrics.clone(),
        max_queue: opts.max_queue,
        timeout: opts.request_timeout,
    });
    let runtime = tokio::runtime::Runtime::new()
        .map_err(|e| RuntimeError::Device(format!("cannot start the async runtime: {e}")))?;
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind((
            opts.host.as_str(),
            opts.port,
        )))
        .map_err(|e| {
            RuntimeError::Request(format!("cannot listen on {}:{}: {e}", opts.host, opts.port))
        })?;
    let addr: SocketAddr = listener
        .local_addr()
        .map_err(|e| RuntimeError::Device(format!("the listener has no address: {e}")))?;
    let (ended_tx, ended_rx) = oneshot::channel();
    let (device, chunks) = (opts.device, opts.chunks_per_step);
    let engine = std::thread::Builder::new()
        .name("kiln-engine".into())
        .spawn(move || {
            let result = run_engine(art, device, commands, &shared, &metrics, chunks);
            if let Err(e) = &result {
                tracing::error!(error = %e, "the engine stopped");
                *shared.failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
            }
            let _ = ended_tx.send(());
            result
        })
        .map_err(|e| RuntimeError::Device(format!("cannot start the engine thread: {e}")))?;
    writeln!(out, "listening on http://{addr}")
        .and_then(|()| out.flush())
        .map_err(|e| RuntimeError::Device(format!("cannot write to stdout: {e}")))?;
    tracing::info!(%addr, model = %app.model, "listening");
    let drain = opts.drain;
    let router = router(app.clone());
    runtime
        .block_on(async move {
            axum::serve(listener, router)
                .with_graceful_shutdown(shutdown(app, ended_rx, drain))
                .await
        })
        .map_err(|e| RuntimeError::Device(format!("the server failed: {e}")))?;
    engine
        .join()
        .map_err(|_| RuntimeError::Device("the engine thread panicked".into()))?
}

/// Loads the executor on this thread (a CUDA context belongs to the thread that made it) and
/// runs the engine loop.
fn run_engine(
    art: Artifact,
    device: Device,
    commands: mpsc::UnboundedReceiver<Command>,
    shared: &Shared,
    metrics: &Metrics,
    chunks_per_step: usize,
) -> Result<(), RuntimeError> {
    let work = if art.manifest.model.decoder {
        Work::Generation
    } else {
        Work::All
    };
    let mut exec = Executor::open_for(&art, device, work)?;
    tracing::info!(executor = %exec.describe(), "loaded");
    engine::run(&art, &mut exec, commands, shared, metrics, chunks_per_step)
}

/// Resolves on SIGTERM or Ctrl-C (then tells the engine to drain) or when the engine stops.
async fn shutdown(app: Arc<App>, ended: oneshot::Receiver<()>, drain: Duration) {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
        _ = ended => return,
    }
    tracing::info!(seconds = drain.as_secs_f64(), "draining");
    app.shared.draining.store(true, Ordering::SeqCst);
    let _ = app.engine.send(Command::Drain(Instant::now() + drain));
}

fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .fallback(|| async {
            error(ApiError {
                status: 404,
                message: "no such endpoint".into(),
                param: None,
            })
        })
        .with_state(app)
}

/// An OpenAI-style JSON error.
fn error(e: ApiError) -> Response {
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
fn runtime_error(e: RuntimeError) -> ApiError {
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

/// A generation, checked and ready for the engine.
struct Request {
    prompt: Vec<i64>,
    max_new: usize,
    sampling: Sampling,
    stops: Vec<String>,
    stop_ids: Vec<i64>,
    stream: bool,
    include_usage: bool,
    return_token_ids: bool,
    chat: bool,
}

async fn completions(State(app): State<Arc<App>>, body: Bytes) -> Response {
    match completion_request(&app, &body) {
        Ok(req) => generate(app, req).await,
        Err(e) => error(e),
    }
}

async fn chat_completions(State(app): State<Arc<App>>, body: Bytes) -> Response {
    match chat_request(&app, &body) {
        Ok(req) => generate(app, req).await,
        Err(e) => error(e),
    }
}

fn completion_request(app: &App, body: &[u8]) -> Result<Request, ApiError> {
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

fn chat_request(app: &App, body: &[u8]) -> Result<Request, ApiError> {
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
fn tokenizer<'a>(app: &'a App, param: &str) -> Result<&'a TextTokenizer, ApiError> {
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
fn settle(
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
fn check_model(app: &App, model: Option<&str>) -> Result<(), ApiError> {
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
fn random_seed() -> i64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish() as i64
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
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
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
    tracing::info!(id = %answer.id, prompt = req.prompt.len(), tokens = n, finish = finish.reason(), "answered");
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
            let first = json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null});
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
        tracing::info!(id = %answer.id, prompt = req.prompt.len(), tokens = n, finish = finish.reason(), "streamed");
        let _ = tx.send(Ok(SseEvent::default().data("[DONE]")));
    });
    Sse::new(UnboundedReceiverStream::new(out)).into_response()
}

async fn embeddings(State(app): State<Arc<App>>, body: Bytes) -> Response {
    match embedding_request(&app, &body) {
        Ok(batch) => embed(app, batch).await,
        Err(e) => error(e),
    }
}

fn embedding_request(app: &App, body: &[u8]) -> Result<TokenBatch, ApiError> {
    let mut map = api::object(body, Endpoint::Embeddings)?;
    let model: Option<String> = api::field(&mut map, "model")?;
    check_model(app, model.as_deref())?;
    if app.decoder || !app.embeds {
        let message = format!("model `{}` has no sentence embeddings (an encoder compiled from a sentence-transformers folder serves them)", app.model);
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
    Json(json!({"object": "list", "data": data, "model": app.model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})).into_response()
}

async fn models(State(app): State<Arc<App>>) -> Response {
    let model = json!({"id": app.model, "object": "model", "created": app.created, "owned_by": "kiln", "max_model_len": app.context});
    Json(json!({"object": "list", "data": [model]})).into_response()
}

async fn health(State(app): State<Arc<App>>) -> Response {
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

async fn metrics_text(State(app): State<Arc<App>>) -> Response {
    let content_type = "application/openmetrics-text; version=1.0.0; charset=utf-8";
    ([(header::CONTENT_TYPE, content_type)], app.metrics.render()).into_response()
}
