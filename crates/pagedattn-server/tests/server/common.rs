//! What the server's tests share: servers on 127.0.0.1 port 0 over small models, and an HTTP
//! client (hyper's) that reads plain and streamed answers.

use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{HeaderMap, Request, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use pagedattn::{registry, AttentionConfig, DType};
use pagedattn_engine::models::chat::ChatTemplate;
use pagedattn_engine::models::families;
use pagedattn_engine::models::gguf::Gguf;
use pagedattn_engine::models::gguf_writer::{tiny_llama, TinyLlama};
use pagedattn_engine::models::hf::HfFolder;
use pagedattn_engine::models::llama::Llama;
use pagedattn_engine::models::ops::Precision;
use pagedattn_engine::models::synthetic::SyntheticConfig;
use pagedattn_engine::models::tokenizer::Tokenizer;
use pagedattn_engine::serving::blocks::BlockConfig;
use pagedattn_engine::serving::engine::{Engine, EngineConfig, EngineRequest, Placed};
use pagedattn_engine::serving::model::{Attend, Model, StepTokens};
use pagedattn_engine::serving::scheduler::{PreemptionPolicy, SchedulerConfig};
use pagedattn_server::{EngineParts, Server, ServerConfig, Summary};
use serde_json::Value;

/// The engine's configuration for the tests: `blocks` blocks of 8 tokens, `max_seqs`
/// sequences and 256 tokens a step.
pub fn engine_config(blocks: usize, max_seqs: usize) -> EngineConfig {
    EngineConfig {
        scheduler: SchedulerConfig {
            max_batched_tokens: 256,
            max_seqs,
            preemption: PreemptionPolicy::Auto,
            blocks: BlockConfig {
                block_size: 8,
                num_device_blocks: blocks,
                num_host_blocks: blocks,
                prefix_caching: true,
                sliding_window: None,
                watermark_blocks: 1,
            },
        },
        cuda_graphs: false,
    }
}

/// A small synthetic decoder (token ids only: no tokenizer).
pub fn synthetic_model() -> Box<dyn Model> {
    let config = SyntheticConfig {
        layers: 2,
        hidden: 64,
        ffn: 128,
        heads: 4,
        kv_heads: 2,
        head_size: 16,
        vocab: 512,
        max_context: 1024,
        ..SyntheticConfig::default()
    };
    Box::new(config.build().expect("synthetic model"))
}

/// The tiny Llama GGUF (byte-level tokenizer, ChatML template) as a model with text.
pub fn tiny_text_model() -> (Box<dyn Model>, Tokenizer, ChatTemplate) {
    let file = Gguf::from_bytes(tiny_llama(&TinyLlama {
        context: 2048,
        ..TinyLlama::default()
    }))
    .expect("tiny llama");
    (
        Box::new(Llama::from_gguf(&file, Precision::Exact).expect("model")),
        Tokenizer::from_gguf(&file).expect("tokenizer"),
        ChatTemplate::from_gguf(&file).expect("template"),
    )
}

/// A model that takes at least `pace` a step: requests that last long enough for a test to
/// act while they run, whatever the machine's speed.
struct Paced {
    model: Box<dyn Model>,
    pace: Duration,
    /// Fail the step after this many (an engine error), or panic (a bug).
    fail_after: Option<(usize, bool)>,
    steps: usize,
}

impl Model for Paced {
    fn name(&self) -> String {
        self.model.name()
    }
    fn layers(&self) -> &[AttentionConfig] {
        self.model.layers()
    }
    fn dtype(&self) -> DType {
        self.model.dtype()
    }
    fn vocab_size(&self) -> usize {
        self.model.vocab_size()
    }
    fn max_context(&self) -> usize {
        self.model.max_context()
    }
    fn stop_tokens(&self) -> Vec<u32> {
        self.model.stop_tokens()
    }
    fn first_plain_token(&self) -> u32 {
        self.model.first_plain_token()
    }
    fn forward(
        &mut self,
        step: &StepTokens<'_>,
        attend: &mut Attend<'_>,
        logits: &mut Vec<f32>,
    ) -> pagedattn_engine::Result<()> {
        std::thread::sleep(self.pace);
        self.steps += 1;
        match self.fail_after {
            Some((n, false)) if self.steps > n => {
                return Err(pagedattn_engine::Error::Model("injected failure".into()))
            }
            Some((n, true)) if self.steps > n => panic!("injected panic"),
            _ => {}
        }
        self.model.forward(step, attend, logits)
    }
}

/// The model a test server serves.
#[derive(Clone, Copy, Debug)]
pub enum TestModel {
    /// The small synthetic decoder: token ids only.
    Synthetic,
    /// It, at least 2 ms a step.
    Paced,
    /// It paced, failing from its 20th step on.
    Failing,
    /// It paced, panicking at its 20th step.
    Panicking,
    /// The tiny Llama with its tokenizer and chat template.
    Text,
    /// A Hugging Face family's folder of tests/hf-models (`llama`, `bert`, `bart`, ...).
    Folder(&'static str),
}

/// The folder of tests/hf-models named `family`.
pub fn hf_folder(family: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/hf-models")
        .join(family)
}

/// A server on 127.0.0.1 port 0 and a client for it; shut down and checked when dropped
/// unless [`TestServer::stop`] did it.
pub struct TestServer {
    server: Option<Server>,
    pub addr: SocketAddr,
    client: Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
}

/// Starts a server of `model` on `cpu`.
pub fn start(config: ServerConfig, engine: EngineConfig, model: TestModel) -> TestServer {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let server = Server::start(listener, config, move || {
        let backend = registry::backend("cpu")?;
        let mut decoder_start = None;
        let (model, text) = match model {
            TestModel::Folder(family) => {
                let dir = hf_folder(family);
                let folder = HfFolder::open(&dir)?;
                decoder_start = folder
                    .config_usize_opt("decoder_start_token_id")?
                    .map(|t| t as u32);
                let tokenizer = Tokenizer::from_hf_folder(&dir)?;
                let template = ChatTemplate::from_hf_folder(&dir, &tokenizer)?;
                let model = families::from_hf(&folder, Precision::Exact)?.into_model();
                (model, Some((tokenizer, template)))
            }
            TestModel::Text => {
                let (model, tokenizer, template) = tiny_text_model();
                (model, Some((tokenizer, template)))
            }
            TestModel::Synthetic => (synthetic_model(), None),
            TestModel::Paced | TestModel::Failing | TestModel::Panicking => (
                Box::new(Paced {
                    model: synthetic_model(),
                    pace: Duration::from_millis(2),
                    fail_after: match model {
                        TestModel::Failing => Some((20, false)),
                        TestModel::Panicking => Some((20, true)),
                        _ => None,
                    },
                    steps: 0,
                }) as Box<dyn Model>,
                None,
            ),
        };
        Ok(EngineParts {
            decoder_start,
            placed: Placed::one(backend, model),
            config: engine,
            text,
        })
    })
    .expect("server starts");
    TestServer {
        addr: server.addr(),
        server: Some(server),
        client: Client::builder(TokioExecutor::new()).build_http(),
    }
}

/// A response: status, headers, body.
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: String,
}

impl Answer {
    /// The body as JSON.
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
}

impl TestServer {
    async fn send(
        &self,
        method: &str,
        path: &str,
        body: Vec<u8>,
    ) -> hyper::Response<hyper::body::Incoming> {
        let request = Request::builder()
            .method(method)
            .uri(format!("http://{}{path}", self.addr))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .expect("request");
        self.client
            .request(request)
            .await
            .expect("the server answers")
    }

    /// A request and its whole response.
    pub async fn call(&self, method: &str, path: &str, body: impl Into<Vec<u8>>) -> Answer {
        let response = self.send(method, path, body.into()).await;
        let status = response.status();
        let headers = response.headers().clone();
        let bytes = response
            .into_body()
            .collect()
            .await
            .expect("body")
            .to_bytes();
        Answer {
            status,
            headers,
            body: String::from_utf8_lossy(&bytes).into_owned(),
        }
    }

    /// `POST path` with a JSON body.
    pub async fn post(&self, path: &str, body: &Value) -> Answer {
        self.call("POST", path, body.to_string()).await
    }

    /// A streamed request's events, `[DONE]` as `Value::Null`.
    pub async fn stream(&self, path: &str, body: &Value) -> Vec<Value> {
        let answer = self.post(path, body).await;
        assert_eq!(answer.status, StatusCode::OK, "{}", answer.body);
        assert_eq!(answer.headers["content-type"], "text/event-stream");
        events(&answer.body)
    }

    /// Starts a stream and returns its body to read from (dropping it disconnects).
    pub async fn open_stream(&self, path: &str, body: &Value) -> hyper::body::Incoming {
        let response = self.send("POST", path, body.to_string().into_bytes()).await;
        assert_eq!(response.status(), StatusCode::OK);
        response.into_body()
    }

    /// A metric's value (the first series of that name).
    pub async fn metric(&self, name: &str) -> f64 {
        let text = self.call("GET", "/metrics", "").await.body;
        text.lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no metric {name} in:\n{text}"))
    }

    /// Waits until `metric` reads `value` (within 10 s).
    pub async fn await_metric(&self, name: &str, value: f64) {
        let start = Instant::now();
        loop {
            let now = self.metric(name).await;
            if now == value {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "{name} = {now}, waited for {value}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Begins the shutdown.
    pub fn shutdown(&self) {
        self.server.as_ref().expect("running").shutdown();
    }

    /// Waits for a server that stops by itself (its engine failed): the error.
    pub fn failure(mut self) -> String {
        let server = self.server.take().expect("running");
        server.wait().expect_err("a failure").to_string()
    }

    /// Shuts it down and waits: the engine's summary (the block manager's check passed).
    pub fn stop(mut self) -> Summary {
        let server = self.server.take().expect("running");
        server.shutdown();
        server.wait().expect("a clean stop")
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(server) = self.server.take() {
            server.shutdown();
            let stopped = server.wait();
            if !std::thread::panicking() {
                stopped.expect("a clean stop");
            }
        }
    }
}

/// The events of a server-sent event stream, `[DONE]` as `Value::Null`.
pub fn events(body: &str) -> Vec<Value> {
    body.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let data = e
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not an event: {e:?}"));
            if data == "[DONE]" {
                Value::Null
            } else {
                serde_json::from_str(data).unwrap_or_else(|err| panic!("{err}: {data}"))
            }
        })
        .collect()
}

/// The greedy tokens of `prompt` from an engine of its own (no server), served alone.
pub fn alone(prompt: &[u32], max_new_tokens: usize) -> Vec<u32> {
    let backend = registry::backend("cpu").expect("cpu");
    let engine =
        Engine::new(backend.as_ref(), synthetic_model(), &engine_config(512, 64)).expect("engine");
    let request = EngineRequest {
        ignore_eos: true,
        ..EngineRequest::greedy(prompt.to_vec(), max_new_tokens)
    };
    let report = engine
        .run(
            "alone",
            vec![request],
            &AtomicBool::new(false),
            &mut |_, _, _| {},
        )
        .expect("run");
    report.requests[0].generated[0].clone()
}

/// A prompt of `len` token ids from `seed`.
pub fn prompt(seed: u64, len: usize) -> Vec<u32> {
    (0..len as u64)
        .map(|i| ((seed * 7919 + i * 104_729) % 500) as u32 + 1)
        .collect()
}
