//! Hugging Face model folders as transformers writes them (`save_pretrained`): `config.json`
//! and the weights in one `model.safetensors` or in shards named by
//! `model.safetensors.index.json`, memory-mapped and read by tensor name as f32 (f32, f16 and
//! bf16 stored). Every refusal names the file and the field or tensor.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata};
use serde_json::{Map, Value};

use crate::{Error, Result};

/// One memory-mapped `.safetensors` file: its header, and where its data begins.
struct WeightFile {
    path: PathBuf,
    map: Mmap,
    header: Metadata,
    data_start: usize,
}

/// An opened model folder.
pub struct HfFolder {
    dir: PathBuf,
    config: Map<String, Value>,
    files: Vec<WeightFile>,
    /// Each tensor's file (its index in `files`).
    file_of: HashMap<String, usize>,
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.display().to_string(),
        source,
    }
}

fn model_error(path: &Path, what: impl std::fmt::Display) -> Error {
    Error::Model(format!("{}: {what}", path.display()))
}

/// Reads `path` as a JSON object.
pub(crate) fn json_object(path: &Path) -> Result<Map<String, Value>> {
    let text = std::fs::read_to_string(path).map_err(io_error(path))?;
    match serde_json::from_str(&text) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(model_error(path, "expected a JSON object")),
        Err(e) => Err(model_error(path, format!("not valid JSON: {e}"))),
    }
}

impl WeightFile {
    fn open(path: PathBuf) -> Result<Self> {
        let file = std::fs::File::open(&path).map_err(io_error(&path))?;
        // SAFETY: the map is read-only and private to this value; the contract is that the
        // model's files are not modified while it loads, as the GGUF reader's is (and every
        // memory-mapping loader's).
        let map = unsafe { Mmap::map(&file) }.map_err(io_error(&path))?;
        let (header_len, header) = safetensors::SafeTensors::read_metadata(&map)
            .map_err(|e| model_error(&path, format!("not a safetensors file: {e}")))?;
        Ok(WeightFile {
            data_start: 8 + header_len,
            path,
            map,
            header,
        })
    }
}

impl WeightFile {
    /// The data bytes `start..end` (offsets after the header), where they lie inside the file.
    fn data(&self, start: usize, end: usize) -> Option<&[u8]> {
        let from = self.data_start.checked_add(start)?;
        let to = self.data_start.checked_add(end)?;
        self.map.get(from..to)
    }
}

impl HfFolder {
    /// Opens `dir`: its `config.json`, and `model.safetensors` or the shards its
    /// `model.safetensors.index.json` names.
    pub fn open(dir: &Path) -> Result<Self> {
        let config = json_object(&dir.join("config.json"))?;
        let index_path = dir.join("model.safetensors.index.json");
        let file_names: Vec<String> = if index_path.exists() {
            let index = json_object(&index_path)?;
            let Some(Value::Object(map)) = index.get("weight_map") else {
                return Err(model_error(&index_path, "weight_map: expected an object"));
            };
            let mut names: Vec<String> = Vec::new();
            for (tensor, file) in map {
                let Some(file) = file.as_str() else {
                    return Err(model_error(
                        &index_path,
                        format!("weight_map.{tensor}: expected a file name"),
                    ));
                };
                if !names.iter().any(|n| n == file) {
                    names.push(file.to_string());
                }
            }
            names
        } else {
            vec!["model.safetensors".into()]
        };
        let mut files = Vec::with_capacity(file_names.len());
        let mut file_of = HashMap::new();
        for name in &file_names {
            // Shard names come from the folder's own index: no path may leave the folder.
            if Path::new(name).components().count() != 1 || name.starts_with('.') {
                return Err(model_error(
                    &index_path,
                    format!("weight_map names `{name}`: expected a file in the folder"),
                ));
            }
            let file = WeightFile::open(dir.join(name))?;
            for tensor in file.header.tensors().keys() {
                if file_of.insert(tensor.clone(), files.len()).is_some() {
                    return Err(model_error(
                        &file.path,
                        format!("tensor `{tensor}` is in two files"),
                    ));
                }
            }
            files.push(file);
        }
        Ok(HfFolder {
            dir: dir.to_path_buf(),
            config,
            files,
            file_of,
        })
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `config.json`'s `model_type`.
    pub fn model_type(&self) -> Result<&str> {
        self.config
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| self.config_error("model_type", "a string"))
    }

    /// `config.json`'s field `key` (`None` where absent or null).
    pub fn config(&self, key: &str) -> Option<&Value> {
        self.config.get(key).filter(|v| !v.is_null())
    }

    /// `config.json`'s field `key` as a whole number.
    pub fn config_usize(&self, key: &str) -> Result<usize> {
        self.config(key)
            .and_then(Value::as_u64)
            .and_then(|v| usize::try_from(v).ok())
            .ok_or_else(|| self.config_error(key, "a whole number"))
    }

    /// `config.json`'s field `key` as a whole number, `None` where absent or null.
    pub fn config_usize_opt(&self, key: &str) -> Result<Option<usize>> {
        self.config(key).map(|_| self.config_usize(key)).transpose()
    }

    /// `config.json`'s field `key` as a number.
    pub fn config_f64(&self, key: &str) -> Result<f64> {
        self.config(key)
            .and_then(Value::as_f64)
            .ok_or_else(|| self.config_error(key, "a number"))
    }

    /// `config.json`'s field `key` as a number, `None` where absent or null.
    pub fn config_f64_opt(&self, key: &str) -> Result<Option<f64>> {
        self.config(key).map(|_| self.config_f64(key)).transpose()
    }

    /// `config.json`'s field `key` as a boolean, `default` where absent or null.
    pub fn config_bool(&self, key: &str, default: bool) -> Result<bool> {
        match self.config(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.config_error(key, "true or false")),
        }
    }

    /// `config.json`'s field `key` as a string, `None` where absent or null.
    pub fn config_str_opt(&self, key: &str) -> Result<Option<&str>> {
        match self.config(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.config_error(key, "a string")),
        }
    }

    /// An error naming `config.json`, the field `key`, its value and what was `expected`.
    pub fn config_error(&self, key: &str, expected: &str) -> Error {
        let value = self
            .config
            .get(key)
            .map_or("missing".to_string(), |v| format!("{v}"));
        model_error(
            &self.dir.join("config.json"),
            format!("{key} = {value}: expected {expected}"),
        )
    }

    /// Every tensor's name.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.file_of.keys().map(String::as_str)
    }

    /// Whether the folder holds tensor `name`.
    pub fn has(&self, name: &str) -> bool {
        self.file_of.contains_key(name)
    }

    /// Tensor `name` as f32, which must have `shape` (row-major, as stored).
    pub fn tensor(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let file = self
            .file_of
            .get(name)
            .map(|&i| &self.files[i])
            .ok_or_else(|| model_error(&self.dir, format!("no tensor `{name}`")))?;
        let info = file
            .header
            .info(name)
            .ok_or_else(|| model_error(&file.path, format!("no tensor `{name}`")))?;
        if info.shape != shape {
            return Err(model_error(
                &file.path,
                format!(
                    "tensor `{name}` has shape {:?}: expected {shape:?}",
                    info.shape
                ),
            ));
        }
        let (start, end) = info.data_offsets;
        let bytes = file.data(start, end).ok_or_else(|| {
            model_error(
                &file.path,
                format!("tensor `{name}`'s data is outside the file"),
            )
        })?;
        // (Shapes come from the caller's config and the file's header: sizes are checked, not
        // trusted to fit.)
        let count = shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .ok_or_else(|| {
                model_error(&file.path, format!("tensor `{name}`: {shape:?} overflows"))
            })?;
        let width = match info.dtype {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::BF16 => 2,
            other => {
                return Err(model_error(
                    &file.path,
                    format!("tensor `{name}` is {other:?}: expected F32, F16 or BF16"),
                ))
            }
        };
        if count.checked_mul(width) != Some(bytes.len()) {
            return Err(model_error(
                &file.path,
                format!(
                    "tensor `{name}`: {} bytes for {count} elements of {width}",
                    bytes.len()
                ),
            ));
        }
        let mut out = Vec::new();
        out.try_reserve_exact(count)
            .map_err(|_| model_error(&file.path, format!("tensor `{name}`: out of memory")))?;
        match info.dtype {
            Dtype::F32 => out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            ),
            Dtype::F16 => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()),
            ),
            _ => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()),
            ),
        }
        Ok(out)
    }
}
