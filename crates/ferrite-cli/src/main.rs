//! The ferrite binary.
fn main() {}
