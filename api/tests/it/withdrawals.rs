//! Withdrawal requests, idempotency, refusals, approvals, cancels and listing through the API.

use custodian_api::pb::{self, request_withdrawal_request::Amount as WireAmount};
use tonic::Code;

use crate::support::{assert_status, authed, withdrawal_request, Api, ETHER, FUNDER};

/// A checksummed destination that is none of ours.
const DESTINATION: &str = "0x3C44CdDdB6a900fa2b585dd299e03d12FA4293BC";

#[tokio::test]
async fn refusals_map_to_status_codes_that_say_what_was_wrong() {
    let api = Api::start().await;
    api.hot_wallet().await;
    let token = api.root_token().await;
    let account = api.account(&token, "erin").await;
    api.credit(account, 0, ETHER).await;
    let send = |request: pb::RequestWithdrawalRequest| {
        let mut withdrawals = api.withdrawals();
        let request = authed(&token, request);
        async move { withdrawals.request_withdrawal(request).await }
    };
    let base = || withdrawal_request(account, "w", DESTINATION, 1000);
    let with_amount = |amount: WireAmount| pb::RequestWithdrawalRequest { amount: Some(amount), ..base() };

    // One letter's case flipped.
    let bad_checksum =
        pb::RequestWithdrawalRequest { destination: "0x3c44CdDdB6a900fa2b585dd299e03d12FA4293BC".into(), ..base() };
    assert_status(send(bad_checksum).await, Code::InvalidArgument, &["EIP-55 checksum"]);
    let short = pb::RequestWithdrawalRequest { destination: "0x1234".into(), ..base() };
    assert_status(send(short).await, Code::InvalidArgument, &["40 hexadecimal digits"]);
    assert_status(
        send(with_amount(WireAmount::AmountUnits("0".into()))).await,
        Code::InvalidArgument,
        &["greater than zero"],
    );
    assert_status(
        send(with_amount(WireAmount::AmountDecimal("0.0000000000000000001".into()))).await,
        Code::InvalidArgument,
        &["19 decimals", "only 18"],
    );
    assert_status(
        send(with_amount(WireAmount::AmountUnits("1.5".into()))).await,
        Code::InvalidArgument,
        &["amount_units", "whole number"],
    );
    assert_status(
        send(with_amount(WireAmount::AmountDecimal("1,5".into()))).await,
        Code::InvalidArgument,
        &["not a decimal number"],
    );
    let no_amount = pb::RequestWithdrawalRequest { amount: None, ..base() };
    assert_status(send(no_amount).await, Code::InvalidArgument, &["amount_units or amount_decimal"]);
    let unknown_asset = pb::RequestWithdrawalRequest { asset: "DOGE".into(), ..base() };
    assert_status(send(unknown_asset).await, Code::InvalidArgument, &["unknown asset \"DOGE\""]);
    let no_id = pb::RequestWithdrawalRequest { external_id: " ".into(), ..base() };
    assert_status(send(no_id).await, Code::InvalidArgument, &["external_id is required"]);
    let ours = pb::RequestWithdrawalRequest { destination: crate::support::HOT_WALLET.into(), ..base() };
    assert_status(send(ours).await, Code::InvalidArgument, &["one of our hot wallets"]);

    let nobody = pb::RequestWithdrawalRequest { account_id: account + 100, ..base() };
    assert_status(send(nobody).await, Code::NotFound, &["no account has id"]);
    let too_much = with_amount(WireAmount::AmountDecimal("1.000000000000000001".into()));
    assert_status(send(too_much).await, Code::FailedPrecondition, &["insufficient funds", "1000000000000000001"]);

    // A paused lane refuses requests with the reason; resumed, the same request goes through.
    let pause = pb::PauseLaneRequest { lane: "a".into(), reason: "key rotation".into() };
    let paused = api.admin().pause_lane(authed(&token, pause)).await.unwrap().into_inner();
    assert!(paused.paused);
    assert_status(send(base()).await, Code::PermissionDenied, &["lane a is paused", "key rotation"]);
    let resumed = api.admin().resume_lane(authed(&token, pb::ResumeLaneRequest { lane: "a".into() })).await;
    assert!(!resumed.unwrap().into_inner().paused);
    let accepted = send(base()).await.unwrap().into_inner();
    assert!(accepted.created);

    // None of the refusals wrote anything.
    let client = api.db.pool.get().await.unwrap();
    let events: i64 = client.query_one("select count(*) from withdrawal_event", &[]).await.unwrap().get(0);
    assert_eq!(events, 1, "only the accepted request's event");
    let missing = api.withdrawals().get_withdrawal(authed(&token, pb::GetWithdrawalRequest { id: 999 })).await;
    assert_status(missing, Code::NotFound, &["no withdrawal has id 999"]);
    let unknown_lane = pb::PauseLaneRequest { lane: "zz".into(), reason: "x".into() };
    assert_status(api.admin().pause_lane(authed(&token, unknown_lane)).await, Code::NotFound, &["\"zz\""]);
    let no_reason = pb::PauseLaneRequest { lane: "a".into(), reason: String::new() };
    assert_status(api.admin().pause_lane(authed(&token, no_reason)).await, Code::InvalidArgument, &["reason"]);
}

#[tokio::test]
async fn the_same_external_id_returns_the_same_withdrawal_and_a_different_payload_is_refused() {
    let api = Api::start().await;
    api.hot_wallet().await;
    let token = api.root_token().await;
    let account = api.account(&token, "frank").await;
    let other = api.account(&token, "grace").await;
    api.credit(account, 0, ETHER).await;
    api.credit(other, 0, ETHER).await;
    let send = |request: pb::RequestWithdrawalRequest| {
        let mut withdrawals = api.withdrawals();
        let request = authed(&token, request);
        async move { withdrawals.request_withdrawal(request).await.map(tonic::Response::into_inner) }
    };

    let first = send(withdrawal_request(account, "payout-1", DESTINATION, ETHER / 2)).await.unwrap();
    assert!(first.created);
    let withdrawal = first.withdrawal.unwrap();
    assert_eq!(withdrawal.state, i32::from(pb::WithdrawalState::Requested));
    assert_eq!((withdrawal.amount.as_str(), withdrawal.amount_display.as_str()), ("500000000000000000", "0.5"));
    assert_eq!(withdrawal.destination, DESTINATION);
    assert_eq!(withdrawal.lane, "a");

    // The same payload, however it is spelled: amount in whole units, lowercase destination,
    // the asset by key.
    let same = pb::RequestWithdrawalRequest {
        asset: "eth".into(),
        destination: DESTINATION.to_lowercase(),
        amount: Some(WireAmount::AmountDecimal("0.50".into())),
        ..withdrawal_request(account, "payout-1", DESTINATION, 0)
    };
    let again = send(same).await.unwrap();
    assert!(!again.created);
    assert_eq!(again.withdrawal.unwrap(), withdrawal);

    let more = send(withdrawal_request(account, "payout-1", DESTINATION, ETHER / 3)).await;
    assert_status(more, Code::AlreadyExists, &["\"payout-1\"", &format!("withdrawal {}", withdrawal.id), "amount"]);
    let elsewhere = send(withdrawal_request(account, "payout-1", FUNDER, ETHER / 3)).await;
    assert_status(elsewhere, Code::AlreadyExists, &["different destination, amount"]);
    // External ids belong to an account: another account may use the same one.
    let theirs = send(withdrawal_request(other, "payout-1", DESTINATION, ETHER / 3)).await.unwrap();
    assert!(theirs.created);
    assert_ne!(theirs.withdrawal.unwrap().id, withdrawal.id);

    // Only one hold was taken for the repeated request.
    let balances = api.accounts().get_balances(authed(&token, pb::GetBalancesRequest { account_id: account })).await;
    assert_eq!(balances.unwrap().into_inner().balances[0].held_display, "0.5");
}

#[tokio::test]
async fn approvals_cancels_and_listing_go_through_the_api() {
    let api = Api::start().await;
    api.hot_wallet().await;
    let root = api.root_token().await;
    let reader = api.token("reader", &[custodian_api::tokens::Scope::Read]).await;
    let account = api.account(&root, "heidi").await;
    api.credit(account, 0, 10 * ETHER).await;
    let client = api.db.pool.get().await.unwrap();
    client
        .execute(
            "update asset set approval_limit = $1::text::numeric, approvals_required = 1 where asset = 'ETH'",
            &[&ETHER.to_string()],
        )
        .await
        .unwrap();
    let mut withdrawals = api.withdrawals();

    let big = withdrawals
        .request_withdrawal(authed(&root, withdrawal_request(account, "big", DESTINATION, 2 * ETHER)))
        .await
        .unwrap()
        .into_inner()
        .withdrawal
        .unwrap();
    assert_eq!(big.state, i32::from(pb::WithdrawalState::AwaitingApproval));
    let alice = api.token("alice", &[custodian_api::tokens::Scope::Approve]).await;
    let approve = |token: &str| authed(token, pb::ApproveWithdrawalRequest { id: big.id });
    assert_status(withdrawals.approve_withdrawal(approve(&reader)).await, Code::PermissionDenied, &["approve"]);
    // Four eyes: root requested it, so root (holding every scope) may not approve it.
    assert_status(
        withdrawals.approve_withdrawal(approve(&root)).await,
        Code::PermissionDenied,
        &["requested by \"root\"", "may not approve"],
    );
    let approved = withdrawals.approve_withdrawal(approve(&alice)).await.unwrap().into_inner();
    assert_eq!(approved.state, i32::from(pb::WithdrawalState::Requested));
    assert_eq!(withdrawals.approve_withdrawal(approve(&alice)).await.unwrap().into_inner(), approved);

    let small = withdrawals
        .request_withdrawal(authed(&root, withdrawal_request(account, "small", DESTINATION, ETHER / 2)))
        .await
        .unwrap()
        .into_inner()
        .withdrawal
        .unwrap();
    let wrong_state = pb::ApproveWithdrawalRequest { id: small.id };
    assert_status(
        withdrawals.approve_withdrawal(authed(&alice, wrong_state)).await,
        Code::FailedPrecondition,
        &["only a withdrawal awaiting approval"],
    );

    let cancel = |id| authed(&root, pb::CancelWithdrawalRequest { id });
    let cancelled = withdrawals.cancel_withdrawal(cancel(small.id)).await.unwrap().into_inner();
    assert_eq!(cancelled.state, i32::from(pb::WithdrawalState::Cancelled));
    assert_eq!(withdrawals.cancel_withdrawal(cancel(small.id)).await.unwrap().into_inner(), cancelled);
    assert_status(withdrawals.cancel_withdrawal(cancel(999)).await, Code::NotFound, &["999"]);
    let by: String = client
        .query_one(
            "select payload->>'by' from withdrawal_event where withdrawal_id = $1 and event_type = 'approved'",
            &[&big.id],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(by, "alice");

    // Listing: filters, and pages of one.
    let list = |state: pb::WithdrawalState, page_token: String| {
        let mut withdrawals = api.withdrawals();
        let request = authed(
            &reader,
            pb::ListWithdrawalsRequest { account_id: Some(account), state: state.into(), page_size: 1, page_token },
        );
        async move { withdrawals.list_withdrawals(request).await.map(tonic::Response::into_inner) }
    };
    let first = list(pb::WithdrawalState::Unspecified, String::new()).await.unwrap();
    assert_eq!(first.withdrawals, std::slice::from_ref(&approved));
    let second = list(pb::WithdrawalState::Unspecified, first.next_page_token).await.unwrap();
    assert_eq!(second.withdrawals, std::slice::from_ref(&cancelled));
    assert_eq!(second.next_page_token, "");
    let only_cancelled = list(pb::WithdrawalState::Cancelled, String::new()).await.unwrap();
    assert_eq!(only_cancelled.withdrawals, [cancelled]);
    let nobody = pb::ListWithdrawalsRequest { account_id: Some(account + 1), ..Default::default() };
    assert!(withdrawals.list_withdrawals(authed(&reader, nobody)).await.unwrap().into_inner().withdrawals.is_empty());
    let bad_state = pb::ListWithdrawalsRequest { state: 42, ..Default::default() };
    assert_status(withdrawals.list_withdrawals(authed(&reader, bad_state)).await, Code::InvalidArgument, &["state 42"]);

    // The hold of the cancelled withdrawal went back; the approved one still holds.
    let balances = api.accounts().get_balances(authed(&reader, pb::GetBalancesRequest { account_id: account })).await;
    let eth = &balances.unwrap().into_inner().balances[0];
    assert_eq!((eth.held_display.as_str(), eth.available_display.as_str()), ("2", "8"));

    let lanes = api.admin().list_hot_wallets(authed(&root, pb::ListHotWalletsRequest {})).await.unwrap().into_inner();
    assert_eq!(lanes.hot_wallets.len(), 1);
    assert_eq!(lanes.hot_wallets[0].address, "0x70997970C51812dc3A010C7d01b50e0d17dc79C8");
}
