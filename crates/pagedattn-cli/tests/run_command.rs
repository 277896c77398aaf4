//! `pagedattn run`: the engine on the synthetic model (every attention call of a small chat
//! workload recomputed with `reference`), its JSON report and its errors; and a replay case
//! on a backend, checked against `reference`.

use std::path::Path;
use std::process::{Command, Output};

use pagedattn::cpu::{Isa, ISA_ENV};

fn pagedattn(args: &[&str], isa: Option<Isa>) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pagedattn"));
    cmd.args(args);
    if let Some(isa) = isa {
        cmd.env(ISA_ENV, isa.name());
    }
    cmd.output().unwrap()
}

/// Exit code 0 and the check's verdict "ok" on stdout, which names `backend`.
fn assert_ok(out: &Output, backend: &str) {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(0),
        "stdout: {stdout} stderr: {stderr}"
    );
    assert!(stdout.contains(&format!("{backend}: ")), "{stdout}");
    assert!(stdout.trim_end().ends_with(": ok"), "{stdout}");
}

/// Exit code 0 and the engine's report on stdout: `backend` and `workload` named, all
/// `requests` served, every attention call verified. Returns stdout.
fn assert_served(out: &Output, backend: &str, workload: &str, requests: usize) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(0),
        "stdout: {stdout} stderr: {stderr}"
    );
    assert!(
        stdout.contains(&format!(" on {backend}, workload {workload}")),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!("requests: {requests} (0 rejected)")),
        "{stdout}"
    );
    let verified = stdout
        .lines()
        .find_map(|l| l.strip_prefix("verification: "))
        .unwrap_or_else(|| panic!("{stdout}"));
    let words: Vec<&str> = verified.split_whitespace().collect();
    assert_eq!(words[0], words[2], "every call checked: {verified}");
    stdout
}

#[test]
fn the_engine_serves_verified_on_every_isa() {
    let args = [
        "run",
        "--requests",
        "6",
        "--max-new-tokens",
        "12",
        "--verify",
    ];
    let with = |backend: &'static str| [&args[..], &["--backend", backend]].concat();
    assert_served(&pagedattn(&with("reference"), None), "reference", "chat", 6);
    for isa in Isa::ALL.into_iter().filter(|i| i.is_available()) {
        assert_served(&pagedattn(&with("cpu"), Some(isa)), "cpu", "chat", 6);
    }
}

#[test]
fn the_encoder_workloads_serve_verified_on_cpu_and_reference() {
    for backend in ["cpu", "reference"] {
        for (workload, says) in [
            ("encoder", "pooled outputs: 4 (encoder-only requests)"),
            ("encoder-decoder", "encoder prompt tokens "),
        ] {
            let out = pagedattn(
                &[
                    "run",
                    "--backend",
                    backend,
                    "--workload",
                    workload,
                    "--requests",
                    "4",
                    "--max-new-tokens",
                    "8",
                    "--verify",
                ],
                None,
            );
            let stdout = assert_served(&out, backend, workload, 4);
            assert!(stdout.contains(says), "{stdout}");
        }
    }
}

#[test]
fn ctrl_c_prints_the_report_so_far() {
    // A workload of minutes, interrupted after 3 s (the handler is in place long before).
    let child = Command::new(env!("CARGO_BIN_EXE_pagedattn"))
        .args([
            "run",
            "--backend",
            "cpu",
            "--requests",
            "400",
            "--max-new-tokens",
            "2000",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_secs(3));
    let killed = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(130), "{stdout}");
    assert!(
        stdout.contains("(interrupted: the report so far)"),
        "{stdout}"
    );
    assert!(stdout.contains("requests: 400 (0 rejected)"), "{stdout}");
}

/// The JSON report of `pagedattn ARGS` (which must exit with 0).
fn json_report(args: &[&str]) -> serde_json::Value {
    let out = pagedattn(args, None);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn json_report_holds_every_request() {
    let report = json_report(&[
        "run",
        "--backend",
        "cpu",
        "--requests",
        "5",
        "--max-new-tokens",
        "7",
        "--json",
    ]);
    let requests = report["requests"].as_array().unwrap();
    assert_eq!(requests.len(), 5);
    for r in requests {
        let generated = r["generated"][0].as_array().unwrap();
        assert!(!generated.is_empty() && generated.len() <= 7, "{r}");
    }
    assert_eq!(
        report["summary"]["generated_tokens"].as_u64(),
        Some(
            requests
                .iter()
                .map(|r| r["generated"][0].as_array().unwrap().len() as u64)
                .sum()
        )
    );
}

#[test]
fn replay_case_runs_and_writes_output() {
    let case = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/mixed_batch.safetensors");
    let out_path =
        std::env::temp_dir().join(format!("pagedattn-run-{}.safetensors", std::process::id()));
    let out = pagedattn(
        &[
            "forward",
            "--input",
            case.to_str().unwrap(),
            "--output",
            out_path.to_str().unwrap(),
            "--check",
        ],
        None,
    );
    assert_ok(&out, "cpu");
    let written = std::fs::read(&out_path).unwrap();
    let result = pagedattn::replay::read_output(&written).unwrap();
    let case = pagedattn::replay::read_case(&std::fs::read(&case).unwrap()).unwrap();
    assert_eq!(result.output.shape(), case.query.shape());
    std::fs::remove_file(out_path).unwrap();
}

#[test]
fn bad_input_is_one_line_and_exit_code_2() {
    let dir = std::env::temp_dir().join(format!("pagedattn-run-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("trace.jsonl");
    std::fs::write(
        &trace,
        "{\"tokens\": [1, 2]}\n{\"tokens\": [1], \"n\": 0}\n",
    )
    .unwrap();
    let not_gguf = dir.join("model.gguf");
    std::fs::write(&not_gguf, b"GGUF\x03\x00\x00\x00").unwrap();
    let (trace, not_gguf) = (trace.to_str().unwrap(), not_gguf.to_str().unwrap());
    let hf = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/hf-models");
    let (llama, bert) = (hf.join("llama"), hf.join("bert"));
    let (llama, bert) = (llama.to_str().unwrap(), bert.to_str().unwrap());
    // A folder of an architecture not served: llama's files under a T5 config.
    let t5 = dir.join("t5");
    std::fs::create_dir_all(&t5).unwrap();
    for file in [
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        std::fs::copy(hf.join("llama").join(file), t5.join(file)).unwrap();
    }
    std::fs::write(t5.join("config.json"), r#"{"model_type": "t5"}"#).unwrap();
    let t5 = t5.to_str().unwrap();
    for (args, says) in [
        (
            &["forward", "--input", "/nonexistent/case.safetensors"][..],
            "/nonexistent/case.safetensors",
        ),
        (&["run", "--backend", "nope"][..], "nope"),
        (
            &["run", "--trace", trace][..],
            "trace line 2: field `n` is 0",
        ),
        (&["run", "--model", not_gguf][..], "truncated"),
        (
            &["run", "--model", "/nonexistent/m.gguf"][..],
            "/nonexistent/m.gguf",
        ),
        (
            &["run", "--workload", "nope"][..],
            "unknown workload `nope`",
        ),
        (
            &["run", "--model", t5][..],
            "t5/config.json: model_type = \"t5\": expected one of llama, mistral, qwen2, gemma2, bloom, opt, bert, bart",
        ),
        (
            &["run", "--workload", "encoder", "--model", llama][..],
            "--workload encoder needs an encoder-only model; llama is a decoder model",
        ),
        (
            &["run", "--workload", "encoder-decoder", "--model", bert][..],
            "--workload encoder-decoder needs an encoder-decoder model; bert is an encoder-only model",
        ),
        (
            &["run", "--input", "case.safetensors"][..],
            "--input",
        ),
        (&["run", "--prompt", "hi"][..], "no tokenizer"),
        // Numeric flags are checked where they enter (these once panicked or aborted).
        (&["run", "--block-size", "0"][..], "--block-size"),
        (&["run", "--rate", "nan"][..], "--rate"),
        (&["run", "--rate=-1"][..], "--rate"),
        (&["run", "--rate", "0"][..], "--rate"),
        (&["run", "--requests", "10000000"][..], "--requests"),
        (&["run", "--top-p", "1e-300"][..], "--top-p"),
        (&["run", "--temperature", "inf"][..], "--temperature"),
        (&["run", "--max-seqs", "0"][..], "--max-seqs"),
        (&["run", "--max-batched-tokens", "0"][..], "--max-batched-tokens"),
        (&["run", "--num-blocks", "0"][..], "--num-blocks"),
        // Tensor parallelism shards the GPU model only.
        (&["run", "--tensor-parallel", "0"][..], "--tensor-parallel"),
        (
            &["run", "--tensor-parallel", "2", "--backend", "cpu"][..],
            "--tensor-parallel 2: expected --backend cuda",
        ),
    ] {
        let out = pagedattn(args, None);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// Requests arriving over time (a trace with spread-out arrivals, and `--rate`) are all
/// served (the engine once stopped at the first arrival after it idled), and a request that
/// cannot be served is rejected alone, with its reason, while the others run.
#[test]
fn arrivals_over_time_are_served_and_a_bad_request_is_rejected_alone() {
    let dir = std::env::temp_dir().join(format!("pagedattn-run-arrivals-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("trace.jsonl");
    std::fs::write(
        &trace,
        concat!(
            "{\"tokens\": [1, 2], \"max_new_tokens\": 2}\n",
            "{\"tokens\": [1, 2], \"max_new_tokens\": 2, \"arrival\": 0.3}\n",
            "{\"tokens\": [3], \"max_new_tokens\": 1000000000000}\n",
            "{\"tokens\": [3], \"top_p\": 1e-300}\n",
            "{\"tokens\": [4000000000]}\n",
            "{\"tokens\": [5, 6], \"max_new_tokens\": 3, \"arrival\": 0.6}\n",
            "{\"tokens\": [7], \"arrival\": 4294967296}\n",
        ),
    )
    .unwrap();
    let report = json_report(&[
        "run",
        "--trace",
        trace.to_str().unwrap(),
        "--backend",
        "cpu",
        "--json",
    ]);
    let requests = report["requests"].as_array().unwrap();
    let rejected: Vec<String> = requests
        .iter()
        .filter_map(|r| r["rejected"].as_str().map(String::from))
        .collect();
    assert_eq!(rejected.len(), 4, "{rejected:?}");
    for (reason, says) in rejected.iter().zip([
        "prompt + max_new_tokens",
        "top_p",
        "token 4000000000",
        "arrival = 4294967296: expected seconds in [0, 86400]",
    ]) {
        assert!(reason.contains(says), "{reason}");
    }
    assert_eq!(report["summary"]["generated_tokens"].as_u64(), Some(7));
    let served = json_report(&[
        "run",
        "--rate",
        "20",
        "--requests",
        "4",
        "--max-new-tokens",
        "2",
        "--backend",
        "cpu",
        "--json",
    ]);
    assert_eq!(served["summary"]["generated_tokens"].as_u64(), Some(8));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn ten_thousand_requests_run_in_a_pool_sized_by_memory() {
    // 10^4 short requests at once, a 1 MiB pool (128 blocks of the synthetic model): the
    // requests wait for blocks, and what the run holds is the pool and the requests' records,
    // not room for every request.
    let dir = std::env::temp_dir().join(format!("pagedattn-run-10k-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("trace.jsonl");
    let lines: String = (0..10_000u32)
        .map(|i| {
            let prompt: Vec<String> = (0..1 + i % 8)
                .map(|t| (100 + (7 * i + t) % 1900).to_string())
                .collect();
            format!(
                "{{\"tokens\": [{}], \"max_new_tokens\": {}}}\n",
                prompt.join(", "),
                1 + i % 3
            )
        })
        .collect();
    std::fs::write(&trace, lines).unwrap();
    let args = [
        "run",
        "--trace",
        trace.to_str().unwrap(),
        "--backend",
        "cpu",
    ];
    let report = json_report(
        &[
            &args[..],
            &["--no-verify", "--kv-cache-memory", "1MiB", "--json"],
        ]
        .concat(),
    );
    let summary = &report["summary"];
    assert_eq!(summary["requests"].as_u64(), Some(10_000));
    assert_eq!(summary["rejected"].as_u64(), Some(0));
    let generated: u64 = (0..10_000u64).map(|i| 1 + i % 3).sum();
    assert_eq!(summary["generated_tokens"].as_u64(), Some(generated));
    assert!(
        report["kv_cache_bytes"].as_u64().unwrap() <= 1 << 20,
        "{}",
        report["kv_cache_bytes"]
    );
    let peak = report["peak_resident_bytes"]
        .as_u64()
        .expect("Linux reports VmHWM");
    assert!(peak < 512 << 20, "peak resident {peak} bytes");
    // A pool that cannot hold one block is refused, naming the flag's budget.
    let out = pagedattn(&[&args[..], &["--kv-cache-memory", "100"]].concat(), None);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("a KV cache of 100 bytes: expected at least one block"),
        "{stderr}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

/// SmolLM2's GGUF, or `None` after saying the test is skipped (`PAGEDATTN_REQUIRE_MODEL=1`:
/// a failure instead).
fn smollm2() -> Option<std::path::PathBuf> {
    let path = match std::env::var_os("PAGEDATTN_SMOLLM2") {
        Some(p) => std::path::PathBuf::from(p),
        None => Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    };
    if path.is_file() {
        return Some(path);
    }
    let msg = format!("{} is missing (tools/fetch-smollm2.sh)", path.display());
    assert!(
        std::env::var("PAGEDATTN_REQUIRE_MODEL").as_deref() != Ok("1"),
        "{msg} and PAGEDATTN_REQUIRE_MODEL=1"
    );
    eprintln!("SKIPPED: {msg}");
    None
}

#[test]
fn ignore_eos_applies_to_every_trace_request() {
    let Some(model) = smollm2() else { return };
    let trace = std::env::temp_dir().join(format!("pagedattn-eos-{}.jsonl", std::process::id()));
    // Answered in a few tokens and the end of the turn: SmolLM2 stops long before 48.
    std::fs::write(
        &trace,
        "{\"chat\": \"What is the capital of France?\", \"max_new_tokens\": 48}\n",
    )
    .unwrap();
    let generated = |extra: &[&str]| -> u64 {
        let mut args = vec![
            "run",
            "--backend",
            "cpu",
            "--model",
            model.to_str().unwrap(),
            "--trace",
            trace.to_str().unwrap(),
            "--json",
        ];
        args.extend_from_slice(extra);
        json_report(&args)["summary"]["generated_tokens"]
            .as_u64()
            .unwrap()
    };
    let stopped = generated(&[]);
    assert!(
        stopped < 48,
        "the answer ran to the limit without --ignore-eos: {stopped}"
    );
    assert_eq!(generated(&["--ignore-eos"]), 48);
    std::fs::remove_file(trace).unwrap();
}

#[test]
fn options_a_trace_overrides_are_refused_with_it() {
    for option in [
        &["--temperature", "0.5"][..],
        &["--top-p", "0.9"],
        &["--max-new-tokens", "3"],
        &["--requests", "3"],
        &["--rate", "2"],
    ] {
        let mut args = vec!["run", "--trace", "t.jsonl"];
        args.extend_from_slice(option);
        let out = pagedattn(&args, None);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(option[0]), "{args:?}: {stderr}");
    }
}

/// `pagedattn` with `args`, killed after `limit`: its output, or `None` if it was still
/// running (a hang).
fn pagedattn_within(args: &[String], limit: std::time::Duration) -> Option<Output> {
    use std::io::Read;
    use std::process::Stdio;
    let mut child = Command::new(env!("CARGO_BIN_EXE_pagedattn"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The pipes drained while it runs (a full pipe would stall it).
    let drain = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = pipe.read_to_end(&mut bytes);
            bytes
        })
    };
    let stdout = drain(Box::new(child.stdout.take().unwrap()));
    let stderr = drain(Box::new(child.stderr.take().unwrap()));
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    };
    let (stdout, stderr) = (stdout.join().unwrap(), stderr.join().unwrap());
    status.map(|status| Output {
        status,
        stdout,
        stderr,
    })
}

/// Hostile values for numeric fields and flags: zeros, negatives, fractions, NaN and
/// infinities, huge counts, past-the-type values, wrong types.
const HOSTILE_NUMBERS: [&str; 16] = [
    "0",
    "1",
    "-1",
    "0.5",
    "3",
    "4096",
    "1e12",
    "1e-300",
    "1e400",
    "-0",
    "18446744073709551616",
    "4294967296",
    "nan",
    "inf",
    "\"7\"",
    "null",
];

/// Random traces (lines of every field with hostile values, junk lines, arrivals spread and
/// bunched) and random flags with hostile values, through `pagedattn run` on the synthetic
/// model: each a run (exit 0) or one line on stderr and exit 2, within its time, never a
/// panic, an abort or a hang. `PAGEDATTN_HOSTILE_CASES` sets the count (CI: 30 of each).
#[test]
fn hostile_traces_and_flags_are_one_line_errors_or_runs() {
    use rand::{Rng, SeedableRng};
    let cases: usize = std::env::var("PAGEDATTN_HOSTILE_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30);
    let mut rng = rand::rngs::StdRng::seed_from_u64(42);
    let dir = std::env::temp_dir().join(format!("pagedattn-run-hostile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("trace.jsonl");
    let trace_arg = trace.to_str().unwrap().to_string();
    let fields = [
        "arrival",
        "prompt",
        "chat",
        "tokens",
        "max_new_tokens",
        "n",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "ignore_eos",
        "bogus",
    ];
    let flags = [
        "--block-size",
        "--num-blocks",
        "--swap-blocks",
        "--max-batched-tokens",
        "--max-seqs",
        "--rate",
        "--requests",
        "--max-new-tokens",
        "--temperature",
        "--top-p",
        "--seed",
        "--kv-cache-memory",
        "--gpu-memory-utilization",
    ];
    let mut outcomes = [0usize; 2];
    for case in 0..2 * cases {
        // Hostile two times in five, else plausible: most runs get past the parsers.
        let number = |rng: &mut rand::rngs::StdRng| {
            if rng.random_range(0..5) < 2 {
                HOSTILE_NUMBERS[rng.random_range(0..HOSTILE_NUMBERS.len())]
            } else {
                ["1", "2", "4", "0.7", "0.9"][rng.random_range(0..5)]
            }
        };
        let mut args: Vec<String> = vec!["run".into(), "--backend".into(), "cpu".into()];
        if case < cases {
            // A trace: a few lines, each a request (token ids mostly in the vocabulary) with
            // hostile values in some fields, or junk.
            let lines: Vec<String> = (0..rng.random_range(1..6))
                .map(|_| match rng.random_range(0..10) {
                    0 => "{\"tokens\": [1, 2".to_string(),
                    1 => "[1, 2, 3]".to_string(),
                    2 => String::new(),
                    _ => {
                        let tokens: Vec<String> = (0..rng.random_range(0..6))
                            .map(|_| match rng.random_range(0..8) {
                                0 => number(&mut rng).to_string(),
                                _ => rng.random_range(0..2048).to_string(),
                            })
                            .collect();
                        let mut line = format!("{{\"tokens\": [{}]", tokens.join(", "));
                        for _ in 0..rng.random_range(0..4) {
                            let field = fields[rng.random_range(0..fields.len())];
                            line += &format!(", \"{field}\": {}", number(&mut rng));
                        }
                        line + "}"
                    }
                })
                .collect();
            std::fs::write(&trace, lines.join("\n")).unwrap();
            args.extend(["--trace".into(), trace_arg.clone()]);
        } else {
            // Flags: a few with hostile values, the built-in workload kept short.
            args.extend([
                "--requests".into(),
                "3".into(),
                "--max-new-tokens".into(),
                "8".into(),
            ]);
            for _ in 0..rng.random_range(1..4) {
                let flag = flags[rng.random_range(0..flags.len())];
                args.extend([flag.to_string(), number(&mut rng).to_string()]);
            }
        }
        let Some(out) = pagedattn_within(&args, std::time::Duration::from_secs(120)) else {
            panic!(
                "{args:?} (trace: {:?}) ran past 120 s",
                std::fs::read_to_string(&trace)
            );
        };
        let stderr = String::from_utf8_lossy(&out.stderr);
        let context = || {
            format!(
                "{args:?} (trace: {:?}): {stderr}",
                std::fs::read_to_string(&trace)
            )
        };
        match out.status.code() {
            Some(0) => outcomes[0] += 1,
            Some(2) => {
                assert_eq!(stderr.trim_end().lines().count(), 1, "{}", context());
                outcomes[1] += 1;
            }
            other => panic!("exit {other:?}: {}", context()),
        }
        assert!(!stderr.contains("panicked"), "{}", context());
    }
    // Both answers occur: the hostile values reach past the parsers.
    eprintln!("runs, errors: {outcomes:?}");
    assert!(outcomes.iter().all(|&n| n > 0), "{outcomes:?}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// `run --model DIR --prompt TEXT` on each family's Hugging Face folder as transformers wrote
/// it (tests/hf-models), the prompt's text through the folder's own tokenizer: the decoders'
/// and BART's greedy tokens transformers generated (BART's from its decoder start token), and
/// BERT's pooled output.
#[test]
fn every_hugging_face_family_runs_from_its_folder() {
    let models = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/hf-models");
    for family in [
        "llama", "qwen2", "mistral", "gemma2", "bloom", "opt", "bart", "bert",
    ] {
        let dir = models.join(family);
        let golden: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap())
                .unwrap();
        let bert = family == "bert";
        // The golden greedy entry with the most tokens before a near tie (a top-2 margin
        // under 1e-3), and how many.
        let sure = |g: &serde_json::Value| {
            let margins = g["margins"].as_array().unwrap();
            margins
                .iter()
                .position(|m| m.as_f64().unwrap() < 1e-3)
                .unwrap_or(margins.len())
        };
        let entry = match bert {
            true => &golden["prompts"][0],
            false => golden["greedy"]
                .as_array()
                .unwrap()
                .iter()
                .max_by_key(|g| sure(g))
                .unwrap(),
        };
        let prompt = match bert {
            true => &entry["text"],
            false => &entry["prompt"],
        };
        let out = pagedattn(
            &[
                "run",
                "--backend",
                "cpu",
                "--model",
                dir.to_str().unwrap(),
                "--prompt",
                prompt.as_str().unwrap(),
                "--max-new-tokens",
                "32",
                "--ignore-eos",
                "--json",
            ],
            None,
        );
        assert!(
            out.status.success(),
            "{family}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let request = &report["requests"][0];
        if bert {
            let want = golden["pooled"][0].as_array().unwrap();
            let got = request["pooled"].as_array().unwrap();
            assert_eq!(got.len(), want.len());
            for (g, w) in got.iter().zip(want) {
                let (g, w) = (g.as_f64().unwrap(), w.as_f64().unwrap());
                assert!((g - w).abs() <= 1e-5, "bert: pooled {g} against {w}");
            }
            continue;
        }
        let sure = sure(entry);
        let got = request["generated"][0].as_array().unwrap();
        let want = entry["tokens"].as_array().unwrap();
        assert!(sure >= 8, "{family}: a near tie at token {sure}");
        assert_eq!(got[..sure], want[..sure], "{family}");
    }
}
