//! Shared pieces of pagedattn's fuzz targets (`fuzz_targets/`): sizes as fuzz inputs, the
//! backends and how one call runs on them, the differential check of `cpu` against
//! `reference`, and the generator of random valid calls.
//!
//! A failure is a panic whose message says what disagreed; with `PAGEDATTN_FUZZ_CASE_OUT=PATH`
//! set, a failing call is also written there as a replay file, so that
//! `pagedattn forward --input PATH --backend cpu --check` replays it
//! outside the fuzzer.

pub mod compare;
pub mod gen;
pub mod rng;
pub mod run;
pub mod size;

use pagedattn::replay::{run_case, write_case, ReplayCase, ReplayOutput};
use pagedattn::Error;

pub use compare::Rows;

/// How the backends answered a case they agree on.
#[derive(Debug)]
pub enum Answer {
    /// Every backend ran it (`reference`'s result).
    Ran(ReplayOutput),
    /// Every backend refused it (`reference`'s error).
    Refused(Error),
}

/// Runs `case` (`replay::run_case`: the output starts as NaN) on `reference` and on `cpu`
/// under every instruction set this machine has, and checks each `cpu` result against `reference`'s ([`compare::check`]).
/// Returns what disagreed: a result against an error, a cache byte, an output element.
pub fn compare_backends(case: &ReplayCase, rows: Rows) -> std::result::Result<Answer, String> {
    let want = run_case(case, &run::reference());
    for cpu in run::cpus() {
        let isa = cpu.isa();
        match (&want, run_case(case, &cpu)) {
            (Ok(w), Ok(g)) => compare::check(case, w, &g, isa, rows)?,
            (Err(_), Err(_)) => {}
            (Ok(_), Err(e)) => {
                return Err(format!("isa {isa}: cpu refused a call reference ran: {e}"))
            }
            (Err(e), Ok(_)) => {
                return Err(format!("isa {isa}: cpu ran a call reference refused ({e})"))
            }
        }
    }
    match want {
        Ok(out) => Ok(Answer::Ran(out)),
        Err(e) => Ok(Answer::Refused(e)),
    }
}

/// Reports a failure on `case`: writes it as a replay file where `PAGEDATTN_FUZZ_CASE_OUT`
/// says, then panics with `message` (libFuzzer saves the input as a crash artifact).
pub fn fail(case: &ReplayCase, message: &str) -> ! {
    if let Some(path) = std::env::var_os("PAGEDATTN_FUZZ_CASE_OUT") {
        match write_case(case).map(|bytes| std::fs::write(&path, bytes)) {
            Ok(Ok(())) => eprintln!("the failing call is in {}", path.to_string_lossy()),
            Ok(Err(e)) => eprintln!("could not write the failing call: {e}"),
            Err(e) => eprintln!("could not serialize the failing call: {e}"),
        }
    }
    panic!("{message}");
}
