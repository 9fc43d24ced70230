from django.urls import path

from billing import api

urlpatterns = [
    path("api/ledger/entries/", api.Entries.as_view(), name="ledger-entries"),
    path("api/ledger/daily/", api.Daily.as_view(), name="ledger-daily"),
]
