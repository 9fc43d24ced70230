"""The first-cut ledger and API keys, in the database."""

from datetime import UTC, datetime

import pytest
from django.core.management import call_command

from billing import ledger
from billing.models import KEY_PREFIX, ApiKey, AppendOnlyError, UsageEntry

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def record(request_id="chatcmpl-1", reason="stop", completion_tokens=7, **extra):
    return ledger.record(
        request_id, reason, model="smollm2-135m-instruct", tokenizer="smollm2:abc", prompt_tokens=11,
        completion_tokens=completion_tokens, received_at=NOW, finished_at=NOW, **extra,
    )  # fmt: skip


@pytest.mark.django_db
def test_it_writes_one_entry_per_request_however_often_it_is_recorded():
    first = record()
    again = record(completion_tokens=99)
    assert again.pk == first.pk
    assert UsageEntry.objects.get().completion_tokens == 7


@pytest.mark.django_db
@pytest.mark.parametrize("reason,status", [("stop", "completed"), ("length", "length"), ("cancelled", "cancelled"), ("error", "failed")])
def test_the_status_follows_the_finish_reason(reason, status):
    assert record(reason=reason).status == status


@pytest.mark.django_db
def test_entries_are_never_changed_or_deleted():
    entry = record()
    entry.completion_tokens = 1
    with pytest.raises(AppendOnlyError):
        entry.save()
    with pytest.raises(AppendOnlyError):
        entry.delete()
    assert UsageEntry.objects.get().completion_tokens == 7


@pytest.mark.django_db
def test_the_admin_shows_the_ledger_read_only(admin_client):
    entry = record()
    listing = admin_client.get("/admin/billing/usageentry/")
    assert listing.status_code == 200 and entry.request_id in listing.content.decode()
    change_url = f"/admin/billing/usageentry/{entry.pk}/change/"
    assert 'type="submit"' not in admin_client.get(change_url).content.decode().split('id="content"')[1]
    assert admin_client.post(change_url, {"completion_tokens": 1}).status_code == 403
    assert admin_client.get(f"/admin/billing/usageentry/{entry.pk}/delete/").status_code == 403
    assert UsageEntry.objects.get().completion_tokens == 7


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
