//! A controllable fake provider for testing agents and backstop itself.
#![deny(missing_docs)]
