"""A chat page's reply is settled (text, tool calls, steering marks, ending) from its request's
log once the request ends, whichever process ends it: request_finished is sent by the worker as
well as by the web, so this module imports only shared modules (no gateway/, no chat/)."""

from django.dispatch import receiver

from billing.models import UsageEntry
from inference import streamlog
from inference.models import Turn
from inference.protocol import chunks
from inference.protocol.entries import Delta, End, Steer, choice_of
from inference.signals import request_finished

LOST = "The reply's text had expired from the stream log before it was saved."
GONE = "The reply was lost: its request is known neither to the stream log nor to the ledger."


def settle(turn):
    """Fill a streaming reply from its log once the log has its end; True if it did."""
    if not turn.streaming:
        return False
    client = streamlog.sync_client()
    entries = [entry for _, entry in streamlog.read_all(client, turn.request_id)]
    if entries and isinstance(entries[-1], End):
        fill(turn, entries)
    elif not entries and not streamlog.load_meta(client, turn.request_id):
        # Its log and metadata expired (or Redis lost them): whatever happened, it is over.
        ended = UsageEntry.objects.filter(request_id=turn.request_id).exists()
        turn.finish_reason, turn.error = "error", LOST if ended else GONE
    else:
        return False
    turn.save(update_fields=["content", "tool_calls", "steering", "finish_reason", "error"])
    return True


def fill(turn, entries):
    """Choice 0's text, calls and steering marks (the page asks for one choice)."""
    ours = [entry for entry in entries if choice_of(entry) == 0]
    text = []
    for entry in ours:
        if isinstance(entry, Delta):
            text.append(entry.text)
        elif isinstance(entry, Steer) and entry.error is None:
            turn.steering.append({"at": len("".join(text)), "text": entry.text})
    end = entries[-1]
    turn.content = "".join(text)
    turn.tool_calls = chunks.tool_calls(ours)
    turn.finish_reason = end.finish_reasons[0]
    turn.error = end.error or ""


def settle_request(request_id):
    for turn in Turn.objects.filter(request_id=request_id, finish_reason=""):
        settle(turn)


@receiver(request_finished, dispatch_uid="chat-settle-reply")
def settle_reply(sender, request_id, **kwargs):
    """The chat keeps the reply whatever the page does."""
    settle_request(request_id)
