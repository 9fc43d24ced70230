"""The database itself refuses to change a ledger entry or a price sheet.

UPDATE is refused on PostgreSQL and SQLite; DELETE on PostgreSQL (its TRUNCATE, which test
runs use to empty tables, bypasses row triggers; SQLite's empties tables with DELETE).
"""

from django.db import migrations

TABLES = ("billing_usageentry", "billing_pricesheet")
MESSAGE = "ledger entries and price sheets are append-only: add a correcting entry instead"


def postgresql(table):
    return f"""
        CREATE TRIGGER {table}_append_only BEFORE UPDATE OR DELETE ON {table}
        FOR EACH ROW EXECUTE FUNCTION billing_refuse_change();
    """


def sqlite(table):
    return f"CREATE TRIGGER {table}_append_only BEFORE UPDATE ON {table} BEGIN SELECT RAISE(ABORT, '{MESSAGE}'); END;"


def guard(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    if vendor == "postgresql":
        schema_editor.execute(
            "CREATE OR REPLACE FUNCTION billing_refuse_change() RETURNS trigger AS $$ "
            f"BEGIN RAISE EXCEPTION '{MESSAGE}'; END; $$ LANGUAGE plpgsql;"
        )
    for table in TABLES:
        if vendor in ("postgresql", "sqlite"):
            schema_editor.execute(postgresql(table) if vendor == "postgresql" else sqlite(table))


def unguard(apps, schema_editor):
    for table in TABLES:
        on = f" ON {table}" if schema_editor.connection.vendor == "postgresql" else ""
        schema_editor.execute(f"DROP TRIGGER IF EXISTS {table}_append_only{on}")


class Migration(migrations.Migration):
    dependencies = [("billing", "0006_signed_corrections")]
    operations = [migrations.RunPython(guard, unguard)]
