//! Times on the wire: RFC 3339 strings, printed in UTC with microseconds (PostgreSQL's
//! precision), parsed strictly. Integer calendar arithmetic (days from the civil date and back),
//! so no date crate is needed.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

const SECONDS_PER_DAY: i64 = 86_400;

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's `days_from_civil`).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let day_of_year = (153 * (month + if month > 2 { -3 } else { 9 }) + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

/// The date of a day count since 1970-01-01 (H. Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z - era * 146_097;
    let year_of_era = (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let mp = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn days_in_month(year: i64, month: i64) -> i64 {
    match month {
        2 if (year % 4 == 0 && year % 100 != 0) || year % 400 == 0 => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Prints `time` as `YYYY-MM-DDTHH:MM:SS.ffffffZ`.
pub(crate) fn format(time: SystemTime) -> String {
    let (seconds, micros) = match time.duration_since(UNIX_EPOCH) {
        Ok(after) => (i64::try_from(after.as_secs()).unwrap_or(i64::MAX), i64::from(after.subsec_micros())),
        Err(before) => {
            let before = before.duration();
            let whole = i64::try_from(before.as_secs()).unwrap_or(i64::MAX);
            match i64::from(before.subsec_micros()) {
                0 => (-whole, 0),
                micros => (-whole - 1, 1_000_000 - micros),
            }
        }
    };
    let (year, month, day) = civil_from_days(seconds.div_euclid(SECONDS_PER_DAY));
    let of_day = seconds.rem_euclid(SECONDS_PER_DAY);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{micros:06}Z",
        of_day / 3600,
        of_day % 3600 / 60,
        of_day % 60
    )
}

/// Parses an RFC 3339 time (`2025-03-01T12:00:00Z`, `2025-03-01T13:30:00.5+01:30`). Also accepts
/// a space for the `T` and an offset of hours alone (`+01`), which is how PostgreSQL prints a
/// `timestamptz`. `None` for anything else, including impossible dates.
pub(crate) fn parse(input: &str) -> Option<SystemTime> {
    let s = input.as_bytes();
    let digits = |range: std::ops::Range<usize>| -> Option<i64> {
        let part = s.get(range)?;
        part.iter().all(u8::is_ascii_digit).then(|| part.iter().fold(0, |n, d| n * 10 + i64::from(d - b'0')))
    };
    let at = |i: usize, expected: &[u8]| s.get(i).is_some_and(|c| expected.contains(c));
    if !(at(4, b"-") && at(7, b"-") && at(10, b"Tt ") && at(13, b":") && at(16, b":")) {
        return None;
    }
    let (year, month, day) = (digits(0..4)?, digits(5..7)?, digits(8..10)?);
    let (hour, minute, second) = (digits(11..13)?, digits(14..16)?, digits(17..19)?);
    if !(1..=12).contains(&month) || !(1..=days_in_month(year, month)).contains(&day) {
        return None;
    }
    if hour > 23 || minute > 59 || second > 59 {
        return None;
    }
    let mut i = 19;
    let mut nanos = 0i64;
    if at(i, b".") {
        let start = i + 1;
        let end = start + s[start..].iter().take_while(|c| c.is_ascii_digit()).count();
        if end == start || end - start > 9 {
            return None;
        }
        let fraction = digits(start..end)?;
        let scale = 10i64.pow(u32::try_from(9 - (end - start)).ok()?);
        nanos = fraction * scale;
        i = end;
    }
    let offset_seconds = match s.get(i..)? {
        b"Z" | b"z" => 0,
        [sign @ (b'+' | b'-'), rest @ ..] => {
            let hours = digits(i + 1..i + 3)?;
            let minutes = match rest.len() {
                2 => 0,
                5 if rest[2] == b':' => digits(i + 4..i + 6)?,
                _ => return None,
            };
            if hours > 23 || minutes > 59 {
                return None;
            }
            let offset = hours * 3600 + minutes * 60;
            if *sign == b'-' {
                -offset
            } else {
                offset
            }
        }
        _ => return None,
    };
    let seconds =
        days_from_civil(year, month, day) * SECONDS_PER_DAY + hour * 3600 + minute * 60 + second - offset_seconds;
    let nanos = u32::try_from(nanos).ok()?;
    if seconds >= 0 {
        Some(UNIX_EPOCH + Duration::new(u64::try_from(seconds).ok()?, nanos))
    } else {
        let before = Duration::from_secs(seconds.unsigned_abs());
        Some(UNIX_EPOCH - before + Duration::from_nanos(u64::from(nanos)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
