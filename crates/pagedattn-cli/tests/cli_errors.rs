//! Malformed input to the CLI is one line on stderr and exit code 2, never a panic.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;

fn example_case() -> Vec<u8> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/mixed_batch.safetensors");
    std::fs::read(path).expect("examples/mixed_batch.safetensors is committed")
}

/// A tensor of a safetensors file: dtype, shape, bytes.
type Entry = (Dtype, Vec<usize>, Vec<u8>);

/// Parses `bytes`, lets `edit` change the tensors and metadata, and serializes the result.
fn rewrite(
    bytes: &[u8],
    edit: impl FnOnce(&mut HashMap<String, Entry>, &mut HashMap<String, String>),
) -> Vec<u8> {
    let st = SafeTensors::deserialize(bytes).unwrap();
    let (_, header) = SafeTensors::read_metadata(bytes).unwrap();
    let mut meta = header.metadata().clone().unwrap_or_default();
    let mut tensors: HashMap<String, Entry> = st
        .tensors()
        .into_iter()
        .map(|(name, v)| (name, (v.dtype(), v.shape().to_vec(), v.data().to_vec())))
        .collect();
    edit(&mut tensors, &mut meta);
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, (d, s, b))| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize(views, Some(meta)).unwrap()
}

fn run(args: &[&str], input: Option<&[u8]>, name: &str) -> Output {
    let dir = std::env::temp_dir().join(format!("pagedattn-cli-errors-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pagedattn"));
    cmd.args(args);
    if let Some(bytes) = input {
        let path: PathBuf = dir.join(format!("{name}.safetensors"));
        std::fs::write(&path, bytes).unwrap();
        cmd.arg("--input")
            .arg(path)
            .arg("--output")
            .arg(dir.join(format!("{name}.out")));
    }
    cmd.output().unwrap()
}

/// Asserts exit code 2 and one stderr line that mentions `needle`.
fn assert_one_line_error(out: &Output, needle: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {stderr}");
    assert_eq!(
        stderr.trim_end().lines().count(),
        1,
        "one line expected: {stderr}"
    );
    assert!(stderr.starts_with("error: "), "{stderr}");
    assert!(stderr.contains(needle), "expected {needle:?} in {stderr}");
}

fn forward_error(name: &str, bytes: &[u8], needle: &str) {
    let out = run(&["forward"], Some(bytes), name);
    assert_one_line_error(&out, needle);
}

#[test]
fn valid_example_runs() {
    let out = run(&["forward"], Some(&example_case()), "valid");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn truncated_file() {
    let bytes = example_case();
    for cut in [0, 4, 9, 200, bytes.len() / 2, bytes.len() - 1] {
        forward_error(
            &format!("truncated{cut}"),
            &bytes[..cut],
            "malformed safetensors file",
        );
    }
}

#[test]
fn missing_tensor() {
    for name in [
        "query",
        "seq_lens",
        "query_start_loc",
        "block_tables",
        "slot_mapping",
        "value_cache",
        "value",
    ] {
        let bytes = rewrite(&example_case(), |t, _| {
            t.remove(name);
        });
        forward_error(&format!("missing_{name}"), &bytes, name);
    }
}

#[test]
fn mistyped_tensor() {
    let bytes = rewrite(&example_case(), |t, _| {
        let (_, shape, data) = t.remove("seq_lens").unwrap();
        t.insert("seq_lens".into(), (Dtype::F32, shape, data));
    });
    forward_error("mistyped_seq_lens", &bytes, "seq_lens dtype");
    let bytes = rewrite(&example_case(), |t, _| {
        let (_, shape, data) = t.remove("key").unwrap();
        t.insert("key".into(), (Dtype::F16, shape, data));
    });
    forward_error("mistyped_key", &bytes, "key dtype");
}

#[test]
fn wrong_shape() {
    let bytes = rewrite(&example_case(), |t, _| {
        let q = t.get_mut("query").unwrap();
        q.1 = vec![q.1[0] * 2, q.1[1] / 2, q.1[2]];
    });
    forward_error("wrong_shape", &bytes, "query shape");
}

#[test]
fn inconsistent_metadata() {
    let set_i32 = |name: &'static str, index: usize, value: i32| {
        rewrite(&example_case(), move |t, _| {
            t.get_mut(name).unwrap().2[index * 4..index * 4 + 4]
                .copy_from_slice(&value.to_le_bytes());
        })
    };
    forward_error("short_seq_len", &set_i32("seq_lens", 0, 3), "seq_lens[0]");
    forward_error(
        "block_out_of_range",
        &set_i32("block_tables", 0, 100_000),
        "block_tables[0][0]",
    );
    let bytes = rewrite(&example_case(), |t, _| {
        t.get_mut("slot_mapping").unwrap().2[..8].copy_from_slice(&(1i64 << 40).to_le_bytes());
    });
    forward_error("slot_out_of_range", &bytes, "slot_mapping[0]");
    let bytes = rewrite(&example_case(), |_, m| {
        m.insert("num_prefills".into(), "1".into());
    });
    forward_error("num_prefills", &bytes, "decodes");
    let bytes = rewrite(&example_case(), |_, m| {
        m.insert("num_kv_heads".into(), "3".into());
    });
    forward_error("num_kv_heads", &bytes, "num_kv_heads");
}

#[test]
fn unknown_attn_type_and_bad_metadata() {
    let bytes = rewrite(&example_case(), |_, m| {
        m.insert("attn_type".into(), "cross".into());
    });
    forward_error("attn_type", &bytes, "attn_type");
    let bytes = rewrite(&example_case(), |_, m| {
        m.insert("scale".into(), "abc".into());
    });
    forward_error("scale", &bytes, "scale");
    let bytes = rewrite(&example_case(), |_, m| {
        m.remove("num_heads");
    });
    forward_error("no_num_heads", &bytes, "num_heads");
    let bytes = rewrite(&example_case(), |t, _| {
        t.insert("extra".into(), (Dtype::F32, vec![1], vec![0; 4]));
    });
    forward_error("extra_tensor", &bytes, "unknown tensor extra");
}

#[test]
fn unknown_backend_and_missing_file() {
    let out = run(
        &["forward", "--backend", "nope"],
        Some(&example_case()),
        "backend",
    );
    assert_one_line_error(&out, "backend");
    let out = run(
        &[
            "forward",
            "--input",
            "/nonexistent/case.safetensors",
            "--output",
            "/tmp/x",
        ],
        None,
        "",
    );
    assert_one_line_error(&out, "/nonexistent/case.safetensors");
}

/// `--backend cuda` where no GPU is usable is one line and exit code 2, and `pagedattn info`
/// says why in one line; on a GPU machine the backend starts but has no attention kernels yet,
/// which is the same one-line error.
#[test]
fn cuda_without_attention_or_gpu_is_one_line() {
    let out = run(&["run", "--backend", "cuda"], None, "cuda");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let needle = if stderr.contains("no usable CUDA GPU") {
        "no usable CUDA GPU"
    } else {
        "cuda"
    };
    assert_one_line_error(&out, needle);
    let info = run(&["info"], None, "info");
    assert_eq!(info.status.code(), Some(0));
    let text = String::from_utf8_lossy(&info.stdout);
    let cuda: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("backend cuda"))
        .collect();
    assert_eq!(cuda.len(), 1, "{text}");
    if cuda[0].contains("unavailable") {
        assert!(
            cuda[0].contains("no usable CUDA GPU") || cuda[0].contains("libnvrtc"),
            "{text}"
        );
    } else {
        assert!(text.contains("compute capability"), "{text}");
    }
}

/// Usage errors that clap finds (an unknown flag or command, a flag without its value, a value
/// a typed option cannot parse, no command) are one line too, naming the help to read.
#[test]
fn usage_errors_are_one_line() {
    for (args, needle, help) in [
        (&["--foo"][..], "'--foo'", "try 'pagedattn --help'"),
        (&["run", "--foo"], "'--foo'", "try 'pagedattn run --help'"),
        (
            &["forward", "--input"],
            "'--input <INPUT>'",
            "pagedattn forward --help",
        ),
        (
            &["example", "--output", "/tmp/x", "--seed", "abc"],
            "'abc'",
            "pagedattn example --help",
        ),
        (
            &["bench", "--suite", "nope"],
            "possible values",
            "pagedattn bench --help",
        ),
        (
            &["compile-kernels", "--arch", "sm_80", "--parts", "0"],
            "--parts",
            "pagedattn compile-kernels --help",
        ),
        (&["nope"], "'nope'", "try 'pagedattn --help'"),
        (
            &["serve", "--port", "70000"],
            "'70000'",
            "pagedattn serve --help",
        ),
        (
            &["serve", "--max-n", "0"],
            "at least 1",
            "pagedattn serve --help",
        ),
        (
            &["serve", "--shutdown-timeout=-1"],
            "from 0 to 86400",
            "pagedattn serve --help",
        ),
        (
            &["serve", "--max-request-bytes", "lots"],
            "a byte count",
            "pagedattn serve --help",
        ),
        (
            &[],
            "a command is needed: run, serve, forward",
            "try 'pagedattn --help'",
        ),
    ] {
        let out = run(args, None, "usage");
        assert_one_line_error(&out, needle);
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(help),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.stdout.is_empty(), "{args:?}");
    }
}

/// A sweep's part out of range, or parts without `--depth spread`: one line, exit 2, before
/// NVRTC is looked for.
#[cfg(feature = "cuda")]
#[test]
fn compile_kernels_parts_are_checked() {
    for args in [
        &[
            "compile-kernels",
            "--arch",
            "sm_80",
            "--depth",
            "spread",
            "--parts",
            "2",
            "--part",
            "2",
        ][..],
        &["compile-kernels", "--arch", "sm_80", "--parts", "2"],
    ] {
        let out = run(args, None, "parts");
        assert_one_line_error(
            &out,
            "expected a part below --parts, and more than one part only with --depth spread",
        );
    }
}

/// `--help`, `--version` and `help` print on stdout as clap prints them, with exit code 0.
#[test]
fn help_and_version_print_normally() {
    for args in [
        &["--help"][..],
        &["--version"],
        &["bench", "--help"],
        &["help"],
    ] {
        let out = run(args, None, "help");
        assert_eq!(out.status.code(), Some(0), "{args:?}");
        assert!(out.stderr.is_empty(), "{args:?}");
        assert!(!out.stdout.is_empty(), "{args:?}");
    }
}

/// `bench` refuses the `reference` backend (the f64 oracle: even `--quick` took over 10 minutes
/// on it, timing nothing an engine runs) at once, naming the backends it takes.
#[test]
fn bench_refuses_the_reference_backend() {
    let out = run(
        &["bench", "--backend", "reference", "--quick"],
        None,
        "bench",
    );
    assert_one_line_error(&out, "reference backend is the f64 oracle");
    assert!(String::from_utf8_lossy(&out.stderr).contains("cpu, cuda or auto"));
    assert!(out.stdout.is_empty());
}
