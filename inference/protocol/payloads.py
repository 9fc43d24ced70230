"""What the gateway sends a worker to run one request: the Celery task's arguments, as one type.

The gateway sends it by name (it never imports the worker); the pending row keeps it, should the
request need sending again. On the wire it is the task's keyword arguments, a JSON object.
"""

import dataclasses
from dataclasses import dataclass

GENERATE = "inference.tasks.generate"  # the task's name, as workers register it


@dataclass(frozen=True)
class GenerateTask:
    request_id: str
    model: str
    prompt_ids: list  # the ids the local model reads; empty for an upstream
    params: dict  # SamplingParams' fields, max_tokens included
    received_at: float
    prompt_tokens: int = 0  # as billed: len(prompt_ids), or the upstream's count
    n: int = 1
    tools: bool = False  # parse <tool_call> text into tool-call entries
    upstream_body: dict | None = None  # what the worker sends an upstream model
    api_key_id: int | None = None
    user_id: int | None = None

    def as_kwargs(self):
        return dataclasses.asdict(self)

    @property
    def max_tokens(self):
        return self.params["max_tokens"]
