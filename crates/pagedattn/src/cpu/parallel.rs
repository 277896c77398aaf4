//! Parallel loops over indices on rayon's pool, through `dyn` closures: rayon's machinery is
//! then compiled once, not once per kernel instantiation (ISA × element type) that runs a
//! loop. The indirect call per index costs nothing beside a unit of work (a decode unit, a
//! prefill group or tile, a merge).

use rayon::prelude::*;

use crate::error::Result;

/// Runs `f(i)` for every `i` in `0..n`, in parallel.
pub(super) fn for_each(n: usize, f: &(dyn Fn(usize) + Sync)) {
    (0..n).into_par_iter().for_each(f);
}

/// Runs `f(i)` for every `i` in `0..n`, in parallel, until one fails; returns a failure.
pub(super) fn try_for_each(n: usize, f: &(dyn Fn(usize) -> Result<()> + Sync)) -> Result<()> {
    (0..n).into_par_iter().try_for_each(f)
}

/// Runs `a` and `b` in parallel; returns `a`'s result.
pub(super) fn join(a: &(dyn Fn() -> Result<()> + Sync), b: &(dyn Fn() + Sync)) -> Result<()> {
    rayon::join(a, b).0
}
