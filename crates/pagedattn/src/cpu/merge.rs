//! Split-K merges: the partitions of one (token, kv head) combined into its output rows.

use super::plan::Merge;

use super::call::CallRows;

impl CallRows<'_> {
    /// Combines the split-K partitions of one (token, kv head) and writes the output rows.
    pub(super) fn merge(&self, merge: &Merge, partials: &[f32]) {
        let (d, group) = (self.cfg.head_size(), self.group_size());
        let width = group * (d + 2);
        for gh in 0..group {
            let part = |p: usize| &partials[p * width + gh * (d + 2)..][..d + 2];
            let m = merge
                .parts
                .clone()
                .map(|p| part(p)[0])
                .fold(f32::NEG_INFINITY, f32::max);
            // Summed in f64 (rounded to f32 once), so that the partitions' count does not
            // add to the error (docs/semantics.md, "Accuracy").
            let mut acc = vec![0.0f64; d];
            let mut l = 0.0f64;
            for p in merge.parts.clone() {
                // A partition whose max stayed -inf weighs 0 (its sum is 0, or NaN from a NaN
                // score, which 0 * NaN keeps); with every max -inf, `output_norm` decides.
                let w = if m > f32::NEG_INFINITY {
                    (part(p)[0] as f64 - m as f64).exp()
                } else {
                    0.0
                };
                l += part(p)[1] as f64 * w;
                for (a, &x) in acc.iter_mut().zip(&part(p)[2..]) {
                    *a += x as f64 * w;
                }
            }
            let acc: Vec<f32> = acc.iter().map(|&a| a as f32).collect();
            let l = l as f32;
            let head = merge.kv_head * group + gh;
            self.write_row(merge.seq, merge.token, head, m, l, &acc);
        }
    }
}
