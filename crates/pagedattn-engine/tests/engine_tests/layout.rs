//! The repository's import rules, read off the sources' `crate::` paths (what the compiler
//! would enforce were the wings crates): the engine's wings import only the wings before them
//! (serving <- models <- harness), no two modules import each other through a longer
//! circle, and no fast attention backend imports the `reference` oracle.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Every `.rs` file under `dir`, sorted.
fn sources(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for entry in std::fs::read_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display())) {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// The engine crate's `src/`.
fn engine_src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// The module a file belongs to, as far as the rules go: its wing and the wing's child
/// (`serving::engine` for `serving/engine/forward.rs`), or the root file's name.
fn module_of(file: &Path) -> String {
    let relative = file.strip_prefix(engine_src()).expect("a file of src/");
    let parts: Vec<String> = relative
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    match parts.as_slice() {
        [wing, child, ..] if child != "mod" => format!("{wing}::{child}"),
        [root, ..] => root.clone(),
        [] => String::new(),
    }
}

/// The modules a file's `crate::` paths name (comments included: a doc link is a use too).
fn imports(text: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    for (at, _) in text.match_indices("crate::") {
        // `pagedattn_engine::` in tests, `crate::` here; skip `$crate::` in macros.
        if text[..at].ends_with('$') {
            continue;
        }
        let path: Vec<&str> = text[at + "crate::".len()..]
            .split(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
            .next()
            .unwrap_or("")
            .split("::")
            .filter(|s| !s.is_empty())
            .collect();
        match path.as_slice() {
            [wing @ ("serving" | "models" | "harness"), child, ..]
                if child.starts_with(char::is_lowercase) =>
            {
                found.insert(format!("{wing}::{child}"));
            }
            [first, ..] if first.starts_with(char::is_lowercase) => {
                found.insert(first.to_string());
            }
            _ => {}
        }
    }
    found
}

/// The wing of a module (`serving`, `models`, `harness`) or `None` for the crate root's.
fn wing(module: &str) -> Option<&str> {
    let first = module.split("::").next()?;
    ["serving", "models", "harness"]
        .contains(&first)
        .then_some(first)
}

#[test]
fn wings_import_only_the_wings_before_them_and_no_module_circles() {
    let order = |w: &str| {
        ["serving", "models", "harness"]
            .iter()
            .position(|x| *x == w)
    };
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut wrong = Vec::new();
    for file in sources(&engine_src()) {
        let text = std::fs::read_to_string(&file).expect("a source file reads");
        let from = module_of(&file);
        for to in imports(&text) {
            if let (Some(a), Some(b)) = (wing(&from), wing(&to)) {
                if order(b) > order(a) {
                    wrong.push(format!("{} ({from}) imports {to}", file.display()));
                }
            }
            if to != from && !from.starts_with(&format!("{to}::")) {
                graph.entry(from.clone()).or_default().insert(to);
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "a wing imports a later one:\n{}",
        wrong.join("\n")
    );
    // The wings' modules must form no circle (a module's own submodules are part of it).
    let nodes: Vec<String> = graph.keys().cloned().collect();
    let mut state: BTreeMap<String, u8> = BTreeMap::new(); // 1 visiting, 2 done
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        match state.get(node) {
            Some(2) => return None,
            Some(1) => {
                let start = path.iter().position(|n| n == node).unwrap_or(0);
                let mut circle = path[start..].to_vec();
                circle.push(node.to_string());
                return Some(circle);
            }
            _ => {}
        }
        state.insert(node.to_string(), 1);
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            // The crate root's modules (error, rng) are shared by every wing.
            if wing(next).is_some() {
                if let Some(circle) = visit(next, graph, state, path) {
                    return Some(circle);
                }
            }
        }
        path.pop();
        state.insert(node.to_string(), 2);
        None
    }
    for node in nodes.iter().filter(|n| wing(n).is_some()) {
        if let Some(circle) = visit(node, &graph, &mut state, &mut Vec::new()) {
            panic!("modules import each other: {}", circle.join(" -> "));
        }
    }
    // The rules are read off real paths: the core's engine imports its scheduler, a model
    // family the core's trait, the harness's verifier the core's hook.
    for (from, to) in [
        ("serving::engine", "serving::scheduler"),
        ("models::llama", "serving::model"),
        ("harness::verify", "serving::check"),
    ] {
        assert!(
            graph.get(from).is_some_and(|t| t.contains(to)),
            "{from} -> {to} not found: the import reader is broken"
        );
    }
}

#[test]
fn the_serving_core_names_no_model_and_no_oracle() {
    for file in sources(&engine_src().join("serving")) {
        let text = std::fs::read_to_string(&file).expect("a source file reads");
        for banned in [
            "crate::models",
            "crate::harness",
            "pagedattn::reference",
            "\"reference\"",
        ] {
            assert!(
                !text.contains(banned),
                "{} names {banned}: the core knows models through the Model trait and checks \
                 through CallCheck",
                file.display()
            );
        }
    }
}

#[test]
fn no_fast_backend_imports_the_reference_oracle() {
    let library = Path::new(env!("CARGO_MANIFEST_DIR")).join("../pagedattn/src");
    for backend in ["cpu", "cuda"] {
        let files = sources(&library.join(backend));
        assert!(!files.is_empty(), "the {backend} backend's sources");
        for file in files {
            let text = std::fs::read_to_string(&file).expect("a source file reads");
            for banned in ["crate::reference", "pagedattn::reference", "Reference"] {
                assert!(
                    !text.contains(banned),
                    "{} names {banned}: `reference` is the oracle, for tests and the verifier",
                    file.display()
                );
            }
        }
    }
}
