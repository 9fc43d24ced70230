"""A request-level engine in the shape of vLLM v1: waiting queue, running set, step().

One step admits waiting requests, applies cancellations, advances every running request by
one token (a prefill for a request that just joined), and emits one Output per request that
produced text or finished. Forward passes go through a runner, so tests can script the model.
"""

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from .detokenizer import IncrementalDetokenizer
from .sampling import SamplingParams, make_generator, sample

log = logging.getLogger(__name__)

class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    prefilled: int = 0  # prompt tokens the model has consumed
    finish_reason: str | None = None
    error: str | None = None
    started_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    state: object = None  # the runner's per-sequence cache
    detokenizer: IncrementalDetokenizer | None = None
    generator: object = None


@dataclass
class Output:
    request_id: str
    text: str
    completion_tokens: int
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None


class Engine:
    def __init__(self, runner, tokenizer, stop_ids, context_length, max_running=8, clock=time.time):
        self.runner = runner
        self.tokenizer = tokenizer
        self.stop_ids = frozenset(stop_ids)
        self.context_length = context_length
        self.max_running = max_running
        self.clock = clock
        self.waiting = deque()
        self.running = []
        self._cancelled = set()
        self._lock = threading.Lock()

    def add(self, request):
        with self._lock:
            self.waiting.append(request)

    def cancel(self, request_id):
        """Takes effect at the next step boundary."""
        with self._lock:
            self._cancelled.add(request_id)

    def has_work(self):
        return bool(self.waiting or self.running)

    def live_ids(self):
        """Ids of the requests waiting or running, safe to call from another thread."""
        with self._lock:
            return [r.request_id for r in (*self.waiting, *self.running)]

    def step(self):
        self._admit()
        outputs = self._apply_cancels()
        outputs += [self._advance_or_fail(request) for request in self.running]
        self._drop_finished()
        return [o for o in outputs if o.text or o.finished]

    def fail_all(self, message):
        """Something outside one request failed: end every live one rather than hang them."""
        with self._lock:
            failed, self.waiting = [*self.running, *self.waiting], deque()
        self.running = []
        return [self._finish(r, "error", error=message) for r in failed]

    def _admit(self):
        with self._lock:
            while self.waiting and len(self.running) < self.max_running:
                request = self.waiting.popleft()
                request.status = RequestStatus.RUNNING
                request.started_at = self.clock()
                request.detokenizer = IncrementalDetokenizer(self.tokenizer, request.params.stop)
                request.generator = make_generator(request.params.seed, self.runner.device)
                self.running.append(request)

    def _apply_cancels(self):
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
            # A cancel for a request still waiting is kept until it is admitted.
            self._cancelled |= cancelled & {r.request_id for r in self.waiting}
        outputs = [self._finish(r, "cancelled") for r in self.running if r.request_id in cancelled]
        self._drop_finished()
        return outputs

    def _drop_finished(self):
        self.running = [r for r in self.running if r.status is not RequestStatus.FINISHED]

    def _advance_or_fail(self, request):
        try:
            return self._advance(request)
        except Exception as exc:  # one request's failure ends that request, not its neighbours
            log.exception("request %s failed", request.request_id)
            return self._finish(request, "error", error=f"generation failed: {exc}")

    def _advance(self, request):
        if request.state is None:
            logits, request.state = self.runner.prefill(request.prompt_ids)
            request.prefilled = len(request.prompt_ids)
        else:
            logits = self.runner.decode(request.output_ids[-1], request.state)
        token = sample(logits, request.params, request.generator)
        request.output_ids.append(token)
        if request.first_token_at is None:
            request.first_token_at = self.clock()
        return self._update(request, token)

    def _update(self, request, token):
        if token in self.stop_ids:
            return self._finish(request, "stop")
        text = request.detokenizer.add(token)
        if request.detokenizer.stopped:
            return self._finish(request, "stop", text)
        if self._out_of_room(request):
            return self._finish(request, "length", text)
        return self._output(request, text)

    def _out_of_room(self, request):
        produced = len(request.output_ids)
        return produced >= request.params.max_tokens or len(request.prompt_ids) + produced >= self.context_length

    def _finish(self, request, reason, text="", error=None):
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.error = error
        request.finished_at = self.clock()
        request.state = None  # frees the KV cache
        if request.detokenizer is not None:
            text += request.detokenizer.flush()
        output = self._output(request, text)
        output.finished, output.finish_reason, output.error = True, reason, error
        return output

    def _output(self, request, text):
        return Output(request.request_id, text, len(request.output_ids))
