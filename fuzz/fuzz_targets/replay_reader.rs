//! Arbitrary bytes as a replay file (`docs/replay-format.md`): `read_case` answers a case or
//! an error, never a panic. A case it reads is written back and read again (the same
//! config, metadata, tensors and cache bytes), and, when small, run on `reference` and on
//! `cpu` under every instruction set: the same errors, the same cache bytes after the call,
//! and the same outputs on every row whose inputs are finite and inside the contract's
//! exactness domain; `reference`'s result also survives `write_output` / `read_output`.

#![no_main]

use libfuzzer_sys::fuzz_target;
use pagedattn::replay::{read_case, read_output, write_case, write_output, ReplayCase};
use pagedattn::Tensor;
use pagedattn_fuzz::{compare_backends, fail, Answer, Rows};

/// Multiply-adds (query tokens × keys per sequence × H × D) of the largest case that runs: a
/// few milliseconds on every backend.
const WORK: usize = 1 << 20;

fuzz_target!(|data: &[u8]| {
    let Ok(case) = read_case(data) else {
        return;
    };
    let bytes = write_case(&case).unwrap_or_else(|e| {
        fail(
            &case,
            &format!("write_case refused a case read_case read: {e}"),
        )
    });
    let again = read_case(&bytes).unwrap_or_else(|e| {
        fail(
            &case,
            &format!("read_case refused what write_case wrote: {e}"),
        )
    });
    if let Err(what) = same_case(&case, &again) {
        fail(
            &case,
            &format!("the case changed through write_case / read_case: {what}"),
        );
    }
    if !small(&case) {
        return;
    }
    match compare_backends(&case, Rows::FiniteInDomain) {
        Ok(Answer::Ran(out)) => {
            let back = write_output(&out)
                .and_then(|bytes| read_output(&bytes))
                .unwrap_or_else(|e| fail(&case, &format!("the output does not round-trip: {e}")));
            let tensors =
                |o: &pagedattn::replay::ReplayOutput| -> Vec<(String, Vec<usize>, Vec<u8>)> {
                    std::iter::once(&o.output)
                        .chain(o.kv_cache.iter().flat_map(|(k, v)| [k, v]))
                        .map(describe)
                        .collect()
                };
            if tensors(&out) != tensors(&back) {
                fail(
                    &case,
                    "the output changed through write_output / read_output",
                );
            }
        }
        Ok(Answer::Refused(_)) => {}
        Err(mismatch) => fail(&case, &mismatch),
    }
});

/// Whether a case is cheap enough to run (its work bounded by [`WORK`]).
fn small(case: &ReplayCase) -> bool {
    let md = &case.metadata;
    let longest_encoder = md.encoder.as_ref().map_or(0, |e| {
        e.encoder_seq_lens
            .iter()
            .map(|&l| l.max(0) as usize)
            .max()
            .unwrap_or(0)
    });
    let keys = md.max_seq_len.max(md.max_query_len).max(longest_encoder);
    [keys, case.config.num_heads(), case.config.head_size()]
        .iter()
        .try_fold(md.num_tokens(), |n, &x| n.checked_mul(x))
        .is_some_and(|work| work <= WORK)
}

/// A tensor's dtype, shape and bytes (bytes, so that NaN payloads compare too).
fn describe(t: &Tensor) -> (String, Vec<usize>, Vec<u8>) {
    let bytes = t.host().map(|h| h.as_bytes().to_vec()).unwrap_or_default();
    (t.dtype().to_string(), t.shape().to_vec(), bytes)
}

/// What differs between a case and the same case written and read back. The block size is
/// written only with a cache (the cache's), so without one it is not compared.
fn same_case(a: &ReplayCase, b: &ReplayCase) -> Result<(), String> {
    if a.config != b.config {
        return Err(format!("config {:?} became {:?}", a.config, b.config));
    }
    let mut md = a.metadata.clone();
    md.block_size = a.kv_cache.as_ref().map(|c| c.spec().block_size);
    let mut md_back = b.metadata.clone();
    if a.kv_cache.is_none() {
        md_back.block_size = None;
    }
    if md != md_back {
        return Err(format!("metadata {md:?} became {md_back:?}"));
    }
    let tensors = |c: &ReplayCase| -> Vec<(String, Vec<usize>, Vec<u8>)> {
        std::iter::once(&c.query)
            .chain(c.key_value.iter().flat_map(|(k, v)| [k, v]))
            .map(describe)
            .collect()
    };
    if tensors(a) != tensors(b) {
        return Err("query, key or value".into());
    }
    let cache = |c: &ReplayCase| {
        c.kv_cache.as_ref().map(|cache| {
            let (k, v) = cache.to_canonical().expect("host cache");
            (*cache.spec(), k.as_bytes().to_vec(), v.as_bytes().to_vec())
        })
    };
    if cache(a) != cache(b) {
        return Err("kv cache".into());
    }
    Ok(())
}
