//! Shutdown: in-flight requests finish, or are aborted at the deadline; the blocks are all
//! free at the end.

use std::time::Duration;

use http_body_util::BodyExt;
use pagedattn_server::ServerConfig;
use serde_json::json;

use crate::common::{engine_config, events, prompt, start, TestModel};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_lets_requests_in_flight_finish() {
    let server = start(
        ServerConfig::new("m"),
        engine_config(512, 8),
        TestModel::Paced,
    );
    let body = json!({
        "model": "m", "prompt": prompt(3, 12), "max_tokens": 200, "temperature": 0,
        "ignore_eos": true, "stream": true, "return_token_ids": true,
    });
    let mut stream = server.open_stream("/v1/completions", &body).await;
    let first = stream.frame().await.unwrap().unwrap();
    assert!(first.is_data());
    server.shutdown();
    let rest = stream.collect().await.unwrap().to_bytes();
    let events = events(&String::from_utf8_lossy(&rest));
    assert!(events.last().unwrap().is_null(), "ends with [DONE]");
    let reason = &events[events.len() - 2]["choices"][0]["finish_reason"];
    assert_eq!(reason, "length", "{events:?}");
    let summary = server.stop();
    assert_eq!((summary.finished, summary.aborted), (1, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_aborts_what_has_not_finished_by_its_deadline() {
    let mut config = ServerConfig::new("m");
    config.shutdown_timeout = Duration::from_millis(100);
    let server = start(config, engine_config(1024, 8), TestModel::Paced);
    let body = json!({
        "model": "m", "prompt": prompt(5, 12), "max_tokens": 1000, "temperature": 0,
        "ignore_eos": true, "stream": true,
    });
    let mut stream = server.open_stream("/v1/completions", &body).await;
    assert!(stream.frame().await.unwrap().unwrap().is_data());
    server.shutdown();
    let rest = stream.collect().await.unwrap().to_bytes();
    let events = events(&String::from_utf8_lossy(&rest));
    assert!(events.last().unwrap().is_null());
    let error = &events[events.len() - 2]["error"];
    assert!(
        error["message"].as_str().unwrap().contains("shut down"),
        "{events:?}"
    );
    let summary = server.stop();
    assert_eq!(summary.aborted, 1);
}

/// An engine that fails (an error mid-stream) or panics (a bug on its thread): the stream in
/// flight ends with an error event, and the server stops by itself saying why (a supervisor
/// restarts it) instead of answering 503 forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_failure_or_panic_ends_the_streams_and_stops_the_server() {
    for (model, streamed, stopped) in [
        (TestModel::Failing, "injected failure", "injected failure"),
        (TestModel::Panicking, "not serving", "panicked"),
    ] {
        let server = start(ServerConfig::new("m"), engine_config(512, 8), model);
        let body = json!({
            "model": "m", "prompt": prompt(6, 12), "max_tokens": 100, "temperature": 0,
            "ignore_eos": true, "stream": true,
        });
        let events = server.stream("/v1/completions", &body).await;
        assert!(events.last().unwrap().is_null());
        let error = &events[events.len() - 2]["error"];
        let message = error["message"].as_str().unwrap();
        assert!(message.contains(streamed), "{model:?}: {events:?}");
        assert_eq!(error["type"], "server_error");
        let failure = server.failure();
        assert!(failure.contains(stopped), "{model:?}: {failure}");
    }
}
