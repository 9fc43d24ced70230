"""API keys: made by a command or the admin, shown once, stored hashed, revocable."""

from datetime import UTC, datetime

import pytest
from django.core.management import call_command

from billing.models import KEY_PREFIX, ApiKey

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


@pytest.mark.django_db
def test_create_api_key_prints_a_key_that_authenticates(capsys):
    call_command("create_api_key", "--name", "laptop")
    raw = capsys.readouterr().out.strip().splitlines()[-1]
    key = ApiKey.authenticate(raw)
    assert key is not None and key.name == "laptop"
    assert raw not in key.key_hash and key.prefix == raw[:12]
    key.revoked_at = NOW
    key.save()
    assert ApiKey.authenticate(raw) is None


@pytest.mark.django_db
def test_the_admin_creates_a_key_and_shows_it_once(admin_client):
    response = admin_client.post("/admin/billing/apikey/add/", {"name": "ci", "scopes": "chat"}, follow=True)
    shown = [str(m) for m in response.context["messages"] if KEY_PREFIX in str(m)]
    raw = shown[0].split("The new key is ")[1].split(" ")[0]
    key = ApiKey.authenticate(raw)
    assert key.name == "ci" and raw not in admin_client.get(f"/admin/billing/apikey/{key.pk}/change/").content.decode()
    admin_client.post("/admin/billing/apikey/add/", {"name": "second", "scopes": "chat"})
    assert ApiKey.objects.count() == 2  # each add makes its own secret
