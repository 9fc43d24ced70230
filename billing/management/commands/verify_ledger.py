from django.core.management.base import BaseCommand, CommandError

from billing import ledger


class Command(BaseCommand):
    help = "Walk the ledger's hash chain; name the first entry whose content or link does not match."

    def handle(self, *args, **options):
        checked, broken = ledger.verify()
        if broken is not None:
            raise CommandError(f"entry {broken.pk} ({broken.request_id}) does not match the chain after {checked} good entries")
        self.stdout.write(f"ledger verified: {checked} entries")
