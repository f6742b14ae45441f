//! `kiln-run serve` end to end on the CPU executor, through a real HTTP client (reqwest): 16
//! concurrent requests, streamed and not, get the greedy tokens `kiln-run generate` prints for
//! their prompts; sampled answers agree streamed and not; stop strings, end-of-sequence tokens and
//! the chat template; a full queue answers 503 with `Retry-After`; a client that goes away frees
//! its row; malformed JSON, an unknown model, an over-long prompt and bad parameters each get a
//! 4xx JSON error while the server keeps serving; sentence embeddings equal a forward pass's;
//! `/metrics` counts what was served; SIGTERM lets a running stream finish and the server return
//! cleanly.
//!
//! The servers run in this process, in one test, so that the SIGTERM it sends reaches them all and
//! nothing else.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use clap::Parser;
use kiln_ir::inputs::TokenBatch;
use kiln_tests::{compile_artifact, fixture, kiln_run, sentence_transformers_copy};
use serde_json::{json, Value};

/// A server started by [`start`].
struct Server {
    base: String,
    thread: JoinHandle<Result<(), String>>,
}

/// Writes lines to a channel (the server's "listening on" line).
struct Lines(mpsc::Sender<String>, Vec<u8>);

impl Write for Lines {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.1.extend_from_slice(buf);
        while let Some(i) = self.1.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.1.drain(..=i).collect();
            let _ = self
                .0
                .send(String::from_utf8_lossy(&line).trim().to_string());
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// `kiln-run serve ART --port 0 ARGS..` on a thread; returns once `/health` answers 200.
fn start(art: &Path, args: &[&str]) -> Server {
    let mut argv = vec!["kiln-run", "serve", art.to_str().unwrap(), "--port", "0"];
    argv.extend_from_slice(args);
    let argv: Vec<String> = argv.into_iter().map(String::from).collect();
    let (tx, rx) = mpsc::channel();
    let thread = std::thread::spawn(move || {
        let cli = kiln_runtime::cli::Cli::try_parse_from(argv).map_err(|e| e.to_string())?;
        kiln_runtime::cli::run(cli, &mut Lines(tx, Vec::new())).map_err(|e| format!("{e:#}"))
    });
    let line = rx
        .recv_timeout(Duration::from_secs(120))
        .expect("the server prints its address");
    let base = line.strip_prefix("listening on ").expect(&line).to_string();
    let started = Instant::now();
    while get(&format!("{base}/health")).0 != 200 {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the server never became ready"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    Server { base, thread }
}

fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(300))
        .build()
        .unwrap()
}

fn get(url: &str) -> (u16, String) {
    let r = client().get(url).send().unwrap();
    (r.status().as_u16(), r.text().unwrap())
}

/// POSTs `body` (raw bytes); the status, the `Retry-After` header and the JSON answer.
fn post_raw(url: &str, body: Vec<u8>) -> (u16, Option<String>, Value) {
    let r = client()
        .post(url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .unwrap();
    let status = r.status().as_u16();
    let retry = r
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_string());
    (status, retry, r.json().unwrap())
}

fn post(url: &str, body: &Value) -> (u16, Value) {
    let (status, _, v) = post_raw(url, body.to_string().into_bytes());
    (status, v)
}

/// A streamed request's `data:` events up to `[DONE]` (which must come).
fn stream(url: &str, body: &Value) -> Vec<Value> {
    let r = client().post(url).json(body).send().unwrap();
    assert_eq!(r.status().as_u16(), 200, "{body}");
    let mut events = Vec::new();
    for line in BufReader::new(r).lines() {
        let line = line.unwrap();
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            return events;
        }
        events.push(serde_json::from_str(data).unwrap());
    }
    panic!("the stream ended without [DONE]: {events:?}");
}

/// The token ids and the text of a streamed answer's chunks, and its finish reason.
fn streamed(events: &[Value], chat: bool) -> (Vec<i64>, String, String) {
    let mut ids = Vec::new();
    let mut text = String::new();
    let mut finish = String::new();
    for e in events {
        let Some(c) = e["choices"].get(0) else {
            continue;
        };
        ids.extend(
            c["token_ids"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|t| t.as_i64().unwrap()),
        );
        let piece = if chat {
            &c["delta"]["content"]
        } else {
            &c["text"]
        };
        text += piece.as_str().unwrap_or("");
        if let Some(f) = c["finish_reason"].as_str() {
            finish = f.to_string();
        }
    }
    (ids, text, finish)
}

fn ids(v: &Value) -> Vec<i64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_i64().unwrap())
        .collect()
}

/// `kiln-run generate` of `prompt` (greedy, or with `sampling`'s arguments).
fn generate(art: &Path, prompt: &[i64], n: usize, sampling: &[&str]) -> Vec<i64> {
    let list: Vec<String> = prompt.iter().map(i64::to_string).collect();
    let list = list.join(",");
    let n = n.to_string();
    let mut args = vec!["generate", art.to_str().unwrap(), "--prompt-ids", &list];
    args.extend(["--max-new-tokens", &n, "--device", "cpu"]);
    args.extend(sampling);
    kiln_run(&args)
        .unwrap()
        .split_whitespace()
        .map(|t| t.parse().unwrap())
        .collect()
}

/// Words of the test tokenizer: ids 3.. are these, then `w<id>`.
const WORDS: [&str; 5] = ["user", "assistant", "system", "hello", "world"];

/// llama-tiny with a word-level `tokenizer.json` over its 512 ids (`<s>` added in front of a
/// text) and a `tokenizer_config.json` whose chat template writes `role content` pairs.
fn llama_with_tokenizer(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    for entry in std::fs::read_dir(fixture("llama-tiny")).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, dir.join(p.file_name().unwrap())).unwrap();
    }
    let mut vocab = serde_json::Map::new();
    for id in 0..512 {
        let word = match id {
            0 => "<unk>".to_string(),
            1 => "<s>".to_string(),
            2 => "</s>".to_string(),
            i if i < 3 + WORDS.len() => WORDS[i - 3].to_string(),
            i => format!("w{i}"),
        };
        vocab.insert(word, json!(id));
    }
    let special = |id: i64, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": false, "special": true})
    };
    let bos = json!({"SpecialToken": {"id": "<s>", "type_id": 0}});
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")],
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": {"type": "TemplateProcessing",
            "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }} {{ m['content'] | trim }} {% endfor %}{% if add_generation_prompt %}assistant{% endif %}";
    let config =
        json!({"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": template});
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
}

#[test]
fn serve_answers_like_generate_and_survives_bad_requests() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("llama-words");
    llama_with_tokenizer(&model);
    let art = tmp.path().join("llama.kiln");
    let flags = [
        "--buckets",
        "16,64",
        "--batch-buckets",
        "1,4",
        "--max-context",
        "64",
    ];
    compile_artifact(
        &model,
        &art,
        &[
            &flags[..],
            &["--prefill-chunk", "8,3", "--prefill-batch", "2"],
            // A paged cache of 16 blocks of 4 keys, one sequence of the context: requests wait
            // for blocks as well as for rows.
            &["--kv-block-size", "4", "--kv-blocks", "17"],
        ]
        .concat(),
    );
    let main = start(&art, &["--drain-seconds", "20"]);
    let served = concurrent_greedy(&main, &art);
    sampled_streams_agree(&main, &art);
    text_stops_and_chat(&main, &art, &model);
    bad_requests(&main);
    metrics(&main, served);
    let slow = queue_and_disconnect(&art);
    let bert = embeddings(tmp.path());
    sigterm(main, [slow, bert]);
}

/// 16 concurrent requests get `kiln-run generate`'s greedy tokens; the tokens they asked for.
fn concurrent_greedy(main: &Server, art: &Path) -> usize {
    let completions = format!("{}/v1/completions", main.base);
    // 16 concurrent requests (4 rows, and KV blocks for two or three of them: most wait), every
    // other one streamed; prompts of 1 to 20 tokens (up to three chunks), 3 to 18 new tokens
    // each.
    let requests: Vec<(Vec<i64>, usize, bool)> = (0..16)
        .map(|i| {
            let prompt = (0..1 + (i * 7) % 20)
                .map(|j| 3 + ((i * 31 + j * 17) % 500) as i64)
                .collect();
            (prompt, 3 + i % 16, i % 2 == 0)
        })
        .collect();
    let answers: Vec<Vec<i64>> = std::thread::scope(|s| {
        let handles: Vec<_> = requests
            .iter()
            .map(|(prompt, n, streamed_)| {
                let url = completions.clone();
                s.spawn(move || {
                    let body = json!({"model": "llama", "prompt": prompt, "max_tokens": n,
                        "temperature": 0, "ignore_eos": true, "return_token_ids": true,
                        "stream": streamed_});
                    if *streamed_ {
                        let (ids_, _, finish) = streamed(&stream(&url, &body), false);
                        assert_eq!(finish, "length");
                        ids_
                    } else {
                        let (status, v) = post(&url, &body);
                        assert_eq!(status, 200, "{v}");
                        assert_eq!(v["usage"]["completion_tokens"], json!(n));
                        assert_eq!(v["usage"]["prompt_tokens"], json!(prompt.len()));
                        ids(&v["choices"][0]["token_ids"])
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for ((prompt, n, s), got) in requests.iter().zip(&answers) {
        assert_eq!(
            *got,
            generate(art, prompt, *n, &[]),
            "prompt {prompt:?} (streamed {s})"
        );
    }
    requests.iter().map(|r| r.1).sum()
}

/// A sampled request gives the same tokens streamed and not, those of `kiln-run generate`.
fn sampled_streams_agree(main: &Server, art: &Path) {
    let completions = format!("{}/v1/completions", main.base);
    // Sampled: streamed and not give the same tokens, those of `kiln-run generate`.
    let sampled = json!({"model": "llama", "prompt": [5, 9, 11], "max_tokens": 12, "temperature": 0.8,
        "top_k": 20, "seed": 7, "ignore_eos": true, "return_token_ids": true});
    let (status, whole) = post(&completions, &sampled);
    assert_eq!(status, 200, "{whole}");
    let mut body = sampled.clone();
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let events = stream(&completions, &body);
    let (streamed_ids, streamed_text, _) = streamed(&events, false);
    assert_eq!(ids(&whole["choices"][0]["token_ids"]), streamed_ids);
    assert_eq!(whole["choices"][0]["text"].as_str().unwrap(), streamed_text);
    let want = generate(
        art,
        &[5, 9, 11],
        12,
        &["--temperature", "0.8", "--top-k", "20", "--seed", "7"],
    );
    assert_eq!(streamed_ids, want, "sampled tokens");
    assert_eq!(
        events.last().unwrap()["usage"]["completion_tokens"],
        json!(12),
        "include_usage"
    );
}

/// Text prompts, stop strings, end-of-sequence ids and the chat template.
fn text_stops_and_chat(main: &Server, art: &Path, model: &Path) {
    let completions = format!("{}/v1/completions", main.base);
    let chat = format!("{}/v1/chat/completions", main.base);
    // Text: the prompt tokenised with <s> in front; a stop string ends the text before it.
    let tokenizer =
        kiln_runtime::tokenizer::TextTokenizer::from_file(&model.join("tokenizer.json")).unwrap();
    let prompt = tokenizer.encode("hello world w77").unwrap();
    assert_eq!(prompt, [1, 6, 7, 77]);
    let tokens = generate(art, &prompt, 10, &[]);
    let text = tokenizer.decode(&tokens).unwrap();
    let stop_word = tokenizer.decode(&tokens[4..5]).unwrap();
    let body = json!({"model": "llama", "prompt": "hello world w77", "max_tokens": 10,
        "temperature": 0, "ignore_eos": true, "stop": [format!(" {stop_word}")]});
    let (status, v) = post(&completions, &body);
    assert_eq!(status, 200, "{v}");
    let cut = &text[..text.find(&format!(" {stop_word}")).unwrap_or(text.len())];
    assert_eq!(
        v["choices"][0]["text"].as_str().unwrap(),
        cut,
        "text cut at the stop string"
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let mut body = body.clone();
    body["stream"] = json!(true);
    let (_, text_streamed, finish) = streamed(&stream(&completions, &body), false);
    assert_eq!(
        (text_streamed.as_str(), finish.as_str()),
        (cut, "stop"),
        "streamed stop string"
    );

    // End of sequence: without ignore_eos the answer ends before the first </s> (id 2).
    let (status, v) = post(
        &completions,
        &json!({"model": "llama", "prompt": [1, 2, 2], "max_tokens": 30,
        "temperature": 0, "return_token_ids": true, "stop": [2]}),
    );
    assert_eq!(status, 200, "{v}");
    let all = generate(art, &[1, 2, 2], 30, &[]);
    let until = all.iter().position(|&t| t == 2).unwrap_or(all.len());
    assert_eq!(ids(&v["choices"][0]["token_ids"]), all[..until]);
    let reason = if until < all.len() { "stop" } else { "length" };
    assert_eq!(v["choices"][0]["finish_reason"], reason);

    // Chat: the template rendered, then tokenised as it is.
    let messages = json!([{"role": "system", "content": "hello"}, {"role": "user", "content": [{"type": "text", "text": "world w9 "}]}]);
    let rendered = tokenizer
        .encode_plain("<s>system hello user world w9 assistant")
        .unwrap();
    assert_eq!(rendered, [1, 5, 6, 3, 7, 9, 4]);
    let body = json!({"model": "llama", "messages": messages, "max_tokens": 6, "temperature": 0,
        "ignore_eos": true, "return_token_ids": true});
    let (status, v) = post(&chat, &body);
    assert_eq!(status, 200, "{v}");
    let want = generate(art, &rendered, 6, &[]);
    assert_eq!(ids(&v["choices"][0]["token_ids"]), want);
    assert_eq!(
        v["choices"][0]["message"]["content"].as_str().unwrap(),
        tokenizer.decode(&want).unwrap()
    );
    assert_eq!(v["object"], "chat.completion");
    let mut body = body.clone();
    body["stream"] = json!(true);
    let events = stream(&chat, &body);
    assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
    let (chat_ids, chat_text, _) = streamed(&events, true);
    assert_eq!(
        (chat_ids, chat_text.as_str()),
        (
            want,
            v["choices"][0]["message"]["content"].as_str().unwrap()
        )
    );
}

/// Malformed JSON, an unknown model, an over-long prompt and bad parameters.
fn bad_requests(main: &Server) {
    let completions = format!("{}/v1/completions", main.base);
    let chat = format!("{}/v1/chat/completions", main.base);
    // Bad requests: 4xx JSON errors naming the problem, and the server keeps serving.
    let bad: [(&str, Vec<u8>, u16, &str); 9] = [
        (
            &completions,
            b"{\"model\": \"llama\", \"prompt\": [1,".to_vec(),
            400,
            "JSON",
        ),
        (
            &completions,
            br#"{"model": "gpt-4", "prompt": [1]}"#.to_vec(),
            404,
            "gpt-4",
        ),
        (
            &completions,
            json!({"model": "llama", "prompt": vec![5; 60], "max_tokens": 10})
                .to_string()
                .into_bytes(),
            400,
            "context",
        ),
        (
            &completions,
            br#"{"model": "llama", "prompt": [1], "temperature": -1}"#.to_vec(),
            400,
            "temperature",
        ),
        (
            &completions,
            br#"{"model": "llama", "prompt": [1], "n": 3}"#.to_vec(),
            400,
            "`n`",
        ),
        (
            &completions,
            br#"{"model": "llama", "prompt": [1], "top_p": "most"}"#.to_vec(),
            400,
            "top_p",
        ),
        (
            &completions,
            br#"{"model": "llama", "prompt": [1], "max_tokens": 0}"#.to_vec(),
            400,
            "max_tokens",
        ),
        (
            &completions,
            br#"{"model": "llama", "prompt": [9999]}"#.to_vec(),
            400,
            "9999",
        ),
        (
            &chat,
            br#"{"model": "llama", "messages": [], "frobnicate": 1}"#.to_vec(),
            400,
            "frobnicate",
        ),
    ];
    for (url, body, status, names) in bad {
        let (got, _, v) = post_raw(url, body.clone());
        let message = v["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert_eq!(got, status, "{}: {v}", String::from_utf8_lossy(&body));
        assert!(
            message.contains(names),
            "the error names {names}: {message}"
        );
    }
    let (status, v) = post(
        &format!("{}/v1/embeddings", main.base),
        &json!({"model": "llama", "input": "x"}),
    );
    assert_eq!(status, 400, "a decoder serves no embeddings: {v}");
    let (status, v) = post(
        &completions,
        &json!({"model": "llama", "prompt": [3], "max_tokens": 2, "temperature": 0}),
    );
    assert_eq!(
        (status, v["usage"]["completion_tokens"].clone()),
        (200, json!(2)),
        "still serving: {v}"
    );
}

/// `/metrics` counts at least the `served` greedy tokens and the later requests', and
/// `/v1/models` names the model.
fn metrics(main: &Server, served: usize) {
    // A prompt of 3 tokens alone: its head of 2 tokens takes the chunk of 3, not that of 8.
    let body = json!({"model": "llama", "prompt": [5, 6, 7], "max_tokens": 1, "temperature": 0});
    let (status, v) = post(&format!("{}/v1/completions", main.base), &body);
    assert_eq!(status, 200, "{v}");
    // Metrics count what was served.
    let (status, text) = get(&format!("{}/metrics", main.base));
    assert_eq!(status, 200);
    let metric = |name: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
            .unwrap_or_else(|| panic!("{name} in {text}"))
    };
    assert!(
        metric("kiln_generation_tokens_total") >= (served + 12 * 2 + 2) as f64,
        "{text}"
    );
    assert!(metric("kiln_time_to_first_token_seconds_count") >= 16.0);
    // Every engine step is timed, by whether prompt chunks ran in it (prompts enter through the
    // chunk bucket here); a step hands out at most 4 tokens (4 rows).
    let steps = |kind: &str| {
        metric(&format!(
            "kiln_engine_step_seconds_count{{kind=\"{kind}\"}}"
        ))
    };
    let (decode, chunked) = (steps("decode"), steps("prompt_chunks"));
    assert!(decode >= 1.0 && chunked >= 1.0, "{text}");
    assert!(decode + chunked >= served as f64 / 4.0, "{text}");
    assert_eq!(metric("kiln_requests_running"), 0.0);
    // The default chunk budget has a decode step to measure chunks against by now.
    assert!(metric("kiln_prompt_chunk_limit_seconds") > 0.0, "{text}");
    assert_eq!(metric("kiln_kv_blocks"), 16.0);
    assert_eq!(metric("kiln_kv_blocks_used"), 0.0, "every block came back");
    // Prompts of 1 to 20 tokens fill through chunks of 8, and what is left of them at the end
    // (at most 3 tokens in both rows) through chunks of 3.
    for bucket in ["decode-b4-s1", "decode-b2-s8", "decode-b2-s3"] {
        assert!(
            metric(&format!(
                "kiln_bucket_replays_total{{bucket=\"buckets/{bucket}.ron\"}}"
            )) >= 1.0,
            "{bucket}: {text}"
        );
    }
    let (_, models) = get(&format!("{}/v1/models", main.base));
    assert!(models.contains("\"id\":\"llama\""), "{models}");
}

/// A server on the interpreter with a queue of one: returned running, for [`sigterm`].
fn queue_and_disconnect(art: &Path) -> Server {
    // Four rows and a queue of one: of 12 requests at once, at least 5 are served and the rest
    // answered 503 with Retry-After; a client that goes away frees its row. The interpreter is
    // slow enough that requests pile up.
    let slow = start(
        art,
        &[
            "--device",
            "interpreter",
            "--max-queue",
            "1",
            "--model-name",
            "slow",
        ],
    );
    let url = format!("{}/v1/completions", slow.base);
    let body = json!({"model": "slow", "prompt": [3], "max_tokens": 60, "temperature": 0, "ignore_eos": true});
    let statuses: Vec<(u16, Option<String>)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..12)
            .map(|_| {
                s.spawn(|| {
                    let (status, retry, _) = post_raw(&url, body.to_string().into_bytes());
                    (status, retry)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(
        statuses.iter().all(|(s, _)| *s == 200 || *s == 503),
        "{statuses:?}"
    );
    assert!(
        statuses
            .iter()
            .any(|(s, r)| *s == 503 && r.as_deref() == Some("1")),
        "{statuses:?}"
    );
    assert!(
        statuses.iter().filter(|(s, _)| *s == 200).count() >= 5,
        "{statuses:?}"
    );
    let mut body = body.clone();
    body["stream"] = json!(true);
    let r = client().post(&url).json(&body).send().unwrap();
    let mut lines = BufReader::new(r).lines();
    assert!(
        lines.next().unwrap().unwrap().starts_with("data: "),
        "a first chunk"
    );
    drop(lines);
    let started = Instant::now();
    while !get(&format!("{}/metrics", slow.base))
        .1
        .contains("kiln_requests_finished_total{reason=\"cancelled\"} 1")
    {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the dropped stream was never cancelled"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    slow
}

/// SIGTERM: a running stream of `main` still finishes, then every server returns cleanly.
fn sigterm(main: Server, others: [Server; 2]) {
    let completions = format!("{}/v1/completions", main.base);
    // SIGTERM: a running stream still finishes, then both servers return cleanly.
    let body = json!({"model": "llama", "prompt": [3], "max_tokens": 40, "temperature": 0,
        "ignore_eos": true, "stream": true, "return_token_ids": true});
    let r = client().post(&completions).json(&body).send().unwrap();
    let mut lines = BufReader::new(r).lines();
    assert!(lines.next().unwrap().unwrap().starts_with("data: "));
    let kill = std::process::Command::new("kill")
        .args(["-TERM", &std::process::id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let rest: Vec<String> = lines
        .map(Result::unwrap)
        .filter(|l| l.starts_with("data: "))
        .collect();
    assert_eq!(rest.last().map(String::as_str), Some("data: [DONE]"));
    assert!(
        rest.iter()
            .any(|l| l.contains("\"finish_reason\":\"length\"")),
        "{rest:?}"
    );
    assert_eq!(main.thread.join().unwrap(), Ok(()));
    for s in others {
        assert_eq!(s.thread.join().unwrap(), Ok(()));
    }
}

/// Embedding `i` of an `/v1/embeddings` answer.
fn embedding(v: &Value, i: usize) -> Vec<f32> {
    let values = v["data"][i]["embedding"].as_array().unwrap();
    values.iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

/// Sentence embeddings over HTTP equal a forward pass's, for token-id inputs; an encoder serves
/// no completions. Returns the server, for [`sigterm`].
fn embeddings(tmp: &Path) -> Server {
    let st = tmp.join("bert-st");
    sentence_transformers_copy(
        &fixture("bert-tiny"),
        &st,
        &["pooling_mode_mean_tokens"],
        true,
    );
    let art_dir = tmp.join("bert.kiln");
    let art = compile_artifact(
        &st,
        &art_dir,
        &["--buckets", "8,16", "--batch-buckets", "1,4"],
    );
    let server = start(&art_dir, &["--model-name", "bert"]);
    let inputs = vec![vec![101i64, 7, 8, 9, 102], vec![101, 42, 102]];
    let (status, v) = post(
        &format!("{}/v1/embeddings", server.base),
        &json!({"model": "bert", "input": inputs}),
    );
    assert_eq!(status, 200, "{v}");
    let batch = TokenBatch::padded(&inputs, 0);
    let mut exec = kiln_runtime::Executor::open(&art, kiln_runtime::Device::Cpu).unwrap();
    let out = kiln_runtime::forward::forward(&art, &mut exec, &batch).unwrap();
    let want = out["sentence_embedding"].as_f32().unwrap();
    let dim = out["sentence_embedding"].shape[1];
    for (i, row) in want.chunks(dim).enumerate() {
        let got = embedding(&v, i);
        assert_eq!(got, row, "embedding {i}");
    }
    assert_eq!(v["usage"]["prompt_tokens"], json!(8));
    // More inputs than the largest batch bucket (4): run in parts, each row what it is alone.
    let many: Vec<Vec<i64>> = (0..6).map(|i| vec![101, 7 + i, 9, 102]).collect();
    let url = format!("{}/v1/embeddings", server.base);
    let (status, v) = post(&url, &json!({"model": "bert", "input": many}));
    assert_eq!(status, 200, "{v}");
    for (i, row) in many.iter().enumerate() {
        let alone = TokenBatch::padded(std::slice::from_ref(row), 0);
        let out = kiln_runtime::forward::forward(&art, &mut exec, &alone).unwrap();
        let want = out["sentence_embedding"].as_f32().unwrap();
        let got = embedding(&v, i);
        let err = kiln_tests::rel_err(&got, want);
        assert!(err < 1e-5, "input {i} of 6: relative error {err}");
    }
    let (status, e) = post(
        &format!("{}/v1/completions", server.base),
        &json!({"model": "bert", "prompt": [1]}),
    );
    assert_eq!(status, 400, "an encoder does not complete: {e}");
    let (status, e) = post(
        &format!("{}/v1/embeddings", server.base),
        &json!({"model": "bert", "input": [[1]], "encoding_format": "base64"}),
    );
    assert!(
        status == 400 && e.to_string().contains("encoding_format"),
        "{e}"
    );
    server
}
