//! Amounts of money: integer minor units with the currency they are counted
//! in (SPEC §5 "Money").
//!
//! idem keeps every amount (a contract's price and fees, a delivery's
//! `charge`, a cancellation's `fee`) as an integer number of minor units. A
//! class's fee policy may name its currency (`fees.currency`, an ISO 4217
//! alphabetic code); its minor-unit exponent (EUR 2, JPY 0, KWD 3) comes from
//! the ISO 4217 table of the `iso_currency` crate, and both are frozen into
//! the contract. [`Money`]'s `Display` is the one way every human-facing
//! surface (CLI, demo, console) writes an amount: `EUR 1.00`, `JPY 100`,
//! `KWD 1.000`, and `100 minor units` when the class names no currency.
//! [`Money`]'s `FromStr` reads that text back.

use std::fmt;
use std::str::FromStr;

/// Errors naming a currency.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MoneyError {
    /// The code is not an ISO 4217 alphabetic code.
    #[error("currency `{0}` is not an ISO 4217 code")]
    UnknownCurrency(String),
    /// The code is in ISO 4217 but has no minor unit (gold, SDR, testing codes).
    #[error("currency `{0}` has no minor unit in ISO 4217 (N.A.)")]
    NoMinorUnit(String),
    /// The text is not an amount as [`Money`]'s `Display` writes it.
    #[error("`{0}` is not an amount (`EUR 1.00`, `JPY 100` or `100 minor units`)")]
    NotAnAmount(String),
}

/// A currency: its ISO 4217 alphabetic code and the exponent of its minor
/// unit (the number of decimals: EUR 2, JPY 0, KWD 3).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Currency {
    /// ISO 4217 alphabetic code, e.g. `EUR`.
    pub code: String,
    /// Decimals of the minor unit, from ISO 4217.
    pub exponent: u32,
}

impl Currency {
    /// The currency of ISO 4217 code `code` (upper case, as the standard
    /// writes it), with its exponent from the ISO 4217 table.
    ///
    /// # Errors
    /// [`MoneyError::UnknownCurrency`] for a code not in ISO 4217 (`eur`
    /// included); [`MoneyError::NoMinorUnit`] for one without a minor unit
    /// (`XAU`, `XDR`, `XXX`).
    pub fn from_code(code: &str) -> Result<Currency, MoneyError> {
        let iso = iso_currency::Currency::from_code(code)
            .ok_or_else(|| MoneyError::UnknownCurrency(code.to_owned()))?;
        let exponent = iso
            .exponent()
            .ok_or_else(|| MoneyError::NoMinorUnit(code.to_owned()))?;
        Ok(Currency {
            code: iso.code().to_owned(),
            exponent: u32::from(exponent),
        })
    }
}

/// An amount: `amount` minor units of `currency`, or of no named currency
/// (`None`: a class without `fees.currency`, or a task accepted before its
/// class named one).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Money {
    /// Integer minor units (cents for EUR).
    pub amount: i64,
    /// The currency, when the contract names one.
    pub currency: Option<Currency>,
}

impl Money {
    /// `amount` minor units of `currency`.
    pub fn new(amount: i64, currency: Option<Currency>) -> Money {
        Money { amount, currency }
    }
}

/// `EUR 1.00`, `JPY 100`, `KWD 1.000`, `EUR -0.05`: the code, a space and the
/// amount with exactly `exponent` decimals; `100 minor units` (`1 minor unit`)
/// without a currency.
impl fmt::Display for Money {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some(currency) = &self.currency else {
            let unit = if self.amount == 1 { "unit" } else { "units" };
            return write!(f, "{} minor {unit}", self.amount);
        };
        let sign = if self.amount < 0 { "-" } else { "" };
        let magnitude = self.amount.unsigned_abs();
        let exponent = currency.exponent;
        match 10u64.checked_pow(exponent) {
            Some(scale) if exponent > 0 => {
                let (whole, minor) = (magnitude / scale, magnitude % scale);
                let width = exponent as usize;
                write!(f, "{} {sign}{whole}.{minor:0width$}", currency.code)
            }
            // Exponent 0, or one too large for any i64 amount to reach a
            // whole unit (not in ISO 4217): all digits are minor units.
            _ if exponent == 0 => write!(f, "{} {sign}{magnitude}", currency.code),
            _ => {
                let width = exponent as usize;
                write!(f, "{} {sign}0.{magnitude:0width$}", currency.code)
            }
        }
    }
}

/// Reads back what `Display` writes: `EUR 1.00` (exactly the currency's
/// decimals), `JPY 100`, `100 minor units`, `1 minor unit`.
impl FromStr for Money {
    type Err = MoneyError;

    fn from_str(text: &str) -> Result<Money, MoneyError> {
        let not = || MoneyError::NotAnAmount(text.to_owned());
        if let Some(number) = text
            .strip_suffix(" minor units")
            .or_else(|| text.strip_suffix(" minor unit"))
        {
            let amount = parse_integer(number).ok_or_else(not)?;
            return Ok(Money::new(amount, None));
        }
        let (code, number) = text.split_once(' ').ok_or_else(not)?;
        let currency = Currency::from_code(code)?;
        let (negative, digits) = match number.strip_prefix('-') {
            Some(rest) => (true, rest),
            None => (false, number),
        };
        let (whole, minor) = match digits.split_once('.') {
            Some((w, m)) => (w, m),
            None => (digits, ""),
        };
        if minor.len() != currency.exponent as usize
            || whole.is_empty()
            || !whole
                .bytes()
                .chain(minor.bytes())
                .all(|b| b.is_ascii_digit())
        {
            return Err(not());
        }
        let magnitude: i128 = format!("{whole}{minor}").parse().map_err(|_| not())?;
        let amount =
            i64::try_from(if negative { -magnitude } else { magnitude }).map_err(|_| not())?;
        Ok(Money::new(amount, Some(currency)))
    }
}

/// A delivery's charge in words, as the CLI and the demo say it: `a charge of
/// EUR 1.00`, `a charge of 100 minor units`, or `no charge`.
pub fn charge_words(charge: Option<&Money>) -> String {
    charge.map_or_else(|| "no charge".to_owned(), |c| format!("a charge of {c}"))
}

/// A cancellation's fee in words: `a cancellation fee of EUR 0.14`, or `no
/// cancellation fee` while none is settled.
pub fn fee_words(fee: Option<&Money>) -> String {
    fee.map_or_else(
        || "no cancellation fee".to_owned(),
        |f| format!("a cancellation fee of {f}"),
    )
}

/// A cancellation that lost to delivery (`too_late` on a delivered task), in
/// words: one amount, the delivery's charge, and that the fee is that same
/// charge, not a second one (SPEC §2.7: after delivery the fee is the full
/// price): `the cancellation fee is the delivery's charge, EUR 1.00, charged
/// once (no second charge)`.
pub fn too_late_words(charge: &Money) -> String {
    format!(
        "the cancellation fee is the delivery's charge, {charge}, charged once (no second charge)"
    )
}

/// Checks for the property every human-facing rendering of an amount keeps
/// (the CLI's, the demo's, the console's): callable from other crates' tests.
pub mod testing {
    use super::{Currency, Money};

    /// The currencies the property runs over: exponents 0, 2 and 3 (JPY,
    /// EUR, KWD) and none.
    pub fn currencies() -> Vec<Option<Currency>> {
        ["JPY", "EUR", "KWD"]
            .iter()
            .filter_map(|code| Currency::from_code(code).ok())
            .map(Some)
            .chain([None])
            .collect()
    }

    /// Whether `rendered` (a sentence, a line, a table row) carries `money`
    /// as [`Money`]'s `Display` writes it, so that the amount reads back:
    /// with a currency, its code, a space and the amount with exactly
    /// `exponent` decimals; without one, `N minor unit(s)`. `Err` says what
    /// is missing.
    ///
    /// # Errors
    /// A message naming the rendering and what it lacks.
    pub fn check_rendering(rendered: &str, money: &Money) -> Result<(), String> {
        let candidates: Vec<&str> = match &money.currency {
            Some(currency) => {
                let prefix = format!("{} ", currency.code);
                rendered
                    .match_indices(&prefix)
                    .map(|(start, _)| {
                        let rest = &rendered[start..];
                        let end = rest[prefix.len()..]
                            .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '-'))
                            .map_or(rest.len(), |i| i + prefix.len());
                        rest[..end].trim_end_matches('.')
                    })
                    .collect()
            }
            None => rendered
                .match_indices(" minor unit")
                .map(|(end, _)| {
                    let head = &rendered[..end];
                    let start = head
                        .rfind(|c: char| !(c.is_ascii_digit() || c == '-'))
                        .map_or(0, |i| i + 1);
                    let unit = if rendered[end..].starts_with(" minor units") {
                        " minor units"
                    } else {
                        " minor unit"
                    };
                    &rendered[start..end + unit.len()]
                })
                .collect(),
        };
        if candidates
            .iter()
            .any(|text| text.parse::<Money>().as_ref() == Ok(money))
        {
            return Ok(());
        }
        Err(format!(
            "{rendered:?} does not carry {:?} ({money:?}); amounts found: {candidates:?}",
            money.to_string()
        ))
    }
}

fn parse_integer(text: &str) -> Option<i64> {
    let digits = text.strip_prefix('-').unwrap_or(text);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn cur(code: &str) -> Option<Currency> {
        Some(Currency::from_code(code).unwrap())
    }

    #[test]
    fn amounts_carry_their_code_and_decimals() {
        for (amount, code, text) in [
            (100, Some("EUR"), "EUR 1.00"),
            (5, Some("EUR"), "EUR 0.05"),
            (0, Some("EUR"), "EUR 0.00"),
            (-5, Some("EUR"), "EUR -0.05"),
            (100, Some("JPY"), "JPY 100"),
            (1000, Some("KWD"), "KWD 1.000"),
            (1, Some("KWD"), "KWD 0.001"),
            (100, None, "100 minor units"),
            (1, None, "1 minor unit"),
            (i64::MIN, Some("EUR"), "EUR -92233720368547758.08"),
        ] {
            let money = Money::new(amount, code.and_then(cur));
            assert_eq!(money.to_string(), text);
            assert_eq!(text.parse::<Money>().unwrap(), money, "{text}");
        }
    }

    #[test]
    fn codes_come_from_iso_4217() {
        assert_eq!(Currency::from_code("EUR").unwrap().exponent, 2);
        assert_eq!(Currency::from_code("JPY").unwrap().exponent, 0);
        assert_eq!(Currency::from_code("KWD").unwrap().exponent, 3);
        assert_eq!(
            Currency::from_code("eur"),
            Err(MoneyError::UnknownCurrency("eur".into()))
        );
        assert_eq!(
            Currency::from_code("ZZZ"),
            Err(MoneyError::UnknownCurrency("ZZZ".into()))
        );
        assert_eq!(
            Currency::from_code("XAU"),
            Err(MoneyError::NoMinorUnit("XAU".into()))
        );
    }

    proptest::proptest! {
        /// The words the CLI and the demo say a charge, a fee and a
        /// cancellation that lost to delivery with carry the amount with its
        /// code and exactly the currency's decimals (or `minor units`), and
        /// read back to it.
        #[test]
        fn charges_and_fees_read_back(amount in proptest::num::i64::ANY, which in 0usize..4) {
            let currency = testing::currencies().swap_remove(which);
            let money = Money::new(amount, currency);
            for words in [
                charge_words(Some(&money)),
                fee_words(Some(&money)),
                too_late_words(&money),
            ] {
                proptest::prop_assert_eq!(testing::check_rendering(&words, &money), Ok(()));
            }
        }
    }

    #[test]
    fn the_rendering_check_fails_what_it_should() {
        let eur = Money::new(100, cur("EUR"));
        assert!(testing::check_rendering("a charge of EUR 1.00", &eur).is_ok());
        assert!(testing::check_rendering("a charge of EUR 1.0", &eur).is_err());
        assert!(testing::check_rendering("a charge of 100", &eur).is_err());
        assert!(testing::check_rendering("a charge of EUR 1.01", &eur).is_err());
        let none = Money::new(100, None);
        assert!(testing::check_rendering("a charge of 100 minor units", &none).is_ok());
        assert!(testing::check_rendering("a charge of 100", &none).is_err());
        assert_eq!(charge_words(None), "no charge");
        assert_eq!(fee_words(None), "no cancellation fee");
    }

    #[test]
    fn text_that_is_not_an_amount_is_refused() {
        for bad in [
            "EUR 1.0",
            "EUR 1",
            "EUR 1.000",
            "JPY 1.00",
            "EUR",
            "EUR .50",
            "EUR 1,00",
            "1.5 minor units",
            "minor units",
            "EUR +1.00",
            "",
        ] {
            assert!(bad.parse::<Money>().is_err(), "{bad}");
        }
    }
}
