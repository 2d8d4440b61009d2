"""Prompts: Jinja templates (strict: a missing variable is an error, never an empty string)."""
from __future__ import annotations

import functools
import json
import os

import jinja2

_DIR = os.path.join(os.path.dirname(__file__), "prompts")


@functools.lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(_DIR), undefined=jinja2.StrictUndefined,
                             autoescape=False)
    env.filters["json"] = json.dumps  # unlike `tojson`: keeps key order, no HTML escaping
    return env


def render(name: str, **variables) -> str:
    """Render `prompts/<name>.j2`; raises jinja2.UndefinedError if a variable is missing."""
    return _env().get_template(f"{name}.j2").render(**variables).strip()


SUMMARY_WORDS = 300  # the self-summary's length limit, as the request states it


def summary_request() -> str:
    """The user message that asks the model for its self-summary."""
    return render("summarize", max_words=SUMMARY_WORDS)
