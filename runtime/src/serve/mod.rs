//! `kiln-run serve`: an OpenAI-compatible HTTP server (axum on tokio) over one artifact.
//!
//! The HTTP side parses and checks requests ([`api`]), tokenises and renders chat templates
//! ([`text`]), and streams answers; one engine thread ([`engine`]) owns the executor and runs the
//! continuous batching loop of [`crate::batcher`]. They meet through channels: a bounded number of
//! requests may wait for a row (past it the server answers 503 with `Retry-After`), and a request
//! whose client goes away frees its row at the next step. Nothing is compiled or captured after
//! load; `/health` answers 503 until the executor is loaded and while draining.

mod answers;
pub mod api;
pub mod engine;
pub mod metrics;
mod requests;
pub mod text;

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::routing::{get, post};
use axum::serve::ListenerExt;
use axum::Router;
use tokio::sync::{mpsc, oneshot};

use self::answers::{
    chat_completions, completions, embeddings, error, health, metrics_text, models,
};
use self::api::ApiError;
use self::engine::{Command, Shared};
use self::metrics::Metrics;
use self::text::ChatTemplate;
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
    /// Prompt chunks run between two decode steps, and whether decode steps are launched ahead.
    pub stepping: engine::Stepping,
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
    let (device, stepping) = (opts.device, opts.stepping);
    let engine = std::thread::Builder::new()
        .name("kiln-engine".into())
        .spawn(move || {
            let result = run_engine(art, device, commands, &shared, &metrics, stepping);
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
    // Streamed tokens are small writes: with Nagle's algorithm each would wait behind the
    // client's delayed acknowledgement of the one before.
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::warn!(error = %e, "cannot set TCP_NODELAY on a connection");
        }
    });
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
    stepping: engine::Stepping,
) -> Result<(), RuntimeError> {
    let work = if art.manifest.model.decoder {
        Work::Generation
    } else {
        Work::All
    };
    let mut exec = Executor::open_for(&art, device, work)?;
    tracing::info!(executor = %exec.describe(), "loaded");
    engine::run(&art, &mut exec, commands, shared, metrics, stepping)
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
