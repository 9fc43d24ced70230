"""Money as finance reads it: each currency on its own (never added to another), to the
currency's minor unit."""

from decimal import ROUND_HALF_UP, Decimal

# ISO 4217 minor units where they are not 2.
MINOR_UNITS = {"BHD": 3, "CLP": 0, "IQD": 3, "ISK": 0, "JOD": 3, "JPY": 0, "KRW": 0, "KWD": 3, "LYD": 3, "OMR": 3, "TND": 3, "VND": 0}


def rounded(value, currency):
    return Decimal(value).quantize(Decimal(1).scaleb(-MINOR_UNITS.get(currency.upper(), 2)), rounding=ROUND_HALF_UP)


def amount(value, currency):
    """'0.02 USD': to the currency's minor unit."""
    return f"{rounded(value, currency)} {currency}"
