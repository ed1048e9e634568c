//! The scope retry quota (`retry_quota`, SPEC §5).

use super::diagnostics::Ctx;
use super::raw::{RawRetryQuota, S};
use crate::budget::RetryQuotaConfig;

pub(super) fn validate_retry_quota(
    raw: Option<&S<RawRetryQuota>>,
    ctx: &mut Ctx,
) -> RetryQuotaConfig {
    let defaults = RetryQuotaConfig::default();
    let Some(raw) = raw else {
        return defaults;
    };
    let q = &raw.value;
    let capacity = ctx.positive_u32(&q.capacity, "retry_quota.capacity");
    let retry_cost = ctx.positive_u32(&q.retry_cost, "retry_quota.retry_cost");
    let timeout_cost = ctx.positive_u32(&q.timeout_cost, "retry_quota.timeout_cost");
    let success_refund = match &q.success_refund {
        Some(s) => ctx
            .integer(s, "retry_quota.success_refund", 0, u64::from(u32::MAX))
            .and_then(|n| u32::try_from(n).ok())
            .unwrap_or(defaults.success_refund),
        None => defaults.success_refund,
    };
    // A cost is compared with the capacity the file states (or the default when it states
    // none); an invalid capacity was already reported and is not compared with.
    let capacity_valid = q.capacity.is_none() || capacity.is_some();
    let capacity = capacity.unwrap_or(defaults.capacity);
    let retry_cost = retry_cost.unwrap_or(defaults.retry_cost);
    let timeout_cost = timeout_cost.unwrap_or(defaults.timeout_cost);
    for (value, field, v) in [
        (retry_cost, "retry_cost", &q.retry_cost),
        (timeout_cost, "timeout_cost", &q.timeout_cost),
    ] {
        if capacity_valid && value > capacity {
            let at = v.as_ref().map(|s| s.referenced).unwrap_or(raw.referenced);
            let whose = if q.capacity.is_some() {
                "the capacity"
            } else {
                "the default capacity"
            };
            ctx.err(
                &at,
                format!(
                    "retry_quota.{field}: {value} exceeds {whose} {capacity}; no retry could ever be paid"
                ),
            );
        }
    }
    RetryQuotaConfig {
        capacity,
        retry_cost,
        timeout_cost,
        success_refund,
    }
}
