//! backstop's gateway: proxy door, scheduler, scope state, action API, metrics.
#![deny(missing_docs)]
