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

/// An engine error mid-stream: the stream ends with the error, the server stops by itself and
/// says why (a supervisor restarts it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_failure_ends_the_streams_and_stops_the_server() {
    let server = start(
        ServerConfig::new("m"),
        engine_config(512, 8),
        TestModel::Failing,
    );
    let body = json!({
        "model": "m", "prompt": prompt(6, 12), "max_tokens": 100, "temperature": 0,
        "ignore_eos": true, "stream": true,
    });
    let events = server.stream("/v1/completions", &body).await;
    assert!(events.last().unwrap().is_null());
    let error = &events[events.len() - 2]["error"];
    assert!(
        error["message"]
            .as_str()
            .unwrap()
            .contains("injected failure"),
        "{events:?}"
    );
    assert_eq!(error["type"], "server_error");
    assert!(server.failure().contains("injected failure"));
}

/// A panic on the engine's thread (a bug) stops the server too: the stream in flight ends, and
/// `wait` says the thread panicked instead of the server answering 503 forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_panic_stops_the_server() {
    let server = start(
        ServerConfig::new("m"),
        engine_config(512, 8),
        TestModel::Panicking,
    );
    let body = json!({
        "model": "m", "prompt": prompt(6, 12), "max_tokens": 100, "temperature": 0,
        "ignore_eos": true, "stream": true,
    });
    let events = server.stream("/v1/completions", &body).await;
    assert!(events.last().unwrap().is_null());
    let error = &events[events.len() - 2]["error"];
    assert!(
        error["message"].as_str().unwrap().contains("not serving"),
        "{events:?}"
    );
    assert!(server.failure().contains("panicked"));
}
