"""The chat page keeps a reply whatever the page does: when its request ends, the reply is settled."""

from django.dispatch import receiver

from inference.chat.conversations import settle_request
from inference.signals import request_finished


@receiver(request_finished, dispatch_uid="chat-settle-reply")
def settle_reply(sender, request_id, **kwargs):
    settle_request(request_id)
