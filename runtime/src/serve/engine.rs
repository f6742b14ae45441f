//! The engine thread: it owns the executor (a CUDA context lives on the thread that made it) and
//! runs the continuous batching loop. Requests arrive on a channel; each generation streams its
//! tokens back on its own channel, and a closed channel (the client went away, or its handler
//! timed out) frees the sequence's row at the next step.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Instant;

use kiln_ir::inputs::TokenBatch;
use tokio::sync::{mpsc, oneshot};

use super::metrics::{BucketLabel, FinishLabel, Metrics, StepLabel};
use crate::batcher::{Batcher, Job, SeqId};
use crate::forward::forward;
use crate::{Artifact, Executor, RuntimeError};

/// Why a sequence ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// An end-of-sequence or stop token (not handed out), or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
}

impl Finish {
    /// The OpenAI `finish_reason`.
    pub fn reason(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

/// What a generation's channel carries.
#[derive(Debug)]
pub enum Event {
    /// A new token.
    Token(i64),
    /// The sequence ended.
    Done(Finish),
    /// The request failed (a bad request the engine found, a device error, or shutdown).
    Failed(RuntimeError),
}

/// A generation request.
pub struct Generation {
    /// What to generate.
    pub job: Job,
    /// Tokens that end the sequence (end-of-sequence ids and the request's stop ids).
    pub stop_ids: Vec<i64>,
    /// Where its events go.
    pub events: mpsc::UnboundedSender<Event>,
    /// When the request arrived.
    pub arrived: Instant,
}

/// An embedding request: the batch, and where the sentence embeddings go.
pub struct Embedding {
    /// The tokenised texts.
    pub batch: TokenBatch,
    /// One embedding per text, or the failure.
    pub reply: oneshot::Sender<Result<Vec<Vec<f32>>, RuntimeError>>,
}

/// What the engine is asked to do.
pub enum Command {
    /// Generate.
    Generate(Generation),
    /// Embed.
    Embed(Embedding),
    /// Stop admitting; finish what runs by the deadline, then cancel the rest and exit.
    Drain(Instant),
}

/// State shared with the HTTP side.
#[derive(Default)]
pub struct Shared {
    /// Every graph is captured (the executor is loaded): `/health` answers 200.
    pub ready: AtomicBool,
    /// Shutting down: new requests are refused.
    pub draining: AtomicBool,
    /// Requests sent to the engine and not yet in a row.
    pub waiting: AtomicUsize,
    /// Rows no sequence holds: so many requests get a row at once, the rest queue.
    pub free_rows: AtomicUsize,
    /// Why loading failed, if it did.
    pub failed: std::sync::Mutex<Option<String>>,
}

/// A sequence the engine runs, with what its metrics need.
struct Live {
    events: mpsc::UnboundedSender<Event>,
    stop_ids: Vec<i64>,
    arrived: Instant,
    last_token: Option<Instant>,
}

/// How the engine's batcher steps.
#[derive(Clone, Copy, Debug)]
pub struct Stepping {
    /// Prompt chunks run between two decode steps.
    pub chunks_per_step: usize,
    /// The share of a decode step's time a prompt chunk may add to it
    /// ([`Batcher::with_chunk_budget`]); `None`: any chunk.
    pub chunk_budget: Option<f64>,
    /// Whether each greedy decode step's successor is launched before its tokens go out
    /// ([`Batcher::with_launch_ahead`]).
    pub launch_ahead: bool,
}

/// Loads `art` on `exec`'s device and serves `commands` until they end or a drain finishes.
pub fn run(
    art: &Artifact,
    exec: &mut Executor,
    commands: mpsc::UnboundedReceiver<Command>,
    shared: &Shared,
    metrics: &Metrics,
    stepping: Stepping,
) -> Result<(), RuntimeError> {
    if !art.manifest.model.decoder {
        shared.ready.store(true, Ordering::SeqCst);
        return serve_encoder(art, exec, commands);
    }
    let mut batcher = Batcher::new(art, exec)?
        .with_chunks_per_step(stepping.chunks_per_step)
        .with_launch_ahead(stepping.launch_ahead);
    if let Some(fraction) = stepping.chunk_budget {
        batcher = batcher.with_chunk_budget(fraction);
    }
    shared.free_rows.store(batcher.capacity(), Ordering::SeqCst);
    shared.ready.store(true, Ordering::SeqCst);
    Loop {
        batcher,
        commands,
        shared,
        metrics,
        waiting: VecDeque::new(),
        live: HashMap::new(),
        next_id: 0,
        deadline: None,
    }
    .run()
}

/// An encoder's engine: embedding requests, one forward each.
fn serve_encoder(
    art: &Artifact,
    exec: &mut Executor,
    mut commands: mpsc::UnboundedReceiver<Command>,
) -> Result<(), RuntimeError> {
    while let Some(command) = commands.blocking_recv() {
        match command {
            Command::Embed(e) => {
                let _ = e.reply.send(embed_in_parts(art, exec, &e.batch));
            }
            Command::Generate(g) => {
                let why = "this model is an encoder: it serves /v1/embeddings only";
                let _ = g
                    .events
                    .send(Event::Failed(RuntimeError::Request(why.into())));
            }
            Command::Drain(_) => break,
        }
    }
    Ok(())
}

/// The sentence embeddings of `batch`, run in parts of at most the largest prefill batch (extra
/// padding columns of a part are masked and change nothing).
fn embed_in_parts(
    art: &Artifact,
    exec: &mut Executor,
    batch: &TokenBatch,
) -> Result<Vec<Vec<f32>>, RuntimeError> {
    let most = art
        .manifest
        .prefill
        .iter()
        .map(|e| e.batch)
        .max()
        .unwrap_or(1);
    let mut rows = Vec::with_capacity(batch.ids.len());
    for start in (0..batch.ids.len()).step_by(most.max(1)) {
        let end = (start + most).min(batch.ids.len());
        let part = TokenBatch {
            ids: batch.ids[start..end].to_vec(),
            mask: batch.mask.as_ref().map(|m| m[start..end].to_vec()),
            types: batch.types.as_ref().map(|t| t[start..end].to_vec()),
        };
        rows.extend(embeddings(&forward(art, exec, &part)?)?);
    }
    Ok(rows)
}

/// The rows of a forward pass's `sentence_embedding`.
fn embeddings(
    outputs: &std::collections::BTreeMap<String, kiln_ir::Tensor>,
) -> Result<Vec<Vec<f32>>, RuntimeError> {
    let emb = outputs.get("sentence_embedding").ok_or_else(|| {
        RuntimeError::Request("the model has no sentence_embedding output".into())
    })?;
    let values = emb
        .as_f32()
        .ok_or_else(|| RuntimeError::Request("sentence_embedding is not a float tensor".into()))?;
    Ok(values
        .chunks(emb.shape[1].max(1))
        .map(<[f32]>::to_vec)
        .collect())
}

/// The decoder's scheduling loop.
struct Loop<'b, 'a> {
    batcher: Batcher<'a>,
    commands: mpsc::UnboundedReceiver<Command>,
    shared: &'b Shared,
    metrics: &'b Metrics,
    waiting: VecDeque<Generation>,
    live: HashMap<SeqId, Live>,
    next_id: SeqId,
    deadline: Option<Instant>,
}

impl Loop<'_, '_> {
    fn run(mut self) -> Result<(), RuntimeError> {
        loop {
            let idle = self.batcher.is_idle() && self.waiting.is_empty();
            if idle && self.deadline.is_some() {
                return Ok(());
            }
            if idle {
                match self.commands.blocking_recv() {
                    Some(c) => self.take(c),
                    None => return Ok(()),
                }
            }
            while let Ok(c) = self.commands.try_recv() {
                self.take(c);
            }
            if self.deadline.is_some_and(|d| Instant::now() >= d) {
                self.cancel_all("the server is shutting down");
                return Ok(());
            }
            // Cancelling and admitting first read a step launched ahead, so they fail as a
            // step does.
            let stepped = self
                .drop_cancelled()
                .and_then(|()| self.admit())
                .and_then(|()| self.step());
            if let Err(e) = stepped {
                // A failed step leaves the rows' caches unknown: every running sequence fails.
                tracing::error!(error = %e, "decode step failed");
                self.fail_running(&e.to_string())?;
            }
            self.publish();
        }
    }

    /// Queues a generation, or answers an embedding request (this engine has none), or starts
    /// the drain.
    fn take(&mut self, command: Command) {
        match command {
            Command::Generate(g) => self.waiting.push_back(g),
            Command::Embed(e) => {
                let why = "this model is a decoder: /v1/embeddings needs an encoder";
                let _ = e.reply.send(Err(RuntimeError::Request(why.into())));
            }
            Command::Drain(deadline) => self.deadline = Some(deadline),
        }
    }

    /// Frees the rows and queue places of requests whose clients went away.
    fn drop_cancelled(&mut self) -> Result<(), RuntimeError> {
        let gone: Vec<SeqId> = self
            .live
            .iter()
            .filter(|(_, l)| l.events.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            self.batcher.retire(id)?;
            self.live.remove(&id);
            self.finished("cancelled");
        }
        let before = self.waiting.len();
        self.waiting.retain(|g| !g.events.is_closed());
        for _ in self.waiting.len()..before {
            self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
            self.finished("cancelled");
        }
        Ok(())
    }

    /// Moves waiting requests into free rows, in arrival order.
    fn admit(&mut self) -> Result<(), RuntimeError> {
        while let Some(g) = self.waiting.front() {
            if let Err(e) = self.batcher.check(&g.job) {
                let g = self.waiting.pop_front().expect("front exists");
                self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
                let _ = g.events.send(Event::Failed(e));
                self.finished("error");
                continue;
            }
            if !self.batcher.can_admit(&g.job) {
                break;
            }
            let g = self.waiting.pop_front().expect("front exists");
            self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
            let id = self.next_id;
            self.next_id += 1;
            self.metrics.prompt_tokens.inc_by(g.job.prompt.len() as u64);
            self.metrics
                .queue_time
                .observe(g.arrived.elapsed().as_secs_f64());
            self.batcher.admit(id, g.job)?;
            self.live.insert(
                id,
                Live {
                    events: g.events,
                    stop_ids: g.stop_ids,
                    arrived: g.arrived,
                    last_token: None,
                },
            );
        }
        Ok(())
    }

    /// One batcher step; each chosen token goes to its sequence.
    fn step(&mut self) -> Result<(), RuntimeError> {
        if self.batcher.is_idle() {
            return Ok(());
        }
        let started = Instant::now();
        let emitted = self.batcher.step()?;
        for e in emitted {
            let Some(live) = self.live.get_mut(&e.id) else {
                continue;
            };
            let now = Instant::now();
            match live.last_token {
                None => self
                    .metrics
                    .time_to_first_token
                    .observe((now - live.arrived).as_secs_f64()),
                Some(t) => self.metrics.inter_token.observe((now - t).as_secs_f64()),
            }
            live.last_token = Some(now);
            self.metrics.generated_tokens.inc();
            let finish = if live.stop_ids.contains(&e.token) {
                Some(Finish::Stop)
            } else {
                let _ = live.events.send(Event::Token(e.token));
                e.last.then_some(Finish::Length)
            };
            if let Some(finish) = finish {
                let _ = live.events.send(Event::Done(finish));
                self.metrics
                    .end_to_end
                    .observe(live.arrived.elapsed().as_secs_f64());
                self.live.remove(&e.id);
                if !e.last {
                    self.batcher.retire(e.id)?;
                }
                self.finished(finish.reason());
            }
        }
        let kind = if self.batcher.last_chunks > 0 {
            "prompt_chunks"
        } else {
            "decode"
        };
        self.metrics
            .step_seconds
            .get_or_create(&StepLabel { kind: kind.into() })
            .observe(started.elapsed().as_secs_f64());
        Ok(())
    }

    /// Fails every running sequence with `why` and frees its row.
    fn fail_running(&mut self, why: &str) -> Result<(), RuntimeError> {
        for (id, live) in std::mem::take(&mut self.live) {
            let _ = live
                .events
                .send(Event::Failed(RuntimeError::Device(why.into())));
            self.batcher.retire(id)?;
            self.finished("error");
        }
        Ok(())
    }

    /// Ends every request, running or waiting, with `why`.
    fn cancel_all(&mut self, why: &str) {
        let error = || Event::Failed(RuntimeError::Device(why.into()));
        for live in std::mem::take(&mut self.live).into_values() {
            let _ = live.events.send(error());
            self.finished("cancelled");
        }
        for g in std::mem::take(&mut self.waiting) {
            self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
            let _ = g.events.send(error());
            self.finished("cancelled");
        }
    }

    fn finished(&self, reason: &str) {
        let label = FinishLabel {
            reason: reason.to_string(),
        };
        self.metrics.finished.get_or_create(&label).inc();
    }

    /// Sets the gauges, replay counts and the driver's work since load.
    fn publish(&self) {
        let m = self.metrics;
        if let Executor::Cuda(c) = self.batcher.executor() {
            let after = c.after_load();
            m.captures_after_load.set(after.captures as i64);
            m.compilations_after_load.set(after.module_loads as i64);
        }
        m.running.set(self.batcher.active() as i64);
        m.chunk_limit.set(self.batcher.chunk_limit().unwrap_or(0.0));
        m.cache_tokens_used.set(self.batcher.cached_tokens() as i64);
        if let Some((used, blocks)) = self.batcher.kv_blocks() {
            m.kv_blocks_used.set(used as i64);
            m.kv_blocks.set(blocks as i64);
        }
        m.waiting
            .set(self.shared.waiting.load(Ordering::SeqCst) as i64);
        for (bucket, n) in &self.batcher.runs {
            let label = BucketLabel {
                bucket: bucket.clone(),
            };
            let counter = m.replays.get_or_create(&label);
            counter.inc_by(n.saturating_sub(counter.get()));
        }
    }
}
