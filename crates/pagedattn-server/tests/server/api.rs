//! The endpoints' answers and refusals.

use hyper::StatusCode;
use pagedattn_server::ServerConfig;
use serde_json::{json, Value};

use crate::common::{engine_config, prompt, start, TestModel};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_health_and_metrics_answer() {
    let server = start(
        ServerConfig::new("m"),
        engine_config(64, 8),
        TestModel::Synthetic,
    );
    let models = server.call("GET", "/v1/models", "").await;
    assert_eq!(models.status, StatusCode::OK);
    let models = models.json();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "m");
    assert_eq!(models["data"][0]["max_model_len"], 1024);
    assert_eq!(
        server.call("GET", "/health", "").await.status,
        StatusCode::OK
    );
    let metrics = server.call("GET", "/metrics", "").await;
    assert!(metrics.headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/plain"));
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:num_preemptions_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
    ] {
        assert!(
            metrics.body.contains(&format!("{name}{{model_name=\"m\"")),
            "{name}"
        );
    }
    assert_eq!(server.metric("pagedattn:kv_cache_blocks_total").await, 64.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_streamed_and_not_has_the_same_tokens_with_usage() {
    let server = start(
        ServerConfig::new("m"),
        engine_config(64, 8),
        TestModel::Synthetic,
    );
    let body = json!({
        "model": "m", "prompt": prompt(1, 20), "max_tokens": 12, "temperature": 0,
        "ignore_eos": true, "return_token_ids": true,
    });
    let plain = server.post("/v1/completions", &body).await.json();
    assert_eq!(plain["object"], "text_completion");
    assert_eq!(plain["choices"][0]["finish_reason"], "length");
    let tokens = plain["choices"][0]["token_ids"].clone();
    assert_eq!(tokens.as_array().unwrap().len(), 12);
    assert_eq!(
        plain["usage"],
        json!({"prompt_tokens": 20, "completion_tokens": 12, "total_tokens": 32})
    );
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let events = server.stream("/v1/completions", &streamed).await;
    assert_eq!(events.last(), Some(&Value::Null), "ends with [DONE]");
    let chunks = &events[..events.len() - 1];
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 12);
    let mut ids = Vec::new();
    for c in &chunks[..chunks.len() - 1] {
        assert_eq!(c["usage"], Value::Null, "usage only in the last chunk");
        ids.extend(
            c["choices"][0]["token_ids"]
                .as_array()
                .unwrap()
                .iter()
                .cloned(),
        );
    }
    assert_eq!(Value::Array(ids), tokens);
    assert_eq!(
        chunks[chunks.len() - 2]["choices"][0]["finish_reason"],
        "length"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_prompts_and_samples_are_choices_in_order() {
    let server = start(
        ServerConfig::new("m"),
        engine_config(128, 16),
        TestModel::Synthetic,
    );
    let body = json!({
        "model": "m", "prompt": [prompt(2, 9), prompt(3, 5)], "max_tokens": 6, "n": 3,
        "temperature": 0.9, "seed": 11, "ignore_eos": true, "return_token_ids": true,
    });
    let answer = server.post("/v1/completions", &body).await.json();
    let choices = answer["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 6);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["token_ids"].as_array().unwrap().len(), 6);
    }
    assert_eq!(answer["usage"]["prompt_tokens"], 14);
    assert_eq!(answer["usage"]["completion_tokens"], 36);
    // The same seed draws the same tokens again.
    let again = server.post("/v1/completions", &body).await.json();
    assert_eq!(again["choices"], answer["choices"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_token_ids_end_a_choice_and_min_tokens_holds_them_off() {
    let server = start(
        ServerConfig::new("m"),
        engine_config(64, 8),
        TestModel::Synthetic,
    );
    let p = prompt(4, 16);
    let greedy = |extra: Value| {
        let mut body = json!({"model": "m", "prompt": p, "max_tokens": 10, "temperature": 0, "return_token_ids": true});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        body
    };
    let free = server
        .post("/v1/completions", &greedy(json!({})))
        .await
        .json();
    let tokens: Vec<u64> = free["choices"][0]["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    assert_eq!(tokens.len(), 10);
    let third = tokens[2];
    let first_seen = tokens.iter().position(|&t| t == third).unwrap();
    let stopped = server
        .post(
            "/v1/completions",
            &greedy(json!({"stop_token_ids": [third]})),
        )
        .await
        .json();
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
    assert_eq!(
        stopped["choices"][0]["token_ids"].as_array().unwrap().len(),
        first_seen + 1
    );
    let held = server
        .post(
            "/v1/completions",
            &greedy(json!({"stop_token_ids": [third], "min_tokens": 6})),
        )
        .await
        .json();
    let held_ids: Vec<u64> = held["choices"][0]["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    assert!(held_ids.len() >= 6, "{held_ids:?}");
    assert!(
        !held_ids[..6].contains(&third),
        "{third} drawn before min_tokens: {held_ids:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_and_text_completions_with_stop_strings() {
    let server = start(
        ServerConfig::new("tiny"),
        engine_config(256, 8),
        TestModel::Text,
    );
    let chat = json!({
        "model": "tiny", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
        "max_tokens": 24, "temperature": 0, "ignore_eos": true,
    });
    let answer = server.post("/v1/chat/completions", &chat).await.json();
    assert_eq!(answer["object"], "chat.completion");
    let content = answer["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(answer["choices"][0]["message"]["role"], "assistant");
    assert_eq!(answer["choices"][0]["finish_reason"], "length");
    // The stream says the same in pieces: the role first, then the content.
    let mut streamed = chat.clone();
    streamed["stream"] = json!(true);
    let events = server.stream("/v1/chat/completions", &streamed).await;
    assert_eq!(events[0]["object"], "chat.completion.chunk");
    assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = events[1..events.len() - 1]
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, content);
    // A stop string taken from the answer ends it before the string (the string not returned).
    let chars: Vec<char> = content.chars().collect();
    if chars.len() >= 8 {
        let stop: String = chars[4..7].iter().collect();
        let cut: String = content[..content.find(&stop).unwrap()].to_string();
        for stream in [false, true] {
            let mut body = chat.clone();
            body["stop"] = json!([stop]);
            body["stream"] = json!(stream);
            let (text, reason) = if stream {
                let events = server.stream("/v1/chat/completions", &body).await;
                let text: String = events
                    .iter()
                    .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
                    .collect();
                let reason = events.iter().rev().find_map(|e| {
                    e["choices"][0]["finish_reason"]
                        .as_str()
                        .map(str::to_string)
                });
                (text, reason.unwrap())
            } else {
                let a = server.post("/v1/chat/completions", &body).await.json();
                (
                    a["choices"][0]["message"]["content"]
                        .as_str()
                        .unwrap()
                        .to_string(),
                    a["choices"][0]["finish_reason"]
                        .as_str()
                        .unwrap()
                        .to_string(),
                )
            };
            assert_eq!(text, cut, "stream {stream}");
            assert_eq!(reason, "stop");
        }
    }
    let completion = server
        .post("/v1/completions", &json!({"model": "tiny", "prompt": "Once upon", "max_tokens": 5, "temperature": 0, "ignore_eos": true}))
        .await;
    assert_eq!(completion.status, StatusCode::OK, "{}", completion.body);
    assert_eq!(completion.json()["usage"]["completion_tokens"], 5);
}

/// Each bad body's status and the field its error names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_openai_errors_and_the_server_keeps_serving() {
    let mut config = ServerConfig::new("tiny");
    config.max_body_bytes = 4096;
    let server = start(config, engine_config(16, 8), TestModel::Text);
    let ok = json!({"model": "tiny", "prompt": "hi", "max_tokens": 3});
    let with = |field: &str, value: Value| {
        let mut body = ok.clone();
        body[field] = value;
        body.to_string()
    };
    let chat = |messages: Value| json!({"model": "tiny", "messages": messages}).to_string();
    let cases: Vec<(&str, String, u16, Option<&str>)> = vec![
        ("/v1/completions", "{\"model\": ".into(), 400, None),
        ("/v1/completions", "[1, 2]".into(), 400, None),
        (
            "/v1/completions",
            with("max_tokens", json!(0)),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/completions",
            with("max_tokens", json!(-3)),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/completions",
            with("max_tokens", json!("ten")),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/completions",
            with("max_tokens", json!(5000)),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/completions",
            with("temperature", json!(-0.5)),
            400,
            Some("temperature"),
        ),
        (
            "/v1/completions",
            with("temperature", json!(2.5)),
            400,
            Some("temperature"),
        ),
        (
            "/v1/completions",
            with("top_p", json!(0)),
            400,
            Some("top_p"),
        ),
        ("/v1/completions", with("n", json!(17)), 400, Some("n")),
        ("/v1/completions", with("n", json!(0)), 400, Some("n")),
        (
            "/v1/completions",
            with("model", json!("gpt-4")),
            404,
            Some("model"),
        ),
        (
            "/v1/completions",
            with("prompt", json!([])),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            with("prompt", json!([1, 99999])),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            with("prompt", json!({"a": 1})),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            with("stop", json!(["a", ""])),
            400,
            Some("stop"),
        ),
        ("/v1/completions", with("stop", json!(7)), 400, Some("stop")),
        (
            "/v1/completions",
            with("stream_options", json!({"include_usage": true})),
            400,
            Some("stream_options"),
        ),
        (
            "/v1/completions",
            with("logprobs", json!(5)),
            400,
            Some("logprobs"),
        ),
        (
            "/v1/completions",
            with("presence_penalty", json!(0.5)),
            400,
            Some("presence_penalty"),
        ),
        (
            "/v1/completions",
            with("frobnicate", json!(true)),
            400,
            Some("frobnicate"),
        ),
        (
            "/v1/completions",
            with("min_tokens", json!(9)),
            400,
            Some("min_tokens"),
        ),
        (
            "/v1/completions",
            with("stop_token_ids", json!([1_000_000])),
            400,
            Some("stop_token_ids"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi"}).to_string(),
            400,
            Some("model"),
        ),
        (
            "/v1/completions",
            with("prompt", json!("x".repeat(5000))),
            413,
            None,
        ),
        (
            "/v1/chat/completions",
            chat(json!([])),
            400,
            Some("messages"),
        ),
        (
            "/v1/chat/completions",
            chat(json!("hi")),
            400,
            Some("messages"),
        ),
        (
            "/v1/chat/completions",
            chat(json!([{"content": "hi"}])),
            400,
            Some("messages[0]"),
        ),
        (
            "/v1/chat/completions",
            chat(json!([{"role": "user", "content": [{"type": "image_url"}]}])),
            400,
            Some("messages[0]"),
        ),
        (
            "/v1/chat/completions",
            chat(json!([{"role": "user", "content": "hi", "tool_calls": []}])),
            400,
            Some("messages[0]"),
        ),
        (
            "/v1/chat/completions",
            chat(json!([{"role": "wizard", "content": "hi"}])),
            400,
            Some("messages"),
        ),
    ];
    for (path, body, status, param) in cases {
        let answer = server.call("POST", path, body.clone()).await;
        assert_eq!(
            answer.status.as_u16(),
            status,
            "{path} {body}: {}",
            answer.body
        );
        let error = &answer.json()["error"];
        assert!(
            error["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{}",
            answer.body
        );
        assert!(error["type"].is_string(), "{}", answer.body);
        assert_eq!(error["param"].as_str(), param, "{body}: {}", answer.body);
        assert!(error.get("code").is_some());
    }
    // The template's own refusal is the message.
    let refused = server
        .post(
            "/v1/chat/completions",
            &json!({"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}),
        )
        .await;
    let message = refused.json()["error"]["message"].to_string();
    assert!(message.contains("Unknown role: wizard"), "{message}");
    // Not UTF-8.
    let mut bytes = b"{\"model\": \"tiny\", \"prompt\": \"".to_vec();
    bytes.extend([0xff, 0xfe, b'"', b'}']);
    let answer = server.call("POST", "/v1/completions", bytes).await;
    assert_eq!(answer.status.as_u16(), 400, "{}", answer.body);
    assert!(answer.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("JSON"));
    // Refusals of the engine itself: a request that can never fit the cache (16 blocks of
    // 8 tokens) is refused before it is queued.
    let big = server
        .post(
            "/v1/completions",
            &json!({"model": "tiny", "prompt": "x".repeat(100), "max_tokens": 100}),
        )
        .await;
    assert_eq!(big.status.as_u16(), 400, "{}", big.body);
    assert_eq!(big.json()["error"]["param"], "max_tokens");
    for (method, path, status) in [("GET", "/v1/completions", 405), ("GET", "/nowhere", 404)] {
        let answer = server.call(method, path, "").await;
        assert_eq!(answer.status.as_u16(), status);
        assert!(answer.json()["error"]["message"].is_string());
    }
    // Still serving, and nothing leaked (the drop checks the block manager). The engine loop
    // publishes the metrics after the step whose tokens the answer carries: a loaded machine
    // may read them before (CI saw 1 block in use).
    let answer = server.post("/v1/completions", &ok).await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.body);
    server
        .await_metric("pagedattn:kv_cache_blocks_used", 0.0)
        .await;
}
