//! quota
