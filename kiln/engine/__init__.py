"""Decoding: batched KV-cache engine, sampling, MTP speculative decoding, in-flight weight swap."""
from kiln.engine.engine import Engine
from kiln.engine.request import Completion, Request
from kiln.engine.sampling import SamplingParams

__all__ = ["Completion", "Engine", "Request", "SamplingParams"]
