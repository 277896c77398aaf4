//! `Attention` (one layer's attention) and `Plan` (a step prepared for it): plan once per
//! step, run every layer.

use std::sync::{Arc, Mutex, PoisonError};

use pagedattn::{
    AttentionConfig, AttentionImpl, AttnType, DType, Device, GraphCapacity, Inputs, KvCacheDtype,
    KvCacheSpec, Plan, Workspace,
};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::backend::{Kind, PyBackend};
use crate::dlpack::Imported;
use crate::errors::{type_error, value_error, OrPyErr};
use crate::metadata::PyMetadata;
use crate::stream;
use crate::tensors::{self, Ranges};

/// One layer's attention (see the type stubs).
#[pyclass(frozen, module = "pagedattn._native", name = "Attention")]
pub struct PyAttention {
    kind: Arc<Kind>,
    attention: Box<dyn AttentionImpl>,
}

/// A step prepared for the layers of one geometry, with the workspace its calls use.
#[pyclass(frozen, module = "pagedattn._native", name = "Plan")]
pub struct PyPlan {
    state: Mutex<PlanState>,
}

struct PlanState {
    plan: Plan,
    workspace: Workspace,
}

impl PyPlan {
    fn lock(&self) -> std::sync::MutexGuard<'_, PlanState> {
        // A panic never happens while the lock is held; the state stays valid if one did.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[pymethods]
impl PyPlan {
    /// Query tokens of the step.
    #[getter]
    fn num_tokens(&self) -> usize {
        self.lock().plan.num_tokens()
    }
    /// Bytes of workspace its calls use.
    #[getter]
    fn workspace_bytes(&self) -> usize {
        self.lock().plan.workspace_bytes()
    }
}

#[pymethods]
impl PyAttention {
    #[new]
    #[pyo3(signature = (
        backend, num_heads, head_size, *, scale = None, num_kv_heads = None,
        alibi_slopes = None, sliding_window = None, logits_soft_cap = None,
        kv_cache_dtype = "auto", k_scale = 1.0, v_scale = 1.0, attn_type = "decoder",
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        backend: &PyBackend,
        num_heads: usize,
        head_size: usize,
        scale: Option<f32>,
        num_kv_heads: Option<usize>,
        alibi_slopes: Option<Vec<f32>>,
        sliding_window: Option<usize>,
        logits_soft_cap: Option<f32>,
        kv_cache_dtype: &str,
        k_scale: f32,
        v_scale: f32,
        attn_type: &str,
    ) -> PyResult<Self> {
        let mut builder = AttentionConfig::builder(num_heads, head_size)
            .num_kv_heads(num_kv_heads.unwrap_or(num_heads))
            .alibi_slopes(alibi_slopes)
            .sliding_window(sliding_window)
            .logits_soft_cap(logits_soft_cap)
            .kv_cache_dtype(kv_cache_dtype.parse::<KvCacheDtype>().py()?)
            .kv_scales(k_scale, v_scale)
            .attn_type(attn_type.parse::<AttnType>().py()?);
        if let Some(scale) = scale {
            builder = builder.scale(scale);
        }
        let config = builder.build().py()?;
        let attention = backend.kind.backend().attention(&config).py()?;
        Ok(PyAttention {
            kind: backend.kind.clone(),
            attention,
        })
    }

    #[getter]
    fn num_heads(&self) -> usize {
        self.config().num_heads()
    }
    #[getter]
    fn num_kv_heads(&self) -> usize {
        self.config().num_kv_heads()
    }
    #[getter]
    fn head_size(&self) -> usize {
        self.config().head_size()
    }
    #[getter]
    fn scale(&self) -> f32 {
        self.config().scale()
    }

    fn __repr__(&self) -> String {
        let c = self.config();
        format!(
            "Attention(num_heads={}, num_kv_heads={}, head_size={}, attn_type={:?}, backend={:?})",
            c.num_heads(),
            c.num_kv_heads(),
            c.head_size(),
            c.attn_type().name(),
            self.kind.backend().name()
        )
    }

    /// Validates and prepares a step.
    #[pyo3(signature = (metadata, kv_cache = None, *, dtype = None, stream = None))]
    fn plan(
        &self,
        py: Python<'_>,
        metadata: &PyMetadata,
        kv_cache: Option<&Bound<'_, PyAny>>,
        dtype: Option<&Bound<'_, PyAny>>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyPlan> {
        self.make_plan(py, metadata, kv_cache, dtype, stream, None)
    }

    /// A plan that `replan` refreshes in place, for calls captured in a CUDA graph.
    #[pyo3(signature = (metadata, kv_cache, max_seq_len, *, dtype = None, stream = None))]
    fn plan_for_graph(
        &self,
        py: Python<'_>,
        metadata: &PyMetadata,
        kv_cache: Option<&Bound<'_, PyAny>>,
        max_seq_len: usize,
        dtype: Option<&Bound<'_, PyAny>>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyPlan> {
        let capacity = GraphCapacity { max_seq_len };
        self.make_plan(py, metadata, kv_cache, dtype, stream, Some(capacity))
    }

    /// Refreshes `plan` for a new step.
    #[pyo3(signature = (plan, metadata, *, stream = None))]
    fn replan(
        &self,
        py: Python<'_>,
        plan: &PyPlan,
        metadata: &PyMetadata,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let on = stream::target(&self.kind, stream, [])?;
        let mut state = plan.lock();
        let state = &mut *state;
        stream::run(py, &self.kind, on, || {
            let spec = state.plan.cache_spec().copied();
            self.attention
                .replan(&mut state.plan, &metadata.metadata, spec.as_ref())?;
            state.workspace.reserve(&state.plan)
        })
    }

    /// Writes the new keys and values into the cache, then attends; returns the output.
    #[pyo3(signature = (plan, query, key = None, value = None, kv_cache = None, out = None, *, stream = None))]
    #[allow(clippy::too_many_arguments)]
    fn run<'py>(
        &self,
        py: Python<'py>,
        plan: &PyPlan,
        query: &Bound<'py, PyAny>,
        key: Option<&Bound<'py, PyAny>>,
        value: Option<&Bound<'py, PyAny>>,
        kv_cache: Option<&Bound<'py, PyAny>>,
        out: Option<&Bound<'py, PyAny>>,
        stream: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let device = self.kind.device();
        let config = self.config();
        let q = tensors::argument(query, "query", device, false)?;
        let dtype = tensors::activation_dtype(&q, "query")?;
        let q_shape = self.rows(&q, "query", config.num_heads())?;
        let kv = match (key, value) {
            (Some(k), Some(v)) => Some((
                tensors::argument(k, "key", device, false)?,
                tensors::argument(v, "value", device, false)?,
            )),
            (None, None) => None,
            _ => return Err(value_error("key, value", "one of them", "both or neither")),
        };
        let cache = kv_cache
            .map(|c| tensors::argument(c, "kv_cache", device, true))
            .transpose()?;
        let out = match out {
            Some(o) => o.clone(),
            None => new_like(query)?,
        };
        let o = tensors::argument(&out, "out", device, true)?;
        if o.elem != q.elem {
            return Err(type_error(
                "out.dtype",
                o.elem,
                &format!("{} (the query's)", q.elem),
            ));
        }
        if o.shape != q.shape {
            return Err(value_error(
                "out.shape",
                format!("{:?}", o.shape),
                &format!("{:?} (the query's)", q.shape),
            ));
        }
        let mut ranges = Ranges::default();
        ranges.add("query", &q, false)?;
        if let Some((k, v)) = &kv {
            ranges.add("key", k, false)?;
            ranges.add("value", v, false)?;
        }
        if let Some(c) = &cache {
            ranges.add("kv_cache", c, true)?;
        }
        ranges.add("out", &o, true)?;

        let query_t = tensors::tensor(py, &q, dtype, q_shape.clone(), device)?;
        let mut out_t = tensors::tensor(py, &o, dtype, q_shape, device)?;
        let kv_t = match &kv {
            Some((k, v)) => {
                let heads = config.num_kv_heads();
                let key = self.kv_tensor(py, k, "key", heads, device)?;
                let value = self.kv_tensor(py, v, "value", heads, device)?;
                Some((key, value))
            }
            None => None,
        };
        let mut cache_t = match &cache {
            Some(c) => Some(self.cache(py, c, Some(dtype))?),
            None => None,
        };
        let on = stream::target(&self.kind, stream, [query])?;
        let mut state = plan.lock();
        let state = &mut *state;
        stream::run(py, &self.kind, on, || {
            let inputs = Inputs::new(&query_t)
                .with_kv_pair(
                    kv_t.as_ref()
                        .map(|(k, v)| pagedattn::KvPair { key: k, value: v }),
                )
                .with_cache_opt(cache_t.as_mut());
            self.attention
                .forward_into(&state.plan, &mut state.workspace, inputs, &mut out_t)
        })?;
        Ok(out)
    }

    /// Only the cache write of `run`.
    #[pyo3(signature = (plan, key, value, kv_cache, *, stream = None))]
    fn write_kv(
        &self,
        py: Python<'_>,
        plan: &PyPlan,
        key: &Bound<'_, PyAny>,
        value: &Bound<'_, PyAny>,
        kv_cache: &Bound<'_, PyAny>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let device = self.kind.device();
        let heads = self.config().num_kv_heads();
        let k = tensors::argument(key, "key", device, false)?;
        let v = tensors::argument(value, "value", device, false)?;
        let c = tensors::argument(kv_cache, "kv_cache", device, true)?;
        let mut ranges = Ranges::default();
        ranges.add("key", &k, false)?;
        ranges.add("value", &v, false)?;
        ranges.add("kv_cache", &c, true)?;
        let dtype = tensors::activation_dtype(&k, "key")?;
        let key_t = self.kv_tensor(py, &k, "key", heads, device)?;
        let value_t = self.kv_tensor(py, &v, "value", heads, device)?;
        let mut cache_t = self.cache(py, &c, Some(dtype))?;
        let on = stream::target(&self.kind, stream, [key])?;
        let state = plan.lock();
        stream::run(py, &self.kind, on, || {
            self.attention
                .write_kv(&state.plan, &key_t, &value_t, &mut cache_t)
        })
    }
}

impl PyAttention {
    fn config(&self) -> &AttentionConfig {
        self.attention.config()
    }

    #[allow(clippy::too_many_arguments)]
    fn make_plan(
        &self,
        py: Python<'_>,
        metadata: &PyMetadata,
        kv_cache: Option<&Bound<'_, PyAny>>,
        dtype: Option<&Bound<'_, PyAny>>,
        stream: Option<&Bound<'_, PyAny>>,
        graph: Option<GraphCapacity>,
    ) -> PyResult<PyPlan> {
        let dtype = dtype.map(parse_dtype).transpose()?;
        let spec = match kv_cache {
            Some(c) => {
                let t = tensors::argument(c, "kv_cache", self.kind.device(), true)?;
                Some(self.spec(&t, dtype)?)
            }
            None => None,
        };
        let on = stream::target(&self.kind, stream, kv_cache)?;
        let md = &metadata.metadata;
        let backend = self.kind.backend();
        let state = stream::run(py, &self.kind, on, || {
            let plan = match graph {
                Some(capacity) => self.attention.plan_for_graph(md, spec.as_ref(), capacity)?,
                None => self.attention.plan(md, spec.as_ref())?,
            };
            let workspace = backend.workspace(&plan)?;
            Ok(PlanState { plan, workspace })
        })?;
        Ok(PyPlan {
            state: Mutex::new(state),
        })
    }

    /// The spec of cache tensor `t` for this layer; `dtype` is the activations' (default:
    /// the cache's when it holds activations).
    fn spec(&self, t: &Imported, dtype: Option<DType>) -> PyResult<KvCacheSpec> {
        let config = self.config();
        let (num_blocks, block_elems) = tensors::cache_blocks(t, "kv_cache")?;
        let row = config.num_kv_heads() * config.head_size();
        if block_elems % row != 0 || block_elems == 0 {
            return Err(value_error(
                "kv_cache.shape",
                format!("{:?}", t.shape),
                &format!(
                    "(2, num_blocks, ...) with a multiple of num_kv_heads * head_size = {row} \
                     elements per block"
                ),
            ));
        }
        let kv_cache_dtype = config.kv_cache_dtype();
        let dtype = match (dtype, kv_cache_dtype) {
            (Some(d), _) => d,
            (None, KvCacheDtype::Auto) => tensors::activation_dtype(t, "kv_cache")?,
            (None, _) => {
                return Err(type_error(
                    "dtype",
                    "None",
                    "the activations' dtype (an fp8 cache does not say it)",
                ))
            }
        };
        tensors::check_cache_elem(t, kv_cache_dtype, dtype, "kv_cache")?;
        Ok(config.kv_cache_spec(dtype, num_blocks, block_elems / row))
    }

    /// The cache over `t`'s memory.
    fn cache(
        &self,
        py: Python<'_>,
        t: &Imported,
        dtype: Option<DType>,
    ) -> PyResult<pagedattn::KvCache> {
        let spec = self.spec(t, dtype)?;
        let layout = self.kind.backend().kv_cache_layout();
        tensors::kv_cache(py, t, spec, layout, self.kind.device())
    }

    /// A `[T, heads, D]` key or value tensor over `t` (`[T, heads, D]` or `[T, heads * D]`).
    fn kv_tensor(
        &self,
        py: Python<'_>,
        t: &Imported,
        name: &str,
        heads: usize,
        device: Device,
    ) -> PyResult<pagedattn::Tensor> {
        let dtype = tensors::activation_dtype(t, name)?;
        let shape = self.rows(t, name, heads)?;
        tensors::tensor(py, t, dtype, shape, device)
    }

    /// The `[T, heads, D]` shape of a `[T, heads, D]` or `[T, heads * D]` tensor.
    fn rows(&self, t: &Imported, name: &str, heads: usize) -> PyResult<Vec<usize>> {
        let d = self.config().head_size();
        match t.shape[..] {
            [n, h, dd] if h == heads && dd == d => Ok(vec![n, h, dd]),
            [n, hd] if hd == heads * d => Ok(vec![n, heads, d]),
            _ => Err(value_error(
                &format!("{name}.shape"),
                format!("{:?}", t.shape),
                &format!("[T, {heads}, {d}] or [T, {}]", heads * d),
            )),
        }
    }
}

/// A new tensor like `query` (same shape, dtype and device), allocated by its library.
fn new_like<'py>(query: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let py = query.py();
    let shape = query.getattr(intern!(py, "shape"))?;
    if query.hasattr(intern!(py, "new_empty"))? {
        query.call_method1(intern!(py, "new_empty"), (shape,))
    } else {
        py.import("numpy")?
            .call_method1("empty_like", PyTuple::new(py, [query])?)
    }
}

/// The activations' dtype from a torch or numpy dtype or a name.
fn parse_dtype(obj: &Bound<'_, PyAny>) -> PyResult<DType> {
    let text = obj.str()?.to_string();
    let name = text.strip_prefix("torch.").unwrap_or(&text);
    match name {
        "float32" | "float" | "f32" => Ok(DType::F32),
        "float16" | "half" | "f16" => Ok(DType::F16),
        "bfloat16" | "bf16" => Ok(DType::BF16),
        _ => Err(type_error("dtype", text, "float32, float16 or bfloat16")),
    }
}
