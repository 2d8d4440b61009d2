"""The registry of real-code task sources: pinned, pure-Python projects whose own test suites pass
in a kiln sandbox with nothing beyond pytest.

toolz comes in as a pinned dependency (kiln/tasks/builtin.py copies the installed wheel, which
ships its tests). Every other project comes as its source distribution, fetched ONCE, pinned by
version and sha256, into the sources cache (`$KILN_SOURCES`, else ~/.cache/kiln/sources) by
`kiln tasks sources --fetch` (scripts/setup.sh runs it). Nothing here downloads at run time: a
source whose sdist is not cached is a SourceError that says how to fetch it, and tests that need
one skip with that reason.

Materialising a source writes a small repository: the package (a src/ layout flattened to the
root, so `python -m pytest` at the root imports the copy), its tests, its licence file, and a
pyproject.toml of kiln's own whose pytest section sets testpaths and deselects the few tests that
are slow or timing-dependent (each one named below with the reason). The sdist's own setup files,
tox.ini and pytest options (coverage plugins and the like) are left out.

Each was chosen by trying it: its suite passes in a kiln sandbox, in a second or a few. Tried and
left out: sortedcontainers (its sdist ships no tests), humanize (tests need freezegun), funcy
(tests need `whatever`), python-slugify (needs text-unidecode), jmespath (its sdist's tests do not
import as shipped), wcwidth (a test reads a script the sdist lacks).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field

SOURCES_ENV = "KILN_SOURCES"


class SourceError(RuntimeError):
    """A source that is unknown, not fetched, or whose cached file does not match its pin."""


@dataclass(frozen=True)
class Source:
    name: str  # `--repo builtin:NAME`
    dist: str  # the PyPI project
    version: str
    sdist: str  # the file pip downloads
    sha256: str
    license: str
    copy: dict = field(default_factory=dict)  # path inside the sdist's top folder -> path in the repository
    testpaths: tuple = ()
    deselect: tuple = ()  # test ids left out (slow or timing-dependent), with the reason in a comment
    license_file: str = "LICENSE"
    split: str = "train"  # kiln-bench-v1's split by project

    @property
    def top(self) -> str:
        return self.sdist[:-len(".tar.gz")]


SOURCES: dict[str, Source] = {s.name: s for s in [
    Source("boltons", "boltons", "26.2.0", "boltons-26.2.0.tar.gz",
           "d39cfd15c1a1c3bd4d705c82252fa9edb8e4f5e8cc039f8e39afac7b1b47e92c", "BSD-3-Clause",
           {"boltons": "boltons", "tests": "tests"}, ("tests",), split="train"),
    Source("cachetools", "cachetools", "8.0.2", "cachetools-8.0.2.tar.gz",
           "30ac523adfc118b51d2b2e7bad8a0ddb31370dfe2700c7f10ca224f36ccf81e0", "MIT",
           {"src/cachetools": "cachetools", "tests": "tests"}, ("tests",), split="eval"),
    Source("inflection", "inflection", "0.5.1", "inflection-0.5.1.tar.gz",
           "1a29730d366e996aaacffb2f1f1cb9593dc38e2ddd30c91250c6dde09ea9b417", "MIT",
           # testpaths ".": its tests sit at the root, and so do hidden tests and an agent's new test files
           {"inflection": "inflection", "test_inflection.py": "test_inflection.py"}, (".",),
           split="train"),
    Source("more-itertools", "more-itertools", "11.2.1", "more_itertools-11.2.1.tar.gz",
           "cbf08fd0af284dc69718b9b76a8e6203df624d70209ea511e4219d350c856f63", "MIT",
           {"more_itertools": "more_itertools", "tests": "tests"}, ("tests",),
           deselect=(  # together ~11 of the suite's ~16 s: prime sieves and FFT round trips
                     "tests/test_recipes.py::PrimeFunctionTests::test_primes",
                     "tests/test_recipes.py::PrimeFunctionTests::test_nth_prime_approximate",
                     "tests/test_more.py::DiscreteFourierTransformTests::test_roundtrip",
                     "tests/test_recipes.py::PolynomialFromRootsTests::test_large",
                     # threads racing on purpose: timing-dependent
                     "tests/test_more.py::TestConcurrentTee",
                     "tests/test_more.py::TestSerialize::test_concurrent_calls",
                     "tests/test_more.py::TestSynchronized::test_concurrent_calls"),
           split="train"),
    Source("parse", "parse", "1.22.4", "parse-1.22.4.tar.gz",
           "706d458feed5a81b02768d3156e8070baf6cee7d150a3a3c0cd43101a875c3b5", "MIT",
           {"parse": "parse", "tests": "tests"}, ("tests",), split="eval"),
    Source("semver", "semver", "3.1.2", "semver-3.1.2.tar.gz",
           "bea193552413194252d33ff26ce0962b76669bd1c6fb17e8e203ac37f072feaf", "BSD-3-Clause",
           {"src/semver": "semver", "tests": "tests"}, ("tests",), license_file="LICENSE.txt", split="train"),
    Source("tabulate", "tabulate", "0.8.10", "tabulate-0.8.10.tar.gz",
           "6c57f3f3dd7ac2782770155f3adb2db0b1a269637e42f27599925e64b114f519", "MIT",
           {"tabulate.py": "tabulate.py", "test": "test"}, ("test",), split="eval"),
]}
BUILTIN = ("toolz", *SOURCES)  # every NAME of `--repo builtin:NAME`
TOOLZ_SPLIT = "train"

PYPROJECT = """\
# A repository materialized by kiln from the {dist} {version} source distribution (sha256 {sha256}),
# licensed {license} (see {license_file}); see kiln/tasks/sources.py. `python -m pytest` at this
# root puts the root first on sys.path, so the copy here is what the tests import.
[project]
name = "{dist}"
version = "{version}"

[tool.pytest.ini_options]
testpaths = [{testpaths}]
{addopts}"""


def cache_dir() -> str:
    return os.path.abspath(os.path.expanduser(os.environ.get(SOURCES_ENV) or "~/.cache/kiln/sources"))


def get(name: str) -> Source:
    if name not in SOURCES:
        raise SourceError(f"builtin:{name}: unknown source; known: {', '.join(BUILTIN)}")
    return SOURCES[name]


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cached(name: str) -> str | None:
    """The cached sdist of a source when present and matching its pin, else None."""
    s = get(name)
    path = os.path.join(cache_dir(), s.sdist)
    return path if os.path.isfile(path) and sha256_of(path) == s.sha256 else None


def missing_reason(name: str) -> str | None:
    """Why a source cannot be materialised here (None: it can): for tests' skip messages."""
    if name == "toolz" or cached(name):
        return None
    return (f"the {name} source is not in the sources cache {cache_dir()} "
            f"(run `kiln tasks sources --fetch`, or scripts/setup.sh)")


def fetch(names: list[str] | None = None, log=print) -> list[str]:
    """Download the pinned sdists that the cache lacks (pip, by name and version, no dependencies,
    the hash checked before the file is kept). Returns the names fetched; raises SourceError for
    one that cannot be had or does not match its pin."""
    root = cache_dir()
    os.makedirs(root, exist_ok=True)
    got = []
    for name in names or list(SOURCES):
        s = get(name)
        if cached(name):
            continue
        with tempfile.TemporaryDirectory(prefix="kiln-fetch-", dir=root) as tmp:
            log(f"fetching {s.dist}=={s.version}")
            r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                                f"{s.dist}=={s.version}", "-d", tmp], capture_output=True, text=True)
            path = os.path.join(tmp, s.sdist)
            if r.returncode or not os.path.isfile(path):
                raise SourceError(f"{s.dist}=={s.version}: pip download failed:\n{(r.stderr or r.stdout)[-1500:]}")
            if sha256_of(path) != s.sha256:
                raise SourceError(f"{s.sdist}: sha256 {sha256_of(path)} is not the pinned {s.sha256}")
            os.replace(path, os.path.join(root, s.sdist))
        got.append(name)
    return got


def materialize(name: str, dest: str) -> str:
    """Write the source's repository into `dest` (absent or empty); returns `dest`."""
    if name == "toolz":
        from .builtin import materialize_toolz
        return materialize_toolz(dest)
    s = get(name)
    path = cached(name)
    if path is None:
        raise SourceError(missing_reason(name))
    if os.path.isdir(dest) and os.listdir(dest):
        raise FileExistsError(f"{dest}: not empty (materialize writes a fresh repository)")
    os.makedirs(dest, exist_ok=True)
    wanted = {**s.copy, s.license_file: "LICENSE"}
    with tarfile.open(path, "r:gz") as tar:
        for m in sorted(tar.getmembers(), key=lambda m: m.name):
            if not m.isfile():
                continue
            rel = m.name.split("/", 1)[1] if "/" in m.name else ""
            if "__pycache__" in rel or rel.endswith((".pyc", ".pyo")):
                continue
            for src, dst in wanted.items():
                if rel == src or rel.startswith(src + "/"):
                    out = os.path.join(dest, dst + rel[len(src):])
                    os.makedirs(os.path.dirname(out), exist_ok=True)
                    with tar.extractfile(m) as f, open(out, "wb") as o:
                        shutil.copyfileobj(f, o)
                    break
    addopts = ""
    if s.deselect:
        addopts = "addopts = [\n" + "".join(f'    "--deselect={d}",\n' for d in s.deselect) + "]\n"
    with open(os.path.join(dest, "pyproject.toml"), "w", encoding="utf-8") as f:
        f.write(PYPROJECT.format(dist=s.dist, version=s.version, sha256=s.sha256, license=s.license,
                                 license_file="LICENSE", testpaths=", ".join(f'"{t}"' for t in s.testpaths),
                                 addopts=addopts))
    return dest


def describe(name: str, count_tests: bool = True) -> dict:
    """Files, lines and test count of a source (tests counted by pytest's collection, on the host)."""
    from .gen import python_files
    with tempfile.TemporaryDirectory(prefix="kiln-src-") as tmp:
        repo = materialize(name, os.path.join(tmp, "repo"))
        src, tests = python_files(repo)

        def lines(paths):
            return sum(open(os.path.join(repo, p), "rb").read().count(b"\n") for p in paths)
        info = {"name": name, "version": version(name), "license": license_of(name),
                "split": split_of(name), "source_files": len(src), "source_lines": lines(src),
                "test_files": len(tests), "test_lines": lines(tests), "tests": None}
        if count_tests:
            env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONDONTWRITEBYTECODE": "1"}
            r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                               cwd=repo, env=env, capture_output=True, text=True, timeout=300)
            info["tests"] = sum(1 for ln in r.stdout.splitlines() if "::" in ln)
    return info


def version(name: str) -> str:
    if name == "toolz":
        from .builtin import toolz_version
        return toolz_version()
    return get(name).version


def license_of(name: str) -> str:
    return "BSD-3-Clause" if name == "toolz" else get(name).license


def split_of(name: str) -> str:
    return TOOLZ_SPLIT if name == "toolz" else get(name).split
