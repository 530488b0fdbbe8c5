//! What must not compile (the crate's guarantees: exactly one teardown, !Sync, group borrows, and
//! registrations and windows as borrows of their communicator and buffer).
//! The expected compiler errors are in `tests/ui/*.stderr`; regenerate them with
//! `TRYBUILD=overwrite cargo test --test compile_fail` and read the diff.

#[test]
fn misuse_does_not_compile() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
}
