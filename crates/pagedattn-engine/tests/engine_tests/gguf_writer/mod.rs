//! A minimal GGUF writer for the tests: synthetic files, well-formed or deliberately broken.

/// GGUF's metadata value type codes.
pub const U8: u32 = 0;
pub const U32: u32 = 4;
pub const I32: u32 = 5;
pub const F32: u32 = 6;
pub const BOOL: u32 = 7;
pub const STRING: u32 = 8;
pub const ARRAY: u32 = 9;

/// ggml type codes.
pub const GGML_F32: u32 = 0;
pub const GGML_Q4_1: u32 = 3;
pub const GGML_Q8_0: u32 = 8;

/// Builds a GGUF file: key/values and tensors in the order added, data aligned as GGUF wants.
pub struct GgufWriter {
    pub version: u32,
    pub alignment: usize,
    kvs: Vec<u8>,
    n_kv: u64,
    infos: Vec<u8>,
    n_tensors: u64,
    data: Vec<u8>,
}

/// A GGUF string: u64 length, bytes.
pub fn string(s: &str) -> Vec<u8> {
    let mut v = (s.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(s.as_bytes());
    v
}

impl Default for GgufWriter {
    fn default() -> Self {
        GgufWriter::new(3, 32)
    }
}

impl GgufWriter {
    /// An empty file of `version` whose tensors are aligned to `alignment` (which the caller
    /// writes as `general.alignment` when it is not 32).
    pub fn new(version: u32, alignment: usize) -> Self {
        GgufWriter {
            version,
            alignment,
            kvs: Vec::new(),
            n_kv: 0,
            infos: Vec::new(),
            n_tensors: 0,
            data: Vec::new(),
        }
    }

    /// A key with a value type code and the value's encoded bytes.
    pub fn kv_raw(&mut self, key: &str, ty: u32, payload: &[u8]) -> &mut Self {
        self.kvs.extend(string(key));
        self.kvs.extend(ty.to_le_bytes());
        self.kvs.extend_from_slice(payload);
        self.n_kv += 1;
        self
    }

    pub fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.kv_raw(key, U32, &v.to_le_bytes())
    }

    pub fn kv_f32(&mut self, key: &str, v: f32) -> &mut Self {
        self.kv_raw(key, F32, &v.to_le_bytes())
    }

    pub fn kv_bool(&mut self, key: &str, v: bool) -> &mut Self {
        self.kv_raw(key, BOOL, &[v as u8])
    }

    pub fn kv_str(&mut self, key: &str, v: &str) -> &mut Self {
        self.kv_raw(key, STRING, &string(v))
    }

    pub fn kv_str_array(&mut self, key: &str, items: &[&str]) -> &mut Self {
        let mut p = STRING.to_le_bytes().to_vec();
        p.extend((items.len() as u64).to_le_bytes());
        for s in items {
            p.extend(string(s));
        }
        self.kv_raw(key, ARRAY, &p)
    }

    pub fn kv_i32_array(&mut self, key: &str, items: &[i32]) -> &mut Self {
        let mut p = I32.to_le_bytes().to_vec();
        p.extend((items.len() as u64).to_le_bytes());
        for v in items {
            p.extend(v.to_le_bytes());
        }
        self.kv_raw(key, ARRAY, &p)
    }

    /// A tensor record with an explicit offset and no data (for broken files).
    pub fn tensor_info(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.infos.extend(string(name));
        self.infos.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            self.infos.extend(d.to_le_bytes());
        }
        self.infos.extend(ty.to_le_bytes());
        self.infos.extend(offset.to_le_bytes());
        self.n_tensors += 1;
        self
    }

    /// A tensor with its data, placed at the next aligned offset.
    pub fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, data: &[u8]) -> &mut Self {
        let offset = self.data.len().next_multiple_of(self.alignment);
        self.data.resize(offset, 0);
        self.data.extend_from_slice(data);
        self.tensor_info(name, dims, ty, offset as u64)
    }

    /// The file's bytes.
    pub fn build(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(self.version.to_le_bytes());
        out.extend(self.n_tensors.to_le_bytes());
        out.extend(self.n_kv.to_le_bytes());
        out.extend_from_slice(&self.kvs);
        out.extend_from_slice(&self.infos);
        if self.n_tensors > 0 {
            out.resize(out.len().next_multiple_of(self.alignment), 0);
            out.extend_from_slice(&self.data);
        }
        out
    }
}

/// The file the real model is expected at, or `None` after saying, past the test harness's
/// output capture, that the test is skipped. `PAGEDATTN_REQUIRE_MODEL=1` makes absence a failure.
pub fn model_path() -> Option<std::path::PathBuf> {
    use std::io::Write;
    // `PAGEDATTN_SMOLLM2` names the file where the test binary runs away from its checkout
    // (the GPU machine).
    let path = match std::env::var_os("PAGEDATTN_SMOLLM2") {
        Some(p) => std::path::PathBuf::from(p),
        None => std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    };
    if path.is_file() {
        return Some(path);
    }
    let msg = format!(
        "{} is missing (bash tools/fetch-smollm2.sh fetches it)",
        path.display()
    );
    if std::env::var("PAGEDATTN_REQUIRE_MODEL").as_deref() == Ok("1") {
        panic!("{msg} and PAGEDATTN_REQUIRE_MODEL=1");
    }
    // Written to the stderr handle directly: libtest captures only the print macros.
    let _ = writeln!(std::io::stderr(), "SKIPPED: {msg}");
    None
}
