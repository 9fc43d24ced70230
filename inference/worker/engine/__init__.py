"""The inference engine: plain Python and torch, nothing of Django, Celery or Redis."""

from inference.protocol.payloads import SamplingParams

from .detokenizer import IncrementalDetokenizer
from .engine import Engine, Output, Request, RequestStatus, Totals, choices

__all__ = ["Engine", "IncrementalDetokenizer", "Output", "Request", "RequestStatus", "SamplingParams", "Totals", "choices"]
