import importlib

from django.db import migrations, models

# SQLite rebuilds a table to alter its columns and drops its triggers with it: the append-only
# guard comes off first and goes back on last, on every database alike.
guarded = importlib.import_module("billing.migrations.0002_ledger_prices_budgets_and_limits")


def nothing_compared_is_unknown(apps, schema_editor):
    """Entries without a vendor's report compared nothing: their counts_differ was a false
    "agree" (the field is outside the entry hash, so the chain stays true)."""
    entries = apps.get_model("billing", "UsageEntry").objects
    entries.filter(vendor_prompt_tokens__isnull=True, vendor_completion_tokens__isnull=True).update(counts_differ=None)


class Migration(migrations.Migration):

    dependencies = [
        ('billing', '0003_invoices_and_vendor_usage'),
    ]

    operations = [
        migrations.RunPython(guarded.unguard, guarded.guard),
        migrations.AddField(
            model_name='usageentry',
            name='counted_prompt_tokens',
            field=models.IntegerField(blank=True, help_text='Our count of the prompt, for a relayed request.', null=True),
        ),
        migrations.AddField(
            model_name='usageentry',
            name='counted_completion_tokens',
            field=models.IntegerField(blank=True, help_text='Our count of the reply, for a relayed request.', null=True),
        ),
        migrations.AlterField(
            model_name='usageentry',
            name='counts_differ',
            field=models.BooleanField(blank=True, db_index=True, default=None, help_text="Whether the vendor's counts differ from ours; empty when nothing was compared (a local model, or no vendor usage).", null=True),
        ),
        migrations.AlterField(
            model_name='usageentry',
            name='usage_source',
            field=models.CharField(default='engine_ids', help_text="How the counts were obtained: engine_ids (the ids our model read and wrote), upstream (the upstream's usage, as its invoice will say), estimate (an upstream that reported none: our count), stream_log, correction.", max_length=20),
        ),
        migrations.RunPython(nothing_compared_is_unknown, migrations.RunPython.noop),
        migrations.RunPython(guarded.guard, guarded.unguard),
    ]
