//! Cross-crate tests: integration tests live in tests/tests/; the collective test bodies
//! shared by CPU, process and GPU runs live here.

pub mod collective_suite;
