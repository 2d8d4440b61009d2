"""SWE-bench environments: each row's tests run against its repository's own dependencies, not kiln's.

An install spec per repository and version (SPECS, a small table for the common repositories; a user's
own table merges over it: `kiln tasks import-swebench --specs FILE`):

    python    the Python the tests need; the environment is the Debian release whose python3 is nearest
              (env_images.PYTHON: 3.8-3.9 bullseye, 3.10-3.11 bookworm, 3.12+ trixie), so Python comes
              from the Debian base, never from another download
    apt       Debian packages (one layer)
    pip       pip pins (one layer; bullseye and bookworm bases also ship pytest from Debian, which a
              `pytest==` pin replaces)
    install   the repository's own install, run in it at WORKDIR (/testbed, as SWE-bench's images) after
              it is copied in: the task's own layer; e.g. `python -m pip install -e .`
    env       environment variables for the build and the tests (e.g. SETUPTOOLS_SCM_PRETEND_VERSION)

`dockerfile(spec)` writes it as a Dockerfile and env_build builds it as any task environment: each
layer once, keyed by its instruction and its parent, so every row of one repository and version shares
the Python, apt and pip layers, and only the copy of the repository and its install are the task's own.
The network is there while a layer builds (PyPI, the Debian mirror), never when tests run.

The table follows SWE-bench's harness specs in spirit (same Python minor versions and the pins that
matter), without reading the repository's requirements files at `environment_setup_commit`: the pins
here are what a row's tests were written against. A row whose repository and version are not in the
table runs on the host root, in kiln's own environment, as before.
"""
from __future__ import annotations

import json
import os
import shlex
import tomllib
from dataclasses import dataclass, field

from . import env_images
from .record import TaskError

WORKDIR = "/testbed"  # where SWE-bench's images keep the repository


@dataclass(frozen=True)
class EnvSpec:
    python: str
    pip: tuple[str, ...] = ()
    apt: tuple[str, ...] = ()
    install: str = ""
    env: dict = field(default_factory=dict)

    @property
    def suite(self) -> str:
        minor = int(self.python.split(".")[1])
        return env_images.PYTHON.get(minor, "trixie" if minor >= 12 else "bullseye")

    def to_dict(self) -> dict:
        return {"python": self.python, "pip": list(self.pip), "apt": list(self.apt), "install": self.install,
                "env": dict(self.env)}


_EDITABLE = "python -m pip install -e ."
_PYTEST7 = "pytest==7.4.4"
# Flask's own setup.cfg turns warnings into errors, so Werkzeug must be of the row's time: a later one's
# deprecation warnings fail its tests (Werkzeug 2.3.7 under Flask 2.0.3: url_parse is deprecated).
_FLASK_20 = ("setuptools==70.0.0", "Werkzeug==2.0.3", "Jinja2==3.0.3", "itsdangerous==2.0.1", "click==8.0.4",
             "MarkupSafe==2.0.1", _PYTEST7)
_FLASK_2X = {v: ("setuptools==70.0.0", f"Werkzeug=={w}", "Jinja2==3.1.2", "itsdangerous==2.1.2", "click==8.1.3",
                 "MarkupSafe==2.1.1", _PYTEST7) for v, w in (("2.1", "2.1.2"), ("2.2", "2.2.3"), ("2.3", "2.3.7"))}
_PYTEST_DEPS = {"5": ("py==1.11.0", "packaging==23.1", "attrs==23.1.0", "more-itertools==10.1.0", "pluggy==0.13.1",
                      "wcwidth==0.2.6", "setuptools==70.0.0", "setuptools_scm==7.1.0", "wheel"),
                "6": ("py==1.11.0", "packaging==23.1", "attrs==23.1.0", "iniconfig==2.0.0", "pluggy==0.13.1",
                      "toml==0.10.2", "setuptools==70.0.0", "setuptools_scm==7.1.0", "wheel"),
                "7": ("py==1.11.0", "packaging==23.1", "attrs==23.1.0", "iniconfig==2.0.0", "pluggy==1.0.0",
                      "tomli==2.0.1", "exceptiongroup==1.1.3", "setuptools==70.0.0", "setuptools_scm==7.1.0",
                      "wheel"),
                "8": ("packaging==23.1", "iniconfig==2.0.0", "pluggy==1.3.0", "tomli==2.0.1", "exceptiongroup==1.1.3",
                      "setuptools==70.0.0", "setuptools_scm==8.0.4", "wheel")}


def _table() -> dict[str, dict[str, EnvSpec]]:
    t: dict[str, dict[str, EnvSpec]] = {}
    t["pallets/flask"] = {"2.0": EnvSpec("3.9", _FLASK_20, install=_EDITABLE),
                          **{v: EnvSpec("3.11", pins, install=_EDITABLE) for v, pins in _FLASK_2X.items()}}
    t["psf/requests"] = {v: EnvSpec("3.9", ("setuptools==70.0.0", "wheel", _PYTEST7, "pytest-httpbin==2.0.0"),
                                    install="python -m pip install .")
                         for v in ("2.0", "2.2", "2.3", "2.4", "2.5", "2.7", "2.8", "2.9", "2.10", "2.12", "2.17",
                                   "2.18", "2.19", "2.22", "2.25", "2.26", "2.27", "3.0")}
    t["pytest-dev/pytest"] = {
        v: EnvSpec("3.9", (*_PYTEST_DEPS[v.split(".")[0]], "hypothesis==6.82.0", "xmlschema==2.4.0",
                           "nose==1.3.7" if v < "8" else "mock==5.1.0"),
                   install=_EDITABLE, env={"SETUPTOOLS_SCM_PRETEND_VERSION": f"{v}.0"})
        for v in ("5.4", "6.0", "6.2", "6.3", "7.0", "7.1", "7.2", "7.4", "8.0")}
    t["sympy/sympy"] = {v: EnvSpec("3.9", ("mpmath==1.3.0", "setuptools==70.0.0", _PYTEST7), install=_EDITABLE)
                        for v in ("1.0", "1.1", "1.2", "1.4", "1.5", "1.6", "1.7", "1.8", "1.9", "1.10", "1.11",
                                  "1.12", "1.13")}
    return t


SPECS = _table()


def spec_from_dict(d: dict, where: str) -> EnvSpec:
    known = {"python", "pip", "apt", "install", "env"}
    unknown = sorted(set(d) - known)
    if unknown or not isinstance(d.get("python"), str) or not d["python"].startswith("3."):
        raise TaskError(f"{where}: an install spec is a table of python = \"3.X\" (required), pip, apt, install, "
                        f"env{f'; unknown key(s) {unknown}' if unknown else ''}")
    try:
        int(d["python"].split(".")[1])
        return EnvSpec(d["python"], tuple(map(str, d.get("pip", ()))), tuple(map(str, d.get("apt", ()))),
                       str(d.get("install", "")), {str(k): str(v) for k, v in d.get("env", {}).items()})
    except (ValueError, IndexError, AttributeError, TypeError) as e:
        raise TaskError(f"{where}: not an install spec: {e}") from None


def load_specs(path: str) -> dict[str, dict[str, EnvSpec]]:
    """A user's table, TOML (`["owner/name"."1.2"]` tables) or JSON ({repo: {version: spec}})."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
        data = json.loads(raw) if path.endswith(".json") else tomllib.loads(raw.decode())
    except (OSError, ValueError) as e:  # JSONDecodeError and TOMLDecodeError are ValueErrors
        raise TaskError(f"{path}: cannot read install specs: {e}") from None
    if not isinstance(data, dict):
        raise TaskError(f"{path}: install specs are a table of repositories")
    return {repo: {ver: spec_from_dict(s, f"{path}: {repo} {ver}") for ver, s in versions.items()}
            for repo, versions in data.items()}


def spec_for(repo: str, version, specs: dict | None = None) -> EnvSpec | None:
    """The install spec for a row's repository and version: `specs` (a user's) first, then kiln's."""
    version = str(version or "")
    for table in (specs or {}, SPECS):
        spec = table.get(repo, {}).get(version)
        if spec is not None:
            return spec if isinstance(spec, EnvSpec) else spec_from_dict(spec, f"{repo} {version}")
    return None


def dockerfile(spec: EnvSpec) -> str:
    """The environment as a Dockerfile (what env_build builds; kept in the task's provenance). A
    spec without pip pins or an install needs no pip, so it starts from the Debian base itself."""
    needs_pip = bool(spec.pip or spec.install)
    lines = [f"FROM python:{spec.python}-{spec.suite}" if needs_pip else f"FROM debian:{spec.suite}"]
    env = dict(spec.env)
    if needs_pip and int(spec.python.split(".")[1]) < 12:
        # A pinned setuptools brings its own copy of distutils, which knows nothing of Debian's layout: a
        # `setup.py develop` would link the package from /usr/lib/python3.X/site-packages, which Debian's
        # Python never reads. Debian's own distutils installs where pip's pins went (/usr/local/.../dist-packages).
        env.setdefault("SETUPTOOLS_USE_DISTUTILS", "stdlib")
    if env:
        lines.append("ENV " + " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())))
    if spec.apt:
        lines.append("RUN apt-get update && apt-get install -y --no-install-recommends "
                     f"{' '.join(map(shlex.quote, spec.apt))} && rm -rf /var/lib/apt/lists/*")
    if spec.pip:
        lines.append(f"RUN python -m pip install --no-cache-dir {' '.join(map(shlex.quote, spec.pip))}")
    lines.append(f"WORKDIR {WORKDIR}")
    if spec.install:
        lines += [f"COPY repo/ {WORKDIR}/", f"RUN {spec.install}"]
    return "\n".join(lines) + "\n"


def build(spec: EnvSpec, tree: str, cache: str, log=print):
    """Build the environment for a repository checked out at `tree` (its install runs on a copy of
    it); returns (env_build.Environment, the Dockerfile text)."""
    from . import env_build
    text = dockerfile(spec)
    context = os.path.dirname(tree)
    if os.path.basename(tree) != "repo":
        raise TaskError(f"{tree}: the build context's repository folder must be named repo/")
    recipe = env_build.parse(text, "SWE-bench environment")
    return env_build.build(recipe, context, cache, log=log), text
