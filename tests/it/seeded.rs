//! Seeded property runs for the campaign modules: a failure always prints the
//! seed, the case count and the shrunk input, so it can be replayed exactly.
//!
//! Knobs: `OUTBOX_PROPTEST_CASES` (cases per property), `OUTBOX_PROPTEST_SEED`
//! (replay a reported failure).

use std::fmt::Debug;

use proptest::strategy::Strategy;
use proptest::test_runner::{Config, RngSeed, TestCaseError, TestError, TestRunner};

/// A `u64` from the environment, if set and valid.
pub fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

/// A seed from `var`, or a fresh one from the clock.
pub fn seed_from_env(var: &str) -> u64 {
    env_u64(var).unwrap_or_else(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        // Fold the 128-bit count so consecutive runs differ in the low bits too.
        (nanos as u64) ^ ((nanos >> 64) as u64) ^ u64::from(std::process::id())
    })
}

/// Runs `test` on `cases` inputs drawn from `strategy` (default `default_cases`,
/// `OUTBOX_PROPTEST_CASES` overrides) and panics with the replay recipe on failure.
pub fn check<S>(
    name: &str,
    default_cases: u32,
    strategy: &S,
    test: impl Fn(S::Value) -> Result<(), TestCaseError>,
) where
    S: Strategy,
    S::Value: Debug,
{
    let cases = env_u64("OUTBOX_PROPTEST_CASES").map_or(default_cases, |n| n as u32);
    check_cases(name, cases, strategy, test);
}

/// As [`check`], with exactly `cases` cases (for properties whose cases are costly
/// and that scale `OUTBOX_PROPTEST_CASES` down themselves).
pub fn check_cases<S>(
    name: &str,
    cases: u32,
    strategy: &S,
    test: impl Fn(S::Value) -> Result<(), TestCaseError>,
) where
    S: Strategy,
    S::Value: Debug,
{
    let seed = seed_from_env("OUTBOX_PROPTEST_SEED");
    let config = Config {
        cases,
        rng_seed: RngSeed::Fixed(seed),
        failure_persistence: None,
        max_shrink_iters: 512,
        ..Config::default()
    };
    let replay = format!(
        "replay: OUTBOX_PROPTEST_SEED={seed} OUTBOX_PROPTEST_CASES={cases} \
         cargo test --all-features --test it {name}"
    );
    match TestRunner::new(config).run(strategy, test) {
        Ok(()) => {}
        Err(TestError::Fail(reason, input)) => {
            panic!("{name}: {reason}\nshrunk failing input: {input:#?}\n{replay}")
        }
        Err(TestError::Abort(reason)) => panic!("{name}: aborted: {reason}\n{replay}"),
    }
}

/// Fails the current case with `message` unless `condition` holds.
pub fn ensure(condition: bool, message: impl FnOnce() -> String) -> Result<(), TestCaseError> {
    if condition {
        Ok(())
    } else {
        Err(TestCaseError::fail(message()))
    }
}
