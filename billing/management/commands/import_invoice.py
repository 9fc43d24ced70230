import csv
import sys
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from billing import invoices


class Command(BaseCommand):
    help = "Import a vendor's usage export (CSV) once, and reconcile it with the ledger."

    def add_arguments(self, parser):
        parser.add_argument("file", type=Path)
        parser.add_argument("--vendor", required=True, help="a vendor of TOKSTREAM_VENDORS")
        parser.add_argument("--report", type=Path, help="write the reconciliation here as CSV ('-' for stdout)")

    def handle(self, *args, file, vendor, report, **options):
        try:
            invoice, created = invoices.import_invoice(vendor, file.name, file.read_bytes())
        except (OSError, invoices.InvoiceError) as exc:
            raise CommandError(f"{file}: {exc}; nothing was imported") from None
        what = "imported" if created else "already imported: nothing changed"
        self.stdout.write(f"invoice {invoice.pk}, {invoice.lines.count()} lines, {what}")
        outcomes = invoices.reconcile(invoice)
        for name, value in sorted(invoices.totals(outcomes).items()):
            self.stdout.write(f"  {name}: {value}")
        if report:
            self.write_report(report, outcomes)

    def write_report(self, path, outcomes):
        out = sys.stdout if str(path) == "-" else open(path, "w", newline="")
        csv.writer(out).writerows(invoices.report_rows(outcomes))
        if out is not sys.stdout:
            out.close()
