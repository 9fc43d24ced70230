from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from billing.models import SCOPES, ApiKey


class Command(BaseCommand):
    help = "Create an API key and print it; only its hash is stored, so copy it now."

    def add_arguments(self, parser):
        parser.add_argument("--name", required=True)
        parser.add_argument("--user", help="username the key acts for (optional)")
        parser.add_argument("--scopes", default="chat", help='space-separated: chat, ledger:read, ledger:read:all (default "chat")')

    def handle(self, *args, name, user, scopes, **options):
        owner = None
        if user:
            owner = get_user_model().objects.filter(username=user).first()
            if owner is None:
                raise CommandError(f"no user named {user!r}")
        unknown = set(scopes.split()) - SCOPES
        if unknown:
            raise CommandError(f"unknown scopes: {' '.join(sorted(unknown))}")
        key, raw = ApiKey.issue(name, owner, scopes=scopes)
        self.stderr.write(f"created key {key.name!r} ({key.prefix}…); it is shown only once:")
        self.stdout.write(raw)
