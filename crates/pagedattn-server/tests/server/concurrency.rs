//! Requests served together: the same tokens as alone, disconnects, a full queue.

use std::time::{Duration, Instant};

use http_body_util::BodyExt;
use hyper::StatusCode;
use pagedattn_server::ServerConfig;
use serde_json::json;

use crate::common::{alone, engine_config, prompt, start, TestModel};

/// 32 streams at once, of different lengths: each gets the greedy tokens its prompt gets from
/// an engine serving it alone (the engine's products and attention do not depend on the
/// batch around a sequence: what this checks).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_two_concurrent_streams_get_the_tokens_they_get_alone() {
    let server = std::sync::Arc::new(start(
        ServerConfig::new("m"),
        engine_config(1024, 64),
        TestModel::Paced,
    ));
    let jobs: Vec<(Vec<u32>, usize)> = (0..32)
        .map(|i| {
            (
                prompt(100 + i, 5 + (i as usize * 7) % 60),
                8 + (i as usize * 5) % 24,
            )
        })
        .collect();
    let mut tasks = Vec::new();
    for (p, max) in jobs.clone() {
        let server = std::sync::Arc::clone(&server);
        tasks.push(tokio::spawn(async move {
            let body = json!({
                "model": "m", "prompt": p, "max_tokens": max, "temperature": 0,
                "ignore_eos": true, "stream": true, "return_token_ids": true,
            });
            let events = server.stream("/v1/completions", &body).await;
            let ids: Vec<u32> = events
                .iter()
                .filter(|e| !e.is_null())
                .flat_map(|e| {
                    e["choices"][0]["token_ids"]
                        .as_array()
                        .cloned()
                        .unwrap_or_default()
                })
                .map(|t| t.as_u64().unwrap() as u32)
                .collect();
            ids
        }));
    }
    let mut got = Vec::new();
    for t in tasks {
        got.push(t.await.unwrap());
    }
    // The streams overlapped: more than one request ran in a step.
    assert!(
        server.metric("pagedattn:engine_steps_total").await
            < jobs.iter().map(|j| j.1 as f64).sum::<f64>()
    );
    for ((p, max), ids) in jobs.iter().zip(got) {
        assert_eq!(ids, alone(p, *max), "prompt of {} tokens", p.len());
    }
}

/// A client that goes away mid-stream: its request is aborted at the next step and its
/// blocks freed at once; the others go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disconnect_mid_stream_frees_its_blocks() {
    let server = start(
        ServerConfig::new("m"),
        engine_config(512, 8),
        TestModel::Paced,
    );
    let body = json!({
        "model": "m", "prompt": prompt(7, 40), "max_tokens": 900, "temperature": 0,
        "ignore_eos": true, "stream": true,
    });
    let mut stream = server.open_stream("/v1/completions", &body).await;
    let mut chunks = 0;
    while chunks < 3 {
        let frame = stream.frame().await.expect("a chunk").expect("readable");
        if frame.is_data() {
            chunks += 1;
        }
    }
    assert!(server.metric("pagedattn:kv_cache_blocks_used").await > 0.0);
    assert_eq!(server.metric("vllm:num_requests_running").await, 1.0);
    drop(stream);
    server
        .await_metric("pagedattn:kv_cache_blocks_used", 0.0)
        .await;
    server.await_metric("vllm:num_requests_running", 0.0).await;
    let aborted = server.call("GET", "/metrics", "").await.body;
    assert!(
        aborted.contains("finished_reason=\"abort\"} 1"),
        "{aborted}"
    );
    // A plain (not streamed) request whose client goes away while it is served is dropped too.
    let body =
        json!({"model": "m", "prompt": prompt(9, 40), "max_tokens": 900, "ignore_eos": true});
    let gone = tokio::time::timeout(
        Duration::from_millis(200),
        server.post("/v1/completions", &body),
    )
    .await;
    assert!(
        gone.is_err(),
        "it cannot have finished: 900 steps of at least 2 ms"
    );
    server.await_metric("vllm:num_requests_running", 0.0).await;
    server
        .await_metric("pagedattn:kv_cache_blocks_used", 0.0)
        .await;
    let ok = server
        .post(
            "/v1/completions",
            &json!({"model": "m", "prompt": prompt(8, 10), "max_tokens": 4}),
        )
        .await;
    assert_eq!(ok.status, StatusCode::OK);
    let summary = server.stop();
    assert_eq!(summary.aborted, 2);
    assert_eq!(summary.finished, 1);
}

/// Past the waiting queue's bound a request gets 429 with `Retry-After`; what was queued is
/// served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_gets_429_with_retry_after() {
    let mut config = ServerConfig::new("m");
    config.max_waiting = 2;
    // One sequence a step: one request runs, two wait, the fourth is refused.
    let server = std::sync::Arc::new(start(config, engine_config(512, 1), TestModel::Paced));
    let long = json!({"model": "m", "prompt": prompt(9, 8), "max_tokens": 300, "temperature": 0, "ignore_eos": true});
    let mut held = Vec::new();
    for _ in 0..3 {
        let client = std::sync::Arc::clone(&server);
        let body = long.clone();
        held.push(tokio::spawn(async move {
            client.post("/v1/completions", &body).await.status
        }));
        let start = Instant::now();
        let before = held.len() as f64;
        // Each accepted before the next is sent.
        while server.metric("vllm:prompt_tokens_total").await < 8.0 * before {
            assert!(start.elapsed() < Duration::from_secs(10));
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    let refused = server.post("/v1/completions", &long).await;
    assert_eq!(
        refused.status,
        StatusCode::TOO_MANY_REQUESTS,
        "{}",
        refused.body
    );
    assert_eq!(refused.headers["retry-after"], "1");
    assert_eq!(refused.json()["error"]["code"], "queue_full");
    for h in held {
        assert_eq!(h.await.unwrap(), StatusCode::OK);
    }
}
