//! `Metadata`: one step's batch, from vLLM's fields.

use pagedattn::{AttentionMetadata, BlockId, BlockTables, EncoderMetadata};
use pyo3::prelude::*;

use crate::errors::{value_error, OrPyErr};
use crate::tensors::indices;

/// One step's batch (see the type stubs).
#[pyclass(frozen, module = "pagedattn._native", name = "Metadata")]
pub struct PyMetadata {
    pub metadata: AttentionMetadata,
}

#[pymethods]
impl PyMetadata {
    #[new]
    #[pyo3(signature = (
        *,
        seq_lens,
        slot_mapping,
        block_tables = None,
        num_prefills = None,
        context_lens = None,
        query_start_loc = None,
        block_size = None,
        encoder_seq_lens = None,
        cross_block_tables = None,
        cross_slot_mapping = None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        seq_lens: &Bound<'_, PyAny>,
        slot_mapping: &Bound<'_, PyAny>,
        block_tables: Option<&Bound<'_, PyAny>>,
        num_prefills: Option<usize>,
        context_lens: Option<&Bound<'_, PyAny>>,
        query_start_loc: Option<&Bound<'_, PyAny>>,
        block_size: Option<usize>,
        encoder_seq_lens: Option<&Bound<'_, PyAny>>,
        cross_block_tables: Option<&Bound<'_, PyAny>>,
        cross_slot_mapping: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let seq_lens = int32s(&vector(seq_lens, "seq_lens")?, "seq_lens")?;
        let num_seqs = seq_lens.len();
        let slot_mapping = vector(slot_mapping, "slot_mapping")?;
        let block_tables = table(block_tables, "block_tables", num_seqs)?;
        let context_lens = context_lens
            .map(|c| int32s(&vector(c, "context_lens")?, "context_lens"))
            .transpose()?;
        let query_start_loc = query_start_loc
            .map(|q| int32s(&vector(q, "query_start_loc")?, "query_start_loc"))
            .transpose()?;
        let query_lens: Vec<i32> = match (&query_start_loc, &context_lens) {
            (Some(q), _) => q.windows(2).map(|w| w[1] - w[0]).collect(),
            (None, Some(c)) => {
                if c.len() != num_seqs {
                    return Err(value_error(
                        "len(context_lens)",
                        c.len(),
                        &format!("{num_seqs} (one per sequence, as seq_lens)"),
                    ));
                }
                seq_lens.iter().zip(c).map(|(s, c)| s - c).collect()
            }
            (None, None) => {
                // Without contexts: the first num_prefills sequences are whole prompts, the
                // rest decodes of one token.
                let prefills = num_prefills.unwrap_or(num_seqs).min(num_seqs);
                (0..num_seqs)
                    .map(|s| if s < prefills { seq_lens[s] } else { 1 })
                    .collect()
            }
        };
        let num_prefills = num_prefills.unwrap_or_else(|| {
            // Decodes are the trailing sequences of one query token.
            num_seqs - query_lens.iter().rev().take_while(|&&q| q == 1).count()
        });
        let query_start_loc = match query_start_loc {
            Some(q) => q,
            None => std::iter::once(0)
                .chain(query_lens.iter().scan(0i32, |end, &q| {
                    *end = end.saturating_add(q);
                    Some(*end)
                }))
                .collect(),
        };
        let encoder = match encoder_seq_lens {
            None => None,
            Some(lens) => Some(EncoderMetadata {
                encoder_seq_lens: int32s(&vector(lens, "encoder_seq_lens")?, "encoder_seq_lens")?,
                cross_block_tables: table(cross_block_tables, "cross_block_tables", num_seqs)?,
                cross_slot_mapping: match cross_slot_mapping {
                    Some(m) => vector(m, "cross_slot_mapping")?,
                    None => Vec::new(),
                },
            }),
        };
        let mut metadata = AttentionMetadata::from_parts(
            num_prefills,
            query_start_loc,
            seq_lens,
            slot_mapping,
            block_tables,
            encoder,
        )
        .py()?;
        metadata.block_size = block_size;
        Ok(PyMetadata { metadata })
    }

    #[getter]
    fn num_seqs(&self) -> usize {
        self.metadata.num_seqs()
    }
    #[getter]
    fn num_tokens(&self) -> usize {
        self.metadata.num_tokens()
    }
    #[getter]
    fn num_prefills(&self) -> usize {
        self.metadata.num_prefills
    }
    #[getter]
    fn num_prefill_tokens(&self) -> usize {
        self.metadata.num_prefill_tokens
    }
    #[getter]
    fn num_decode_tokens(&self) -> usize {
        self.metadata.num_decode_tokens
    }
    #[getter]
    fn max_query_len(&self) -> usize {
        self.metadata.max_query_len
    }
    #[getter]
    fn max_seq_len(&self) -> usize {
        self.metadata.max_seq_len
    }
    /// Longest seq_len of the prefills (0 without prefills).
    #[getter]
    fn max_prefill_seq_len(&self) -> i32 {
        let md = &self.metadata;
        md.seq_lens[..md.num_prefills]
            .iter()
            .copied()
            .max()
            .unwrap_or(0)
    }
    /// Longest seq_len of the decodes (0 without decodes).
    #[getter]
    fn max_decode_seq_len(&self) -> i32 {
        let md = &self.metadata;
        md.seq_lens[md.num_prefills..]
            .iter()
            .copied()
            .max()
            .unwrap_or(0)
    }
    #[getter]
    fn query_start_loc(&self) -> Vec<i32> {
        self.metadata.query_start_loc.clone()
    }
    #[getter]
    fn seq_lens(&self) -> Vec<i32> {
        self.metadata.seq_lens.clone()
    }
    #[getter]
    fn context_lens(&self) -> Vec<i32> {
        self.metadata.context_lens.clone()
    }

    fn __repr__(&self) -> String {
        let md = &self.metadata;
        format!(
            "Metadata(num_seqs={}, num_prefills={}, num_tokens={}, max_seq_len={})",
            md.num_seqs(),
            md.num_prefills,
            md.num_tokens(),
            md.max_seq_len
        )
    }
}

/// A 1-D index tensor or sequence.
fn vector(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<i64>> {
    let (values, shape) = indices(obj, name)?;
    if shape.len() != 1 {
        return Err(value_error(
            &format!("{name}.shape"),
            format!("{shape:?}"),
            "one dimension",
        ));
    }
    Ok(values)
}

/// Values that must fit in int32.
fn int32s(values: &[i64], name: &str) -> PyResult<Vec<i32>> {
    values
        .iter()
        .map(|&v| i32::try_from(v).map_err(|_| value_error(name, v, "values that fit in int32")))
        .collect()
}

/// A `[rows, M]` block table (an empty one when not given or empty).
fn table(obj: Option<&Bound<'_, PyAny>>, name: &str, rows: usize) -> PyResult<BlockTables> {
    let Some(obj) = obj else {
        return BlockTables::new(rows, 0, Vec::new()).py();
    };
    let (values, shape) = indices(obj, name)?;
    let width = match shape[..] {
        [r, w] if r == rows => w,
        // An empty tensor (vLLM's `torch.tensor([])` for batches without tables).
        [0] => 0,
        _ => {
            return Err(value_error(
                &format!("{name}.shape"),
                format!("{shape:?}"),
                &format!("[{rows}, M]: one row of blocks per sequence"),
            ))
        }
    };
    let blocks = values
        .into_iter()
        .map(|b| {
            BlockId::try_from(b)
                .map_err(|_| value_error(name, b, "block numbers that fit in int32"))
        })
        .collect::<PyResult<Vec<_>>>()?;
    BlockTables::new(rows, width, blocks).py()
}
