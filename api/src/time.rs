//! Times on the wire: RFC 3339 strings, printed in UTC with microseconds (PostgreSQL's
//! precision), parsed strictly with the `time` crate; PostgreSQL's own form of a `timestamptz`
//! (a space for the `T`, an offset of hours alone) is read too.

use std::time::SystemTime;

use time::format_description::well_known::Rfc3339;
use time::macros::format_description;
use time::{OffsetDateTime, UtcOffset};

/// Prints `time` as `YYYY-MM-DDTHH:MM:SS.ffffffZ`.
pub(crate) fn format(time: SystemTime) -> String {
    let utc = OffsetDateTime::from(time).to_offset(UtcOffset::UTC);
    utc.format(format_description!("[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:6]Z"))
        .expect("BUG: a UTC time between years 0 and 9999 always formats")
}

/// Parses an RFC 3339 time (`2025-03-01T12:00:00Z`, `2025-03-01T13:30:00.5+01:30`). Also accepts
/// a space for the `T` and an offset of hours alone (`+01`), which is how PostgreSQL prints a
/// `timestamptz`. `None` for anything else, including impossible dates and leap seconds.
pub(crate) fn parse(input: &str) -> Option<SystemTime> {
    let mut text = input.to_owned();
    if text.as_bytes().get(10) == Some(&b' ') {
        text.replace_range(10..11, "T");
    }
    // PostgreSQL's `+01`: an offset of hours alone becomes `+01:00`.
    let bytes = text.as_bytes();
    if bytes.len() >= 3 {
        let tail = &bytes[bytes.len() - 3..];
        if matches!(tail[0], b'+' | b'-') && tail[1].is_ascii_digit() && tail[2].is_ascii_digit() && bytes.len() > 19 {
            text.push_str(":00");
        }
    }
    let parsed = OffsetDateTime::parse(&text, &Rfc3339).ok()?;
    // Rfc3339 admits a leap second (`:60`) and digits beyond nanoseconds; a timestamp here has
    // neither.
    let fraction = text
        .get(19..)
        .filter(|rest| rest.starts_with('.'))
        .map_or(0, |rest| rest[1..].bytes().take_while(u8::is_ascii_digit).count());
    if text.get(17..19) == Some("60") || fraction > 9 {
        return None;
    }
    Some(parsed.into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, UNIX_EPOCH};

    fn at(seconds: u64, micros: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(seconds) + Duration::from_micros(micros)
    }

    #[test]
    fn times_print_in_utc_with_microseconds() {
        let cases = [
            (at(0, 0), "1970-01-01T00:00:00.000000Z"),
            (at(951_782_400, 1), "2000-02-29T00:00:00.000001Z"),
            (at(1_735_689_599, 999_999), "2024-12-31T23:59:59.999999Z"),
            (UNIX_EPOCH - Duration::from_micros(1), "1969-12-31T23:59:59.999999Z"),
            (UNIX_EPOCH - Duration::from_secs(86_400), "1969-12-31T00:00:00.000000Z"),
        ];
        for (time, expected) in cases {
            assert_eq!(format(time), expected);
            assert_eq!(parse(expected), Some(time), "{expected}");
        }
    }

    #[test]
    fn rfc3339_and_postgres_forms_parse() {
        let noon = at(1_740_830_400, 0); // 2025-03-01T12:00:00Z
        let cases = [
            ("2025-03-01T12:00:00Z", Some(noon)),
            ("2025-03-01t12:00:00z", Some(noon)),
            ("2025-03-01T13:30:00+01:30", Some(noon)),
            ("2025-03-01T07:00:00-05:00", Some(noon)),
            ("2025-03-01 12:00:00+00", Some(noon)),
            ("2025-03-01 14:00:00.25+02", Some(at(1_740_830_400, 250_000))),
            ("2025-03-01T12:00:00.123456789Z", Some(noon + Duration::from_nanos(123_456_789))),
            ("2024-02-29T00:00:00Z", Some(at(1_709_164_800, 0))),
            ("2025-02-29T00:00:00Z", None),
            ("2025-13-01T00:00:00Z", None),
            ("2025-04-31T00:00:00Z", None),
            ("2025-03-01T24:00:00Z", None),
            ("2025-03-01T12:60:00Z", None),
            ("2025-03-01T12:00:60Z", None),
            ("2025-03-01T12:00:00", None),
            ("2025-03-01T12:00:00.Z", None),
            ("2025-03-01T12:00:00.1234567891Z", None),
            ("2025-03-01T12:00:00+1:00", None),
            ("2025-03-01T12:00:00+01:0", None),
            ("2025-03-01", None),
            ("yesterday", None),
            ("", None),
            ("2025-03-01T12:00:00Z ", None),
            ("+025-03-01T12:00:00Z", None),
        ];
        for (input, expected) in cases {
            assert_eq!(parse(input), expected, "{input:?}");
        }
    }
}
