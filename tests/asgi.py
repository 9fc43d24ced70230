"""The streaming ASGI apps driven in this process, for the answers they give before anything
runs behind them: a refused request touches neither the queue nor a worker, so it needs no
Daphne and no Celery."""

from asgiref.sync import async_to_sync
from channels.testing import HttpCommunicator

from inference.gateway.sse import ChatCompletions


def post_chat(body, headers, timeout=60):
    """(status, body) of POST /v1/chat/completions, as ChatCompletions answers it. The timeout
    is generous: the first request of a session loads the model's tokenizer."""
    return async_to_sync(answer)(ChatCompletions(), "POST", "/v1/chat/completions", body, headers, timeout)


async def answer(app, method, path, body, headers, timeout):
    # Content-Length as a client sends it: the app refuses a body too large from it alone.
    sent = {"Content-Length": str(len(body)), **headers}
    communicator = HttpCommunicator(app, method, path, body, [(name.lower().encode(), value.encode()) for name, value in sent.items()])
    response = await communicator.get_response(timeout)
    await communicator.wait(timeout)  # the app has returned: nothing of it runs on after the test
    return response["status"], response["body"]
