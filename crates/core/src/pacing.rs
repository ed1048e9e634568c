//! pacing
