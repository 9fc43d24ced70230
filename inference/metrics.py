"""Prometheus metrics that every web process and worker share through Redis.

Workers add each finished request's timings and counts to one Redis hash (histogram buckets
are plain counters); the gauges come from the workers' heartbeats. GET /metrics reads both and
renders them with prometheus_client, so any web process answers for the whole service.
"""

import json
import math

from django.conf import settings
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from inference import streamlog

HISTOGRAMS = {
    "queue_time_seconds": ("Time from arrival to a worker taking the request.", (0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60)),
    "time_to_first_token_seconds": ("Time from arrival to the first token.", (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)),
    "inter_token_latency_seconds": ("Time between a request's successive outputs.", (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)),
    "e2e_request_latency_seconds": ("Time from arrival to the end of the request.", (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)),
}
DRAFT_COUNTERS = {
    "draft_tokens": "Prompt-lookup draft tokens the model verified.",
    "draft_tokens_kept": "Draft tokens the model agreed with: divided by draft_tokens, the acceptance rate.",
}
COUNTERS = {
    "prompt_tokens": "Prompt tokens the model consumed (steering included).",
    "completion_tokens": "Tokens the model produced.",
    **DRAFT_COUNTERS,
}


def metrics_key():
    return f"{settings.TOKSTREAM_REDIS_PREFIX}:metrics"


def field(*parts):
    return json.dumps(parts)


def observe(pipe, name, model, values):
    """Count observations into the histogram's buckets (cumulative, as Prometheus wants), one
    command per bucket however many there are."""
    for bound in (*HISTOGRAMS[name][1], math.inf):
        count = sum(value <= bound for value in values)
        if count:
            pipe.hincrby(metrics_key(), field(name, model, "bucket", bound), count)
    pipe.hincrbyfloat(metrics_key(), field(name, model, "sum"), sum(values))
    pipe.hincrby(metrics_key(), field(name, model, "count"), len(values))


def record_request(client, model, outcome, timings, gaps, prompt_tokens, completion_tokens):
    """One finished request: `timings` maps histogram names to seconds (None: did not happen)."""
    with client.pipeline(transaction=False) as pipe:
        for name, value in timings.items():
            if value is not None:
                observe(pipe, name, model, [max(value, 0.0)])
        if gaps:
            observe(pipe, "inter_token_latency_seconds", model, gaps)
        pipe.hincrby(metrics_key(), field("prompt_tokens", model), prompt_tokens)
        pipe.hincrby(metrics_key(), field("completion_tokens", model), completion_tokens)
        pipe.hincrby(metrics_key(), field("requests", model, outcome), 1)
        pipe.execute()


def add_counts(client, model, counts):
    with client.pipeline(transaction=False) as pipe:
        for name, count in counts.items():
            pipe.hincrby(metrics_key(), field(name, model), count)
        pipe.execute()


class SharedCollector:
    def __init__(self, stored, beats):
        self.stored = {tuple(json.loads(k)): float(v) for k, v in stored.items()}
        self.beats = beats

    def collect(self):
        yield from self.histograms()
        yield from self.counters()
        yield from self.gauges()

    def models(self, name):
        return sorted({key[1] for key in self.stored if key[0] == name})

    def histograms(self):
        for name, (doc, bounds) in HISTOGRAMS.items():
            family = HistogramMetricFamily(f"tokstream_{name}", doc, labels=["model"])
            for model in self.models(name):
                buckets = [(str(b), self.stored.get((name, model, "bucket", b), 0)) for b in bounds]
                buckets.append(("+Inf", self.stored.get((name, model, "bucket", math.inf), 0)))
                family.add_metric([model], buckets, self.stored.get((name, model, "sum"), 0))
            yield family

    def counters(self):
        for name, doc in COUNTERS.items():
            family = CounterMetricFamily(f"tokstream_{name}", doc, labels=["model"])
            for model in self.models(name):
                family.add_metric([model], self.stored[(name, model)])
            yield family
        family = CounterMetricFamily("tokstream_requests", "Requests by how they ended.", labels=["model", "outcome"])
        for key, value in sorted(self.stored.items()):
            if key[0] == "requests":
                family.add_metric([key[1], key[2]], value)
        yield family

    def gauges(self):
        running = GaugeMetricFamily("tokstream_requests_running", "Sequences decoding now.", labels=["model"])
        waiting = GaugeMetricFamily("tokstream_requests_waiting", "Requests a worker holds but has not started.", labels=["model"])
        for model, (now_running, now_waiting) in sorted(engine_load(self.beats).items()):
            running.add_metric([model], now_running)
            waiting.add_metric([model], now_waiting)
        yield running
        yield waiting


def engine_load(beats):
    """Model -> (running, waiting), summed over the live workers' heartbeats."""
    load = {}
    for beat in streamlog.live_beats(beats):
        running, waiting = load.get(beat.model, (0, 0))
        load[beat.model] = (running + beat.running, waiting + beat.waiting)
    return load


def render(client):
    registry = CollectorRegistry()
    registry.register(SharedCollector(client.hgetall(metrics_key()), streamlog.workers(client)))
    return generate_latest(registry)
