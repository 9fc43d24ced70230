"""What other parts of the service may react to, without the lifecycle knowing them.

`request_finished` (not Django's HTTP signal of the same name): a chat completion request has
ended and its ledger row is written. Sent once per request, by whichever process ended it,
with `request_id`, `model` and `finish_reason`. A receiver's failure is logged and does not
undo the end.
"""

from django.dispatch import Signal

request_finished = Signal()
