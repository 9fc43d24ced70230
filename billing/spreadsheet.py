"""CSV cells that a spreadsheet opens as data, never as a formula (OWASP's CSV injection advice).

Text that reaches our CSV files comes from outside: an upstream's chunk id, a vendor's invoice,
a correction reason typed by staff. A cell that begins with `=`, `+`, `-` or `@` (or a tab or
carriage return, which some spreadsheets skip before reading one of those) is a formula to Excel
and LibreOffice; a leading `'` makes it text, and the spreadsheet does not show the quote.
"""

import re

FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
# A signed count or amount: a spreadsheet reads it as a number, so it is no formula, and a
# reversal's -12 or an API's "-0.000120000" (DRF sends decimals as text) must stay a number.
NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def safe_cell(value):
    """The value to write in a CSV cell: text that a spreadsheet would run gets a leading `'`."""
    if isinstance(value, str) and value.startswith(FORMULA_STARTS) and not NUMBER.fullmatch(value):
        return f"'{value}"
    return value
