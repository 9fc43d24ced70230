"""One engine per model and device per worker process, each driven by its own thread.

Celery tasks submit requests and read their outputs from a queue; the thread steps the engine
whenever there is work, reads the cancel and steering flags in Redis every SIGNAL_SECONDS (and
before any waiting prompt is computed), and beats (inference/worker/beats.py) between steps so
/healthz and the readers can tell that a worker has its model loaded.
"""

import ctypes
import logging
import queue
import threading
import time

from django.conf import settings

from inference import backends, metrics, registry, streamlog
from inference.protocol.payloads import Status
from inference.worker.beats import STOPPED, UpstreamBeat, beat, beat_interval, worker_id
from inference.worker.engine import Engine, Request, SamplingParams, choices, cpu_ops, loader
from inference.worker.engine.llama import LlamaRunner, drop_model_matrices

log = logging.getLogger(__name__)
_loops = {}
LOST_CLAIM = "The request was taken from this worker (its state was lost or it was ended elsewhere)."
_loops_lock = threading.Lock()
_load_lock = threading.Lock()  # transformers' loading is not thread-safe (it patches module globals)
# How often the loop reads the cancel and steering flags: a Redis round trip every step cost
# 2-4% of a CPU step (more on a GPU), and a cancel 50 ms late frees its slot soon enough.
SIGNAL_SECONDS = 0.05
RETRY_SECONDS = 1  # after a failed iteration (Redis away): try again soon, without spinning


class EngineLoop(threading.Thread):
    """Loads its model and steps its engine on this one thread. torch's OpenMP (libgomp) keeps
    a team of threads for every thread that ever ran a parallel operation, and once it manages
    more threads than there are cores it spins only briefly between operations: each of a
    step's hundreds of operations then waits for its team to wake (a step on another thread
    than the loader's took ×1.3–1.5 as long; bench/threads.py)."""

    def __init__(self, name, device, redis_client):
        super().__init__(daemon=True, name=f"engine-{name}-{device}")
        self.name_of_model, self.device = name, device
        self.model = self.engine = None
        self.loaded = threading.Event()
        self.failure = None  # why the model could not be loaded
        self.redis = redis_client
        self.worker_id = worker_id(device)
        self.last_beat = self.last_signals = 0.0
        self.reported = {}  # draft counts already added to the metrics
        self.sinks = {}
        self.claimed = set()  # request ids this worker claimed: they must stay claimed to run
        self.claims_lock = threading.Lock()  # task threads submit while the loop prunes
        self.wake = threading.Event()
        self.stopping = threading.Event()

    def load(self):
        """Sequences submitted here and not finished: the least loaded engine takes the next."""
        return len(self.sinks)

    def stop(self):
        self.stopping.set()
        self.wake.set()

    def submit(self, request_id, prompt_ids, params, n=1, claimed=False, sink=None):
        """Queue the `n` choices of one request; their outputs go, in order, to one sink (the
        engine's Requests stay its own: callers read Outputs): by default an Outbox, returned,
        for the caller to read; or a sink that turns them into log entries (local.RequestLog).
        A `claimed` request is stopped should its claim be lost (see apply_signals)."""
        requests = choices(request_id, prompt_ids, params, n)
        if any(request.request_id in self.sinks for request in requests):
            raise ValueError(f"request {request_id} is already running here")
        sink = sink or Outbox()
        for request in requests:
            self.sinks[request.request_id] = sink
        with self.claims_lock:
            if claimed:
                self.claimed.add(requests[0].group)
            self.engine.add(*requests)
        self.wake.set()
        return sink

    def wait_loaded(self):
        """Wait until the started thread's engine is ready; raises what loading raised."""
        self.loaded.wait()
        if self.failure is not None:
            raise self.failure

    def run(self):
        try:
            with _load_lock:  # one at a time: this also keeps the weight formats' timings apart
                self.model = load(self.name_of_model, self.device)
                self.engine = build_engine(self.model)
        except BaseException as exc:  # handed to the thread that waits for the load
            self.failure = exc
            return
        finally:
            self.loaded.set()
        while not self.stopping.is_set():
            try:
                self.run_once()
            except Exception:  # Redis went away, say: the loop must outlive it
                log.exception("engine loop iteration failed")
                time.sleep(RETRY_SECONDS)

    def run_once(self):
        self.heartbeat()
        if not self.engine.has_work():
            self.wake.wait(timeout=beat_interval())
            self.wake.clear()
            return
        if self.engine.load()[1] or time.monotonic() - self.last_signals >= SIGNAL_SECONDS:  # a cancelled prompt is never computed
            self.last_signals = time.monotonic()
            self.apply_signals()
        self.deliver(self.step())

    def heartbeat(self):
        if not STOPPED.is_set() and time.monotonic() - self.last_beat >= beat_interval():
            beat(self.redis, self.worker_id, self.model.name, *self.engine.load())
            self.last_beat = time.monotonic()
            self.report_drafts()

    def report_drafts(self):
        """The engine's draft counts since the last report: a step is too often to write them."""
        counts = {name: self.engine.stats[name] for name in metrics.DRAFT_COUNTERS}
        new = {name: counts[name] - self.reported.get(name, 0) for name in counts}
        if any(new.values()):
            metrics.add_counts(self.redis, self.model.name, new)
        self.reported = counts

    def apply_signals(self):
        # Waiting requests too: one whose client left while it queued is never prefilled.
        with self.claims_lock:
            live = self.engine.live_ids()
            self.claimed &= set(live)
            claimed = list(self.claimed)
        cancelled, steering, states = streamlog.signals_among(self.redis, live)
        for request_id in claimed:
            status = Status.from_redis(states.get(request_id))
            if status is None or status.holder() != self.worker_id:
                # Ended by a reader that thought this worker dead, or lost with Redis: nobody
                # reads on, and another ending is already written or on its way. Told first
                # (the first reason given stands): a client told of the loss leaves, and its
                # leaving sets a cancel flag, but the request failed.
                self.engine.cancel(request_id, error=LOST_CLAIM)
        for request_id in cancelled:
            self.engine.cancel(request_id)
        for request_id, texts in steering.items():
            for text in texts:
                self.engine.steer(request_id, text)

    def step(self):
        try:
            return self.engine.step()
        except Exception as exc:  # outside the forward pass (which the engine handles itself)
            log.exception("engine step failed")
            return self.engine.fail_all(f"generation failed: {exc}")

    def deliver(self, outputs):
        """Each output to its sink, and the step's log entries of every request to Redis in one
        round trip; each sink is told once they are written (or why they were not)."""
        entries = {}  # sink -> its entries of this step
        for output in outputs:
            sink = self.sinks.get(output.request_id)
            if output.finished:
                self.sinks.pop(output.request_id, None)
            if sink is None:
                continue
            found = entries.setdefault(sink, [])  # told `written` even if its entries fail
            try:
                found.extend(sink.take(output))
            except Exception as exc:  # one request's entries could not be made: it alone fails
                log.exception("the outputs of %s could not be logged", output.request_id)
                self.engine.cancel(sink.request_id, error=sink.failed(exc))
        self.write(entries)
        for sink in entries:
            sink.written()

    def write(self, entries):
        logs = {sink: found for sink, found in entries.items() if found}
        if not logs:
            return
        try:
            errors = streamlog.append_each(self.redis, [(sink.request_id, found, sink.push_expiry()) for sink, found in logs.items()])
        except Exception as exc:  # Redis away: every request written to fails
            log.exception("the stream logs could not be written")
            errors = [exc] * len(logs)
        for sink, error in zip(logs, errors):
            if error is not None:  # see RequestLog.failed
                self.engine.cancel(sink.request_id, error=sink.failed(error))


class Outbox(queue.Queue):
    """A sink whose caller reads the outputs itself, as they come."""

    def take(self, output):
        self.put(output)
        return []

    def written(self):
        pass


def engine_for(lm):
    """The engine a worker runs for `lm`, before the worker frees the model's own matrices."""
    return Engine.for_model(
        lm,
        registry.kv_cache_tokens(lm.name),  # as admission counts them
        max_running=settings.TOKSTREAM_MAX_RUNNING,
        step_tokens=settings.TOKSTREAM_STEP_TOKENS,
        weights=settings.TOKSTREAM_WEIGHTS,
        formats_file=formats_file(lm),
        kv_dtype=settings.TOKSTREAM_KV_DTYPE,
        compile=settings.TOKSTREAM_COMPILE,
        compile_cache=settings.CACHE_DIR / "compiled",
        tells_places=True,  # the chat page shows them
    )


def build_engine(lm):
    engine = engine_for(lm)
    if isinstance(engine.runner, LlamaRunner):
        drop_model_matrices(lm.model, engine.runner.weights)
    warm_up(engine)
    give_back_freed_memory()
    return engine


def give_back_freed_memory():
    """Laying the weights out frees hundreds of megabytes of temporaries that glibc's malloc
    would otherwise keep mapped (resident) for good."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def formats_file(lm):
    """Where `auto` keeps what it measured for this model on this machine's device."""
    return settings.CACHE_DIR / "weights" / f"{lm.name}-{str(lm.device).replace(':', '-')}.json"


def warm_up(engine):
    """The first forward pass is slow; let it not be a user's."""
    engine.add(Request("warm-up", engine.tokenizer.encode("warm up"), SamplingParams(max_tokens=2, temperature=0)))
    while engine.has_work():
        engine.step()


def start_loops(name):
    """One engine per device (every GPU, with TOKSTREAM_DEVICE=auto): a model small enough
    for one GPU serves from all of them."""
    engine = backends.of(name).engine
    if engine is None:
        upstream_beat = UpstreamBeat(name, streamlog.sync_client())
        upstream_beat.start()
        return [upstream_beat]
    loops = []
    for device in ["cpu"] if engine == "echo" else devices():
        loops.append(EngineLoop(name, device, streamlog.sync_client()))
        loops[-1].start()
    for loop in loops:
        loop.wait_loaded()
        log.info("model %s loaded on %s", name, loop.device)
    return loops


def devices():
    return loader.pick_devices(settings.TOKSTREAM_DEVICE)


def load(name, device=None):
    """The model on `device` (by default the first of TOKSTREAM_DEVICE's)."""
    if backends.of(name).engine == "echo":
        step_seconds = registry.entry(name).get("step_ms", 0) / 1000
        return loader.load_echo(name, registry.folder(name), step_seconds)
    lm = loader.load(name, registry.folder(name), device or devices()[0], settings.TOKSTREAM_DTYPE)
    if lm.device.type == "cpu":  # built before any weights are laid out: the int8 format computes with them
        cpu_ops.available(settings.CACHE_DIR / "compiled")
    return lm


def engine_loop(name):
    """The least loaded of the model's engines, started on first use (or at worker start-up)."""
    with _loops_lock:
        if name not in _loops:
            _loops[name] = start_loops(name)
        return min(_loops[name], key=lambda loop: loop.load())


def serves(model):
    """This process has started the engines (or relay) of `model`."""
    return model in _loops
