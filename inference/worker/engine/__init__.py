"""The inference engine: plain Python and torch, nothing of Django, Celery or Redis."""

from .detokenizer import IncrementalDetokenizer
from .engine import Engine, Output, Request, RequestStatus, choices
from .sampling import SamplingParams

__all__ = ["Engine", "IncrementalDetokenizer", "Output", "Request", "RequestStatus", "SamplingParams", "choices"]
