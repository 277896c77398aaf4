//! `pagedattn serve` as a process: it says where it listens, answers, refuses what it cannot
//! start with one line (exit 2), and on SIGTERM or SIGINT stops cleanly (exit 0) after the
//! requests in flight.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Starts `pagedattn serve --port 0 ARGS` on `cpu`; returns it and the port it printed.
fn serve(args: &[&str]) -> (Child, u16) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_pagedattn"))
        .args([
            "serve",
            "--backend",
            "cpu",
            "--port",
            "0",
            "--kv-cache-memory",
            "64MiB",
        ])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let port = line
        .trim()
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no port in {line:?}"));
    (child, port)
}

/// One HTTP/1.1 request with `Connection: close`; the whole response. (The server's own
/// tests drive it with hyper's client; this checks the process, not the protocol.)
fn request(port: u16, method: &str, path: &str, body: &str) -> String {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    response
}

/// Sends `signal` and waits (at most 30 s) for the exit code and stderr.
fn stop(mut child: Child, signal: &str) -> (Option<i32>, String) {
    let killed = Command::new("kill")
        .args([signal, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut stderr = String::new();
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut stderr)
                .unwrap();
            return (status.code(), stderr);
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no exit after {signal}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn it_serves_then_stops_cleanly_on_sigterm_and_sigint() {
    for signal in ["-TERM", "-INT"] {
        let (child, port) = serve(&["--served-model-name", "syn"]);
        let health = request(port, "GET", "/health", "");
        assert!(health.starts_with("HTTP/1.1 200"), "{health}");
        let answer = request(
            port,
            "POST",
            "/v1/completions",
            r#"{"model": "syn", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}"#,
        );
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.contains("\"completion_tokens\":4"), "{answer}");
        let (code, stderr) = stop(child, signal);
        assert_eq!(code, Some(0), "{signal}: {stderr}");
        assert!(
            stderr.contains("stopped after 1 requests finished"),
            "{stderr}"
        );
    }
}

#[test]
fn what_cannot_start_is_one_line_and_exit_2() {
    let (child, port) = serve(&[]);
    // The port is taken.
    let out = Command::new(env!("CARGO_BIN_EXE_pagedattn"))
        .args(["serve", "--backend", "cpu", "--port", &port.to_string()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    assert!(stderr.contains(&format!("--port {port}")), "{stderr}");
    stop(child, "-TERM");
    for (args, needle) in [
        (&["--model", "/nonexistent.gguf"][..], "/nonexistent.gguf"),
        (&["--host", "no such host"], "--host no such host"),
        (
            &["--precision", "fast", "--model-on", "cloud"],
            "--model-on cloud",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_pagedattn"))
            .args(["serve", "--backend", "cpu", "--port", "0"])
            .args(args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(out.stdout.is_empty());
    }
}
