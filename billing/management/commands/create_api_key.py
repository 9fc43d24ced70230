from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from billing.models import ApiKey


class Command(BaseCommand):
    help = "Create an API key and print it; only its hash is stored, so copy it now."

    def add_arguments(self, parser):
        parser.add_argument("--name", required=True)
        parser.add_argument("--user", help="username the key acts for (optional)")

    def handle(self, *args, name, user, **options):
        owner = None
        if user:
            owner = get_user_model().objects.filter(username=user).first()
            if owner is None:
                raise CommandError(f"no user named {user!r}")
        key, raw = ApiKey.issue(name, owner)
        self.stderr.write(f"created key {key.name!r} ({key.prefix}…); it is shown only once:")
        self.stdout.write(raw)
