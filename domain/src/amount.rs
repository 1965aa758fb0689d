//! Money as an unsigned integer in the asset's smallest unit (wei, satoshi, token base units).
//!
//! Arithmetic is checked: overflow and underflow are named errors, never wrap-around. Decimal
//! strings exist only at the edge, for people: [`Amount::parse_decimal`] and
//! [`Amount::to_decimal_string`] convert with the asset's number of decimals and never round.

use std::fmt;

use alloy_primitives::U256;
use rust_decimal::Decimal;

/// The largest number of decimals an asset may have: 10^77 is the largest power of ten in a U256,
/// and `numeric(78,0)` holds 78 digits.
pub const MAX_DECIMALS: u8 = 77;

/// A non-negative quantity of some asset, in its smallest unit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Amount(U256);

/// Arithmetic that would leave the range of an [`Amount`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AmountError {
    /// The result is larger than 2^256 − 1.
    #[error("amount overflow: the result exceeds 2^256 - 1")]
    Overflow,
    /// The result would be negative.
    #[error("amount underflow: the result would be negative")]
    Underflow,
}

/// Why a human-readable amount string was refused. Each case is distinct so a client can be told
/// exactly what to fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseAmountError {
    /// Nothing was given.
    #[error("amount is empty")]
    Empty,
    /// A minus sign: amounts are unsigned, direction is a separate field.
    #[error("amount {0:?} is negative; amounts are always positive")]
    Negative(String),
    /// More digits after the point than the asset has decimals. Rounding would move money.
    #[error("amount {input:?} has {given} decimals but the asset has only {max}")]
    TooManyDecimals {
        /// The string given.
        input: String,
        /// Significant fractional digits in it.
        given: usize,
        /// Decimals of the asset.
        max: u8,
    },
    /// The value does not fit in 256 bits once scaled to the smallest unit.
    #[error("amount {0:?} is too large")]
    Overflow(String),
    /// Not a plain decimal number (letters, exponent, several points, missing digits).
    #[error("amount {0:?} is not a decimal number like \"1.5\"")]
    Invalid(String),
    /// The asset declares more decimals than any amount could hold.
    #[error("an asset cannot have {0} decimals (maximum {MAX_DECIMALS})")]
    BadDecimals(u8),
}

impl Amount {
    /// Zero of any asset.
    pub const ZERO: Amount = Amount(U256::ZERO);
    /// The largest representable amount, 2^256 − 1.
    pub const MAX: Amount = Amount(U256::MAX);

    /// An amount of `units` smallest units.
    pub const fn from_units(units: U256) -> Self {
        Amount(units)
    }

    /// An amount from a `u64` count of smallest units (satoshis always fit).
    pub fn from_u64(units: u64) -> Self {
        Amount(U256::from(units))
    }

    /// The count of smallest units.
    pub const fn units(self) -> U256 {
        self.0
    }

    /// Whether this is zero.
    pub fn is_zero(self) -> bool {
        self.0.is_zero()
    }

    /// `self + other`, or [`AmountError::Overflow`].
    pub fn checked_add(self, other: Amount) -> Result<Amount, AmountError> {
        self.0.checked_add(other.0).map(Amount).ok_or(AmountError::Overflow)
    }

    /// `self − other`, or [`AmountError::Underflow`].
    pub fn checked_sub(self, other: Amount) -> Result<Amount, AmountError> {
        self.0.checked_sub(other.0).map(Amount).ok_or(AmountError::Underflow)
    }

    /// `self × factor`, or [`AmountError::Overflow`] (fees: gas used × price per gas).
    pub fn checked_mul(self, factor: U256) -> Result<Amount, AmountError> {
        self.0.checked_mul(factor).map(Amount).ok_or(AmountError::Overflow)
    }

    /// Parses a decimal string such as `"1.5"` into smallest units of an asset with `decimals`
    /// decimals. Exact over the whole U256 range. Trailing zeros after the point are not
    /// significant (`"1.50"` is fine for a 1-decimal asset); any other excess precision is refused.
    pub fn parse_decimal(input: &str, decimals: u8) -> Result<Amount, ParseAmountError> {
        if decimals > MAX_DECIMALS {
            return Err(ParseAmountError::BadDecimals(decimals));
        }
        let s = input.trim();
        if s.is_empty() {
            return Err(ParseAmountError::Empty);
        }
        if s.starts_with('-') {
            return Err(ParseAmountError::Negative(input.to_owned()));
        }
        let (whole, fraction) = match s.split_once('.') {
            Some((w, f)) => (w, f),
            None => (s, ""),
        };
        let all_digits = |part: &str| part.bytes().all(|b| b.is_ascii_digit());
        let has_point = s.contains('.');
        if whole.is_empty() || !all_digits(whole) || !all_digits(fraction) || (has_point && fraction.is_empty()) {
            return Err(ParseAmountError::Invalid(input.to_owned()));
        }
        let fraction = fraction.trim_end_matches('0');
        if fraction.len() > usize::from(decimals) {
            return Err(ParseAmountError::TooManyDecimals {
                input: input.to_owned(),
                given: fraction.len(),
                max: decimals,
            });
        }
        let overflow = || ParseAmountError::Overflow(input.to_owned());
        let mut units = U256::ZERO;
        let padding = usize::from(decimals) - fraction.len();
        for digit in whole.bytes().chain(fraction.bytes()).chain(std::iter::repeat_n(b'0', padding)) {
            units = units
                .checked_mul(U256::from(10u8))
                .and_then(|u| u.checked_add(U256::from(digit - b'0')))
                .ok_or_else(overflow)?;
        }
        Ok(Amount(units))
    }

    /// Converts a `rust_decimal` value (as found in configuration files) exactly, with the same
    /// rules as [`Amount::parse_decimal`].
    pub fn from_decimal(value: Decimal, decimals: u8) -> Result<Amount, ParseAmountError> {
        Amount::parse_decimal(&value.normalize().to_string(), decimals)
    }

    /// Prints the amount in whole units with the asset's decimals, without trailing zeros:
    /// 1500000000000000000 wei with 18 decimals is `"1.5"`.
    pub fn to_decimal_string(self, decimals: u8) -> String {
        let digits = self.0.to_string();
        let decimals = usize::from(decimals);
        if decimals == 0 {
            return digits;
        }
        let padded = format!("{digits:0>width$}", width = decimals + 1);
        let (whole, fraction) = padded.split_at(padded.len() - decimals);
        let fraction = fraction.trim_end_matches('0');
        if fraction.is_empty() {
            whole.to_owned()
        } else {
            format!("{whole}.{fraction}")
        }
    }
}

impl fmt::Display for Amount {
    /// The count of smallest units, as stored.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl From<U256> for Amount {
    fn from(units: U256) -> Self {
        Amount(units)
    }
}

impl std::str::FromStr for Amount {
    type Err = ParseAmountError;

    /// Parses a count of smallest units (an integer string, as stored).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Amount::parse_decimal(s, 0)
    }
}

impl serde::Serialize for Amount {
    /// Amounts travel as decimal strings of smallest units: JSON numbers lose precision.
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(&self.0)
    }
}

impl<'de> serde::Deserialize<'de> for Amount {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let s = String::deserialize(deserializer)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// A signed count of smallest units: a balance, which a reversed deposit can take below zero
/// (the account then owes it). Never used to move money: an [`Amount`] does that.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SignedAmount {
    /// Zero or more.
    NonNegative(Amount),
    /// Below zero by this much.
    Negative(Amount),
}

impl SignedAmount {
    /// `plus - minus`: always representable, never a negative zero.
    pub fn difference(plus: Amount, minus: Amount) -> SignedAmount {
        match plus.checked_sub(minus) {
            Ok(held) => SignedAmount::NonNegative(held),
            Err(_) => SignedAmount::Negative(minus.checked_sub(plus).expect("BUG: minus exceeds plus here")),
        }
    }

    /// `self - other`, exact; `Overflow` only beyond ±(2^256 - 1).
    pub fn checked_sub(self, other: SignedAmount) -> Result<SignedAmount, AmountError> {
        self.checked_add(other.negated())
    }

    /// `self + other`, exact; `Overflow` only beyond ±(2^256 - 1).
    pub fn checked_add(self, other: SignedAmount) -> Result<SignedAmount, AmountError> {
        use SignedAmount::{Negative, NonNegative};
        Ok(match (self, other) {
            (NonNegative(a), NonNegative(b)) => NonNegative(a.checked_add(b)?),
            (Negative(a), Negative(b)) => Negative(a.checked_add(b)?),
            (NonNegative(a), Negative(b)) | (Negative(b), NonNegative(a)) => SignedAmount::difference(a, b),
        })
    }

    /// The same magnitude, the other sign.
    pub fn negated(self) -> SignedAmount {
        match self {
            SignedAmount::NonNegative(a) => SignedAmount::difference(Amount::ZERO, a),
            SignedAmount::Negative(a) => SignedAmount::NonNegative(a),
        }
    }

    /// Whether it is zero.
    pub fn is_zero(self) -> bool {
        matches!(self, SignedAmount::NonNegative(a) if a.is_zero())
    }

    /// Whether it is below zero.
    pub fn is_negative(self) -> bool {
        matches!(self, SignedAmount::Negative(_))
    }

    /// Whether `amount` may be taken from it.
    pub fn covers(self, amount: Amount) -> bool {
        matches!(self, SignedAmount::NonNegative(held) if held >= amount)
    }

    /// In whole units of an asset with `decimals` decimals, a minus sign when owed.
    pub fn to_decimal_string(self, decimals: u8) -> String {
        match self {
            SignedAmount::NonNegative(held) => held.to_decimal_string(decimals),
            SignedAmount::Negative(owed) => format!("-{}", owed.to_decimal_string(decimals)),
        }
    }
}

impl serde::Serialize for SignedAmount {
    /// As a decimal string of smallest units, a minus sign when negative (as [`Amount`] travels).
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl From<Amount> for SignedAmount {
    fn from(amount: Amount) -> Self {
        SignedAmount::NonNegative(amount)
    }
}

impl fmt::Display for SignedAmount {
    /// The signed count of smallest units, as the database writes it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SignedAmount::NonNegative(held) => write!(f, "{held}"),
            SignedAmount::Negative(owed) => write!(f, "-{owed}"),
        }
    }
}

impl std::str::FromStr for SignedAmount {
    type Err = ParseAmountError;

    /// Parses a signed count of smallest units (`numeric::text`); `-0` is zero.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.strip_prefix('-') {
            Some(owed) => Ok(SignedAmount::difference(Amount::ZERO, owed.parse()?)),
            None => Ok(SignedAmount::NonNegative(s.parse()?)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn units(s: &str) -> Amount {
        Amount(U256::from_str_radix(s, 10).expect("test literal"))
    }

    #[test]
    fn a_signed_amount_covers_only_what_it_holds_and_prints_as_stored() {
        let owes: SignedAmount = "-25".parse().unwrap();
        assert_eq!(owes, SignedAmount::Negative(units("25")));
        assert_eq!(owes.to_string(), "-25");
        assert_eq!(owes.to_decimal_string(1), "-2.5");
        assert!(!owes.covers(Amount::from_u64(0)), "an account that owes can take nothing");
        let holds: SignedAmount = "100".parse().unwrap();
        assert!(holds.covers(units("100")) && !holds.covers(units("101")));
        assert_eq!("-0".parse::<SignedAmount>().unwrap(), SignedAmount::NonNegative(Amount::from_u64(0)));
        assert!("--1".parse::<SignedAmount>().is_err() && "1.5".parse::<SignedAmount>().is_err());
    }

    #[test]
    fn signed_arithmetic_is_exact_across_zero_and_over_the_whole_u256_range() {
        let s = |v: &str| v.parse::<SignedAmount>().unwrap();
        assert_eq!(s("5").checked_sub(s("7")), Ok(s("-2")));
        assert_eq!(s("-5").checked_sub(s("-7")), Ok(s("2")));
        assert_eq!(s("-5").checked_add(s("5")), Ok(s("0")));
        assert_eq!(s("-5").checked_sub(s("2")), Ok(s("-7")));
        assert!(!s("0").negated().is_negative(), "there is no negative zero");
        let max = SignedAmount::from(Amount(U256::MAX));
        assert_eq!(max.checked_sub(max), Ok(s("0")));
        assert_eq!(max.negated().checked_add(max), Ok(s("0")));
        assert_eq!(max.checked_add(s("1")), Err(AmountError::Overflow));
        assert_eq!(max.negated().checked_sub(s("1")), Err(AmountError::Overflow));
    }

    #[test]
    fn parses_decimal_strings() {
        let max = U256::MAX.to_string();
        let too_big = "115792089237316195423570985008687907853269984665640564039457584007913129639936";
        let cases: &[(&str, u8, Result<Amount, ParseAmountError>)] = &[
            ("1.5", 18, Ok(units("1500000000000000000"))),
            ("1", 18, Ok(units("1000000000000000000"))),
            ("0.000000000000000001", 18, Ok(units("1"))),
            ("0", 18, Ok(Amount::ZERO)),
            ("  2.50 ", 1, Ok(units("25"))),
            ("21000000", 8, Ok(units("2100000000000000"))),
            ("0.00000001", 8, Ok(units("1"))),
            (&max, 0, Ok(Amount::MAX)),
            ("", 18, Err(ParseAmountError::Empty)),
            ("   ", 18, Err(ParseAmountError::Empty)),
            ("-1", 18, Err(ParseAmountError::Negative("-1".into()))),
            ("-0.5", 8, Err(ParseAmountError::Negative("-0.5".into()))),
            (
                "0.000000001",
                8,
                Err(ParseAmountError::TooManyDecimals { input: "0.000000001".into(), given: 9, max: 8 }),
            ),
            ("1.5", 0, Err(ParseAmountError::TooManyDecimals { input: "1.5".into(), given: 1, max: 0 })),
            (too_big, 0, Err(ParseAmountError::Overflow(too_big.into()))),
            (
                "115792089237316195423570985008687907853269984665640564039457.584007913129639936",
                18,
                Err(ParseAmountError::Overflow(
                    "115792089237316195423570985008687907853269984665640564039457.584007913129639936".into(),
                )),
            ),
            ("1e18", 18, Err(ParseAmountError::Invalid("1e18".into()))),
            ("1.2.3", 18, Err(ParseAmountError::Invalid("1.2.3".into()))),
            (".5", 18, Err(ParseAmountError::Invalid(".5".into()))),
            ("5.", 18, Err(ParseAmountError::Invalid("5.".into()))),
            ("+5", 18, Err(ParseAmountError::Invalid("+5".into()))),
            ("1,5", 18, Err(ParseAmountError::Invalid("1,5".into()))),
            ("abc", 18, Err(ParseAmountError::Invalid("abc".into()))),
            ("1", 78, Err(ParseAmountError::BadDecimals(78))),
        ];
        for (input, decimals, expected) in cases {
            assert_eq!(&Amount::parse_decimal(input, *decimals), expected, "input {input:?} decimals {decimals}");
        }
    }

    #[test]
    fn prints_decimal_strings() {
        let cases: &[(&str, u8, &str)] = &[
            ("1500000000000000000", 18, "1.5"),
            ("1000000000000000000", 18, "1"),
            ("1", 18, "0.000000000000000001"),
            ("0", 18, "0"),
            ("0", 0, "0"),
            ("2100000000000000", 8, "21000000"),
            ("123456789", 8, "1.23456789"),
            ("25", 1, "2.5"),
            ("42", 0, "42"),
        ];
        for (stored, decimals, expected) in cases {
            assert_eq!(units(stored).to_decimal_string(*decimals), *expected, "{stored} with {decimals}");
        }
    }

    #[test]
    fn checked_arithmetic_names_overflow_and_underflow() {
        assert_eq!(Amount::MAX.checked_add(Amount::from_u64(1)), Err(AmountError::Overflow));
        assert_eq!(Amount::ZERO.checked_sub(Amount::from_u64(1)), Err(AmountError::Underflow));
        assert_eq!(Amount::from_u64(2).checked_add(Amount::from_u64(3)), Ok(Amount::from_u64(5)));
        assert_eq!(Amount::from_u64(5).checked_sub(Amount::from_u64(5)), Ok(Amount::ZERO));
        assert_eq!(Amount::MAX.checked_mul(U256::from(2u8)), Err(AmountError::Overflow));
        assert_eq!(Amount::from_u64(21_000).checked_mul(U256::from(7u8)), Ok(Amount::from_u64(147_000)));
    }

    #[test]
    fn from_decimal_is_exact() {
        let d: Decimal = "100.250".parse().expect("literal");
        assert_eq!(Amount::from_decimal(d, 2), Ok(Amount::from_u64(10025)));
        let d: Decimal = "0.001".parse().expect("literal");
        assert!(matches!(Amount::from_decimal(d, 2), Err(ParseAmountError::TooManyDecimals { .. })));
    }

    proptest::proptest! {
        #[test]
        fn print_then_parse_round_trips(limbs in proptest::array::uniform4(proptest::num::u64::ANY), decimals in 0u8..=MAX_DECIMALS) {
            let amount = Amount(U256::from_limbs(limbs));
            let printed = amount.to_decimal_string(decimals);
            proptest::prop_assert_eq!(Amount::parse_decimal(&printed, decimals), Ok(amount));
        }

        #[test]
        fn add_then_sub_is_identity_or_overflow(a in proptest::num::u128::ANY, b in proptest::num::u128::ANY) {
            let (a, b) = (Amount(U256::from(a)), Amount(U256::from(b)));
            let sum = a.checked_add(b).expect("two u128 always fit in U256");
            proptest::prop_assert_eq!(sum.checked_sub(b), Ok(a));
        }
    }
}
