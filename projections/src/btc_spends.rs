//! `replay --verify` for BTC withdrawals: every signed attempt is rebuilt from its stored bytes
//! and checked against the facts it was signed from — it spends exactly its spend's reserved
//! coins, pays each withdrawal of the spend its destination and amount (a cancel pays only us),
//! sends its change to the lane's change address of its index, and its recorded fee is inputs
//! minus outputs. Settlement is checked against the chain's spend: the fees the `confirmed` (or
//! `cancelled`) events carry add up, per spend, to the fee of the sibling they name, and what
//! settled and paid fees for a spend is exactly what its coins lost (inputs minus change), so
//! `custody` moves with our coins.

use std::collections::{BTreeMap, BTreeSet};
use std::str::FromStr;

use alloy_primitives::U256;
use bitcoin::consensus::deserialize;
use bitcoin::{OutPoint, Transaction, Txid};
use custodian_domain::withdrawal::AttemptKind;

use crate::replay::Difference;

fn sat(value: U256) -> u64 {
    u64::try_from(value).unwrap_or(u64::MAX)
}

fn script_of(address: &str) -> Option<bitcoin::ScriptBuf> {
    bitcoin::Address::from_str(address).ok().map(|a| a.assume_checked().script_pubkey())
}

/// Every difference between the stored BTC attempts, their reservations and payouts, and the
/// settlement events and postings.
pub(crate) async fn verify(tx: &deadpool_postgres::Transaction<'_>) -> Result<Vec<Difference>, tokio_postgres::Error> {
    let mut found = Vec::new();
    let mut differ = |detail: String| found.push(Difference { check: "btc spends", detail });
    let mut reserved: BTreeMap<i64, BTreeMap<OutPoint, u64>> = BTreeMap::new();
    for row in tx.query("select spend_id, tx_hash, output_index, amount from utxo_reservation", &[]).await? {
        let outpoint = OutPoint {
            txid: Txid::from_str(row.get(1)).unwrap_or_else(|_| panic!("BUG: a stored txid is hex")),
            vout: u32::try_from(row.get::<_, i32>(2)).unwrap_or(u32::MAX),
        };
        reserved.entry(row.get(0)).or_default().insert(outpoint, sat(row.get(3)));
    }
    let mut payouts: BTreeMap<i64, Vec<(i64, usize, String, u64)>> = BTreeMap::new();
    for row in tx
        .query(
            "select p.spend_id, p.withdrawal_id, p.output_index, w.destination, w.amount
               from btc_spend_payout p join withdrawal w on w.id = p.withdrawal_id order by p.output_index",
            &[],
        )
        .await?
    {
        let vout = usize::try_from(row.get::<_, i32>(2)).unwrap_or(usize::MAX);
        payouts.entry(row.get(0)).or_default().push((row.get(1), vout, row.get(3), sat(row.get(4))));
    }
    let mut fees: BTreeMap<String, u64> = BTreeMap::new();
    let mut spend_of: BTreeMap<String, i64> = BTreeMap::new();
    let attempts = tx
        .query(
            "select a.tx_hash, a.spend_id, a.kind, a.raw_tx, a.fee, a.change_output, c.address
               from btc_attempt a join btc_spend s on s.id = a.spend_id
               left join btc_change_address c on c.lane = s.lane and c.derivation_index = a.change_index
              order by a.spend_id, a.created_at",
            &[],
        )
        .await?;
    for row in &attempts {
        let (hash, spend): (String, i64) = (row.get(0), row.get(1));
        let kind = match row.get::<_, &str>(2).parse::<AttemptKind>() {
            Ok(kind) => kind,
            Err(e) => {
                differ(format!("attempt {hash}: {e}"));
                continue;
            }
        };
        let fee = sat(row.get(4));
        fees.insert(hash.clone(), fee);
        spend_of.insert(hash.clone(), spend);
        let Ok(signed) = deserialize::<Transaction>(row.get::<_, &[u8]>(3)) else {
            differ(format!("attempt {hash}: its stored bytes are not a transaction"));
            continue;
        };
        if signed.compute_txid().to_string() != hash {
            differ(format!("attempt {hash}: its stored bytes hash to {}", signed.compute_txid()));
        }
        let coins = reserved.get(&spend).cloned().unwrap_or_default();
        let inputs: BTreeSet<OutPoint> = signed.input.iter().map(|i| i.previous_output).collect();
        if inputs != coins.keys().copied().collect::<BTreeSet<_>>() || inputs.len() != signed.input.len() {
            differ(format!("attempt {hash}: spends {inputs:?}, but spend {spend} reserved {:?}", coins.keys()));
            continue;
        }
        if kind != AttemptKind::Cancel {
            for (id, vout, destination, amount) in payouts.get(&spend).map(Vec::as_slice).unwrap_or_default() {
                let paid = signed.output.get(*vout).map(|o| (o.script_pubkey.clone(), o.value.to_sat()));
                if paid != script_of(destination).map(|s| (s, *amount)) {
                    differ(format!(
                        "attempt {hash}: output {vout} does not pay withdrawal {id} {amount} sat to {destination}"
                    ));
                }
            }
        }
        let change = row.get::<_, Option<i32>>(5).and_then(|o| usize::try_from(o).ok());
        let expected_outputs = if kind == AttemptKind::Cancel {
            1
        } else {
            payouts.get(&spend).map_or(0, Vec::len) + usize::from(change.is_some())
        };
        if signed.output.len() != expected_outputs {
            differ(format!(
                "attempt {hash}: {} outputs where its payouts and change make {expected_outputs}",
                signed.output.len()
            ));
        }
        if let Some(change) = change {
            let to: Option<String> = row.get(6);
            let ours = to.as_deref().and_then(script_of);
            if signed.output.get(change).map(|o| o.script_pubkey.clone()) != ours || ours.is_none() {
                differ(format!("attempt {hash}: output {change} is not the lane's change address {to:?}"));
            }
        }
        let out: u64 = signed.output.iter().map(|o| o.value.to_sat()).sum();
        let inputs: u64 = coins.values().sum();
        if inputs.checked_sub(out) != Some(fee) {
            differ(format!("attempt {hash}: records fee {fee}, but inputs {inputs} minus outputs {out} differ"));
        }
    }
    // Settlement: per spend, once every withdrawal of it has settled (each is its own
    // transaction), the events' fees add up to the fee of the sibling they name.
    let mut settled: BTreeMap<(i64, String), (u64, usize)> = BTreeMap::new();
    for row in tx
        .query(
            "select e.withdrawal_id, e.event_type, e.payload ->> 'tx_hash', (e.payload ->> 'fee')::numeric(78,0)
               from withdrawal_event e join withdrawal w on w.id = e.withdrawal_id
              where w.chain = 'btc' and e.event_type in ('confirmed', 'cancelled') and e.payload ->> 'tx_hash' is not null",
            &[],
        )
        .await?
    {
        let (id, event, hash): (i64, String, String) = (row.get(0), row.get(1), row.get(2));
        let Some(spend) = spend_of.get(&hash) else {
            differ(format!("withdrawal {id}: {event} by {hash}, which is none of our attempts"));
            continue;
        };
        let entry = settled.entry((*spend, hash)).or_default();
        entry.0 += sat(row.get(3));
        entry.1 += 1;
    }
    for ((spend, hash), (fee, count)) in settled {
        let recorded = fees.get(&hash).copied().unwrap_or_default();
        let members = payouts.get(&spend).map_or(0, Vec::len);
        if fee > recorded || (count == members && fee != recorded) {
            differ(format!(
                "spend {spend}: {count} of its {members} withdrawals settled with fees of {fee} sat, but {hash} paid {recorded}"
            ));
        }
    }
    Ok(found)
}
