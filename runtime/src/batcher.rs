//! Continuous batching over a decoder artifact's KV-cached buckets. Every sequence owns one row of
//! the largest decode bucket's cache (of its block table, when the cache is paged); sequences
//! join and leave between steps, and each step runs the smallest one-token decode bucket that
//! covers the occupied rows (rows without a token this step are masked, so they write nothing).
//! A prompt but its last token enters the cache through
//! the chunk buckets, whose batch of `P` rows works on rows `0..P`: a joining sequence takes one of
//! them (a decoding occupant moves to a free row first) and fills it chunk by chunk, beside the
//! other prompts filling there and interleaved with the others' decode steps; of several chunk
//! sizes, each chunk step takes the smallest that holds what the filling prompts have left, else
//! the largest, and with a chunk budget ([`Batcher::with_chunk_budget`]) no larger one than
//! [`crate::pacing`] predicts to fit it. Without a chunk bucket, prompts enter one token per
//! decode step in their own rows. The last prompt token then goes through a decode step, whose
//! logits choose the first new token. Rows are compacted when a sequence leaves (a filling
//! sequence only ever moves down, so it stays in the chunk rows), so the bucket stays as small
//! as the batch.
//!
//! A paged cache ([`crate::blocks`]) gives each row the blocks its keys reach, out of what the
//! sequence was promised when it joined: a sequence joins only when a row is free and the
//! blocks it can come to need are unpromised, so a running sequence never runs out; rows move by
//! moving their table rows. A dense cache gives each row the whole context and moves rows by
//! copying them.
//!
//! A sequence's tokens do not depend on its neighbours, its row or the bucket it runs in: the
//! executors' decode products are batch-invariant (see ARCHITECTURE.md), cache rows move by
//! exact copies (or not at all), and each sequence samples from its own stream (step `i` of its
//! own seed).

use std::collections::BTreeMap;

use kiln_ir::artifact::{BucketEntry, LOGITS};
use kiln_ir::{Data, Graph, Tensor};

use crate::blocks::BlockPool;
use crate::generate::{check_prompt, chosen, Sampling};
use crate::pacing::Pacing;
use crate::{Artifact, Executor, RuntimeError};

/// The caller's name for a sequence.
pub type SeqId = u64;

/// What to generate: `max_new` tokens after `prompt` under `sampling`.
#[derive(Clone, Debug, PartialEq)]
pub struct Job {
    /// The prompt's token ids (at least one).
    pub prompt: Vec<i64>,
    /// How many tokens to generate (at least one).
    pub max_new: usize,
    /// How each token is chosen.
    pub sampling: Sampling,
}

/// A token a step chose for a sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Emitted {
    /// The sequence.
    pub id: SeqId,
    /// The token.
    pub token: i64,
    /// Whether it was the sequence's last (`max_new` reached; the sequence has left).
    pub last: bool,
}

/// A sequence in its row.
struct Seq {
    id: SeqId,
    job: Job,
    /// Prompt tokens in the cache.
    filled: usize,
    generated: Vec<i64>,
}

impl Seq {
    /// Keys the sequence can come to write: its prompt and its new tokens but the last.
    fn keys(job: &Job) -> usize {
        job.prompt.len() + job.max_new - 1
    }

    /// Keys in the cache (the position of the next token to enter it).
    fn cached(&self) -> usize {
        self.filled + self.generated.len()
    }

    /// Prompt tokens to put in the cache before the last one goes through a decode step.
    fn head(&self) -> usize {
        self.job.prompt.len() - 1
    }

    /// Whether the prompt head is still entering the cache.
    fn filling(&self) -> bool {
        self.filled < self.head()
    }
}

/// What one row does in a decode step.
enum Work {
    /// Nothing (no sequence, or a prompt filling through the chunk bucket): masked.
    Idle,
    /// Puts a prompt token in the cache; its logits are not needed.
    Feed,
    /// Chooses the sequence's next token.
    Choose,
}

/// Sequences decoded together through one artifact's decode buckets (see the module docs).
pub struct Batcher<'a> {
    session: Session<'a>,
    /// The one-token decode buckets, by batch ascending.
    steps: Vec<&'a BucketEntry>,
    /// The prompt chunk buckets, by tokens ascending (all of one batch).
    chunks: Vec<&'a BucketEntry>,
    rows: Vec<Option<Seq>>,
    /// The paged cache's blocks; `None` for a dense cache.
    blocks: Option<BlockPool>,
    /// Prompt chunks run before each decode step (the per-step prompt budget).
    chunks_per_step: usize,
    /// The chunk buckets' measured times and the decode steps' pace, which size the chunks.
    pacing: Pacing,
    /// When the last decode-only [`Batcher::step`] began, and the steps it ran: the next one
    /// times it (from start to start, the caller's work between steps included).
    decode_began: Option<(std::time::Instant, usize)>,
    /// Decode steps one [`Batcher::step`] may chain (see
    /// [`Batcher::with_steps_ahead`]).
    steps_ahead: usize,
    /// Whether a decode step's successor is launched before its tokens are handed out (see
    /// [`Batcher::with_launch_ahead`]).
    launch_ahead: bool,
    /// The decode step launched ahead and not read yet: its bucket, and each row's work.
    in_flight: Option<(&'a BucketEntry, Vec<Work>)>,
    /// Tokens of the step launched ahead, read before an admission or a retirement, that the
    /// next [`Batcher::step`] hands out.
    ready: Vec<Emitted>,
    /// Seconds spent in decode steps in which every sequence was past its prompt.
    pub decode_seconds: f64,
    /// Prompt chunk steps the last [`Batcher::step`] ran before its decode step.
    pub last_chunks: usize,
    /// Runs per bucket graph file.
    pub runs: BTreeMap<String, u64>,
    /// Decode steps launched ahead ([`Batcher::with_launch_ahead`]).
    pub launched_ahead: u64,
}

impl<'a> Batcher<'a> {
    /// A batcher over `art`'s decode buckets on `exec`, with an empty cache.
    pub fn new(art: &'a Artifact, exec: &'a mut Executor) -> Result<Batcher<'a>, RuntimeError> {
        let m = &art.manifest;
        if !m.model.decoder {
            return Err(RuntimeError::Request(format!(
                "{} is an encoder; generation needs a decoder",
                m.architecture
            )));
        }
        let largest = largest_step(art)?;
        let mut steps: Vec<&BucketEntry> = m.decode.iter().filter(|e| e.seq == 1).collect();
        steps.sort_by_key(|e| e.batch);
        let mut chunks: Vec<&BucketEntry> = m.decode.iter().filter(|e| e.seq > 1).collect();
        chunks.sort_by_key(|e| e.seq);
        if let Some(c) = chunks.iter().find(|c| c.batch != chunks[0].batch) {
            return Err(RuntimeError::Request(format!(
                "prompt chunks of {} and {} rows; every chunk bucket must take the same rows",
                chunks[0].batch, c.batch
            )));
        }
        if let Some(c) = chunks.first().filter(|c| c.batch > largest.batch) {
            return Err(RuntimeError::Request(format!(
                "the prompt chunk takes {} rows; the largest decode bucket has {}",
                c.batch, largest.batch
            )));
        }
        // The table holds a row for each of `largest`'s (checked when the artifact was opened).
        let blocks = m.memory.paging.map(BlockPool::new);
        exec.reset_cache()?;
        let session = Session::new(art, exec, largest)?;
        let pacing = Pacing::new(chunks.iter().map(|c| c.seq).collect(), None);
        Ok(Batcher {
            session,
            steps,
            chunks,
            rows: (0..largest.batch).map(|_| None).collect(),
            blocks,
            chunks_per_step: 1,
            pacing,
            decode_began: None,
            steps_ahead: 1,
            launch_ahead: false,
            in_flight: None,
            ready: Vec::new(),
            decode_seconds: 0.0,
            last_chunks: 0,
            runs: BTreeMap::new(),
            launched_ahead: 0,
        })
    }

    /// Sets how many prompt chunks run before each decode step (at least one).
    pub fn with_chunks_per_step(mut self, n: usize) -> Batcher<'a> {
        self.chunks_per_step = n.max(1);
        self
    }

    /// Limits each prompt chunk to `fraction` of a decode step's time (a positive fraction; of
    /// the largest chunk's at a prompt's start when that is longer, see [`crate::pacing`]): a
    /// chunk step then takes the largest chunk bucket [`Pacing`] predicts to fit, so the
    /// sequences decoding beside a prompt wait at most that much longer for their token. The
    /// times are measured as the batcher runs; the tokens do not depend on them.
    pub fn with_chunk_budget(mut self, fraction: f64) -> Batcher<'a> {
        self.pacing.limit_to(fraction);
        self
    }

    /// Lets one [`Batcher::step`] run up to `n` decode steps (at most [`crate::cuda::MAX_STEPS`])
    /// back to back, when every sequence is past its prompt, chooses greedily and wants at least
    /// that many more tokens, and the executor can chain steps (the tokens a step chooses become
    /// the next step's ids: on CUDA on the device, the host reading them after the last; on the
    /// CPU executor on the host, as the device does it). The tokens are those of single steps;
    /// only when the caller sees them changes, so this suits a caller that admits and retires
    /// sequences by itself between calls, not one that must act on every token.
    pub fn with_steps_ahead(mut self, n: usize) -> Batcher<'a> {
        self.steps_ahead = n.clamp(1, crate::cuda::MAX_STEPS);
        self
    }

    /// Launches each greedy decode step's successor before [`Batcher::step`] returns, when
    /// every sequence is past its prompt, chooses greedily and stays (none finished in the step)
    /// and the executor can run a step over the inputs the last one left (CUDA: each step's
    /// tokens become the next step's ids on the device): the caller's work between steps then
    /// runs while the GPU computes. The next `step` hands out that step's tokens; an admission
    /// or a retirement first reads them (a retired sequence's are dropped). The tokens are those
    /// of single steps.
    pub fn with_launch_ahead(mut self, on: bool) -> Batcher<'a> {
        self.launch_ahead = on;
        self
    }

    /// How many sequences can decode together (the largest decode batch).
    pub fn capacity(&self) -> usize {
        self.rows.len()
    }

    /// The compiled context: a sequence's prompt and new tokens together.
    pub fn context(&self) -> usize {
        self.session.context
    }

    /// Seconds a prompt chunk may take now under the chunk budget (see [`crate::pacing`]);
    /// `None` without a budget or before a decode step was timed.
    pub fn chunk_limit(&self) -> Option<f64> {
        self.pacing.limit()
    }

    /// Sequences in rows.
    pub fn active(&self) -> usize {
        self.rows.iter().flatten().count()
    }

    /// The executor the steps run on.
    pub fn executor(&self) -> &Executor {
        self.session.exec
    }

    /// Tokens whose keys and values the sequences hold in the cache.
    pub fn cached_tokens(&self) -> usize {
        self.rows.iter().flatten().map(Seq::cached).sum()
    }

    /// The paged cache's blocks the sequences hold, and all its blocks; `None` for a dense
    /// cache.
    pub fn kv_blocks(&self) -> Option<(usize, usize)> {
        self.blocks.as_ref().map(|p| (p.used(), p.capacity()))
    }

    /// Blocks of the paged cache `job` can come to need (0 for a dense cache).
    fn blocks_needed(&self, job: &Job) -> usize {
        self.blocks
            .as_ref()
            .map_or(0, |p| p.blocks_for(Seq::keys(job)))
    }

    /// Whether no sequence is in a row.
    pub fn is_idle(&self) -> bool {
        self.active() == 0 && self.ready.is_empty() && self.in_flight.is_none()
    }

    /// `Err` naming what is wrong with `job` for this artifact.
    pub fn check(&self, job: &Job) -> Result<(), RuntimeError> {
        job.sampling.validate()?;
        if job.max_new == 0 {
            return Err(RuntimeError::Request(
                "at least one new token must be asked for".into(),
            ));
        }
        check_prompt(&job.prompt, job.max_new, self.context(), self.session.vocab)
            .map_err(RuntimeError::Request)
    }

    /// Whether `job` can join now: a row is free, the blocks it can come to need are
    /// unpromised (a paged cache; every job [`Batcher::check`] passes fits the empty cache, which
    /// holds a whole context beside block 0) and, if its prompt enters through the chunk bucket,
    /// one of the chunk's rows holds no other prompt still filling.
    pub fn can_admit(&self, job: &Job) -> bool {
        let free = self.rows.iter().any(Option::is_none);
        let blocks = self
            .blocks
            .as_ref()
            .is_none_or(|p| p.unpromised() >= self.blocks_needed(job));
        free && blocks
            && (!self.fills_by_chunk(job.prompt.len()) || self.open_chunk_row().is_some())
    }

    /// Puts `job` in a row as sequence `id` (see [`Batcher::can_admit`]); nothing runs until the
    /// next [`Batcher::step`].
    pub fn admit(&mut self, id: SeqId, job: Job) -> Result<(), RuntimeError> {
        self.check(&job)?;
        self.settle()?;
        if !self.can_admit(&job) {
            return Err(RuntimeError::Request(format!(
                "sequence {id} cannot join now: no row is free, the KV cache's blocks are promised, or prompts fill every chunk row"
            )));
        }
        let need = self.blocks_needed(&job);
        let row = if self.fills_by_chunk(job.prompt.len()) {
            let row = self.open_chunk_row().expect("can_admit found a chunk row");
            if self.rows[row].is_some() {
                let free = self.free_row().expect("can_admit found a free row");
                self.move_row(row, free)?;
            }
            row
        } else {
            self.free_row().expect("can_admit found a free row")
        };
        if let Some(p) = self.blocks.as_mut() {
            let promised = p.promise(row, need);
            debug_assert!(promised, "can_admit found the blocks unpromised");
        }
        self.rows[row] = Some(Seq {
            id,
            job,
            filled: 0,
            generated: Vec::new(),
        });
        Ok(())
    }

    /// Removes sequence `id` (finished or cancelled); `false` if it is not in a row.
    pub fn retire(&mut self, id: SeqId) -> Result<bool, RuntimeError> {
        self.settle()?;
        self.ready.retain(|e| e.id != id);
        let Some(row) = self.row_of(id) else {
            return Ok(false);
        };
        self.rows[row] = None;
        if let Some(p) = self.blocks.as_mut() {
            p.release(row);
        }
        // The highest occupied row moves down into the hole, keeping the rows dense.
        if let Some(high) = self.rows.iter().rposition(Option::is_some) {
            if high > row {
                self.move_row(high, row)?;
            }
        }
        Ok(true)
    }

    /// Runs the prompt chunks of this step and one decode step over every sequence that has a
    /// token to put in (or several chained ones, see [`Batcher::with_steps_ahead`]); returns the
    /// tokens chosen, step by step in row order. Sequences that reach their `max_new` leave
    /// (their [`Emitted::last`] is set).
    pub fn step(&mut self) -> Result<Vec<Emitted>, RuntimeError> {
        let started = std::time::Instant::now();
        if let Some((began, steps)) = self.decode_began.take() {
            let seconds = started.duration_since(began).as_secs_f64();
            self.pacing.decoded(seconds / steps as f64);
        }
        if let Some((entry, work)) = self.in_flight.take() {
            // Nothing joined or left since it was launched (that would have read it).
            // (`ready` is empty: only `settle` fills it, and it takes the step in flight.)
            let ids = self.ids();
            let emitted = self.read_launched(entry, &work)?;
            self.last_chunks = 0;
            self.launch_next(entry, work, &ids)?;
            self.decode_seconds += started.elapsed().as_secs_f64();
            self.decode_began = Some((started, 1));
            return Ok(emitted);
        }
        if !self.ready.is_empty() {
            self.last_chunks = 0;
            return Ok(std::mem::take(&mut self.ready));
        }
        let ids = self.ids();
        let chunks = self.run_chunks()?;
        self.last_chunks = chunks;
        let work: Vec<Work> = self.rows.iter().map(|s| self.work(s.as_ref())).collect();
        let Some(used) = work.iter().rposition(|w| !matches!(w, Work::Idle)) else {
            return Ok(Vec::new());
        };
        let entry = *self
            .steps
            .iter()
            .find(|e| e.batch > used)
            .expect("the largest decode bucket covers every row");
        let all_decoding = chunks == 0
            && self
                .rows
                .iter()
                .flatten()
                .all(|s| !s.filling() && !s.generated.is_empty());
        let ahead = if all_decoding { self.ahead() } else { 1 };
        let chosen = self.decode(entry, &work, ahead)?;
        *self.runs.entry(entry.graph.clone()).or_default() += chosen.len() as u64;
        // Only the last of chained steps can finish a sequence, so rows move only after it.
        let mut emitted = Vec::new();
        for step in &chosen {
            emitted.extend(self.advance(&work, step)?);
        }
        if all_decoding && chosen.len() == 1 {
            self.launch_next(entry, work, &ids)?;
        }
        if all_decoding {
            self.decode_seconds += started.elapsed().as_secs_f64();
            self.decode_began = Some((started, chosen.len()));
        }
        Ok(emitted)
    }

    /// Runs the decode step `entry` over the rows' `work` (`ahead` chained steps where more
    /// than one, [`Session::next_steps`]) once the KV blocks of the keys it writes are held:
    /// the tokens chosen, a step at a time, each row's where it chose one.
    fn decode(
        &mut self,
        entry: &BucketEntry,
        work: &[Work],
        ahead: usize,
    ) -> Result<Vec<Vec<Option<usize>>>, RuntimeError> {
        let tokens = self.step_tokens(work);
        let rows: Vec<Row> = self.rows[..entry.batch]
            .iter()
            .zip(&tokens)
            .map(|(s, t)| Row::new(t, s.as_ref().map_or(0, Seq::cached)))
            .collect();
        let picks: Vec<Option<(Sampling, u32)>> = self.rows[..entry.batch]
            .iter()
            .zip(work)
            .map(|(s, w)| match (s, w) {
                (Some(s), Work::Choose) => Some((s.job.sampling, s.generated.len() as u32)),
                _ => None,
            })
            .collect();
        // Each row with a token writes its keys at `cached..cached + ahead`.
        let writes: Vec<(usize, usize)> = self
            .rows
            .iter()
            .zip(work)
            .enumerate()
            .filter_map(|(r, (s, w))| match (s, w) {
                (Some(s), Work::Feed | Work::Choose) => Some((r, s.cached() + ahead)),
                _ => None,
            })
            .collect();
        Self::hold_blocks(&mut self.blocks, self.session.exec, writes)?;
        let chained = match ahead {
            1 => None,
            n => self.session.next_steps(entry, &rows, &picks, n)?,
        };
        Ok(match chained {
            Some(chosen) => chosen,
            None => vec![self.session.next(entry, &rows, &picks)?],
        })
    }

    /// The token each row puts in for its `work`: the prompt's next to feed, or the last one
    /// generated (the prompt's last before any) to choose after; none for an idle row.
    fn step_tokens(&self, work: &[Work]) -> Vec<Vec<i64>> {
        self.rows
            .iter()
            .zip(work)
            .map(|(s, w)| match (s, w) {
                (Some(s), Work::Feed) => vec![s.job.prompt[s.filled]],
                (Some(s), Work::Choose) => {
                    vec![*s.generated.last().unwrap_or(&s.job.prompt[s.head()])]
                }
                _ => Vec::new(),
            })
            .collect()
    }

    /// Each row's sequence.
    fn ids(&self) -> Vec<Option<SeqId>> {
        self.rows.iter().map(|s| s.as_ref().map(|s| s.id)).collect()
    }

    /// After the decode step `entry` ran `work` on rows that held `ids`, launches its successor
    /// over the inputs it left (see [`Batcher::with_launch_ahead`]) when the same sequences,
    /// all greedy, are still in their rows.
    fn launch_next(
        &mut self,
        entry: &'a BucketEntry,
        work: Vec<Work>,
        ids: &[Option<SeqId>],
    ) -> Result<(), RuntimeError> {
        let greedy = self
            .rows
            .iter()
            .flatten()
            .all(|s| s.job.sampling.temperature <= 0.0);
        let each_chose = work
            .iter()
            .zip(&self.rows)
            .all(|(w, s)| matches!(w, Work::Choose) == s.is_some());
        if !self.launch_ahead || !greedy || !each_chose || self.ids() != ids {
            return Ok(());
        }
        // Each row writes the key of the token it chose.
        let writes: Vec<(usize, usize)> = self
            .rows
            .iter()
            .enumerate()
            .filter_map(|(r, s)| s.as_ref().map(|s| (r, s.cached() + 1)))
            .collect();
        Self::hold_blocks(&mut self.blocks, self.session.exec, writes)?;
        if self.session.exec.launch_advanced(entry)? {
            *self.runs.entry(entry.graph.clone()).or_default() += 1;
            self.launched_ahead += 1;
            self.in_flight = Some((entry, work));
        }
        Ok(())
    }

    /// Reads the tokens of the step launched ahead, `entry` running `work`, and records them.
    fn read_launched(
        &mut self,
        entry: &BucketEntry,
        work: &[Work],
    ) -> Result<Vec<Emitted>, RuntimeError> {
        let tokens = self.session.exec.read_launched(entry)?;
        let picks: Vec<Option<(Sampling, u32)>> = work
            .iter()
            .map(|w| matches!(w, Work::Choose).then(|| (Sampling::greedy(), 0)))
            .collect();
        let chosen = picked(&picks[..entry.batch], &tokens, self.session.vocab)?;
        self.advance(work, &chosen)
    }

    /// Reads the step launched ahead, if one is in flight, keeping its tokens for the next
    /// [`Batcher::step`] (before the rows change).
    fn settle(&mut self) -> Result<(), RuntimeError> {
        if let Some((entry, work)) = self.in_flight.take() {
            let emitted = self.read_launched(entry, &work)?;
            self.ready.extend(emitted);
        }
        Ok(())
    }

    /// Decode steps the next [`Batcher::step`] may chain: every sequence chooses greedily, and
    /// none wants fewer new tokens (so none finishes before the last step).
    fn ahead(&self) -> usize {
        let mut ahead = self.steps_ahead;
        for s in self.rows.iter().flatten() {
            if s.job.sampling.temperature > 0.0 {
                return 1;
            }
            ahead = ahead.min(s.job.max_new.saturating_sub(s.generated.len()));
        }
        ahead.max(1)
    }

    /// Runs up to `chunks_per_step` steps of the chunk buckets, each taking the next chunk of
    /// every prompt filling the chunk rows; how many ran.
    fn run_chunks(&mut self) -> Result<usize, RuntimeError> {
        let mut ran = 0;
        while ran < self.chunks_per_step {
            let Some(bucket) = self.next_chunk() else {
                break;
            };
            let chunk = self.chunks[bucket];
            // Each chunk row's next tokens and their first position (none: masked).
            let parts: Vec<(Vec<i64>, usize)> = self.rows[..chunk.batch]
                .iter_mut()
                .map(|s| match s.as_mut().filter(|s| s.filling()) {
                    Some(seq) => {
                        let end = (seq.filled + chunk.seq).min(seq.head());
                        let part = seq.job.prompt[seq.filled..end].to_vec();
                        let start = seq.filled;
                        seq.filled = end;
                        (part, start)
                    }
                    None => (Vec::new(), 0),
                })
                .collect();
            let writes = parts
                .iter()
                .enumerate()
                .filter(|(_, (p, _))| !p.is_empty())
                .map(|(r, (p, start))| (r, start + p.len()));
            Self::hold_blocks(&mut self.blocks, self.session.exec, writes)?;
            let rows: Vec<Row> = parts.iter().map(|(p, start)| Row::new(p, *start)).collect();
            let first = rows
                .iter()
                .filter(|r| !r.tokens.is_empty())
                .map(|r| r.start);
            let first = first.max().unwrap_or(0);
            let began = std::time::Instant::now();
            self.session.fill(chunk, &rows)?;
            let seconds = began.elapsed().as_secs_f64();
            self.pacing.chunked(bucket, first, seconds);
            *self.runs.entry(chunk.graph.clone()).or_default() += 1;
            ran += 1;
        }
        Ok(ran)
    }

    /// Records what a decode step did for each row and returns the chosen tokens; sequences that
    /// are done leave.
    fn advance(
        &mut self,
        work: &[Work],
        chosen: &[Option<usize>],
    ) -> Result<Vec<Emitted>, RuntimeError> {
        let mut emitted = Vec::new();
        for (r, w) in work.iter().enumerate() {
            let Some(seq) = self.rows[r].as_mut() else {
                continue;
            };
            match w {
                Work::Idle => {}
                Work::Feed => seq.filled += 1,
                Work::Choose => {
                    let token = chosen.get(r).copied().flatten().ok_or_else(|| {
                        RuntimeError::Device(format!("the decode step chose no token for row {r}"))
                    })? as i64;
                    seq.generated.push(token);
                    emitted.push(Emitted {
                        id: seq.id,
                        token,
                        last: seq.generated.len() >= seq.job.max_new,
                    });
                }
            }
        }
        for e in emitted.iter().filter(|e| e.last) {
            self.retire(e.id)?;
        }
        Ok(emitted)
    }

    /// The chunk bucket (an index into `chunks`) of the next chunk step, as [`Pacing::pick`]
    /// chooses it for the most tokens a prompt filling the chunk rows has left and the latest
    /// position one is at; `None` when no prompt is filling.
    fn next_chunk(&self) -> Option<usize> {
        let filling = self.rows[..self.chunk_rows()]
            .iter()
            .flatten()
            .filter(|s| s.filling());
        let left = filling.clone().map(|s| s.head() - s.filled).max()?;
        let first = filling.map(|s| s.filled).max()?;
        Some(self.pacing.pick(left, first))
    }

    /// The rows the chunk buckets work on (`0..P`; none without a chunk bucket).
    fn chunk_rows(&self) -> usize {
        self.chunks.first().map_or(0, |c| c.batch)
    }

    /// What row `seq` does in the next decode step.
    fn work(&self, seq: Option<&Seq>) -> Work {
        match seq {
            None => Work::Idle,
            Some(s) if s.filling() && !self.chunks.is_empty() => Work::Idle,
            Some(s) if s.filling() => Work::Feed,
            Some(_) => Work::Choose,
        }
    }

    /// Whether a prompt of `len` tokens enters through the chunk bucket.
    fn fills_by_chunk(&self, len: usize) -> bool {
        !self.chunks.is_empty() && len > 1
    }

    /// A row of the chunk bucket that holds no prompt still filling: a free one first, else one
    /// whose (decoding) occupant can move out.
    fn open_chunk_row(&self) -> Option<usize> {
        let rows = &self.rows[..self.chunk_rows()];
        rows.iter().position(Option::is_none).or_else(|| {
            rows.iter()
                .position(|s| !s.as_ref().is_some_and(Seq::filling))
        })
    }

    fn free_row(&self) -> Option<usize> {
        self.rows.iter().position(Option::is_none)
    }

    fn row_of(&self, id: SeqId) -> Option<usize> {
        self.rows
            .iter()
            .position(|s| s.as_ref().is_some_and(|s| s.id == id))
    }

    /// Moves the sequence in row `from` (cache and state) to the free row `to`: its table row
    /// when the cache is paged, its cache row when the cache is dense.
    fn move_row(&mut self, from: usize, to: usize) -> Result<(), RuntimeError> {
        if let Some(p) = self.blocks.as_mut() {
            p.move_row(from, to);
        }
        self.session.copy_row(from, to, self.blocks.is_some())?;
        self.rows[to] = self.rows[from].take();
        Ok(())
    }

    /// Hands each `(row, keys)` of `writes` the blocks of its first `keys` keys (a paged cache)
    /// and writes the table to `exec` when it changed, before the step that writes them.
    fn hold_blocks(
        blocks: &mut Option<BlockPool>,
        exec: &mut Executor,
        writes: impl IntoIterator<Item = (usize, usize)>,
    ) -> Result<(), RuntimeError> {
        let Some(pool) = blocks.as_mut() else {
            return Ok(());
        };
        for (row, keys) in writes {
            pool.ensure(row, keys)?;
        }
        match pool.take_table() {
            Some(table) => exec.write_block_table(table),
            None => Ok(()),
        }
    }
}

/// One batch row of a cached step: its tokens, from position `start` on.
pub(crate) struct Row<'t> {
    tokens: &'t [i64],
    start: usize,
}

impl<'t> Row<'t> {
    pub(crate) fn new(tokens: &'t [i64], start: usize) -> Row<'t> {
        Row { tokens, start }
    }
}

/// A step's logits: the bucket's whole output, and where each row's last token's logits start.
struct Logits {
    values: Vec<f32>,
    starts: Vec<usize>,
    vocab: usize,
}

impl Logits {
    /// Row `i`'s logits.
    fn row(&self, i: usize) -> &[f32] {
        &self.values[self.starts[i]..self.starts[i] + self.vocab]
    }
}

/// The executor and (for the interpreter) the KV cache tensors, for the largest decode batch.
pub(crate) struct Session<'a> {
    art: &'a Artifact,
    pub(crate) exec: &'a mut Executor,
    caches: BTreeMap<String, Tensor>,
    vocab: usize,
    context: usize,
}

impl<'a> Session<'a> {
    /// A session over the cache of the decode bucket `largest` (the largest batch): the
    /// executor's own as it is, or new empty tensors passed along (the interpreter).
    pub(crate) fn new(
        art: &'a Artifact,
        exec: &'a mut Executor,
        largest: &BucketEntry,
    ) -> Result<Session<'a>, RuntimeError> {
        let mut caches = BTreeMap::new();
        if !exec.keeps_cache() {
            let graph: &Graph = &art.graphs[&largest.graph];
            caches = graph
                .inputs()
                .filter(|(_, n, _)| n.starts_with("past_"))
                .map(|(_, n, ty)| {
                    let shape: Vec<usize> = ty
                        .shape
                        .iter()
                        .map(|d| d.as_const().unwrap_or(0) as usize)
                        .collect();
                    let n_el = shape.iter().product();
                    (
                        n.to_string(),
                        Tensor::f32(shape, vec![0.0; n_el]).cast(ty.dtype),
                    )
                })
                .collect();
        }
        Ok(Session {
            art,
            exec,
            caches,
            vocab: art.manifest.model.vocab_size,
            context: largest.context.unwrap_or(0),
        })
    }

    /// Runs `rows` through the one-token bucket `entry` and returns, for each row with a pick
    /// (its sampling and generation step), the token chosen after it: greedy tokens on the device
    /// where the executor chooses them there (only their ids come back), else from the logits.
    fn next(
        &mut self,
        entry: &BucketEntry,
        rows: &[Row],
        picks: &[Option<(Sampling, u32)>],
    ) -> Result<Vec<Option<usize>>, RuntimeError> {
        let inputs = self.inputs(entry, rows);
        let greedy = picks.iter().flatten().all(|(s, _)| s.temperature <= 0.0);
        if rows.iter().all(|r| r.tokens.len() <= 1) {
            let chosen = if greedy {
                self.exec.run_greedy(entry, &inputs)?
            } else {
                // A row without a pick is greedy (its token is not used).
                let greedy = Sampling::greedy();
                let params: Vec<[u32; 4]> = picks
                    .iter()
                    .map(|pick| match pick {
                        Some((s, step)) => crate::generate::sampler_words(s, *step),
                        None => crate::generate::sampler_words(&greedy, 0),
                    })
                    .collect();
                self.exec.run_sampled(entry, &inputs, &params)?
            };
            if let Some(tokens) = chosen {
                return picked(picks, &tokens, self.vocab);
            }
        }
        let logits = self.step(entry, rows, inputs)?;
        picks
            .iter()
            .enumerate()
            .map(|(r, p)| {
                p.as_ref()
                    .map(|(s, step)| self.exec.choose(logits.row(r), s, *step))
                    .transpose()
            })
            .collect()
    }

    /// Runs `steps` greedy decode steps of `entry` from `rows` (one token each), chained
    /// ([`Executor::run_greedy_steps`]: on CUDA without the host in between), and returns, for
    /// each step, each row's token where it has a pick; `None` when the executor cannot chain
    /// them.
    fn next_steps(
        &mut self,
        entry: &BucketEntry,
        rows: &[Row],
        picks: &[Option<(Sampling, u32)>],
        steps: usize,
    ) -> Result<Option<Vec<Vec<Option<usize>>>>, RuntimeError> {
        let inputs = self.inputs(entry, rows);
        let Some(all) = self
            .exec
            .run_greedy_steps(self.art, entry, &inputs, steps)?
        else {
            return Ok(None);
        };
        all.iter()
            .map(|tokens| picked(picks, tokens, self.vocab))
            .collect::<Result<_, _>>()
            .map(Some)
    }

    /// Runs `inputs` (of `rows`) through `entry` and returns the logits of each row's last token.
    fn step(
        &mut self,
        entry: &BucketEntry,
        rows: &[Row],
        inputs: BTreeMap<String, Tensor>,
    ) -> Result<Logits, RuntimeError> {
        let mut outputs = self.run(entry, &inputs)?;
        let Some(Data::Float(values)) = outputs.remove(LOGITS).map(|t| t.data) else {
            return Err(RuntimeError::Request(
                "the decode graph has no float logits".into(),
            ));
        };
        let starts = rows
            .iter()
            .enumerate()
            .map(|(r, row)| (r * entry.seq + row.tokens.len().saturating_sub(1)) * self.vocab)
            .collect();
        Ok(Logits {
            values,
            starts,
            vocab: self.vocab,
        })
    }

    /// Runs `rows` (row `r` of the bucket: its tokens at positions `start..`) through the
    /// KV-cached bucket `entry`, so that their keys and values enter the cache; a row's tail
    /// past its tokens, and the bucket's rows past `rows`, are masked, so nothing of them reaches
    /// the cache.
    fn fill(&mut self, entry: &BucketEntry, rows: &[Row]) -> Result<(), RuntimeError> {
        let inputs = self.inputs(entry, rows);
        self.run(entry, &inputs).map(drop)
    }

    /// Runs `inputs` through the KV-cached bucket `entry`, keeps the updated caches the caller
    /// keeps, and returns the bucket's other outputs.
    pub(crate) fn run(
        &mut self,
        entry: &BucketEntry,
        inputs: &BTreeMap<String, Tensor>,
    ) -> Result<BTreeMap<String, Tensor>, RuntimeError> {
        let mut outputs = self.exec.run(self.art, entry, inputs)?;
        let b = entry.batch;
        for (name, cache) in self.caches.iter_mut() {
            let present = outputs
                .remove(&name.replacen("past_", "present_", 1))
                .ok_or_else(|| {
                    RuntimeError::Request(format!("the decode graph lacks an output for {name}"))
                })?;
            let n = leading_rows(cache, b);
            if let (Data::Float(all), Data::Float(new)) = (&mut cache.data, &present.data) {
                all[..n].copy_from_slice(&new[..n]);
            }
        }
        Ok(outputs)
    }

    /// The inputs of the KV-cached bucket `entry` for `rows` (see [`Session::fill`]): those of
    /// [`step_inputs`] and the caches the caller keeps.
    pub(crate) fn inputs(&self, entry: &BucketEntry, rows: &[Row]) -> BTreeMap<String, Tensor> {
        let mut inputs = step_inputs(entry, rows, self.context);
        let b = entry.batch;
        for (name, cache) in &self.caches {
            let mut part = cache.clone();
            if let Data::Float(v) = &mut part.data {
                v.truncate(leading_rows(cache, b));
            }
            part.shape[0] = b;
            inputs.insert(name.clone(), part);
        }
        inputs
    }

    /// Copies cache row `from` to row `to`: the caller's dense tensors always, the executor's
    /// cache unless it is `paged` (its block table moves the row).
    fn copy_row(&mut self, from: usize, to: usize, paged: bool) -> Result<(), RuntimeError> {
        if self.exec.keeps_cache() {
            return match paged {
                true => Ok(()),
                false => self.exec.copy_cache_row(from, to),
            };
        }
        for cache in self.caches.values_mut() {
            let row = cache.numel() / cache.shape[0].max(1);
            if let Data::Float(v) = &mut cache.data {
                v.copy_within(from * row..(from + 1) * row, to * row);
            }
        }
        Ok(())
    }
}

/// The inputs of the KV-cached bucket `entry` for `rows` (row `r` of the bucket: its tokens at
/// positions `start..`) in a cache of `context` entries: token ids, the mask of each row's
/// tokens (a row's tail past its tokens, and the bucket's rows past `rows`, masked) and
/// positions.
pub(crate) fn step_inputs(
    entry: &BucketEntry,
    rows: &[Row],
    context: usize,
) -> BTreeMap<String, Tensor> {
    let (b, s) = (entry.batch, entry.seq);
    let last = context.saturating_sub(1);
    let grid = |f: &dyn Fn(&Row, usize) -> i64| -> Vec<i64> {
        let empty = Row::new(&[], 0);
        (0..b)
            .flat_map(|r| {
                let row = rows.get(r).unwrap_or(&empty);
                (0..s).map(move |i| f(row, i)).collect::<Vec<_>>()
            })
            .collect()
    };
    BTreeMap::from([
        (
            "input_ids".to_string(),
            Tensor::i64(
                vec![b, s],
                grid(&|row, i| row.tokens.get(i).copied().unwrap_or(0)),
            ),
        ),
        (
            "attention_mask".to_string(),
            Tensor::i64(vec![b, s], grid(&|row, i| i64::from(i < row.tokens.len()))),
        ),
        (
            "position_ids".to_string(),
            Tensor::i64(vec![b, s], grid(&|row, i| (row.start + i).min(last) as i64)),
        ),
    ])
}

/// The largest one-token decode bucket: its rows are the cache's.
pub(crate) fn largest_step(art: &Artifact) -> Result<&BucketEntry, RuntimeError> {
    art.manifest
        .decode
        .iter()
        .filter(|e| e.seq == 1)
        .max_by_key(|e| e.batch)
        .ok_or_else(|| RuntimeError::Request("the artifact has no decode bucket".into()))
}

/// The token of each row with a pick among a step's `tokens` (chosen on the device, checked
/// against the vocabulary).
fn picked(
    picks: &[Option<(Sampling, u32)>],
    tokens: &[i64],
    vocab: usize,
) -> Result<Vec<Option<usize>>, RuntimeError> {
    let tokens = chosen(tokens, picks.len(), vocab)?;
    Ok(picks
        .iter()
        .zip(tokens)
        .map(|(p, t)| p.map(|_| t))
        .collect())
}

/// Elements of `cache`'s leading `rows` rows: caches are kept for the largest decode batch, and
/// a bucket of fewer rows reads and updates the leading ones, as it does the executors' dense
/// caches and block tables.
fn leading_rows(cache: &Tensor, rows: usize) -> usize {
    cache.numel() / cache.shape[0].max(1) * rows
}
