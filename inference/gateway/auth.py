"""Who is asking: the bearer key of `Authorization: Bearer KEY`, as the owner of a request.
The ledger's REST API has its own DRF authentication (billing/api.py): a key there reads
the ledger, it does not chat."""

from billing.models import ApiKey
from inference.gateway.admission import Owner
from inference.protocol.errors import forbidden, unauthorized


def key_owner(authorization):
    """The owner of the live key the header names, or None when it names none; a key without
    the chat scope is refused."""
    key = ApiKey.from_authorization(authorization)
    if key is None:
        return None
    if not key.has_scope("chat"):
        raise forbidden("chat")
    return Owner.of_key(key)


def required_owner(authorization):
    owner = key_owner(authorization)
    if owner is None:
        raise unauthorized()
    return owner
