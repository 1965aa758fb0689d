//! Conversions between protobuf messages and the domain's types, by hand, and the small parsing
//! rules every service shares (enums, paging, times). Wire types stop here.

use std::time::SystemTime;

use custodian_domain::withdrawal::WithdrawalState;
use custodian_domain::Chain;
use tonic::Status;

use crate::pb;

/// Page size when a request leaves it at 0.
pub(crate) const DEFAULT_PAGE_SIZE: u32 = 100;
/// The largest page; larger requests are served this many (as Google's AIP-158 advises).
pub(crate) const MAX_PAGE_SIZE: u32 = 1000;

/// A required chain.
pub(crate) fn chain(value: i32, field: &str) -> Result<Chain, Status> {
    optional_chain(value, field)?.ok_or_else(|| Status::invalid_argument(format!("{field} is required (eth or btc)")))
}

/// A chain filter: `None` for `CHAIN_UNSPECIFIED`.
pub(crate) fn optional_chain(value: i32, field: &str) -> Result<Option<Chain>, Status> {
    match pb::Chain::try_from(value) {
        Ok(pb::Chain::Unspecified) => Ok(None),
        Ok(pb::Chain::Eth) => Ok(Some(Chain::Eth)),
        Ok(pb::Chain::Btc) => Ok(Some(Chain::Btc)),
        Err(_) => Err(Status::invalid_argument(format!("{field} {value} is not a known chain"))),
    }
}

/// The wire value of a chain.
pub(crate) fn chain_to_pb(chain: Chain) -> i32 {
    match chain {
        Chain::Eth => pb::Chain::Eth.into(),
        Chain::Btc => pb::Chain::Btc.into(),
    }
}

/// The wire value of a withdrawal state.
pub(crate) fn state_to_pb(state: WithdrawalState) -> i32 {
    use pb::WithdrawalState as P;
    use WithdrawalState as S;
    let wire = match state {
        S::Requested => P::Requested,
        S::AwaitingApproval => P::AwaitingApproval,
        S::Rejected => P::Rejected,
        S::Signed => P::Signed,
        S::Broadcast => P::Broadcast,
        S::Mined => P::Mined,
        S::Confirmed => P::Confirmed,
        S::FailedOnchain => P::FailedOnchain,
        S::CancelRequested => P::CancelRequested,
        S::Cancelled => P::Cancelled,
        S::NeedsReview => P::NeedsReview,
    };
    wire.into()
}

/// A withdrawal state filter: `None` for `WITHDRAWAL_STATE_UNSPECIFIED`.
pub(crate) fn state_filter(value: i32) -> Result<Option<WithdrawalState>, Status> {
    use pb::WithdrawalState as P;
    use WithdrawalState as S;
    let wire = pb::WithdrawalState::try_from(value)
        .map_err(|_| Status::invalid_argument(format!("state {value} is not a known withdrawal state")))?;
    Ok(Some(match wire {
        P::Unspecified => return Ok(None),
        P::Requested => S::Requested,
        P::AwaitingApproval => S::AwaitingApproval,
        P::Rejected => S::Rejected,
        P::Signed => S::Signed,
        P::Broadcast => S::Broadcast,
        P::Mined => S::Mined,
        P::Confirmed => S::Confirmed,
        P::FailedOnchain => S::FailedOnchain,
        P::CancelRequested => S::CancelRequested,
        P::Cancelled => S::Cancelled,
        P::NeedsReview => S::NeedsReview,
    }))
}

/// The wire value of a stored posting direction.
pub(crate) fn direction_to_pb(direction: &str) -> i32 {
    match direction {
        "debit" => pb::Direction::Debit.into(),
        "credit" => pb::Direction::Credit.into(),
        other => panic!("BUG: ledger_posting.direction {other:?} is checked by the table"),
    }
}

/// Rows to return for a requested page size.
pub(crate) fn page_size(requested: u32) -> i64 {
    i64::from(match requested {
        0 => DEFAULT_PAGE_SIZE,
        n => n.min(MAX_PAGE_SIZE),
    })
}

/// The id a page starts after: 0 for the first page.
pub(crate) fn page_after(token: &str) -> Result<i64, Status> {
    if token.is_empty() {
        return Ok(0);
    }
    token
        .parse::<i64>()
        .ok()
        .filter(|id| *id > 0)
        .ok_or_else(|| Status::invalid_argument(format!("page_token {token:?} is not one this call returned")))
}

/// The token of the page after the one ending at `last`, if there is one.
pub(crate) fn next_page_token(more: bool, last: Option<i64>) -> String {
    match (more, last) {
        (true, Some(id)) => id.to_string(),
        _ => String::new(),
    }
}

/// An optional RFC 3339 time filter.
pub(crate) fn time_filter(value: &str, field: &str) -> Result<Option<SystemTime>, Status> {
    if value.is_empty() {
        return Ok(None);
    }
    crate::time::parse(value).map(Some).ok_or_else(|| {
        Status::invalid_argument(format!("{field} {value:?} is not an RFC 3339 time like 2025-03-01T12:00:00Z"))
    })
}

/// A required, non-blank text field, trimmed.
pub(crate) fn required<'a>(value: &'a str, field: &str) -> Result<&'a str, Status> {
    let trimmed = value.trim();
    if trimmed.is_empty() {
        return Err(Status::invalid_argument(format!("{field} is required")));
    }
    Ok(trimmed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_withdrawal_state_survives_the_wire() {
        use WithdrawalState as S;
        let all = [
            S::Requested,
            S::AwaitingApproval,
            S::Rejected,
            S::Signed,
            S::Broadcast,
            S::Mined,
            S::Confirmed,
            S::FailedOnchain,
            S::CancelRequested,
            S::Cancelled,
            S::NeedsReview,
        ];
        for state in all {
            assert_eq!(state_filter(state_to_pb(state)).unwrap(), Some(state));
        }
        assert_eq!(state_filter(0).unwrap(), None);
        assert_eq!(state_filter(99).unwrap_err().code(), tonic::Code::InvalidArgument);
    }

    #[test]
    fn chains_and_pages_are_checked() {
        assert_eq!(chain(chain_to_pb(Chain::Btc), "chain").unwrap(), Chain::Btc);
        assert_eq!(chain(0, "chain").unwrap_err().code(), tonic::Code::InvalidArgument);
        assert_eq!(optional_chain(0, "chain").unwrap(), None);
        assert_eq!(optional_chain(7, "chain").unwrap_err().code(), tonic::Code::InvalidArgument);
        assert_eq!(page_size(0), 100);
        assert_eq!(page_size(5000), 1000);
        assert_eq!(page_after("").unwrap(), 0);
        assert_eq!(page_after("42").unwrap(), 42);
        for bad in ["-1", "0", "x", "1.5"] {
            assert_eq!(page_after(bad).unwrap_err().code(), tonic::Code::InvalidArgument, "{bad}");
        }
        assert_eq!(next_page_token(true, Some(9)), "9");
        assert_eq!(next_page_token(false, Some(9)), "");
    }
}
